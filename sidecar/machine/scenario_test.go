package machine_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// TestScenarios runs the protocol scenarios (testdata/scenarios) against
// the Machine alone. The copy engine is emulated: a copy moves the bytes
// between an in-memory pool and the in-memory buffers regions are
// registered over, so a `check` after a load proves that the Machine's slot
// bookkeeping hands back exactly what a store put in. The pool starts
// filled with poison, and freed slots are poisoned again: a load of a slot
// nobody wrote, or one freed under it, shows as "unknown".
func TestScenarios(t *testing.T) {
	scenario.RunAll(t, "../../testdata/scenarios", func(t *testing.T) scenario.Driver { return &pure{t: t} })
}

const (
	pureUID  = 1000
	purePID  = 4242
	poisonB  = 0xDB
	baseAddr = 1 << 32 // the emulated address space's first region
)

// pure drives a Machine directly, as the sidecar's session loop and copy
// scheduler would, but synchronously: every copy and registration the
// Machine asks for runs before the call returns.
type pure struct {
	t         *testing.T
	m         *machine.Machine
	pool      []byte
	slotBytes uint64
	chunk     uint64 // the most one copy may move
	now       int64

	mem      map[uint64][]byte // client memory by base address
	nextBase uint64
	regions  map[gpu.Handle]gpu.Region
	nextH    gpu.Handle
}

func (d *pure) Start(c scenario.Config) error {
	// The sidecar's configuration with the scenario's settings, mapped to
	// the Machine's and the cache's as sidecar.New maps them.
	cfg := sidecar.Config{PoolBytes: uint64(c.Slots) * c.SlotBytes,
		Machine: machine.Config{SlotBytes: c.SlotBytes, Budget: c.Budget, ChunkBytes: c.ChunkBytes}}
	cfg.EnsureDefaults()
	d.slotBytes, d.chunk = cfg.Machine.SlotBytes, cfg.Machine.ChunkBytes
	d.pool = make([]byte, c.Slots*int(c.SlotBytes))
	for i := range d.pool {
		d.pool[i] = poisonB
	}
	cc, err := cache.New(cache.Config{Capacity: c.Slots, DeltaLogSize: cfg.DeltaLogSize, WriteTimeout: cfg.WriteTimeout,
		Epoch: 0x5CE7A210, MaxLogBytes: machine.DefaultMetaBytes / 4})
	if err != nil {
		return err
	}
	mcfg := cfg.Machine
	mcfg.MetaBytes, mcfg.RingBytes = machine.DefaultMetaBytes, machine.DefaultRingBytes
	mcfg.PoisonSlot = func(slot uint32) {
		s := d.pool[uint64(slot)*d.slotBytes : uint64(slot+1)*d.slotBytes]
		for i := range s {
			s[i] = poisonB
		}
	}
	d.m, err = machine.New(mcfg, cc)
	d.mem, d.regions, d.nextBase = map[uint64][]byte{}, map[gpu.Handle]gpu.Region{}, baseAddr
	return err
}

// tick is the Machine's clock: a microsecond a call, so that nothing
// expires during a scenario.
func (d *pure) tick() int64 {
	d.now += int64(time.Microsecond)
	return d.now
}

func (d *pure) PID() int { return purePID }

type pureMem struct {
	b    []byte
	base uint64
}

func (m pureMem) Bytes() []byte { return m.b }
func (m pureMem) Base() uint64  { return m.base }

func (d *pure) Memory(n int) scenario.Memory {
	m := pureMem{b: make([]byte, n), base: d.nextBase}
	d.mem[m.base] = m.b
	d.nextBase += (uint64(n) + 1<<20) &^ (1<<20 - 1) // a gap after each
	return m
}

func (d *pure) Pool() (scenario.Pool, error) {
	st := d.m.Cache().Stats()
	return scenario.Pool{Blocks: st.Blocks, Pending: st.PendingBlocks, Pinned: st.PinnedBlocks, Leases: st.Leases,
		Loads: st.Loads, Writers: st.Writers, Used: st.Used, Free: st.Free}, nil
}

func (d *pure) Attach(o scenario.AttachOptions) (scenario.Session, error) {
	req := &schema.AttachRequest{Version: schema.Version, Role: o.Role, Rank: uint32(o.Rank), WorldSize: uint32(o.WorldSize),
		DigestWidth: uint8(o.DigestWidth), Instance: o.Instance, Model: o.Model, Layout: o.Layout, Salt: o.Salt}
	if err := req.Validate(); err != nil {
		return nil, err
	}
	// What the sidecar charges and grants for rings of RingCapacity
	// (sidecar/attach.go).
	const c = scenario.RingCapacity
	ringBytes := int64(2*(ring.HeaderSize+c)) + min(c, 4<<20)
	att, serr := d.m.Attach(d.tick(), machine.AttachArgs{UID: pureUID, PID: purePID, Req: req, RingBytes: ringBytes,
		MaxPayload: int(ring.DefaultMaxRecord(c)) - ring.RecordHeaderSize})
	if serr != nil {
		return nil, serr
	}
	return &pureSession{d: d, id: att.Session, width: o.DigestWidth}, nil
}

// run makes one call of the Machine and carries out everything it asks
// for (and everything those completions ask for), in the order the sidecar
// does: replies, copies, unregistrations, registrations. It returns the
// replies and whether the session asked to end.
func (d *pure) run(call func(out *machine.Output)) (replies []machine.Reply, end bool) {
	out := new(machine.Output)
	call(out)
	d.drain(out, &replies, &end)
	return replies, end
}

func (d *pure) drain(out *machine.Output, replies *[]machine.Reply, end *bool) {
	// The Output is reused by the next call: take everything out first.
	for _, r := range out.Replies {
		r.Payload = append([]byte(nil), r.Payload...)
		*replies = append(*replies, r)
	}
	*end = *end || out.End
	copies := append([]machine.Copy(nil), out.Copies...)
	unreg := append([]gpu.Handle(nil), out.Unregister...)
	regs := append([]machine.Register(nil), out.Registers...)
	for _, c := range copies {
		res := d.copy(c)
		o := new(machine.Output)
		d.m.CopyDone(d.tick(), c.ID, res, o)
		d.drain(o, replies, end)
	}
	for _, h := range unreg {
		if _, ok := d.regions[h]; !ok {
			d.t.Fatalf("the machine unregistered handle %d, which is not registered", h)
		}
		delete(d.regions, h)
	}
	for _, rg := range regs {
		h, err := d.register(rg.Region)
		o := new(machine.Output)
		d.m.RegisterDone(d.tick(), rg.Session, rg.ID, h, err, o)
		d.drain(o, replies, end)
	}
}

// register is the host copy engine's Register: it validates the region.
func (d *pure) register(r gpu.Region) (gpu.Handle, error) {
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if r.Kind != gpu.HostProcess {
		return 0, fmt.Errorf("%w: host backend cannot reach %v regions", gpu.ErrUnsupported, r.Kind)
	}
	if len(r.Segments) > 0 {
		d.t.Fatalf("scenarios register no segmented regions")
	}
	if r.PID != purePID {
		d.t.Fatalf("the machine registered a region of pid %d, not the attached process", r.PID)
	}
	d.nextH++
	d.regions[d.nextH] = r
	return d.nextH, nil
}

// copy is the copy engine: every byte of every page, between the region's
// buffer and the pool. A copy outside the region, the pool or a slot is a
// bug of the Machine and fails the test.
func (d *pure) copy(c machine.Copy) machine.CopyResult {
	r, ok := d.regions[c.Region]
	if !ok {
		d.t.Fatalf("copy %d on handle %d, which is not registered", c.ID, c.Region)
	}
	buf, ok := d.mem[r.Base]
	if !ok || uint64(len(buf)) < r.Length {
		d.t.Fatalf("region at %#x (%d bytes) is no memory the scenario allocated", r.Base, r.Length)
	}
	if c.PageBytes != r.PageSize || c.PageBytes > d.slotBytes || len(c.Pages) != len(c.PoolOffsets) || len(c.Pages) == 0 {
		d.t.Fatalf("copy %d: %d pages of %d bytes, %d pool offsets, region pages of %d bytes", c.ID, len(c.Pages), c.PageBytes, len(c.PoolOffsets), r.PageSize)
	}
	if uint64(len(c.Pages))*c.PageBytes > max(d.chunk, c.PageBytes) {
		d.t.Fatalf("copy %d of %d pages of %d bytes: more than a piece (%d bytes)", c.ID, len(c.Pages), c.PageBytes, d.chunk)
	}
	slots := map[uint64]bool{}
	var n int64
	for i, p := range c.Pages {
		off := c.PoolOffsets[i]
		if p >= r.PageCount || off%d.slotBytes != 0 || off+c.PageBytes > uint64(len(d.pool)) {
			d.t.Fatalf("copy %d: page %d of %d, pool offset %d of %d", c.ID, p, r.PageCount, off, len(d.pool))
		}
		if slots[off] {
			d.t.Fatalf("copy %d names slot %d twice", c.ID, off/d.slotBytes)
		}
		slots[off] = true
		page := buf[uint64(p)*r.PageSize : uint64(p+1)*r.PageSize]
		slot := d.pool[off : off+c.PageBytes]
		switch c.Dir {
		case gpu.PoolToEngine:
			copy(page, slot)
		case gpu.EngineToPool:
			copy(slot, page)
		default:
			d.t.Fatalf("copy %d: direction %v", c.ID, c.Dir)
		}
		n += int64(c.PageBytes)
	}
	return machine.CopyResult{Bytes: n}
}

// pureSession is a client of the pure driver: it encodes requests and
// decodes replies as connector.Client does.
type pureSession struct {
	d     *pure
	id    machine.SessionID
	width int
	seq   uint64
	ended bool
}

// handle runs one request and returns its replies.
func (s *pureSession) handle(typ uint16, seq uint64, payload []byte) ([]machine.Reply, error) {
	if s.ended {
		return nil, errors.New("the session ended")
	}
	replies, end := s.d.run(func(out *machine.Output) { s.d.m.Handle(s.d.tick(), s.id, typ, seq, payload, out) })
	for _, r := range replies {
		if r.Session != s.id {
			s.d.t.Fatalf("request %s of session %d was answered to session %d", schema.TypeName(typ), s.id, r.Session)
		}
		if r.Type != schema.ReplyType(typ) {
			s.d.t.Fatalf("request %s answered with record type %#x", schema.TypeName(typ), r.Type)
		}
		if r.Seq != seq {
			s.d.t.Fatalf("request %d answered with seq %d", seq, r.Seq)
		}
		if len(r.Payload) < 4 {
			s.d.t.Fatalf("reply of %d bytes", len(r.Payload))
		}
	}
	if len(replies) > 1 {
		s.d.t.Fatalf("request %s got %d replies", schema.TypeName(typ), len(replies))
	}
	if end {
		s.ended = true
		s.d.run(func(out *machine.Output) { s.d.m.Detach(s.d.tick(), s.id, out) })
	}
	return replies, nil
}

func (s *pureSession) Call(typ uint16, payload []byte) ([]byte, error) {
	s.seq++
	replies, err := s.handle(typ, s.seq, payload)
	if err != nil {
		return nil, err
	}
	if len(replies) == 0 {
		return nil, fmt.Errorf("no reply to %s", schema.TypeName(typ))
	}
	return replies[0].Payload, nil
}

func (s *pureSession) Quiet(typ uint16, payload []byte) (schema.Status, bool, error) {
	replies, err := s.handle(typ, 0, payload)
	if err != nil || len(replies) == 0 {
		return 0, false, err
	}
	return schema.Status(binary.LittleEndian.Uint32(replies[0].Payload)), true, nil
}

func (s *pureSession) Detach() error {
	b, err := s.Call(schema.TypeDetach, nil)
	if err != nil {
		return err
	}
	var r schema.Reply
	if err := r.Decode(b); err != nil || r.Status != schema.OK || !s.ended {
		return fmt.Errorf("detach: %+v %v, ended %v", r, err, s.ended)
	}
	return nil
}

func (s *pureSession) Abandon() error {
	s.ended = true
	s.d.run(func(out *machine.Output) { s.d.m.Detach(s.d.tick(), s.id, out) })
	return nil
}

func (s *pureSession) simple(typ uint16, payload []byte) (uint64, error) {
	b, err := s.Call(typ, payload)
	if err != nil {
		return 0, err
	}
	var r schema.Reply
	if err := r.Decode(b); err != nil {
		return 0, err
	}
	return r.Value, r.Err()
}

func (s *pureSession) PutHashesFlags(batch uint64, digests []byte, flags uint32) (int, error) {
	m := schema.PutHashes{Batch: batch, Flags: flags, Digests: digests}
	n, err := s.simple(schema.TypePutHashes, m.Append(nil, s.width))
	return int(n), err
}

func (s *pureSession) DropHashes(batch uint64) error {
	_, err := s.simple(schema.TypeDropHashes, schema.IDRequest{ID: batch}.Append(nil))
	return err
}

func (s *pureSession) Lookup(v schema.View) (int, error) {
	n, err := s.simple(schema.TypeLookup, (&schema.Lookup{View: v}).Append(nil))
	return int(n), err
}

func (s *pureSession) lease(typ uint16, payload []byte) (schema.LeaseReply, error) {
	var r schema.LeaseReply
	b, err := s.Call(typ, payload)
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}

func (s *pureSession) Acquire(v schema.View, ttl time.Duration) (schema.LeaseReply, error) {
	return s.lease(schema.TypeAcquire, (&schema.Acquire{View: v, TTLms: uint32(ttl / time.Millisecond)}).Append(nil))
}

func (s *pureSession) Poll(lease uint64) (schema.LeaseReply, error) {
	return s.lease(schema.TypePoll, schema.IDRequest{ID: lease}.Append(nil))
}

func (s *pureSession) Release(lease uint64) error {
	_, err := s.simple(schema.TypeRelease, schema.IDRequest{ID: lease}.Append(nil))
	return err
}

func (s *pureSession) RegisterRegion(r schema.RegisterRegion) error {
	_, err := s.simple(schema.TypeRegisterRegion, r.Append(nil))
	return err
}

func (s *pureSession) Load(lease uint64, region, first uint32, pages []uint32) (int, error) {
	n, err := s.simple(schema.TypeLoad, (&schema.Load{Lease: lease, Region: region, First: first, Pages: pages}).Append(nil))
	return int(n), err
}

func (s *pureSession) Store(v schema.View, region uint32, pages []uint32) (schema.StoreReply, error) {
	var r schema.StoreReply
	b, err := s.Call(schema.TypeStore, (&schema.Store{View: v, Region: region, Pages: pages}).Append(nil))
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}

func (s *pureSession) Changes(epoch, seq uint64, max uint32) (schema.ChangesReply, error) {
	var r schema.ChangesReply
	b, err := s.Call(schema.TypeChanges, (&schema.Changes{Epoch: epoch, Seq: seq, Max: max}).Append(nil))
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status}
	}
	return r, nil
}

func (s *pureSession) Snapshot(from uint64, max uint32) (schema.SnapshotReply, error) {
	var r schema.SnapshotReply
	b, err := s.Call(schema.TypeSnapshot, (&schema.Snapshot{From: from, Max: max}).Append(nil))
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status}
	}
	return r, nil
}

func (s *pureSession) Ping(v uint64) error {
	got, err := s.simple(schema.TypePing, schema.IDRequest{ID: v}.Append(nil))
	if err == nil && got != v {
		err = fmt.Errorf("ping answered %d, want %d", got, v)
	}
	return err
}
