package ring

import (
	"testing"
	"time"
)

func TestAliveCheckRateLimited(t *testing.T) {
	calls := 0
	alive := true
	probe := func() bool { calls++; return alive }
	var a aliveCheck
	for i := 0; i < 100; i++ {
		if !a.ok(probe) {
			t.Fatal("reported dead while alive")
		}
	}
	if calls != 1 {
		t.Fatalf("%d /proc probes in a burst, want 1", calls)
	}
	// After AliveEvery it asks again; a dead answer is never cached.
	a.at = a.at.Add(-AliveEvery - time.Millisecond)
	alive = false
	for i := 0; i < 3; i++ {
		if a.ok(probe) {
			t.Fatalf("call %d: dead peer reported alive", i)
		}
	}
	if calls != 4 {
		t.Fatalf("%d probes, want 4 (each answer of dead is fresh)", calls)
	}
}
