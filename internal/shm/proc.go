package shm

import (
	"fmt"
	"os"
	"sync"

	"github.com/ringside-kv/ringside/internal/sys"
)

// Process identity: a pid alone is not enough to tell that the process that
// wrote it is still alive, because pids are reused. ringside records the pid
// together with the process's start time (field 22 of /proc/PID/stat, in clock
// ticks since boot), and a process is the same one only if both match.

// StartTime returns the start time of pid in clock ticks since boot.
func StartTime(pid int) (uint64, error) {
	if pid <= 0 {
		return 0, fmt.Errorf("shm: invalid pid %d", pid)
	}
	_, start, err := sys.ProcStat(pid)
	return start, err
}

var self struct {
	once  sync.Once
	pid   int
	start uint64
}

// Self returns this process's pid and start time.
func Self() (pid int, start uint64) {
	self.once.Do(func() {
		self.pid = os.Getpid()
		self.start, _ = StartTime(self.pid)
	})
	return self.pid, self.start
}

// Alive reports whether the process pid that started at start is still
// running. A pid of 0 means "unknown" and counts as alive: liveness then
// rests on other signals (a closed flag, the attach socket). A zombie counts
// as dead.
func Alive(pid int, start uint64) bool {
	if pid == 0 {
		return true
	}
	state, st, err := sys.ProcStat(pid)
	if err != nil || state == 'Z' || state == 'X' {
		return false
	}
	return start == 0 || st == start
}
