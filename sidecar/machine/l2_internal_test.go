package machine

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// rv drives a Machine with the shared tier on, for the tests that look at
// its records.
type rv struct {
	t   *testing.T
	m   *Machine
	now int64
	out Output
	seq uint64
}

func newRV(t *testing.T, slots int) *rv {
	c, err := cache.New(cache.Config{Capacity: slots, DeltaLogSize: 64, Epoch: 11})
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{SlotBytes: 4096, MetaBytes: 64 << 20, RingBytes: 4 << 20, PinShare: 1, PendingShare: 1}, c)
	if err != nil {
		t.Fatal(err)
	}
	m.EnableL2(L2Config{FetchTimeout: 50 * time.Millisecond})
	return &rv{t: t, m: m}
}

func (r *rv) attach(world, rank int) SessionID {
	a, err := r.m.Attach(r.now, AttachArgs{UID: 1000, PID: 77, RingBytes: 1 << 16, MaxPayload: 1 << 20,
		Req: &schema.AttachRequest{Version: schema.Version, Role: schema.RoleClient, Rank: uint32(rank), WorldSize: uint32(world),
			DigestWidth: 32, Instance: "i", Model: "m", Layout: "l", Salt: ""}})
	if err != nil {
		r.t.Fatal(err)
	}
	return a.Session
}

func (r *rv) send(s SessionID, typ uint16, p []byte) *Output {
	r.now += int64(time.Millisecond)
	r.seq++
	r.m.Handle(r.now, s, typ, r.seq, p, &r.out)
	return &r.out
}

func (r *rv) acquireRelease(s SessionID) {
	o := r.send(s, schema.TypeAcquire, (&schema.Acquire{View: schema.View{Batch: 1, Count: 1}}).Append(nil))
	var l schema.LeaseReply
	if len(o.Replies) != 1 || l.Decode(o.Replies[0].Payload) != nil || l.State != schema.StateWaiting {
		r.t.Fatalf("acquire: %+v", o.Replies)
	}
	r.send(s, schema.TypeRelease, schema.IDRequest{ID: l.Lease}.Append(nil))
}

func rvDigs(n int) []byte {
	var out []byte
	for i := 0; i < n; i++ {
		d := make([]byte, 32)
		copy(d, "l2 internal")
		binary.LittleEndian.PutUint64(d[24:], uint64(i))
		out = append(out, d...)
	}
	return out
}

// A block kept pending (its store's copy in flight: a stalled chunk, or
// with world >= 2 a rank that never stores) must not collect, in
// l2.stored, the acquires that waited for it once they resolved at their
// deadline and their metadata charge was given back (it did: memory
// without a bound, outside the metadata limit).
func TestL2StoreWaitKeepsNoResolvedFetch(t *testing.T) {
	r := newRV(t, 64)
	s := r.attach(1, 0)
	o := r.send(s, schema.TypeRegisterRegion, (&schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: 77,
		Base: 1 << 20, Length: 8 * 4096, PageSize: 4096, PageCount: 8}).Append(nil))
	reg := o.Registers[0]
	r.m.RegisterDone(r.now, s, reg.ID, gpu.Handle(1), nil, &r.out)
	d := rvDigs(1)
	r.send(s, schema.TypePutHashes, (&schema.PutHashes{Batch: 1, Digests: d}).Append(nil, 32))
	o = r.send(s, schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Start: 0, Count: 1}, Region: 1, Pages: []uint32{0}}).Append(nil))
	if len(o.Copies) != 1 {
		t.Fatalf("%d copies", len(o.Copies))
	}
	// The copy is never ended: the block stays pending.
	base := r.m.total.meta
	const N = 200
	for i := 0; i < N; i++ {
		r.acquireRelease(s)
		r.now += int64(60 * time.Millisecond)
		r.m.Tick(r.now, &r.out)
	}
	for id, f := range r.m.l2.fetches {
		t.Logf("fetch %d: resolved %v own %v deps %d deadline %d now %d", id, f.resolved, f.own, f.deps, f.deadline, r.now)
	}
	k := fillKey(r.m.sessions[s].inst.ns.id, d)
	held := 0
	if sw := r.m.l2.stored[k]; sw != nil {
		held = len(sw.waiters)
	}
	t.Logf("metadata charged: %d before, %d after; resolved fetches still referenced by l2.stored: %d", base, r.m.total.meta, held)
	if held > 1 {
		t.Fatalf("l2.stored holds %d resolved, uncharged fetches (with their views, queries and sessions)", held)
	}
}

func (r *rv) attachW(world, rank int) SessionID {
	a, err := r.m.Attach(r.now, AttachArgs{UID: 1000, PID: 77, RingBytes: 1 << 16, MaxPayload: 1 << 20,
		Req: &schema.AttachRequest{Version: schema.Version, Role: schema.RoleWorker, Rank: uint32(rank), WorldSize: uint32(world),
			DigestWidth: 32, Instance: "i", Model: "m", Layout: "l", Salt: ""}})
	if err != nil {
		r.t.Fatal(err)
	}
	return a.Session
}

func (r *rv) region(s SessionID, h gpu.Handle) {
	o := r.send(s, schema.TypeRegisterRegion, (&schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: 77,
		Base: 1 << 20, Length: 8 * 4096, PageSize: 4096, PageCount: 8}).Append(nil))
	r.m.RegisterDone(r.now, s, o.Registers[0].ID, h, nil, &r.out)
}

// With world 2, rank 0 stores, rank 1's store fails (and is retried) every
// 18 s: the block stays pending for ever (each BeginStore moves its
// deadline); l2.stored's waiters must not grow with every acquire.
func TestL2StoreWaitOnABlockPendingForEver(t *testing.T) {
	r := newRV(t, 64)
	s0, s1 := r.attachW(2, 0), r.attachW(2, 1)
	r.region(s0, 1)
	r.region(s1, 2)
	d := rvDigs(1)
	st := func(s SessionID) CopyID {
		r.send(s, schema.TypePutHashes, (&schema.PutHashes{Batch: 1, Digests: d}).Append(nil, 32))
		o := r.send(s, schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Start: 0, Count: 1}, Region: 1, Pages: []uint32{0}}).Append(nil))
		if len(o.Copies) != 1 {
			t.Fatalf("%d copies", len(o.Copies))
		}
		return o.Copies[0].ID
	}
	c0 := st(s0)
	r.m.CopyDone(r.now, c0, CopyResult{}, &r.out)
	c1 := st(s1)
	base := r.m.total.meta
	const N = 5000 // 300 s at one acquire per 60 ms
	for i := 0; i < N; i++ {
		if i%300 == 299 { // every 18 s: rank 1's copy fails, and it tries again
			r.m.CopyDone(r.now, c1, CopyResult{Err: errFake}, &r.out)
			o := r.send(s1, schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Start: 0, Count: 1}, Region: 1, Pages: []uint32{0}}).Append(nil))
			if len(o.Copies) != 1 {
				t.Fatalf("retry %d: %d copies", i, len(o.Copies))
			}
			c1 = o.Copies[0].ID
		}
		r.acquireRelease(s0)
		r.now += int64(60 * time.Millisecond)
		r.m.Tick(r.now, &r.out)
	}
	k := fillKey(r.m.sessions[s0].inst.ns.id, d)
	held := 0
	if sw := r.m.l2.stored[k]; sw != nil {
		held = len(sw.waiters)
	}
	t.Logf("after %v: metadata charged %d before, %d after; fetch records %d; resolved fetches referenced by l2.stored: %d",
		time.Duration(N)*60*time.Millisecond, base, r.m.total.meta, len(r.m.l2.fetches), held)
	if held > 1 {
		t.Fatalf("l2.stored holds %d resolved, uncharged fetches", held)
	}
}

var errFake = fakeErr("copy failed")

type fakeErr string

func (e fakeErr) Error() string { return string(e) }

// A one-rank namespace's fetch reservations are charged to the uid's
// pending share: its concurrent acquires cannot reserve the whole pool
// (they did, past its pending and pin shares), and another uid's Store
// finds room while the tier has not answered.
func TestL2FetchReservationsAreCharged(t *testing.T) {
	c, err := cache.New(cache.Config{Capacity: 64, DeltaLogSize: 64, Epoch: 11})
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{SlotBytes: 4096, MetaBytes: 64 << 20, RingBytes: 4 << 20}, c) // default shares: pin 0.5, pending 0.25
	if err != nil {
		t.Fatal(err)
	}
	m.EnableL2(L2Config{})
	r := &rv{t: t, m: m}
	att := func(uid uint32, salt string) SessionID {
		a, err := m.Attach(r.now, AttachArgs{UID: uid, PID: 77, RingBytes: 1 << 16, MaxPayload: 1 << 20,
			Req: &schema.AttachRequest{Version: schema.Version, Role: schema.RoleClient, WorldSize: 1,
				DigestWidth: 32, Instance: salt, Model: "m", Layout: "l", Salt: salt}})
		if err != nil {
			t.Fatal(err)
		}
		return a.Session
	}
	evil := att(1000, "evil")
	all := rvDigs(64)
	for b := 0; b < 2; b++ {
		r.send(evil, schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(b + 1), Digests: all[b*32*32 : (b+1)*32*32]}).Append(nil, 32))
		r.send(evil, schema.TypeAcquire, (&schema.Acquire{View: schema.View{Batch: uint64(b + 1), Count: 32}}).Append(nil))
	}
	st := m.cache.Stats()
	t.Logf("pool 64 slots, pending limit %d, pin limit %d: %d blocks reserved by uid 1000's fetches", m.pendingLimit(), m.pinLimit(), st.PendingBlocks)
	victim := att(2000, "victim")
	r.region(victim, 9)
	r.send(victim, schema.TypePutHashes, (&schema.PutHashes{Batch: 1, Digests: rvDigs(1)}).Append(nil, 32))
	o := r.send(victim, schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: 1}, Region: 1, Pages: []uint32{0}}).Append(nil))
	if st.PendingBlocks > m.pendingLimit() || len(o.Copies) == 0 {
		t.Fatalf("uid 1000 reserves %d slots (pending share %d); uid 2000's store got %d copies, replies %v", st.PendingBlocks, m.pendingLimit(), len(o.Copies), o.Replies)
	}
}
