package cache

import (
	"fmt"
	"testing"
)

// A namespace's announced set is the union of its pool's present,
// described blocks and its node set: stored when a block enters either,
// removed only when it has left both; snapshot pages read both parts; a
// rebuild drops what it did not see again.
func TestNodeSetUnion(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(8, 1, 0)
	head, _ := x.c.EventHead(ns)
	d1, d2, d3 := dig(1, 8), dig(2, 8), dig(3, 8)
	node := func(d []byte, tk int) {
		t.Helper()
		if _, full, err := x.c.NodeStored(ns, d, nil, []uint32{uint32(tk)}, nil, 1<<20); full || err != nil {
			t.Fatalf("NodeStored: %v %v", full, err)
		}
		x.check()
	}
	gone := func(d []byte) {
		t.Helper()
		if ok, err := x.c.NodeRemoved(ns, d); !ok || err != nil {
			t.Fatalf("NodeRemoved: %v %v", ok, err)
		}
		x.check()
	}
	node(d1, 10)                                          // node only: stored
	node(d1, 11)                                          // again: nothing
	x.store(ns, d1, 0)                                    // in the pool too, described: nothing
	x.describe(ns, nil, d1, toks(20, 1), 1, nil, 1, 1, 0) // nothing
	x.store(ns, d2, 0)                                    // pool only
	x.describe(ns, nil, d2, toks(30, 1), 1, nil, 1, 1, 0) // stored
	node(d2, 31)                                          // in both: nothing
	gone(d1)                                              // left the node, in the pool: nothing
	node(d3, 40)                                          // stored
	got, cur := x.events(ns, head)
	want := []seen{
		{EventStored, string(d1), "", string(toks(10, 1)), ""},
		{EventStored, string(d2), "", string(toks(30, 1)), ""},
		{EventStored, string(d3), "", string(toks(40, 1)), ""},
	}
	// d1 is read with the pool's description, which it has by now.
	want[0].tokens = string(toks(20, 1))
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("events\n got %+v\nwant %+v", got, want)
	}
	for _, maxScan := range []int{1, 3, 0} {
		snap, _ := x.snapshotEvents(ns, maxScan)
		if len(snap) != 3 {
			t.Fatalf("snapshot (scan %d): %+v", maxScan, snap)
		}
	}
	// d2 leaves the pool: still in the node set. d1 leaves the pool:
	// removed. A rebuild that sees d3 only removes d2.
	x.c.Clear(ns)
	x.check()
	if err := x.c.NodeRebuild(ns); err != nil {
		t.Fatal(err)
	}
	node(d3, 41)
	if n, err := x.c.NodeSweep(ns); n != 1 || err != nil {
		t.Fatalf("sweep: %d %v", n, err)
	}
	x.check()
	got, _ = x.events(ns, cur)
	want = []seen{{EventRemoved, string(d1), "", "", ""}, {EventRemoved, string(d2), "", "", ""}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("events\n got %+v\nwant %+v", got, want)
	}
	if n, b := x.c.NodeBlocks(); n != 1 || b != DescCost(8, 1, 0, false) {
		t.Fatalf("node blocks %d, %d bytes", n, b)
	}
	// The bound: a block past it is not added.
	if added, full, _ := x.c.NodeStored(ns, dig(4, 8), nil, []uint32{1}, nil, DescCost(8, 1, 0, false)); added || !full {
		t.Fatal("a node-set block past the bound was added")
	}
	// A digest of another width is refused.
	if _, _, err := x.c.NodeStored(ns, dig(5, 16), nil, []uint32{1}, nil, 1<<20); err == nil {
		t.Fatal("a 16-byte digest in an 8-byte namespace was taken")
	}
	// Removing the namespace forgets its node set.
	gone(d3)
	if err := x.c.RemoveNamespace(ns); err != nil {
		t.Fatal(err)
	}
	if n, b := x.c.NodeBlocks(); n != 0 || b != 0 {
		t.Fatalf("node blocks %d, %d bytes after removal", n, b)
	}
	x.check()
}
