package sidecar

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// scheduler runs copies on the copy engine fairly between sessions, in
// lanes that each have a budget of their own: one for host regions and one
// for every GPU that holds CUDA IPC regions. The machine splits every Load
// and Store into chunks (--copy.chunk-bytes for host regions,
// --copy.cuda-chunk-bytes for CUDA ones); each chunk goes to its region's
// lane. Host copies are CPU-bound (process_vm_readv/writev on the copy
// goroutines): their lane runs --copy.workers chunks at a time. CUDA copies
// are asynchronous DMA, which costs no CPU while it runs: each device's lane
// runs --copy.cuda-inflight chunks at a time, so that the PCIe link stays
// busy. A slow host copy never takes a CUDA slot and the reverse, and one
// GPU's copies never wait for another's.
//
// Within a lane, each session's chunks wait in a queue of its own, and the
// engine is given chunks round robin over the sessions that have some,
// `base` at a time, plus one for each session that has none running. A
// session that pipelines huge loads therefore delays another session's
// copy by at most one chunk per slot, not by its whole backlog.
//
// A chunk that runs longer than stallAfter (a copy stuck on a page fault
// the client holds, e.g. with userfaultfd, or on a process that stopped) is
// stalled: it stops counting against its lane's `base`, so the other
// sessions keep their slots, and its session's chunks queued in that lane
// are cancelled, as are the new ones it submits there until the stuck
// chunk returns. A uid with maxStalledPerUID stuck chunks in a lane has all
// its new chunks for that lane cancelled. A stuck chunk therefore holds the
// slots of one chunk, never a session's backlog.
// Nothing here waits while holding a lock, and no completion waits for
// anything: done callbacks only post results.
type scheduler struct {
	eng        gpu.Engine
	host, cuda budget
	stallAfter time.Duration

	mu     sync.RWMutex
	routes map[gpu.Handle]laneKey // CUDA IPC regions; a handle not here is host memory
	lanes  map[laneKey]*lane

	stop    chan struct{}
	stopped sync.Once
}

// budget is what one lane runs at once.
type budget struct {
	base int // chunks in flight when nothing is stalled
	max  int // the most chunks in flight ever (the engine must run them)
}

// laneKey names a lane: the host's (the zero key), or one GPU's.
type laneKey struct {
	cuda bool
	gpu  [16]byte // the device's UUID
}

// lane runs the chunks of one budget.
type lane struct {
	eng        gpu.Engine
	base       int
	maxLimit   int
	stallAfter time.Duration
	gpu        bool // a GPU's lane: its backend marks when it issues a chunk (chunk.since)

	mu       sync.Mutex
	queues   map[uint64]*sessQueue
	order    []*sessQueue // sessions with queued chunks, round-robin order
	next     int
	running  map[*chunk]struct{}
	stalled  int
	uidStall map[uint32]int
}

// maxStalledPerUID bounds the stuck chunks of one uid in one lane: past
// it, the uid's new chunks for the lane are cancelled at once.
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
	fence   gpu.Fence      // raised when the session ends: withdraws the chunk if the engine has not issued it
	issued  gpu.IssueClock // marked by a GPU backend when it issues the chunk's copies
	alive   func() bool    // false once the region's process is gone
	done    func(gpu.Result, bool)
	started time.Time
	stalled bool
	q       *sessQueue
}

// since returns when the chunk's copy began for the stall clock: when its
// backend issued it where the backend says (Op.Issued: a GPU store waits
// for its engine's forward pass before that, which is no stall), else when
// the chunk was handed to the engine. A chunk its backend holds back has
// not begun: the session's end withdraws it, and the CUDA backend's
// watchdog times issued copies.
func (c *chunk) since() time.Time {
	if c.op.Issued == nil {
		return c.started
	}
	if t, ok := c.op.Issued.At(); ok {
		return t
	}
	return time.Now()
}

var (
	// errCancelled ends the chunks of a session that ended before they ran.
	errCancelled = errors.New("copy cancelled: the session ended before it ran")
	// errStalled ends the chunks of a session (or uid) with a copy stuck.
	errStalled = errors.New("copy cancelled: another copy of this session has been stuck for longer than --copy.stall")
)

// newScheduler returns a scheduler over eng with the budgets of the host
// lane and of each GPU's lane.
func newScheduler(eng gpu.Engine, host, cuda budget, stallAfter time.Duration) *scheduler {
	s := &scheduler{eng: eng, host: host, cuda: cuda, stallAfter: stallAfter,
		routes: map[gpu.Handle]laneKey{}, lanes: map[laneKey]*lane{}, stop: make(chan struct{})}
	s.lanes[laneKey{}] = newLane(eng, host, stallAfter)
	go s.watch()
	return s
}

func newLane(eng gpu.Engine, b budget, stallAfter time.Duration) *lane {
	return &lane{eng: eng, base: b.base, maxLimit: b.max, stallAfter: stallAfter,
		queues: map[uint64]*sessQueue{}, running: map[*chunk]struct{}{}, uidStall: map[uint32]int{}}
}

// route records the region the engine registered as h, before any copy of
// it is submitted: a CUDA region's chunks (CUDA IPC or by descriptor) go
// to its GPU's lane, any other's to the host's.
func (s *scheduler) route(h gpu.Handle, r gpu.Region) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !r.Kind.CUDA() {
		delete(s.routes, h)
		return
	}
	s.routes[h] = laneKey{cuda: true, gpu: r.IPC.GPU}
}

// unroute forgets h, before the engine does: a handle the engine issues
// again is then routed afresh. Chunks of h already submitted keep their
// lane.
func (s *scheduler) unroute(h gpu.Handle) {
	s.mu.Lock()
	delete(s.routes, h)
	s.mu.Unlock()
}

// kind reports the kind of region h names, as far as scheduling goes:
// gpu.CUDAIPC for a routed CUDA region (of either CUDA kind), else
// gpu.HostProcess.
func (s *scheduler) kind(h gpu.Handle) gpu.Kind {
	s.mu.RLock()
	_, ok := s.routes[h]
	s.mu.RUnlock()
	if ok {
		return gpu.CUDAIPC
	}
	return gpu.HostProcess
}

// laneOf returns the lane of region h's chunks, starting a GPU's lane on
// its first chunk.
func (s *scheduler) laneOf(h gpu.Handle) *lane {
	s.mu.RLock()
	k := s.routes[h]
	l := s.lanes[k]
	s.mu.RUnlock()
	if l != nil {
		return l
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if l = s.lanes[k]; l == nil {
		l = newLane(s.eng, s.cuda, s.stallAfter)
		l.gpu = true
		s.lanes[k] = l
	}
	return l
}

// eachLane calls f for every lane.
func (s *scheduler) eachLane(f func(*lane)) {
	s.mu.RLock()
	lanes := make([]*lane, 0, len(s.lanes))
	for _, l := range s.lanes {
		lanes = append(lanes, l)
	}
	s.mu.RUnlock()
	for _, l := range lanes {
		f(l)
	}
}

// submit queues one chunk of session sess (of uid) in its region's lane.
// done is called once, when the chunk has ended, with its result and
// whether its process was found gone after the copy.
func (s *scheduler) submit(sess uint64, uid uint32, op gpu.Op, alive func() bool, done func(gpu.Result, bool)) {
	s.laneOf(op.Region).submit(sess, uid, op, alive, done)
}

// cancel ends every queued chunk of session sess, in every lane, and
// raises the fences of those handed to the engine: the ones the engine has
// not issued yet (a CUDA device's queue) end without being issued, so
// nothing touches the memory of an engine that died or gave up; those
// already issued finish.
func (s *scheduler) cancel(sess uint64) {
	s.eachLane(func(l *lane) {
		l.drop(sess, errCancelled, nil)
		l.fence(sess, nil)
	})
}

// cancelLoads does what cancel does, for the session's loads only: an
// ending session's loads have nobody left to read them (its engine gave
// up on them or detached), while its stores may still be kept.
func (s *scheduler) cancelLoads(sess uint64) {
	isLoad := func(c *chunk) bool { return c.op.Dir == gpu.PoolToEngine }
	s.eachLane(func(l *lane) {
		l.drop(sess, errCancelled, isLoad)
		l.fence(sess, isLoad)
	})
}

// fence raises the fences of session sess's chunks that are running (with
// the engine), those that match if match is set.
func (l *lane) fence(sess uint64, match func(*chunk) bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for c := range l.running {
		if c.q.id == sess && (match == nil || match(c)) {
			c.fence.Raise()
		}
	}
}

func (l *lane) submit(sess uint64, uid uint32, op gpu.Op, alive func() bool, done func(gpu.Result, bool)) {
	l.mu.Lock()
	q := l.queues[sess]
	if q == nil {
		q = &sessQueue{id: sess, uid: uid}
		l.queues[sess] = q
	}
	if q.stalled > 0 || l.uidStall[uid] >= maxStalledPerUID {
		l.forget(q)
		l.mu.Unlock()
		done(gpu.Result{Err: errStalled}, false)
		return
	}
	c := &chunk{op: op, alive: alive, done: done, q: q}
	// The clocks are set here, before the chunk is shared: scan reads
	// c.op under mu while start runs without it.
	c.op.Fence = &c.fence
	if l.gpu {
		c.op.Issued = &c.issued
	}
	q.chunks = append(q.chunks, c)
	if !q.queued {
		q.queued = true
		l.order = append(l.order, q)
	}
	l.mu.Unlock()
	l.dispatch()
}

// drop ends session sess's queued chunks (those that match, if match is
// set) with why.
func (l *lane) drop(sess uint64, why error, match func(*chunk) bool) {
	l.mu.Lock()
	q := l.queues[sess]
	var drop []*chunk
	if q != nil && match == nil {
		drop, q.chunks = q.chunks, nil
	} else if q != nil {
		keep := q.chunks[:0]
		for _, c := range q.chunks {
			if match(c) {
				drop = append(drop, c)
			} else {
				keep = append(keep, c)
			}
		}
		clear(q.chunks[len(keep):])
		q.chunks = keep
	}
	if q != nil {
		l.forget(q)
	}
	l.mu.Unlock()
	for _, c := range drop {
		c.done(gpu.Result{Err: why}, false)
	}
}

// forget drops q from the lane's tables when it holds nothing.
// Caller holds mu.
func (l *lane) forget(q *sessQueue) {
	if len(q.chunks) == 0 && q.running == 0 && l.queues[q.id] == q {
		delete(l.queues, q.id)
	}
}

// dispatch starts chunks while there is room, round robin over sessions.
// Room is `base` chunks, and beyond that one chunk for every session that
// has none running (up to maxLimit): a session with copies queued never
// waits for another session's chunk to finish, so one session's large
// copies delay another's small one by nothing but the CPU they share.
func (l *lane) dispatch() {
	for {
		l.mu.Lock()
		var c *chunk
		if len(l.running) < l.maxLimit {
			c = l.pick(len(l.running)-l.stalled < l.base)
		}
		if c != nil {
			c.started = time.Now()
			l.running[c] = struct{}{}
			c.q.running++
		}
		l.mu.Unlock()
		if c == nil {
			return
		}
		if c.alive != nil && !c.alive() {
			l.finish(c, gpu.Result{Err: fmt.Errorf("%w: the region's process has exited", gpu.ErrTransfer)}, true, false)
			continue
		}
		l.start(c)
	}
}

// pick takes the next chunk, round robin; with room false only from a
// session that has no chunk running. Caller holds mu.
func (l *lane) pick(room bool) *chunk {
	for tries := len(l.order); tries > 0 && len(l.order) > 0; tries-- {
		if l.next >= len(l.order) {
			l.next = 0
		}
		q := l.order[l.next]
		if len(q.chunks) == 0 {
			q.queued = false
			l.order = append(l.order[:l.next], l.order[l.next+1:]...)
			l.forget(q)
			tries++
			continue
		}
		if !room && q.running > 0 {
			l.next++
			continue
		}
		c := q.chunks[0]
		q.chunks[0] = nil
		q.chunks = q.chunks[1:]
		l.next++
		return c
	}
	return nil
}

// start hands a chunk to the engine. The process is checked before (in
// dispatch) and after the copy: a store is kept only if its process was
// alive at both ends, so its pid cannot have changed hands in between.
func (l *lane) start(c *chunk) {
	err := l.eng.Submit(c.op, func(r gpu.Result) {
		exited := c.alive != nil && !c.alive()
		l.finish(c, r, exited, true)
	})
	if err != nil {
		l.finish(c, gpu.Result{Err: err}, false, false)
	}
}

// finish records a chunk's end, completes it and, when more is set, starts
// the next chunks.
func (l *lane) finish(c *chunk, r gpu.Result, exited, more bool) {
	l.mu.Lock()
	if _, ok := l.running[c]; ok {
		delete(l.running, c)
		c.q.running--
		if c.stalled {
			l.stalled--
			c.q.stalled--
			if l.uidStall[c.q.uid]--; l.uidStall[c.q.uid] <= 0 {
				delete(l.uidStall, c.q.uid)
			}
		}
		l.forget(c.q)
	}
	l.mu.Unlock()
	c.done(r, exited)
	if more {
		l.dispatch()
	}
}

// watch marks chunks that run too long as stalled, in every lane.
func (s *scheduler) watch() {
	t := time.NewTicker(max(s.stallAfter/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.eachLane((*lane).scan)
	}
}

// scan marks the lane's chunks that run too long as stalled, cancels their
// sessions' queues in the lane, and lets the other sessions have the
// slots.
func (l *lane) scan() {
	var stuck []uint64
	l.mu.Lock()
	for c := range l.running {
		if !c.stalled && time.Since(c.since()) > l.stallAfter {
			c.stalled = true
			c.q.stalled++
			l.stalled++
			l.uidStall[c.q.uid]++
			stuck = append(stuck, c.q.id)
		}
	}
	l.mu.Unlock()
	for _, id := range stuck {
		l.drop(id, errStalled, nil)
	}
	if len(stuck) > 0 {
		l.dispatch()
	}
}

// stats reports chunks in flight, stalled and queued, in all lanes.
func (s *scheduler) stats() (running, stalled, queued int) {
	s.eachLane(func(l *lane) {
		r, st, q := l.stats()
		running, stalled, queued = running+r, stalled+st, queued+q
	})
	return running, stalled, queued
}

func (l *lane) stats() (running, stalled, queued int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, q := range l.queues {
		queued += len(q.chunks)
	}
	return len(l.running), l.stalled, queued
}

func (s *scheduler) close() { s.stopped.Do(func() { close(s.stop) }) }

// waitSession waits until session sess has no chunk queued or running in
// any lane, or deadline passes. Its loads are cancelled first
// (cancelLoads): only its stores are worth finishing.
func (s *scheduler) waitSession(sess uint64, deadline time.Time) {
	s.cancelLoads(sess)
	for time.Now().Before(deadline) {
		busy := false
		s.eachLane(func(l *lane) { busy = busy || l.busy(sess) })
		if !busy {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// busy reports whether session sess has a chunk queued or running here.
func (l *lane) busy(sess uint64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.queues[sess]
	return ok
}
