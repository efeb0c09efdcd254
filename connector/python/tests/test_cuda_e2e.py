"""GPU KV caches through a real sidecar running its CUDA copy backend
(--copy.backend=cuda) on the stand-in driver (gpu/gputest/testdata/fakecuda.c,
found through LD_LIBRARY_PATH): the regions are what from_block_tensors
makes of simulator memory (test_cuda_region.py), registered, stored and
loaded with the client as the vLLM worker does it, and the bytes compared.
"""

import ctypes
import os
import time

import pytest
from test_cuda_region import BLOCK, BS, D, H, Sim, T, libcuda  # noqa: F401 - libcuda: a fixture

from ringside import schema as S
from ringside.plugin.region import from_block_tensors

NB = 8
LAYERS = 32
PAGE = LAYERS * 2 * BLOCK  # 8 KiB


@pytest.fixture
def sim(libcuda):  # noqa: F811 - the fixture of the same name
    s = Sim(libcuda)
    yield s
    s.close()


@pytest.fixture
def cuda_sidecar(start_sidecar, libcuda, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    return start_sidecar(pool="4MiB", slot="16KiB", args=["--copy.backend=cuda"])


def kv_cache(sim, fill=None):
    """32 layers, one allocation each, FlashAttention's [2, blocks, bs, h, d]."""
    layers, ptrs = {}, []
    for i in range(LAYERS):
        p = sim.alloc(2 * NB * BLOCK)
        if fill is not None:
            data = bytes((fill * 131 + i * 17 + k * 7) % 251 for k in range(2 * NB * BLOCK))
        else:
            data = bytes(2 * NB * BLOCK)
        ctypes.memmove(p, data, len(data))
        layers["model.layers.%d.self_attn.attn" % i] = T(p, (2, NB, BS, H, D))
        ptrs.append(p)
    return layers, ptrs


def block(ptr, kv, b):
    return ctypes.string_at(ptr + (kv * NB + b) * BLOCK, BLOCK)


def test_32_allocations_store_and_load_byte_exact(cuda_sidecar, sim):
    src_layers, src = kv_cache(sim, fill=1)
    dst_layers, dst = kv_cache(sim)
    r_src = from_block_tensors(src_layers, drv=sim.drv)
    r_dst = from_block_tensors(dst_layers, drv=sim.drv)
    assert len(S.decode_cuda_extra(r_src.extra).allocations) == LAYERS
    s = cuda_sidecar.attach(instance="cuda-e2e")
    r_src.register(s, 1)
    r_dst.register(s, 2)
    digests = [bytes([b + 1]) * 32 for b in range(NB)]
    assert s.put_hashes(1, b"".join(digests)) == NB
    stream = sim.stream()
    r_src.event.record(stream)  # what wait_for_save does before its Store
    pages = [3, 0, 7, 1, 2, 6, 5, 4]  # blocks 0.. of the batch from these engine blocks
    rep = s.store(1, 0, NB, 1, pages)
    assert rep.status == 0 and rep.stored == NB, rep
    lease = s.acquire(1, 0, NB)
    assert lease.blocks == NB, lease
    into = [5, 6, 7, 0, 1, 2, 3, 4]
    assert s.load(lease.lease, 2, 0, into) == NB
    s.release(lease.lease)
    for i in range(LAYERS):
        for j in range(NB):
            for kv in range(2):
                assert block(dst[i], kv, into[j]) == block(src[i], kv, pages[j]), (i, j, kv)


def test_a_store_waits_for_the_event(cuda_sidecar, sim, tmp_path, monkeypatch):
    # While the work before the event's record "still runs" (the stand-in
    # keeps the event incomplete while a file exists) the store does not
    # copy; once it completes, the store copies the blocks.
    layers, _ = kv_cache(sim, fill=2)
    r = from_block_tensors(layers, drv=sim.drv)
    s = cuda_sidecar.attach(instance="cuda-event")
    r.register(s, 1)
    s.put_hashes(1, b"".join(bytes([0x40 + b]) * 32 for b in range(NB)))
    hold = tmp_path / "hold"
    hold.write_bytes(b"")
    monkeypatch.setenv("FAKECUDA_EVENT_HOLD", str(hold))
    r.event.record(sim.stream())
    seq = s.submit(S.TYPE_STORE, S.encode_store(1, 0, NB, 1, list(range(NB))))
    time.sleep(0.3)
    assert s.try_reply(seq) is None, "the store finished before the event completed"
    hold.unlink()
    rep = S.decode_store_reply(s.await_reply(seq, timeout=10))
    assert rep.status == 0 and rep.stored == NB, rep


def test_a_region_past_its_allocations_is_refused(cuda_sidecar, sim):
    # The sidecar bounds every segment by its allocation: a region whose
    # extra names a smaller allocation than its pages need is refused.
    layers, _ = kv_cache(sim, fill=3)
    r = from_block_tensors(layers, drv=sim.drv)
    x = S.decode_cuda_extra(r.extra)
    a = x.allocations[0]
    small = [(a.handle, a.base, BLOCK)] + [tuple(b) for b in x.allocations[1:]]
    bad = S.encode_cuda_extra(x.gpu, small, event=x.event)
    s = cuda_sidecar.attach(instance="cuda-bounds")
    with pytest.raises(S.RingsideError) as e:
        s.register_region(1, r.base, r.length, r.page_size, r.page_count, r.segments, kind=r.kind, extra=bad)
    assert e.value.status == S.Status.OUT_OF_RANGE, e.value
