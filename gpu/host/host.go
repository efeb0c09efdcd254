package host

import (
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/internal/procmem"
	"github.com/ringside-kv/ringside/gpu/internal/regions"
)

// Options configures New. The zero value is usable.
type Options struct {
	// Workers is the number of copy goroutines (default 2).
	Workers int
	// Queue is the number of accepted ops that may wait for a worker
	// before Submit blocks (default 64).
	Queue int
	// PerRange issues one process_vm_* call per range instead of batching
	// up to IOV_MAX ranges per call (benchmarks: the "per_range" mode).
	PerRange bool
	// ThreadSetup, if set, runs on each worker's own OS thread (the worker
	// goroutine is locked to it) before it copies anything: the sidecar
	// lowers the copy threads' priority there.
	ThreadSetup func()
}

// Engine is the CPU backend: gpu.HostShared regions are copied with
// copy(), gpu.HostProcess regions with process_vm_readv/process_vm_writev,
// batching all ranges of one op into as few system calls as possible.
// Device memory regions (gpu.CUDAIPC, gpu.CUDAFD) are rejected with
// gpu.ErrUnsupported.
type Engine struct {
	pool []byte

	regions regions.Table[*hostRegion]
	jobs    chan hostJob

	workers  sync.WaitGroup
	noMerge  bool // tests and benchmarks: skip MergeRanges
	perRange bool
	setup    func()
}

var _ gpu.Engine = (*Engine)(nil)

type hostRegion struct {
	r        gpu.Region
	inflight sync.WaitGroup
}

type hostJob struct {
	dir       gpu.Direction
	h         gpu.Handle
	reg       *hostRegion
	ranges    []gpu.Range
	submitted time.Time
	done      func(gpu.Result)
}

// New returns a host backend copying to and from pool (the sidecar's
// mapping of the block pool). pool must stay mapped until Close returns.
func New(pool []byte, opts Options) (*Engine, error) {
	if len(pool) == 0 {
		return nil, fmt.Errorf("%w: empty pool", gpu.ErrInvalidOp)
	}
	if opts.Workers <= 0 {
		opts.Workers = 2
	}
	if opts.Queue <= 0 {
		opts.Queue = 64
	}
	h := &Engine{
		pool:     pool,
		regions:  regions.New[*hostRegion](),
		jobs:     make(chan hostJob, opts.Queue),
		perRange: opts.PerRange,
		setup:    opts.ThreadSetup,
	}
	h.workers.Add(opts.Workers)
	for range opts.Workers {
		go h.worker()
	}
	return h, nil
}

// Name returns "host".
func (h *Engine) Name() string { return "host" }

// Supports reports true for gpu.HostProcess and gpu.HostShared.
func (h *Engine) Supports(k gpu.Kind) bool { return k == gpu.HostProcess || k == gpu.HostShared }

// Register validates r and registers it. Device memory regions fail with
// an error wrapping gpu.ErrUnsupported.
func (h *Engine) Register(r gpu.Region) (gpu.Handle, error) {
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if r.Kind.CUDA() {
		return 0, fmt.Errorf("%w: host backend cannot reach %v regions", gpu.ErrUnsupported, r.Kind)
	}
	r.Segments = append([]gpu.Segment(nil), r.Segments...) // caller may reuse theirs
	return h.regions.Add(&hostRegion{r: r})
}

// Unregister removes the region and waits for its in-flight ops.
func (h *Engine) Unregister(hd gpu.Handle) error {
	reg, err := h.regions.Remove(hd)
	if err != nil {
		return err
	}
	reg.inflight.Wait()
	return nil
}

// Submit bounds-checks and plans op, then queues it for a worker.
func (h *Engine) Submit(op gpu.Op, done func(gpu.Result)) error {
	return h.regions.Submit(op, done, func(reg *hostRegion, now time.Time) error {
		ranges, err := gpu.PlanRanges(nil, &reg.r, uint64(len(h.pool)), op.Pages, op.PoolOffsets)
		if err != nil {
			return err
		}
		if !h.noMerge {
			ranges = gpu.MergeRanges(ranges)
		}
		reg.inflight.Add(1)
		// Sending under the table's read lock keeps Close from closing the
		// channel under us; workers never take the lock, so this cannot
		// deadlock.
		h.jobs <- hostJob{dir: op.Dir, h: op.Region, reg: reg, ranges: ranges, submitted: now, done: done}
		return nil
	})
}

// Close stops accepting ops, runs the accepted ones and waits for the
// workers. It is idempotent.
func (h *Engine) Close() error {
	if h.regions.Close() {
		// No Submit is sending: they hold the read lock while they do, and
		// every later one sees the table closed.
		close(h.jobs)
	}
	h.workers.Wait()
	return nil
}

func (h *Engine) worker() {
	defer h.workers.Done()
	if h.setup != nil {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		h.setup()
	}
	for j := range h.jobs {
		start := time.Now()
		res := h.run(j)
		res.Queued = start.Sub(j.submitted)
		res.Elapsed = time.Since(start)
		res.Ranges = len(j.ranges)
		// The callback runs before the op stops counting as in flight, so
		// Unregister returns only after every callback of the region ran.
		j.done(res)
		j.reg.inflight.Done()
	}
}

func (h *Engine) run(j hostJob) gpu.Result {
	r := &j.reg.r
	switch r.Kind {
	case gpu.HostShared:
		var n int64
		for _, rg := range j.ranges {
			p := h.pool[rg.Pool : rg.Pool+rg.Len]
			e := r.Mapped[rg.Engine : rg.Engine+rg.Len]
			if j.dir == gpu.PoolToEngine {
				copy(e, p)
			} else {
				copy(p, e)
			}
			n += int64(rg.Len)
		}
		return gpu.Result{Bytes: n, Calls: len(j.ranges)}
	case gpu.HostProcess:
		prs := make([]procmem.Range, len(j.ranges))
		for i, rg := range j.ranges {
			prs[i] = procmem.Range{Local: rg.Pool, Remote: rg.Engine, Len: rg.Len}
		}
		xfer := procmem.Read
		if j.dir == gpu.PoolToEngine {
			xfer = procmem.Write
		}
		var st procmem.Stats
		var err error
		if h.perRange {
			for i := range prs {
				var s procmem.Stats
				s, err = xfer(r.PID, h.pool, prs[i:i+1])
				st.Bytes += s.Bytes
				st.Calls += s.Calls
				if err != nil {
					break
				}
			}
		} else {
			st, err = xfer(r.PID, h.pool, prs)
		}
		res := gpu.Result{Bytes: st.Bytes, Calls: st.Calls}
		if err != nil {
			res.Err = &gpu.CopyError{Dir: j.dir, Region: j.h, Index: -1, Err: fmt.Errorf("%w: %w", gpu.ErrTransfer, err)}
		}
		return res
	}
	// Register rejects every other kind.
	return gpu.Result{Err: &gpu.CopyError{Dir: j.dir, Region: j.h, Index: -1, Err: fmt.Errorf("%w: kind %v", gpu.ErrUnsupported, r.Kind)}}
}
