"""The GPU KV cache as a sidecar region, against the stand-in CUDA driver
(gpu/gputest/testdata/fakecuda.c): its cuMemAlloc memory is a /dev/shm
mapping the CPU can read and write, so the tensors here are duck-typed views
(data_ptr, shape, stride, element_size, device) of real "device" memory, in
the shapes and strides vLLM's GPU runners give the connector:

- FlashAttention, one allocation per layer: [2, blocks, block size, heads,
  head size] (vllm/v1/attention/backends/flash_attn.py get_kv_cache_shape;
  the V1 runner's _allocate_kv_cache_tensors, one torch.zeros per
  KVCacheTensor);
- FlashInfer / Triton NHD [blocks, 2, block size, heads, head size] and its
  HND stride order (0, 1, 3, 2, 4) (vllm/v1/attention/backends/flashinfer.py
  get_kv_cache_stride_order);
- MLA [blocks, block size, latent + rope] (vllm/v1/attention/backends/mla/common.py);
- cross-layer: one tensor [blocks, layers, 2, block size, heads, head size]
  holding every layer, and per-layer views of a block-outermost buffer.

The layouts of the installed vLLM's own allocator are checked in
test_cuda_vllm.py (vLLM venv).
"""

import ctypes
import os
import shutil
import subprocess
import threading
from types import SimpleNamespace

import pytest

from ringside import schema as S
from ringside.plugin import cudaipc
from ringside.plugin.region import RegionError, from_block_tensors, memory_runs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAKE_SRC = os.path.join(REPO, "gpu", "gputest", "testdata", "fakecuda.c")
GRANULE = 2 << 20  # the stand-in's cuMemAlloc rounds to 2 MiB and reports the rounded size
FAKE_UUID = bytes(0xF0 + i for i in range(16))


@pytest.fixture(scope="session")
def libcuda(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler: cannot build the stand-in CUDA driver")
    d = tmp_path_factory.mktemp("fakecuda")
    out = str(d / "libcuda.so.1")
    subprocess.run([gcc, "-shared", "-fPIC", "-o", out, FAKE_SRC], check=True, capture_output=True)
    return out


class Sim:
    """The stand-in driver, called directly (its plain exports have the ABI
    of the _v2 entry points), with the primary context current on this
    thread as torch makes it for the engine."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.drv = cudaipc.Driver(path)
        ctx = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert self.lib.cuCtxSetCurrent(ctx) == 0
        self.allocs = []
        # Every store event made through this driver or the process's one
        # for this library is destroyed at close (the stand-in keeps an
        # interprocess event's file until then).
        self.events = []
        for d in (self.drv, cudaipc.driver(path)):
            d.ipc_event = self._tracked(d.ipc_event)

    def _tracked(self, make):
        def ipc_event():
            ev = make()
            self.events.append(ev)
            return ev

        return ipc_event

    def alloc(self, n):
        p = ctypes.c_uint64()
        assert self.lib.cuMemAlloc(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        self.allocs.append(p.value)
        return p.value

    def handle(self, base):
        h = ctypes.create_string_buffer(64)
        assert self.lib.cuIpcGetMemHandle(h, ctypes.c_uint64(base)) == 0
        return h.raw

    def stream(self):
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreateWithPriority(ctypes.byref(s), 0, 0) == 0
        return s.value

    def close(self):
        for ev in self.events:
            if ev.event:
                ev.close()
        self.events = []
        d = cudaipc.driver(self.path)
        d.__dict__.pop("ipc_event", None)
        for p in self.allocs:
            self.lib.cuMemFree(ctypes.c_uint64(p))
        self.allocs = []


@pytest.fixture
def sim(libcuda):
    s = Sim(libcuda)
    yield s
    s.close()


class T:
    """A duck-typed tensor over memory at ptr."""

    def __init__(self, ptr, shape, stride=None, es=2, device="cuda"):
        self.ptr, self.shape, self.es = ptr, tuple(shape), es
        self._stride = tuple(stride) if stride is not None else contiguous(shape)
        self.device = SimpleNamespace(type=device, index=0)

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return self._stride

    def element_size(self):
        return self.es


def contiguous(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


def permuted(shape, order):
    """Strides of a tensor of logical shape allocated in the physical
    dimension order `order` (vLLM's get_kv_cache_stride_order)."""
    phys = contiguous([shape[i] for i in order])
    st = [0] * len(shape)
    for k, i in enumerate(order):
        st[i] = phys[k]
    return tuple(st)


def extra_of(region):
    return S.decode_cuda_extra(region.extra)


def expected_region(sim, starts, pages, allocs, region):
    """Check region against pieces (address, stride, length) in page order
    and the allocations (base, size) they lie in."""
    base = min(a for a, _, _ in starts)
    assert region.kind == S.REGION_CUDA_IPC
    assert region.base == base
    assert region.page_count == pages
    assert region.page_size == sum(n for _, _, n in starts)
    assert region.segments == tuple((a - base, st, n) for a, st, n in starts)
    assert region.length == max(a + st * (pages - 1) + n for a, st, n in starts) - base
    x = extra_of(region)
    assert x.gpu == FAKE_UUID
    assert x.allocations == tuple(S.CUDAAllocation(sim.handle(b), b, n) for b, n in sorted(allocs))
    assert x.event is not None and x.event == region.event.handle and x.event[:4] == b"FEVT"


NB, BS, H, D, ES = 6, 4, 2, 8, 2
BLOCK = BS * H * D * ES  # one block of K (or V) of one layer: 128 bytes


def test_flash_attention_32_allocations(sim):
    # One allocation a layer, [2, blocks, bs, h, d]: K and V of block i are
    # two pieces per layer; the page is the layers in layer-index order
    # ("layers.2" before "layers.10"), whatever order the allocations are
    # in, K then V.
    layers, starts, allocs = {}, {}, []
    for i in range(32):
        p = sim.alloc(2 * NB * BLOCK)
        name = "model.layers.%d.attn" % i
        layers[name] = T(p, (2, NB, BS, H, D))
        starts[name] = [(p, BLOCK, BLOCK), (p + NB * BLOCK, BLOCK, BLOCK)]
        allocs.append((p, GRANULE))
    starts = [s for i in range(32) for s in starts["model.layers.%d.attn" % i]]
    r = from_block_tensors(layers, drv=sim.drv)
    expected_region(sim, starts, NB, allocs, r)
    assert len(r.segments) == 64 and len(extra_of(r).allocations) == 32


def test_nhd_and_hnd_blocks_are_one_piece_per_layer(sim):
    shape = (NB, 2, BS, H, D)
    for order in ((0, 1, 2, 3, 4), (0, 1, 3, 2, 4)):  # NHD, HND
        layers, starts, allocs = {}, [], []
        for i in range(4):
            p = sim.alloc(NB * 2 * BLOCK)
            layers["layers.%d" % i] = T(p, shape, permuted(shape, order))
            starts.append((p, 2 * BLOCK, 2 * BLOCK))
            allocs.append((p, GRANULE))
        r = from_block_tensors(layers, drv=sim.drv)
        expected_region(sim, starts, NB, allocs, r)


def test_hnd_page_is_the_blocks_raw_bytes(sim):
    # HND: a block's bytes are one range, copied raw; page i of the region
    # is block i of every layer, byte for byte.
    shape = (NB, 2, BS, H, D)
    layers, ptrs = {}, []
    for i in range(3):
        p = sim.alloc(NB * 2 * BLOCK)
        data = bytes((i * 7 + k) % 251 for k in range(NB * 2 * BLOCK))
        ctypes.memmove(p, data, len(data))
        layers["layers.%d" % i] = T(p, shape, permuted(shape, (0, 1, 3, 2, 4)))
        ptrs.append(p)
    r = from_block_tensors(layers, drv=sim.drv)
    for page in range(NB):
        got = b"".join(ctypes.string_at(r.base + o + page * st, n) for o, st, n in r.page_segments())
        want = b"".join(ctypes.string_at(p + page * 2 * BLOCK, 2 * BLOCK) for p in ptrs)
        assert got == want


def test_mla(sim):
    layers, starts, allocs = {}, [], []
    page = BS * 576 * ES
    for i in range(4):
        p = sim.alloc(NB * page)
        layers["layers.%d" % i] = T(p, (NB, BS, 576))
        starts.append((p, page, page))
        allocs.append((p, GRANULE))
    r = from_block_tensors(layers, drv=sim.drv)
    expected_region(sim, starts, NB, allocs, r)


def test_cross_layer_tensor_is_one_segment(sim):
    # One tensor of every layer, block outermost (the V1 runner's
    # cross-layer KV cache): a block is one range of one allocation.
    L = 5
    p = sim.alloc(NB * L * 2 * BLOCK)
    r = from_block_tensors({"all": T(p, (NB, L, 2, BS, H, D))}, drv=sim.drv)
    expected_region(sim, [(p, L * 2 * BLOCK, L * 2 * BLOCK)], NB, [(p, GRANULE)], r)


def test_block_outermost_layer_views_join(sim):
    # Per-layer views of a block-outermost buffer (layer l of block b at
    # b * L * page + l * page): pieces that touch join into one segment.
    L, page = 10, 2 * BLOCK
    p = sim.alloc(NB * L * page)
    st = (L * page // ES, BS * H * D, H * D, D, 1)
    layers = {"layers.%d" % i: T(p + i * page, (NB, 2, BS, H, D), st) for i in range(L)}
    r = from_block_tensors(layers, drv=sim.drv)
    expected_region(sim, [(p, L * page, L * page)], NB, [(p, GRANULE)], r)


def test_pieces_in_two_allocations_never_join(sim):
    # Two allocations that happen to be adjacent in the engine's address
    # space are two mappings in the sidecar's: their pieces stay apart.
    a = sim.alloc(GRANULE)
    b = sim.alloc(GRANULE)
    lo, hi = min(a, b), max(a, b)
    if hi != lo + GRANULE:
        pytest.skip("the stand-in's two mappings are not adjacent here")
    # Layer 0: the last block of lo's allocation ends where hi begins.
    nb = 2
    t0 = T(lo + GRANULE - nb * 2 * BLOCK, (nb, 2, BS, H, D))
    t1 = T(hi, (nb, 2, BS, H, D))
    r = from_block_tensors({"a": t0, "b": t1}, drv=sim.drv)
    assert len(r.segments) == 2


def test_shared_layers_are_stored_once(sim):
    p = sim.alloc(NB * 2 * BLOCK)
    t = T(p, (NB, 2, BS, H, D))
    r = from_block_tensors({"layers.0": t, "layers.1": t, "layers.2": [t]}, drv=sim.drv)
    expected_region(sim, [(p, 2 * BLOCK, 2 * BLOCK)], NB, [(p, GRANULE)], r)


def test_store_event_records_on_a_stream(sim):
    p = sim.alloc(NB * 2 * BLOCK)
    r = from_block_tensors({"l": T(p, (NB, 2, BS, H, D))}, drv=sim.drv)
    s = sim.stream()
    r.event.record(s)  # the sidecar's copies wait for this
    r.event.stream = s
    r.event.record()

    # The handle names an interprocess event of this process (the sidecar
    # opens it): it opens in the stand-in, which counts it.
    class Handle(ctypes.Structure):
        _fields_ = [("r", ctypes.c_char * 64)]

    ev = ctypes.c_void_p()
    f = sim.lib.cuIpcOpenEventHandle
    f.argtypes = (ctypes.POINTER(ctypes.c_void_p), Handle)
    assert f(ctypes.byref(ev), Handle.from_buffer_copy(r.event.handle)) == 0
    assert sim.lib.cuEventDestroy(ev) == 0
    r.event.close()


def test_vmm_memory_is_refused_with_its_cause(sim, monkeypatch):
    # PyTorch's expandable segments (cuMemCreate + cuMemMap) cannot be
    # exported with legacy CUDA IPC: the refusal says so.
    monkeypatch.setenv("FAKECUDA_VMM", "1")
    p = sim.alloc(NB * 2 * BLOCK)
    monkeypatch.delenv("FAKECUDA_VMM")
    with pytest.raises(RegionError, match="expandable_segments") as e:
        from_block_tensors({"l": T(p, (NB, 2, BS, H, D))}, drv=sim.drv)
    assert "IS_LEGACY_CUDA_IPC_CAPABLE" in str(e.value)


def test_vmm_export_failure_names_the_call(sim, monkeypatch):
    # Without the pointer attribute, cuIpcGetMemHandle's
    # CUDA_ERROR_INVALID_VALUE is what says it.
    monkeypatch.setenv("FAKECUDA_VMM", "1")
    p = sim.alloc(GRANULE)
    monkeypatch.delenv("FAKECUDA_VMM")
    monkeypatch.setattr(sim.drv, "ipc_capable", lambda ptr: None)
    with pytest.raises(cudaipc.NotShareable, match=r"cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE \(1\).*expandable"):
        sim.drv.ipc_mem_handle(p)


def test_blocks_past_their_allocation_are_refused(sim):
    p = sim.alloc(GRANULE)
    nb = GRANULE // (2 * BLOCK) + 1  # one block more than the allocation holds
    with pytest.raises(RegionError, match="past the end of their allocation"):
        from_block_tensors({"l": T(p, (nb, 2, BS, H, D))}, drv=sim.drv)


def test_no_context_on_the_thread_names_the_call(sim):
    p = sim.alloc(NB * 2 * BLOCK)
    got = []

    def run():
        try:
            from_block_tensors({"l": T(p, (NB, 2, BS, H, D))}, drv=sim.drv)
        except RegionError as e:
            got.append(str(e))

    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert got and "CUDA_ERROR_INVALID_CONTEXT (201)" in got[0] and "cuMemGetAddressRange" in got[0]


def test_driver_resolves_entry_points_at_cuda_12(libcuda):
    d = cudaipc.Driver(libcuda)
    assert d.fn("cuMemGetAddressRange") is not None
    assert d.fn("cuNoSuchCall") is None
    with pytest.raises(cudaipc.CudaError, match="cuNoSuchCall: not found"):
        d.call("cuNoSuchCall")
    assert d.error_name(201) == "CUDA_ERROR_INVALID_CONTEXT"


def test_a_library_without_cuGetProcAddress_v2_is_refused():
    with pytest.raises(cudaipc.CudaError, match="cuGetProcAddress_v2"):
        cudaipc.Driver("libc.so.6")


def test_driver_env(libcuda, monkeypatch):
    monkeypatch.setenv(cudaipc.LIB_ENV, libcuda)
    assert cudaipc.driver().path == libcuda


# -- layouts, without a driver ----------------------------------------------------


def test_memory_runs_sorts_dimensions_by_stride():
    shape = (2, BS, H, D)
    assert memory_runs(shape, permuted(shape, (0, 2, 1, 3)), 2) == [(0, 2 * BS * H * D * 2)]
    # Heads outermost in a layer-major buffer (vLLM's LHBNC): one piece a head.
    assert memory_runs((H, BS, D), (NB * BS * D, D, 1), 2) == [(h * NB * BS * D * 2, BS * D * 2) for h in range(H)]
    with pytest.raises(RegionError, match="overlap"):
        memory_runs((4, 4), (2, 1), 1)
    with pytest.raises(RegionError, match="stride"):
        memory_runs((4, 4), (0, 1), 1)


def test_host_regions_join_in_address_order():
    # Host tensors: the same page (K and V of a layer in a [2, blocks, ...]
    # tensor are two pieces), the layers in name order.
    bufs = [ctypes.create_string_buffer(2 * NB * BLOCK) for _ in range(3)]
    layers = {"layers.%d" % i: T(ctypes.addressof(b), (2, NB, BS, H, D), device="cpu") for i, b in enumerate(bufs)}
    r = from_block_tensors(layers)
    starts = [(a, BLOCK, BLOCK) for b in bufs for a in (ctypes.addressof(b), ctypes.addressof(b) + NB * BLOCK)]
    base = min(starts)[0]
    assert r.kind == S.REGION_HOST_PROCESS and r.extra == b"" and r.event is None
    assert r.segments == tuple((a - base, st, n) for a, st, n in starts)


def test_more_pieces_than_register_region_takes_are_refused():
    n = S.MAX_SEGMENTS + 1
    buf = ctypes.create_string_buffer(3 * n * 64)
    base = ctypes.addressof(buf)
    # Layer i's 16 bytes of each of 3 blocks at i * 64: pieces that never touch.
    layers = {"layers.%04d" % i: T(base + i * 64, (3, 16), (n * 64, 1), es=1, device="cpu") for i in range(n)}
    with pytest.raises(RegionError, match="at most %d" % S.MAX_SEGMENTS):
        from_block_tensors(layers)
    del layers["layers.%04d" % (n - 1)]
    assert len(from_block_tensors(layers).segments) == S.MAX_SEGMENTS
