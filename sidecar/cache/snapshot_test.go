package cache

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// pageAll reads a whole snapshot of ns in pages and returns the digests in
// page order, the first page's cursor and the number of pages.
func pageAll(t *testing.T, c *Cache, ns NamespaceID, maxEntries, maxScan int) ([]string, Cursor, int) {
	t.Helper()
	var out []string
	var c0 Cursor
	from := uint64(0)
	for pages := 1; ; pages++ {
		got := 0
		cur, next, done, err := c.SnapshotPage(ns, from, maxEntries, maxScan, func(d []byte) {
			out = append(out, string(d))
			got++
		})
		if err != nil {
			t.Fatal(err)
		}
		if pages == 1 {
			c0 = cur
		}
		if maxEntries > 0 && got > maxEntries {
			t.Fatalf("page of %d entries, max %d", got, maxEntries)
		}
		if maxScan > 0 && next-from > uint64(maxScan) {
			t.Fatalf("page scanned [%d, %d), max %d slots", from, next, maxScan)
		}
		if done {
			if next != uint64(c.Capacity()) {
				t.Fatalf("done with next %d, capacity %d", next, c.Capacity())
			}
			return out, c0, pages
		}
		if next <= from {
			t.Fatalf("next %d does not advance from %d", next, from)
		}
		if pages > 10*c.Capacity() {
			t.Fatal("paging does not end")
		}
		from = next
	}
}

func TestSnapshotPage(t *testing.T) {
	x := newTC(t, 32)
	a := x.ns(16, 2, 0)
	b := x.ns(16, 1, 1) // same digests, another namespace
	for i := 1; i <= 6; i++ {
		x.store(a, dig(i, 16), 0)
	}
	for i := 1; i <= 3; i++ {
		x.store(b, dig(i, 16), 0)
	}
	x.commit(x.begin(a, 0, dig(20, 16), 1, 0, Allocated)) // rank 0 stored, rank 1 never: incomplete
	x.commit(x.begin(a, 1, dig(21, 16), 1, 0, Allocated)) // rank 1 stored, rank 0 never
	x.begin(a, 0, dig(22, 16), 1, 0, Allocated)           // being written
	x.store(a, dig(7, 16), 0)
	l := x.acquire(a, 0, dig(7, 16), 1, time.Minute, 0) // pinned: present all the same
	defer x.c.Release(l.ID)

	full := map[string]bool{}
	head, _ := x.c.Snapshot(a, func(d []byte) bool { full[string(d)] = true; return true })
	if len(full) != 7 {
		t.Fatalf("Snapshot found %d blocks, want 7", len(full))
	}
	for i := 1; i <= 7; i++ {
		if !full[string(dig(i, 16))] {
			t.Fatalf("Snapshot misses block %d", i)
		}
	}
	t.Run("one page", func(t *testing.T) {
		var got []string
		cur, next, done, err := x.c.SnapshotPage(a, 0, -1, 0, func(d []byte) { got = append(got, string(d)) })
		if err != nil || !done || next != 32 || cur != head || len(got) != 7 {
			t.Fatalf("cur %+v next %d done %v err %v, %d digests", cur, next, done, err, len(got))
		}
		for _, d := range got {
			if !full[d] {
				t.Fatalf("digest %x is not present", d)
			}
		}
	})
	t.Run("paging visits each block once, in slot order", func(t *testing.T) {
		all, _, _ := pageAll(t, x.c, a, 0, 0)
		for _, me := range []int{0, 1, 2, 3, 7, 100} {
			for _, ms := range []int{0, 1, 2, 5, 31, 32, 33, 1000} {
				got, c0, pages := pageAll(t, x.c, a, me, ms)
				if fmt.Sprint(got) != fmt.Sprint(all) || c0 != head {
					t.Fatalf("max entries %d, max scan %d: %d digests %x, cursor %+v; want %x", me, ms, len(got), got, c0, all)
				}
				if ms == 1 && pages < 32 {
					t.Fatalf("max scan 1: %d pages", pages)
				}
			}
		}
	})
	t.Run("empty pages of a sparse scan", func(t *testing.T) {
		empty := 0
		for from := uint64(0); ; {
			n := 0
			_, next, done, err := x.c.SnapshotPage(a, from, 0, 1, func([]byte) { n++ })
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 && !done {
				empty++
			}
			if done {
				break
			}
			from = next
		}
		if empty == 0 {
			t.Fatal("no empty page with a scan of one slot")
		}
	})
	t.Run("other namespace", func(t *testing.T) {
		got, _, _ := pageAll(t, x.c, b, 2, 4)
		if len(got) != 3 {
			t.Fatalf("namespace b: %d digests", len(got))
		}
	})
	t.Run("past the end", func(t *testing.T) {
		for _, from := range []uint64{32, 33, 1 << 40, ^uint64(0)} {
			n := 0
			cur, next, done, err := x.c.SnapshotPage(a, from, 0, 0, func([]byte) { n++ })
			if err != nil || !done || next != from || n != 0 || cur != head {
				t.Fatalf("from %d: next %d done %v n %d err %v", from, next, done, n, err)
			}
		}
	})
	t.Run("empty namespace is done at once", func(t *testing.T) {
		e := x.ns(16, 1, 9)
		cur, next, done, err := x.c.SnapshotPage(e, 0, 1, 1, func([]byte) { t.Fatal("a digest of an empty namespace") })
		if err != nil || !done || next != 32 || cur.Epoch != 7 {
			t.Fatalf("next %d done %v err %v", next, done, err)
		}
	})
	t.Run("unknown namespace", func(t *testing.T) {
		_, _, _, err := x.c.SnapshotPage(0, 0, 0, 0, func([]byte) {})
		wantErr(t, err, ErrUnknownNamespace)
		_, _, _, err = x.c.SnapshotPage(99, 0, 0, 0, func([]byte) {})
		wantErr(t, err, ErrUnknownNamespace)
	})
	t.Run("evicted blocks leave the snapshot", func(t *testing.T) {
		y := newTC(t, 4)
		ns := y.ns(8, 1, 0)
		for i := 1; i <= 6; i++ { // 1 and 2 are evicted
			y.store(ns, dig(i, 8), 0)
		}
		got, _, _ := pageAll(t, y.c, ns, 1, 2)
		want := map[string]bool{string(dig(3, 8)): true, string(dig(4, 8)): true, string(dig(5, 8)): true, string(dig(6, 8)): true}
		if len(got) != 4 {
			t.Fatalf("%d digests", len(got))
		}
		for _, d := range got {
			if !want[d] {
				t.Fatalf("digest %x should be gone", d)
			}
		}
	})
}

// TestSnapshotPageMirror rebuilds a mirror the way docs/protocol.md section
// 11 tells clients to: pages from the first page's cursor C0 on, with blocks
// stored, evicted, pinned, cleared and reaped between pages, then the log
// from C0. The mirror must equal what Lookup answers, every time.
func TestSnapshotPageMirror(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) { runMirror(t, seed) })
	}
}

func runMirror(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0x5a5a))
	x := newTC(t, 32) // delta log of 64: some rebuilds find their cursor overwritten
	c := x.c
	type nsDef struct {
		id    NamespaceID
		world int
		ds    [][]byte
	}
	var nss []nsDef
	for i, world := range []int{1, 2} {
		n := nsDef{id: x.ns(16, world, uint64(i)), world: world}
		for j := 0; j < 40; j++ {
			n.ds = append(n.ds, dig(j, 16))
		}
		nss = append(nss, n)
	}
	var leases []uint64
	now := int64(0)
	// mutate changes the pool at random: stores (whole and partial),
	// aborts, pins and releases, reaping, now and then a Clear.
	mutate := func() {
		n := nss[rng.IntN(len(nss))]
		d := n.ds[rng.IntN(len(n.ds))]
		switch p := rng.IntN(100); {
		case p < 55: // store every rank
			for r := 0; r < n.world; r++ {
				if tk, st, err := c.BeginStore(n.id, r, d, 1, now); err != nil {
					t.Fatal(err)
				} else if st == Allocated {
					if err := c.CommitStore(tk); err != nil {
						t.Fatal(err)
					}
				}
			}
		case p < 65: // one rank only: incomplete until the others come or it is reaped
			r := rng.IntN(n.world)
			if tk, st, err := c.BeginStore(n.id, r, d, 2, now); err != nil {
				t.Fatal(err)
			} else if st == Allocated {
				if rng.IntN(3) == 0 {
					c.AbortStore(tk)
				} else if err := c.CommitStore(tk); err != nil {
					t.Fatal(err)
				}
			}
		case p < 80: // pin the block (if present) for a while
			l, err := c.Acquire(n.id, 0, d, 3, time.Duration(1+rng.IntN(50))*time.Millisecond, now)
			if err != nil {
				t.Fatal(err)
			}
			if l.ID != 0 {
				leases = append(leases, l.ID)
			}
		case p < 90: // release a lease
			if len(leases) > 0 {
				i := rng.IntN(len(leases))
				c.Release(leases[i]) // may have expired already
				leases = append(leases[:i], leases[i+1:]...)
			}
		case p < 99: // time passes: leases and incomplete blocks expire
			now += rng.Int64N(int64(40 * time.Millisecond))
			c.Reap(now)
		default:
			if _, err := c.Clear(n.id); err != nil {
				t.Fatal(err)
			}
		}
	}
	truth := func(n nsDef) map[string]bool {
		m := map[string]bool{}
		for _, d := range n.ds {
			if k, err := c.Lookup(n.id, d); err != nil {
				t.Fatal(err)
			} else if k == 1 {
				m[string(d)] = true
			}
		}
		return m
	}
	var buf []Change
	rebuilds, resyncs, changedDuring, pagesRead := 0, 0, 0, 0
	for round := 0; round < 400; round++ {
		n := nss[round%len(nss)]
		mirror := map[string]bool{}
		var c0 Cursor
	rebuild:
		rebuilds++
		clear(mirror)
		from, first := uint64(0), true
		head0, _ := c.Head(n.id)
		for {
			cur, next, done, err := c.SnapshotPage(n.id, from, 1+rng.IntN(5), 1+rng.IntN(12), func(d []byte) {
				mirror[string(d)] = true
			})
			if err != nil {
				t.Fatal(err)
			}
			pagesRead++
			if first {
				c0, first = cur, false
			}
			if done {
				break
			}
			from = next
			k := rng.IntN(4)
			if rng.IntN(30) == 0 {
				k = 200 // a burst: the log may overwrite C0
			}
			for ; k > 0; k-- {
				mutate()
			}
		}
		if h, _ := c.Head(n.id); h != head0 {
			changedDuring++
		}
		for k := rng.IntN(6); k > 0; k-- { // changes after the last page too
			mutate()
		}
		// Follow the log from C0 to its head, in small reads.
		for cur := c0; ; {
			var err error
			buf, cur, err = c.ChangesSince(n.id, cur, 1+rng.IntN(8), buf)
			if err != nil {
				wantErr(t, err, ErrResync)
				resyncs++
				goto rebuild
			}
			if len(buf) == 0 {
				break
			}
			for _, ch := range buf {
				switch ch.Op {
				case OpStored:
					mirror[string(ch.Digest())] = true
				case OpEvicted:
					delete(mirror, string(ch.Digest()))
				case OpCleared:
					clear(mirror)
				}
			}
		}
		want := truth(n)
		if len(mirror) != len(want) {
			t.Fatalf("round %d: mirror holds %d blocks, Lookup finds %d", round, len(mirror), len(want))
		}
		for d := range want {
			if !mirror[d] {
				t.Fatalf("round %d: mirror misses %x", round, d)
			}
		}
		x.check()
	}
	t.Logf("seed %d: %d rebuilds, %d resyncs, %d with changes between pages, %d pages, %+v",
		seed, rebuilds, resyncs, changedDuring, pagesRead, c.Stats())
	s := c.Stats()
	if changedDuring < 100 || resyncs == 0 || s.Evictions == 0 || s.Cleared == 0 || s.ExpiredBlocks == 0 {
		t.Fatalf("the walk did not cover enough: %d changed during paging, %d resyncs, %+v", changedDuring, resyncs, s)
	}
}
