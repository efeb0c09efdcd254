"""vLLM's OffloadingConnector on a CPU-only vLLM, for bench_vllm.py's peers.

vLLM's own CPUOffloadingSpec refuses non-CUDA platforms in get_worker: its
worker copies between the KV cache and host memory with CUDA streams and
cuMemcpyBatchAsync. Everything else (the scheduler-side manager, its LRU, the
connector's store and load planning, the chunk sizing, the host buffers) is
device-agnostic. HostCopySpec is CPUOffloadingSpec with only the device copy
replaced:

- the manager, the sizing and the CPU buffers are CPUOffloadingSpec's and
  CPUOffloadingWorker's own (inherited, unchanged);
- the copy descriptors (source and destination pointer, size) are computed by
  vLLM's own SingleDirectionOffloadingHandler._fill_direct_ops;
- only the copy of those descriptors, done on the GPU's copy engines there,
  is a host copy here (host_copy_batch), run when the transfer is submitted;
  a transfer is complete when submit returns, so get_finished reports it at
  once and wait has nothing to wait for.

Loaded by the connector's kv_connector_extra_config:
{"spec_name": "HostCopySpec", "spec_module_path": "hostcopy_spec"} with
bench/vllm on sys.path (bench_vllm.py puts it there).

``python hostcopy_spec.py`` measures the host copy's bandwidth against one
plain memcpy of the same bytes (bench_vllm.py reports it with the peers).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

_memmove = ctypes.memmove


def host_copy_batch(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> int:
    """The host counterpart of vLLM's swap_blocks_batch: copy sizes[i] bytes
    from address src[i] to dst[i], in order; adjacent descriptors (both sides
    contiguous) are merged into one copy. Returns the bytes copied."""
    n = len(sizes)
    if n == 0:
        return 0
    s = src.astype(np.uint64, copy=False)
    d = dst.astype(np.uint64, copy=False)
    z = sizes.astype(np.uint64, copy=False)
    # Runs: descriptor i+1 continues i on both sides.
    cont = (s[1:] == s[:-1] + z[:-1]) & (d[1:] == d[:-1] + z[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    run_bytes = np.add.reduceat(z, starts)
    for a, b, nb in zip(s[starts].tolist(), d[starts].tolist(), run_bytes.tolist()):
        _memmove(b, a, nb)
    return int(z.sum())


class HostCopyHandler(SingleDirectionOffloadingHandler):
    """SingleDirectionOffloadingHandler with host copies instead of CUDA
    streams: one direction, transfers complete in submission order (each
    before submit returns). Direct layout only (the canonical layout needs
    vLLM's shared mmap region, which CPUOffloadingSpec uses only on CUDA)."""

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
    ):
        # The parent's checks, less "the KV cache is on a GPU".
        assert len(gpu_tensors) == len(cpu_tensors) > 0
        for g, c in zip(gpu_tensors, cpu_tensors):
            assert g.dtype == c.dtype == torch.int8 and g.ndim == c.ndim == 2
            assert g.device.type == c.device.type == "cpu"
            assert c.shape[1] == g.shape[1] * blocks_per_chunk
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._canonical_copy_plans = None
        self._fill_group_ops = self._fill_direct_ops
        self._done: deque[TransferResult] = deque()
        self.copied_bytes = 0
        self.copy_ns = 0

    def transfer_async(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec) and isinstance(dst_spec, BlockIDsLoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        group_sizes, block_indices = gpu_spec.group_sizes, gpu_spec.block_indices
        assert len(group_sizes) == len(block_indices) == len(self.layer_refs_per_group)
        n_ops = self._estimate_max_copy_ops(group_sizes)
        all_src = np.empty(n_ops, dtype=np.int64)
        all_dst = np.empty(n_ops, dtype=np.int64)
        all_sizes = np.empty(n_ops, dtype=np.int64)
        # The descriptors exactly as the parent's transfer_async fills them.
        src_off = dst_off = op_idx = 0
        for g_idx, (group_size, block_idx) in enumerate(zip(group_sizes, block_indices)):
            if group_size == 0:
                continue
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_end = src_off + cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_end = dst_off + cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            assert src_end <= len(src_blocks) and dst_end <= len(dst_blocks)
            op_idx, _ = self._fill_group_ops(
                g_idx,
                group_src=src_blocks[src_off:src_end],
                group_dst=dst_blocks[dst_off:dst_end],
                group_size=group_size,
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=all_src,
                all_dst=all_dst,
                all_sizes=all_sizes,
                op_idx=op_idx,
            )
            src_off, dst_off = src_end, dst_end
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
        t0 = time.perf_counter_ns()
        nbytes = host_copy_batch(all_src[:op_idx], all_dst[:op_idx], all_sizes[:op_idx])
        dt = time.perf_counter_ns() - t0
        self.copied_bytes += nbytes
        self.copy_ns += dt
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=dt * 1e-9))
        return True

    def get_finished(self) -> list[TransferResult]:
        out = list(self._done)
        self._done.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer finished before its submit returned

    def shutdown(self) -> None:
        self._done.clear()
        self.src_tensors = []
        self.dst_tensors = []


class HostCopyWorker(CPUOffloadingWorker):
    """CPUOffloadingWorker (its submit_store/submit_load/get_finished/wait/
    shutdown, inherited) with HostCopyHandlers. The CPU buffers are the
    ones CPUOffloadingWorker allocates without vLLM's shared region:
    torch.zeros((num_cpu_chunks, page * blocks_per_chunk), int8)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int):
        self._mmap_region = None
        gpu_tensors, cpu_tensors = [], []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            gpu_tensors.append(t.tensor.view(torch.int8).view((-1, page)))
            cpu_tensors.append(torch.zeros((num_cpu_chunks, page * blocks_per_chunk), dtype=torch.int8))
        refs = kv_caches.group_data_refs
        self._store_handler = HostCopyHandler(gpu_tensors, cpu_tensors, blocks_per_chunk, refs, True)
        self._load_handler = HostCopyHandler(gpu_tensors, cpu_tensors, blocks_per_chunk, refs, False)


class HostCopySpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose worker copies on the host (see the module doc)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


def bandwidth(page_bytes: Sequence[int] = (8192, 32768), blocks: int = 64, reps: int = 200) -> list[dict]:
    """The store handler's transfer of `blocks` scattered blocks of two
    tensors (layers) of each page size (vLLM's descriptor fill and
    host_copy_batch) against plain memcpys of the same bytes: one memmove per
    page of the same pages (what any host copy of them must do) and one
    memmove of as many contiguous bytes (cache-friendly: an upper bound).
    Best of `reps` each, in GB/s."""
    rows = []
    rng = np.random.default_rng(0)
    for page in page_bytes:
        nblk = 4096
        gpu = [torch.randint(-128, 127, (nblk, page), dtype=torch.int8) for _ in range(2)]
        cpu = [torch.ones((nblk, page), dtype=torch.int8) for _ in range(2)]  # faulted in, as vLLM's zeros are
        refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(2)]]
        h = HostCopyHandler(gpu, cpu, 1, refs, True)
        src_ids = rng.choice(nblk, blocks, replace=False).tolist()
        dst_ids = rng.choice(nblk, blocks, replace=False).tolist()
        pairs = [(cpu[i][b].data_ptr(), gpu[i][a].data_ptr()) for i in range(2) for a, b in zip(src_ids, dst_ids)]
        total = 2 * blocks * page
        a = torch.ones(total, dtype=torch.int8)
        b = torch.ones(total, dtype=torch.int8)
        best = [None, None, None, None]
        for _ in range(reps):
            c0 = h.copy_ns
            t0 = time.perf_counter_ns()
            spec = GPULoadStoreSpec(src_ids, group_sizes=[blocks], block_indices=[0])
            h.transfer_async(0, spec, CPULoadStoreSpec(dst_ids))
            t1 = time.perf_counter_ns()
            for d, s in pairs:
                _memmove(d, s, page)
            t2 = time.perf_counter_ns()
            _memmove(b.data_ptr(), a.data_ptr(), total)
            t3 = time.perf_counter_ns()
            for k, v in enumerate((t1 - t0, h.copy_ns - c0, t2 - t1, t3 - t2)):
                best[k] = v if best[k] is None else min(best[k], v)
        h.get_finished()
        assert all(torch.equal(cpu[i][dst_ids[k]], gpu[i][src_ids[k]]) for i in range(2) for k in range(blocks))
        rows.append(
            {
                "bench": "hostcopy_bandwidth",
                "page_bytes": page,
                "pages": 2 * blocks,
                "bytes": total,
                "transfer_gbps": round(total / best[0], 2),  # descriptors + copy, as the connector runs it
                "host_copy_gbps": round(total / best[1], 2),  # host_copy_batch alone
                "memcpy_same_pages_gbps": round(total / best[2], 2),
                "memcpy_contiguous_gbps": round(total / best[3], 2),
                "host_copy_vs_memcpy_same_pages": round(best[2] / best[1], 3),
            }
        )
    return rows


if __name__ == "__main__":
    import json

    for r in bandwidth():
        print(json.dumps(r))
