package sys

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// SetBatchScheduling puts every thread of this process under SCHED_BATCH
// (keeping its nice value). Threads created later inherit the policy from
// the thread that creates them, so once all are batch, the process stays
// batch.
//
// Why: under the default policy, a thread woken by an engine (a futex wake
// when a request arrives in the ring) may preempt the engine thread that
// woke it when both share a CPU; on a virtual machine that cost the engine
// ~260 µs per wake in measurements (docs/benchmarks.md). The kernel never
// preempts a running SCHED_NORMAL thread in favour of a waking SCHED_BATCH
// one: the sidecar runs on an idle CPU at once, or when the engine thread
// blocks, or at the next tick. No privilege is needed to choose it.
//
// It returns the number of threads switched.
func SetBatchScheduling() (int, error) {
	changed := 0
	// Threads may be created while the list is walked: repeat until a pass
	// finds none left to switch.
	for pass := 0; pass < 10; pass++ {
		tids, err := threads()
		if err != nil {
			return changed, err
		}
		n := 0
		for _, tid := range tids {
			a, err := unix.SchedGetAttr(tid, 0)
			if err != nil {
				if err == unix.ESRCH {
					continue // exited meanwhile
				}
				return changed, fmt.Errorf("sched_getattr %d: %w", tid, err)
			}
			if a.Policy == unix.SCHED_BATCH {
				continue
			}
			if a.Policy != unix.SCHED_NORMAL {
				continue // a real-time or idle policy set on purpose: left alone
			}
			b := unix.SchedAttr{Policy: unix.SCHED_BATCH, Nice: a.Nice}
			if err := unix.SchedSetAttr(tid, &b, 0); err != nil {
				if err == unix.ESRCH {
					continue
				}
				return changed, fmt.Errorf("sched_setattr %d SCHED_BATCH: %w", tid, err)
			}
			n++
		}
		changed += n
		if n == 0 {
			return changed, nil
		}
	}
	return changed, nil
}

// ThreadPolicies returns the scheduling policy of each thread of process
// pid (0: this process), by thread id.
func ThreadPolicies(pid int) (map[int]uint32, error) {
	dir := "/proc/self/task"
	if pid != 0 {
		dir = "/proc/" + strconv.Itoa(pid) + "/task"
	}
	tids, err := listTids(dir)
	if err != nil {
		return nil, err
	}
	out := make(map[int]uint32, len(tids))
	for _, tid := range tids {
		a, err := unix.SchedGetAttr(tid, 0)
		if err != nil {
			if err == unix.ESRCH {
				continue
			}
			return nil, fmt.Errorf("sched_getattr %d: %w", tid, err)
		}
		out[tid] = a.Policy
	}
	return out, nil
}

func threads() ([]int, error) { return listTids("/proc/self/task") }

func listTids(dir string) ([]int, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	tids := make([]int, 0, len(ents))
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// NiceThread lowers the calling thread's priority by delta nice steps (a
// higher nice value; no privilege needed). Call it from a goroutine locked
// to its thread (runtime.LockOSThread): the copy workers of the sidecar
// run this way, so that on a busy CPU the session loops, which answer
// every other client, go first.
func NiceThread(delta int) error {
	tid := unix.Gettid()
	cur, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		return err
	}
	// getpriority returns 20 - nice.
	return unix.Setpriority(unix.PRIO_PROCESS, tid, min(20-cur+delta, 19))
}
