package sidecar

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// scheduler runs copies on the copy engine fairly between sessions. The
// machine splits every Load and Store into chunks of at most
// --copy.chunk-bytes; each session's chunks wait in a queue of its own, and
// the engine is given chunks round robin over the sessions that have some,
// `base` at a time, plus one for each session that has none running. A session that pipelines huge loads therefore
// delays another session's copy by at most one chunk per worker, not by its
// whole backlog.
//
// A chunk that runs longer than stallAfter (a copy stuck on a page fault
// the client holds, e.g. with userfaultfd, or on a process that stopped) is
// stalled: it stops counting against `base`, so the other sessions keep
// their workers, and its session's queued chunks are cancelled, as are the
// new ones it submits until the stuck chunk returns. A uid with
// maxStalledPerUID stuck chunks has all its new chunks cancelled. A stuck
// chunk therefore holds the slots of one chunk, never a session's backlog.
// Nothing here waits while holding mu, and no completion waits for
// anything: done callbacks only post results.
type scheduler struct {
	eng        gpu.Engine
	base       int // chunks in flight when nothing is stalled
	maxLimit   int // the engine's workers: the most chunks in flight ever
	stallAfter time.Duration

	mu       sync.Mutex
	queues   map[uint64]*sessQueue
	order    []*sessQueue // sessions with queued chunks, round-robin order
	next     int
	running  map[*chunk]struct{}
	stalled  int
	uidStall map[uint32]int
	stop     chan struct{}
	stopped  sync.Once
}

// maxStalledPerUID bounds the stuck chunks of one uid: past it, the uid's
// new chunks are cancelled at once.
const maxStalledPerUID = 4

type sessQueue struct {
	id      uint64
	uid     uint32
	chunks  []*chunk
	running int
	stalled int
	queued  bool // in order
}

type chunk struct {
	op      gpu.Op
	alive   func() bool // false once the region's process is gone
	done    func(gpu.Result, bool)
	started time.Time
	stalled bool
	q       *sessQueue
}

var (
	// errCancelled ends the chunks of a session that ended before they ran.
	errCancelled = errors.New("copy cancelled: the session ended before it ran")
	// errStalled ends the chunks of a session (or uid) with a copy stuck.
	errStalled = errors.New("copy cancelled: another copy of this session has been stuck for longer than --copy.stall")
)

func newScheduler(eng gpu.Engine, workers, maxWorkers int, stallAfter time.Duration) *scheduler {
	s := &scheduler{eng: eng, base: workers, maxLimit: maxWorkers, stallAfter: stallAfter,
		queues: map[uint64]*sessQueue{}, running: map[*chunk]struct{}{}, uidStall: map[uint32]int{}, stop: make(chan struct{})}
	go s.watch()
	return s
}

// submit queues one chunk of session sess (of uid). done is called once,
// when the chunk has ended, with its result and whether its process was
// found gone after the copy.
func (s *scheduler) submit(sess uint64, uid uint32, op gpu.Op, alive func() bool, done func(gpu.Result, bool)) {
	s.mu.Lock()
	q := s.queues[sess]
	if q == nil {
		q = &sessQueue{id: sess, uid: uid}
		s.queues[sess] = q
	}
	if q.stalled > 0 || s.uidStall[uid] >= maxStalledPerUID {
		s.forget(q)
		s.mu.Unlock()
		done(gpu.Result{Err: errStalled}, false)
		return
	}
	q.chunks = append(q.chunks, &chunk{op: op, alive: alive, done: done, q: q})
	if !q.queued {
		q.queued = true
		s.order = append(s.order, q)
	}
	s.mu.Unlock()
	s.dispatch()
}

// cancel ends every queued chunk of session sess (those running finish).
func (s *scheduler) cancel(sess uint64) { s.drop(sess, errCancelled) }

func (s *scheduler) drop(sess uint64, why error) {
	s.mu.Lock()
	q := s.queues[sess]
	var drop []*chunk
	if q != nil {
		drop, q.chunks = q.chunks, nil
		s.forget(q)
	}
	s.mu.Unlock()
	for _, c := range drop {
		c.done(gpu.Result{Err: why}, false)
	}
}

// forget drops q from the scheduler's tables when it holds nothing.
// Caller holds mu.
func (s *scheduler) forget(q *sessQueue) {
	if len(q.chunks) == 0 && q.running == 0 && s.queues[q.id] == q {
		delete(s.queues, q.id)
	}
}

// dispatch starts chunks while there is room, round robin over sessions.
// Room is `base` chunks, and beyond that one chunk for every session that
// has none running (up to maxLimit): a session with copies queued never
// waits for another session's chunk to finish, so one session's large
// copies delay another's small one by nothing but the CPU they share.
func (s *scheduler) dispatch() {
	for {
		s.mu.Lock()
		var c *chunk
		if len(s.running) < s.maxLimit {
			c = s.pick(len(s.running)-s.stalled < s.base)
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
		if c.alive != nil && !c.alive() {
			s.finish(c, gpu.Result{Err: fmt.Errorf("%w: the region's process has exited", gpu.ErrTransfer)}, true, false)
			continue
		}
		s.start(c)
	}
}

// pick takes the next chunk, round robin; with room false only from a
// session that has no chunk running. Caller holds mu.
func (s *scheduler) pick(room bool) *chunk {
	for tries := len(s.order); tries > 0 && len(s.order) > 0; tries-- {
		if s.next >= len(s.order) {
			s.next = 0
		}
		q := s.order[s.next]
		if len(q.chunks) == 0 {
			q.queued = false
			s.order = append(s.order[:s.next], s.order[s.next+1:]...)
			s.forget(q)
			tries++
			continue
		}
		if !room && q.running > 0 {
			s.next++
			continue
		}
		c := q.chunks[0]
		q.chunks[0] = nil
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
	err := s.eng.Submit(c.op, func(r gpu.Result) {
		exited := c.alive != nil && !c.alive()
		s.finish(c, r, exited, true)
	})
	if err != nil {
		s.finish(c, gpu.Result{Err: err}, false, false)
	}
}

// finish records a chunk's end, completes it and, when more is set, starts
// the next chunks.
func (s *scheduler) finish(c *chunk, r gpu.Result, exited, more bool) {
	s.mu.Lock()
	if _, ok := s.running[c]; ok {
		delete(s.running, c)
		c.q.running--
		if c.stalled {
			s.stalled--
			c.q.stalled--
			if s.uidStall[c.q.uid]--; s.uidStall[c.q.uid] <= 0 {
				delete(s.uidStall, c.q.uid)
			}
		}
		s.forget(c.q)
	}
	s.mu.Unlock()
	c.done(r, exited)
	if more {
		s.dispatch()
	}
}

// watch marks chunks that run too long as stalled, cancels their
// sessions' queues, and lets the other sessions have the workers.
func (s *scheduler) watch() {
	t := time.NewTicker(max(s.stallAfter/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		var stuck []uint64
		s.mu.Lock()
		for c := range s.running {
			if !c.stalled && time.Since(c.started) > s.stallAfter {
				c.stalled = true
				c.q.stalled++
				s.stalled++
				s.uidStall[c.q.uid]++
				stuck = append(stuck, c.q.id)
			}
		}
		s.mu.Unlock()
		for _, id := range stuck {
			s.drop(id, errStalled)
		}
		if len(stuck) > 0 {
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
