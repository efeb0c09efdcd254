package reliability

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/internal/sys"
)

// The sidecar runs every thread under SCHED_BATCH unless told not to, so
// that an engine waking it never gets preempted by it on a shared CPU.
func TestSidecarSchedulingPolicy(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want uint32
	}{
		{"default", nil, unix.SCHED_BATCH},
		{"off", []string{"--sched.batch=false"}, unix.SCHED_NORMAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startSidecar(t, newDir(t), tc.args...)
			pol, err := sys.ThreadPolicies(s.pid())
			if err != nil {
				t.Fatal(err)
			}
			if len(pol) < 2 {
				t.Fatalf("%d threads listed", len(pol))
			}
			for tid, p := range pol {
				if p != tc.want {
					t.Errorf("thread %d: policy %d, want %d", tid, p, tc.want)
				}
			}
		})
	}
}
