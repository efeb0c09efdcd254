"""A KV cache described as one sidecar region (protocol.md, RegisterRegion).

A region is ``page_count`` pages of ``page_size`` bytes. Page ``i`` is the
concatenation of its segments, segment ``j`` being ``length`` bytes at
``base + offset + i * stride`` (no segments: page ``i`` is the
``page_size`` bytes at ``base + i * page_size``). Both plugins build one from
strided tensors:

- vLLM (:func:`from_block_tensors`): one tensor per layer whose first
  dimension (or second, after a K/V dimension of 2) is the block; page ``i``
  is block ``i`` of every layer, K and V.
- SGLang (:func:`from_page_views`): the host pool's view of page 0, 1 and the
  last; page ``p`` is the contiguous runs of the view of page ``p``.

The tensors are duck-typed (``data_ptr``, ``shape``, ``stride``,
``element_size``, ``device``): torch is only imported for CUDA memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..schema import REGION_CUDA_IPC, REGION_HOST_PROCESS, encode_cuda_extra

# Most contiguous pieces a page may be made of (RegisterRegion's bound on
# segments is larger; beyond this a layout is not worth registering).
MAX_RUNS = 1024


class RegionError(ValueError):
    """The memory cannot be described as one region (the reason says why)."""


@dataclass(frozen=True)
class Region:
    """One region: see the module doc. ``segments`` are (offset from base,
    stride, length) in bytes."""

    base: int
    length: int
    page_size: int
    page_count: int
    segments: tuple = ()
    kind: int = REGION_HOST_PROCESS
    extra: bytes = b""

    @classmethod
    def from_segments(
        cls, starts: Sequence[tuple[int, int, int]], page_count: int, kind: int = REGION_HOST_PROCESS, extra=b""
    ) -> "Region":
        """The region whose page i is, for each (address, stride, length) of
        starts, the length bytes at address + i * stride."""
        if page_count < 1 or not starts:
            raise RegionError("no pages")
        base = min(a for a, _, _ in starts)
        end = max(a + st * (page_count - 1) + n for a, st, n in starts)
        segs = tuple((a - base, st, n) for a, st, n in starts)
        return cls(base, end - base, sum(n for _, _, n in starts), page_count, segs, kind, bytes(extra))

    def compact(self) -> "Region":
        """The same memory with no segment list when it is one run of pages
        laid end to end (what RegisterRegion means by no segments)."""
        if len(self.segments) == 1 and self.segments[0] == (0, self.page_size, self.page_size):
            return Region(self.base, self.length, self.page_size, self.page_count, (), self.kind, self.extra)
        return self

    def page_segments(self) -> tuple:
        """The segments, with the implied one when there are none."""
        return self.segments or ((0, self.page_size, self.page_size),)

    def register(self, session: Any, region_id: int) -> None:
        """Register it in a client.Session (raises like any session call)."""
        session.register_region(
            region_id,
            self.base,
            self.length,
            self.page_size,
            self.page_count,
            self.segments,
            kind=self.kind,
            extra=self.extra,
        )


def contiguous_bytes(shape: Sequence[int], stride: Sequence[int], element_size: int) -> Optional[int]:
    """Bytes of a block of this shape and stride if its elements are
    contiguous (dimensions of size 1 aside), else None."""
    n, expect = 1, 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expect:
            return None
        expect *= size
        n *= size
    return n * element_size


def runs(t: Any) -> Optional[list[tuple[int, int]]]:
    """(byte offset from t.data_ptr(), byte length) of each contiguous run of
    t in row-major order, adjacent runs merged; None if more than MAX_RUNS."""
    es = t.element_size()
    dims = [(int(n), int(st)) for n, st in zip(t.shape, t.stride()) if n != 1]
    expect, j = 1, len(dims)
    while j > 0 and dims[j - 1][1] == expect:
        expect *= dims[j - 1][0]
        j -= 1
    run = expect * es
    count = 1
    for n, _ in dims[:j]:
        count *= n
    if count > MAX_RUNS:
        return None
    offs = [0]
    for n, st in dims[:j]:
        offs = [o + i * st * es for o in offs for i in range(n)]
    out: list[tuple[int, int]] = []
    for o in offs:
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((o, run))
    return out


def from_block_tensors(kv_caches: Mapping[str, Any]) -> Region:
    """vLLM's KV cache (layer name -> tensor, or a list/tuple whose first
    element is the tensor) as one region: page i is block i of every layer.
    Layers sharing one tensor are stored once. Raises RegionError."""
    tensors = []
    seen = set()
    for name in sorted(kv_caches):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            t = t[0]
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors.append((name, t))
    if not tensors:
        raise RegionError("no KV cache tensors")
    devices = {t.device.type for _, t in tensors}
    if len(devices) != 1 or devices - {"cpu", "cuda"}:
        raise RegionError("KV caches on %s are not supported" % sorted(devices))
    starts = []
    num_blocks = None
    for name, t in tensors:
        es = t.element_size()
        shape, stride = tuple(t.shape), tuple(t.stride())
        # The block dimension: CPU layouts put it first; some put K/V first.
        if len(shape) >= 2 and shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks) and shape[1] != 2:
            nb = shape[1]
            per = contiguous_bytes(shape[2:], stride[2:], es)
            if per is not None:
                for kv in range(2):
                    starts.append((t.data_ptr() + kv * stride[0] * es, stride[1] * es, per))
        else:
            nb = shape[0]
            per = contiguous_bytes(shape[1:], stride[1:], es)
            if per is not None:
                starts.append((t.data_ptr(), stride[0] * es, per))
        if per is None:
            raise RegionError("layer %s has a non-contiguous block layout %s/%s" % (name, shape, stride))
        if num_blocks is not None and nb != num_blocks:
            raise RegionError("layers disagree on the number of blocks")
        num_blocks = nb
    region = Region.from_segments(starts, num_blocks)
    if "cuda" in devices:
        try:
            extra = cuda_ipc_extra([t for _, t in tensors], region.base)
        except Exception as e:  # noqa: BLE001 - never fail the engine's start over the cache
            raise RegionError("cannot share the GPU KV cache with the sidecar (%s)" % e) from e
        region = Region(
            region.base, region.length, region.page_size, region.page_count, region.segments, REGION_CUDA_IPC, extra
        )
    return region


def cuda_ipc_extra(tensors: Sequence[Any], base: int) -> bytes:
    """The RegisterRegion extra bytes of a GPU KV cache: the CUDA IPC handle
    of the one allocation holding every layer (deduplicated by allocation),
    the GPU's UUID and the offset of ``base`` in that allocation.

    Not verified on a GPU yet (none was available to the project so far).
    Memory that CUDA IPC cannot share (PyTorch expandable segments, vLLM's
    sleep-mode allocator) makes _share_cuda_ fail, and the engine then runs
    without the cache."""
    import torch

    allocs = {}
    device = None
    for t in tensors:
        st = t.untyped_storage()
        dev, handle, _size, offset = st._share_cuda_()[:4]
        alloc_base = st.data_ptr() - int(offset)
        allocs.setdefault(alloc_base, bytes(handle))
        device = dev
    if len(allocs) != 1:
        raise ValueError(
            "the KV cache spans %d allocations; ringside needs all layers of a rank in one "
            "allocation (vLLM's default single KV buffer)" % len(allocs)
        )
    ((alloc_base, handle),) = allocs.items()
    if len(handle) != 64:
        raise ValueError("CUDA IPC handle of %d bytes, want 64" % len(handle))
    uuid = torch.cuda.get_device_properties(device).uuid
    raw = getattr(uuid, "bytes", None) or bytes(uuid)
    if len(raw) != 16:
        raise ValueError("GPU UUID of %d bytes, want 16" % len(raw))
    return encode_cuda_extra(raw, [(handle, alloc_base, int(_size))])


def from_page_views(v0: Any, v1: Any, vlast: Any, page_count: int) -> Region:
    """A region from the views of pages 0, 1 and page_count-1 of a pool
    (SGLang's get_data_page(.., flat=False)); v1 and vlast are unused when
    page_count is 1. Raises RegionError."""
    r = runs(v0)
    if r is None:
        raise RegionError("a page has more than %d contiguous pieces: %s/%s" % (MAX_RUNS, tuple(v0.shape), v0.stride()))
    p0 = v0.data_ptr()
    stride = 0
    if page_count > 1:
        stride = v1.data_ptr() - p0
        for v in (v1, vlast):
            if v.shape != v0.shape or v.stride() != v0.stride():
                raise RegionError("pages differ in shape")
        if stride <= 0 or vlast.data_ptr() != p0 + (page_count - 1) * stride:
            raise RegionError("pages are not evenly spaced")
        if any(length > stride for _, length in r):
            raise RegionError("pages overlap")
    starts = [(p0 + o, stride if page_count > 1 else length, length) for o, length in r]
    region = Region.from_segments(starts, page_count)
    if v0.numel() * v0.element_size() != region.page_size:
        raise RegionError("a page's pieces overlap")
    return region.compact()
