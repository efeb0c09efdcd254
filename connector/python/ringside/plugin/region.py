"""A KV cache described as one sidecar region (protocol.md, RegisterRegion).

A region is ``page_count`` pages of ``page_size`` bytes. Page ``i`` is the
concatenation of its segments, segment ``j`` being ``length`` bytes at
``base + offset + i * stride`` (no segments: page ``i`` is the
``page_size`` bytes at ``base + i * page_size``). Both plugins build one from
strided tensors:

- vLLM (:func:`from_block_tensors`): one tensor per layer whose first
  dimension (or second, after a K/V dimension of 2) is the block; page ``i``
  is block ``i`` of every layer, K and V: the layers in layer-index order
  (:func:`layer_order`), each layer's block as its contiguous pieces in
  address order (pieces that touch joined), copied raw.
- SGLang (:func:`from_page_views`): the host pool's view of page 0, 1 and the
  last; page ``p`` is the contiguous runs of the view of page ``p``.

The tensors are duck-typed (``data_ptr``, ``shape``, ``stride``,
``element_size``, ``device``). GPU memory is exported with the CUDA driver
(cudaipc.py), one IPC handle per device allocation the blocks lie in; memory
of the driver's virtual memory management API (vLLM 0.34's extensible KV
cache), which CUDA IPC cannot export, one POSIX file descriptor per
allocation instead (REGION_CUDA_FD), exported afresh at every registration
and sent with it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..schema import (
    MAX_DESCRIPTORS,
    MAX_SEGMENTS,
    REGION_CUDA_FD,
    REGION_CUDA_IPC,
    REGION_HOST_PROCESS,
    encode_cuda_extra,
    encode_fd_extra,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..client import Session

# Most contiguous pieces a page may be made of (RegisterRegion's bound on
# segments is larger; beyond this a layout is not worth registering).
MAX_RUNS = 1024


class RegionError(ValueError):
    """The memory cannot be described as one region (the reason says why)."""


@dataclass(frozen=True)
class Region:
    """One region: see the module doc. ``segments`` are (offset from base,
    stride, length) in bytes. A CUDA region carries its store ``event``
    (cudaipc.IpcEvent, whose handle is in ``extra``); a REGION_CUDA_FD one
    its ``exporter`` (FdExporter: the allocations whose descriptors each
    registration sends)."""

    base: int
    length: int
    page_size: int
    page_count: int
    segments: tuple = ()
    kind: int = REGION_HOST_PROCESS
    extra: bytes = b""
    event: Any = field(default=None, compare=False, repr=False)
    exporter: Any = field(default=None, compare=False, repr=False)

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
            return Region(
                self.base,
                self.length,
                self.page_size,
                self.page_count,
                (),
                self.kind,
                self.extra,
                self.event,
                self.exporter,
            )
        return self

    def page_segments(self) -> tuple:
        """The segments, with the implied one when there are none."""
        return self.segments or ((0, self.page_size, self.page_size),)

    def register(self, session: Session, region_id: int) -> None:
        """Register it in a client.Session (raises like any session call).
        A REGION_CUDA_FD region exports its allocations' descriptors now,
        sends them with the registration and closes them (and releases the
        handles retained for them) whatever happens; a failure to export
        raises RegionError."""
        if self.kind == REGION_CUDA_FD:
            exp = self.exporter.export()
            try:
                session.register_fd_region(
                    region_id,
                    self.base,
                    self.length,
                    self.page_size,
                    self.page_count,
                    self.segments,
                    self.extra,
                    exp.fds,
                )
            finally:
                exp.close()
            return
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


def memory_runs(shape: Sequence[int], stride: Sequence[int], element_size: int) -> list[tuple[int, int]]:
    """(byte offset, byte length) of the contiguous runs of the elements of
    this shape and stride, in address order (dimensions sorted by stride, so
    a permuted layout whose elements fill one range is one run). Raises
    RegionError for elements that overlap, negative strides, or more than
    MAX_RUNS runs."""
    dims = sorted(((int(st), int(n)) for n, st in zip(shape, stride) if int(n) != 1), reverse=True)
    if any(st <= 0 for st, _ in dims):
        raise RegionError("a block with a zero or negative stride %s/%s" % (tuple(shape), tuple(stride)))
    expect, j = 1, len(dims)
    while j > 0 and dims[j - 1][0] == expect:
        expect *= dims[j - 1][1]
        j -= 1
    span = expect  # elements spanned by the dimensions inside dims[i]
    for st, n in reversed(dims[:j]):
        if st < span:
            raise RegionError("a block whose elements overlap %s/%s" % (tuple(shape), tuple(stride)))
        span = (n - 1) * st + span
    count = 1
    for _, n in dims[:j]:
        count *= n
    if count > MAX_RUNS:
        raise RegionError("a block has more than %d contiguous pieces: %s/%s" % (MAX_RUNS, tuple(shape), tuple(stride)))
    offs = [0]
    for st, n in dims[:j]:
        offs = [o + i * st for o in offs for i in range(n)]
    return [(o * element_size, expect * element_size) for o in sorted(offs)]


def _block_pieces(t: Any, num_blocks: Optional[int], seen: Optional[int]) -> tuple[int, list[tuple[int, int, int]]]:
    """(blocks, [(address, block stride, length)]) of one layer's tensor:
    the contiguous pieces of its block 0 and the stride from each block to
    the next. The block is the first dimension, or the second after a K/V
    dimension of 2 (FlashAttention's [2, blocks, ...]: seen is the block
    count of the layers before, num_blocks the engine's); a block dimension
    of num_blocks * k (kernel blocks of num_blocks manager blocks) is taken
    k at a time."""
    es = int(t.element_size())
    shape, stride = [int(n) for n in t.shape], [int(s) for s in t.stride()]
    if not shape:
        raise RegionError("a KV cache tensor without dimensions")
    ptr = int(t.data_ptr())
    outer = [(0, shape, stride)]
    kv_first = len(shape) >= 2 and shape[0] == 2 and shape[1] != 2
    if num_blocks is not None:
        kv_first = kv_first and shape[1] % num_blocks == 0
    else:
        kv_first = kv_first and (seen is None or shape[1] == seen)
    if kv_first:
        outer = [(kv * stride[0] * es, shape[1:], stride[1:]) for kv in range(2)]
    pieces = []
    nb = outer[0][1][0]
    for off, sh, st in outer:
        nb, bstride, inner_shape, inner_stride = sh[0], st[0], list(sh[1:]), list(st[1:])
        if num_blocks is not None and nb != num_blocks and nb % num_blocks == 0:
            k = nb // num_blocks
            inner_shape, inner_stride = [k] + inner_shape, [bstride] + inner_stride
            nb, bstride = num_blocks, bstride * k
        for o, n in memory_runs(inner_shape, inner_stride, es):
            pieces.append((ptr + off + o, bstride * es, n))
    return nb, pieces


def layer_order(name: str) -> tuple:
    """The sort key of a layer name: its runs of digits as numbers, the
    rest as text, so that "model.layers.2.attn" comes before
    "model.layers.10.attn" (a layer's index, wherever the name has it)."""
    parts = re.split(r"(\d+)", name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def from_block_tensors(kv_caches: Mapping[str, Any], num_blocks: Optional[int] = None, drv: Any = None) -> Region:
    """vLLM's KV cache (layer name -> tensor, or a list/tuple whose first
    element is the tensor) as one region: page i is block i of every layer.
    num_blocks is the engine's block count: a tensor whose block dimension
    is num_blocks * k (vLLM's kernel blocks, k to a block) makes a page of
    k of them, and any other count is refused, so that page i is always
    the block the scheduler calls i. Layers sharing one tensor are stored
    once.

    The page is the layers in layer-index order (layer_order: "layers.2"
    before "layers.10"), each layer's block as its contiguous pieces in
    address order; a piece that begins where the one before it ends, in
    the same device allocation, joins it (a block-outermost layout's
    layers in a row are one segment, a cross-layer tensor is one). Not
    address order across layers: engines that share blocks must lay out a
    page alike, and where the allocator put each layer differs between
    processes; the layer index is the order vLLM packs a block-outermost
    layout's layers in. GPU memory is exported with drv
    (cudaipc.Driver; default: the process's). Raises RegionError."""
    tensors = []
    seen = set()
    for name in sorted(kv_caches, key=layer_order):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            t = t[0]
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        tensors.append((name, t))
    if not tensors:
        raise RegionError("no KV cache tensors")
    devices = {t.device.type for _, t in tensors}
    if len(devices) != 1 or devices - {"cpu", "cuda"}:
        raise RegionError("KV caches on %s are not supported" % sorted(devices))
    starts: list[tuple[int, int, int]] = []
    nb = None
    for name, t in tensors:
        try:
            n, pieces = _block_pieces(t, num_blocks, nb)
        except RegionError as e:
            raise RegionError("layer %s: %s" % (name, e))
        if nb is not None and n != nb:
            raise RegionError("layers disagree on the number of blocks (%s has %d, want %d)" % (name, n, nb))
        nb = n
        starts.extend(sorted(pieces))
    assert nb is not None
    if nb < 1:
        raise RegionError("no blocks")
    if num_blocks is not None and nb != num_blocks:
        raise RegionError(
            "the KV cache tensors hold %d blocks, the engine has %d (nor a multiple of it): "
            "their pages are not the engine's blocks" % (nb, num_blocks)
        )
    if "cuda" not in devices:
        return Region.from_segments(_joined(starts, nb), nb)
    return _cuda_region(tensors, starts, nb, drv)


def _joined(starts: Sequence[tuple[int, int, int]], pages: int, alloc_of: Any = None) -> list[tuple[int, int, int]]:
    """starts in their order, each joined to the one before when it begins
    where that ends with the same stride (and, with alloc_of, lies in the
    same allocation). Raises RegionError for pieces that overlap."""
    by_addr = sorted(starts)
    for (a, _, n), (b, _, _) in zip(by_addr, by_addr[1:]):
        if b < a + n:
            raise RegionError("two KV cache pieces overlap at %#x" % b)
    out: list[tuple[int, int, int]] = []
    for a, st, n in starts:
        if out:
            pa, pst, pn = out[-1]
            joins = pages == 1 or (st == pst and pn + n <= st)
            if a == pa + pn and joins and (alloc_of is None or alloc_of(a) == alloc_of(pa)):
                out[-1] = (pa, pst, pn + n)
                continue
        if pages > 1 and st < n:
            raise RegionError("blocks overlap: a stride of %d bytes for %d-byte pieces" % (st, n))
        out.append((a, st, n))
    if len(out) > MAX_SEGMENTS:
        raise RegionError("a page is %d pieces, RegisterRegion takes at most %d" % (len(out), MAX_SEGMENTS))
    return out


def _cuda_region(tensors: Sequence[tuple[str, Any]], starts: list, nb: int, drv: Any) -> Region:
    """The CUDA region of GPU tensors (see from_block_tensors): CUDA IPC for
    cudaMalloc memory, POSIX file descriptors (REGION_CUDA_FD) for memory of
    the virtual memory management API."""
    ev = None
    try:
        with _engine_device([t for _, t in tensors]):
            if drv is None:
                from . import cudaipc

                drv = cudaipc.driver()
            ordinal = getattr(tensors[0][1].device, "index", None)
            dev = drv.current_device() if ordinal is None else drv.device(ordinal)
            mode = drv.compute_mode(dev)
            if mode == 3:  # CU_COMPUTEMODE_EXCLUSIVE_PROCESS
                raise RegionError(
                    "the GPU is in exclusive-process compute mode: the sidecar cannot open its memory "
                    "(nvidia-smi -c DEFAULT allows it)"
                )
            uuid = drv.device_uuid(dev)
            # The allocation of every piece: its first page's start, and its
            # last page's end in the same allocation. (For VMM memory the
            # driver reports the mapping holding the address: one physical
            # allocation.)
            ranges: dict[int, tuple[int, int]] = {}
            alloc: dict[int, int] = {}
            for a, st, n in starts:
                base, size = drv.address_range(a)
                end = a + st * (nb - 1) + n
                if end > base + size:
                    raise RegionError(
                        "a layer's blocks at %#x..%#x run past the end of their allocation (%#x, %d bytes)"
                        % (a, end, base, size)
                    )
                ranges[base] = (base, size)
                alloc[a] = base
            segs = _joined(starts, nb, alloc.get)
            allocs = sorted(ranges.values())
            legacy = {drv.ipc_capable(b) for b, _ in allocs}
            if False not in legacy:
                handles = [(drv.ipc_mem_handle(b), b, s) for b, s in allocs]
                ev = drv.ipc_event()
                extra = encode_cuda_extra(uuid, handles, event=ev.handle)
                kind, exporter = REGION_CUDA_IPC, None
            elif legacy != {False}:
                raise RegionError(
                    "the KV cache lies partly in cudaMalloc memory and partly in memory of the virtual memory "
                    "management API: one region cannot share both"
                )
            else:
                if len(allocs) > MAX_DESCRIPTORS:
                    raise RegionError(
                        "the KV cache lies in %d driver allocations; one registration carries at most %d descriptors"
                        % (len(allocs), MAX_DESCRIPTORS)
                    )
                from . import cudaipc

                for b, _ in allocs:
                    why = cudaipc.fd_refusal(b, drv.allowed_handle_types(b))
                    if why is not None:
                        raise RegionError(why)
                ev = drv.ipc_event()
                extra = encode_fd_extra(uuid, [(i, b, s) for i, (b, s) in enumerate(allocs)], event=ev.handle)
                kind, exporter = REGION_CUDA_FD, FdExporter(drv, tuple(b for b, _ in allocs))
    except RegionError:
        _close(ev)
        raise
    except Exception as e:  # noqa: BLE001 - never fail the engine's start over the cache
        _close(ev)
        raise RegionError("cannot share the GPU KV cache with the sidecar: %s" % e) from e
    r = Region.from_segments(segs, nb, kind, extra)
    return Region(r.base, r.length, r.page_size, r.page_count, r.segments, r.kind, r.extra, ev, exporter)


class FdExporter:
    """What a REGION_CUDA_FD region's registration exports: the VMM
    allocations mapped at ``bases``, descriptor i being bases[i]'s. Each
    registration exports them afresh (cudaipc.export_fds), in the calling
    thread's CUDA context (the engine's)."""

    def __init__(self, drv: Any, bases: tuple[int, ...]):
        self.drv, self.bases = drv, bases

    def export(self) -> Any:
        """A cudaipc.FdExport of the allocations (close it after sending);
        RegionError when the driver refuses one."""
        from . import cudaipc

        try:
            return cudaipc.export_fds(self.drv, self.bases)
        except cudaipc.CudaError as e:
            raise RegionError("cannot share the GPU KV cache with the sidecar: %s" % e) from e


def _close(ev: Any) -> None:
    if ev is not None:
        try:
            ev.close()
        except Exception:  # noqa: BLE001 - the refusal's own cause is the one to report
            pass


@contextlib.contextmanager
def _engine_device(tensors: Sequence[Any]):
    """For torch tensors: refuse an allocator CUDA IPC cannot export from,
    and make the tensors' device (the engine's context) current while the
    driver is called. Other (duck-typed) tensors: nothing."""
    try:
        import torch
    except ImportError:
        yield
        return
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not ts:
        yield
        return
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        raise RegionError(
            "PyTorch's CUDA allocator is %r: its memory cannot be exported with CUDA IPC "
            "(the native allocator, PYTORCH_CUDA_ALLOC_CONF without backend:cudaMallocAsync, can)" % backend
        )
    idx = {t.device.index for t in ts}
    if len(idx) != 1:
        raise RegionError("KV caches on several GPUs %s" % sorted(idx, key=str))
    torch.cuda.init()
    with torch.cuda.device(ts[0].device):
        torch.cuda.current_device()
        yield


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
