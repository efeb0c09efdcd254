package cache

import (
	"bytes"
	"testing"
	"time"
)

func changesOf(t *testing.T, c *Cache, ns NamespaceID, cur Cursor, max int) ([]Change, Cursor) {
	t.Helper()
	ch, next, err := c.ChangesSince(ns, cur, max, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ch, next
}

func TestDeltaLog(t *testing.T) {
	x := newTC(t, 4) // delta ring of 64
	ns := x.ns(8, 1, 0)
	head, _ := x.c.Head(ns)
	if head.Epoch != 7 || head.Seq != 1<<logSeqShift { // the first namespace's range
		t.Fatalf("Head = %+v", head)
	}
	base := head.Seq
	t.Run("zero cursor resyncs", func(t *testing.T) {
		_, _, err := x.c.ChangesSince(ns, Cursor{}, 10, nil)
		wantErr(t, err, ErrResync)
	})
	for i := 1; i <= 4; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	x.store(ns, dig(5, 8), 0) // evicts 1, reusing its slot
	t.Run("stored and evicted carry digests", func(t *testing.T) {
		ch, next := changesOf(t, x.c, ns, head, 100)
		want := []struct {
			op Op
			id int
		}{{OpStored, 1}, {OpStored, 2}, {OpStored, 3}, {OpStored, 4}, {OpEvicted, 1}, {OpStored, 5}}
		if len(ch) != len(want) || next.Seq != base+6 {
			t.Fatalf("got %d changes, next %+v", len(ch), next)
		}
		for i, w := range want {
			if ch[i].Op != w.op || ch[i].Seq != base+uint64(i) || !bytes.Equal(ch[i].Digest(), dig(w.id, 8)) {
				t.Fatalf("change %d = %v seq %d %x, want %v %d", i, ch[i].Op, ch[i].Seq, ch[i].Digest(), w.op, w.id)
			}
		}
		if ch[4].Slot != ch[5].Slot || ch[0].Slot != ch[4].Slot {
			t.Fatalf("slot reuse not as expected: %+v", ch)
		}
	})
	t.Run("max and continuation", func(t *testing.T) {
		buf := make([]Change, 0, 8)
		ch, next, err := x.c.ChangesSince(ns, head, 4, buf)
		if err != nil || len(ch) != 4 || next.Seq != base+4 {
			t.Fatal(len(ch), next, err)
		}
		ch, next, _ = x.c.ChangesSince(ns, next, 4, buf)
		if len(ch) != 2 || next.Seq != base+6 {
			t.Fatal(len(ch), next)
		}
		ch, next2, _ := x.c.ChangesSince(ns, next, 4, buf)
		if len(ch) != 0 || next2 != next {
			t.Fatal("changes at head")
		}
	})
	t.Run("future seq resyncs", func(t *testing.T) {
		_, _, err := x.c.ChangesSince(ns, Cursor{Epoch: 7, Seq: base + 7}, 10, nil)
		wantErr(t, err, ErrResync)
	})
	t.Run("seq before the log began resyncs", func(t *testing.T) {
		_, _, err := x.c.ChangesSince(ns, Cursor{Epoch: 7, Seq: base - 1}, 10, nil)
		wantErr(t, err, ErrResync)
	})
	t.Run("other epoch resyncs", func(t *testing.T) {
		c2, _ := New(Config{Capacity: 4, Epoch: 8})
		ns2, _ := c2.AddNamespace(NamespaceKey{DigestWidth: 8, WorldSize: 1})
		_, _, err := c2.ChangesSince(ns2, head, 10, nil)
		wantErr(t, err, ErrResync)
	})
	t.Run("gap resyncs, snapshot recovers", func(t *testing.T) {
		old, _ := x.c.Head(ns)
		for i := 100; i < 140; i++ { // 40 stores + 40 evictions > 64
			x.store(ns, dig(i, 8), 0)
		}
		_, _, err := x.c.ChangesSince(ns, old, 1000, nil)
		wantErr(t, err, ErrResync)
		set := map[string]bool{}
		cur, err := x.c.Snapshot(ns, func(d []byte) bool { set[string(d)] = true; return true })
		if err != nil || len(set) != 4 || !set[string(dig(139, 8))] {
			t.Fatalf("snapshot %d %v", len(set), err)
		}
		x.store(ns, dig(200, 8), 0)
		ch, _ := changesOf(t, x.c, ns, cur, 10)
		if len(ch) != 2 || ch[0].Op != OpEvicted || ch[1].Op != OpStored {
			t.Fatalf("after snapshot: %+v", ch)
		}
		n := 0
		x.c.Snapshot(ns, func([]byte) bool { n++; return n < 2 })
		if n != 2 {
			t.Fatal("snapshot did not stop")
		}
		// Exactly one ring's worth back is still readable.
		h, _ := x.c.Head(ns)
		if _, _, err := x.c.ChangesSince(ns, Cursor{Epoch: 7, Seq: h.Seq - 64}, 1, nil); err != nil {
			t.Fatal(err)
		}
		_, _, err = x.c.ChangesSince(ns, Cursor{Epoch: 7, Seq: h.Seq - 65}, 1, nil)
		wantErr(t, err, ErrResync)
	})
	t.Run("clear", func(t *testing.T) {
		cur, _ := x.c.Head(ns)
		l := x.acquire(ns, 0, dig(200, 8), 1, time.Second, 0)
		n, err := x.c.Clear(ns)
		x.check()
		if err != nil || n != 3 || x.c.Len(ns) != 1 {
			t.Fatal(n, err, x.c.Len(ns))
		}
		ch, _ := changesOf(t, x.c, ns, cur, 10)
		if len(ch) != 2 || ch[0].Op != OpCleared || len(ch[0].Digest()) != 0 || ch[0].Slot != NoSlot ||
			ch[1].Op != OpStored || !bytes.Equal(ch[1].Digest(), dig(200, 8)) {
			t.Fatalf("clear changes %+v", ch)
		}
		x.c.Release(l.ID)
		x.check()
		if x.c.Stats().Cleared != 3 {
			t.Fatal("cleared counter")
		}
	})
	t.Run("tp block logged once", func(t *testing.T) {
		tp := x.ns(8, 2, 5)
		cur, _ := x.c.Head(tp)
		d := dig(1, 8)
		x.commit(x.begin(tp, 1, d, 1, 0, Allocated))
		if ch, _ := changesOf(t, x.c, tp, cur, 10); len(ch) != 0 {
			t.Fatal("incomplete block logged")
		}
		x.commit(x.begin(tp, 0, d, 1, 0, Allocated))
		if ch, _ := changesOf(t, x.c, tp, cur, 10); len(ch) != 1 || ch[0].Op != OpStored {
			t.Fatalf("%+v", ch)
		}
	})
}
