package node

import (
	"time"

	"testing"

	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

func (r *rawConn) describe(ns machine.L2Namespace, es ...wire.Entry) []wire.Status {
	_, b := r.req(wire.TypeDescribe, wire.Describe{FP: ns.FP, Entries: es}.Append)
	if b == nil {
		r.t.Fatal("connection ended")
	}
	rep, err := wire.DecodeItemsReply(b)
	if err != nil {
		r.t.Fatal(err)
	}
	if rep.Status != wire.OK {
		return []wire.Status{rep.Status}
	}
	var st []wire.Status
	for _, it := range rep.Items {
		st = append(st, it.Status)
	}
	return st
}

func (r *rawConn) events(ns machine.L2Namespace, cursor uint64, n uint32) wire.EventsReply {
	_, b := r.req(wire.TypeEvents, wire.Events{FP: ns.FP, Cursor: cursor, Max: n}.Append)
	if b == nil {
		r.t.Fatal("connection ended")
	}
	rep, err := wire.DecodeEventsReply(b)
	if err != nil {
		r.t.Fatal(err)
	}
	return rep
}

// putBlock writes every rank of block i of ns through window slot 0.
func (r *rawConn) putBlock(ns machine.L2Namespace, i int) {
	for rank := 0; rank < ns.World; rank++ {
		if st := r.putValue(ns, digest(i), rank, 0, make([]byte, testSlot), nil); st != wire.OK {
			r.t.Fatalf("put %d/%d: %v", i, rank, st)
		}
	}
}

func descOf(i int, parent int) wire.Entry {
	e := wire.Entry{Op: wire.OpStored, Tokens: []uint32{uint32(i), uint32(i + 1)}, Extra: []byte("lora")}
	copy(e.Digest[:], digest(i))
	if parent >= 0 {
		e.HasParent = true
		copy(e.Parent[:], digest(parent))
	}
	return e
}

// A block pod A writes and describes is in pod B's read of the namespace's
// event log, with A's description; its eviction from the node tier is a
// removed entry; a pod that did not register the namespace reads nothing
// of it.
func TestEventsBetweenPods(t *testing.T) {
	s := startServer(t, nil)
	a, b := rawDial(t, s.Socket(), "pod-a"), rawDial(t, s.Socket(), "pod-b")
	a.register(testNS)
	b.register(testNS)
	// Not present yet: a description is refused, nothing is logged.
	if st := a.describe(testNS, descOf(1, -1)); st[0] != wire.NotFound {
		t.Fatalf("describe of an absent block: %v", st)
	}
	a.putBlock(testNS, 1)
	a.putBlock(testNS, 2)
	if st := a.describe(testNS, descOf(1, -1), descOf(2, 1)); st[0] != wire.OK || st[1] != wire.OK {
		t.Fatalf("describe: %v", st)
	}
	// The first description wins, whoever sends the next.
	if st := b.describe(testNS, descOf(1, 7)); st[0] != wire.Exists {
		t.Fatalf("second description: %v", st)
	}
	rep := b.events(testNS, 0, 16)
	if rep.Status != wire.OK || len(rep.Entries) != 2 {
		t.Fatalf("events: %+v", rep)
	}
	for k, e := range rep.Entries {
		want := descOf(k+1, k)
		if k == 0 {
			want = descOf(1, -1)
		}
		if e.Op != wire.OpStored || e.Digest != want.Digest || e.HasParent != want.HasParent || e.Parent != want.Parent ||
			len(e.Tokens) != 2 || e.Tokens[0] != uint32(k+1) || string(e.Extra) != "lora" {
			t.Fatalf("entry %d: %+v", k, e)
		}
	}
	cur := rep.Next
	if r := b.events(testNS, cur, 16); r.Status != wire.OK || len(r.Entries) != 0 || r.Next != cur {
		t.Fatalf("at the end: %+v", r)
	}
	// Paged: one entry a read.
	if r := b.events(testNS, 0, 1); len(r.Entries) != 1 || b.events(testNS, r.Next, 1).Entries[0].Digest != rep.Entries[1].Digest {
		t.Fatalf("paged: %+v", r)
	}
	// Another pod that did not register the namespace reads nothing of it.
	c := rawDial(t, s.Socket(), "pod-c")
	if r := c.events(testNS, 0, 16); r.Status != wire.NotRegistered || len(r.Entries) != 0 {
		t.Fatalf("unregistered: %+v", r)
	}
	if st := c.describe(testNS, descOf(2, -1)); st[0] != wire.NotRegistered {
		t.Fatalf("unregistered describe: %v", st)
	}
	// Another namespace's log is its own, and registering it gives no hold
	// on this one's blocks.
	c.register(otherNS)
	if st := c.describe(otherNS, descOf(1, -1)); st[0] != wire.NotFound {
		t.Fatalf("describe of another namespace's block: %v", st)
	}
	if r := c.events(otherNS, 0, 16); r.Status != wire.OK || len(r.Entries) != 0 {
		t.Fatalf("other namespace: %+v", r)
	}
	// Pod A fills the pool with undescribed blocks: blocks 1 and 2 are
	// evicted (least recently used), each a removed entry, once.
	n := int(s.Index().Slots)
	for i := 100; i < 100+n; i++ {
		a.putBlock(testNS, i)
	}
	if got := s.Index().EvictedShare + s.Index().Evicted; got == 0 {
		t.Fatal("nothing evicted")
	}
	r := b.events(testNS, cur, 16)
	if r.Status != wire.OK || len(r.Entries) != 2 {
		t.Fatalf("after the evictions: %+v", r)
	}
	for k, e := range r.Entries {
		if e.Op != wire.OpRemoved || e.Digest != rep.Entries[k].Digest || len(e.Tokens) != 0 {
			t.Fatalf("removal %d: %+v", k, e)
		}
	}
	// Read from the beginning: the stored entries of gone blocks are left
	// out; the set rebuilt is empty.
	if r := b.events(testNS, 0, 16); len(r.Entries) != 2 || r.Entries[0].Op != wire.OpRemoved {
		t.Fatalf("from the beginning: %+v", r)
	}
	if d, _, _ := s.ev.statsLocked(s); d != 0 {
		t.Fatalf("%d descriptions left", d)
	}
}

// A cursor older than a compaction, or one from the future, is Gone and
// reads from the beginning, which holds exactly the blocks described now.
func TestEventsCompaction(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.PodShare = 1 })
	a := rawDial(t, s.Socket(), "pod-a")
	a.register(testNS)
	if r := a.events(testNS, 5, 4); r.Status != wire.Gone || r.Next != 0 {
		t.Fatalf("a cursor into no log: %+v", r)
	}
	a.putBlock(testNS, 1)
	a.describe(testNS, descOf(1, -1))
	old := a.events(testNS, 0, 16).Next
	// More removals than blocks described, and more than 1,024: compacted.
	slots := int(s.Index().Slots)
	for i := 2; i < 2+1100+slots; i++ {
		a.putBlock(testNS, i)
		if st := a.describe(testNS, descOf(i, i-1)); st[0] != wire.OK {
			t.Fatalf("describe %d: %v", i, st)
		}
	}
	r := a.events(testNS, old, wire.MaxEvents)
	if r.Status != wire.Gone {
		t.Fatalf("a cursor before the compaction: %v", r.Status)
	}
	// Read the whole log from the beginning: what is stored at its end is
	// what the pool holds described.
	set := map[[wire.DigestSize]byte]bool{}
	cur := uint64(0)
	for {
		r := a.events(testNS, cur, wire.MaxEvents)
		if r.Status != wire.OK {
			t.Fatalf("read: %v", r.Status)
		}
		for _, e := range r.Entries {
			set[e.Digest] = e.Op == wire.OpStored
		}
		if len(r.Entries) == 0 {
			break
		}
		cur = r.Next
	}
	held := 0
	for d, in := range set {
		if in {
			held++
			if a.lookupDigest(testNS, d[:16]) != 1 {
				t.Fatalf("announced but not held: %x", d[:16])
			}
		}
	}
	descs, _, entries := s.ev.statsLocked(s)
	if held != descs || held == 0 || held > slots/testNS.World {
		t.Fatalf("%d announced, %d described, %d slots", held, descs, slots)
	}
	if entries > descs+1024+descs+1 {
		t.Fatalf("the log keeps %d entries for %d descriptions", entries, descs)
	}
	if r := a.events(testNS, 1<<40, 4); r.Status != wire.Gone {
		t.Fatalf("a cursor from the future: %v", r.Status)
	}
}

// The descriptions' bound refuses past it (the block stays cached).
func TestEventsBound(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.DescBytes, c.PodShare = 1<<20, 1 })
	a := rawDial(t, s.Socket(), "pod-a")
	a.register(testNS)
	a.putBlock(testNS, 1)
	big := descOf(1, -1)
	big.Tokens = make([]uint32, wire.MaxDescTokens)
	big.Extra = make([]byte, wire.MaxDescExtra)
	n := 0
	for i := 2; i < 64; i++ { // 64 blocks of two ranks: the pool

		a.putBlock(testNS, i)
		e := big
		copy(e.Digest[:], digest(i))
		st := a.describe(testNS, e)
		if st[0] == wire.Limit {
			break
		}
		if st[0] != wire.OK {
			t.Fatalf("describe %d: %v", i, st)
		}
		n++
	}
	if _, b, _ := s.ev.statsLocked(s); b > 1<<20 || n == 0 || n == 62 {
		t.Fatalf("%d bytes of descriptions after %d", b, n)
	}
	if s.Stats().DescribeRefused.Load() != 1 || a.lookupDigest(testNS, digest(1)) != 1 {
		t.Fatal("refused description not counted, or the block dropped")
	}
}

func (v *events) statsLocked(s *Server) (int, int64, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return v.stats()
}

func (r *rawConn) lookupDigest(ns machine.L2Namespace, d []byte) uint32 {
	return r.status(wire.TypeLookup, wire.Lookup{FP: ns.FP, Width: ns.Width, Digests: d}.Append).Value
}

// Two sidecars' clients on one node process: a block pod A writes and
// describes is in pod B's read of the node's event log, with A's
// description, and its eviction from the node tier is a removal there.
func TestClientEventsBetweenPods(t *testing.T) {
	s := startServer(t, nil)
	a, b := newTestClient(t, s.Socket(), "pod-a"), newTestClient(t, s.Socket(), "pod-b")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	if st := a.Describe(testNS, []wire.Entry{descOf(1, -1)}); len(st) != 1 || st[0] != wire.OK {
		t.Fatalf("describe: %v", st)
	}
	ev, ok := b.ReadEvents(testNS, 0, 16)
	if !ok || ev.Gone || ev.Epoch != s.Epoch() || len(ev.Entries) != 1 {
		t.Fatalf("read: %+v %v", ev, ok)
	}
	if e := ev.Entries[0]; e.Op != wire.OpStored || string(e.Digest[:16]) != string(digest(1)) || len(e.Tokens) != 2 || string(e.Extra) != "lora" {
		t.Fatalf("entry: %+v", e)
	}
	// Pod A writes past its share: block 1, its least recently used, goes.
	for i := 2; i < 2+s.ShareSlots(); i++ {
		a.write(t, i, i%16)
	}
	waitFor(t, "evicted", func() bool { return a.lookup(1) == 0 })
	ev2, ok := b.ReadEvents(testNS, ev.Next, 16)
	if !ok || ev2.Gone || len(ev2.Entries) != 1 || ev2.Entries[0].Op != wire.OpRemoved || string(ev2.Entries[0].Digest[:16]) != string(digest(1)) {
		t.Fatalf("after the eviction: %+v %v", ev2, ok)
	}
	// Bounded: with the node gone, a read fails within the client's deadline.
	s.Shutdown()
	<-s.Done()
	start := time.Now()
	if _, ok := b.ReadEvents(testNS, ev2.Next, 16); ok {
		t.Fatal("a read from a stopped node")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("a read waited %v", d)
	}
}

// A node's entries that do not fit the namespace the request named (a
// digest or parent past its width: another namespace's, or none at all;
// a description without tokens) make the read fail.
func TestEntriesFit(t *testing.T) {
	ok := descOf(1, 0)
	if !entriesFit(testNS, []wire.Entry{ok, {Op: wire.OpRemoved, Digest: ok.Digest}}) {
		t.Fatal("a valid read refused")
	}
	wide := ok
	wide.Digest[20] = 1
	wideParent := ok
	wideParent.Parent[16] = 1
	empty := ok
	empty.Tokens = nil
	for name, e := range map[string]wire.Entry{"digest": wide, "parent": wideParent, "tokens": empty} {
		if entriesFit(testNS, []wire.Entry{ok, e}) {
			t.Errorf("%s: accepted", name)
		}
	}
}
