package sidecar

import (
	"errors"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// session is one attached client: a ring pair and the socket whose closing
// tells the sidecar the peer is gone. Its goroutine (run) reads the
// submission ring, hands each record to the machine and carries out what
// comes back; its replies go through its outbox. Everything the protocol
// knows about the session lives in the machine.
type session struct {
	srv   *Server
	id    machine.SessionID
	ns    uint32 // the namespace the session joined
	cred  sys.Cred
	pidfd *sys.Pidfd // nil on kernels without pidfds
	log   zerolog.Logger
	conn  *net.UnixConn

	sub, cmp *ring.File
	cons     *ring.Consumer
	prod     *ring.Producer
	ob       *outbox

	// probeAt is an address in one of the session's host regions: after a
	// copy, a one-byte read there tells whether the process still has its
	// memory (it loses it before its pidfd says it exited).
	probeAt atomic.Uint64

	closed atomic.Bool
	reason atomic.Value // string: why the session ends

	lifeMu   sync.Mutex // orders shutdown's wake-up against unmapping the rings
	unmapped bool

	// detached is the reply to the session's Detach, held back by handle
	// until cleanup has closed the session's GPU mappings.
	detached *machine.Reply

	out machine.Output // the session loop's scratch
}

// alive reports whether the process that attached still runs and still
// has its memory. Copies check it before they start and after they end: a
// store is kept only if both say yes.
func (ss *session) alive() bool {
	if ss.pidfd == nil {
		return true
	}
	if ss.pidfd.Exited() {
		return false
	}
	if a := ss.probeAt.Load(); a != 0 && sys.ProbeMemory(ss.cred.PID, a) != nil {
		return false
	}
	return true
}

// shutdown asks the session loop to end; it is safe from any goroutine and
// never blocks.
func (ss *session) shutdown(reason string) {
	if ss.closed.CompareAndSwap(false, true) {
		ss.reason.Store(reason)
	}
	ss.lifeMu.Lock()
	if !ss.unmapped {
		faultSafe(ss.cons.Interrupt) // the peer may have truncated the ring
	}
	ss.lifeMu.Unlock()
}

// run serves the submission ring until the session ends.
func (ss *session) run() {
	defer ss.cleanup()
	// A peer that truncates a ring file makes our mapping fault; turn that
	// into a panic we recover from, instead of a crash of the sidecar.
	debug.SetPanicOnFault(true)
	defer func() {
		if r := recover(); r != nil {
			ss.log.Error().Interface("panic", r).Msg("session aborted")
			ss.reason.CompareAndSwap(nil, "a fault in a ring mapping")
		}
	}()
	for !ss.closed.Load() {
		t0 := time.Now()
		// Closing interrupts the wait; the deadline only bounds it.
		err := ss.cons.Wait(t0.Add(time.Second))
		ss.srv.met.ringWait.Add(time.Since(t0).Seconds())
		switch {
		case err == nil:
		case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, ring.ErrClosed):
			continue
		case errors.Is(err, ring.ErrPeerDead), errors.Is(err, ring.ErrPeerClosed):
			ss.shutdown("peer gone: " + err.Error())
			return
		default:
			ss.shutdown("submission ring unusable: " + err.Error())
			return
		}
		for i := 1; ; i++ {
			rec, err := ss.cons.Next()
			if errors.Is(err, ring.ErrEmpty) {
				break
			}
			if err != nil {
				ss.shutdown("submission ring corrupt: " + err.Error())
				return
			}
			if !ss.handle(rec) {
				ss.cons.Commit()
				return
			}
			// A client that floods its ring gets its turn like any other:
			// every few records the loop releases what it read and lets the
			// other sessions' goroutines run (Go's scheduler would otherwise
			// let it run for a 10 ms time slice while they wait).
			if i%yieldEvery == 0 {
				ss.cons.Commit()
				runtime.Gosched()
			}
		}
		ss.cons.Commit()
	}
}

// yieldEvery is how many records a session loop serves before it yields.
const yieldEvery = 8

// handle serves one record. It returns false when the session must end.
func (ss *session) handle(rec ring.Record) bool {
	s := ss.srv
	s.met.request(rec.Type)
	// A client whose replies back up stalls only itself: its next request
	// waits until they drain (or the session is dropped as stuck).
	if ss.ob.congested() {
		if err := ss.ob.waitDrained(time.Now().Add(s.cfg.ReplyTimeout)); err != nil {
			ss.shutdown("completion ring full: the client stopped reading its replies")
			return false
		}
	}
	s.mu.Lock()
	s.m.Handle(monotonic(), ss.id, rec.Type, rec.Seq, rec.Payload, &ss.out)
	s.mu.Unlock()
	if ss.out.End {
		ss.holdDetachReply(&ss.out)
	}
	s.apply(&ss.out)
	if ss.out.End {
		ss.shutdown("detach requested")
		return false
	}
	return !ss.closed.Load()
}

// holdDetachReply takes the reply to the session's Detach out of out:
// cleanup sends it once the session's GPU regions are unregistered.
func (ss *session) holdDetachReply(out *machine.Output) {
	for i, r := range out.Replies {
		if r.Session == ss.id && r.Type == schema.ReplyType(schema.TypeDetach) {
			r.Payload = append([]byte(nil), r.Payload...)
			ss.detached = &r
			out.Replies = append(out.Replies[:i], out.Replies[i+1:]...)
			return
		}
	}
}

// cleanup ends the session: queued copies are given a moment to finish
// (bounded), the machine forgets the session (its leases released, its
// regions unregistered), the Detach is answered, and its rings are closed.
// The session's GPU regions are unregistered first, each once its copies
// have ended (bounded: a copy not issued yet is withdrawn, one issued ends
// or trips the CUDA backend's watchdog), so that whatever tells its engine
// the session has ended (the Detach reply, the rings closed) comes only
// after the sidecar's mappings of its memory are closed and its store
// event released: the engine may then free or reuse the memory, destroy
// the event, or register new memory that yields the same handle. Host
// regions are unregistered in the background: they have no mapping, and
// a copy stuck on a page fault the client holds must not hold the rings.
func (ss *session) cleanup() {
	s := ss.srv
	ss.closed.Store(true)
	s.smu.Lock()
	delete(s.sessions, ss.id)
	s.smu.Unlock()
	if s.exits != nil && ss.pidfd != nil {
		s.exits.Unwatch(ss.pidfd)
	}
	// A session its client ended (Detach, socket closed, process gone)
	// keeps no store: its engine may reuse the pages from then on, so its
	// queued copies are cancelled and those still running keep their slots
	// pinned until they end, when the machine discards what they wrote.
	// Only at the sidecar's shutdown do the queued copies of a live process
	// get the reply timeout to finish (its engine still holds the pages).
	if s.draining.Load() && ss.alive() {
		s.sched.waitSession(uint64(ss.id), time.Now().Add(s.cfg.ReplyTimeout))
	}
	s.sched.cancel(uint64(ss.id))
	out := new(machine.Output)
	s.mu.Lock()
	s.m.Detach(monotonic(), ss.id, out)
	s.mu.Unlock()
	var gpuRegions []gpu.Handle
	host := out.Unregister[:0]
	for _, h := range out.Unregister {
		if s.sched.kind(h).CUDA() {
			gpuRegions = append(gpuRegions, h)
		} else {
			host = append(host, h)
		}
	}
	out.Unregister = host
	s.apply(out)
	for _, h := range gpuRegions {
		s.sched.unroute(h) // before the engine may issue h again
		s.copier.Unregister(h)
	}
	if r := ss.detached; r != nil {
		ss.ob.send(r.Type, r.Seq, r.Payload)
		ss.ob.flush(time.Now().Add(min(s.cfg.ReplyTimeout, time.Second)))
	}
	ss.ob.close()
	faultSafe(ss.prod.Close)
	faultSafe(ss.cons.Close)
	ss.lifeMu.Lock()
	ss.unmapped = true
	ss.sub.Close()
	ss.cmp.Close()
	ss.lifeMu.Unlock()
	ss.conn.Close()
	if ss.pidfd != nil {
		ss.pidfd.Close()
	}
	s.met.detaches.Inc()
	reason, _ := ss.reason.Load().(string)
	ss.log.Info().Str("reason", reason).Msg("detached")
}

// faultSafe runs f, which touches a ring mapping, and reports false if that
// faulted: a peer that truncates a ring file makes any access past the new
// end raise SIGBUS, which must end the session, never the sidecar.
func faultSafe(f func()) (ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	f()
	return true
}
