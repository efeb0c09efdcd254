"""The vLLM worker's GPU KV cache, on the stand-in CUDA driver
(gpu/gputest/testdata/fakecuda.c; see test_cuda_region.py), in the vLLM venv:

- every KVCacheLayout of the installed vLLM's own allocator
  (vllm/v1/kv_cache_interface.py create_kv_cache_views over one buffer, the
  strides from compute_layout_strides as get_kv_cache_config_from_groups
  sets them), page by page, byte by byte;
- WorkerSide's registration: the store event, refusals that leave the
  engine serving, and a second register_kv_caches;
- the connector through the test harness (vllm_harness.py) with its KV
  cache in simulator memory and a real sidecar on its CUDA copy backend:
  stores, loads, and a re-registration after which the old memory is
  never copied into again.
"""

import ctypes
import logging
import os
import signal
import struct
import threading
import time
from types import SimpleNamespace

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable
from test_cuda_region import BLOCK, BS, GRANULE, D, Sim, T, libcuda  # noqa: F401 - libcuda: a fixture
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from ringside import schema as S
from ringside.plugin import cudaipc
from ringside.plugin.config import VLLM, Config
from ringside.plugin.region import from_block_tensors
from ringside.sidecar_process import stop_process
from ringside.vllm.metadata import LoadSpec, RingsideConnectorMetadata
from ringside.vllm.worker import REGION_ID, WorkerSide

torch = H.torch


@pytest.fixture
def sim(libcuda, monkeypatch):  # noqa: F811 - the fixture of the same name
    monkeypatch.setenv(cudaipc.LIB_ENV, libcuda)  # the worker's driver is the stand-in
    s = Sim(libcuda)
    yield s
    s.close()


class Cuda:
    """A torch tensor over simulator memory that says it is on the GPU."""

    def __init__(self, t):
        self.t = t
        self.device = SimpleNamespace(type="cuda", index=0)
        self.shape, self.dtype = t.shape, t.dtype

    def data_ptr(self):
        return self.t.data_ptr()

    def stride(self):
        return self.t.stride()

    def element_size(self):
        return self.t.element_size()

    def __getitem__(self, k):
        return self.t[k]

    def __setitem__(self, k, v):
        self.t[k] = v


def device_bytes(sim, n):
    p = sim.alloc(n)
    return p, torch.frombuffer((ctypes.c_char * n).from_address(p), dtype=torch.int8)


def byte_addresses(t):
    """Every byte address of tensor t, in address order."""
    es = t.element_size()
    offs = [0]
    for n, st in zip(t.shape, t.stride()):
        offs = [o + i * st for o in offs for i in range(n)]
    return sorted(t.data_ptr() + o * es + k for o in offs for k in range(es))


SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=D, dtype=torch.float16)


def vllm_views(sim, layout, nb=6, layers=3, kernel_block_size=None):
    ls, bs, *_ = compute_layout_strides(SPEC, nb, layers, layout)
    size = nb * layers * SPEC.page_size_bytes
    p, raw = device_bytes(sim, size)
    names = ["model.layers.%d.self_attn.attn" % i for i in range(layers)]
    kvt = KVCacheTensor(size=size, layers=names, layer_stride=ls, block_stride=bs)
    views = create_kv_cache_views(raw, SPEC, nb, layout, kvt, kernel_block_size=kernel_block_size)
    return p, dict(zip(names, views))


# Segments a page of 3 layers has in each layout: a block-outermost layout
# whose block is compact is one range; heads outside the block dimension
# make a piece per head and layer.
SEGMENTS = {"LBHNC": 3, "LBNHC": 3, "LHBNC": 6, "BLHNC": 1, "BLNHC": 1, "BHLNC": 6}


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda lay: lay.name)
def test_every_vllm_layout_pages_byte_by_byte(sim, layout):
    nb = 6
    p, views = vllm_views(sim, layout, nb)
    r = from_block_tensors({n: Cuda(v) for n, v in views.items()}, drv=sim.drv)
    assert r.page_count == nb and r.page_size == 3 * SPEC.page_size_bytes
    for i in range(nb):
        want = [a for n in views for a in byte_addresses(views[n][i])]  # the layers in index order
        got = [r.base + o + i * st + k for o, st, ln in r.page_segments() for k in range(ln)]
        assert got == want, i
    assert len(r.segments) == SEGMENTS[layout.name]
    x = S.decode_cuda_extra(r.extra)
    assert x.allocations == (S.CUDAAllocation(sim.handle(p), p, GRANULE),)


@pytest.mark.parametrize("layout", [KVCacheLayout.BLNHC, KVCacheLayout.BLHNC], ids=lambda lay: lay.name)
def test_a_block_outermost_page_of_many_layers_is_one_run(sim, layout):
    # vLLM packs a block-outermost layout's layers in layer-index order: a
    # page of 12 layers is one run of memory when the layers are taken in
    # that order ("layers.2" before "layers.10"), not in name order.
    nb = 4
    p, views = vllm_views(sim, layout, nb, layers=12)
    shuffled = {n: Cuda(views[n]) for n in sorted(views)}  # the engine's dict order is no order
    r = from_block_tensors(shuffled, drv=sim.drv)
    assert r.page_count == nb and r.page_size == 12 * SPEC.page_size_bytes
    assert r.segments == ((0, 12 * SPEC.page_size_bytes, 12 * SPEC.page_size_bytes),), r.segments
    for i in range(nb):
        want = [a for n in views for a in byte_addresses(views[n][i])]
        got = [r.base + o + i * st + k for o, st, ln in r.page_segments() for k in range(ln)]
        assert got == want, i


def test_kernel_blocks_make_one_page_of_a_block(sim):
    # A kernel block size below the block size: the views count kernel
    # blocks; given the engine's block count a page is a whole block.
    nb = 4
    _, views = vllm_views(sim, KVCacheLayout.LBNHC, nb, kernel_block_size=BS // 2)
    kv = {n: Cuda(v) for n, v in views.items()}
    assert next(iter(views.values())).shape[0] == 2 * nb
    r = from_block_tensors(kv, num_blocks=nb, drv=sim.drv)
    assert r.page_count == nb and r.page_size == 3 * SPEC.page_size_bytes
    for i in range(nb):
        want = [a for n in sorted(views) for a in byte_addresses(views[n][2 * i]) + byte_addresses(views[n][2 * i + 1])]
        got = [r.base + o + i * st + k for o, st, ln in r.page_segments() for k in range(ln)]
        assert got == want


# -- the engine's blocks, whatever the kernel blocks ---------------------------------


def connector_worker(sock, nb, names):
    """The connector's worker as vLLM builds it: RingsideConnector with the
    engine's KVCacheConfig (nb blocks; one group of the layers names)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from ringside.vllm import RingsideConnector

    vc = H.vllm_config({"socket": sock, "timeout": 2.0, "reattach_interval": 0.0})
    # The group's spec at the engine's block size (the views' spec, SPEC,
    # has the stand-in's small blocks; the worker reads only the count).
    spec = FullAttentionSpec(block_size=H.BLOCK, num_kv_heads=2, head_size=D, dtype=torch.float16)
    kcc = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return RingsideConnector(vc, KVConnectorRole.WORKER, kcc)


def test_the_worker_registers_the_engines_blocks_not_kernel_blocks(sim, start_sidecar, libcuda, monkeypatch):  # noqa: F811
    # vLLM splits a block into kernel blocks where the attention backend
    # does not take the block size (--block-size 128 with FlashInfer or
    # FlashMLA): its views count kernel blocks while block ids count the
    # scheduler's blocks. The connector's worker, given only the views,
    # must still make page b engine block b: a store of block b reads, and
    # a load into block c writes, both of its kernel blocks and nothing else.
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="4MiB", slot="4KiB", args=["--copy.backend=cuda"])
    nb = 6
    p, views = vllm_views(sim, KVCacheLayout.LBNHC, nb, kernel_block_size=BS // 2)
    assert next(iter(views.values())).shape[0] == 2 * nb
    conn = connector_worker(sc.sock, nb, list(views))
    ws = conn.connector_worker
    conn.register_kv_caches({n: Cuda(v) for n, v in views.items()})
    r = ws.region
    assert r is not None and r.page_count == nb, "the region counts kernel blocks: %s" % (r,)
    assert r.page_size == 3 * SPEC.page_size_bytes
    raw = torch.frombuffer((ctypes.c_char * (nb * 3 * SPEC.page_size_bytes)).from_address(p), dtype=torch.int8)
    raw.fill_(0)
    for n, v in views.items():  # every kernel block of every layer its own bytes
        for k in range(2 * nb):
            v[k].view(torch.int8).fill_((k * 7 + list(views).index(n) * 31 + 1) % 127)
    before = raw.clone()
    half = SPEC.page_size_bytes // 2  # a kernel block of a layer: contiguous in LBNHC

    def at(n, k):  # the byte offset of kernel block k of layer n in the buffer
        return views[n][k].data_ptr() - p

    s = ws.link.session
    ws.store_event.record(sim.stream())  # what wait_for_save does before its stores
    assert s.put_hashes(7, bytes([9]) * 32) == 1
    rep = s.store(7, 0, 1, REGION_ID, [4])
    assert rep.status == 0 and rep.stored == 1, rep
    lease = s.acquire(7, 0, 1)
    assert lease.blocks == 1, lease
    assert s.load(lease.lease, REGION_ID, 0, [1]) == 1
    s.release(lease.lease)
    # Block 1 (kernel blocks 2 and 3 of every layer) now holds block 4's
    # (kernel blocks 8 and 9); no other byte changed.
    want = before.clone()
    for n in views:
        for k in (0, 1):
            want[at(n, 2 + k) : at(n, 2 + k) + half] = before[at(n, 8 + k) : at(n, 8 + k) + half]
    assert bool(torch.equal(raw, want)), "the load wrote other bytes than block 4's into block 1"
    conn.shutdown()


def test_a_cache_of_another_block_count_is_refused(sim, caplog):
    # Views whose block dimension is not the engine's block count (nor a
    # multiple of it) describe other blocks than the scheduler's: the
    # engine serves without the cache rather than store the wrong ones.
    nb = 6
    _, views = vllm_views(sim, KVCacheLayout.LBNHC, nb)
    conn = connector_worker("/nonexistent/ringside.sock", nb + 1, list(views))
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        conn.register_kv_caches({n: Cuda(v) for n, v in views.items()})
    assert conn.connector_worker.region is None
    warned = [r.getMessage() for r in caplog.records if "serving without the cache" in r.getMessage()]
    assert len(warned) == 1 and "7" in warned[0] and "6" in warned[0], warned
    conn.shutdown()


def worker(sock="/nonexistent/ringside.sock"):
    cfg = Config.parse({"socket": sock, "reattach_interval": 0.0, "timeout": 2.0}, VLLM)
    attach = dict(instance="cuda-worker", model="m", layout="l", salt="", world_size=1, digest_width=32)
    return WorkerSide(cfg, attach, 0, True)


def fa_layers(sim, n, nb=6):
    return {"model.layers.%d.attn" % i: T(sim.alloc(2 * nb * BLOCK), (2, nb, BS, 2, D)) for i in range(n)}


def test_worker_attaches_the_store_event(sim):
    w = worker()
    w.register_kv_caches(fa_layers(sim, 32))
    assert w.region is not None and w.region.kind == S.REGION_CUDA_IPC
    assert isinstance(w.store_event, cudaipc.IpcEvent)
    assert S.decode_cuda_extra(w.region.extra).event == w.store_event.handle
    w.store_event.record(sim.stream())
    # Host memory has none.
    bufs = [ctypes.create_string_buffer(2 * 6 * BLOCK) for _ in range(2)]
    h = worker()
    h.register_kv_caches(
        {"l%d" % i: T(ctypes.addressof(b), (2, 6, BS, 2, D), device="cpu") for i, b in enumerate(bufs)}
    )
    assert h.region is not None and h.region.kind == S.REGION_HOST_PROCESS and h.store_event is None


def test_worker_serves_without_the_cache_when_memory_cannot_be_shared(sim, monkeypatch, caplog):
    monkeypatch.setenv("FAKECUDA_VMM", "1")
    layers = fa_layers(sim, 2)
    monkeypatch.delenv("FAKECUDA_VMM")
    w = worker()
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        w.register_kv_caches(layers)
    assert w.region is None and w.store_event is None
    warned = [r.getMessage() for r in caplog.records if "serving without the cache" in r.getMessage()]
    assert len(warned) == 1 and "expandable_segments" in warned[0], warned
    # The engine's steps go on: nothing to load or store.
    w.start_load_kv(None)
    assert w.get_finished(set()) == (None, None)


def sidecar_counters(d, pid):
    """The stand-in driver's call counters in the sidecar (FAKECUDA_COUNTERS):
    (IPC handles opened, closed)."""
    try:
        with open(os.path.join(d, str(pid)), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return 0, 0
    c = struct.unpack("<%dQ" % (len(raw) // 8), raw)
    return c[3], c[4]


def wait_for(cond, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_second_registration_replaces_the_first(sim, start_sidecar, libcuda, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    monkeypatch.setenv("FAKECUDA_COUNTERS", str(tmp_path))
    sc = start_sidecar(pool="4MiB", slot="16KiB", args=["--copy.backend=cuda"], metrics=True)
    monkeypatch.delenv("FAKECUDA_COUNTERS")
    pid = sc.proc.pid
    w = worker(sc.sock)
    w.register_kv_caches(fa_layers(sim, 4))
    first, ev, gen = w.region, w.store_event, w.link.generation
    assert w._region_gen == gen
    wait_for(lambda: sidecar_counters(tmp_path, pid) == (4, 0), "the sidecar did not open the 4 allocations")
    w.register_kv_caches(fa_layers(sim, 4))
    assert w.region is not first and w.store_event is not ev and ev.event is None  # the old event destroyed
    # A new session registered the new memory; the old one is gone, and
    # with it the sidecar's mappings of the old allocations.
    assert w.link.generation == gen + 1 and w._region_gen == w.link.generation
    sid = w.link.session.info.session
    wait_for(
        lambda: [(x["id"], x["regions"]) for x in sc.state()["sessions"]] == [(sid, 1)],
        "the old session is still there: %s" % sc.state()["sessions"],
    )
    wait_for(lambda: sidecar_counters(tmp_path, pid) == (8, 4), "the old allocations are still mapped")
    w.shutdown()


def test_an_unconfirmed_detach_keeps_the_old_store_event(sim, start_sidecar, libcuda, monkeypatch):  # noqa: F811
    """A re-registration whose Detach the sidecar does not answer (stopped:
    it may still have the old event open, a store's gate waiting on it)
    does not destroy the old store event, which would be undefined
    behaviour in the sidecar (cuIpcOpenEventHandle); a confirmed one does
    (above)."""
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="4MiB", slot="16KiB", args=["--copy.backend=cuda"])
    w = worker(sc.sock)
    w.register_kv_caches(fa_layers(sim, 4))
    ev = w.store_event
    stop_process(sc.proc.pid)
    try:
        w._release_region()  # what a second register_kv_caches starts with
        assert ev.event is not None, "the old store event was destroyed without the sidecar's word"
        assert w._kept_events == [ev]
    finally:
        os.kill(sc.proc.pid, signal.SIGCONT)
    w.shutdown()


# -- the connector, end to end ---------------------------------------------------


class _SimTorch:
    """The harness's torch, whose zeros() are tensors in simulator memory
    (the engine's KV cache)."""

    def __init__(self, sim):
        self.sim = sim

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *shape, dtype):
        n = 1
        for d in shape:
            n *= d
        es = torch.empty((), dtype=dtype).element_size()
        _, raw = device_bytes(self.sim, n * es)
        raw.zero_()
        return Cuda(raw.view(dtype).view(*shape))


def cuda_engine(sim, sock, stream, **kw):
    old = H.torch
    H.torch = _SimTorch(sim)
    try:
        eng = H.Engine(sock, **kw)
    finally:
        H.torch = old
    ws = eng.worker.connector_worker
    assert ws.region is not None and ws.region.kind == S.REGION_CUDA_IPC, "the KV cache was not registered"
    ws.store_event.stream = stream  # the stand-in has no torch stream
    return eng


def test_connector_stores_loads_and_reregisters(sim, start_sidecar, libcuda, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda"])
    stream = sim.stream()
    a = cuda_engine(sim, sc.sock, stream, num_blocks=32)
    first = [H.request("c%d" % i, H.prompt(50 + i, 40 + 7 * i), max_tokens=8) for i in range(3)]
    a.run(first)
    assert a.wstats["stored_blocks"] > 0 and a.wstats["store_errors"] == 0, a.wstats

    # vLLM re-initialises its KV cache: new memory, an empty prefix cache.
    old = a.tensors
    new = [_SimTorch(sim).zeros(*t.shape, dtype=t.dtype) for t in old]
    a.tensors = new
    a.kv = {name: new[i] for g in a.groups for i, name in enumerate(g.layer_names)}
    a.worker.register_kv_caches(a.kv)
    a.worker.connector_worker.store_event.stream = stream
    # The old memory, now another allocation's: never copied into or out of
    # again. (Written only now: the first turn's last stores may still be
    # reading it until register_kv_caches, which waits for them.)
    for t in old:
        t.t.fill_(-7.0)
    assert a.sched.reset_prefix_cache()
    # The next turns find every block in the sidecar: loads land in the new
    # memory (the harness checks every block's bytes before each forward).
    turn = [
        H.request("d%d" % i, list(r.all_token_ids) + H.prompt(90 + i, 20), max_tokens=4) for i, r in enumerate(first)
    ]
    loaded = a.wstats["loaded_blocks"]
    a.run(turn)
    assert a.wstats["loaded_blocks"] > loaded and a.wstats["load_error_blocks"] == 0, a.wstats
    for t in old:
        assert bool((t.t == -7.0).all()), "a copy reached the old KV cache"
    a.shutdown()

    # What was stored from the new memory is right: a host engine loads it.
    b = H.Engine(sc.sock, num_blocks=64)
    b.run([H.request("e%d" % i, list(r.all_token_ids), max_tokens=2) for i, r in enumerate(turn)])
    b.shutdown()
    assert b.wstats["loaded_blocks"] > 0 and b.wstats["load_error_blocks"] == 0, b.wstats
    assert b.checked_blocks > 0


# -- a store event that cannot be recorded ---------------------------------------


class _Stream:
    """torch.cuda.current_stream() of the CPU build, which has none: counts
    synchronize() calls, or fails them."""

    def __init__(self, fail=False):
        self.synced, self.fail = 0, fail

    def synchronize(self):
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.synced += 1


@pytest.mark.parametrize("sync", ["works", "fails"])
def test_a_store_event_that_cannot_be_recorded_never_fails_the_step(
    sim,
    start_sidecar,
    libcuda,  # noqa: F811 - the fixture of the same name
    monkeypatch,
    caplog,
    sync,
):
    # cuEventRecord raising in wait_for_save (no current context on the
    # calling thread, a context error of the engine's) must not leave the
    # hook: the worker drops the event and waits for the engine's stream
    # instead, so the stores read only what the forward pass wrote; where
    # that fails too, the step's stores are skipped (a future miss).
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda"])
    eng = cuda_engine(sim, sc.sock, sim.stream(), num_blocks=32)
    ws = eng.worker.connector_worker
    ev = ws.store_event
    calls = []

    def record(stream=None):
        calls.append(stream)
        raise cudaipc.CudaError("cuEventRecord", 201, "CUDA_ERROR_INVALID_CONTEXT")

    ev.record = record
    stream = _Stream(fail=sync == "fails")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        eng.run([H.request("e%d" % i, H.prompt(30 + i, 40), max_tokens=4) for i in range(2)])  # no exception
        reset(eng)
        eng.run([H.request("e2", H.prompt(40, 40), max_tokens=4)])
        reset(eng)
    assert len(calls) == 1, "the event was recorded again after it failed: %d calls" % len(calls)
    assert ws.store_event is None
    warned = [r.getMessage() for r in caplog.records if "store event" in r.getMessage()]
    assert warned and "CUDA_ERROR_INVALID_CONTEXT" in warned[0], warned
    if sync == "works":
        # Three prompts of two full blocks each, stored after a synchronize.
        assert stream.synced >= 2, stream.synced
        assert ws.stats["stored_blocks"] == 6 and ws.stats["store_errors"] == 0, ws.stats
        # What they stored loads back byte-exact (the harness checks).
        loaded = ws.stats["loaded_blocks"]
        eng.run([H.request("e3", H.prompt(40, 45), max_tokens=2)])
        assert ws.stats["loaded_blocks"] == loaded + 2 and ws.stats["load_error_blocks"] == 0, ws.stats
    else:
        assert ws.stats["stored_blocks"] == 0 and ws.stats["stores_skipped"] == 6, ws.stats
        skipped = [r.getMessage() for r in caplog.records if "not stored (skipped)" in r.getMessage()]
        assert len(skipped) == 1, skipped  # said once
    eng.shutdown()


# -- a load past its timeout ------------------------------------------------------


def test_a_load_past_its_timeout_is_reported_once_the_sidecar_ended_its_session(
    sim,
    start_sidecar,
    libcuda,  # noqa: F811 - the fixture of the same name
    monkeypatch,
    tmp_path,
):
    # A load unanswered at load_timeout is given up and its request
    # recomputes: vLLM may hand its blocks on once finished_recving reports
    # it. A copy the sidecar had not issued yet must never land after that:
    # the worker reports the request only once the sidecar has ended the
    # session (closed its rings, after withdrawing its copies not issued and
    # once those issued have ended).
    # Here the device thread is busy in the driver (FAKECUDA_COPY_HOLD holds
    # a store's copy call), the load waits in the device's queue, and the
    # sidecar is stopped when the timeout passes, so it cannot end the
    # session until it is continued.
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    hold = str(tmp_path / "copy-hold")
    monkeypatch.setenv("FAKECUDA_COPY_HOLD", hold)
    sc = start_sidecar(pool="4MiB", slot="4KiB", args=["--copy.backend=cuda", "--copy.stall=30s"], metrics=True)
    monkeypatch.delenv("FAKECUDA_COPY_HOLD")
    cfg = Config.parse({"socket": sc.sock, "reattach_interval": 0.0, "timeout": 2.0, "load_timeout": 0.5}, VLLM)
    attach = dict(instance="cuda-load", model="m", layout="l", salt="", world_size=1, digest_width=32)
    ws = WorkerSide(cfg, attach, 0, True, 6)
    layers = fa_layers(sim, 2)
    ws.register_kv_caches(layers)
    s = ws.link.session
    assert s is not None and ws.region is not None
    stream = sim.stream()
    for i, t in enumerate(layers.values()):  # every block of every layer its own bytes
        ctypes.memmove(t.ptr, bytes((i * 37 + k) % 251 for k in range(2 * 6 * BLOCK)), 2 * 6 * BLOCK)
    ws.store_event.record(stream)
    assert s.put_hashes(1, bytes([1]) * 32 + bytes([2]) * 32) == 2
    assert s.store(1, 0, 2, REGION_ID, [0, 1]).stored == 2
    lease = s.acquire(1, 0, 2)
    assert lease.blocks == 2, lease

    def blocks(ids):
        return [
            ctypes.string_at(t.ptr + kv * 6 * BLOCK + b * BLOCK, BLOCK)
            for t in layers.values()
            for kv in (0, 1)
            for b in ids
        ]

    before = blocks([4, 5])
    open(hold, "wb").close()  # the next copy call blocks: the device thread is busy
    try:
        assert s.put_hashes(2, bytes([3]) * 32) == 1
        s.submit(S.TYPE_STORE, S.encode_store(2, 0, 1, REGION_ID, [2]))  # its copy call holds the device thread
        time.sleep(0.2)
        meta = RingsideConnectorMetadata(loads=[LoadSpec("r", lease.lease, [4, 5], [])])
        ws.start_load_kv(meta)
        assert ws.get_finished(set()) == (None, None)  # queued behind the store
        time.sleep(0.6)  # past load_timeout
        stop_process(sc.proc.pid)
        try:
            for _ in range(10):
                _, recving = ws.get_finished(set(), RingsideConnectorMetadata())
                assert not recving, "a load was given up before the sidecar ended its session"
                time.sleep(0.05)
            assert ws.link.session is not s  # given up on: the next step attaches anew
        finally:
            os.kill(sc.proc.pid, signal.SIGCONT)
        # The sidecar ends the session: it withdraws its copies not issued
        # (the load) before it forgets the session; it acknowledges the end
        # (the rings closed) only once the copies issued (the held store's
        # call) have ended and the region's mapping is closed.
        sid = s.info.session
        wait_for(lambda: sid not in [x["id"] for x in sc.state()["sessions"] or []], "the session did not end")
        os.unlink(hold)
        deadline = time.monotonic() + 5.0
        recving = None
        while not recving:
            assert time.monotonic() < deadline, (
                "the load was never reported after the sidecar ended the session" + sc.logs()[-3000:]
            )
            _, recving = ws.get_finished(set(), RingsideConnectorMetadata())
            time.sleep(0.01)
        assert recving == {"r"} and s.peer_gone
        assert ws.get_block_ids_with_load_errors() == {4, 5}
    finally:
        if os.path.exists(hold):
            os.unlink(hold)
    # The device thread free again: the load was withdrawn, never copied.
    time.sleep(0.3)
    assert blocks([4, 5]) == before, "a load landed after its request was reported"
    ws.shutdown()


# -- the benchmark of waiting for stores -------------------------------------------


def test_the_settle_wait_benchmark_runs(ringside_bin, libcuda, tmp_path):  # noqa: F811
    """bench/vllm/settle_wait.py --quick (docs/benchmarks.md, waiting for
    stores): every scenario runs and stores, and its deterministic counts
    hold: with plenty of blocks no step blocks on a store (no schedule hands
    a stored block on, and no model here has Model Runner V2 write blocks
    before handle_preemptions)."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = tmp_path / "rows.jsonl"
    r = subprocess.run(
        [sys.executable, os.path.join(repo, "bench", "vllm", "settle_wait.py"), "--quick", "--out", str(out)],
        env=dict(os.environ, RINGSIDE_TEST_BIN=ringside_bin),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = {(x["model"], x["memory"], x["runner"]): x for x in map(json.loads, out.read_text().splitlines())}
    assert len(rows) == 8, rows.keys()
    for k, x in rows.items():
        assert x["stored_blocks"] > 0 and x["steps"] > 0, (k, x)
    for model in ("full", "sliding"):
        for runner in ("v1", "v2"):
            assert rows[(model, "ample", runner)]["store_waits"] == 0, rows[(model, "ample", runner)]


# -- stores in flight: finished and preempted requests --------------------------


class Held:
    """FAKECUDA_EVENT_HOLD in this (the engine's) process: while the file
    exists, a store event recorded here stays incomplete, so the sidecar's
    store copies wait behind it and cannot have read the blocks. (The same
    file can be the sidecar's FAKECUDA_COPY_HOLD.)"""

    def __init__(self, path, monkeypatch):
        self.path = str(path)
        monkeypatch.setenv("FAKECUDA_EVENT_HOLD", self.path)

    def hold(self):
        with open(self.path, "wb"):
            pass

    def release(self):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def held(self):
        return os.path.exists(self.path)


@pytest.fixture
def held(monkeypatch, tmp_path):
    """A Held, released at teardown (before the sidecar's stop, which would
    wait for a store behind it)."""
    h = Held(tmp_path / "event-hold", monkeypatch)
    yield h
    h.release()


def observe(eng):
    """Record what request_finished answered and every step's finished_sending."""
    finished, sending = {}, []
    conn, w = eng.conn, eng.worker
    gtr = w.get_transfer_results

    def wrap(name):
        rf = getattr(conn, name)

        def request_finished(request, block_ids):
            out = rf(request, block_ids)
            finished[request.request_id] = out[0]
            return out

        setattr(conn, name, request_finished)

    wrap("request_finished")
    wrap("request_finished_all_groups")  # what vLLM calls for a connector with SupportsHMA

    def get_transfer_results(ids):
        res = gtr(ids)
        sending.append(set(res.finished_sending or ()))
        return res

    w.get_transfer_results = get_transfer_results
    return finished, sending


def reset(eng, timeout=4.0):
    """vLLM's reset_prefix_cache, once the held requests' blocks are freed
    (the engine steps until their stores are reported ended)."""
    deadline = time.monotonic() + timeout
    while not eng.sched.reset_prefix_cache():
        assert time.monotonic() < deadline, "the prefix cache could not be reset"
        eng.step()
        time.sleep(0.005)


def test_a_store_unanswered_a_step_later_is_waited_for(sim, start_sidecar, held, libcuda, monkeypatch):  # noqa: F811
    # A store is let run on through one more forward pass (overlap_saves),
    # not more: the scheduler holds a finished request's blocks only while
    # its last store is recent (hold_steps), so a store still unanswered a
    # step later must be waited for, even when no newer store followed it.
    # Two full blocks, then a decode that fills no third: the prefill's store
    # is the only one. Its event is held for 1 s while the request decodes.
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda"])
    ev = held
    eng = cuda_engine(sim, sc.sock, sim.stream(), num_blocks=16)
    ws = eng.worker.connector_worker
    finished, _ = observe(eng)
    answered = {}
    rf = eng.conn.request_finished_all_groups

    def request_finished(request, block_ids):
        answered[request.request_id] = ws.stats["stores"]
        return rf(request, block_ids)

    eng.conn.request_finished_all_groups = request_finished
    ev.hold()
    timer = threading.Timer(1.0, ev.release)
    timer.start()
    try:
        eng.run([H.request("d0", H.prompt(12, 2 * H.BLOCK), max_tokens=H.BLOCK - 2)])
    finally:
        timer.cancel()
        ev.release()
    assert "d0" in finished and "d0" in answered, (finished, answered)
    # Either its store had been answered when it finished, or vLLM was told
    # to keep its blocks.
    assert finished["d0"] or answered["d0"] >= 1, (
        "request_finished freed the blocks of a request whose store was unanswered: %s, %s" % (finished, ws.stats)
    )
    reset(eng)
    assert ws.stats["stored_blocks"] == 2 and ws.stats["store_errors"] == 0, ws.stats
    eng.shutdown()


@pytest.mark.parametrize("hold", ["event", "copy"])
def test_a_finished_request_is_held_until_its_store_ended(sim, start_sidecar, held, libcuda, monkeypatch, hold):  # noqa: F811
    # The store is held by its event (FAKECUDA_EVENT_HOLD, in the engine) or
    # by the sidecar's copy call (FAKECUDA_COPY_HOLD, in the sidecar: the
    # call blocks before it reads anything).
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    if hold == "copy":
        monkeypatch.delenv("FAKECUDA_EVENT_HOLD")
        monkeypatch.setenv("FAKECUDA_COPY_HOLD", held.path)
    # --copy.stall above the hold: a held copy is not stuck.
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda", "--copy.stall=10s"])
    monkeypatch.delenv("FAKECUDA_COPY_HOLD", raising=False)
    ev = held
    eng = cuda_engine(sim, sc.sock, sim.stream(), num_blocks=16)
    ws = eng.worker.connector_worker
    finished, sending = observe(eng)
    # Two full blocks, finished in the step that computes them (one token):
    # the step's store is sent after the forward pass, and held.
    ev.hold()
    eng.add(H.request("f0", H.prompt(11, 2 * H.BLOCK), max_tokens=1))
    deadline = time.monotonic() + 4.0
    while "f0" not in eng.finished:  # the scheduler's lookup first, then the prefill
        assert time.monotonic() < deadline, "f0 did not finish"
        eng.step()
        time.sleep(0.001)
    assert finished == {"f0": True}, "request_finished did not hold the request: %s" % finished
    blocks = eng._block_ids("f0")
    assert len(blocks) >= 2
    try:
        for _ in range(10):
            eng.step()
            time.sleep(0.02)
            assert ev.held
            assert not any("f0" in s for s in sending), "reported in finished_sending before its store copied"
            assert "f0" in eng.sched.requests and eng._block_ids("f0") == blocks, "its blocks were freed"
            assert ws.stats["stores"] == 0, "a store was answered while its event was incomplete"
    finally:
        ev.release()
    deadline = time.monotonic() + 4.0
    while not any("f0" in s for s in sending):
        assert time.monotonic() < deadline, "never reported in finished_sending after its store ended"
        eng.step()
        time.sleep(0.005)
    assert ws.stats["stores"] >= 1 and ws.stats["stored_blocks"] == 2 and ws.stats["store_errors"] == 0, ws.stats
    assert "f0" not in eng.sched.requests
    # What the store read loads back: a longer turn of the same prompt,
    # with vLLM's prefix cache emptied, loads both blocks (the harness
    # checks every block's bytes before the forward pass).
    assert eng.sched.reset_prefix_cache()
    eng.run([H.request("f1", H.prompt(11, 2 * H.BLOCK + 5), max_tokens=2)])
    assert eng.wstats["loaded_blocks"] == 2 and eng.wstats["load_error_blocks"] == 0, eng.wstats
    assert eng.checked_blocks >= 2
    eng.shutdown()


def test_a_store_event_on_the_legacy_default_stream(sim, start_sidecar, held, libcuda, monkeypatch):  # noqa: F811
    # torch records on its current stream, the legacy default stream (0)
    # unless one is set; the driver takes stream 0 wherever it takes a
    # stream, and so does the stand-in. The sidecar's store copies wait for
    # the event recorded there: no store is answered while the "kernel"
    # before the record still runs (FAKECUDA_EVENT_HOLD, released after
    # 0.5 s), and then the blocks are stored.
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda", "--copy.stall=10s"])
    eng = cuda_engine(sim, sc.sock, 0, num_blocks=16)
    ws = eng.worker.connector_worker
    assert ws.store_event.stream == 0
    answered = []
    done = ws._store_done

    def store_done(payload):
        answered.append(held.held)
        return done(payload)

    ws._store_done = store_done
    held.hold()
    timer = threading.Timer(0.5, held.release)
    timer.start()
    try:
        eng.run([H.request("l0", H.prompt(13, 2 * H.BLOCK + 3), max_tokens=6)])
    finally:
        timer.cancel()
        held.release()
    reset(eng)
    assert ws.store_event is not None, "recording on stream 0 failed"
    assert answered and not any(answered), "a store was answered while its event was incomplete"
    assert ws.stats["stored_blocks"] == 2 and ws.stats["store_errors"] == 0, ws.stats
    eng.shutdown()


def test_a_preempted_requests_blocks_wait_for_its_store(sim, start_sidecar, held, libcuda, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda"])
    ev = held
    # 7 usable blocks (one is vLLM's null block): two 3-block prompts fill
    # 6 in their prefill step, whose store is held; in the next step both
    # need a 4th block, and vLLM preempts the second, freeing its blocks
    # while that store has not read them. No step may write one of them
    # (hand it on as a new block) before the store has read them: the
    # preemption's own step allocates none of them, so the store runs on
    # through it, and the step after waits for it (a store runs on through
    # one step, never more).
    eng = cuda_engine(sim, sc.sock, sim.stream(), num_blocks=8)
    ws = eng.worker.connector_worker
    steps = []  # (preempted, store held before, store held after, handed on, seconds)
    hp = eng.worker.handle_preemptions
    stored: set = set()
    timer = threading.Timer(0.3, ev.release)

    def handle_preemptions(meta):
        so = eng.sched_output
        pre = set(so.preempted_req_ids or ())
        if pre and not timer.is_alive() and ev.held:
            timer.start()  # the store "runs" 0.3 s more from the preemption on
        pending = {b for e in ws._saving for b in e[4]}  # the stores sent in the steps before
        before, t0 = ev.held, time.monotonic()
        hp(meta)
        handed = bool(stored & pending & allocated(so))
        steps.append((pre, before, ev.held, handed, time.monotonic() - t0))
        assert not (ev.held and handed), "a step hands on blocks a store has not read: %s" % steps

    eng.worker.handle_preemptions = handle_preemptions
    sched = eng.sched.schedule

    def schedule():
        eng.sched_output = sched()
        if not stored:
            stored.update(eng.sched_output.kv_connector_metadata.store_block_ids)
        return eng.sched_output

    eng.sched.schedule = schedule
    reqs = [H.request("p%d" % i, H.prompt(20 + i, 3 * H.BLOCK), max_tokens=4) for i in range(2)]
    ev.hold()  # from the prefill step's store on
    try:
        eng.run(reqs)
    finally:
        timer.cancel()
        ev.release()
    pre = [x for x in steps if x[0]]
    assert pre and pre[0][0] == {"p1"} and pre[0][1], "no preemption with the store held: %s" % steps
    assert pre[0][2] and not pre[0][3], "the preemption's step waited, or handed the blocks on: %s" % steps
    # The step after waits for it (a store runs on through one step, not more).
    i = steps.index(pre[0]) + 1
    assert not steps[i][2] and steps[i][4] > 0.2, "the step after the preemption did not wait: %s" % steps
    assert ws.stats["stored_blocks"] == 6 and ws.stats["store_errors"] == 0, ws.stats
    # The preempted request's blocks as stored load back byte-exact.
    reset(eng)
    loaded = eng.wstats["loaded_blocks"]
    eng.run([H.request("p2", H.prompt(21, 3 * H.BLOCK + 5), max_tokens=1)])
    assert eng.wstats["loaded_blocks"] - loaded == 3 and eng.wstats["load_error_blocks"] == 0, eng.wstats
    eng.shutdown()


def allocated(so) -> set:
    """The block ids a schedule allocated (test_vllm_connector.allocated)."""
    new = {b for nr in so.scheduled_new_reqs for g in nr.block_ids for b in g}
    return new | {b for nb in so.scheduled_cached_reqs.new_block_ids if nb for g in nb for b in g}


def test_a_sticky_error_in_the_sidecar_leaves_the_engine_serving(sim, start_sidecar, libcuda, monkeypatch, tmp_path):  # noqa: F811
    # FAKECUDA_STICKY_AFTER=1 in the sidecar: its first copy call fails with
    # CUDA_ERROR_ILLEGAL_ADDRESS and poisons its context. The store gets
    # status 11, the sidecar marks the GPU failed and exits non-zero; the
    # engine's steps go on (its requests compute), and once a new sidecar
    # serves the socket the worker attaches and registers its KV cache
    # again, and its stores are copied.
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    monkeypatch.setenv("FAKECUDA_STICKY_AFTER", "1")
    monkeypatch.setenv("FAKECUDA_COUNTERS", str(tmp_path))
    sc = start_sidecar(pool="8MiB", slot="4KiB", args=["--copy.backend=cuda"], metrics=True)
    monkeypatch.delenv("FAKECUDA_STICKY_AFTER")
    first_pid = sc.proc.pid
    stream = sim.stream()
    eng = cuda_engine(sim, sc.sock, stream, num_blocks=32)
    ws = eng.worker.connector_worker
    statuses = []
    done = ws._store_done

    def store_done(payload):
        statuses.append(S.decode_store_reply(payload).status)
        return done(payload)

    ws._store_done = store_done
    gen = ws.link.generation
    eng.run([H.request("s0", H.prompt(5, 40), max_tokens=4)])  # no exception out of the hooks
    reset(eng)  # steps until the request's stores ended
    assert statuses and statuses[0] == S.Status.COPY_FAILED, statuses
    assert ws.stats["stored_blocks"] == 0 and ws.stats["store_errors"] >= 1, ws.stats
    try:
        rc = sc.proc.wait(10)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
        pytest.fail("the sidecar did not exit after the sticky error:\n" + sc.logs())
    assert rc != 0, "the sidecar exited 0 after a sticky error:\n" + sc.logs()
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in sc.logs() and "exiting to be restarted" in sc.logs(), sc.logs()
    assert copy_calls(tmp_path, first_pid)[1] > 0, "the poisoned context was not refused anything"
    # No sidecar: the engine serves on, computing.
    eng.run([H.request("s1", H.prompt(6, 40), max_tokens=4)])
    # A new sidecar on the same socket (a fresh context: no sticky error).
    sc.start()
    deadline = time.monotonic() + 5.0
    n = 0
    while ws.stats["stored_blocks"] == 0:
        assert time.monotonic() < deadline, "no store was copied after the restart: %s" % ws.stats
        eng.run([H.request("s%d" % (2 + n), H.prompt(7 + n, 40), max_tokens=2)])
        reset(eng)  # steps until the request's stores ended
        n += 1
    assert ws.link.generation > gen and ws._region_gen == ws.link.generation
    assert statuses[-1] == S.Status.OK, statuses
    assert copy_calls(tmp_path, sc.proc.pid)[0] > 0, "the new sidecar copied nothing"
    # s0's blocks were never stored: with vLLM's prefix cache emptied its
    # prompt computes again (the harness checks the bytes), and is stored.
    loaded, stored = ws.stats["loaded_blocks"], ws.stats["stored_blocks"]
    eng.run([H.request("s0b", H.prompt(5, 40), max_tokens=2)])
    reset(eng)
    assert ws.stats["loaded_blocks"] == loaded and ws.stats["stored_blocks"] == stored + 2, ws.stats
    # And what the new sidecar stored loads back byte-exact, once the
    # scheduler has attached to it: until its local index of the first
    # sidecar goes stale (mirror_max_lag_ms after its last answered poll),
    # lookups are answered from that index, as misses.
    deadline = time.monotonic() + 5.0
    n = 0
    while ws.stats["loaded_blocks"] == loaded:
        assert time.monotonic() < deadline, "no hit in the new sidecar: %s %s" % (eng.stats, ws.stats)
        eng.run([H.request("s0c%d" % n, H.prompt(5, 40), max_tokens=2)])
        reset(eng)
        n += 1
        time.sleep(0.05)
    assert ws.stats["loaded_blocks"] == loaded + 2 and ws.stats["load_error_blocks"] == 0, ws.stats
    eng.shutdown()


def copy_calls(d, pid):
    """The stand-in driver's copy calls in process pid (FAKECUDA_COUNTERS),
    and the calls it refused on a poisoned context: (copies, refused)."""
    try:
        with open(os.path.join(d, str(pid)), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return 0, 0
    c = struct.unpack("<%dQ" % (len(raw) // 8), raw)
    return c[1] + c[2], c[11]
