package cache

import (
	"testing"
	"time"
)

func TestBeginFetchReservesEveryRank(t *testing.T) {
	for _, tc := range []struct {
		name   string
		commit int // tickets committed (the rest aborted)
		want   BlockState
	}{
		{"all committed", 2, Present},
		{"one aborted", 1, Pending},
		{"none committed", 0, Absent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := newTC(t, 8)
			ns := x.ns(32, 2, 0)
			d := dig(1, 32)
			ts, st, err := x.c.BeginFetch(ns, d, 9, 0, Charge{})
			if err != nil || st != Allocated || len(ts) != 2 {
				t.Fatalf("BeginFetch = %v %v %v", ts, st, err)
			}
			x.check()
			if got := x.c.State(ns, d); got != Pending {
				t.Fatalf("state while fetching %v", got)
			}
			if x.lookup(ns, d) != 0 {
				t.Fatal("a block being fetched is visible")
			}
			// A store of the block meanwhile is told someone writes it.
			if _, st, _ := x.c.BeginStore(ns, 0, d, 1, 0); st != InFlight {
				t.Fatalf("store during the fetch: %v", st)
			}
			for i, tk := range ts {
				if i < tc.commit {
					x.commit(tk)
				} else if err := x.c.AbortStore(tk); err != nil {
					t.Fatal(err)
				}
				x.check()
			}
			if got := x.c.State(ns, d); got != tc.want {
				t.Fatalf("state %v, want %v", got, tc.want)
			}
		})
	}
}

func TestBeginFetchRefusals(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(32, 2, 0)
	x.store(ns, dig(1, 32), 0)
	if _, st, _ := x.c.BeginFetch(ns, dig(1, 32), 9, 0, Charge{}); st != AlreadyPresent {
		t.Fatalf("present block: %v", st)
	}
	x.begin(ns, 0, dig(2, 32), 1, 0, Allocated)
	if _, st, _ := x.c.BeginFetch(ns, dig(2, 32), 9, 0, Charge{}); st != InFlight {
		t.Fatalf("pending block: %v", st)
	}
	// Four slots: two blocks of two; one is being written, the other is
	// evictable. A charge of 2 slots is used by the pending block.
	if _, st, _ := x.c.BeginFetch(ns, dig(3, 32), 9, 0, Charge{Key: 5, Limit: 1}); st != OverQuota {
		t.Fatalf("over quota: %v", st)
	}
	ts, st, _ := x.c.BeginFetch(ns, dig(3, 32), 9, 0, Charge{})
	if st != Allocated {
		t.Fatalf("evicting fetch: %v", st)
	}
	if _, st, _ := x.c.BeginFetch(ns, dig(4, 32), 9, 0, Charge{}); st != NoSpace {
		t.Fatalf("full pool: %v", st)
	}
	for _, tk := range ts {
		x.commit(tk)
	}
	x.check()
}

func TestOpenLeaseExtends(t *testing.T) {
	x := newTC(t, 16)
	ns := x.ns(32, 1, 0)
	view := digs(32, 1, 2, 3, 4)
	x.store(ns, dig(1, 32), 0)
	l, _, err := x.c.AcquireOpen(ns, 0, view, 3, time.Second, 0, Charge{Key: 7})
	if err != nil || l.ID == 0 || l.Blocks != 1 {
		t.Fatalf("AcquireOpen = %+v %v", l, err)
	}
	// An open lease over nothing present still gets an id.
	e, _, err := x.c.AcquireOpen(ns, 0, digs(32, 9), 3, time.Second, 0, Charge{Key: 7})
	if err != nil || e.ID == 0 || e.Blocks != 0 {
		t.Fatalf("empty AcquireOpen = %+v %v", e, err)
	}
	x.check()
	// Blocks 2 and 3 come in; 4 does not.
	x.store(ns, dig(2, 32), 0)
	x.store(ns, dig(3, 32), 0)
	n, short, err := x.c.ExtendLease(l.ID, ns, view[32:], 0)
	if err != nil || n != 2 || short {
		t.Fatalf("ExtendLease = %d %v %v", n, short, err)
	}
	if b, _ := x.c.LeaseBlocks(l.ID); b != 3 {
		t.Fatalf("lease holds %d blocks", b)
	}
	x.check()
	// A repeat of a held block ends an extension.
	if n, _, _ := x.c.ExtendLease(l.ID, ns, digs(32, 1, 2), 0); n != 0 {
		t.Fatalf("repeated blocks added: %d", n)
	}
	// The empty lease extends too, up to its key's limit: key 7 pins
	// blocks 1-3, so a limit of 4 slots leaves room for block 9 alone.
	x.store(ns, dig(9, 32), 0)
	x.store(ns, dig(10, 32), 0)
	n, short, _ = x.c.ExtendLease(e.ID, ns, digs(32, 9, 10), 4)
	if n != 1 || !short {
		t.Fatalf("limited extension = %d short %v", n, short)
	}
	x.check()
	// Pinned blocks are not evictable; releasing gives them back.
	if st := x.c.Stats(); st.PinnedBlocks != 4 {
		t.Fatalf("pinned %d", st.PinnedBlocks)
	}
	x.c.Release(l.ID)
	x.c.Release(e.ID)
	x.check()
	if st := x.c.Stats(); st.PinnedBlocks != 0 || st.Leases != 0 || x.c.PinnedCharged(7) != 0 {
		t.Fatalf("after release: %+v charged %d", st, x.c.PinnedCharged(7))
	}
	if _, _, err := x.c.ExtendLease(l.ID, ns, view, 0); err == nil {
		t.Fatal("extended a released lease")
	}
}

func TestPinBlockToTailAndMarks(t *testing.T) {
	x := newTC(t, 3)
	ns := x.ns(32, 1, 0)
	for i := 1; i <= 3; i++ {
		x.store(ns, dig(i, 32), 0)
	}
	// LRU, least recent first: 1, 2, 3.
	tail := func() []int {
		var out []int
		x.c.LRUTail(10, func(_ NamespaceID, d []byte, _ bool) bool {
			out = append(out, int(d[31]))
			return true
		})
		return out
	}
	if got := tail(); len(got) != 3 || got[0] != 1 || got[2] != 3 {
		t.Fatalf("tail %v", got)
	}
	// Block 3 (the most recent) pinned for a write that ends at the tail.
	id, slots, ok := x.c.PinBlock(ns, dig(3, 32), true, nil)
	if !ok || len(slots) != 1 {
		t.Fatal("PinBlock failed")
	}
	x.check()
	if got := tail(); len(got) != 2 {
		t.Fatalf("a pinned block is in the LRU: %v", got)
	}
	if !x.c.Mark(ns, dig(3, 32)) || !x.c.Marked(ns, dig(3, 32)) {
		t.Fatal("mark")
	}
	x.c.EndLoad(id)
	x.check()
	if got := tail(); got[0] != 3 {
		t.Fatalf("a tail pin's end left the block at %v", got)
	}
	// A plain pin's end makes it the most recent.
	id, _, _ = x.c.PinBlock(ns, dig(1, 32), false, nil)
	x.c.EndLoad(id)
	if got := tail(); got[2] != 1 {
		t.Fatalf("after a plain pin %v", got)
	}
	// Evicting the marked block 3 and the unmarked block 2.
	x.store(ns, dig(4, 32), 0)
	x.store(ns, dig(5, 32), 0)
	st := x.c.Stats()
	if st.Evictions != 2 || st.EvictedUnmarked != 1 {
		t.Fatalf("evictions %d unmarked %d", st.Evictions, st.EvictedUnmarked)
	}
	// The slot's mark went with the block.
	if x.c.Marked(ns, dig(3, 32)) || x.c.Marked(ns, dig(4, 32)) || x.c.Marked(ns, dig(5, 32)) {
		t.Fatal("a mark survived eviction or reached a new block")
	}
	if _, _, ok := x.c.PinBlock(ns, dig(3, 32), false, nil); ok {
		t.Fatal("pinned an absent block")
	}
	x.check()
}
