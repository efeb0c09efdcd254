package cache

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	for _, tt := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"ok", Config{Capacity: 10, Epoch: 1}, true},
		{"zero capacity", Config{Epoch: 1}, false},
		{"zero epoch", Config{Capacity: 10}, false},
		{"log not pow2", Config{Capacity: 10, Epoch: 1, DeltaLogSize: 3}, false},
		{"negative timeout", Config{Capacity: 10, Epoch: 1, WriteTimeout: -1}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			if (err == nil) != tt.ok {
				t.Fatalf("New(%+v) err = %v", tt.cfg, err)
			}
			if err != nil && !errors.Is(err, ErrBadConfig) {
				t.Fatalf("err %v is not ErrBadConfig", err)
			}
		})
	}
}

func TestAddNamespace(t *testing.T) {
	x := newTC(t, 8)
	k := NamespaceKey{Model: "llama", Layout: 3, TenantSalt: 9, DigestWidth: 16, WorldSize: 2}
	a, err := x.c.AddNamespace(k)
	if err != nil || a == 0 {
		t.Fatal(a, err)
	}
	b, _ := x.c.AddNamespace(k)
	if a != b {
		t.Fatalf("not idempotent: %d vs %d", a, b)
	}
	k2 := k
	k2.TenantSalt = 10
	if c2, _ := x.c.AddNamespace(k2); c2 == a {
		t.Fatal("different tenant got same namespace")
	}
	for _, bad := range []NamespaceKey{
		{DigestWidth: 12, WorldSize: 1},
		{DigestWidth: 8, WorldSize: 0},
		{DigestWidth: 8, WorldSize: 65},
		{DigestWidth: 8, WorldSize: 9}, // > capacity
	} {
		if _, err := x.c.AddNamespace(bad); !errors.Is(err, ErrBadNamespaceKey) {
			t.Errorf("AddNamespace(%+v) err = %v", bad, err)
		}
	}
	if got, _ := x.c.Namespace(a); got != k {
		t.Fatalf("Namespace = %+v", got)
	}
	x.check()
}

func TestBadArguments(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(8, 2, 0)
	d := dig(1, 8)
	for _, tt := range []struct {
		name string
		err  error
		want error
	}{
		{"begin unknown ns", func() error { _, _, err := x.c.BeginStore(99, 0, d, 1, 0); return err }(), ErrUnknownNamespace},
		{"begin ns 0", func() error { _, _, err := x.c.BeginStore(0, 0, d, 1, 0); return err }(), ErrUnknownNamespace},
		{"begin bad rank", func() error { _, _, err := x.c.BeginStore(ns, 2, d, 1, 0); return err }(), ErrBadRank},
		{"begin negative rank", func() error { _, _, err := x.c.BeginStore(ns, -1, d, 1, 0); return err }(), ErrBadRank},
		{"begin short digest", func() error { _, _, err := x.c.BeginStore(ns, 0, d[:7], 1, 0); return err }(), ErrBadDigest},
		{"lookup ragged", func() error { _, err := x.c.Lookup(ns, make([]byte, 12)); return err }(), ErrBadDigest},
		{"lookup unknown ns", func() error { _, err := x.c.Lookup(5, d); return err }(), ErrUnknownNamespace},
		{"acquire zero ttl", func() error { _, err := x.c.Acquire(ns, 0, d, 1, 0, 0); return err }(), ErrBadTTL},
		{"acquire bad rank", func() error { _, err := x.c.Acquire(ns, 3, d, 1, time.Second, 0); return err }(), ErrBadRank},
		{"release unknown", x.c.Release(42), ErrUnknownLease},
		{"renew unknown", x.c.Renew(42, time.Second, 0), ErrUnknownLease},
		{"commit unknown", x.c.CommitStore(Ticket{Slot: 3, ID: 9}), ErrStaleTicket},
		{"commit out of range", x.c.CommitStore(Ticket{Slot: 1 << 30, ID: 9}), ErrStaleTicket},
		{"abort unknown", x.c.AbortStore(Ticket{Slot: 0, ID: 1}), ErrStaleTicket},
		{"changes unknown ns", func() error { _, _, err := x.c.ChangesSince(7, Cursor{}, 1, nil); return err }(), ErrUnknownNamespace},
		{"clear unknown ns", func() error { _, err := x.c.Clear(7); return err }(), ErrUnknownNamespace},
	} {
		t.Run(tt.name, func(t *testing.T) { wantErr(t, tt.err, tt.want) })
	}
	if err := x.c.Release(0); err != nil {
		t.Fatalf("Release(0) = %v", err)
	}
	x.check()
}

// TestStoreTransitions walks every slot-state transition of one block.
func TestStoreTransitions(t *testing.T) {
	d := dig(1, 8)
	t.Run("begin-commit", func(t *testing.T) {
		x := newTC(t, 4)
		ns := x.ns(8, 1, 0)
		tk := x.begin(ns, 0, d, 1, 0, Allocated)
		if s := x.c.Stats(); s.Writing != 1 || s.Free != 3 || s.Blocks != 0 {
			t.Fatalf("stats %+v", s)
		}
		if x.lookup(ns, d) != 0 {
			t.Fatal("writing block visible to Lookup")
		}
		if l := x.acquire(ns, 0, d, 1, time.Second, 0); l.ID != 0 || l.Blocks != 0 {
			t.Fatalf("writing block acquired: %+v", l)
		}
		x.begin(ns, 0, d, 2, 0, InFlight)
		x.commit(tk)
		if x.lookup(ns, d) != 1 || x.c.Len(ns) != 1 {
			t.Fatal("committed block not visible")
		}
		x.begin(ns, 0, d, 2, 0, AlreadyPresent)
		wantErr(t, x.c.CommitStore(tk), ErrStaleTicket) // double commit
		wantErr(t, x.c.AbortStore(tk), ErrStaleTicket)  // abort after commit
		x.check()
		if s := x.c.Stats(); s.Stored != 1 || s.Stores != 1 {
			t.Fatalf("stats %+v", s)
		}
	})
	t.Run("begin-abort", func(t *testing.T) {
		x := newTC(t, 4)
		ns := x.ns(8, 1, 0)
		tk := x.begin(ns, 0, d, 1, 0, Allocated)
		if err := x.c.AbortStore(tk); err != nil {
			t.Fatal(err)
		}
		x.check()
		if s := x.c.Stats(); s.Free != 4 || s.PendingBlocks != 0 {
			t.Fatalf("abort did not free: %+v", s)
		}
		wantErr(t, x.c.AbortStore(tk), ErrStaleTicket)
		wantErr(t, x.c.CommitStore(tk), ErrStaleTicket)
		// The freed slot is reused by a new writer; the old ticket stays stale.
		tk2 := x.begin(ns, 0, d, 1, 0, Allocated)
		if tk2.Slot == tk.Slot {
			wantErr(t, x.c.CommitStore(tk), ErrStaleTicket)
		}
		x.commit(tk2)
	})
	t.Run("evict-after-commit", func(t *testing.T) {
		x := newTC(t, 1)
		ns := x.ns(8, 1, 0)
		x.store(ns, d, 0)
		x.store(ns, dig(2, 8), 0)
		if x.lookup(ns, d) != 0 || x.lookup(ns, dig(2, 8)) != 1 {
			t.Fatal("eviction did not replace block")
		}
		if x.c.Stats().Evictions != 1 {
			t.Fatal("eviction not counted")
		}
	})
}

func TestTensorParallelPresence(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(16, 2, 0)
	d := dig(5, 16)
	t0 := x.begin(ns, 0, d, 10, 0, Allocated)
	if s := x.c.Stats(); s.Reserved != 1 || s.Writing != 1 || s.Free != 6 {
		t.Fatalf("group not reserved at once: %+v", s)
	}
	x.commit(t0)
	for r := 0; r < 2; r++ {
		if x.lookup(ns, d) != 0 {
			t.Fatalf("rank 0 stored, rank 1 not: lookup hit (asking rank %d)", r)
		}
		if l := x.acquire(ns, r, d, 10, time.Second, 0); l.Blocks != 0 {
			t.Fatal("incomplete block acquired")
		}
	}
	x.begin(ns, 0, d, 10, 0, AlreadyPresent) // rank 0 must not store twice
	t1 := x.begin(ns, 1, d, 11, 0, Allocated)
	if t1.Slot == t0.Slot {
		t.Fatal("ranks share a slot")
	}
	x.begin(ns, 1, d, 12, 0, InFlight)
	x.commit(t1)
	if x.lookup(ns, d) != 1 {
		t.Fatal("complete block missing")
	}
	l0 := x.acquire(ns, 0, d, 10, time.Second, 0)
	l1 := x.acquire(ns, 1, d, 11, time.Second, 0)
	if l0.Blocks != 1 || l1.Blocks != 1 || l0.Slots[0] != t0.Slot || l1.Slots[0] != t1.Slot {
		t.Fatalf("per-rank slots wrong: %+v %+v (tickets %v %v)", l0, l1, t0, t1)
	}
	if x.c.Stats().PinnedBlocks != 1 {
		t.Fatal("pin not counted once per block")
	}
	// Rank 1 aborting after rank 0 committed keeps the block pending.
	d2 := dig(6, 16)
	x.commit(x.begin(ns, 0, d2, 10, 0, Allocated))
	a := x.begin(ns, 1, d2, 11, 0, Allocated)
	if err := x.c.AbortStore(a); err != nil {
		t.Fatal(err)
	}
	x.check()
	if s := x.c.Stats(); s.PendingBlocks != 1 || s.Reserved != 1 {
		t.Fatalf("after abort: %+v", s)
	}
	x.commit(x.begin(ns, 1, d2, 11, 0, Allocated)) // retry
	if x.lookup(ns, digs(16, 5, 6)) != 2 {
		t.Fatal("retry did not complete block")
	}
	// NoSpace is all-or-nothing: 6 slots pinned, 2 free; a second W=2 block
	// fits, a third does not (and nothing is evicted for it).
	x.commit(x.begin(ns, 0, dig(7, 16), 1, 0, Allocated))
	x.commit(x.begin(ns, 1, dig(7, 16), 1, 0, Allocated))
	x.acquire(ns, 0, digs(16, 5, 6, 7), 1, time.Second, 0)
	if _, st, _ := x.c.BeginStore(ns, 0, dig(8, 16), 1, 0); st != Allocated {
		t.Fatalf("2 free slots: %v", st)
	}
	if _, st, _ := x.c.BeginStore(ns, 0, dig(9, 16), 1, 0); st != NoSpace {
		t.Fatalf("0 free slots: %v", st)
	}
	x.check()
}

func TestNamespaceIsolation(t *testing.T) {
	x := newTC(t, 8)
	a := x.ns(8, 1, 1)
	b := x.ns(8, 1, 2)
	d := dig(1, 8)
	x.store(a, d, 0)
	if x.lookup(b, d) != 0 {
		t.Fatal("block visible across namespaces")
	}
	if l := x.acquire(b, 0, d, 1, time.Second, 0); l.Blocks != 0 {
		t.Fatal("acquired across namespaces")
	}
	x.begin(b, 0, d, 1, 0, Allocated) // not AlreadyPresent
	if x.c.Len(a) != 1 || x.c.Len(b) != 0 {
		t.Fatal("Len mixes namespaces")
	}
	if _, err := x.c.Clear(b); err != nil {
		t.Fatal(err)
	}
	x.check()
	if x.lookup(a, d) != 1 {
		t.Fatal("Clear of b dropped a's block")
	}
}

func TestDigestsDifferingInLastByte(t *testing.T) {
	for _, w := range []int{8, 16, 32} {
		t.Run(fmt.Sprintf("width%d", w), func(t *testing.T) {
			x := newTC(t, 600)
			ns := x.ns(w, 1, 0)
			for i := 0; i < 256; i += 2 {
				x.store(ns, dig(i, w), 0)
			}
			for i := 0; i < 256; i++ {
				got := x.c.find(uint16(ns), dig(i, w))
				if (got != NoSlot) != (i%2 == 0) {
					t.Fatalf("digest %d: found=%v", i, got != NoSlot)
				}
			}
			// Same leading bytes, different tail: never a match on a prefix.
			base := make([]byte, w)
			base[0] = 0xAA
			x.store(ns, base, 0)
			d := append([]byte(nil), base...)
			d[w-1] = 1
			if x.lookup(ns, d) != 0 || x.lookup(ns, base) != 1 {
				t.Fatal("matched a digest differing only in the last byte")
			}
			x.begin(ns, 0, d, 1, 0, Allocated)
		})
	}
}

func TestLookupLeadingAndCounters(t *testing.T) {
	x := newTC(t, 16)
	ns := x.ns(8, 1, 0)
	for _, i := range []int{1, 2, 3, 5} {
		x.store(ns, dig(i, 8), 0)
	}
	for _, tt := range []struct {
		name string
		ids  []int
		want int
	}{
		{"empty", nil, 0},
		{"all", []int{1, 2, 3}, 3},
		{"stop at miss", []int{1, 2, 4, 5}, 2},
		{"first miss", []int{4, 1, 2}, 0},
		{"a repeated digest ends the prefix", []int{1, 2, 1, 3}, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := x.lookup(ns, digs(8, tt.ids...)); got != tt.want {
				t.Fatalf("Lookup = %d, want %d", got, tt.want)
			}
		})
	}
	s := x.c.Stats()
	if s.Lookups != 5 || s.LookupBlocks != 14 || s.HitBlocks != 7 {
		t.Fatalf("counters %+v", s)
	}
}

func TestEvictionOrder(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 4; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	// Recency now 4,3,2,1 (1 oldest). A lookup of prefix [2,1] touches in
	// reverse: 2 is most recent and 1 next.
	x.lookup(ns, digs(8, 2, 1))
	// Expect evictions in order 3, 4, 1, 2.
	var got []int
	for i := 10; i < 14; i++ {
		x.store(ns, dig(i, 8), 0)
		for _, j := range []int{1, 2, 3, 4} {
			if x.c.find(uint16(ns), dig(j, 8)) == NoSlot && !contains(got, j) {
				got = append(got, j)
			}
		}
	}
	want := []int{3, 4, 1, 2}
	if len(got) != 4 {
		t.Fatalf("evicted %v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("eviction order %v, want %v", got, want)
		}
	}
	// AlreadyPresent touches too.
	x2 := newTC(t, 2)
	ns2 := x2.ns(8, 1, 0)
	x2.store(ns2, dig(1, 8), 0)
	x2.store(ns2, dig(2, 8), 0)
	x2.begin(ns2, 0, dig(1, 8), 1, 0, AlreadyPresent)
	x2.store(ns2, dig(3, 8), 0)
	if x2.lookup(ns2, dig(1, 8)) != 1 || x2.lookup(ns2, dig(2, 8)) != 0 {
		t.Fatal("BeginStore on a present block did not touch it")
	}
}

func contains(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func TestPinnedNeverEvicted(t *testing.T) {
	x := newTC(t, 3)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 3; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	l := x.acquire(ns, 0, digs(8, 1, 2), 5, time.Second, 0) // 1,2 pinned; 3 evictable
	if l.Blocks != 2 || len(l.Slots) != 2 {
		t.Fatalf("lease %+v", l)
	}
	x.store(ns, dig(4, 8), 0) // evicts 3 even though 1 is older
	if x.lookup(ns, digs(8, 1, 2)) != 2 || x.lookup(ns, dig(3, 8)) != 0 {
		t.Fatal("pinned block evicted")
	}
	l2 := x.acquire(ns, 0, dig(4, 8), 5, time.Second, 0)
	// Everything pinned: NoSpace, and nothing was evicted in vain.
	x.begin(ns, 0, dig(5, 8), 1, 0, NoSpace)
	if s := x.c.Stats(); s.NoSpace != 1 || s.Blocks != 3 || s.Evictable != 0 {
		t.Fatalf("stats %+v", s)
	}
	// Clear cannot drop pinned blocks.
	if n, _ := x.c.Clear(ns); n != 0 {
		t.Fatalf("Clear dropped %d pinned blocks", n)
	}
	x.check()
	// Writing slots are not evictable either.
	if err := x.c.Release(l2.ID); err != nil {
		t.Fatal(err)
	}
	x.check()
	tk := x.begin(ns, 0, dig(6, 8), 1, 0, Allocated) // evicts 4
	x.begin(ns, 0, dig(7, 8), 1, 0, NoSpace)         // only pinned + writing left
	x.commit(tk)
	wantErr(t, x.c.Release(l2.ID), ErrUnknownLease) // double release
	if err := x.c.Release(l.ID); err != nil {
		t.Fatal(err)
	}
	wantErr(t, x.c.Release(l.ID), ErrUnknownLease)
	x.check()
	if s := x.c.Stats(); s.PinnedBlocks != 0 || s.Leases != 0 || s.Evictable != 3 {
		t.Fatalf("after release %+v", s)
	}
}

func TestLeaseIDsUniqueAndShared(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	x.store(ns, dig(1, 8), 0)
	seen := map[uint64]bool{}
	for i := 0; i < 50; i++ {
		l := x.acquire(ns, 0, dig(1, 8), SessionID(i%3), time.Second, 0)
		if l.ID == 0 || seen[l.ID] {
			t.Fatalf("lease id %d reused or zero", l.ID)
		}
		seen[l.ID] = true
		if i%2 == 0 {
			if err := x.c.Release(l.ID); err != nil {
				t.Fatal(err)
			}
			x.check()
		}
	}
	if x.c.Stats().Leases != 25 {
		t.Fatal("lease count")
	}
}

func TestWriterReap(t *testing.T) {
	x := newTC(t, 4) // WriteTimeout 100ms
	ns := x.ns(8, 2, 0)
	d := dig(1, 8)
	t0 := x.begin(ns, 0, d, 1, 0, Allocated)
	if r := x.c.Reap(99 * ms); r != (ReapResult{}) {
		t.Fatalf("early reap %+v", r)
	}
	x.check()
	t1 := x.begin(ns, 1, d, 2, 50*ms, Allocated) // extends deadline to 150ms
	if r := x.c.Reap(120 * ms); r != (ReapResult{}) {
		t.Fatalf("deadline not extended: %+v", r)
	}
	x.commit(t0)
	if dl, ok := x.c.NextDeadline(); !ok || dl != 150*ms {
		t.Fatalf("NextDeadline = %d %v", dl, ok)
	}
	r := x.c.Reap(150 * ms)
	x.check()
	if r != (ReapResult{Writes: 1, Blocks: 1}) {
		t.Fatalf("reap %+v", r)
	}
	// Rank 1's copy is still in flight: the block is dropped (a new store
	// of the digest starts afresh) but its slots stay taken until that copy
	// ends, so the copy can never land in a slot handed to another block.
	if s := x.c.Stats(); s.Free != 2 || s.DoomedBlocks != 1 || s.ExpiredBlocks != 1 || s.ExpiredWrites != 1 || s.Writers != 1 {
		t.Fatalf("stats after reap %+v", s)
	}
	if x.lookup(ns, d) != 0 {
		t.Fatal("a dropped block is visible")
	}
	n0 := x.begin(ns, 0, d, 3, 200*ms, Allocated) // a new block, in the two free slots
	n1 := x.begin(ns, 1, d, 3, 200*ms, Allocated)
	if n0.Slot == t1.Slot || n1.Slot == t1.Slot || n0.Slot == t0.Slot || n1.Slot == t0.Slot {
		t.Fatalf("the doomed block's slots were reused: %v %v, doomed %v %v", n0, n1, t0, t1)
	}
	wantErr(t, x.c.CommitStore(t1), ErrDoomed) // the late copy is discarded, its slots freed
	x.check()
	if s := x.c.Stats(); s.Free != 2 || s.DoomedBlocks != 0 {
		t.Fatalf("stats after the late commit %+v", s)
	}
	wantErr(t, x.c.CommitStore(t1), ErrStaleTicket)
	wantErr(t, x.c.AbortStore(t0), ErrStaleTicket)
	x.commit(n0)
	x.commit(n1)
	if x.lookup(ns, d) != 1 {
		t.Fatal("block missing")
	}
	if _, ok := x.c.NextDeadline(); ok {
		t.Fatal("timer left behind")
	}
}

func TestLeaseExpiryAndRenew(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	x.store(ns, dig(1, 8), 0)
	x.store(ns, dig(2, 8), 0)
	a := x.acquire(ns, 0, dig(1, 8), 1, 10*time.Millisecond, 0)
	b := x.acquire(ns, 0, digs(8, 1, 2), 2, 20*time.Millisecond, 0)
	if err := x.c.Renew(a.ID, 30*time.Millisecond, 5*ms); err != nil {
		t.Fatal(err)
	}
	x.check()
	if r := x.c.Reap(19 * ms); r.Leases != 0 {
		t.Fatalf("reaped early: %+v", r)
	}
	if r := x.c.Reap(20 * ms); r.Leases != 1 {
		t.Fatalf("b not reaped: %+v", r)
	}
	x.check()
	wantErr(t, x.c.Release(b.ID), ErrUnknownLease)
	if s := x.c.Stats(); s.PinnedBlocks != 1 || s.Leases != 1 {
		t.Fatalf("stats %+v", s)
	}
	if r := x.c.Reap(1 << 62); r.Leases != 1 {
		t.Fatalf("a not reaped: %+v", r)
	}
	x.check()
	if s := x.c.Stats(); s.PinnedBlocks != 0 || s.Leases != 0 || s.ExpiredLeases != 2 {
		t.Fatalf("stats %+v", s)
	}
	// Huge TTL saturates instead of overflowing.
	l := x.acquire(ns, 0, dig(1, 8), 1, time.Duration(1<<62), 1<<62)
	if r := x.c.Reap(1 << 62); r.Leases != 0 {
		t.Fatal("saturated lease reaped")
	}
	if err := x.c.Release(l.ID); err != nil {
		t.Fatal(err)
	}
	x.check()
}

func TestReleaseOwner(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(8, 1, 0)
	tp := x.ns(8, 2, 1)
	x.store(ns, dig(1, 8), 0)
	x.store(ns, dig(2, 8), 0)
	x.acquire(ns, 0, digs(8, 1, 2), 7, time.Second, 0)
	x.acquire(ns, 0, dig(1, 8), 7, time.Second, 0)
	keep := x.acquire(ns, 0, dig(2, 8), 8, time.Second, 0)
	x.begin(ns, 0, dig(3, 8), 7, 0, Allocated)
	x.commit(x.begin(tp, 0, dig(4, 8), 8, 0, Allocated))
	x.begin(tp, 1, dig(4, 8), 7, 0, Allocated)
	r := x.c.ReleaseOwner(7)
	x.check()
	if r != (ReapResult{Leases: 2, Writes: 2}) {
		t.Fatalf("ReleaseOwner = %+v", r)
	}
	if s := x.c.Stats(); s.Leases != 1 || s.PinnedBlocks != 1 || s.Writing != 0 || s.PendingBlocks != 1 {
		t.Fatalf("stats %+v", s)
	}
	if r := x.c.ReleaseOwner(7); r != (ReapResult{}) {
		t.Fatal("second ReleaseOwner did something")
	}
	if r := x.c.ReleaseOwner(99); r != (ReapResult{}) {
		t.Fatal("unknown owner")
	}
	if err := x.c.Release(keep.ID); err != nil {
		t.Fatal(err)
	}
	x.check()
	if len(x.c.owners) != 0 { // owner 8's write committed, its lease is released
		t.Fatalf("owners leak: %d", len(x.c.owners))
	}
}
