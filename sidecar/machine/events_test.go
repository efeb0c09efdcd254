package machine_test

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/schema"
)

// evClient is a session of the pure driver (scenario_test.go) with the
// requests of KV events.
type evClient struct {
	t *testing.T
	s *pureSession
}

func evAttach(t *testing.T, d *pure, instance string, role uint16, rank, world int, salt string) evClient {
	t.Helper()
	s, err := d.Attach(scenario.AttachOptions{Instance: instance, Model: "m", Layout: "l", Salt: salt, Role: role,
		Rank: rank, WorldSize: world, DigestWidth: 16})
	if err != nil {
		t.Fatal(err)
	}
	return evClient{t: t, s: s.(*pureSession)}
}

func evDigest(i int) []byte {
	d := make([]byte, 16)
	binary.BigEndian.PutUint64(d[8:], uint64(i)+1)
	return d
}

func evDigests(from, n int) []byte {
	var b []byte
	for i := from; i < from+n; i++ {
		b = append(b, evDigest(i)...)
	}
	return b
}

func evTokens(from, n int) []byte {
	b := make([]byte, 4*n)
	for i := range n {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(from+i))
	}
	return b
}

// store registers digests [from, from+n) in batch and stores them from the
// session's region (pages from 0).
func (c evClient) store(batch uint64, from, n int) schema.StoreReply {
	c.t.Helper()
	if _, err := c.s.PutHashesFlags(batch, evDigests(from, n), schema.FlagReplace); err != nil {
		c.t.Fatal(err)
	}
	pages := make([]uint32, n)
	for i := range pages {
		pages[i] = uint32(i)
	}
	r, err := c.s.Store(schema.View{Batch: batch, Start: 0, Count: uint32(n)}, 1, pages)
	if err != nil {
		c.t.Fatal(err)
	}
	return r
}

func (c evClient) region(pages int) {
	c.t.Helper()
	m := c.s.d.Memory(pages * 4096)
	err := c.s.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: purePID, Base: m.Base(),
		Length: uint64(pages * 4096), PageSize: 4096, PageCount: uint32(pages)})
	if err != nil {
		c.t.Fatal(err)
	}
}

func (c evClient) describe(runs ...schema.DescribeRun) schema.Reply {
	c.t.Helper()
	b, err := c.s.Call(schema.TypeDescribe, (&schema.Describe{Runs: runs}).Append(nil, 16))
	if err != nil {
		c.t.Fatal(err)
	}
	var r schema.Reply
	if err := r.Decode(b); err != nil {
		c.t.Fatal(err)
	}
	return r
}

func (c evClient) reply(typ uint16, payload []byte) schema.EventsReply {
	c.t.Helper()
	b, err := c.s.Call(typ, payload)
	if err != nil {
		c.t.Fatal(err)
	}
	var r schema.EventsReply
	if err := r.Decode(b); err != nil {
		c.t.Fatalf("%s reply: %v", schema.TypeName(typ), err)
	}
	return r
}

func (c evClient) events(epoch, seq uint64, max uint32) schema.EventsReply {
	return c.reply(schema.TypeEvents, (&schema.Changes{Epoch: epoch, Seq: seq, Max: max}).Append(nil))
}

func (c evClient) eventSnapshot(from uint64, max uint32) schema.EventsReply {
	return c.reply(schema.TypeEventSnapshot, (&schema.Snapshot{From: from, Max: max}).Append(nil))
}

// lines renders a reply's events, digests by their index.
func lines(r schema.EventsReply) []string {
	var out []string
	r.Events(func(e *schema.Event) bool {
		s := fmt.Sprintf("%d d%d", e.Op, binary.BigEndian.Uint64(e.Digest[8:])-1)
		if e.Parent != nil {
			s += fmt.Sprintf(" p%d", binary.BigEndian.Uint64(e.Parent[8:])-1)
		}
		if n := e.TokenCount(); n > 0 {
			s += fmt.Sprintf(" t%d..%d", e.Token(0), e.Token(n-1))
		}
		if len(e.Extra) > 0 {
			s += " x=" + string(e.Extra)
		}
		out = append(out, s)
		return true
	})
	return out
}

func newEventsDriver(t *testing.T, slots int) *pure {
	t.Helper()
	d := &pure{t: t}
	if err := d.Start(scenario.Config{Slots: slots, SlotBytes: 4096}); err != nil {
		t.Fatal(err)
	}
	return d
}

// Two ranks store, the scheduler describes (before the second rank's store
// lands), another engine of the namespace reads the events; an engine of
// another namespace (salt) sees none; eviction is announced; a worker may
// not read a snapshot.
func TestEventsThroughTheMachine(t *testing.T) {
	d := newEventsDriver(t, 32)
	sched := evAttach(t, d, "e1", schema.RoleScheduler, 0, 2, "")
	w0 := evAttach(t, d, "e1", schema.RoleWorker, 0, 2, "")
	w1 := evAttach(t, d, "e1", schema.RoleWorker, 1, 2, "")
	other := evAttach(t, d, "e2", schema.RoleScheduler, 0, 2, "")
	tenant := evAttach(t, d, "e3", schema.RoleScheduler, 0, 2, "salt")
	w0.region(16)
	w1.region(16)

	start := other.events(0, 0, 0)
	if !start.Resync || start.Count != 0 {
		t.Fatalf("initial cursor: %+v", start)
	}
	tstart := tenant.events(0, 0, 0)

	w0.store(1, 0, 3)
	// Described while only rank 0 holds the blocks: announced when rank 1 stores.
	if r := sched.describe(schema.DescribeRun{Digests: evDigests(0, 3), TokensPerBlock: 2, Tokens: evTokens(10, 6), Extra: []byte("lora")}); r.Status != schema.OK || r.Value != 3 {
		t.Fatalf("describe: %+v", r)
	}
	if got := other.events(start.Epoch, start.Seq, 0); got.Count != 0 {
		t.Fatalf("announced before every rank stored: %v", lines(got))
	}
	w1.store(1, 0, 3)
	got := other.events(start.Epoch, start.Seq, 0)
	want := []string{"1 d0 t10..11 x=lora", "1 d1 p0 t12..13 x=lora", "1 d2 p1 t14..15 x=lora"}
	if fmt.Sprint(lines(got)) != fmt.Sprint(want) {
		t.Fatalf("events\n got %v\nwant %v", lines(got), want)
	}
	if r := tenant.events(tstart.Epoch, tstart.Seq, 0); r.Count != 0 {
		t.Fatalf("another namespace sees %v", lines(r))
	}
	// max bounds a reply; the cursor continues.
	part := other.events(start.Epoch, start.Seq, 2)
	if part.Count != 2 {
		t.Fatalf("max 2: %d events", part.Count)
	}
	if rest := other.events(part.Epoch, part.Seq, 0); fmt.Sprint(lines(rest)) != fmt.Sprint(want[2:]) {
		t.Fatalf("the rest: %v", lines(rest))
	}
	// A snapshot of the described blocks, one at a time.
	var snap []string
	from := uint64(0)
	for {
		page := other.eventSnapshot(from, 1)
		snap = append(snap, lines(page)...)
		if page.Done {
			break
		}
		if page.Next <= from {
			t.Fatalf("snapshot did not advance from %d", from)
		}
		from = page.Next
	}
	if fmt.Sprint(snap) != fmt.Sprint(want) {
		t.Fatalf("snapshot\n got %v\nwant %v", snap, want)
	}
	b, _ := w0.s.Call(schema.TypeEventSnapshot, (&schema.Snapshot{}).Append(nil))
	var wr schema.EventsReply
	if err := wr.Decode(b); err != nil || wr.Status != schema.ErrCodeNotPermitted {
		t.Fatalf("worker snapshot: %+v %v", wr, err)
	}
	// Fill the pool: the three described blocks go, and their removals are read.
	for k := range 4 { // 4 blocks at a time: a uid may hold a quarter of the pool in incomplete blocks
		w0.store(uint64(2+k), 10+4*k, 4)
		w1.store(uint64(2+k), 10+4*k, 4)
	}
	rem := other.events(got.Epoch, got.Seq, 0)
	if fmt.Sprint(lines(rem)) != fmt.Sprint([]string{"2 d0", "2 d1", "2 d2"}) {
		t.Fatalf("removals: %v", lines(rem))
	}
	// A cursor of another epoch resyncs.
	if r := other.events(rem.Epoch+1, rem.Seq, 0); !r.Resync || r.Epoch != rem.Epoch || r.Seq != rem.Seq {
		t.Fatalf("wrong epoch: %+v", r)
	}
	if err := d.m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// Descriptions count under the metadata bounds: a Describe that would take
// the session past its share is refused whole (status 7), and a session's
// descriptions stay (charged to its uid) when it ends.
func TestDescribeQuota(t *testing.T) {
	d := newEventsDriver(t, 16)
	s := evAttach(t, d, "e1", schema.RoleScheduler, 0, 1, "")
	share := int64(float64(d.m.Config().MetaBytes) * d.m.Config().SessionShare)
	// Runs of 4096 tokens a block (16 KiB each) until the session's share is used.
	big := func(from int) schema.DescribeRun {
		return schema.DescribeRun{Digests: evDigests(from, 64), TokensPerBlock: 4096, Tokens: evTokens(0, 64*4096)}
	}
	var refused bool
	for i := 0; i < int(share/(64*16<<10))+4; i++ {
		r := s.describe(big(i * 64))
		if r.Status == schema.ErrCodeTooLarge {
			refused = true
			break
		}
		if r.Status != schema.OK || r.Value != 64 {
			t.Fatalf("describe %d: %+v", i, r)
		}
	}
	if !refused {
		t.Fatal("descriptions past the session's share of the metadata bound were accepted")
	}
	u := d.m.Usage()
	if u.MetaBytes > share+share/4 || u.MetaBytes < share/2 {
		t.Fatalf("metadata %d bytes, the session's share is %d", u.MetaBytes, share)
	}
	keep := evAttach(t, d, "e1", schema.RoleWorker, 0, 1, "") // the namespace lives on
	if err := s.s.Detach(); err != nil {
		t.Fatal(err)
	}
	if d.m.Cache().DescBytes() == 0 {
		t.Fatal("descriptions went with their session")
	}
	if err := d.m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	if err := keep.s.Detach(); err != nil { // the namespace goes, and its pending descriptions
		t.Fatal(err)
	}
	if d.m.Cache().DescBytes() != 0 {
		t.Fatal("pending descriptions outlived their namespace")
	}
}

// Malformed Describe and Events records get status 1, in their reply
// layouts; nothing is recorded.
func TestEventsMalformed(t *testing.T) {
	d := newEventsDriver(t, 4)
	s := evAttach(t, d, "e1", schema.RoleScheduler, 0, 1, "")
	good := (&schema.Describe{Runs: []schema.DescribeRun{{Digests: evDigests(0, 1), TokensPerBlock: 1, Tokens: evTokens(0, 1)}}}).Append(nil, 16)
	for name, p := range map[string][]byte{
		"short":    good[:len(good)-1],
		"trailing": append(append([]byte(nil), good...), 0),
		"flags":    append([]byte{1, 0, 0, 0, 1, 0, 0, 0}, good[8:]...),
		"width":    (&schema.Describe{Runs: []schema.DescribeRun{{Digests: make([]byte, 8), TokensPerBlock: 1, Tokens: evTokens(0, 1)}}}).Append(nil, 8),
	} {
		b, err := s.s.Call(schema.TypeDescribe, p)
		if err != nil {
			t.Fatal(err)
		}
		var r schema.Reply
		if err := r.Decode(b); err != nil || r.Status != schema.ErrCodeMalformed {
			t.Errorf("%s: %+v %v", name, r, err)
		}
	}
	for _, typ := range []uint16{schema.TypeEvents, schema.TypeEventSnapshot} {
		b, err := s.s.Call(typ, []byte{1, 2, 3})
		if err != nil {
			t.Fatal(err)
		}
		var r schema.EventsReply
		if err := r.Decode(b); err != nil || r.Status != schema.ErrCodeMalformed || r.Width != 16 {
			t.Errorf("%s: %+v %v", schema.TypeName(typ), r, err)
		}
	}
	if d.m.Cache().DescBytes() != 0 {
		t.Fatal("a malformed record recorded descriptions")
	}
}
