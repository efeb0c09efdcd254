package sidecar

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// gateEngine is a copy engine whose copies end when the test says: each
// Submit records the op and waits on its own gate.
type gateEngine struct {
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
	s := newScheduler(e, 1, 8, time.Hour)
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
	s := newScheduler(e, 1, 8, 30*time.Millisecond)
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
	s := newScheduler(e, 1, 16, 30*time.Millisecond)
	defer s.close()
	r := &results{errs: map[uint64][]error{}}
	for sess := uint64(1); sess <= maxStalledPerUID; sess++ {
		s.submit(sess, 7, gpu.Op{Region: gpu.Handle(sess), Pages: []uint32{0}}, nil, r.done(sess))
	}
	waitFor(t, "the uid's chunks stuck", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.uidStall[7] == maxStalledPerUID
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
	s := newScheduler(e, 2, 8, time.Hour)
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
	s := newScheduler(e, 1, 8, time.Hour)
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
	waitFor(t, "forgotten", func() bool { s.mu.Lock(); defer s.mu.Unlock(); return len(s.queues) == 0 })
}
