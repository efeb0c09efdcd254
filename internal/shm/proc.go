package shm

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
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
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces or
	// parentheses itself: parse from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("shm: malformed /proc stat")
	}
	fields := bytes.Fields(b[i+1:])
	// fields[0] is field 3 (state); field 22 is fields[19].
	if len(fields) < 20 {
		return 0, errors.New("shm: short /proc stat")
	}
	return strconv.ParseUint(string(fields[19]), 10, 64)
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
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return false
	}
	fields := bytes.Fields(b[i+1:])
	if len(fields) < 20 {
		return false
	}
	if len(fields[0]) == 1 && (fields[0][0] == 'Z' || fields[0][0] == 'X') {
		return false
	}
	if start == 0 {
		return true
	}
	st, err := strconv.ParseUint(string(fields[19]), 10, 64)
	return err == nil && st == start
}
