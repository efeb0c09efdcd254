package sys

import (
	"bufio"
	"os"
	"strconv"
	"strings"
)

// MemoryLimit returns the memory limit of this process's cgroup in bytes
// (cgroup v2 memory.max, else v1 memory.limit_in_bytes of the memory
// controller's hierarchy), the file it came from, and false when there is
// none (no cgroup, or "max", or a v1 limit so high it means none).
func MemoryLimit() (int64, string, bool) {
	return memoryLimit("/proc/self/cgroup", "/sys/fs/cgroup")
}

func memoryLimit(procCgroup, root string) (int64, string, bool) {
	f, err := os.Open(procCgroup)
	if err != nil {
		return 0, "", false
	}
	defer f.Close()
	var v2, v1 string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// hierarchy-ID:controller-list:cgroup-path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "":
			v2 = parts[2]
		case hasController(parts[1], "memory"):
			v1 = parts[2]
		}
	}
	try := func(file string) (int64, bool) {
		b, err := os.ReadFile(file)
		if err != nil {
			return 0, false
		}
		s := strings.TrimSpace(string(b))
		if s == "max" {
			return 0, false
		}
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil || v <= 0 || v >= 1<<62 { // v1 reports "unlimited" as a huge page-rounded number
			return 0, false
		}
		return v, true
	}
	if v1 != "" {
		for _, dir := range []string{root + "/memory" + v1, root + "/memory"} {
			file := dir + "/memory.limit_in_bytes"
			if v, ok := try(file); ok {
				return v, file, true
			}
		}
	}
	if v2 != "" {
		for _, dir := range []string{root + v2, root + "/unified" + v2, root} {
			file := dir + "/memory.max"
			if v, ok := try(file); ok {
				return v, file, true
			}
		}
	}
	return 0, "", false
}

func hasController(list, name string) bool {
	for _, c := range strings.Split(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}
