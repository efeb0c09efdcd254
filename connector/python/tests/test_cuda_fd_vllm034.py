"""vLLM 0.34's own extensible KV cache, shared with a real sidecar by file
descriptor, on the stand-in CUDA driver (gpu/gputest/testdata/fakecuda.c).

vLLM 0.34 has no CPU build: a child process imports its Python sources
(``make vllm-src``, .vllm-src/0.34.0) over the vLLM venv, as
test_vllm_versions.py does, and runs its allocation code as the GPU worker
does for a connector that declares ``KVCacheAccess.EXPORTS_FD``:
``pad_kv_cache_segments`` with ``registers_memory``,
``ExtensibleKVCache(..., export_handle_types=kv_cache_export_handle_types(...))``
(vllm/v1/worker/extensible_kv_cache.py), whose ``ExtensibleTensor`` makes
the driver calls of vllm/utils/vmm_driver.py against the stand-in:
``allocate`` (the null block), warm-up commits (``ensure_kv_cache_blocks``:
a segment grows by more physical allocations), then ``extend_kv_cache``'s
commit with ``defragment`` and ``shrink`` (each segment remapped as one
allocation). What stands in: torch's DLPack views of device memory (no GPU
here) by ctypes views of the same addresses, which the stand-in maps in the
process; ``torch.accelerator.synchronize`` by nothing (the stand-in's copies
are synchronous); and the committed per-layer views by duck-typed tensors
over the segments, shaped as LBHNC lays a layer out.

The connector's worker (WorkerSide) registers the committed views with a
``ringside serve --copy.backend=cuda`` started here; stores and loads are
compared byte for byte after the extension, after a second extension
(register_kv_caches again: the new allocations re-registered on a new
session, without restarting the sidecar), and after sleep mode's release
and recommit (unregister_kv_caches, restore_kv_caches). The sidecar's
descriptors show that it keeps only the current allocations imported, and
none once the worker is gone.
"""

import json
import os
import subprocess

import pytest
from test_cuda_region import libcuda  # noqa: F401 - a fixture

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(TESTS)))
SRC = os.path.join(os.environ.get("RINGSIDE_VLLM_SRC") or os.path.join(REPO, ".vllm-src"), "0.34.0")
VENV_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")

CHILD = r"""
import ctypes, json, os, sys, time
from types import SimpleNamespace

import torch
import vllm
from vllm.config.kv_transfer import KVCacheAccess
from vllm.utils import extensible_tensor as et
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker import extensible_kv_cache as ekc

from ringside import schema as S
from ringside.plugin.config import VLLM, Config
from ringside.vllm.worker import REGION_ID, WorkerSide

sock, sidecar_pid = sys.argv[1], int(sys.argv[2])
assert vllm.__version__ == "0.34.0", vllm.__version__


class HostBytes:
    # ExtensibleTensor's full_view: torch.from_dlpack of device memory needs a
    # GPU; the stand-in maps device memory here, so bytes are zeroed through
    # ctypes at the same addresses.
    def __init__(self, ptr, n):
        self.ptr, self.n = ptr, n

    def __getitem__(self, s):
        return HostBytes(self.ptr + s.start, s.stop - s.start)

    def zero_(self):
        ctypes.memset(self.ptr, 0, self.n)


et.ExtensibleTensor.full_view = lambda self: HostBytes(self.base_ptr, self._max_num_bytes)
torch.accelerator.synchronize = lambda *a, **k: None


class View:
    # A committed layer view: [blocks, heads, tokens, content] at ptr.
    def __init__(self, ptr, shape):
        self.ptr, self.shape = ptr, tuple(shape)
        st, acc = [], 1
        for n in reversed(self.shape):
            st.append(acc)
            acc *= n
        self._stride = tuple(reversed(st))
        self.device = SimpleNamespace(type="cuda", index=0)

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return self._stride

    def element_size(self):
        return 2


LAYERS, CAPACITY, H, N, C = 4, 1024, 2, 16, 64
PAGE = H * N * C * 2
names = ["model.layers.%d.self_attn.attn" % i for i in range(LAYERS)]
layout = KVCacheLayout.LBHNC
cfg = KVCacheConfig(
    num_blocks=CAPACITY,
    kv_cache_tensors=[
        KVCacheTensor(size=LAYERS * CAPACITY * PAGE, layers=names, layer_stride=CAPACITY * PAGE, block_stride=PAGE)
    ],
    kv_cache_groups=[],
)
# What vLLM makes of a connector that declares EXPORTS_FD.
vcfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
    kv_cache_access=lambda: KVCacheAccess.EXPORTS_FD,
    registers_kv_cache_memory=lambda: KVCacheAccess.EXPORTS_FD.needs_single_chunk(),
))
# In the worker torch has made the device's context current; here vLLM's
# own ensure_context does.
from vllm.utils.vmm_driver import get_vmm_driver
get_vmm_driver().ensure_context(0)
types = ekc.kv_cache_export_handle_types(vcfg)
assert types == 1, types  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
cfg = ekc.pad_kv_cache_segments(cfg, layout, et.granule_size(0), registers_memory=ekc.registers_kv_cache_memory(vcfg))
kv = ekc.ExtensibleKVCache(cfg, torch.device("cuda", 0), layout, export_handle_types=types)
kv.allocate(kv.size)  # the null block
kv.commit(200)  # warm-up (ensure_kv_cache_blocks): a granule (2 MiB, 512 pages) per segment
assert kv.buffer.num_physical_chunks == LAYERS
kv.commit(600)  # more: each segment now spans two allocations
assert kv.buffer.num_physical_chunks == 2 * LAYERS, kv.buffer.num_physical_chunks


def views():
    base, blocks = kv.buffer.base_ptr, kv.num_committed_blocks
    return {n: View(base + kv.segment_offsets[i], (blocks, H, N, C)) for i, n in enumerate(names)}


def fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def steady(pid):
    # The count once it stopped moving: a descriptor connection the sidecar
    # answered is closed a moment after the answer.
    prev = None
    while True:
        n = fds(pid)
        if n == prev:
            return n
        prev = n
        time.sleep(0.2)


def fill(tag, blocks):
    for i in range(LAYERS):
        for b in blocks:
            p = kv.buffer.base_ptr + kv.segment_offsets[i] + b * PAGE
            ctypes.memmove(p, bytes([(tag + i * 7 + b) % 251]) * PAGE, PAGE)


def page(i, b):
    return ctypes.string_at(kv.buffer.base_ptr + kv.segment_offsets[i] + b * PAGE, PAGE)


def round_trip(w, tag, src, dst):
    # Store pages src as a batch's blocks, load them into pages dst, compare.
    s = w.link.session
    fill(tag, src)
    w.store_event.record(STREAM)  # what wait_for_save does before its stores
    batch = 1000 + tag
    digests = b"".join(bytes([tag, j]) * 16 for j in range(len(src)))
    assert s.put_hashes(batch, digests) == len(src)
    rep = s.store(batch, 0, len(src), REGION_ID, src)
    assert rep.status == 0 and rep.stored == len(src), rep
    lease = s.acquire(batch, 0, len(src))
    assert lease.blocks == len(src), lease
    assert s.load(lease.lease, REGION_ID, 0, dst) == len(src)
    s.release(lease.lease)
    for i in range(LAYERS):
        for a, b in zip(src, dst):
            assert page(i, b) == page(i, a), (tag, i, a, b)


# The stand-in has no torch stream: the store event is recorded on one of its own.
_lib = ctypes.CDLL(os.environ["RINGSIDE_LIBCUDA"])
_s = ctypes.c_void_p()
assert _lib.cuStreamCreateWithPriority(ctypes.byref(_s), 0, 0) == 0
STREAM = _s.value

out = {}
base_fds = steady(sidecar_pid)
ws = WorkerSide(
    Config.parse({"socket": sock, "reattach_interval": 0.0, "timeout": 10.0}, VLLM),
    dict(instance="vllm034-fd", model="m", layout="l", salt="", world_size=1, digest_width=32),
    0,
    True,
)

# extend_kv_cache: the final size, each segment remapped as one allocation;
# the connector is created then and registers the committed views.
kv.commit(512, defragment=ekc.registers_kv_cache_memory(vcfg), shrink=True)
assert all(kv.buffer.segments_backed_by_one_chunk([512 * PAGE] * LAYERS))
ws.register_kv_caches(views())
assert ws.region is not None and ws.region.kind == S.REGION_CUDA_FD, ws.region
assert ws.region.page_count == 512 and ws.region.page_size == LAYERS * PAGE
gen = ws.link.generation
out["imported_after_first"] = steady(sidecar_pid) - base_fds
round_trip(ws, 1, [0, 5, 511, 200], [10, 11, 12, 13])

# A second extension (the cache re-initialised): new allocations at the
# same addresses, registered again without restarting the sidecar.
kv.commit(1024, defragment=True, shrink=True)
ws.register_kv_caches(views())
assert ws.region.page_count == 1024 and ws.link.generation == gen + 1
out["imported_after_second"] = steady(sidecar_pid) - base_fds
round_trip(ws, 2, [1000, 3, 700], [1023, 512, 600])

# Sleep mode: the memory released and mapped afresh, the registration
# dropped and restored.
ws.unregister_kv_caches()
kv.release_physical()
kv.recommit()
ws.restore_kv_caches()
assert ws.region is not None and ws.link.generation == gen + 2
round_trip(ws, 3, [7, 8], [900, 901])
out["imported_after_sleep"] = steady(sidecar_pid) - base_fds

ws.shutdown()
deadline = time.monotonic() + 5
while fds(sidecar_pid) != base_fds and time.monotonic() < deadline:
    time.sleep(0.01)
out["imported_after_shutdown"] = fds(sidecar_pid) - base_fds
kv.free()
print(json.dumps(out))
"""


def test_vllm_034_extensible_kv_cache_by_descriptor(start_sidecar, libcuda, monkeypatch):  # noqa: F811
    for what, path in (
        ("vLLM 0.34.0's sources", os.path.join(SRC, "vllm", "_version.py")),
        ("the vLLM venv", VENV_PYTHON),
    ):
        if not os.path.exists(path):
            why = "%s are not at %s (make vllm-src, make vllm-venv)" % (what, path)
            if os.environ.get("CI"):
                pytest.fail(why)
            pytest.skip(why)
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    sc = start_sidecar(pool="8MiB", slot="64KiB", args=["--copy.backend=cuda"])
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([SRC, os.path.dirname(TESTS)]),
        RINGSIDE_LIBCUDA=libcuda,
    )
    r = subprocess.run(
        [VENV_PYTHON, "-c", CHILD, sc.sock, str(sc.proc.pid)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # The sidecar's descriptors beyond those it had before: the session's
    # four (its socket, the process's pidfd, two rings) and one per imported
    # allocation (the stand-in keeps a descriptor of each: its "physical
    # memory"): 4 layers, 4 allocations, whatever was registered before.
    assert got == {
        "imported_after_first": 4 + 4,
        "imported_after_second": 4 + 4,
        "imported_after_sleep": 4 + 4,
        "imported_after_shutdown": 0,
    }, got
