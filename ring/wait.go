package ring

import (
	"os"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
)

// WaitConfig is the waiting strategy of one side: spin, then yield, then
// park on a futex in the shared header. A parked side costs nothing until the
// peer publishes; the peer pays for a wake system call only while this side
// is parked.
type WaitConfig struct {
	// Spin is how long to busy-poll before yielding. Zero means do not spin.
	Spin time.Duration
	// Yield is how long to poll with runtime.Gosched between checks after
	// spinning. Zero means do not yield.
	Yield time.Duration
	// Park is the longest single futex sleep. Between sleeps the waiter
	// checks that the peer is alive, so Park bounds how long a dead peer or
	// a lost wake-up goes unnoticed. Default 10ms.
	Park time.Duration
	// IdlePark, when longer than Park, lets a wait that keeps timing out
	// sleep longer: each further sleep of the same wait doubles, up to
	// IdlePark. An idle waiter then costs fewer wake-ups; each one is a
	// thread switch, and in Go a return from a blocking system call that
	// wakes the runtime's sysmon, which then polls every 20 µs for a while
	// (measured on an idle sidecar: most of its CPU). The peer's liveness
	// is still read at most every AliveEvery; a dead peer is noticed within
	// IdlePark. Zero: always Park.
	IdlePark time.Duration
}

// maxSpuriousWakes is how many early wake-ups with nothing to read one wait
// takes from the futex before it sleeps without it (see wait).
var maxSpuriousWakes = 32 // a var: a tuning value, not a wire constant (internal/wiregen exports the package's constants)

// DefaultWait spins for 50 µs, yields for 50 µs, then parks.
var DefaultWait = WaitConfig{Spin: 50 * time.Microsecond, Yield: 50 * time.Microsecond, Park: 10 * time.Millisecond}

// ParkWait parks at once: lowest CPU, highest latency.
var ParkWait = WaitConfig{Park: 10 * time.Millisecond}

func (w WaitConfig) withDefaults() WaitConfig {
	if w.Park <= 0 {
		w.Park = 10 * time.Millisecond
	}
	return w
}

// WaitStats counts how a side waited.
type WaitStats struct {
	Waits  uint64        // calls that had to wait at all
	Parks  uint64        // futex sleeps
	Waited time.Duration // total time spent waiting
}

// wait runs the spin, yield, park strategy until cond holds, peer reports an
// error, check fails, or deadline passes.
func (w WaitConfig) wait(cond func() bool, peer func() error, parked, futex *atomic.Uint32, deadline time.Time, check func() error, st *WaitStats) error {
	if cond() {
		return nil
	}
	start := time.Now()
	st.Waits++
	defer func() { st.Waited += time.Since(start) }()
	if w.Spin > 0 {
		end := start.Add(w.Spin)
		for i := 0; ; i++ {
			if cond() {
				return nil
			}
			if i&127 == 127 && time.Now().After(end) {
				break
			}
		}
	}
	if w.Yield > 0 {
		end := time.Now().Add(w.Yield)
		for i := 0; ; i++ {
			runtime.Gosched()
			if cond() {
				return nil
			}
			if i&7 == 7 && time.Now().After(end) {
				break
			}
		}
	}
	park := w.Park
	spurious := 0
	for {
		if err := peer(); err != nil {
			return err
		}
		if check != nil {
			if err := check(); err != nil {
				return err
			}
		}
		sleep := park
		if park < w.IdlePark {
			park = min(2*park, w.IdlePark)
		}
		if !deadline.IsZero() {
			left := time.Until(deadline)
			if left <= 0 {
				if cond() {
					return nil
				}
				return os.ErrDeadlineExceeded
			}
			sleep = min(sleep, left)
		}
		if spurious >= maxSpuriousWakes {
			// The futex word keeps changing and nothing is published: the
			// peer (or anyone who maps the ring) is hammering it. Sleep
			// without it, so that a hostile peer costs this side one check
			// a park, not a busy loop; a real record waits at most a park.
			st.Parks++
			time.Sleep(sleep)
			if cond() {
				return nil
			}
			continue
		}
		seq := futex.Load()
		parked.Store(1) // sequentially consistent: ordered before the re-check
		if cond() {
			parked.Store(0)
			return nil
		}
		st.Parks++
		t0 := time.Now()
		if err := shm.FutexWait(futex, seq, sleep); err != nil {
			parked.Store(0)
			return err
		}
		parked.Store(0)
		if cond() {
			return nil
		}
		if time.Since(t0) < sleep/2 {
			spurious++ // woken early, and nothing to read
		} else {
			spurious = 0
		}
		if err := peer(); err != nil {
			return err
		}
	}
}
