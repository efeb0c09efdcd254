package sys

import (
	"bytes"
	"errors"
	"os"
	"strconv"
)

// ProcStat reads what ringside needs of /proc/PID/stat: the process's state
// (field 3: 'R', 'S', 'Z' for a zombie, 'X' dead, ...) and its start time
// (field 22, in clock ticks since boot). A pid alone does not name a
// process, because pids are reused; a pid and its start time do.
func ProcStat(pid int) (state byte, start uint64, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces or
	// parentheses itself: parse from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, errors.New("malformed /proc stat")
	}
	fields := bytes.Fields(b[i+1:])
	// fields[0] is field 3; field 22 is fields[19].
	if len(fields) < 20 {
		return 0, 0, errors.New("short /proc stat")
	}
	if len(fields[0]) == 1 {
		state = fields[0][0]
	}
	start, err = strconv.ParseUint(string(fields[19]), 10, 64)
	return state, start, err
}
