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

// A wait that keeps timing out sleeps longer each time, up to IdlePark; a
// record published meanwhile still ends it at once (the futex wake).
func TestIdleParkGrows(t *testing.T) {
	for _, tc := range []struct {
		name     string
		idle     time.Duration
		maxParks uint64
	}{
		{"fixed", 0, 1000},                     // 10 ms slices: ~60 parks in 600 ms
		{"growing", 80 * time.Millisecond, 12}, // 10, 20, 40, then 80 ms: ~10
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, p, c := newHeapRingWait(t, 4096, 256, WaitConfig{Park: 10 * time.Millisecond, IdlePark: tc.idle})
			// What a 10 ms sleep takes on this machine now: a loaded one
			// stretches every park alike.
			t0 := time.Now()
			for range 10 {
				time.Sleep(10 * time.Millisecond)
			}
			slice := time.Since(t0) / 10
			t0 = time.Now()
			if err := c.Wait(t0.Add(600 * time.Millisecond)); err == nil {
				t.Fatal("a wait on an empty ring returned without a record")
			}
			waited := time.Since(t0)
			parks := c.Stats().Parks
			if parks > tc.maxParks {
				t.Fatalf("%d parks in %v", parks, waited)
			}
			// The fixed case's parks do not grow: each takes about what a
			// 10 ms sleep takes (at most 3 times as long, the time to wake
			// and check included), not the growing case's 10, 20, 40, 80 ms.
			if tc.idle == 0 && (parks == 0 || waited/time.Duration(parks) > 3*slice) {
				t.Fatalf("%d parks in %v: longer than 3 x %v a park", parks, waited, slice)
			}
			// A record published while it parks ends the wait.
			done := make(chan error, 1)
			go func() { done <- c.Wait(time.Now().Add(5 * time.Second)) }()
			time.Sleep(150 * time.Millisecond)
			if err := p.Write(1, 0, 1, []byte("x"), time.Now().Add(time.Second)); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatalf("wait after a publish: %v", err)
			}
		})
	}
}
