package sidecar

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// scheduler runs copies on the copy engine fairly between sessions: each
// copy is split into chunks of at most chunkBytes, each session's chunks
// wait in a queue of their own, and the engine is given chunks round robin
// over the sessions that have some, at most `limit` at a time. A session
// that pipelines huge loads therefore delays another session's copy by at
// most one chunk per worker, not by its whole backlog.
//
// A chunk that runs longer than stallAfter (a copy stuck on a page fault
// the client holds, e.g. with userfaultfd) stops counting against the
// limit, so the other sessions keep their workers, and its session gets no
// further chunk until it returns. Nothing here waits while holding mu, and
// no completion ever waits for anything: done callbacks only post results.
type scheduler struct {
	eng        gpu.Engine
	chunkBytes uint64
	base       int // chunks in flight when nothing is stalled
	maxLimit   int // the engine's workers: the most chunks in flight ever
	stallAfter time.Duration

	mu      sync.Mutex
	queues  map[uint64]*sessQueue
	order   []*sessQueue // sessions with queued chunks, round-robin order
	next    int
	running map[*chunk]struct{}
	stalled int
	stop    chan struct{}
	stopped sync.Once
}

type sessQueue struct {
	id      uint64
	chunks  []*chunk
	running int
	stalled int
	queued  bool // in order
}

// copyJob is one Op as the machine asked for it.
type copyJob struct {
	op      gpu.Op
	sess    uint64
	alive   func() bool // false once the region's process is gone
	done    func(gpu.Result, bool)
	mu      sync.Mutex
	left    int
	res     gpu.Result
	exited  bool
	started time.Time
}

type chunk struct {
	job     *copyJob
	pages   []uint32
	offsets []uint64
	started time.Time
	stalled bool
	q       *sessQueue
}

// errCancelled ends the chunks of a session that ended before they ran.
var errCancelled = errors.New("copy cancelled: the session ended before it ran")

func newScheduler(eng gpu.Engine, workers, maxWorkers int, chunkBytes uint64, stallAfter time.Duration) *scheduler {
	s := &scheduler{eng: eng, chunkBytes: chunkBytes, base: workers, maxLimit: maxWorkers, stallAfter: stallAfter,
		queues: map[uint64]*sessQueue{}, running: map[*chunk]struct{}{}, stop: make(chan struct{})}
	go s.watch()
	return s
}

// submit splits op into chunks and queues them for session sess. done is
// called once, when every chunk has ended, with the bytes copied, the
// first error, and whether the process was found gone after the copy.
// pageBytes is the size of one page of the region.
func (s *scheduler) submit(sess uint64, op gpu.Op, pageBytes uint64, alive func() bool, done func(gpu.Result, bool)) {
	per := 1
	if pageBytes > 0 && s.chunkBytes > pageBytes {
		per = int(s.chunkBytes / pageBytes)
	}
	n := (len(op.Pages) + per - 1) / per
	j := &copyJob{op: op, sess: sess, alive: alive, done: done, left: n, started: time.Now()}
	s.mu.Lock()
	q := s.queues[sess]
	if q == nil {
		q = &sessQueue{id: sess}
		s.queues[sess] = q
	}
	for i := 0; i < len(op.Pages); i += per {
		e := min(i+per, len(op.Pages))
		q.chunks = append(q.chunks, &chunk{job: j, pages: op.Pages[i:e], offsets: op.PoolOffsets[i:e], q: q})
	}
	if !q.queued && len(q.chunks) > 0 {
		q.queued = true
		s.order = append(s.order, q)
	}
	s.mu.Unlock()
	s.dispatch()
}

// cancel ends every queued chunk of session sess (those running finish).
func (s *scheduler) cancel(sess uint64) {
	s.mu.Lock()
	q := s.queues[sess]
	var drop []*chunk
	if q != nil {
		drop, q.chunks = q.chunks, nil
		s.forget(q)
	}
	s.mu.Unlock()
	for _, c := range drop {
		s.finish(c, gpu.Result{Err: errCancelled}, false, false)
	}
}

// forget drops q from the scheduler's tables when it holds nothing.
// Caller holds mu.
func (s *scheduler) forget(q *sessQueue) {
	if len(q.chunks) == 0 && q.running == 0 {
		delete(s.queues, q.id)
	}
}

// dispatch starts chunks while there is room, round robin over sessions.
func (s *scheduler) dispatch() {
	for {
		s.mu.Lock()
		var c *chunk
		if len(s.running)-s.stalled < s.base && len(s.running) < s.maxLimit {
			c = s.pick()
		}
		if c != nil {
			c.started = time.Now()
			s.running[c] = struct{}{}
			c.q.running++
		}
		s.mu.Unlock()
		if c == nil {
			return
		}
		if j := c.job; j.alive != nil && !j.alive() {
			s.finish(c, gpu.Result{Err: fmt.Errorf("%w: the region's process has exited", gpu.ErrTransfer)}, true, false)
			continue
		}
		s.start(c)
	}
}

// pick takes the next chunk, round robin. Caller holds mu.
func (s *scheduler) pick() *chunk {
	for tries := len(s.order); tries > 0; tries-- {
		if s.next >= len(s.order) {
			s.next = 0
		}
		q := s.order[s.next]
		if len(q.chunks) == 0 {
			q.queued = false
			s.order = append(s.order[:s.next], s.order[s.next+1:]...)
			s.forget(q)
			continue
		}
		if q.stalled > 0 { // wait for its stuck chunk first
			s.next++
			continue
		}
		c := q.chunks[0]
		q.chunks = q.chunks[1:]
		s.next++
		return c
	}
	return nil
}

// start hands a chunk to the engine. The process is checked before (in
// dispatch) and after the copy: a store is kept only if its process was
// alive at both ends, so its pid cannot have changed hands in between.
func (s *scheduler) start(c *chunk) {
	j := c.job
	op := gpu.Op{Dir: j.op.Dir, Region: j.op.Region, Pages: c.pages, PoolOffsets: c.offsets}
	err := s.eng.Submit(op, func(r gpu.Result) {
		exited := j.alive != nil && !j.alive()
		s.finish(c, r, exited, true)
	})
	if err != nil {
		s.finish(c, gpu.Result{Err: err}, false, false)
	}
}

// finish records a chunk's end, completes the job after its last chunk
// and, when more is set, starts the next chunks.
func (s *scheduler) finish(c *chunk, r gpu.Result, exited, more bool) {
	s.mu.Lock()
	if _, ok := s.running[c]; ok {
		delete(s.running, c)
		c.q.running--
		if c.stalled {
			s.stalled--
			c.q.stalled--
		}
		s.forget(c.q)
	}
	s.mu.Unlock()
	j := c.job
	j.mu.Lock()
	j.res.Bytes += r.Bytes
	j.res.Ranges += r.Ranges
	j.res.Calls += r.Calls
	j.res.Queued += r.Queued
	j.res.Elapsed += r.Elapsed
	if r.Err != nil && j.res.Err == nil {
		j.res.Err = r.Err
	}
	j.exited = j.exited || exited
	j.left--
	last := j.left == 0
	j.mu.Unlock()
	if last {
		j.done(j.res, j.exited)
	}
	if more {
		s.dispatch()
	}
}

// watch marks chunks that run too long as stalled, freeing their worker's
// place in the limit for the other sessions.
func (s *scheduler) watch() {
	t := time.NewTicker(max(s.stallAfter/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.mu.Lock()
		more := false
		for c := range s.running {
			if !c.stalled && time.Since(c.started) > s.stallAfter {
				c.stalled = true
				c.q.stalled++
				s.stalled++
				more = true
			}
		}
		s.mu.Unlock()
		if more {
			s.dispatch()
		}
	}
}

// stats reports chunks in flight, stalled and queued.
func (s *scheduler) stats() (running, stalled, queued int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, q := range s.queues {
		queued += len(q.chunks)
	}
	return len(s.running), s.stalled, queued
}

func (s *scheduler) close() { s.stopped.Do(func() { close(s.stop) }) }

// waitSession waits until session sess has no chunk queued or running, or
// deadline passes.
func (s *scheduler) waitSession(sess uint64, deadline time.Time) {
	for time.Now().Before(deadline) {
		s.mu.Lock()
		_, busy := s.queues[sess]
		s.mu.Unlock()
		if !busy {
			return
		}
		time.Sleep(time.Millisecond)
	}
}
