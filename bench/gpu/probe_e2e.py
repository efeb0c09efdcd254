#!/usr/bin/env python3
"""The vLLM connector's GPU path end to end: the engine's side of ringside
(connector/python: ringside.plugin.region, ringside.plugin.cudaipc,
ringside.client) against a real `ringside serve --copy.backend=cuda`.

One `torch.zeros` buffer (int8) is viewed as vLLM 0.32 to 0.34 view their
one KV cache buffer (create_kv_cache_views: per-layer [blocks, heads,
tokens, K and V] views through strides over [L, B, H, N, C]), in the layout
vLLM picks by default (LBNHC) and in the block-outermost one the connector
asks for on CUDA (BLNHC); `from_block_tensors` describes it with the
engine's block count, the worker's ctypes driver exports it (CUDA IPC, the
store event), and the sidecar imports it. One line per probe,
`PROBE <name>: <verdict> (<details>)`:

  e2e-lbnhc, e2e-blnhc  fill the buffer, record the store event on torch's
                        current stream (the legacy default stream, 0),
                        store 64 blocks, overwrite them on the GPU, load
                        them back, compare every byte of the buffer (the
                        other blocks must be untouched); times of a store
                        and a load of the 64 blocks (median of 5), and for
                        BLNHC the ratio to LBNHC's
  e2e-delayed-record    the event recorded behind a GPU sleep (200 ms,
                        torch.cuda._sleep) and a kernel that writes the 64
                        blocks after it; the store is sent at once: it must
                        answer only after the sleep, with the bytes written
                        after it (loaded into 64 other blocks, compared)

Without CUDA torch it prints `PROBE e2e: skipped (...)` and exits 0. With
--stand-in HOLD (run.sh dry) it runs against the stand-in driver
(gpu/gputest/testdata/fakecuda.c on LD_LIBRARY_PATH) without torch: the
buffer is the stand-in's device memory (cuMemAlloc, mapped in this
process), viewed through duck-typed views with the same shapes and
strides, written with ctypes; the GPU sleep is the stand-in's
FAKECUDA_EVENT_HOLD (the record stays incomplete while the file HOLD
exists), removed after the delay, once the blocks are written. The exit
status is 1 only when a probe itself broke (verdict `error`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import threading
import time
import traceback
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "connector", "python"))
sys.path.insert(0, HERE)

REGION = 1
STORED = 64  # blocks stored and loaded a probe
# [L, B, H, N, C] stride orders (vllm/v1/kv_cache_layout.py, KVCacheLayout).
LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "BLNHC": (1, 0, 3, 2, 4)}


def verdict(name: str, v: str, details: str) -> None:
    print(f"PROBE {name}: {v} ({details})", flush=True)


class Geometry:
    """A Llama-8B-like shard on a GPU (32 layers, 8 KV heads of 128, bf16,
    16-token blocks: 2 MiB pages), 4 layers against the stand-in."""

    def __init__(self, layers: int, blocks: int = 2 * STORED, heads: int = 8, tokens: int = 16, head: int = 128):
        self.L, self.B, self.H, self.N = layers, blocks, heads, tokens
        self.C = 2 * head * 2  # bytes: K and V of a token and head, 2-byte elements
        self.layer_page = heads * tokens * self.C
        self.page = layers * self.layer_page
        self.bytes = blocks * self.page

    def strides(self, layout: str) -> list[int]:
        """Byte strides over [L, B, H, N, C] (vLLM's compute_layout_strides)."""
        shape = (self.L, self.B, self.H, self.N, self.C)
        st, cur = [0] * 5, 1
        for dim in reversed(LAYOUTS[layout]):
            st[dim] = cur
            cur *= shape[dim]
        return st

    def block_at(self, layout: str, layer: int, block: int) -> int:
        """Byte offset of a layer's block ([H, N, C] contiguous in both layouts)."""
        st = self.strides(layout)
        return layer * st[0] + block * st[1]


class View:
    """A duck-typed 2-byte-element view (what from_block_tensors reads)."""

    def __init__(self, ptr: int, shape, stride):
        self.ptr, self.shape, self._stride = ptr, tuple(shape), tuple(stride)
        self.device = SimpleNamespace(type="cuda", index=0)

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self):
        return self._stride

    def element_size(self) -> int:
        return 2


def layer_names(g: Geometry) -> list[str]:
    return ["model.layers.%d.self_attn.attn" % i for i in range(g.L)]


class Torch:
    """The buffer in GPU memory through torch (a GPU run)."""

    def __init__(self, g: Geometry):
        import torch

        self.torch, self.g = torch, g
        self.buf = torch.zeros(g.bytes, dtype=torch.int8, device="cuda")
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1)
        self.gen = gen

    def views(self, layout: str) -> dict:
        t, g = self.torch, self.g
        st = g.strides(layout)
        out = {}
        for i, name in enumerate(layer_names(g)):
            v = t.as_strided(self.buf, (g.B, g.H, g.N, g.C), (st[1], st[2], st[3], 1), i * st[0])
            out[name] = v.view(t.bfloat16)
        return out

    def randomize(self) -> None:
        self.buf.copy_(
            self.torch.randint(-128, 128, (self.g.bytes,), dtype=self.torch.int8, device="cuda", generator=self.gen)
        )
        self.torch.cuda.synchronize()

    def snapshot(self):
        s = self.buf.clone()
        self.torch.cuda.synchronize()
        return s

    def same(self, snap) -> bool:
        return bool(self.torch.equal(self.buf, snap))

    def blocks(self, layout: str, blocks):
        """The layers' [H, N, C] slices of blocks, as int8 tensors."""
        g = self.g
        return [
            self.buf[g.block_at(layout, li, b) : g.block_at(layout, li, b) + g.layer_page]
            for b in blocks
            for li in range(g.L)
        ]

    def zero(self, layout: str, blocks) -> None:
        for s in self.blocks(layout, blocks):
            s.zero_()
        self.torch.cuda.synchronize()  # a load is not ordered after the engine's stream

    def prepare(self, layout: str, blocks, delay: float):
        """New bytes for blocks, and the sleep's length in GPU cycles."""
        t = self.torch
        new = [
            t.randint(-128, 128, (self.g.layer_page,), dtype=t.int8, device="cuda", generator=self.gen)
            for _ in self.blocks(layout, blocks)
        ]
        cycles = self.cycles(delay)
        t.cuda.synchronize()
        return new, cycles

    def delayed_write(self, layout: str, blocks, prepared) -> None:
        """On torch's current stream: a sleep, then a write of the new bytes
        into blocks."""
        new, cycles = prepared
        self.torch.cuda._sleep(cycles)
        for s, n in zip(self.blocks(layout, blocks), new):
            s.copy_(n)

    def cycles(self, delay: float) -> int:
        """GPU clock cycles torch.cuda._sleep spins for delay seconds (measured)."""
        t = self.torch
        a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        n = 20_000_000
        a.record()
        t.cuda._sleep(n)
        b.record()
        b.synchronize()
        per_ms = n / max(a.elapsed_time(b), 1e-3)
        return int(per_ms * delay * 1000)

    def holds(self, layout: str, blocks, want) -> bool:
        t = self.torch
        ok = all(bool(t.equal(s, w)) for s, w in zip(self.blocks(layout, blocks), want))
        t.cuda.synchronize()
        return ok

    def close(self) -> None:
        del self.buf


class StandIn:
    """The buffer in the stand-in driver's device memory (run.sh dry)."""

    def __init__(self, g: Geometry, hold: str):
        import cudrv

        self.drv = cudrv.Driver()  # the primary context, current on this thread
        self.g, self.hold = g, hold
        self.ptr = self.drv.alloc(g.bytes)
        self.rng = random.Random(1)

    def views(self, layout: str) -> dict:
        g = self.g
        st = g.strides(layout)
        return {
            name: View(self.ptr + i * st[0], (g.B, g.H, g.N, g.C // 2), (st[1] // 2, st[2] // 2, st[3] // 2, 1))
            for i, name in enumerate(layer_names(g))
        }

    def randomize(self) -> None:
        step = 16 << 20
        for off in range(0, self.g.bytes, step):
            n = min(step, self.g.bytes - off)
            ctypes.memmove(self.ptr + off, self.rng.randbytes(n), n)

    def snapshot(self) -> bytes:
        return ctypes.string_at(self.ptr, self.g.bytes)

    def same(self, snap: bytes) -> bool:
        return ctypes.string_at(self.ptr, self.g.bytes) == snap

    def _each(self, layout: str, blocks):
        g = self.g
        for b in blocks:
            for li in range(g.L):
                yield self.ptr + g.block_at(layout, li, b)

    def zero(self, layout: str, blocks) -> None:
        for p in self._each(layout, blocks):
            ctypes.memset(p, 0, self.g.layer_page)

    def prepare(self, layout: str, blocks, delay: float):
        return [self.rng.randbytes(self.g.layer_page) for _ in self._each(layout, blocks)], delay

    def delayed_write(self, layout: str, blocks, prepared) -> None:
        """The stand-in's GPU sleep: records stay incomplete while the hold
        file exists; after the delay the blocks get the new bytes (the
        kernel behind the sleep) and the hold goes (the record completes)."""
        new, delay = prepared
        open(self.hold, "wb").close()
        os.environ["FAKECUDA_EVENT_HOLD"] = self.hold  # read by the stand-in at cuEventRecord

        def later():
            time.sleep(delay)
            for p, n in zip(self._each(layout, blocks), new):
                ctypes.memmove(p, n, len(n))
            os.unlink(self.hold)

        self.thread = threading.Thread(target=later, daemon=True)
        self.thread.start()

    def holds(self, layout: str, blocks, want) -> bool:
        return all(ctypes.string_at(p, len(w)) == w for p, w in zip(self._each(layout, blocks), want))

    def close(self) -> None:
        os.environ.pop("FAKECUDA_EVENT_HOLD", None)
        self.drv.call("cuMemFree", self.ptr)


def digests(tag: int, n: int) -> bytes:
    return b"".join(bytes([tag, i & 0xFF, i >> 8]) + bytes(29) for i in range(n))


def round_trip(s, mem, region, layout: str, tag: int, reps: int) -> tuple[bool, float, float]:
    """Store blocks 0..63, overwrite them, load them back: (the whole buffer
    byte-exact, median store seconds, median load seconds)."""
    from ringside import schema as S

    src = list(range(STORED))
    stores, loads = [], []
    ok = True
    for rep in range(reps):
        mem.randomize()
        snap = mem.snapshot()
        batch = tag * 100 + rep
        assert s.put_hashes(batch, digests(batch, STORED)) == STORED
        region.event.record()  # torch's current stream (the legacy default stream, 0)
        t0 = time.perf_counter()
        rep_ = s.store(batch, 0, STORED, REGION, src)
        stores.append(time.perf_counter() - t0)
        if rep_.status != S.Status.OK or rep_.stored + rep_.present != STORED:
            raise RuntimeError("store: %s" % (rep_,))
        lease = s.acquire(batch, 0, STORED)
        if lease.blocks != STORED:
            raise RuntimeError("acquire: %s" % (lease,))
        mem.zero(layout, src)
        t0 = time.perf_counter()
        n = s.load(lease.lease, REGION, 0, src)
        loads.append(time.perf_counter() - t0)
        s.release(lease.lease)
        if n != STORED:
            raise RuntimeError("load: %d of %d blocks" % (n, STORED))
        ok = ok and mem.same(snap)
    return ok, statistics.median(stores), statistics.median(loads)


def delayed(s, mem, region, layout: str, delay: float) -> tuple[str, str]:
    from ringside import schema as S

    src, dst = list(range(STORED)), list(range(STORED, 2 * STORED))
    mem.randomize()
    batch = 9000
    assert s.put_hashes(batch, digests(90, STORED)) == STORED
    prepared = mem.prepare(layout, src, delay)
    new = prepared[0]
    t0 = time.perf_counter()
    mem.delayed_write(layout, src, prepared)
    region.event.record()  # behind the sleep and the write
    seq = s.submit(S.TYPE_STORE, S.encode_store(batch, 0, STORED, REGION, src))
    sent = time.perf_counter() - t0
    rep = S.decode_store_reply(s.await_reply(seq, timeout=delay + 30))
    took = time.perf_counter() - t0
    if rep.status != S.Status.OK:
        return "the store failed", "status %d: %s" % (rep.status, rep.message)
    lease = s.acquire(batch, 0, STORED)
    n = s.load(lease.lease, REGION, 0, dst)
    s.release(lease.lease)
    got = mem.holds(layout, dst, new)
    d = (
        "record behind a %.0f ms sleep: recording and sending took %.2f ms; "
        "the store answered after %.0f ms; %d blocks loaded"
        % (
            delay * 1000,
            sent * 1000,
            took * 1000,
            n,
        )
    )
    if got and took >= 0.75 * delay:
        return "the store waited", d + ", holding the bytes written after the sleep"
    if not got:
        return "the store did not wait", d + ", not holding the bytes written after the sleep"
    return "the store answered early", d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bin", default=os.path.join(os.environ.get("RINGSIDE_GPU_BIN", os.path.join(REPO, "bin")), "ringside")
    )
    ap.add_argument(
        "--stand-in", metavar="HOLD", help="run against the stand-in driver (run.sh dry), HOLD its hold file"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--delay-ms", type=float, default=200.0)
    ap.add_argument("--layers", type=int, help="layers of the model (default: 32 on a GPU, 4 against the stand-in)")
    a = ap.parse_args()
    if a.stand_in:
        g = Geometry(layers=a.layers or 4)
        what = "stand-in driver"
    else:
        try:
            import torch
        except ImportError:
            verdict("e2e", "skipped", "no CUDA torch: torch is not installed")
            return 0
        if not torch.cuda.is_available():
            verdict("e2e", "skipped", f"no CUDA torch: torch {torch.__version__}, torch.cuda.is_available() is False")
            return 0
        g = Geometry(layers=a.layers or 32)
        what = f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}"
    if not os.access(a.bin, os.X_OK):
        verdict("e2e", "skipped", f"no sidecar binary at {a.bin}")
        return 0
    from ringside.plugin.region import from_block_tensors
    from ringside.sidecar_process import SidecarProcess

    print(
        f"{what}; {g.L} layers, pages of {g.page} B, {g.B} blocks ({g.bytes >> 20} MiB); pid {os.getpid()}", flush=True
    )
    broke = False
    mem = StandIn(g, a.stand_in) if a.stand_in else Torch(g)
    slot = "%dKiB" % (g.page >> 10)
    sc = SidecarProcess(a.bin, pool="%dMiB" % ((3 * STORED * g.page) >> 20), slot=slot, args=["--copy.backend=cuda"])
    times: dict[str, tuple[float, float]] = {}
    try:
        for tag, layout in enumerate(LAYOUTS, 1):
            name = "e2e-" + layout.lower()
            try:
                region = from_block_tensors(mem.views(layout), g.B)
                s = sc.attach(instance="probe-e2e-%s" % layout, model="probe", layout=layout, timeout=30.0)
                region.register(s, REGION)
                ok, st, ld = round_trip(s, mem, region, layout, tag, a.reps)
                times[layout] = (st, ld)
                gbs = STORED * g.page / 1e9
                d = "%d blocks of %d B, segments a page: %d; store %.2f ms, load %.2f ms: %.1f / %.1f GB/s" % (
                    STORED,
                    g.page,
                    len(region.page_segments()),
                    st * 1000,
                    ld * 1000,
                    gbs / st,
                    gbs / ld,
                )
                if layout != "LBNHC" and "LBNHC" in times:
                    b = times["LBNHC"]
                    d += "; %.2fx LBNHC's store time, %.2fx its load time" % (st / b[0], ld / b[1])
                verdict(name, "round trip byte-exact" if ok else "bytes differ", d)
                if layout == "BLNHC":
                    try:
                        v, d = delayed(s, mem, region, layout, a.delay_ms / 1000.0)
                        verdict("e2e-delayed-record", v, d)
                    except Exception as e:  # noqa: BLE001 (a bug in the probe: reported, the rest runs)
                        broke = True
                        verdict("e2e-delayed-record", "error", f"{type(e).__name__}: {e}")
                        traceback.print_exc()
                s.close()
                if region.event is not None:
                    region.event.close()
            except Exception as e:  # noqa: BLE001
                broke = True
                verdict(name, "error", f"{type(e).__name__}: {e}")
                traceback.print_exc()
    finally:
        try:
            sc.stop(check=False)
        finally:
            mem.close()
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())
