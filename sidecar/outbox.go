package sidecar

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// outbox is how replies reach one session's completion ring without anyone
// ever waiting for that session: the session loop and copy completions of
// any session hand replies to send, which never blocks. A reply goes
// straight into the ring when the ring has room and nobody else is writing
// it; otherwise it joins a queue that the outbox's own flusher goroutine
// writes as the client frees room. If the client frees none for
// replyTimeout, the session is dropped (stuck). The queue is bounded
// (limit bytes): past it the session loop stops reading new requests until
// the queue drains (congested), so a client that stops reading its replies
// stalls only itself.
type outbox struct {
	prod         *ring.Producer
	maxPayload   int
	limit        int
	replyTimeout time.Duration
	stuck        func(error) // drops the session; called at most once

	pmu sync.Mutex // owns prod: TryLock by senders, Lock by the flusher

	mu        sync.Mutex // guards q, qBytes, drained, isDrained
	q         []queued
	qBytes    int
	drained   chan struct{} // closed when the queue empties; replaced when it fills again
	isDrained bool

	kick    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	dead    atomic.Bool
	sent    atomic.Uint64
	queuedN atomic.Uint64
	faulted atomic.Bool
}

type queued struct {
	typ uint16
	seq uint64
	b   []byte
}

func newOutbox(prod *ring.Producer, maxPayload, limit int, replyTimeout time.Duration, stuck func(error)) *outbox {
	o := &outbox{prod: prod, maxPayload: maxPayload, limit: limit, replyTimeout: replyTimeout, stuck: stuck,
		drained: make(chan struct{}), kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	close(o.drained) // empty
	o.isDrained = true
	go o.flusher()
	return o
}

// tooLarge replaces a reply that cannot fit the ring.
var tooLarge = (&schema.Reply{Status: schema.ErrCodeInternal, Message: "reply too large"}).Append(nil)

// send writes or queues one reply. It never blocks and never waits.
func (o *outbox) send(typ uint16, seq uint64, payload []byte) {
	if o.dead.Load() {
		return
	}
	if len(payload) > o.maxPayload {
		payload = tooLarge
	}
	o.mu.Lock()
	if len(o.q) == 0 && o.pmu.TryLock() {
		o.mu.Unlock()
		err := o.write(typ, seq, payload)
		o.pmu.Unlock()
		if err == nil {
			return
		}
		if !errors.Is(err, ring.ErrFull) {
			o.kill(err)
			return
		}
		o.mu.Lock()
	}
	if o.isDrained {
		o.drained, o.isDrained = make(chan struct{}), false
	}
	o.q = append(o.q, queued{typ, seq, append([]byte(nil), payload...)})
	o.qBytes += len(payload) + ring.RecordHeaderSize
	o.mu.Unlock()
	o.queuedN.Add(1)
	select {
	case o.kick <- struct{}{}:
	default:
	}
}

// write writes one record without waiting. Caller holds pmu.
func (o *outbox) write(typ uint16, seq uint64, payload []byte) error {
	var err error
	if !faultSafe(func() { err = o.prod.TryWrite(typ, 0, seq, payload) }) {
		// The peer truncated the completion ring.
		o.faulted.Store(true)
		return fmt.Errorf("%w: fault writing the completion ring", ring.ErrCorrupt)
	}
	if err == nil {
		o.sent.Add(1)
	}
	return err
}

// congested reports whether the queue is over its bound; wait then blocks
// (holding nothing) until it drains, the outbox dies, or deadline passes.
func (o *outbox) congested() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.qBytes > o.limit
}

func (o *outbox) waitDrained(deadline time.Time) error {
	for {
		o.mu.Lock()
		over, ch := o.qBytes > o.limit, o.drained
		o.mu.Unlock()
		if !over {
			return nil
		}
		if o.dead.Load() {
			return ring.ErrClosed
		}
		left := time.Until(deadline)
		if left <= 0 {
			return os.ErrDeadlineExceeded
		}
		t := time.NewTimer(min(left, 50*time.Millisecond))
		select {
		case <-ch:
		case <-o.stop:
		case <-t.C:
		}
		t.Stop()
	}
}

// pending is the number of queued replies.
// flush waits, up to deadline, until every queued reply is written (or
// the outbox is dead).
func (o *outbox) flush(deadline time.Time) {
	for {
		o.mu.Lock()
		empty, ch := len(o.q) == 0, o.drained
		o.mu.Unlock()
		left := time.Until(deadline)
		if empty || o.dead.Load() || left <= 0 {
			return
		}
		t := time.NewTimer(min(left, 50*time.Millisecond))
		select {
		case <-ch:
		case <-o.stop:
		case <-t.C:
		}
		t.Stop()
	}
}

func (o *outbox) pending() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.q)
}

// markDrained wakes the waiters of an empty queue. Caller holds mu.
func (o *outbox) markDrained() {
	if !o.isDrained {
		close(o.drained)
		o.isDrained = true
	}
}

func (o *outbox) kill(err error) {
	if o.dead.CompareAndSwap(false, true) {
		o.mu.Lock()
		o.q, o.qBytes = nil, 0
		o.markDrained()
		o.mu.Unlock()
		o.stuck(err)
	}
}

// flusher writes queued replies as the client frees room.
func (o *outbox) flusher() {
	defer close(o.done)
	for {
		select {
		case <-o.stop:
			return
		case <-o.kick:
		}
		progress := time.Now()
		for !o.dead.Load() {
			o.pmu.Lock()
			var wait func(time.Time) error
			var err error
			for {
				o.mu.Lock()
				if len(o.q) == 0 {
					o.markDrained()
					o.mu.Unlock()
					break
				}
				r := o.q[0]
				o.mu.Unlock()
				if err = o.write(r.typ, r.seq, r.b); err != nil {
					if errors.Is(err, ring.ErrFull) {
						// Nothing writes through prod until the wait
						// ends: senders see a non-empty queue and queue.
						wait = o.prod.SpaceWaiter(ring.RecordSize(len(r.b)), o.dead.Load)
					}
					break
				}
				progress = time.Now()
				o.mu.Lock()
				o.q[0] = queued{}
				o.q = o.q[1:]
				o.qBytes -= len(r.b) + ring.RecordHeaderSize
				o.mu.Unlock()
			}
			o.pmu.Unlock()
			if err != nil && wait == nil {
				o.kill(err)
				return
			}
			if wait == nil {
				break // drained
			}
			var werr error
			if !faultSafe(func() { werr = wait(progress.Add(o.replyTimeout)) }) {
				werr = fmt.Errorf("%w: fault reading the completion ring", ring.ErrCorrupt)
			}
			if errors.Is(werr, ring.ErrClosed) {
				return // closed
			}
			if werr != nil {
				if errors.Is(werr, os.ErrDeadlineExceeded) {
					werr = fmt.Errorf("the client freed no room in its completion ring for %v: %w", o.replyTimeout, werr)
				}
				o.kill(werr)
				return
			}
			select {
			case <-o.stop:
				return
			default:
			}
		}
	}
}

// close stops the flusher and waits for it. Queued replies are dropped.
// After close, send drops everything.
func (o *outbox) close() {
	o.dead.Store(true)
	select {
	case <-o.stop:
	default:
		close(o.stop)
	}
	faultSafe(o.prod.Interrupt) // a flusher parked waiting for room
	<-o.done
}
