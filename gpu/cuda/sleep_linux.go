package cuda

import (
	"syscall"
	"time"
)

// prSetTimerSlack is prctl's PR_SET_TIMERSLACK.
const prSetTimerSlack = 29

// setTimerSlack sets the calling thread's timer slack, what the kernel may
// add to its sleeps to batch wake-ups (50 µs by default), to 1 µs: the
// device's thread sleeps only while copies are in flight, between polls.
func setTimerSlack() {
	syscall.RawSyscall6(syscall.SYS_PRCTL, prSetTimerSlack, 1000, 0, 0, 0, 0)
}

// pollSleep sleeps d in the calling thread (nanosleep). Go's time.Sleep
// parks the goroutine on the runtime's timers instead, which wake a
// goroutine locked to its thread about a millisecond later, whatever d.
func pollSleep(d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	syscall.Nanosleep(&ts, nil)
}
