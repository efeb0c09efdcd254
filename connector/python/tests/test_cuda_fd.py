"""GPU memory shared by POSIX file descriptor (REGION_CUDA_FD,
docs/protocol.md section 5.5.2) through a real sidecar running its CUDA copy
backend (``ringside serve --copy.backend=cuda``) on the stand-in driver
(gpu/gputest/testdata/fakecuda.c, found through LD_LIBRARY_PATH).

The KV cache is allocated the way vLLM 0.34's extensible KV cache allocates
it for a connector that declares ``KVCacheAccess.EXPORTS_FD``
(vllm/v1/worker/extensible_kv_cache.py, vllm/utils/extensible_tensor.py,
vllm/utils/vmm_driver.py): one address reservation for the whole capacity,
divided into one segment per layer padded to the granularity
(``pad_kv_cache_segments`` with ``registers_memory``), each segment's
committed prefix backed by one physical allocation (``commit`` with
``defragment``) created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
mapped and made readable and writable; the layout LBHNC, so that a layer's
block is one contiguous page. (test_cuda_fd_vllm.py runs vLLM 0.34's own
code for it.) The worker's path: from_block_tensors makes a REGION_CUDA_FD
region of it, whose registration exports one descriptor per allocation,
sends them in a RegionDescriptors message and closes them.
"""

import ctypes
import os
import socket
import threading

import pytest
from test_cuda_region import Sim, T, libcuda  # noqa: F401 - libcuda: a fixture
from test_cuda_vmm import FABRIC, GRAN, POSIX_FD, Vmm

from ringside import schema as S
from ringside.plugin import cudaipc
from ringside.plugin.region import RegionError, from_block_tensors

H, N, C = 2, 16, 64  # heads, tokens per block, content (K and V) per token: 2-byte elements
PAGE = H * N * C * 2  # one layer's block: 4 KiB


def round_up(n, m):
    return (n + m - 1) // m * m


class VmmKV:
    """A KV cache in VMM memory, as vLLM 0.34 allocates it for EXPORTS_FD
    (see the module doc): layers × capacity blocks reserved, commit(n)
    backing the first n blocks of every layer with one allocation each."""

    def __init__(self, vmm, layers, capacity, types=POSIX_FD):
        self.vmm, self.layers, self.capacity, self.types = vmm, layers, capacity, types
        self.seg = round_up(capacity * PAGE, GRAN)  # pad_kv_cache_segments: each layer from a granule
        self.base = vmm.reserve(layers * self.seg)
        self.chunks = []  # (address, size, handle)
        self.blocks = 0

    def commit(self, blocks):
        """Back the first blocks of every layer, each layer's with one
        allocation (a commit with defragment remaps: contents discarded)."""
        self.release()
        n = round_up(blocks * PAGE, GRAN)
        for i in range(self.layers):
            r, h = self.vmm.create(n, self.types)
            assert r == 0, r
            p = self.base + i * self.seg
            self.vmm.ok("cuMemMap", p, n, 0, h, 0)
            assert self.vmm.grant(p, n) == 0
            self.chunks.append((p, n, h))
        self.blocks = blocks

    def release(self):
        for p, n, h in self.chunks:
            self.vmm.ok("cuMemUnmap", p, n)
            self.vmm.ok("cuMemRelease", h)
        self.chunks = []
        self.blocks = 0

    def close(self):
        self.release()
        self.vmm.ok("cuMemAddressFree", self.base, self.layers * self.seg)

    def tensors(self):
        """What the connector's register_kv_caches gets: per layer, a view
        [blocks, heads, tokens, content] of its committed prefix."""
        return {
            "model.layers.%d.self_attn.attn" % i: T(self.base + i * self.seg, (self.blocks, H, N, C))
            for i in range(self.layers)
        }

    def page(self, layer, block):
        return ctypes.string_at(self.base + layer * self.seg + block * PAGE, PAGE)

    def fill(self, tag):
        for i in range(self.layers):
            data = bytes((tag * 131 + i * 17 + k * 7) % 251 for k in range(self.blocks * PAGE))
            ctypes.memmove(self.base + i * self.seg, data, len(data))


@pytest.fixture
def sim(libcuda, monkeypatch):  # noqa: F811 - the fixture of the same name
    monkeypatch.delenv("FAKECUDA_IMEX", raising=False)
    s = Sim(libcuda)
    s.vmm = Vmm(libcuda)
    yield s
    s.close()


@pytest.fixture
def kvs(sim):
    made = []

    def make(layers=8, capacity=16, blocks=16, types=POSIX_FD):
        kv = VmmKV(sim.vmm, layers, capacity, types)
        made.append(kv)
        kv.commit(blocks)
        return kv

    yield make
    for kv in made:
        kv.close()


@pytest.fixture
def cuda_sidecar(start_sidecar, libcuda, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    return start_sidecar(pool="4MiB", slot="64KiB", args=["--copy.backend=cuda"])


def fds_of(pid="self"):
    return len(os.listdir("/proc/%s/fd" % pid))


def digests(tag, n):
    return b"".join(bytes([tag, b]) * 16 for b in range(n))


def test_the_region_is_shared_by_file_descriptor(sim, kvs):
    kv = kvs(layers=4)
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    assert r.kind == S.REGION_CUDA_FD and r.page_count == 16 and r.page_size == 4 * PAGE
    x = S.decode_fd_extra(r.extra)
    assert [(a.index, a.base, a.size) for a in x.allocations] == [(i, p, n) for i, (p, n, _) in enumerate(kv.chunks)]
    assert x.event == r.event.handle
    # Exporting: one descriptor per allocation, and the handles retained
    # for them released with them.
    before = fds_of()
    exp = r.exporter.export()
    assert len(exp.fds) == 4 and len(exp.handles) == 4 and fds_of() == before + 4
    exp.close()
    exp.close()  # once: a second close closes nothing
    assert fds_of() == before and not exp.fds and not exp.handles


def test_stores_and_loads_byte_exact(cuda_sidecar, sim, kvs):
    src, dst = kvs(layers=8), kvs(layers=8)
    src.fill(3)
    r_src = from_block_tensors(src.tensors(), drv=sim.drv)
    r_dst = from_block_tensors(dst.tensors(), drv=sim.drv)
    s = cuda_sidecar.attach(instance="cuda-fd", timeout=10.0)
    before = fds_of()
    r_src.register(s, 1)
    r_dst.register(s, 2)
    assert fds_of() == before, "the exported descriptors are closed after the registration"
    assert s.put_hashes(1, digests(1, 16)) == 16
    stream = sim.stream()
    r_src.event.record(stream)  # what wait_for_save does before its Store
    pages = [5, 0, 15, 1, 2, 9, 4, 3, 7, 6, 14, 13, 12, 11, 10, 8]
    rep = s.store(1, 0, 16, 1, pages)
    assert rep.status == 0 and rep.stored == 16, rep
    lease = s.acquire(1, 0, 16)
    assert lease.blocks == 16, lease
    into = list(reversed(range(16)))
    assert s.load(lease.lease, 2, 0, into) == 16
    s.release(lease.lease)
    for i in range(8):
        for j in range(16):
            assert dst.page(i, into[j]) == src.page(i, pages[j]), (i, j)
    # Every copy is bounded by the region: page 16 is past it.
    with pytest.raises(S.RingsideError) as e:
        s.store(1, 0, 1, 1, [16])
    assert e.value.status == S.Status.OUT_OF_RANGE
    s.close()


def test_the_sidecar_checks_the_allocations(cuda_sidecar, sim, kvs):
    # A region whose extra declares allocation 0 larger than it is: the
    # sidecar's cuMemMap refuses it (status 6), naming the allocation.
    kv = kvs(layers=2, capacity=1024)  # segments 4 MiB apart, 2 MiB committed in each
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    x = S.decode_fd_extra(r.extra)
    big = [(a.index, a.base, a.size * (2 if a.index == 0 else 1)) for a in x.allocations]
    s = cuda_sidecar.attach(instance="cuda-fd-bounds")
    exp = r.exporter.export()
    try:
        with pytest.raises(S.RingsideError) as e:
            s.register_fd_region(
                1, r.base, r.length, r.page_size, r.page_count, r.segments, S.encode_fd_extra(x.gpu, big), exp.fds
            )
    finally:
        exp.close()
    assert e.value.status == S.Status.OUT_OF_RANGE and "cuMemMap" in e.value.message, e.value
    # The session goes on: the region with its true sizes registers.
    r.register(s, 1)
    s.close()


def test_memory_that_cannot_be_exported_as_a_descriptor_is_refused(sim, kvs, monkeypatch):
    # vLLM 0.34 asks the driver for FABRIC alone wherever an IMEX channel
    # is available, even when the connector asked for descriptors
    # (vllm/utils/vmm_driver.py CudaVmmDriver._make_alloc_prop).
    monkeypatch.setenv("FAKECUDA_IMEX", "1")
    fabric = kvs(layers=2, types=FABRIC)
    with pytest.raises(RegionError, match="FABRIC handle only"):
        from_block_tensors(fabric.tensors(), drv=sim.drv)
    none = kvs(layers=2, types=0)
    with pytest.raises(RegionError, match="created without a shareable handle type"):
        from_block_tensors(none.tensors(), drv=sim.drv)
    # Refused at export too (each registration exports afresh), with
    # nothing left open.
    before = fds_of()
    with pytest.raises(cudaipc.NotShareable, match="FABRIC"):
        cudaipc.export_fds(sim.drv, [fabric.chunks[0][0]])
    assert fds_of() == before


def test_a_sidecar_that_predates_descriptors(sim, kvs, tmp_path, start_sidecar):
    # It reads the RegionDescriptors as an attach request with a wrong magic
    # and answers with an AttachReply of status 1: the client reports
    # UNKNOWN_TYPE (the feature is not there), and its session is untouched.
    sc = start_sidecar()
    s = sc.attach(instance="old-sidecar")
    path = str(tmp_path / "old.sock")
    ln = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ln.bind(path)
    ln.listen(1)

    def old_sidecar():
        c, _ = ln.accept()
        msg, fds, _, _ = socket.recv_fds(c, 65536, 16)
        for fd in fds:
            os.close(fd)
        c.send(
            S.encode_attach_reply(status=S.Status.MALFORMED, message="attach request: magic %#x" % S.DESCRIPTORS_MAGIC)
        )
        c.close()

    t = threading.Thread(target=old_sidecar)
    t.start()
    kv = kvs(layers=2)
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    s.socket_path = path
    with pytest.raises(S.RingsideError) as e:
        r.register(s, 1)
    t.join()
    ln.close()
    assert e.value.status == S.Status.UNKNOWN_TYPE and "predates" in e.value.message, e.value
    assert s.ping(7) == 7
    s.close()
