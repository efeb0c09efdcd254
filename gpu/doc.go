// Package gpu is ringside's copy engine: it moves KV bytes between blocks of
// the sidecar's shared-memory pool and pages of memory that an inference
// engine registered. This package holds the plain types (Region, Op,
// Handle, Result, the errors), the Engine interface, PlanRanges and the
// Router, and links no cgo and no system call: the state machine in
// sidecar/machine takes its types from here. The backends are gpu/host
// (CPU copies) and gpu/cuda (CUDA IPC regions, cuMemcpyBatchAsync); Router
// combines them by region kind. docs/architecture.md ("The copy path") has
// the ordering rules and the IPC pitfalls.
//
// # What every Engine promises
//
//   - Regions are validated at Register (Region.Validate): non-zero sizes,
//     every page and per-layer segment inside [Base, Base+Length), no uint64
//     overflow. A page of a layered layout is several ranges (Segment i of
//     page p at Base+Offset+p*Stride); its pool block holds the segments back
//     to back, so a pool block is always Region.PageSize bytes.
//   - Submit bounds-checks the whole Op before anything is copied: a page
//     index out of range, a pool offset whose block runs past the pool, or an
//     overflow rejects the Op with a *CopyError wrapping ErrOutOfBounds,
//     ErrUnknownRegion, ErrInvalidOp or ErrUnsupported, and nothing moves.
//     There is no partial unchecked copy. PlanRanges is the shared checker.
//   - Ranges that are contiguous on both sides are merged (MergeRanges;
//     the CUDA backend merges after translating to its own mappings and
//     never across two allocations) before any backend call, and one Op is
//     issued with as few calls as the backend allows (Result.Ranges,
//     Result.Calls report it).
//   - A CUDAIPC or CUDAFD region names every device allocation its
//     segments lie in (IPCMem): each segment inside one allocation, no
//     allocation without a segment, none overlapping (Validate); the CUDA
//     backend also bounds each CUDAIPC allocation by its own mapping of
//     the handle, and maps exactly the declared size of a CUDAFD one.
//   - Completion: an accepted Op's done callback runs exactly once, on a
//     backend goroutine, with bytes copied, queueing and copy time, and the
//     error. A failed copy (fault, dead process) is an error wrapping
//     ErrTransfer; the destination's contents are then undefined. Do is the
//     synchronous wrapper. Unregister waits for in-flight ops of the region;
//     Close completes accepted ops.
//
// # Layout
//
// gpu (this package) has the types and the interface; gpu/host and
// gpu/cuda the backends. All system calls and unsafe live in gpu/internal:
// procmem (process_vm_*), cuda (the cgo shim over libcuda.so.1, loaded with
// dlopen), hostmem (anonymous mappings for test and benchmark pools), and
// regions, the region table both backends keep. gpu/gputest holds the peer
// process and the conformance suite run against every backend, and exports
// what benchmarks need of the internal packages; bench/copybench is
// `ringside-bench copy`.
package gpu
