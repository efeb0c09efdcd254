package sys

import (
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

func TestSetBatchScheduling(t *testing.T) {
	if _, err := SetBatchScheduling(); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		pol, err := ThreadPolicies(0)
		if err != nil {
			t.Fatal(err)
		}
		if len(pol) == 0 {
			t.Fatalf("%s: no threads listed", when)
		}
		for tid, p := range pol {
			if p != unix.SCHED_BATCH {
				t.Errorf("%s: thread %d has policy %d, want SCHED_BATCH (%d)", when, tid, p, unix.SCHED_BATCH)
			}
		}
	}
	check("after the call")
	// Threads created afterwards inherit it: lock goroutines to threads so
	// that the runtime must start new ones.
	const n = 8
	ready, done := make(chan struct{}), make(chan struct{})
	for i := 0; i < n; i++ {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			ready <- struct{}{}
			<-done
		}()
	}
	for i := 0; i < n; i++ {
		<-ready
	}
	check("with new threads")
	close(done)
	// A second call finds nothing to switch.
	if c, err := SetBatchScheduling(); err != nil || c != 0 {
		t.Fatalf("second call: %d threads switched, %v", c, err)
	}
}
