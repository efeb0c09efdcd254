package cache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"testing"
)

// toks returns n token ids from base, little-endian u32s.
func toks(base, n int) []byte {
	b := make([]byte, 4*n)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(base+i))
	}
	return b
}

type seen struct {
	op     EventOp
	digest string
	parent string
	tokens string
	extra  string
}

func (x *tc) events(ns NamespaceID, cur Cursor) ([]seen, Cursor) {
	x.t.Helper()
	var out []seen
	next, err := x.c.EventsSince(ns, cur, 0, 0, func(e *DescEvent) bool {
		out = append(out, seen{e.Op, string(e.Digest), string(e.Parent), string(e.Tokens), string(e.Extra)})
		return true
	})
	if err != nil {
		x.t.Fatal(err)
	}
	return out, next
}

func (x *tc) snapshotEvents(ns NamespaceID, maxScan int) ([]seen, Cursor) {
	x.t.Helper()
	var out []seen
	var first Cursor
	from := uint64(0)
	for page := 0; ; page++ {
		cur, next, done, err := x.c.EventSnapshotPage(ns, from, maxScan, func(e *DescEvent) bool {
			out = append(out, seen{e.Op, string(e.Digest), string(e.Parent), string(e.Tokens), string(e.Extra)})
			return true
		})
		if err != nil {
			x.t.Fatal(err)
		}
		if page == 0 {
			first = cur
		}
		if done {
			return out, first
		}
		if next <= from {
			x.t.Fatalf("snapshot page from %d did not advance (%d)", from, next)
		}
		from = next
	}
}

func (x *tc) describe(ns NamespaceID, parent, ds, tk []byte, per int, extra []byte, key uint32, owner SessionID, now int64) int {
	x.t.Helper()
	n, err := x.c.Describe(ns, parent, ds, tk, per, extra, key, owner, now)
	if err != nil {
		x.t.Fatal(err)
	}
	x.check()
	return n
}

// A description given before, during and after the block's store: the
// block is announced once, when it is both present and described, with
// the description as given (its parent from the run), and its removal is
// logged when it is evicted.
func TestDescribeAnnouncesOnce(t *testing.T) {
	for _, when := range []string{"before", "during", "after"} {
		t.Run(when, func(t *testing.T) {
			x := newTC(t, 8)
			ns := x.ns(8, 2, 0)
			head, _ := x.c.EventHead(ns)
			d1, d2 := dig(1, 8), dig(2, 8)
			desc := func() {
				if got := x.describe(ns, nil, digs(8, 1, 2), toks(100, 8), 4, []byte("lora"), 5, 9, 0); got != 2 {
					t.Fatalf("added %d descriptions, want 2", got)
				}
			}
			if when == "before" {
				desc()
			}
			t0 := x.begin(ns, 0, d1, 1, 0, Allocated)
			t1 := x.begin(ns, 0, d2, 1, 0, Allocated)
			x.commit(t0)
			x.commit(t1)
			if when == "during" {
				desc()
			}
			x.commit(x.begin(ns, 1, d1, 1, 0, Allocated))
			x.commit(x.begin(ns, 1, d2, 1, 0, Allocated))
			if when == "after" {
				desc()
				if got := x.describe(ns, nil, digs(8, 1), toks(7, 4), 4, nil, 5, 9, 0); got != 0 {
					t.Fatalf("a second description was added (%d)", got)
				}
			}
			got, cur := x.events(ns, head)
			want := []seen{
				{EventStored, string(d1), "", string(toks(100, 4)), "lora"},
				{EventStored, string(d2), string(d1), string(toks(104, 4)), "lora"},
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("events\n got %+v\nwant %+v", got, want)
			}
			snap, _ := x.snapshotEvents(ns, 3)
			if len(snap) != 2 {
				t.Fatalf("snapshot holds %d events, want 2", len(snap))
			}
			// Evict both by filling the pool (4 blocks of 2 slots).
			for i := 10; i < 14; i++ {
				x.store(ns, dig(i, 8), 0)
			}
			got, _ = x.events(ns, cur)
			want = []seen{{EventRemoved, string(d1), "", "", ""}, {EventRemoved, string(d2), "", "", ""}}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("after eviction\n got %+v\nwant %+v", got, want)
			}
			if a, p := x.c.Descriptions(); a != 0 || p != 0 || x.c.DescBytes() != 0 || x.c.DescCharged(5) != 0 || x.c.DescOwned(9) != 0 {
				t.Fatalf("descriptions left: %d attached, %d pending, %d bytes", a, p, x.c.DescBytes())
			}
		})
	}
}

// A description of a block that is never stored waits WriteTimeout, then
// goes; one of a block whose store is aborted or reaped goes with it. None
// is ever announced.
func TestDescriptionsOfBlocksNeverPresent(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(16, 2, 0)
	head, _ := x.c.EventHead(ns)
	x.describe(ns, nil, digs(16, 1, 2, 3), toks(0, 3), 1, nil, 1, 1, 0)
	if a, p := x.c.Descriptions(); a != 0 || p != 3 {
		t.Fatalf("%d attached, %d pending, want 0, 3", a, p)
	}
	tk := x.begin(ns, 0, dig(2, 16), 1, 0, Allocated) // adopts 2's
	if err := x.c.AbortStore(tk); err != nil {        // and frees it
		t.Fatal(err)
	}
	x.check()
	x.commit(x.begin(ns, 0, dig(3, 16), 1, 0, Allocated)) // 3: one rank of two, reaped later
	if a, p := x.c.Descriptions(); a != 1 || p != 1 {
		t.Fatalf("%d attached, %d pending, want 1, 1", a, p)
	}
	if n := x.c.ReapDescs(99 * ms); n != 0 {
		t.Fatalf("reaped %d before the deadline", n)
	}
	if n := x.c.ReapDescs(100 * ms); n != 1 {
		t.Fatalf("reaped %d at the deadline, want 1 (digest 1)", n)
	}
	x.c.Reap(200 * ms) // drops the incomplete block 3
	x.check()
	if a, p := x.c.Descriptions(); a != 0 || p != 0 || x.c.DescBytes() != 0 {
		t.Fatalf("left %d attached, %d pending, %d bytes", a, p, x.c.DescBytes())
	}
	if got, _ := x.events(ns, head); len(got) != 0 {
		t.Fatalf("events of blocks never present: %+v", got)
	}
}

// An undescribed block is never announced; a stored entry whose block left
// before it is read is skipped, and its removal read; a namespace's events
// are its own.
func TestEventsReadTheBlocksAsTheyAre(t *testing.T) {
	x := newTC(t, 4)
	a, b := x.ns(8, 1, 0), x.ns(8, 1, 1)
	ha, _ := x.c.EventHead(a)
	hb, _ := x.c.EventHead(b)
	x.store(a, dig(1, 8), 0) // never described
	x.describe(a, nil, digs(8, 2), toks(0, 2), 2, nil, 1, 1, 0)
	x.store(a, dig(2, 8), 0)
	x.describe(b, nil, digs(8, 2), toks(50, 2), 2, nil, 1, 1, 0)
	x.store(b, dig(2, 8), 0)
	for i := 3; i < 7; i++ { // evicts 1 and both 2s
		x.store(a, dig(i, 8), 0)
	}
	got, _ := x.events(a, ha)
	want := []seen{{EventRemoved, string(dig(2, 8)), "", "", ""}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("namespace a\n got %+v\nwant %+v", got, want)
	}
	got, _ = x.events(b, hb)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("namespace b\n got %+v\nwant %+v", got, want)
	}
}

// Cursors: the initial one, another epoch, one past the head, one the log
// overwrote; and the bounds on a read.
func TestEventCursors(t *testing.T) {
	x := newTC(t, 200) // the log holds 64 entries at most
	ns := x.ns(8, 1, 0)
	head, err := x.c.EventHead(ns)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.c.EventsSince(ns, head, 0, 0, func(*DescEvent) bool { return true }); err != nil {
		t.Fatalf("the head of a namespace without an event log: %v", err)
	}
	for _, bad := range []Cursor{{Epoch: 8, Seq: head.Seq}, {Epoch: head.Epoch, Seq: head.Seq + 1}, {Epoch: head.Epoch, Seq: head.Seq - 1}} {
		if _, err := x.c.EventsSince(ns, bad, 0, 0, func(*DescEvent) bool { return true }); !errors.Is(err, ErrResync) {
			t.Fatalf("cursor %+v: %v, want ErrResync", bad, err)
		}
	}
	for i := 0; i < 100; i++ {
		x.describe(ns, nil, dig(i, 8), toks(i, 1), 1, nil, 1, 1, 0)
		x.store(ns, dig(i, 8), 0)
	}
	if _, err := x.c.EventsSince(ns, head, 0, 0, func(*DescEvent) bool { return true }); !errors.Is(err, ErrResync) {
		t.Fatalf("an overwritten cursor: %v, want ErrResync", err)
	}
	cur, _ := x.c.EventHead(ns)
	cur.Seq -= 10
	n := 0
	next, err := x.c.EventsSince(ns, cur, 4, 0, func(*DescEvent) bool { n++; return true })
	if err != nil || n != 4 || next.Seq != cur.Seq+4 {
		t.Fatalf("max 4: %d events, next %d (from %d), %v", n, next.Seq, cur.Seq, err)
	}
	n = 0
	next, _ = x.c.EventsSince(ns, cur, 0, 3, func(*DescEvent) bool { n++; return true })
	if n != 3 || next.Seq != cur.Seq+3 {
		t.Fatalf("scan 3: %d events, next %d", n, next.Seq-cur.Seq)
	}
	n = 0
	next, _ = x.c.EventsSince(ns, cur, 0, 0, func(*DescEvent) bool { n++; return n < 2 })
	if n != 2 || next.Seq != cur.Seq+1 {
		t.Fatalf("stopped at the second: %d calls, next %d, want the second not consumed", n, next.Seq-cur.Seq)
	}
	snap, _ := x.snapshotEvents(ns, 7)
	if len(snap) != 100 {
		t.Fatalf("snapshot of %d blocks, want 100", len(snap))
	}
}

// Paged snapshots and the log from the first page's cursor rebuild the
// announced set exactly while blocks come and go between pages.
func TestEventSnapshotWithChanges(t *testing.T) {
	x := newTC(t, 64)
	ns := x.ns(8, 1, 0)
	announced := map[string]bool{}
	for i := 0; i < 40; i++ {
		x.describe(ns, nil, dig(i, 8), toks(i, 1), 1, nil, 1, 1, 0)
		x.store(ns, dig(i, 8), 0)
	}
	var first Cursor
	from := uint64(0)
	for page, i := 0, 40; ; page, i = page+1, i+3 {
		cur, next, done, err := x.c.EventSnapshotPage(ns, from, 8, func(e *DescEvent) bool {
			announced[string(e.Digest)] = true
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
		if page == 0 {
			first = cur
		}
		// Between pages: three more blocks, evicting the oldest.
		for k := i; k < i+3; k++ {
			x.describe(ns, nil, dig(k, 8), toks(k, 1), 1, nil, 1, 1, 0)
			x.store(ns, dig(k, 8), 0)
		}
		if done {
			break
		}
		from = next
	}
	got, _ := x.events(ns, first)
	for _, e := range got {
		if e.op == EventStored {
			announced[e.digest] = true
		} else {
			delete(announced, e.digest)
		}
	}
	want := map[string]bool{}
	x.c.Snapshot(ns, func(d []byte) bool { want[string(d)] = true; return true })
	if len(announced) != len(want) {
		t.Fatalf("rebuilt %d blocks, the pool holds %d", len(announced), len(want))
	}
	for d := range want {
		if !announced[d] {
			t.Fatalf("block %x missing", d)
		}
	}
}

// Charges by key and owner; a forgotten owner keeps its descriptions
// charged to the key and the total; removing a namespace drops its pending
// descriptions and its event log.
func TestDescriptionCharges(t *testing.T) {
	x := newTC(t, 16)
	ns := x.ns(32, 1, 0)
	other := x.ns(32, 1, 5)
	x.describe(ns, dig(0, 32), digs(32, 1, 2), toks(0, 32), 16, []byte("x"), 3, 11, 0)
	x.describe(other, nil, digs(32, 1), toks(0, 16), 16, nil, 4, 12, 0)
	one := DescCost(32, 16, 1, true)
	if one != DescOverhead+97+97/8 {
		t.Fatalf("DescCost = %d", one)
	}
	if got := x.c.DescCharged(3); got != 2*one {
		t.Fatalf("key 3 charged %d, want %d", got, 2*one)
	}
	if got := x.c.DescOwned(11); got != 2*one {
		t.Fatalf("owner 11 charged %d, want %d", got, 2*one)
	}
	x.c.ForgetDescOwner(11)
	x.check()
	if x.c.DescOwned(11) != 0 || x.c.DescCharged(3) != 2*one {
		t.Fatal("forgetting the owner changed the key's charge")
	}
	x.store(ns, dig(1, 32), 0)
	before := x.c.LogBytes()
	if err := x.c.RemoveNamespace(other); err != nil {
		t.Fatal(err)
	}
	x.check()
	if x.c.DescCharged(4) != 0 {
		t.Fatal("the removed namespace's description is still charged")
	}
	if x.c.LogBytes() >= before {
		t.Fatalf("log bytes %d after removing a namespace, %d before", x.c.LogBytes(), before)
	}
	if _, err := x.c.Clear(ns); err != nil {
		t.Fatal(err)
	}
	x.check()
	if a, p := x.c.Descriptions(); a != 0 || p != 1 {
		t.Fatalf("after Clear: %d attached, %d pending (digest 2 never stored)", a, p)
	}
}

func TestDescribeRejectsBadShapes(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(16, 1, 0)
	cases := []struct {
		name           string
		parent, ds, tk []byte
		per            int
		extra          []byte
	}{
		{"no digests", nil, nil, nil, 1, nil},
		{"partial digest", nil, make([]byte, 15), toks(0, 1), 1, nil},
		{"short parent", make([]byte, 8), dig(1, 16), toks(0, 1), 1, nil},
		{"no tokens per block", nil, dig(1, 16), nil, 0, nil},
		{"token bytes", nil, dig(1, 16), toks(0, 2), 1, nil},
		{"extra", nil, dig(1, 16), toks(0, 1), 1, make([]byte, MaxDescExtra+1)},
	}
	for _, c := range cases {
		if _, err := x.c.Describe(ns, c.parent, c.ds, c.tk, c.per, c.extra, 1, 1, 0); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
	if _, err := x.c.Describe(99, nil, dig(1, 16), toks(0, 1), 1, nil, 1, 1, 0); !errors.Is(err, ErrUnknownNamespace) {
		t.Errorf("unknown namespace: %v", err)
	}
	x.check()
}

// The pending queue stays bounded when descriptions are adopted (stale
// references are dropped) and when they expire.
func TestPendingQueueBounded(t *testing.T) {
	x := newTC(t, 64)
	ns := x.ns(8, 1, 0)
	for i := 0; i < 20000; i++ {
		x.c.Describe(ns, nil, dig(i, 8), toks(i, 1), 1, nil, 1, 1, int64(i)*ms/1000)
		tk, st, err := x.c.BeginStore(ns, 0, dig(i, 8), 1, 0)
		if err != nil || st != Allocated {
			t.Fatal(st, err)
		}
		x.c.CommitStore(tk)
	}
	if q := len(x.c.ev.queue) - x.c.ev.qhead; q > 4*len(x.c.ev.pend)+1024 {
		t.Fatalf("%d queued references for %d pending descriptions", q, len(x.c.ev.pend))
	}
	x.check()
}

// The measured cost of a description (heap growth per described block)
// stays within DescCost, whose overhead the metadata bounds count.
func TestDescMemory(t *testing.T) {
	if raceEnabled {
		t.Skip("slow under -race")
	}
	for _, n := range []int{3_000, 50_000, 200_000, 420_000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) { descMemory(t, n) })
	}
}

func descMemory(t *testing.T, n int) {
	c, err := New(Config{Capacity: n, Epoch: 1})
	if err != nil {
		t.Fatal(err)
	}
	ns, _ := c.AddNamespace(NamespaceKey{DigestWidth: 32, WorldSize: 1})
	fill(t, c, ns, 0, n)
	d, p := make([]byte, 32), make([]byte, 32)
	tk := toks(0, 16)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := 0; i < n; i++ {
		putDigest(d, i)
		if _, err := c.Describe(ns, p, d, tk, 16, nil, 1, 1, 0); err != nil {
			t.Fatal(err)
		}
		copy(p, d)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(n)
	cost := DescCost(32, 16, 0, true)
	t.Logf("%.1f heap bytes per description of 16 tokens and a parent (DescCost %d)", per, cost)
	if per > float64(cost) {
		t.Fatalf("a description takes %.1f bytes, DescCost counts %d: raise DescOverhead", per, cost)
	}
	if a, _ := c.Descriptions(); a != n {
		t.Fatalf("%d described", a)
	}
	if !bytes.Equal(c.ev.descs[0].b[32:36], tk[:4]) {
		t.Fatal("tokens not kept")
	}
}
