package shm

import (
	"errors"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Futex operations. x/sys/unix has SYS_FUTEX but not these constants. The
// private flag (128) must not be used: the word is shared between processes.
const (
	futexWait = 0
	futexWake = 1
)

// FutexWait sleeps while *w == val, for at most timeout (which must be
// positive: every wait in ringside is bounded, so that a lost wake-up costs a
// timeout, never a hang). It returns nil when woken, when the value differed
// on entry, on a timeout, or on a signal; the caller re-checks its condition.
func FutexWait(w *atomic.Uint32, val uint32, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = time.Millisecond
	}
	ts := unix.NsecToTimespec(int64(timeout))
	// Syscall6 (not RawSyscall6) so the runtime hands this P to another
	// goroutine while the thread sleeps.
	_, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWait, uintptr(val),
		uintptr(unsafe.Pointer(&ts)), 0, 0)
	switch e {
	case 0, unix.EAGAIN, unix.ETIMEDOUT, unix.EINTR:
		return nil
	default:
		return errors.New("shm: futex wait: " + e.Error())
	}
}

// FutexWake wakes up to n waiters on w and reports how many were woken.
func FutexWake(w *atomic.Uint32, n int) (int, error) {
	r, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWake, uintptr(n), 0, 0, 0)
	if e != 0 {
		return 0, errors.New("shm: futex wake: " + e.Error())
	}
	return int(r), nil
}
