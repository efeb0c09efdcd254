package machine_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// The Machine's side of the shared tier, on two nodes (two Machines, two
// pools) sharing one tier. The tier is the test's: a map of values keyed
// as the Redis tier keys them (namespace fingerprint, digest, rank), and
// each lookup, fetch and write the Machines ask for is carried out when
// the test says, so that every order can be tried. sidecar/l2 and the
// sidecar's tests run the same against a real Redis.

const (
	tSlot  = 4096
	tPage  = 4096
	tWidth = 32
)

type tier struct {
	vals map[string][]byte
}

func tierKey(ns machine.L2Namespace, d []byte, rank int) string {
	return fmt.Sprintf("%x/%x/%d", ns.FP, d, rank)
}

type l2node struct {
	t       *testing.T
	m       *machine.Machine
	pool    []byte
	now     int64
	mem     map[gpu.Handle][]byte // a region's bytes, by handle
	nextH   gpu.Handle
	tier    *tier
	out     *machine.Output
	replies []machine.Reply

	lookups []machine.L2Lookup
	fetches []machine.L2Fetch
	writes  []machine.L2Write

	hold bool           // keep copies in flight (in held) instead of doing them
	held []machine.Copy // copies kept in flight, for endCopies
}

func newNode(t *testing.T, tr *tier, slots int, cfg machine.L2Config) *l2node {
	t.Helper()
	c, err := cache.New(cache.Config{Capacity: slots, DeltaLogSize: 64, Epoch: 11})
	if err != nil {
		t.Fatal(err)
	}
	m, err := machine.New(machine.Config{SlotBytes: tSlot, MetaBytes: 4 << 20, RingBytes: 4 << 20, PinShare: 1, PendingShare: 1}, c)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Enabled = true
	if cfg.WriteSlots == 0 {
		cfg.WriteSlots = slots / 2
	}
	m.EnableL2(cfg)
	return &l2node{t: t, m: m, pool: make([]byte, slots*tSlot), mem: map[gpu.Handle][]byte{}, tier: tr, out: new(machine.Output)}
}

// do makes one call and carries out its copies and registrations at
// once; the tier's work is kept for the test to end.
func (n *l2node) do(call func(now int64, out *machine.Output)) []machine.Reply {
	n.t.Helper()
	n.now += int64(time.Millisecond)
	call(n.now, n.out)
	return n.drain()
}

func (n *l2node) drain() []machine.Reply {
	n.t.Helper()
	if err := n.m.CheckInvariants(); err != nil {
		n.t.Fatal(err)
	}
	out := n.out
	var replies []machine.Reply
	for _, r := range out.Replies {
		r.Payload = append([]byte(nil), r.Payload...)
		replies = append(replies, r)
	}
	n.lookups = append(n.lookups, out.L2Lookups...)
	n.fetches = append(n.fetches, out.L2Fetches...)
	n.writes = append(n.writes, out.L2Writes...)
	copies := append([]machine.Copy(nil), out.Copies...)
	regs := append([]machine.Register(nil), out.Registers...)
	if n.hold {
		n.held = append(n.held, copies...)
		copies = nil
	}
	for _, c := range copies {
		buf := n.mem[c.Region]
		for i, p := range c.Pages {
			page := buf[uint64(p)*c.PageBytes : uint64(p+1)*c.PageBytes]
			slot := n.pool[c.PoolOffsets[i] : c.PoolOffsets[i]+c.PageBytes]
			if c.Dir == gpu.PoolToEngine {
				copy(page, slot)
			} else {
				copy(slot, page)
			}
		}
		replies = append(replies, n.do(func(now int64, o *machine.Output) { n.m.CopyDone(now, c.ID, machine.CopyResult{}, o) })...)
	}
	for _, rg := range regs {
		n.nextH++
		n.mem[n.nextH] = make([]byte, rg.Region.Length)
		h := n.nextH
		replies = append(replies, n.do(func(now int64, o *machine.Output) { n.m.RegisterDone(now, rg.Session, rg.ID, h, nil, o) })...)
	}
	n.replies = append(n.replies, replies...)
	return replies
}

// endCopies carries out the copies kept in flight.
func (n *l2node) endCopies() {
	n.t.Helper()
	cs := n.held
	n.held, n.hold = nil, false
	n.out.Copies = append(n.out.Copies[:0], cs...)
	n.out.Replies, n.out.Registers, n.out.L2Lookups, n.out.L2Fetches, n.out.L2Writes = nil, nil, nil, nil, nil
	n.drain()
}

// endWrites carries out the writes asked for: each rank's value goes to
// the tier (refused: none).
func (n *l2node) endWrites(refuse bool) int {
	ws := n.writes
	n.writes = nil
	for _, w := range ws {
		if !refuse {
			for r, off := range w.PoolOffsets {
				n.tier.vals[tierKey(w.NS, w.Digest, r)] = append([]byte(nil), n.pool[off:off+w.Length]...)
			}
		}
		n.do(func(now int64, o *machine.Output) { n.m.L2WriteDone(now, w.ID, refuse, o) })
	}
	return len(ws)
}

func (n *l2node) endLookups() {
	ls := n.lookups
	n.lookups = nil
	for _, lk := range ls {
		found := 0
		for off := 0; off < len(lk.Digests); off += lk.NS.Width {
			all := true
			for r := 0; r < lk.NS.World; r++ {
				_, ok := n.tier.vals[tierKey(lk.NS, lk.Digests[off:off+lk.NS.Width], r)]
				all = all && ok
			}
			if !all {
				break
			}
			found++
		}
		n.do(func(now int64, o *machine.Output) { n.m.L2LookupDone(now, lk.ID, found, o) })
	}
}

// endFetches fills the slots of every fetch from the tier; spoil(i) makes
// block i's result a failure (an invalid value).
func (n *l2node) endFetches(spoil func(block int) bool) {
	fs := n.fetches
	n.fetches = nil
	for _, f := range fs {
		res := make([]machine.L2FetchResult, len(f.Blocks))
		for i, b := range f.Blocks {
			res[i].OK = true
			for r, off := range b.PoolOffsets {
				v, ok := n.tier.vals[tierKey(f.NS, b.Digest, r)]
				if !ok || (f.Length != 0 && uint64(len(v)) != f.Length) || uint64(len(v)) > f.MaxLength {
					res[i].OK = false
					continue
				}
				copy(n.pool[off:], v)
				res[i].Length = uint64(len(v))
			}
			if spoil != nil && spoil(i) {
				res[i].OK = false
			}
		}
		n.do(func(now int64, o *machine.Output) { n.m.L2FetchDone(now, f.ID, res, o) })
	}
}

type l2sess struct {
	n   *l2node
	id  machine.SessionID
	seq uint64
}

func (n *l2node) attach(instance, salt string, world, rank int) *l2sess {
	n.t.Helper()
	a, err := n.m.Attach(n.now, machine.AttachArgs{UID: 1000, PID: 77, RingBytes: 1 << 16, MaxPayload: 1 << 20,
		Req: &schema.AttachRequest{Version: schema.Version, Role: schema.RoleClient, Rank: uint32(rank), WorldSize: uint32(world),
			DigestWidth: tWidth, Instance: instance, Model: "m", Layout: "l", Salt: salt}})
	if err != nil {
		n.t.Fatal(err)
	}
	return &l2sess{n: n, id: a.Session}
}

// send handles one record and returns the replies that came at once.
func (s *l2sess) send(typ uint16, p []byte) (uint64, []machine.Reply) {
	s.seq++
	seq := s.seq
	return seq, s.n.do(func(now int64, o *machine.Output) { s.n.m.Handle(now, s.id, typ, seq, p, o) })
}

func replyFor(t *testing.T, rs []machine.Reply, seq uint64) []byte {
	t.Helper()
	for _, r := range rs {
		if r.Seq == seq {
			return r.Payload
		}
	}
	return nil
}

func (s *l2sess) region(pages int) {
	s.n.t.Helper()
	_, rs := s.send(schema.TypeRegisterRegion, (&schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: 77,
		Base: 1 << 20, Length: uint64(pages * tPage), PageSize: tPage, PageCount: uint32(pages)}).Append(nil))
	if len(rs) != 1 {
		s.n.t.Fatalf("register: %d replies", len(rs))
	}
}

func (s *l2sess) mem() []byte { return s.n.mem[s.n.nextH] }

func (s *l2sess) put(batch uint64, d []byte) {
	s.n.t.Helper()
	_, rs := s.send(schema.TypePutHashes, (&schema.PutHashes{Batch: batch, Digests: d}).Append(nil, tWidth))
	var r schema.Reply
	if len(rs) != 1 || r.Decode(rs[0].Payload) != nil || r.Status != 0 {
		s.n.t.Fatalf("put hashes: %v", rs)
	}
}

func (s *l2sess) store(batch uint64, start, count int) schema.StoreReply {
	s.n.t.Helper()
	pages := make([]uint32, count)
	for i := range pages {
		pages[i] = uint32(start + i)
		binary.LittleEndian.PutUint64(s.mem()[(start+i)*tPage:], uint64(1000+start+i)) // the page's own bytes
	}
	seq, rs := s.send(schema.TypeStore, (&schema.Store{View: schema.View{Batch: batch, Start: uint32(start), Count: uint32(count)}, Region: 1, Pages: pages}).Append(nil))
	var r schema.StoreReply
	if err := r.Decode(replyFor(s.n.t, rs, seq)); err != nil {
		s.n.t.Fatalf("store reply: %v", err)
	}
	return r
}

func (s *l2sess) lookup(batch uint64, count int) (uint64, []machine.Reply) {
	return s.send(schema.TypeLookup, (&schema.Lookup{View: schema.View{Batch: batch, Count: uint32(count)}}).Append(nil))
}

func lease(t *testing.T, p []byte) schema.LeaseReply {
	t.Helper()
	var r schema.LeaseReply
	if err := r.Decode(p); err != nil {
		t.Fatalf("lease reply %x: %v", p, err)
	}
	return r
}

func (s *l2sess) acquire(batch uint64, count int) schema.LeaseReply {
	s.n.t.Helper()
	seq, rs := s.send(schema.TypeAcquire, (&schema.Acquire{View: schema.View{Batch: batch, Count: uint32(count)}}).Append(nil))
	return lease(s.n.t, replyFor(s.n.t, rs, seq))
}

func (s *l2sess) poll(id uint64) schema.LeaseReply {
	s.n.t.Helper()
	seq, rs := s.send(schema.TypePoll, schema.IDRequest{ID: id}.Append(nil))
	return lease(s.n.t, replyFor(s.n.t, rs, seq))
}

// load loads the lease's blocks into pages 0.. and returns the status.
func (s *l2sess) load(id uint64, n int) schema.Status {
	s.n.t.Helper()
	pages := make([]uint32, n)
	for i := range pages {
		pages[i] = uint32(i)
	}
	clear(s.mem())
	seq, rs := s.send(schema.TypeLoad, (&schema.Load{Lease: id, Region: 1, Pages: pages}).Append(nil))
	var r schema.Reply
	if err := r.Decode(replyFor(s.n.t, rs, seq)); err != nil {
		s.n.t.Fatalf("load reply: %v", err)
	}
	return r.Status
}

func digs(seed string, n int) []byte {
	var out []byte
	for i := 0; i < n; i++ {
		d := make([]byte, tWidth)
		copy(d, seed)
		binary.LittleEndian.PutUint64(d[24:], uint64(i))
		out = append(out, d...)
	}
	return out
}

func TestL2WriteThroughLookupFetchLoad(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{})
	b := newNode(t, tr, 64, machine.L2Config{})
	d := digs("conversation", 6)

	sa := a.attach("engine-a", "", 1, 0)
	sa.region(8)
	sa.put(1, d)
	if r := sa.store(1, 0, 6); r.Stored != 6 {
		t.Fatalf("store: %+v", r)
	}
	if got := len(a.writes); got != 6 {
		t.Fatalf("write-through asked for %d writes, want 6", got)
	}
	a.endWrites(false)
	if len(tr.vals) != 6 {
		t.Fatalf("the tier holds %d values", len(tr.vals))
	}

	// Node B holds nothing: its lookup waits for the tier, then counts
	// what the tier holds.
	sb := b.attach("engine-b", "", 1, 0)
	sb.region(8)
	sb.put(1, d)
	seq, rs := sb.lookup(1, 6)
	if replyFor(t, rs, seq) != nil || len(b.lookups) != 1 {
		t.Fatalf("a local miss was answered at once (%d tier lookups)", len(b.lookups))
	}
	b.endLookups()
	var rep schema.Reply
	if err := rep.Decode(replyFor(t, b.replies, seq)); err != nil || rep.Value != 6 {
		t.Fatalf("lookup answered %+v %v, want 6", rep, err)
	}

	// The acquire waits for the fetch, promising 6 blocks; a load is
	// refused meanwhile.
	l := sb.acquire(1, 6)
	if l.State != schema.StateWaiting || l.Blocks != 6 || l.Lease == 0 || len(b.fetches) != 1 {
		t.Fatalf("acquire: %+v, %d fetches", l, len(b.fetches))
	}
	if p := sb.poll(l.Lease); p.State != schema.StateWaiting || p.Blocks != 6 {
		t.Fatalf("poll while fetching: %+v", p)
	}
	if st := sb.load(l.Lease, 6); st != schema.ErrCodeBadState {
		t.Fatalf("load while fetching: status %v", st)
	}
	b.endFetches(nil)
	if p := sb.poll(l.Lease); p.State != schema.StateReady || p.Blocks != 6 {
		t.Fatalf("poll after the fetch: %+v", p)
	}
	if st := sb.load(l.Lease, 6); st != 0 {
		t.Fatalf("load: status %v", st)
	}
	for i := 0; i < 6; i++ {
		if got := binary.LittleEndian.Uint64(sb.mem()[i*tPage:]); got != uint64(1000+i) {
			t.Fatalf("page %d holds %d, want %d", i, got, 1000+i)
		}
	}
	// Fetched blocks are present on B now, and are never written back.
	if st := b.m.Cache().Stats(); st.Blocks != 6 {
		t.Fatalf("B holds %d blocks", st.Blocks)
	}
	if len(b.writes) != 0 {
		t.Fatalf("fetched blocks were written back: %d writes", len(b.writes))
	}
	c := b.m.L2Counters()
	if c.Lookups != 1 || c.LookupHitBlocks != 6 || c.FetchedBlocks != 6 || c.FetchMisses != 0 {
		t.Fatalf("counters %+v", c)
	}
}

func TestL2FetchStopsAtABadBlockAndTimesOut(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{})
	b := newNode(t, tr, 64, machine.L2Config{Timeout: 50 * time.Millisecond, FetchTimeout: 100 * time.Millisecond})
	d := digs("p", 5)
	sa := a.attach("a", "", 1, 0)
	sa.region(8)
	sa.put(1, d)
	sa.store(1, 0, 5)
	a.endWrites(false)

	// B holds block 0 itself; blocks 1-4 come from the tier, block 2's
	// value is rejected: the lease holds 0 and 1 (3 and 4 are fetched all
	// the same, and serve later lookups).
	sb := b.attach("b", "", 1, 0)
	sb.region(8)
	sb.put(1, d)
	sb.store(1, 0, 1)
	b.writes = nil // B's own write-through of block 0 is not this test's
	l := sb.acquire(1, 5)
	if l.State != schema.StateWaiting || l.Blocks != 5 {
		t.Fatalf("acquire %+v", l)
	}
	b.endFetches(func(i int) bool { return i == 1 }) // the fetch's second block is block 2
	p := sb.poll(l.Lease)
	if p.State != schema.StateReady || p.Blocks != 2 {
		t.Fatalf("after a bad block: %+v", p)
	}
	if st := b.m.Cache().Stats(); st.Blocks != 4 {
		t.Fatalf("B holds %d blocks, want 4 (the rejected one not)", st.Blocks)
	}
	if c := b.m.L2Counters(); c.FetchMisses != 1 || c.FetchedBlocks != 3 {
		t.Fatalf("counters %+v", c)
	}

	// A lookup the tier never answers is answered by the deadline with the
	// local run; so is an acquire whose fetch never ends. The fetch's late
	// end still fills its slots.
	sb.put(2, digs("q", 3))
	sa.put(2, digs("q", 3))
	sa.store(2, 0, 3)
	a.endWrites(false)
	seq, _ := sb.lookup(2, 3)
	l = sb.acquire(2, 3)
	if l.State != schema.StateWaiting {
		t.Fatalf("acquire %+v", l)
	}
	b.now += int64(time.Second)
	b.do(func(now int64, o *machine.Output) { b.m.Tick(now, o) })
	var rep schema.Reply
	if err := rep.Decode(replyFor(t, b.replies, seq)); err != nil || rep.Value != 0 {
		t.Fatalf("timed-out lookup: %+v %v", rep, err)
	}
	if p := sb.poll(l.Lease); p.State != schema.StateMiss || p.Blocks != 0 {
		t.Fatalf("timed-out fetch: %+v", p)
	}
	b.endLookups() // late: ignored
	b.endFetches(nil)
	if c := b.m.L2Counters(); c.LookupTimeouts != 1 || c.FetchTimeouts != 1 || c.PendingFetches != 0 {
		t.Fatalf("counters %+v", c)
	}
	if b.m.Cache().State(b.nsOf(t, sb), digs("q", 3)[:tWidth]) != cache.Present {
		t.Fatal("a late fetch did not fill its slots")
	}
}

func (n *l2node) nsOf(t *testing.T, s *l2sess) cache.NamespaceID {
	for _, in := range n.m.Sessions() {
		if in.ID == s.id {
			for id := cache.NamespaceID(1); id < 10; id++ {
				if _, err := n.m.Cache().Namespace(id); err == nil {
					return id
				}
			}
		}
	}
	t.Fatal("no namespace")
	return 0
}

func TestL2WriteBoundSkips(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{WriteSlots: 2})
	sa := a.attach("a", "", 1, 0)
	sa.region(8)
	sa.put(1, digs("x", 5))
	if r := sa.store(1, 0, 5); r.Stored != 5 {
		t.Fatalf("store %+v", r) // the Store never waits for the tier
	}
	if n := len(a.writes); n != 2 {
		t.Fatalf("%d writes in flight, bound 2", n)
	}
	if st := a.m.Cache().Stats(); st.PinnedBlocks != 2 {
		t.Fatalf("writes pin %d blocks", st.PinnedBlocks)
	}
	a.endWrites(true) // the tier refused them (its queue full)
	c := a.m.L2Counters()
	if c.WritesSkipped != 3 || c.WritesNotTaken != 2 || c.WritingSlots != 0 {
		t.Fatalf("counters %+v", c)
	}
	if st := a.m.Cache().Stats(); st.PinnedBlocks != 0 {
		t.Fatalf("pins left: %d", st.PinnedBlocks)
	}
}

func TestL2WriteOnEvict(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 8, machine.L2Config{Policy: machine.WriteOnEvict, WriteSlots: 2, EvictAhead: 2})
	sa := a.attach("a", "", 1, 0)
	sa.region(16)
	d := digs("e", 12)
	sa.put(1, d)
	// Four blocks: the two least recent are written ahead, not the others.
	sa.store(1, 0, 4)
	if len(a.writes) != 2 {
		t.Fatalf("%d writes ahead of eviction, want 2", len(a.writes))
	}
	for _, w := range a.writes {
		if !bytes.Equal(w.Digest, d[:tWidth]) && !bytes.Equal(w.Digest, d[tWidth:2*tWidth]) {
			t.Fatalf("wrote %x, not one of the two least recent", w.Digest)
		}
	}
	a.endWrites(false)
	// The written blocks went back to the tail, which is written: a tick
	// writes nothing more.
	a.do(func(now int64, o *machine.Output) { a.m.Tick(now, o) })
	if len(a.writes) != 0 {
		t.Fatalf("tick: %d writes", len(a.writes))
	}
	// Six more: four free slots, then the two written blocks are evicted;
	// the new tail (blocks 2 and 3) is written ahead.
	sa.store(1, 4, 6)
	if st := a.m.Cache().Stats(); st.Evictions != 2 || st.EvictedUnmarked != 0 {
		t.Fatalf("evictions %d unmarked %d", st.Evictions, st.EvictedUnmarked)
	}
	if len(a.writes) != 2 {
		t.Fatalf("%d writes ahead", len(a.writes))
	}
	// While those writes pin blocks 2 and 3, two more stores evict the
	// next ones, unwritten: counted.
	sa.store(1, 10, 2)
	if st := a.m.Cache().Stats(); st.Evictions != 4 || st.EvictedUnmarked != 2 {
		t.Fatalf("evictions %d unmarked %d", st.Evictions, st.EvictedUnmarked)
	}
	a.endWrites(false)
	if len(tr.vals) != 4 {
		t.Fatalf("the tier holds %d", len(tr.vals))
	}
}

func TestL2TensorParallelAndSessionEnd(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{})
	b := newNode(t, tr, 64, machine.L2Config{})
	d := digs("tp", 3)
	r0, r1 := a.attach("a", "", 2, 0), a.attach("a", "", 2, 1)
	r0.region(4)
	r0.put(1, d)
	r0.store(1, 0, 3)
	if len(a.writes) != 0 {
		t.Fatal("a block with one rank in was written")
	}
	r1.region(4)
	r1.store(1, 0, 3)
	if len(a.writes) != 3 || len(a.writes[0].PoolOffsets) != 2 {
		t.Fatalf("%d writes", len(a.writes))
	}
	a.endWrites(false)
	if len(tr.vals) != 6 {
		t.Fatalf("tier holds %d values, want 3 blocks x 2 ranks", len(tr.vals))
	}
	// B's scheduler acquires; it ends before the fetch does: the fetch
	// still fills its slots, nobody is answered.
	sb := b.attach("b", "", 2, 0)
	sb.put(1, d)
	l := sb.acquire(1, 3)
	if l.State != schema.StateWaiting || len(b.fetches) != 1 || len(b.fetches[0].Blocks[0].PoolOffsets) != 2 {
		t.Fatalf("acquire %+v", l)
	}
	b.do(func(now int64, o *machine.Output) { b.m.Detach(now, sb.id, o) })
	b.endFetches(nil)
	if st := b.m.Cache().Stats(); st.Blocks != 3 || st.Stored != 6 || st.PinnedBlocks != 0 || st.Leases != 0 {
		t.Fatalf("after the fetch: %+v", st)
	}
	if u := b.m.Usage(); u.Sessions != 0 {
		t.Fatalf("usage %+v", u)
	}
}

func TestL2TenantsNeverShareKeys(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{})
	b := newNode(t, tr, 64, machine.L2Config{})
	d := digs("shared-prompt", 2)
	s1 := a.attach("a", "tenant-1", 1, 0)
	s1.region(2)
	s1.put(1, d)
	s1.store(1, 0, 2)
	a.endWrites(false)
	s2 := b.attach("b", "tenant-2", 1, 0)
	s2.put(1, d)
	seq, _ := s2.lookup(1, 2)
	b.endLookups()
	var rep schema.Reply
	if err := rep.Decode(replyFor(t, b.replies, seq)); err != nil || rep.Value != 0 {
		t.Fatalf("another tenant's lookup found %d blocks (%v)", rep.Value, err)
	}
	if l := s2.acquire(1, 2); l.State == schema.StateWaiting {
		b.endFetches(nil)
		if p := s2.poll(l.Lease); p.Blocks != 0 || p.State != schema.StateMiss {
			t.Fatalf("another tenant's fetch: %+v", p)
		}
	}
}

func TestL2SecondAcquireWaitsForTheFirstsFetch(t *testing.T) {
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{})
	b := newNode(t, tr, 64, machine.L2Config{})
	d := digs("shared system prompt", 4)
	sa := a.attach("a", "", 1, 0)
	sa.region(8)
	sa.put(1, d)
	sa.store(1, 0, 4)
	a.endWrites(false)

	// Two requests on B with the same prefix: the first fetches it, the
	// second waits for that fetch instead of missing.
	s1, s2 := b.attach("b", "", 1, 0), b.attach("b", "", 1, 0)
	s1.region(8)
	s1.put(1, d)
	s2.put(2, d)
	l1 := s1.acquire(1, 4)
	l2 := s2.acquire(2, 4)
	if l1.State != schema.StateWaiting || l2.State != schema.StateWaiting || l2.Blocks != 4 || len(b.fetches) != 1 {
		t.Fatalf("acquires %+v %+v, %d fetches (want one)", l1, l2, len(b.fetches))
	}
	b.endFetches(nil)
	for _, x := range []struct {
		s *l2sess
		l schema.LeaseReply
	}{{s1, l1}, {s2, l2}} {
		if p := x.s.poll(x.l.Lease); p.State != schema.StateReady || p.Blocks != 4 {
			t.Fatalf("after the fetch: %+v", p)
		}
	}
	// The second may be released first, or end with its session: nothing
	// is left either way.
	b.do(func(now int64, o *machine.Output) { b.m.Detach(now, s2.id, o) })
	if st := sa.n.m.L2Counters(); st.PendingFetches != 0 {
		t.Fatalf("A: %+v", st)
	}
	if c := b.m.L2Counters(); c.PendingFetches != 0 || c.FetchedBlocks != 4 {
		t.Fatalf("B: %+v", c)
	}
}

func TestL2AcquireWaitsForABlockAnEngineStores(t *testing.T) {
	// Two requests of one prefix on B: the first hit the tier's first
	// block and stores the second itself (vLLM recomputes the last block of
	// a prompt); the second hits both in the tier and acquires while that
	// store is in flight. Its lease waits for the store rather than stop
	// short of the block its lookup promised; a store that never ends is
	// waited for until the fetch's deadline only.
	for _, never := range []bool{false, true} {
		t.Run(fmt.Sprintf("store-never-ends=%v", never), func(t *testing.T) {
			tr := &tier{vals: map[string][]byte{}}
			a := newNode(t, tr, 64, machine.L2Config{})
			b := newNode(t, tr, 64, machine.L2Config{FetchTimeout: 50 * time.Millisecond})
			d := digs("one prefix", 2)
			sa := a.attach("a", "", 1, 0)
			sa.region(8)
			sa.put(1, d)
			sa.store(1, 0, 2)
			a.endWrites(false)

			s1, s2 := b.attach("b", "", 1, 0), b.attach("b", "", 1, 0)
			s1.region(8)
			s1.put(1, d)
			s2.put(2, d)
			b.hold = true // the store's copy stays in flight, its reply with it
			s1.send(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Start: 1, Count: 1}, Region: 1, Pages: []uint32{1}}).Append(nil))
			if len(b.held) != 1 {
				t.Fatalf("%d copies in flight, want the store's", len(b.held))
			}
			l := s2.acquire(2, 2)
			if l.State != schema.StateWaiting || l.Blocks != 2 || len(b.fetches) != 1 {
				t.Fatalf("acquire %+v, %d fetches", l, len(b.fetches))
			}
			b.endFetches(nil)
			if p := s2.poll(l.Lease); p.State != schema.StateWaiting {
				t.Fatalf("the fetch ended, the store did not: %+v", p)
			}
			want := 2
			if never {
				b.now += int64(time.Second)
				b.do(func(now int64, o *machine.Output) { b.m.Tick(now, o) })
				want = 1
			} else {
				b.endCopies()
			}
			if p := s2.poll(l.Lease); p.State != schema.StateReady || int(p.Blocks) != want {
				t.Fatalf("after the store: %+v, want ready with %d", p, want)
			}
			if never {
				b.endCopies()
			}
			if c := b.m.L2Counters(); c.PendingFetches != 0 {
				t.Fatalf("B: %+v", c)
			}
		})
	}
}

func TestL2AcquireWaitsForItsOwnFetchAndAnothers(t *testing.T) {
	// The second request's prefix is longer: it waits for the first's
	// fetch (blocks 0-1) and fetches blocks 2-3 itself. The first fetch
	// ending first must not resolve it before its own has ended.
	tr := &tier{vals: map[string][]byte{}}
	a := newNode(t, tr, 64, machine.L2Config{})
	b := newNode(t, tr, 64, machine.L2Config{})
	d := digs("a longer prefix", 4)
	sa := a.attach("a", "", 1, 0)
	sa.region(8)
	sa.put(1, d)
	sa.store(1, 0, 4)
	a.endWrites(false)

	s1, s2 := b.attach("b", "", 1, 0), b.attach("b", "", 1, 0)
	s1.put(1, d[:2*tWidth])
	s2.put(2, d)
	l1, l2 := s1.acquire(1, 2), s2.acquire(2, 4)
	if l1.State != schema.StateWaiting || l2.State != schema.StateWaiting || len(b.fetches) != 2 {
		t.Fatalf("acquires %+v %+v, %d fetches (want two)", l1, l2, len(b.fetches))
	}
	b.endFetches(nil) // in order: the first's, then the second's
	if p := s2.poll(l2.Lease); p.State != schema.StateReady || p.Blocks != 4 {
		t.Fatalf("after both fetches: %+v, want ready with 4", p)
	}
	if p := s1.poll(l1.Lease); p.State != schema.StateReady || p.Blocks != 2 {
		t.Fatalf("the first: %+v, want ready with 2", p)
	}
}
