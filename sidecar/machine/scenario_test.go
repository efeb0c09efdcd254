package machine_test

import (
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/machine/machinetest"
)

// TestScenarios runs the protocol scenarios (testdata/scenarios) against
// the Machine alone, each node a machinetest.Env (the nodes of a scenario
// share one emulated tier and one emulated host memory). Sessions are
// connector.Clients whose transport hands records to the Machine. The copy
// engine is emulated: a copy moves the bytes between the in-memory pool and
// the in-memory buffers regions are registered over, so a `check` after a
// load proves that the Machine's slot bookkeeping hands back exactly what a
// store put in. The pool starts filled with poison, and freed slots are
// poisoned again: a load of a slot nobody wrote, or one freed under it,
// shows as "unknown".
func TestScenarios(t *testing.T) {
	scenario.RunAll(t, "../../testdata/scenarios", func(t *testing.T) scenario.Driver { return newPure(t) })
}

const (
	pureUID = 1000
	purePID = 4242
)

// pure is the scenario driver of the Machine alone.
type pure struct {
	t     *testing.T
	tier  *machinetest.Tier
	host  *machinetest.Host
	nodes []*pureNode
	uids  map[string]uint32 // uid names (attach uid=NAME) -> uids
}

func newPure(t *testing.T) *pure {
	return &pure{t: t, tier: machinetest.NewTier(), host: machinetest.NewHost(), uids: map[string]uint32{"": pureUID}}
}

func (d *pure) Name() string { return scenario.Pure }

func (d *pure) PID() int { return purePID }

type pureMem struct {
	b    []byte
	base uint64
}

func (m pureMem) Bytes() []byte { return m.b }
func (m pureMem) Base() uint64  { return m.base }

func (d *pure) Memory(n int) scenario.Memory {
	b, base := d.host.Alloc(n)
	return pureMem{b: b, base: base}
}

func (d *pure) TierValues() (int, error) { return d.tier.Len(), nil }

// Tick moves every node's clock on.
func (d *pure) Tick(dur time.Duration) error {
	for _, n := range d.nodes {
		n.env.Tick(dur)
	}
	return nil
}

// envConfig is the Machine, cache and tier configuration of a scenario's
// sidecar, mapped from the sidecar's configuration as sidecar.New maps it.
func envConfig(c scenario.Config) machinetest.Config {
	cfg := sidecar.Config{PoolBytes: uint64(c.Slots) * c.SlotBytes, Machine: machine.Config{SlotBytes: c.SlotBytes,
		Budget: c.Budget, ChunkBytes: c.ChunkBytes, PinShare: c.PinShare, RetainShare: c.RetainShare, PendingShare: c.PendingShare,
		SessionShare: c.SessionShare, MetaBytes: c.MetaBytes}}
	cfg.EnsureDefaults()
	mc := machinetest.Config{Machine: cfg.Machine}
	if mc.Machine.MetaBytes == 0 { // sidecar.New's, without a memory limit
		mc.Machine.MetaBytes = machine.DefaultMetaBytes
	}
	if mc.Machine.RingBytes == 0 {
		mc.Machine.RingBytes = machine.DefaultRingBytes
	}
	mc.Cache = cache.Config{Capacity: c.Slots, DeltaLogSize: cfg.DeltaLogSize, WriteTimeout: cfg.WriteTimeout,
		Epoch: 0x5CE7A210, MaxLogBytes: mc.Machine.MetaBytes / 4}
	if t := c.Tier; t != nil {
		mc.L2 = machine.L2Config{Enabled: true, WriteSlots: t.WriteSlots, EvictAhead: t.EvictAhead}
		if t.WriteOnEvict {
			mc.L2.Policy = machine.WriteOnEvict
		}
	}
	return mc
}

func (d *pure) Start(c scenario.Config) (scenario.Node, error) {
	cfg := envConfig(c)
	cfg.Tier, cfg.Host = d.tier, d.host
	return d.node(machinetest.New(d.t, cfg)), nil
}

// node makes env a node of the driver: its replies go to their sessions.
func (d *pure) node(env *machinetest.Env) *pureNode {
	n := &pureNode{d: d, env: env, sessions: map[machine.SessionID]*pureTransport{}}
	n.env.Reply = func(r machine.Reply) {
		s := n.sessions[r.Session]
		if s == nil {
			d.t.Fatalf("a reply to session %d, which this driver never attached", r.Session)
		}
		s.deliver(r)
	}
	d.nodes = append(d.nodes, n)
	return n
}

// pureNode is one sidecar: a machinetest.Env.
type pureNode struct {
	d        *pure
	env      *machinetest.Env
	sessions map[machine.SessionID]*pureTransport
}

func (n *pureNode) Attach(o scenario.AttachOptions) (scenario.Session, error) {
	req := &schema.AttachRequest{Version: schema.Version, Role: o.Role, Rank: uint32(o.Rank), WorldSize: uint32(o.WorldSize),
		DigestWidth: uint8(o.DigestWidth), Instance: o.Instance, Model: o.Model, Layout: o.Layout, Salt: o.Salt}
	if err := req.Validate(); err != nil {
		return nil, err
	}
	uid, ok := n.d.uids[o.UID]
	if !ok {
		uid = pureUID + 1000*uint32(len(n.d.uids))
		n.d.uids[o.UID] = uid
	}
	// What the sidecar charges and grants for rings of RingCapacity
	// (sidecar/attach.go).
	const c = scenario.RingCapacity
	ringBytes := int64(2*(ring.HeaderSize+c)) + min(c, 4<<20)
	maxPayload := int(ring.DefaultMaxRecord(c)) - ring.RecordHeaderSize
	att, serr := n.env.Attach(machine.AttachArgs{UID: uid, PID: purePID, Req: req, RingBytes: ringBytes, MaxPayload: maxPayload})
	if serr != nil {
		return nil, serr
	}
	t := &pureTransport{n: n, id: att.Session, maxPayload: maxPayload, asked: map[uint64]uint16{}, replies: map[uint64][]byte{}}
	n.sessions[att.Session] = t
	t.sess = &pureSession{c: connector.New(t, o.DigestWidth), t: t}
	return t.sess, nil
}

func (n *pureNode) Pool() (scenario.Pool, error) {
	st := n.env.M.Cache().Stats()
	return scenario.Pool{Blocks: st.Blocks, Pending: st.PendingBlocks, Pinned: st.PinnedBlocks, Leases: st.Leases,
		Loads: st.Loads, Writers: st.Writers, Used: st.Used, Free: st.Free}, nil
}

func (n *pureNode) Counters() (scenario.Counters, error) {
	st := n.env.M.Cache().Stats()
	mc := n.env.M.Counters()
	c := scenario.Counters{StoredSlots: st.Stored, Evictions: st.Evictions, EvictedUnwritten: st.EvictedUnmarked,
		Machine: &scenario.MachineCounters{DiscardedEndedStores: mc.DiscardedEndedStores,
			DiscardedExitedStores: mc.DiscardedExitedStores, DoomedWrites: mc.DoomedWrites}}
	if n.env.M.L2Config().Enabled {
		c.Tier = tierCounters(n.env.M.L2Counters())
	}
	return c, nil
}

func tierCounters(l machine.L2Counters) *scenario.TierCounters {
	return &scenario.TierCounters{Lookups: l.Lookups, LookupBlocks: l.LookupBlocks, LookupHits: l.LookupHitBlocks,
		LookupTimeouts: l.LookupTimeouts, Fetches: l.Fetches, FetchBlocks: l.FetchBlocks, Fetched: l.FetchedBlocks,
		FetchMisses: l.FetchMisses, FetchTimeouts: l.FetchTimeouts, FetchNoSpace: l.FetchNoSpace, Writes: l.Writes,
		WritesSkipped: l.WritesSkipped, WritesRefused: l.WritesNotTaken, WritingSlots: l.WritingSlots,
		PendingLookups: l.PendingLookups, PendingFetches: l.PendingFetches}
}

func (n *pureNode) Usage() (scenario.Usage, error) {
	u := n.env.M.Usage()
	return scenario.Usage{Sessions: u.Sessions, MetaBytes: u.MetaBytes}, nil
}

// --- ordering (scenario.NodeOrderer) ---

func (n *pureNode) HoldCopies(hold bool) { n.env.HoldCopies = hold }

func (n *pureNode) Holding() bool { return n.env.HoldCopies || n.env.HoldTier }

func (n *pureNode) copyInfo(c machine.Copy) scenario.CopyInfo {
	var s scenario.Session
	if t := n.sessions[c.Session]; t != nil {
		s = t.sess
	}
	return scenario.CopyInfo{Session: s, Store: c.Dir == gpu.EngineToPool, Pages: append([]uint32(nil), c.Pages...)}
}

func (n *pureNode) Copies() []scenario.CopyInfo {
	var out []scenario.CopyInfo
	for _, c := range n.env.Copies {
		out = append(out, n.copyInfo(c))
	}
	return out
}

func (n *pureNode) EndCopies(k int, fail bool) []scenario.CopyInfo {
	var out []scenario.CopyInfo
	for range k {
		out = append(out, n.copyInfo(n.env.Copies[0]))
		var err error
		if fail {
			err = machinetest.ErrCopy
		}
		n.env.EndCopy(0, err, false)
	}
	return out
}

func (n *pureNode) HoldTier() { n.env.HoldTier = true }

func lookupItem(lk machine.L2Lookup) scenario.TierItem {
	return scenario.TierItem{Digests: lk.Digests, Width: lk.NS.Width, World: lk.NS.World}
}

func fetchItem(f machine.L2Fetch) scenario.TierItem {
	it := scenario.TierItem{Width: f.NS.Width, World: f.NS.World}
	for _, b := range f.Blocks {
		it.Digests = append(it.Digests, b.Digest...)
	}
	return it
}

func writeItem(w machine.L2Write) scenario.TierItem {
	return scenario.TierItem{Digests: w.Digest, Width: w.NS.Width, World: len(w.PoolOffsets)}
}

func (n *pureNode) Tier() scenario.TierWork {
	var w scenario.TierWork
	for _, lk := range n.env.Lookups {
		w.Lookups = append(w.Lookups, lookupItem(lk))
	}
	for _, f := range n.env.Fetches {
		w.Fetches = append(w.Fetches, fetchItem(f))
	}
	for _, wr := range n.env.Writes {
		w.Writes = append(w.Writes, writeItem(wr))
	}
	return w
}

func (n *pureNode) DeliverLookups(k int, fail bool) []scenario.TierItem {
	var out []scenario.TierItem
	for range k {
		it := lookupItem(n.env.Lookups[0])
		it.Found, it.Failed = n.env.DeliverLookup(0, fail), fail
		out = append(out, it)
	}
	return out
}

func (n *pureNode) DeliverFetches(k int, fail func(int) bool) []scenario.TierItem {
	var out []scenario.TierItem
	for range k {
		it := fetchItem(n.env.Fetches[0])
		for _, o := range n.env.DeliverFetch(0, fail) {
			it.Outcomes = append(it.Outcomes, map[machinetest.FetchOutcome]string{
				machinetest.Fetched: "fetched", machinetest.Missing: "missing", machinetest.Spoiled: "failed"}[o])
		}
		out = append(out, it)
	}
	return out
}

func (n *pureNode) DeliverWrites(k int, fail bool) []scenario.TierItem {
	var out []scenario.TierItem
	for range k {
		it := writeItem(n.env.Writes[0])
		it.Failed = fail
		n.env.DeliverWrite(0, fail)
		out = append(out, it)
	}
	return out
}

// --- sessions ---

// pureSession is a connector.Client over a pureTransport.
type pureSession struct {
	c *connector.Client
	t *pureTransport
}

func (s *pureSession) Client() *connector.Client { return s.c }

// Detach is the Client's Close: its transport checks that the Machine
// ended the session at the Detach.
func (s *pureSession) Detach() error { return s.c.Close() }

func (s *pureSession) Abandon() error {
	s.c.Abandon()
	return nil
}

func (s *pureSession) Park(park func(seq uint64) ([]byte, error)) { s.t.park = park }

func (s *pureSession) Ended() bool { return s.t.ended }

func (s *pureSession) Arrived(seq uint64) ([]byte, bool) {
	b, ok := s.t.replies[seq]
	delete(s.t.replies, seq)
	return b, ok
}

// pureTransport is a connector.Transport that hands each record to the
// Machine (through the node's Env) and collects the replies the Machine
// gives its session: a request's reply comes at once, or later (a copy or
// the tier held), or for a quiet request only if it failed.
type pureTransport struct {
	n          *pureNode
	sess       *pureSession
	id         machine.SessionID
	maxPayload int // the most a record of the session's submission ring carries
	seq        uint64
	asked      map[uint64]uint16 // requests not answered yet: their types
	replies    map[uint64][]byte // replies not collected yet
	quietTyp   uint16            // the type of the last quiet request
	quiet      int
	last       schema.Status
	ended      bool
	park       func(seq uint64) ([]byte, error)
}

// deliver takes a reply the Machine gave the session.
func (t *pureTransport) deliver(r machine.Reply) {
	tt := t.n.d.t
	if r.Seq == 0 {
		if r.Type != schema.ReplyType(t.quietTyp) {
			tt.Fatalf("quiet request %s answered with record type %#x", schema.TypeName(t.quietTyp), r.Type)
		}
		if st := schema.Status(binary.LittleEndian.Uint32(r.Payload)); st != schema.OK {
			t.quiet++
			t.last = st
		}
		return
	}
	typ, ok := t.asked[r.Seq]
	if !ok {
		tt.Fatalf("session %d got a reply (type %#x) to request %d, which it did not send or had an answer to", t.id, r.Type, r.Seq)
	}
	if r.Type != schema.ReplyType(typ) {
		tt.Fatalf("request %s answered with record type %#x", schema.TypeName(typ), r.Type)
	}
	delete(t.asked, r.Seq)
	t.replies[r.Seq] = r.Payload
}

// check refuses what the ring transport would not send.
func (t *pureTransport) check(payload []byte) error {
	if t.ended {
		return fmt.Errorf("session %d ended", t.id)
	}
	if len(payload) > t.maxPayload {
		return fmt.Errorf("a payload of %d bytes, the ring's records carry %d: %w", len(payload), t.maxPayload, ring.ErrTooLarge)
	}
	return nil
}

func (t *pureTransport) Submit(typ uint16, payload []byte) (uint64, error) {
	if err := t.check(payload); err != nil {
		return 0, err
	}
	t.seq++
	t.asked[t.seq] = typ
	if t.n.env.Handle(t.id, typ, t.seq, payload) {
		t.ended = true
	}
	return t.seq, nil
}

func (t *pureTransport) Await(seq uint64) ([]byte, error) {
	if b, ok := t.replies[seq]; ok {
		delete(t.replies, seq)
		return b, nil
	}
	if t.park != nil {
		return t.park(seq)
	}
	return nil, fmt.Errorf("no reply to request %d (%s) of session %d", seq, schema.TypeName(t.asked[seq]), t.id)
}

func (t *pureTransport) Send(typ uint16, payload []byte) error {
	if err := t.check(payload); err != nil {
		return err
	}
	t.quietTyp = typ
	if t.n.env.Handle(t.id, typ, 0, payload) {
		t.ended = true
	}
	return nil
}

func (t *pureTransport) QuietFailures() (int, schema.Status) { return t.quiet, t.last }

func (t *pureTransport) Close() error {
	if !t.ended {
		return fmt.Errorf("session %d: the Machine did not end it at its Detach", t.id)
	}
	return nil
}

func (t *pureTransport) Abandon() {
	if !t.ended {
		t.ended = true
		t.n.env.Detach(t.id)
	}
}
