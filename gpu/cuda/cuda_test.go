package cuda

import (
	"errors"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

func TestSplitRanges(t *testing.T) {
	rs := []gpu.Range{{Pool: 0, Engine: 100, Len: 10}, {Pool: 14, Engine: 200, Len: 20}, {Pool: 40, Engine: 300, Len: 8}}
	got := splitRanges(append([]gpu.Range(nil), rs...), 16, 64)
	want := []gpu.Range{{Pool: 0, Engine: 100, Len: 10}, {Pool: 14, Engine: 200, Len: 2}, {Pool: 16, Engine: 202, Len: 16}, {Pool: 32, Engine: 218, Len: 2}, {Pool: 40, Engine: 300, Len: 8}}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
	if got := splitRanges(rs, 64, 64); len(got) != 3 {
		t.Errorf("pool within one chunk: %v", got)
	}
}

// TestUnavailable: without a driver New fails cleanly with ErrUnavailable
// (the conformance suite in gputest covers the rest).
func TestUnavailable(t *testing.T) {
	c, err := New(make([]byte, 4096), Options{})
	if err == nil {
		c.Close()
		t.Skip("a CUDA driver is present")
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("New = %v, want ErrUnavailable", err)
	}
	t.Log(err)
}

// Translation happens before merging, and merging stays inside one
// allocation: ranges contiguous in the engine's address space but in two
// allocations are two copies, and ranges contiguous only in the sidecar's
// mappings of two allocations are not merged either.
func TestLocalRanges(t *testing.T) {
	// Two allocations adjacent in the engine at 0x1000 and 0x2000, mapped
	// at 0x90000 and 0x50000 here.
	segs := []cudaSeg{{alloc: 0, delta: 0x90000 - 0x1000}, {alloc: 1, delta: 0x50000 - 0x2000}}
	got := localRanges([]gpu.Range{
		{Pool: 0, Engine: 0x1f00, Len: 0x100},     // page 0, segment 0: end of allocation 0
		{Pool: 0x100, Engine: 0x2000, Len: 0x100}, // page 0, segment 1: start of allocation 1
	}, segs)
	want := []gpu.Range{{Pool: 0, Engine: 0x90f00, Len: 0x100}, {Pool: 0x100, Engine: 0x50000, Len: 0x100}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("adjacent allocations: got %x, want %x", got, want)
	}
	// Within one allocation, contiguous pages merge.
	flat := []cudaSeg{{alloc: 0, delta: 0x100000}}
	got = localRanges([]gpu.Range{{Pool: 0, Engine: 0x10, Len: 8}, {Pool: 8, Engine: 0x18, Len: 8}, {Pool: 32, Engine: 0x20, Len: 8}}, flat)
	if want := []gpu.Range{{Pool: 0, Engine: 0x100010, Len: 16}, {Pool: 32, Engine: 0x100020, Len: 8}}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("one allocation: got %x, want %x", got, want)
	}
	// Two allocations whose mappings here happen to be adjacent: still two.
	segs = []cudaSeg{{alloc: 0, delta: 0x10000}, {alloc: 1, delta: 0x11000 - 0x5000}}
	got = localRanges([]gpu.Range{{Pool: 0, Engine: 0x0ff0, Len: 0x10}, {Pool: 0x10, Engine: 0x5000, Len: 0x10}}, segs)
	if len(got) != 2 || got[0].Engine+got[0].Len != got[1].Engine || got[0].Pool+got[0].Len != got[1].Pool {
		t.Fatalf("adjacent mappings of two allocations: got %x", got)
	}
}

// A completion is noticed within 50 µs of polling: the backoff between
// polls never sleeps longer while ops are in flight.
func TestPollSleepCapped(t *testing.T) {
	d := pollMin
	for range 100 {
		if d > 50*time.Microsecond {
			t.Fatalf("the poll sleeps %v", d)
		}
		d = nextPollSleep(d)
	}
}
