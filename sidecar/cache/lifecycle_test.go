package cache

import (
	"bytes"
	"errors"
	"testing"
	"time"
)

// TestLoadPinOutlivesLease: a load's own pin keeps its blocks (and slots)
// while the copy runs, whatever happens to the lease it came from.
func TestLoadPinOutlivesLease(t *testing.T) {
	for _, end := range []string{"release", "expiry", "release owner"} {
		t.Run(end, func(t *testing.T) {
			x := newTC(t, 8)
			ns := x.ns(8, 1, 0)
			other := x.ns(8, 1, 1)
			for i := 0; i < 4; i++ {
				x.store(ns, dig(i, 8), 0)
			}
			l := x.acquire(ns, 0, digs(8, 0, 1, 2, 3), 1, 10*time.Millisecond, 0)
			id, slots, err := x.c.BeginLoad(l.ID, 0, 1, 2, nil)
			if err != nil || len(slots) != 2 || slots[0] != l.Slots[1] || slots[1] != l.Slots[2] {
				t.Fatalf("BeginLoad = %d %v %v (lease slots %v)", id, slots, err, l.Slots)
			}
			x.check()
			switch end {
			case "release":
				if err := x.c.Release(l.ID); err != nil {
					t.Fatal(err)
				}
			case "expiry":
				if r := x.c.Reap(time.Second.Nanoseconds()); r.Leases != 1 {
					t.Fatalf("reap %+v", r)
				}
			case "release owner":
				x.c.ReleaseOwner(1)
			}
			x.check()
			// Another tenant fills the pool: only the two loading blocks
			// must survive, in the slots the copy reads.
			for i := 0; i < 20; i++ {
				x.c.BeginStore(other, 0, dig(100+i, 8), 2, 0)
			}
			x.c.ReleaseOwner(2)
			for i := 0; i < 20; i++ {
				x.store(other, dig(200+i, 8), 0)
			}
			if got := x.lookup(ns, digs(8, 1, 2)); got != 2 {
				t.Fatalf("loading blocks gone: lookup %d", got)
			}
			if st := x.c.Stats(); st.PinnedBlocks != 2 || st.Loads != 1 {
				t.Fatalf("stats %+v", st)
			}
			if err := x.c.EndLoad(id); err != nil {
				t.Fatal(err)
			}
			wantErr(t, x.c.EndLoad(id), ErrUnknownLoad)
			x.check()
			for i := 0; i < 20; i++ {
				x.store(other, dig(300+i, 8), 0)
			}
			if got := x.lookup(ns, digs(8, 1, 2)); got != 0 {
				t.Fatalf("blocks still pinned after EndLoad: lookup %d", got)
			}
		})
	}
	t.Run("bad arguments", func(t *testing.T) {
		x := newTC(t, 8)
		ns := x.ns(8, 2, 0)
		x.store(ns, dig(1, 8), 0)
		l := x.acquire(ns, 0, dig(1, 8), 1, time.Second, 0)
		for _, c := range []struct{ rank, first, n int }{{0, 0, 2}, {0, -1, 1}, {0, 1, 1}, {2, 0, 1}, {-1, 0, 1}} {
			if _, _, err := x.c.BeginLoad(l.ID, c.rank, c.first, c.n, nil); err == nil {
				t.Errorf("BeginLoad(rank %d, [%d,+%d)) accepted", c.rank, c.first, c.n)
			}
		}
		if _, _, err := x.c.BeginLoad(999, 0, 0, 1, nil); !errors.Is(err, ErrUnknownLease) {
			t.Errorf("unknown lease: %v", err)
		}
		x.check()
	})
}

// TestAcquireCollapsesRepeats: the same digest repeated pins one block.
func TestAcquireCollapsesRepeats(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	x.store(ns, dig(1, 8), 0)
	x.store(ns, dig(2, 8), 0)
	var view []byte
	for i := 0; i < 8192; i++ {
		view = append(view, dig(1, 8)...)
	}
	l := x.acquire(ns, 0, view, 1, time.Second, 0)
	if l.Blocks != 1 || len(l.Slots) != 1 {
		t.Fatalf("lease over one digest repeated: %d blocks", l.Blocks)
	}
	l2 := x.acquire(ns, 0, digs(8, 1, 2, 1, 2), 1, time.Second, 0)
	if l2.Blocks != 2 {
		t.Fatalf("lease over 1,2,1,2: %d blocks", l2.Blocks)
	}
	if n := x.lookup(ns, digs(8, 2, 2)); n != 1 {
		t.Fatalf("lookup 2,2 = %d", n)
	}
}

// TestPendingCharge: BeginStoreCharged keeps a payer's incomplete blocks
// under its limit, and every way a block stops being incomplete ends the
// charge.
func TestPendingCharge(t *testing.T) {
	x := newTC(t, 32) // WriteTimeout 100ms
	ns := x.ns(8, 4, 0)
	ch := Charge{Key: 7, Limit: 8}
	begin := func(i, rank int, want Status) Ticket {
		t.Helper()
		tk, st, err := x.c.BeginStoreCharged(ns, rank, dig(i, 8), 1, 0, ch)
		if err != nil || st != want {
			t.Fatalf("block %d rank %d: %v %v, want %v", i, rank, st, err, want)
		}
		x.check()
		return tk
	}
	a := begin(1, 0, Allocated)
	b := begin(2, 0, Allocated)
	begin(3, 0, OverQuota) // 12 slots > 8
	if got := x.c.PendingCharged(7); got != 8 {
		t.Fatalf("charged %d", got)
	}
	// Joining a block costs nothing new, whoever pays.
	a1 := begin(1, 1, Allocated)
	tk, st, _ := x.c.BeginStoreCharged(ns, 0, dig(3, 8), 2, 0, Charge{Key: 8, Limit: 4})
	if st != Allocated {
		t.Fatalf("another payer: %v", st)
	}
	x.c.AbortStore(tk) // the whole block is freed: its charge ends
	if x.c.PendingCharged(8) != 0 {
		t.Fatal("abort kept the charge")
	}
	x.c.AbortStore(b)
	if got := x.c.PendingCharged(7); got != 4 {
		t.Fatalf("after abort: charged %d", got)
	}
	x.check()
	// Completion ends the charge.
	x.commit(a)
	x.commit(a1)
	for r := 2; r < 4; r++ {
		tk, st, _ := x.c.BeginStoreCharged(ns, r, dig(1, 8), 1, 0, ch)
		if st == Allocated {
			x.commit(tk)
		}
	}
	if got := x.c.PendingCharged(7); got != 0 || x.lookup(ns, dig(1, 8)) != 1 {
		t.Fatalf("after completion: charged %d", got)
	}
	// Expiry ends the charge, also of a doomed block.
	d := begin(5, 0, Allocated)
	x.c.Reap(time.Second.Nanoseconds())
	if got := x.c.PendingCharged(7); got != 0 || x.c.Stats().DoomedBlocks != 1 {
		t.Fatalf("after expiry: charged %d, %+v", got, x.c.Stats())
	}
	wantErr(t, x.c.CommitStore(d), ErrDoomed)
	x.check()
}

// TestNamespaceLifecycle: an empty namespace can be removed, its id is
// reused, and cursors into the old one never validate.
func TestNamespaceLifecycle(t *testing.T) {
	x := newTC(t, 8)
	a := x.ns(8, 1, 1)
	b := x.ns(8, 1, 2)
	x.store(a, dig(1, 8), 0)
	cur, _ := x.c.Head(a)
	wantErr(t, x.c.RemoveNamespace(a), ErrNamespaceInUse)
	l := x.acquire(a, 0, dig(1, 8), 1, time.Second, 0)
	if n, _ := x.c.Clear(a); n != 0 {
		t.Fatal("cleared a pinned block")
	}
	wantErr(t, x.c.RemoveNamespace(a), ErrNamespaceInUse)
	x.c.Release(l.ID)
	x.c.Clear(a)
	if err := x.c.RemoveNamespace(a); err != nil {
		t.Fatal(err)
	}
	x.check()
	wantErr(t, x.c.RemoveNamespace(a), ErrUnknownNamespace)
	if _, err := x.c.Lookup(a, dig(1, 8)); !errors.Is(err, ErrUnknownNamespace) {
		t.Fatalf("lookup in a removed namespace: %v", err)
	}
	if x.c.Namespaces() != 1 {
		t.Fatalf("%d namespaces", x.c.Namespaces())
	}
	// The same key comes back with the reused id and a fresh log.
	a2 := x.ns(8, 1, 1)
	if a2 != a {
		t.Fatalf("id %d not reused (was %d)", a2, a)
	}
	x.store(a2, dig(9, 8), 0)
	if _, _, err := x.c.ChangesSince(a2, cur, 10, nil); !errors.Is(err, ErrResync) {
		t.Fatalf("a cursor of the removed namespace validated: %v", err)
	}
	if n := x.lookup(a2, dig(1, 8)); n != 0 {
		t.Fatal("a removed namespace's block came back")
	}
	if n := x.lookup(b, dig(1, 8)); n != 0 {
		t.Fatal("namespace b sees a's block")
	}
	x.check()
}

// TestLogGrowsLazily: a log starts small, doubles only when it would
// overwrite entries, never past DeltaLogSize or MaxLogBytes.
func TestLogGrowsLazily(t *testing.T) {
	c, err := New(Config{Capacity: 4, DeltaLogSize: 64, InitialLogSize: 4, MaxLogBytes: 3 * 16 * logEntrySize, Epoch: 3})
	if err != nil {
		t.Fatal(err)
	}
	x := &tc{t: t, c: c}
	a := x.ns(8, 1, 1)
	if c.LogBytes() != 4*logEntrySize {
		t.Fatalf("initial log bytes %d", c.LogBytes())
	}
	start, _ := c.Head(a)
	for i := 0; i < 10; i++ { // 4 stores, then 6 x (evict + store)
		x.store(a, dig(i, 8), 0)
	}
	ch, _, err := c.ChangesSince(a, start, -1, nil)
	if err != nil || len(ch) != 16 {
		t.Fatalf("all 16 changes should still be readable after growth: %d %v", len(ch), err)
	}
	if !bytes.Equal(ch[15].Digest(), dig(9, 8)) {
		t.Fatalf("last change %+v", ch[15])
	}
	if c.LogBytes() != 16*logEntrySize {
		t.Fatalf("log bytes %d, want 16 entries", c.LogBytes())
	}
	// A second namespace may grow only within the bound that is left.
	b := x.ns(8, 1, 2)
	for i := 0; i < 200; i++ {
		x.store(b, dig(i, 8), 0)
	}
	if c.LogBytes() > c.cfg.MaxLogBytes {
		t.Fatalf("log bytes %d over the bound %d", c.LogBytes(), c.cfg.MaxLogBytes)
	}
	if _, _, err := c.ChangesSince(b, Cursor{Epoch: 3, Seq: 2 << logSeqShift}, -1, nil); !errors.Is(err, ErrResync) {
		t.Fatalf("b's oldest changes should be overwritten: %v", err)
	}
	x.check()
}
