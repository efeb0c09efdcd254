package gputest

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// SweepFakeFiles removes the shared-memory files of the fake driver
// (gpu/gputest/testdata/fakecuda.c: /dev/shm/fakecuda-<pid>-… for device
// memory, /dev/shm/fakecuda-ev-<pid>-… for interprocess events) whose
// creating process is gone: a process the tests killed cannot remove its
// own. A test binary calls it when its tests have ended; files of live
// processes (another package's tests running beside it) stay.
func SweepFakeFiles() {
	files, _ := filepath.Glob("/dev/shm/fakecuda-*")
	for _, f := range files {
		rest := strings.TrimPrefix(strings.TrimPrefix(filepath.Base(f), "fakecuda-"), "ev-")
		pid, err := strconv.Atoi(rest[:max(strings.IndexByte(rest, '-'), 0)])
		if err != nil || pid <= 0 {
			continue
		}
		if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); os.IsNotExist(err) {
			os.Remove(f)
		}
	}
}
