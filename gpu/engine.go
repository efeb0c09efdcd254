package gpu

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sort"
	"sync/atomic"
	"time"
)

// Sentinel errors. Every error returned by this package wraps one of them
// (or os.ErrClosed), usually inside a *CopyError.
var (
	// ErrInvalidRegion: a Region failed Validate.
	ErrInvalidRegion = errors.New("gpu: invalid region")
	// ErrUnknownRegion: the Handle is not (or no longer) registered.
	ErrUnknownRegion = errors.New("gpu: unknown region")
	// ErrOutOfBounds: a page index or pool offset lies outside the region
	// or the pool, or an offset computation would overflow.
	ErrOutOfBounds = errors.New("gpu: out of bounds")
	// ErrInvalidOp: the Op is malformed (bad direction, mismatched slices).
	ErrInvalidOp = errors.New("gpu: invalid op")
	// ErrUnsupported: the backend cannot serve this region kind.
	ErrUnsupported = errors.New("gpu: unsupported")
	// ErrTransfer: the copy itself failed (fault, dead process, permission).
	ErrTransfer = errors.New("gpu: transfer failed")
	// ErrDeviceFailed: the GPU's context in this process hit a sticky
	// error (an illegal address, a launch failure and the like): nothing
	// more is issued on it, every op on it fails with this error (which
	// names the GPU and the driver's code), and the process must restart
	// to use the GPU again.
	ErrDeviceFailed = errors.New("gpu: CUDA device failed")
	// ErrFenced: the op was withdrawn (its Fence raised) before the
	// backend issued it; nothing of it was copied.
	ErrFenced = errors.New("gpu: copy withdrawn before it was issued")
)

// Kind says how the engine memory of a Region is reached.
type Kind uint8

const (
	_ Kind = iota
	// HostProcess is ordinary host memory of another process, addressed by
	// PID and virtual address (vLLM's CPU backend). The host backend uses
	// process_vm_readv/process_vm_writev.
	HostProcess
	// HostShared is memory also mapped in the sidecar (another shm file);
	// Region.Mapped is the sidecar's mapping and Base an offset into it.
	HostShared
	// CUDAIPC is device memory another process exported with a CUDA IPC
	// handle (Region.IPC); only the CUDA backend serves it. The host
	// backend rejects it with ErrUnsupported.
	CUDAIPC
	// CUDAFD is device memory another process allocated with the virtual
	// memory management API and shares by POSIX file descriptor, one per
	// allocation (Region.IPC, each allocation's FD); only the CUDA backend
	// serves it.
	CUDAFD
)

// CUDA reports whether k is device memory (CUDAIPC or CUDAFD): the CUDA
// backend's kinds.
func (k Kind) CUDA() bool { return k == CUDAIPC || k == CUDAFD }

func (k Kind) String() string {
	switch k {
	case HostProcess:
		return "host-process"
	case HostShared:
		return "host-shared"
	case CUDAIPC:
		return "cuda-ipc"
	case CUDAFD:
		return "cuda-fd"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Direction of a copy.
type Direction uint8

const (
	_ Direction = iota
	// PoolToEngine loads pool blocks into engine pages.
	PoolToEngine
	// EngineToPool stores engine pages into pool blocks.
	EngineToPool
)

func (d Direction) String() string {
	switch d {
	case PoolToEngine:
		return "load"
	case EngineToPool:
		return "store"
	}
	return fmt.Sprintf("Direction(%d)", uint8(d))
}

// Segment is one contiguous piece of every page in a layered layout.
// Segment i of page p lives at Base + Offset + p*Stride and is Length bytes
// long. In the pool block the segments of a page are stored back to back,
// in slice order.
type Segment struct {
	Offset uint64
	Stride uint64
	Length uint64
}

// Region describes engine KV memory. All addresses are in the engine's
// address space: for HostProcess, virtual addresses in process PID; for
// HostShared, offsets into Mapped; for CUDAIPC and CUDAFD, device
// addresses in the exporter.
//
// Without Segments, page p is the single range [Base+p*PageSize, +PageSize).
// With Segments, page p is one range per segment and PageSize must equal
// the sum of the segment lengths: it is always the size of a pool block.
type Region struct {
	Kind      Kind
	PID       int    // HostProcess (and the CUDA exporter)
	Base      uint64 // start of the region
	Length    uint64 // bytes from Base that pages may touch
	PageSize  uint64 // bytes per page, = pool bytes per page
	PageCount uint32
	Segments  []Segment
	Mapped    []byte // HostShared only: the sidecar's mapping
	IPC       IPCMem // CUDAIPC and CUDAFD only: how to open the exporter's allocations
}

// IPCMem names device memory of another process for a CUDAIPC or CUDAFD
// region: the GPU holding it (its UUID), every device allocation the
// region's segments lie in, and optionally an interprocess event that
// stores wait for.
// Region.Base and the segments are addresses in the exporter's address
// space; the CUDA backend translates them through the allocations. vLLM
// allocates the KV cache one tensor (one cudaMalloc) per layer, so a region
// usually spans many allocations.
type IPCMem struct {
	GPU [16]byte
	// Event is the cudaIpcEventHandle_t of an interprocess event the engine
	// records after writing the pages it then stores; when HasEvent is set,
	// every store's copies wait on the GPU for its latest record.
	Event    [64]byte
	HasEvent bool
	// Allocations are disjoint; each holds at least one segment, and every
	// segment lies inside one of them.
	Allocations []IPCAllocation
}

// IPCAllocation is one device allocation of the exporter: how to open it
// (CUDAIPC: the cudaIpcMemHandle_t of its base; CUDAFD: a file descriptor
// of it, cuMemExportToShareableHandle's), and its base address and size in
// the exporter's address space. The CUDA backend bounds a CUDAIPC
// allocation by the smaller of Size and the size of its own mapping of the
// handle, and maps Size bytes of a CUDAFD allocation (refused if the
// allocation is smaller).
type IPCAllocation struct {
	Handle [64]byte
	// FD is the descriptor of a CUDAFD allocation, in the registering
	// process. Register neither keeps nor closes it: the caller closes it
	// once Register has returned (the imported allocation holds the
	// memory). Unused (0) for CUDAIPC.
	FD   int
	Base uint64
	Size uint64
}

// Validate checks the region's geometry: non-zero sizes, every page and
// segment inside [Base, Base+Length), and no uint64 overflow anywhere. It
// reports every problem found, each wrapping ErrInvalidRegion.
func (r *Region) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidRegion}, args...)...))
	}
	switch r.Kind {
	case HostProcess:
		if r.PID <= 0 {
			bad("host-process region needs a pid, got %d", r.PID)
		}
		if r.Mapped != nil {
			bad("host-process region must not set Mapped")
		}
	case HostShared:
		if r.Mapped == nil {
			bad("host-shared region needs Mapped")
		} else if end, c := bits.Add64(r.Base, r.Length, 0); c != 0 || end > uint64(len(r.Mapped)) {
			bad("host-shared region [%d,+%d) outside mapping of %d bytes", r.Base, r.Length, len(r.Mapped))
		}
	case CUDAIPC, CUDAFD:
		if r.Mapped != nil {
			bad("%v region must not set Mapped", r.Kind)
		}
	default:
		bad("unknown kind %d", uint8(r.Kind))
	}
	if !r.Kind.CUDA() && (len(r.IPC.Allocations) > 0 || r.IPC.HasEvent) {
		bad("%v region must not name CUDA allocations or an event", r.Kind)
	}
	if r.Length == 0 {
		bad("zero length")
	}
	if r.PageSize == 0 {
		bad("zero page size")
	}
	if r.PageCount == 0 {
		bad("zero page count")
	}
	if _, c := bits.Add64(r.Base, r.Length, 0); c != 0 {
		bad("base %#x + length %d overflows", r.Base, r.Length)
	}
	if hi, lo := bits.Mul64(r.PageSize, uint64(r.PageCount)); hi != 0 || lo > r.Length {
		bad("page size %d * page count %d exceeds length %d", r.PageSize, r.PageCount, r.Length)
	}
	if len(r.Segments) > 0 && r.PageCount > 0 {
		var sum uint64
		last := uint64(r.PageCount - 1)
		for i, s := range r.Segments {
			if s.Length == 0 {
				bad("segment %d: zero length", i)
				continue
			}
			var c uint64
			if sum, c = bits.Add64(sum, s.Length, 0); c != 0 {
				bad("segment %d: lengths overflow", i)
				sum = math.MaxUint64
			}
			if r.PageCount > 1 && s.Stride < s.Length {
				bad("segment %d: stride %d < length %d: pages overlap", i, s.Stride, s.Length)
			}
			hi, span := bits.Mul64(last, s.Stride)
			end, c1 := bits.Add64(span, s.Offset, 0)
			end, c2 := bits.Add64(end, s.Length, 0)
			if hi != 0 || c1 != 0 || c2 != 0 || end > r.Length {
				bad("segment %d: offset %d + %d*stride %d + length %d exceeds region length %d",
					i, s.Offset, last, s.Stride, s.Length, r.Length)
			}
		}
		if sum != r.PageSize {
			bad("segment lengths sum to %d, page size is %d", sum, r.PageSize)
		}
	}
	if r.Kind.CUDA() && len(errs) == 0 {
		// The allocation checks need sound geometry: segment spans that
		// do not overflow.
		_, err := r.SegmentAllocations()
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// SegmentSpans returns, per segment (one for a flat region), the bytes
// every page of it touches in the exporter's address space:
// [Base+Offset, Base+Offset+(PageCount-1)*Stride+Length). r must have
// passed the geometry checks of Validate.
func (r *Region) SegmentSpans() [][2]uint64 {
	last := uint64(r.PageCount - 1)
	if len(r.Segments) == 0 {
		return [][2]uint64{{r.Base, r.Base + uint64(r.PageCount)*r.PageSize}}
	}
	out := make([][2]uint64, len(r.Segments))
	for i, s := range r.Segments {
		start := r.Base + s.Offset
		out[i] = [2]uint64{start, start + last*s.Stride + s.Length}
	}
	return out
}

// SegmentAllocations checks a CUDAIPC or CUDAFD region's allocations
// against its segments (docs/protocol.md, RegisterRegion): at least one
// allocation, each with a handle (CUDAIPC) or a descriptor (CUDAFD: a
// non-negative FD and no handle), a non-zero size and no overflow; no two
// overlap;
// every segment span lies inside one allocation; every allocation holds at
// least one segment; an event handle only with HasEvent. It returns the
// allocation index of each segment (of the one span of a flat region), or
// every problem found, each wrapping ErrInvalidRegion.
func (r *Region) SegmentAllocations() ([]int, error) {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidRegion}, args...)...))
	}
	m := &r.IPC
	if !m.HasEvent && m.Event != ([64]byte{}) {
		bad("an event handle without HasEvent")
	}
	if m.HasEvent && m.Event == ([64]byte{}) {
		bad("HasEvent without an event handle")
	}
	if len(m.Allocations) == 0 {
		bad("%v region without an allocation (a handle or descriptor, base and size)", r.Kind)
		return nil, errors.Join(errs...)
	}
	order := make([]int, len(m.Allocations))
	for i, a := range m.Allocations {
		order[i] = i
		switch {
		case r.Kind == CUDAFD && a.FD < 0:
			bad("allocation %d without a descriptor (fd %d)", i, a.FD)
		case r.Kind == CUDAFD && a.Handle != ([64]byte{}):
			bad("allocation %d of a cuda-fd region with an IPC handle", i)
		case r.Kind == CUDAIPC && a.Handle == ([64]byte{}):
			bad("allocation %d without an IPC handle", i)
		}
		if _, c := bits.Add64(a.Base, a.Size, 0); a.Size == 0 || c != 0 {
			bad("allocation %d: base %#x size %d is empty or overflows", i, a.Base, a.Size)
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(m.Allocations[a].Base, m.Allocations[b].Base) })
	for k := 1; k < len(order); k++ {
		p, q := m.Allocations[order[k-1]], m.Allocations[order[k]]
		if p.Base+p.Size > q.Base {
			bad("allocations %d [%#x,+%d) and %d [%#x,+%d) overlap", order[k-1], p.Base, p.Size, order[k], q.Base, q.Size)
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	spans := r.SegmentSpans()
	of := make([]int, len(spans))
	used := make([]bool, len(m.Allocations))
	for i, sp := range spans {
		// The last allocation starting at or below the span's first byte.
		k := sort.Search(len(order), func(k int) bool { return m.Allocations[order[k]].Base > sp[0] }) - 1
		if k < 0 {
			bad("segment %d [%#x,%#x) lies in no allocation", i, sp[0], sp[1])
			continue
		}
		a := m.Allocations[order[k]]
		if end := a.Base + a.Size; sp[0] >= end {
			bad("segment %d [%#x,%#x) lies in no allocation", i, sp[0], sp[1])
			continue
		} else if sp[1] > end {
			bad("segment %d [%#x,%#x) runs past the end of allocation %d [%#x,%#x): a segment must lie inside one allocation",
				i, sp[0], sp[1], order[k], a.Base, end)
			continue
		}
		of[i] = order[k]
		used[order[k]] = true
	}
	segErrs := len(errs)
	for i, u := range used {
		if !u && segErrs == 0 {
			a := m.Allocations[i]
			bad("allocation %d [%#x,+%d) holds no segment", i, a.Base, a.Size)
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return of, nil
}

// Handle names a registered region within one Engine. The zero Handle is
// never issued.
type Handle uint32

// Op is one request: copy len(Pages) pages between the registered region
// and the pool. Pages[i] is an engine page index and PoolOffsets[i] the
// byte offset of its pool block (PageSize bytes). An engine reads the
// slices only during Submit; the caller may reuse them afterwards.
type Op struct {
	Dir         Direction
	Region      Handle
	Pages       []uint32
	PoolOffsets []uint64
	// Fence, if set, withdraws the op while it waits: a backend that
	// queues ops before issuing them (the CUDA backend's device queue)
	// checks it just before it issues the op and, if it is raised, ends
	// the op with ErrFenced without touching either side. An op already
	// issued runs to its end. Backends that issue at once may ignore it.
	Fence *Fence
	// Issued, if set, is marked by a backend that may hold an op before
	// it issues its copies (the CUDA backend gates a store on its engine's
	// event, which may wait for a whole forward pass) when the copies go
	// out, so that a caller timing copies counts from there. A backend
	// that issues at once need not mark it.
	Issued *IssueClock
}

// IssueClock records when an op's copies were issued (Op.Issued). The
// zero value is "not yet". Safe for concurrent use; a nil IssueClock
// ignores Mark.
type IssueClock struct{ ns atomic.Int64 }

// Mark records t as the time the copies were issued.
func (c *IssueClock) Mark(t time.Time) {
	if c != nil {
		c.ns.Store(t.UnixNano())
	}
}

// At returns when the copies were issued, and whether they were.
func (c *IssueClock) At() (time.Time, bool) {
	if c == nil {
		return time.Time{}, false
	}
	ns := c.ns.Load()
	return time.Unix(0, ns), ns != 0
}

// Fence withdraws the ops that carry it (Op.Fence). The zero value is
// down; Raise is for good. Safe for concurrent use; a nil Fence is never
// raised.
type Fence struct{ raised atomic.Bool }

// Raise withdraws every op carrying f that has not been issued yet.
func (f *Fence) Raise() { f.raised.Store(true) }

// Raised reports whether Raise was called.
func (f *Fence) Raised() bool { return f != nil && f.raised.Load() }

// Result reports a completed Op.
type Result struct {
	Bytes   int64         // bytes copied (on error: before the failure)
	Ranges  int           // ranges after merging
	Calls   int           // backend calls (syscalls, driver calls) issued
	Queued  time.Duration // from Submit until the copy started
	Elapsed time.Duration // copy time
	Err     error         // nil on success; a *CopyError otherwise
}

// Engine moves bytes between the pool and registered engine regions.
// All methods are safe for concurrent use.
type Engine interface {
	// Name identifies the backend ("host", "cuda").
	Name() string
	// Register validates r and makes it addressable by the returned Handle.
	// The engine keeps r (including Mapped) until Unregister.
	Register(r Region) (Handle, error)
	// Unregister forgets h. It waits for ops already submitted on h to
	// complete and for their done callbacks to return, so the region's
	// memory may be released once it returns.
	// It must not be called from a done callback.
	Unregister(h Handle) error
	// Submit bounds-checks op completely and, if it is valid, queues it and
	// later calls done exactly once with the outcome. If Submit returns an
	// error, nothing was copied and done is never called. done runs on a
	// backend goroutine and must not block; it must not call Unregister or
	// Close. Submit may block while the queue is full.
	Submit(op Op, done func(Result)) error
	// Close stops accepting ops, completes the ones already accepted (their
	// done callbacks run) and releases the backend. It is idempotent.
	Close() error
}

// KindSupporter is implemented by engines that can say which region kinds
// they serve (all of ringside's do).
type KindSupporter interface {
	Supports(k Kind) bool
}

// Supports reports whether e can register regions of kind k. An engine
// that does not implement KindSupporter is assumed to serve the host kinds.
func Supports(e Engine, k Kind) bool {
	if ks, ok := e.(KindSupporter); ok {
		return ks.Supports(k)
	}
	return k == HostProcess || k == HostShared
}

// Do submits op and waits for it to complete. There is deliberately no
// context: an accepted copy cannot be abandoned while it may still touch
// the pool block, so the caller must wait for it either way.
func Do(e Engine, op Op) (Result, error) {
	ch := make(chan Result, 1)
	if err := e.Submit(op, func(r Result) { ch <- r }); err != nil {
		return Result{Err: err}, err
	}
	r := <-ch
	return r, r.Err
}

// CopyError is the error of a rejected or failed Op.
type CopyError struct {
	Dir    Direction
	Region Handle
	Index  int    // index into Op.Pages, -1 if the error is not about one page
	Page   uint32 // Op.Pages[Index] when Index >= 0
	Err    error  // wraps a sentinel; transfer errors name pid and address
}

func (e *CopyError) Error() string {
	if e.Index >= 0 {
		return fmt.Sprintf("gpu: %v region %d page %d (op index %d): %v", e.Dir, e.Region, e.Page, e.Index, e.Err)
	}
	return fmt.Sprintf("gpu: %v region %d: %v", e.Dir, e.Region, e.Err)
}

func (e *CopyError) Unwrap() error { return e.Err }
