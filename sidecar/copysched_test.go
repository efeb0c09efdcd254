package sidecar

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// gateEngine is a copy engine whose copies end when the test says: each
// Submit records the op and waits on its own gate. It issues each op at
// once (marks Op.Issued), unless hold is set: then it holds them unissued,
// as the CUDA backend holds a store at its engine's event.
type gateEngine struct {
	hold    bool
	mu      sync.Mutex
	started []gpu.Op
	gates   map[gpu.Handle][]chan error
	running int
	peak    int
}

func newGateEngine() *gateEngine { return &gateEngine{gates: map[gpu.Handle][]chan error{}} }

func (e *gateEngine) Name() string                            { return "gate" }
func (e *gateEngine) Register(gpu.Region) (gpu.Handle, error) { return 0, nil }
func (e *gateEngine) Unregister(gpu.Handle) error             { return nil }
func (e *gateEngine) Close() error                            { return nil }

func (e *gateEngine) Submit(op gpu.Op, done func(gpu.Result)) error {
	if !e.hold {
		op.Issued.Mark(time.Now())
	}
	g := make(chan error, 1)
	e.mu.Lock()
	e.started = append(e.started, op)
	e.gates[op.Region] = append(e.gates[op.Region], g)
	e.running++
	e.peak = max(e.peak, e.running)
	e.mu.Unlock()
	go func() {
		err := <-g
		e.mu.Lock()
		e.running--
		e.mu.Unlock()
		done(gpu.Result{Err: err, Bytes: int64(len(op.Pages))})
	}()
	return nil
}

// release ends the oldest running copy of region h.
func (e *gateEngine) release(h gpu.Handle, err error) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.gates[h]) == 0 {
		return false
	}
	g := e.gates[h][0]
	e.gates[h] = e.gates[h][1:]
	g <- err
	return true
}

func (e *gateEngine) startedOf(h gpu.Handle) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, op := range e.started {
		if op.Region == h {
			n++
		}
	}
	return n
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

type results struct {
	mu   sync.Mutex
	errs map[uint64][]error
}

func (r *results) done(sess uint64) func(gpu.Result, bool) {
	return func(res gpu.Result, _ bool) {
		r.mu.Lock()
		r.errs[sess] = append(r.errs[sess], res.Err)
		r.mu.Unlock()
	}
}

func (r *results) count(sess uint64) (ok, failed int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.errs[sess] {
		if e == nil {
			ok++
		} else {
			failed++
		}
	}
	return
}

// TestSchedulerSmallCopyNeverWaits: one worker, session A has a long queue
// of chunks running one at a time; session B's chunk starts at once beside
// A's running one, and A's queue is served round robin with B's.
func TestSchedulerSmallCopyNeverWaits(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{1, 8}, budget{1, 8}, time.Hour)
	defer s.close()
	r := &results{errs: map[uint64][]error{}}
	for i := 0; i < 10; i++ {
		s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
	}
	waitFor(t, "A's first chunk", func() bool { return e.startedOf(1) == 1 })
	s.submit(2, 200, gpu.Op{Region: 2, Pages: []uint32{0}}, nil, r.done(2))
	waitFor(t, "B's chunk beside A's", func() bool { return e.startedOf(2) == 1 })
	if n := e.startedOf(1); n != 1 {
		t.Fatalf("A has %d chunks running on one worker", n)
	}
	e.release(2, nil)
	for i := 0; i < 10; i++ {
		waitFor(t, "A's next chunk", func() bool { return e.release(1, nil) })
	}
	waitFor(t, "all done", func() bool { ok, _ := r.count(1); return ok == 10 })
	if ok, _ := r.count(2); ok != 1 {
		t.Fatal("B's copy did not end")
	}
	if e.peak > 2 {
		t.Fatalf("%d copies ran at once with one worker and two sessions", e.peak)
	}
}

// TestSchedulerStalledChunk: a chunk running past the stall bound frees
// its worker's turn, its session's queued chunks are cancelled and so are
// the new ones until it returns; other sessions go on.
func TestSchedulerStalledChunk(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{1, 8}, budget{1, 8}, 30*time.Millisecond)
	defer s.close()
	r := &results{errs: map[uint64][]error{}}
	for i := 0; i < 5; i++ {
		s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
	}
	waitFor(t, "A's queued chunks cancelled", func() bool { _, f := r.count(1); return f == 4 })
	s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{9}}, nil, r.done(1))
	if _, f := r.count(1); f != 5 {
		t.Fatalf("a new chunk of a session with a stuck one was not cancelled at once (%d failed)", f)
	}
	for i := 0; i < 3; i++ {
		s.submit(2, 200, gpu.Op{Region: 2, Pages: []uint32{uint32(i)}}, nil, r.done(2))
		waitFor(t, "B's chunk", func() bool { return e.release(2, nil) })
	}
	waitFor(t, "B done", func() bool { ok, _ := r.count(2); return ok == 3 })
	e.release(1, nil) // the stuck copy returns
	waitFor(t, "A's stuck chunk", func() bool { ok, _ := r.count(1); return ok == 1 })
	s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{10}}, nil, r.done(1))
	waitFor(t, "A's chunk after the stall", func() bool { return e.release(1, nil) })
	waitFor(t, "A served again", func() bool { ok, _ := r.count(1); return ok == 2 })
	for _, err := range r.errs[1] {
		if err != nil && !errors.Is(err, errStalled) {
			t.Fatalf("cancelled with %v", err)
		}
	}
}

// TestSchedulerStalledUID: a uid with maxStalledPerUID stuck chunks gets
// all its new chunks cancelled, in any session; another uid is served.
func TestSchedulerStalledUID(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{1, 16}, budget{1, 16}, 30*time.Millisecond)
	defer s.close()
	r := &results{errs: map[uint64][]error{}}
	for sess := uint64(1); sess <= maxStalledPerUID; sess++ {
		s.submit(sess, 7, gpu.Op{Region: gpu.Handle(sess), Pages: []uint32{0}}, nil, r.done(sess))
	}
	waitFor(t, "the uid's chunks stuck", func() bool {
		l := s.laneOf(0)
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.uidStall[7] == maxStalledPerUID
	})
	s.submit(50, 7, gpu.Op{Region: 50, Pages: []uint32{0}}, nil, r.done(50))
	if _, f := r.count(50); f != 1 {
		t.Fatal("a new session of a uid at its stall bound got a chunk")
	}
	s.submit(60, 8, gpu.Op{Region: 60, Pages: []uint32{0}}, nil, r.done(60))
	waitFor(t, "another uid's chunk", func() bool { return e.release(60, nil) })
	for sess := uint64(1); sess <= maxStalledPerUID; sess++ {
		e.release(gpu.Handle(sess), nil)
	}
}

// TestSchedulerDeadProcess: a chunk whose process is gone before it starts
// is not copied; one found gone after its copy is reported so.
func TestSchedulerDeadProcess(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{2, 8}, budget{2, 8}, time.Hour)
	defer s.close()
	var exited []bool
	var mu sync.Mutex
	done := func(res gpu.Result, ex bool) {
		mu.Lock()
		exited = append(exited, ex)
		mu.Unlock()
	}
	s.submit(1, 1, gpu.Op{Region: 1, Pages: []uint32{0}}, func() bool { return false }, done)
	alive := true
	var amu sync.Mutex
	s.submit(2, 1, gpu.Op{Region: 2, Pages: []uint32{0}}, func() bool { amu.Lock(); defer amu.Unlock(); return alive }, done)
	waitFor(t, "the live one's copy", func() bool { return e.startedOf(2) == 1 })
	if e.startedOf(1) != 0 {
		t.Fatal("a dead process's chunk was copied")
	}
	amu.Lock()
	alive = false // it dies during the copy
	amu.Unlock()
	e.release(2, nil)
	waitFor(t, "both ends", func() bool { mu.Lock(); defer mu.Unlock(); return len(exited) == 2 })
	if !exited[0] || !exited[1] {
		t.Fatalf("exited = %v, want both true", exited)
	}
}

// TestSchedulerCancel: cancelling a session ends its queued chunks at once.
func TestSchedulerCancel(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{1, 8}, budget{1, 8}, time.Hour)
	defer s.close()
	r := &results{errs: map[uint64][]error{}}
	for i := 0; i < 4; i++ {
		s.submit(1, 1, gpu.Op{Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
	}
	waitFor(t, "first chunk", func() bool { return e.startedOf(1) == 1 })
	s.cancel(1)
	if _, f := r.count(1); f != 3 {
		t.Fatalf("%d cancelled, want 3", f)
	}
	e.release(1, nil)
	waitFor(t, "the running one", func() bool { ok, _ := r.count(1); return ok == 1 })
	waitFor(t, "forgotten", func() bool { return !s.laneOf(1).busy(1) })
}

// cudaRegion is a CUDA IPC region on the GPU whose UUID starts with dev.
func cudaRegion(dev byte) gpu.Region {
	r := gpu.Region{Kind: gpu.CUDAIPC}
	r.IPC.GPU[0] = dev
	return r
}

var hostRegion = gpu.Region{Kind: gpu.HostProcess}

// endChunks ends the running copies of regions hs, one at a time, until n of
// session sess's chunks have ended.
func endChunks(t *testing.T, e *gateEngine, r *results, sess uint64, n int, hs ...gpu.Handle) {
	t.Helper()
	waitFor(t, "the session's chunks", func() bool {
		if ok, failed := r.count(sess); ok+failed == n {
			return true
		}
		for _, h := range hs {
			e.release(h, nil)
		}
		return false
	})
}

// TestSchedulerBudgetByKind: a region's chunks run as many at a time as
// its kind's budget says, whatever the other budget is, and a region the
// scheduler was not told of is host memory.
func TestSchedulerBudgetByKind(t *testing.T) {
	for _, tt := range []struct {
		name       string
		host, cuda budget
		region     gpu.Region
		kind       gpu.Kind
		want       int
	}{
		{"host region: the host budget", budget{2, 16}, budget{5, 40}, hostRegion, gpu.HostProcess, 2},
		{"cuda region: the cuda budget", budget{2, 16}, budget{5, 40}, cudaRegion(1), gpu.CUDAIPC, 5},
		{"cuda budget past the host's most", budget{1, 1}, budget{6, 48}, cudaRegion(1), gpu.CUDAIPC, 6},
		{"host budget past the cuda's most", budget{6, 48}, budget{1, 1}, hostRegion, gpu.HostProcess, 6},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newGateEngine()
			s := newScheduler(e, tt.host, tt.cuda, time.Hour)
			defer s.close()
			s.route(1, tt.region)
			if k := s.kind(1); k != tt.kind {
				t.Fatalf("kind %v, want %v", k, tt.kind)
			}
			r := &results{errs: map[uint64][]error{}}
			const n = 20
			for i := range n {
				s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
			}
			if got := e.startedOf(1); got != tt.want {
				t.Fatalf("%d chunks started, want %d", got, tt.want)
			}
			endChunks(t, e, r, 1, n, 1)
			if ok, _ := r.count(1); ok != n {
				t.Fatalf("%d of %d chunks ended well", ok, n)
			}
			if e.peak != tt.want {
				t.Fatalf("%d chunks ran at once, want %d", e.peak, tt.want)
			}
		})
	}
}

// TestSchedulerBudgetPerDevice: each GPU's chunks have a budget of their
// own; a handle forgotten and issued again for host memory is host memory.
func TestSchedulerBudgetPerDevice(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{1, 1}, budget{2, 2}, time.Hour)
	defer s.close()
	s.route(1, cudaRegion(1))
	s.route(2, cudaRegion(2))
	s.route(3, cudaRegion(1))
	s.route(4, hostRegion)
	r := &results{errs: map[uint64][]error{}}
	for i := range 4 {
		for h := gpu.Handle(1); h <= 4; h++ {
			s.submit(uint64(h), 100, gpu.Op{Region: h, Pages: []uint32{uint32(i)}}, nil, r.done(uint64(h)))
		}
	}
	// GPU 1 runs two chunks of regions 1 and 3 (one each: round robin),
	// GPU 2 two of region 2, the host one of region 4.
	for h, want := range map[gpu.Handle]int{1: 1, 2: 2, 3: 1, 4: 1} {
		if got := e.startedOf(h); got != want {
			t.Errorf("region %d: %d chunks started, want %d", h, got, want)
		}
	}
	for h := gpu.Handle(1); h <= 4; h++ {
		endChunks(t, e, r, uint64(h), 4, 1, 2, 3, 4)
	}
	s.unroute(2)
	if k := s.kind(2); k != gpu.HostProcess {
		t.Fatalf("a forgotten handle is %v", k)
	}
	s.route(2, hostRegion)
	s.submit(9, 100, gpu.Op{Region: 2, Pages: []uint32{0}}, nil, r.done(9))
	s.submit(9, 100, gpu.Op{Region: 4, Pages: []uint32{0}}, nil, r.done(9))
	if a, b := e.startedOf(2), e.startedOf(4); a != 5 || b != 4 {
		t.Fatalf("a handle issued again for host memory is still in GPU 2's budget: %d and %d started", a, b)
	}
	endChunks(t, e, r, 9, 2, 2, 4)
}

// TestSchedulerFullBudgetDelaysNoOther: with one budget full, the other's
// chunks start at once, of another session or of the same.
func TestSchedulerFullBudgetDelaysNoOther(t *testing.T) {
	for _, tt := range []struct {
		name        string
		full, other gpu.Region
	}{
		{"host full, cuda starts", hostRegion, cudaRegion(1)},
		{"cuda full, host starts", cudaRegion(1), hostRegion},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newGateEngine()
			s := newScheduler(e, budget{1, 1}, budget{1, 1}, time.Hour)
			defer s.close()
			s.route(1, tt.full)
			s.route(2, tt.other)
			r := &results{errs: map[uint64][]error{}}
			for i := range 4 {
				s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
			}
			s.submit(2, 200, gpu.Op{Region: 1, Pages: []uint32{0}}, nil, r.done(2))
			if got := e.startedOf(1); got != 1 {
				t.Fatalf("%d chunks run in a budget of one", got)
			}
			s.submit(2, 200, gpu.Op{Region: 2, Pages: []uint32{1}}, nil, r.done(2))
			if got := e.startedOf(2); got != 1 {
				t.Fatal("another session's chunk waits for a full budget of the other kind")
			}
			s.submit(1, 100, gpu.Op{Region: 2, Pages: []uint32{1}}, nil, r.done(1))
			e.release(2, nil)
			waitFor(t, "the same session's chunk", func() bool { return e.startedOf(2) == 2 })
			if got := e.startedOf(1); got != 1 {
				t.Fatalf("%d chunks of the full budget started", got)
			}
			e.release(2, nil)
			endChunks(t, e, r, 1, 5, 1)
			endChunks(t, e, r, 2, 2, 1)
		})
	}
}

// TestSchedulerStallStaysInItsBudget: a session's stuck chunk cancels its
// queued chunks of the same budget only; its chunks of the other budget
// run on, as many at a time as before.
func TestSchedulerStallStaysInItsBudget(t *testing.T) {
	for _, tt := range []struct {
		name         string
		stuck, other gpu.Region
	}{
		{"host stuck", hostRegion, cudaRegion(1)},
		{"cuda stuck", cudaRegion(1), hostRegion},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newGateEngine()
			// A stall bound far above how long a released chunk takes to end.
			s := newScheduler(e, budget{1, 8}, budget{1, 8}, 300*time.Millisecond)
			defer s.close()
			s.route(1, tt.stuck)
			s.route(2, tt.other)
			r := &results{errs: map[uint64][]error{}}
			for i := range 3 {
				s.submit(1, 100, gpu.Op{Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
			}
			waitFor(t, "the queued chunks of the stuck one's budget cancelled", func() bool { _, f := r.count(1); return f == 2 })
			for i := range 3 {
				s.submit(1, 100, gpu.Op{Region: 2, Pages: []uint32{uint32(i)}}, nil, r.done(1))
			}
			if got := e.startedOf(2); got != 1 {
				t.Fatalf("%d chunks of the other budget started, want 1", got)
			}
			endChunks(t, e, r, 1, 5, 2)
			if ok, failed := r.count(1); ok != 3 || failed != 2 {
				t.Fatalf("%d ended well, %d failed: the other budget's chunks were cancelled", ok, failed)
			}
			e.release(1, nil)
			waitFor(t, "the stuck chunk", func() bool { ok, _ := r.count(1); return ok == 4 })
		})
	}
}

// TestSchedulerStalledUIDPerBudget: a uid at its bound of stuck chunks in
// one budget has its new chunks of that budget cancelled, not those of the
// other.
func TestSchedulerStalledUIDPerBudget(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{1, 16}, budget{1, 16}, 30*time.Millisecond)
	defer s.close()
	s.route(100, cudaRegion(1))
	r := &results{errs: map[uint64][]error{}}
	for sess := uint64(1); sess <= maxStalledPerUID; sess++ {
		s.submit(sess, 7, gpu.Op{Region: gpu.Handle(sess), Pages: []uint32{0}}, nil, r.done(sess))
	}
	waitFor(t, "the uid's host chunks stuck", func() bool {
		_, stalled, _ := s.stats()
		return stalled == maxStalledPerUID
	})
	s.submit(50, 7, gpu.Op{Region: 50, Pages: []uint32{0}}, nil, r.done(50))
	if _, f := r.count(50); f != 1 {
		t.Fatal("a host chunk of a uid at its stall bound was not cancelled")
	}
	s.submit(51, 7, gpu.Op{Region: 100, Pages: []uint32{0}}, nil, r.done(51))
	if _, f := r.count(51); f != 0 || e.startedOf(100) != 1 {
		t.Fatal("a CUDA chunk of a uid at its host stall bound did not start")
	}
	for sess := uint64(1); sess <= maxStalledPerUID; sess++ {
		e.release(gpu.Handle(sess), nil)
	}
	e.release(100, nil)
	for sess := uint64(1); sess <= maxStalledPerUID; sess++ {
		waitFor(t, "the stuck chunks' ends", func() bool { ok, _ := r.count(sess); return ok == 1 })
	}
}

// TestSchedulerGPUStallCountsFromIssue: on a GPU's lane a chunk's stall
// clock starts when its backend issues the copies (Op.Issued), not when
// the chunk is handed over: a store the CUDA backend holds at its engine's
// event waits for a forward pass, which may take longer than --copy.stall,
// and is no stuck copy. Before, a few such stores put the uid at its stall
// bound, and every later copy of the uid on that GPU was cancelled.
func TestSchedulerGPUStallCountsFromIssue(t *testing.T) {
	e := newGateEngine()
	e.hold = true
	s := newScheduler(e, budget{1, 16}, budget{1, 16}, 20*time.Millisecond)
	defer s.close()
	s.route(100, cudaRegion(1))
	r := &results{errs: map[uint64][]error{}}
	n := maxStalledPerUID + 2
	for sess := uint64(1); sess <= uint64(n); sess++ {
		s.submit(sess, 7, gpu.Op{Region: 100, Pages: []uint32{uint32(sess)}}, nil, r.done(sess))
	}
	waitFor(t, "every chunk handed to the engine", func() bool { return e.startedOf(100) == n })
	time.Sleep(200 * time.Millisecond) // ten stall periods, held by the backend (never issued)
	if _, stalled, _ := s.stats(); stalled != 0 {
		t.Fatalf("%d chunks held by their backend were counted as stalled", stalled)
	}
	s.submit(50, 7, gpu.Op{Region: 100, Pages: []uint32{0}}, nil, r.done(50))
	if _, f := r.count(50); f != 0 {
		t.Fatal("a chunk of the uid was cancelled while its others were only held")
	}
	// One is issued, long ago: that one is stuck.
	e.mu.Lock()
	op := e.started[0]
	e.mu.Unlock()
	if op.Issued == nil {
		t.Fatal("a GPU lane's chunk has no issue clock")
	}
	op.Issued.Mark(time.Now().Add(-time.Second))
	waitFor(t, "the issued chunk stalled", func() bool { _, stalled, _ := s.stats(); return stalled == 1 })
	for e.release(100, nil) {
	}
	for sess := uint64(1); sess <= uint64(n); sess++ {
		waitFor(t, "the chunks' ends", func() bool { ok, f := r.count(sess); return ok+f == 1 })
	}
}
