// Package gpu is ringside's copy engine: it moves KV bytes between blocks of
// the sidecar's shared-memory pool and pages of memory that an inference
// engine registered. Engine is the backend interface; Host is the CPU
// backend, CUDA the GPU backend (CUDA IPC regions, cuMemcpyBatchAsync;
// cuda.go), and Router combines them by region kind. docs/architecture.md
// ("The copy path") has the ordering rules and the IPC pitfalls.
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
//   - A CUDAIPC region names every device allocation its segments lie in
//     (IPCMem): each segment inside one allocation, no allocation without
//     a segment, none overlapping (Validate); the CUDA backend also bounds
//     each allocation by its own mapping of the handle.
//   - Completion: an accepted Op's done callback runs exactly once, on a
//     backend goroutine, with bytes copied, queueing and copy time, and the
//     error. A failed copy (fault, dead process) is an error wrapping
//     ErrTransfer; the destination's contents are then undefined. Do is the
//     synchronous wrapper. Unregister waits for in-flight ops of the region;
//     Close completes accepted ops.
//
// # What the host backend needs
//
// HostShared regions (another file mapped in the sidecar) are plain copy().
// HostProcess regions are read and written with process_vm_readv(2) and
// process_vm_writev(2) in the engine's address space (Region.PID is the pid as
// seen from the sidecar's pid namespace). The kernel allows this
// only with ptrace access mode PTRACE_MODE_ATTACH_REALCREDS to the target:
// the same uid (and the target not made non-dumpable), or CAP_SYS_PTRACE,
// and Yama's kernel.yama.ptrace_scope must permit it: 0 allows same-uid
// peers, 1 only descendants (or a PR_SET_PTRACER exception set by the
// engine), 2 requires CAP_SYS_PTRACE, 3 forbids it. A denied request fails
// with EPERM.
//
// In Kubernetes this matters: the sidecar and the engine are separate
// containers, so the pod needs shareProcessNamespace: true for the sidecar
// to see the engine's pid at all, both containers must run as the same uid
// (runAsUser), and since the sidecar is not the engine's ancestor, a node
// with ptrace_scope=1 (the Ubuntu default) also needs either the engine to
// call prctl(PR_SET_PTRACER, sidecar pid) or the sidecar to be granted
// CAP_SYS_PTRACE, which baseline Pod Security rejects (it is not in the
// allowed add list). Prefer HostShared regions where the engine can place
// its KV in a shared file.
//
// # Layout
//
// All system calls and unsafe live in gpu/internal: procmem
// (process_vm_*), cuda (the cgo shim over libcuda.so.1, loaded with
// dlopen), hostmem (anonymous mappings for test and benchmark pools).
// gpu/gputest holds the peer process and the conformance suite run against
// every backend; gpu/copybench is `ringside-bench copy`.
package gpu
