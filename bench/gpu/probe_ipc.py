#!/usr/bin/env python3
"""What the CUDA driver does with IPC between two processes, as ringside uses it.

A child process (this script with --child) allocates device memory and
exports it; this process imports it, as the sidecar imports an engine's KV
memory. One line per probe, `PROBE <name>: <verdict> (<details>)`:

  ipc-range           cuMemGetAddressRange on the imported pointer of a
                      1 MiB + 4 KiB allocation: the exact size, or rounded
                      up to the allocation granularity
  ipc-corrupt-handle  a handle with bytes 0-1 flipped: does the open fail,
                      with which code
  vmm-export          memory from cuMemCreate + cuMemMap (what PyTorch's
                      expandable segments use): does cuIpcGetMemHandle
                      refuse it
  ipc-event           the child records an interprocess event after a long
                      chain of copies; this process waits on it with
                      cuStreamWaitEvent before its own copy: is the copy
                      held back, does it see the chain's last write
  exporter-death      D2H copies of a large imported allocation queued, the
                      child SIGKILLed meanwhile: which errors come back, is
                      this process's context poisoned (a sticky error)

Only the driver API through ctypes (cudrv.py): no toolkit, no torch. A call
the driver lacks makes its probe `unsupported by this driver (<name>
missing)`; a call the driver or the sandbox refuses is that probe's verdict.
The exit status is 1 only when a probe itself broke (verdict `error`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cudrv  # noqa: E402
from cudrv import CudaError, Missing  # noqa: E402

PROBES = ["ipc-range", "ipc-corrupt-handle", "vmm-export", "ipc-event", "exporter-death"]
MIB = 1 << 20


def verdict(name: str, v: str, details: str) -> None:
    print(f"PROBE {name}: {v} ({details})", flush=True)


# ---------------------------------------------------------------- child


class ChildState:
    def __init__(self) -> None:
        self.drv = cudrv.Driver()
        self.allocs: list[int] = []
        self.buffers: list[cudrv.PinnedBuffer] = []
        self.vmm: list[tuple[int, int, int]] = []
        self.stream = 0
        self.event = ctypes.c_void_p()
        self.event_mem = 0
        self.event_bytes = 0

    def op_init(self, _m: dict) -> dict:
        return {"pid": os.getpid(), "uuid": self.drv.uuid().hex(), "name": self.drv.name()}

    def op_alloc(self, m: dict) -> dict:
        n = int(m["bytes"])
        p = self.drv.alloc(n)
        self.allocs.append(p)
        if "fill" in m:
            k = min(n, MIB)
            src = (ctypes.c_ubyte * k)(*([int(m["fill"])] * k))
            self.drv.call("cuMemcpyHtoD", p, src, k)
        return {"handle": self.drv.ipc_handle(p).hex()}

    def op_vmm(self, _m: dict) -> dict:
        d = self.drv
        gran = d.granularity()
        prop = d.vmm_prop()
        h = ctypes.c_ulonglong()
        d.call("cuMemCreate", ctypes.byref(h), gran, ctypes.byref(prop), 0)
        ptr = cudrv.CUdeviceptr()
        d.call("cuMemAddressReserve", ctypes.byref(ptr), gran, 0, 0, 0)
        d.call("cuMemMap", ptr.value, gran, 0, h.value, 0)
        acc = cudrv.MemAccessDesc()
        acc.location.type, acc.location.id = cudrv.CU_MEM_LOCATION_TYPE_DEVICE, d.device
        acc.flags = cudrv.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        d.call("cuMemSetAccess", ptr.value, gran, ctypes.byref(acc), 1)
        self.vmm.append((ptr.value, gran, h.value))
        ih = cudrv.IpcHandle()
        r = d.try_call("cuIpcGetMemHandle", ctypes.byref(ih), ptr.value)
        out = {"granularity": gran, "export": r, "export_name": d.describe(r)}
        if r == 0:
            out["handle"] = bytes(ih.reserved).hex()
        return out

    def op_event_prepare(self, m: dict) -> dict:
        d = self.drv
        n = int(m["bytes"])
        d.call("cuEventCreate", ctypes.byref(self.event), cudrv.CU_EVENT_INTERPROCESS | cudrv.CU_EVENT_DISABLE_TIMING)
        eh = cudrv.IpcHandle()
        d.call("cuIpcGetEventHandle", ctypes.byref(eh), self.event)
        self.event_mem = d.alloc(n)
        self.allocs.append(self.event_mem)
        self.event_bytes = n
        self.stream = d.stream()
        zero, mark = cudrv.PinnedBuffer(d, n), cudrv.PinnedBuffer(d, n)
        zero.fill(0)
        mark.fill(0xAB)
        self.buffers += [zero, mark]
        return {"event": bytes(eh.reserved).hex(), "mem": d.ipc_handle(self.event_mem).hex()}

    def op_event_go(self, m: dict) -> dict:
        d = self.drv
        zero, mark = self.buffers[-2], self.buffers[-1]
        for _ in range(int(m["reps"])):
            d.call("cuMemcpyHtoDAsync", self.event_mem, ctypes.c_void_p(zero.ptr), self.event_bytes, self.stream)
        d.call("cuMemcpyHtoDAsync", self.event_mem, ctypes.c_void_p(mark.ptr), self.event_bytes, self.stream)
        d.call("cuEventRecord", self.event, self.stream)
        q = d.try_call("cuEventQuery", self.event)
        return {"pending": q == cudrv.CUDA_ERROR_NOT_READY, "query": d.describe(q)}

    def close(self) -> None:
        d = self.drv
        if self.stream:
            d.opt("cuStreamSynchronize", self.stream)
        if self.event:
            d.opt("cuEventDestroy", self.event)
        for b in self.buffers:
            b.close()
        for ptr, n, h in self.vmm:
            d.opt("cuMemUnmap", ptr, n)
            d.opt("cuMemAddressFree", ptr, n)
            d.opt("cuMemRelease", h)
        for p in self.allocs:
            d.opt("cuMemFree", p)


def child_main() -> int:
    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        st = ChildState()
    except Missing as e:
        reply({"missing": e.name})
        return 0
    except (CudaError, OSError) as e:
        reply({"error": str(e), "code": getattr(e, "code", -1)})
        return 0
    for line in sys.stdin:
        m = json.loads(line)
        if m["op"] == "exit":
            st.close()
            reply({"bye": True})
            return 0
        try:
            reply(getattr(st, "op_" + m["op"])(m))
        except Missing as e:
            reply({"missing": e.name})
        except CudaError as e:
            reply({"error": str(e), "code": e.code})
    return 0


# ---------------------------------------------------------------- parent


class Unsupported(Exception):
    """The probe cannot run: `what` is its verdict's detail."""

    def __init__(self, verdict: str, details: str):
        super().__init__(details)
        self.verdict, self.details = verdict, details


class Child:
    """This script run with --child, spoken to in JSON lines."""

    def __init__(self, timeout: float, env: dict | None = None):
        self.timeout = timeout
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child"],
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.ask("init")

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, op: str, **kw) -> dict:
        """The child's reply to op; raises Unsupported for missing calls
        and refusals, so that they become the probe's verdict."""
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            raise Unsupported("failed", f"the child gave no answer to {op} within {self.timeout:.0f} s") from None
        if line is None:
            raise Unsupported("failed", f"the child exited ({self.p.wait()}) during {op}")
        m = json.loads(line)
        if "missing" in m:
            raise Unsupported("unsupported by this driver", f"{m['missing']} missing")
        if "error" in m:
            raise Unsupported("refused", f"child {op}: {m['error']}")
        return m

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.ask("exit")
            except (Unsupported, OSError):
                pass
        if self.p.poll() is None:
            try:
                self.p.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()

    def kill(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait()


def open_or_refuse(drv: cudrv.Driver, handle: bytes) -> int:
    r, p = drv.ipc_open(handle)
    if r != 0:
        raise Unsupported("refused", f"cuIpcOpenMemHandle of the child's allocation: {drv.describe(r)}")
    return p


def stand_in_cleanup(handle: bytes) -> None:
    """The stand-in driver keeps "device memory" in /dev/shm files named in
    its handles; a SIGKILLed exporter leaves its files behind, and so does
    a cuMemFree that a sticky error refuses."""
    if handle[:4] == b"FAKE":
        name = handle[4:].split(b"\0", 1)[0].decode(errors="replace")
        if name.startswith("/fakecuda-") and "/" not in name[1:]:
            try:
                os.unlink("/dev/shm" + name)
            except OSError:
                pass


def probe_range(drv: cudrv.Driver, child: Child, args, st: dict) -> None:
    n = args.range_bytes
    h = bytes.fromhex(child.ask("alloc", bytes=n)["handle"])
    st["handle"] = h
    p = open_or_refuse(drv, h)
    try:
        base, size = drv.address_range(p)
    finally:
        drv.opt("cuIpcCloseMemHandle", p)
    try:
        gran = drv.granularity()
    except (Missing, CudaError):
        gran = 0
    where = "base = imported pointer" if base == p else f"base {base:#x} != imported pointer {p:#x}"
    d = f"asked {n} B, range {size} B, {where}, VMM granularity {gran or 'unknown'}"
    if size == n:
        verdict("ipc-range", "exact", d)
    elif size > n and gran and size % gran == 0:
        verdict("ipc-range", f"rounded up to the granularity ({size - n} B more)", d)
    elif size > n:
        mult = size & -size
        verdict("ipc-range", f"rounded up to a multiple of {mult} B ({size - n} B more)", d)
    else:
        verdict("ipc-range", "smaller than the allocation", d)


def probe_bad_handle(drv: cudrv.Driver, child: Child, args, st: dict) -> None:
    h = st.get("handle")
    if h is None:
        h = bytes.fromhex(child.ask("alloc", bytes=args.range_bytes)["handle"])
    bad = bytes([h[0] ^ 0xFF, h[1] ^ 0xFF]) + h[2:]
    r, p = drv.ipc_open(bad)
    if r == 0:
        drv.opt("cuIpcCloseMemHandle", p)
        verdict("ipc-corrupt-handle", "opens", "cuIpcOpenMemHandle of a handle with bytes 0-1 flipped succeeded")
    else:
        d = "cuIpcOpenMemHandle of a handle with bytes 0-1 flipped"
        verdict("ipc-corrupt-handle", f"open fails with {drv.describe(r)}", d)


def probe_vmm(drv: cudrv.Driver, child: Child, _args, _st: dict) -> None:
    m = child.ask("vmm")
    d = f"cuMemCreate + cuMemMap of {m['granularity']} B (one granule), cuIpcGetMemHandle: {m['export_name']}"
    if m["export"] != 0:
        verdict("vmm-export", f"export fails with {m['export_name']}", d)
        return
    r, p = drv.ipc_open(bytes.fromhex(m["handle"]))
    if r == 0:
        drv.opt("cuIpcCloseMemHandle", p)
    verdict("vmm-export", "export succeeds", f"{d}; the importer's cuIpcOpenMemHandle: {drv.describe(r)}")


def probe_event(drv: cudrv.Driver, child: Child, args, _st: dict) -> None:
    for name in ("cuIpcOpenEventHandle", "cuStreamWaitEvent", "cuEventQuery"):
        if not drv.has(name):
            raise Unsupported("unsupported by this driver", f"{name} missing")
    n = args.event_bytes
    m = child.ask("event_prepare", bytes=n)
    mem = open_or_refuse(drv, bytes.fromhex(m["mem"]))
    host = cudrv.PinnedBuffer(drv, n)
    try:
        host.fill(0x11)
        eh = cudrv.IpcHandle()
        ctypes.memmove(ctypes.byref(eh), bytes.fromhex(m["event"]), 64)
        ev = ctypes.c_void_p()
        r = drv.try_call("cuIpcOpenEventHandle", ctypes.byref(ev), eh)
        if r != 0:
            raise Unsupported("refused", f"cuIpcOpenEventHandle: {drv.describe(r)}")
        s = drv.stream()
        if args.stand_in_hold:
            open(args.stand_in_hold, "w").close()
        go = child.ask("event_go", reps=args.event_reps)
        q = drv.try_call("cuEventQuery", ev)
        t0 = time.monotonic()
        drv.call("cuStreamWaitEvent", s, ev, 0)
        drv.call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, n, s)
        held = host.all_equal(0x11, min(n, 4096))
        if args.stand_in_hold:
            os.unlink(args.stand_in_hold)
        drv.call("cuStreamSynchronize", s)
        took = time.monotonic() - t0
        seen = host.all_equal(0xAB, n)
        pending = q == cudrv.CUDA_ERROR_NOT_READY
        d = (
            f"{args.event_reps} H2D copies of {n} B then the marker, recorded in the child; "
            f"event pending in the child after the record: {go['pending']}, here before the wait: {pending} "
            f"({drv.describe(q)}); this process's copy held back after it was queued: {held}; "
            f"wait + copy took {took * 1e3:.1f} ms"
        )
        if not seen:
            verdict("ipc-event", "the copy did not wait: it saw data from before the marker", d)
        elif held or pending:
            verdict("ipc-event", "the copy follows the event", d)
        else:
            verdict("ipc-event", "inconclusive: the event had completed before the wait", d)
        drv.opt("cuStreamDestroy", s)
        drv.opt("cuEventDestroy", ev)
    finally:
        host.close()
        drv.opt("cuIpcCloseMemHandle", mem)


def probe_death(drv: cudrv.Driver, child: Child, args, _st: dict) -> None:
    n, copies = args.death_bytes, args.death_copies
    for name in ("cuMemcpyDtoHAsync", "cuStreamSynchronize"):
        if not drv.has(name):
            raise Unsupported("unsupported by this driver", f"{name} missing")
    h = own_handle = b""
    h = bytes.fromhex(child.ask("alloc", bytes=n, fill=0x5A)["handle"])
    try:
        mem = open_or_refuse(drv, h)
        host = cudrv.PinnedBuffer(drv, n)
        own = drv.alloc(MIB)
        own_handle = drv.ipc_handle(own)  # only to clean up after the stand-in
        s = drv.stream()
        codes: dict[str, int] = {}
        for i in range(copies):
            r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, n, s)
            if r:
                codes[f"queue copy {i}"] = r
                break
        q = drv.opt("cuStreamQuery", s)
        t0 = time.monotonic()
        child.kill()
        killed_after = time.monotonic() - t0
        codes["sync after the kill"] = drv.try_call("cuStreamSynchronize", s)
        r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), own, MIB, s)
        codes["copy of an own buffer"] = r or drv.try_call("cuStreamSynchronize", s)
        host.fill(0)
        r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, MIB, s)
        codes["copy of the import after the death"] = r or drv.try_call("cuStreamSynchronize", s)
        readable = codes["copy of the import after the death"] == 0 and host.all_equal(0x5A, MIB)
        codes["cuIpcCloseMemHandle"] = drv.try_call("cuIpcCloseMemHandle", mem)
        if (r := drv.opt("cuCtxSynchronize")) is not None:
            codes["cuCtxSynchronize"] = r
        drv.opt("cuMemFree", own)
        drv.opt("cuStreamDestroy", s)
        host.close()
        busy = "unknown" if q is None else "still busy" if q == cudrv.CUDA_ERROR_NOT_READY else "already idle"
        errors = {k: v for k, v in codes.items() if v}
        sticky = sorted({v for v in errors.values() if v in cudrv.STICKY})
        d = (
            f"{copies} D2H copies of {n} B queued, stream at the kill: {busy} ({drv.describe(q)}), "
            f"child reaped in {killed_after * 1e3:.0f} ms; "
            + "; ".join(f"{k}: {drv.describe(v)}" for k, v in codes.items())
            + f"; imported data still readable after the death: {readable}"
        )
        if sticky:
            verdict("exporter-death", f"context poisoned (sticky {', '.join(drv.describe(c) for c in sticky)})", d)
        elif errors:
            verdict("exporter-death", "errors, context still usable", d)
        else:
            verdict("exporter-death", "no error", d)
    finally:
        stand_in_cleanup(h)
        stand_in_cleanup(own_handle)


def parent_main(args) -> int:
    try:
        drv = cudrv.Driver()
    except OSError as e:
        for p in PROBES:
            verdict(p, "skipped", f"no driver: {e}")
        return 0
    except Missing as e:
        for p in PROBES:
            verdict(p, "unsupported by this driver", f"{e.name} missing")
        return 0
    except CudaError as e:
        for p in PROBES:
            verdict(p, "skipped", f"no usable GPU: {e}")
        return 0
    print(f"driver {drv.version}, device 0: {drv.name()} (uuid {drv.uuid().hex()}), pid {os.getpid()}", flush=True)
    broke = False
    state: dict = {}
    child = None
    try:
        for name, fn in [
            ("ipc-range", probe_range),
            ("ipc-corrupt-handle", probe_bad_handle),
            ("vmm-export", probe_vmm),
            ("ipc-event", probe_event),
            ("exporter-death", probe_death),
        ]:
            try:
                if name == "exporter-death" and child is not None:
                    child.close()
                    child = None
                if child is None:
                    hold = {"FAKECUDA_EVENT_HOLD": args.stand_in_hold} if args.stand_in_hold else {}
                    child = Child(args.timeout, hold)
                fn(drv, child, args, state)
            except Unsupported as e:
                verdict(name, e.verdict, e.details)
            except Missing as e:
                verdict(name, "unsupported by this driver", f"{e.name} missing")
            except CudaError as e:
                verdict(name, "refused", str(e))
            except Exception as e:  # noqa: BLE001 (a bug in the probe, not a driver answer: reported, the rest run)
                broke = True
                verdict(name, "error", f"{type(e).__name__}: {e}")
                traceback.print_exc()
    finally:
        if child is not None and child.p.poll() is None:
            child.close()
    return 1 if broke else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--range-bytes", type=int, default=MIB + 4096)
    ap.add_argument("--event-bytes", type=int, default=256 * MIB)
    ap.add_argument("--event-reps", type=int, default=40, help="H2D copies of --event-bytes before the marker")
    ap.add_argument("--death-bytes", type=int, default=1 << 30)
    ap.add_argument("--death-copies", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=30, help="seconds to wait for each answer of the child")
    ap.add_argument(
        "--stand-in-hold",
        metavar="FILE",
        help="for the stand-in driver (gpu/gputest/testdata/fakecuda.c), whose copies finish at once: the "
        "child's interprocess event stays incomplete while FILE exists (FAKECUDA_EVENT_HOLD); this "
        "process removes FILE after queueing its wait and copy",
    )
    args = ap.parse_args()
    if args.child:
        return child_main()
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
