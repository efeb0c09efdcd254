package machine

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// Machine is the protocol state machine. Not safe for concurrent use: the
// caller serialises every call.
type Machine struct {
	cfg    Config
	cache  *cache.Cache
	budget *Budget
	slots  int // pool capacity

	sessions   map[SessionID]*session
	instances  map[string]*instance
	namespaces map[cache.NamespaceID]*nsRec
	nsByKey    map[cache.NamespaceKey]*nsRec
	foreign    int // namespaces in the cache that are not the Machine's (prefill)
	queries    map[uint64]*query
	copies     map[CopyID]*copyOp
	nextSess   SessionID
	nextInst   OwnerID
	nextCopy   CopyID

	total usage
	uids  map[uint32]*usage

	l2     *l2State // the shared tier (l2.go); nil: off
	reaped []uint64
	calls  uint64  // calls so far (invariants builds sample their checks by it)
	out    *Output // the Output of the call in progress (for the cache's free hook)
	st     Counters
}

// Counters are the Machine's event counts since start.
type Counters struct {
	Attaches, Detaches      uint64
	AttachRefusals          uint64
	ExpiredLeases           uint64
	QuotaRefusals           map[string]uint64 // by limit
	NamespacesReclaimed     uint64
	NamespacesRemoved       uint64
	DoomedWrites            uint64 // store copies that ended after their block was dropped
	DiscardedExitedStores   uint64 // stores discarded because their process exited during the copy
	DiscardedEndedStores    uint64 // blocks whose store copy ended after its session did (discarded)
	CopiesStarted, CopiesOK uint64
	CopiesFailed            uint64
	Described               uint64 // block descriptions added (events.go)
	EventsTooLarge          uint64 // events left out of replies they could never fit
}

// usage is what one holder (a session, a uid, everyone) holds.
type usage struct {
	meta     int64 // metadata bytes
	rings    int64 // ring and reply-queue bytes
	sessions int
}

func (u *usage) add(o usage) {
	u.meta += o.meta
	u.rings += o.rings
	u.sessions += o.sessions
}

func (u *usage) sub(o usage) {
	u.meta -= o.meta
	u.rings -= o.rings
	u.sessions -= o.sessions
}

func (u usage) zero() bool { return u == usage{} }

// Metadata costs: what each record takes in memory, rounded up from the Go
// structures (maps, slices and their headers included).
const (
	sessionMeta   = 4 << 10
	instanceMeta  = 1 << 10
	namespaceMeta = 1 << 10 // plus its change log, counted by the cache
	batchMeta     = 96      // plus cap(digests)
	queryMeta     = 256     // plus 4 bytes per pinned block
	regionMeta    = 512     // plus 24 bytes per segment
	copyMeta      = 256     // plus 12 bytes per page (index and pool offset)
)

type session struct {
	id         SessionID
	uid        uint32
	pid        int
	role       uint16
	rank       int
	inst       *instance
	owner      cache.SessionID
	maxPayload int
	regions    map[uint32]*region
	leases     int
	use        usage
	copyMeta   int64 // part of use.meta held by copies and the shared tier's lookups and fetches in flight (their ends give it back)
	// ended: the session's Detach was handled; gone: the session ended
	// (Detach). From either on, its store copies that end commit nothing:
	// its engine may reuse the pages once it saw the session end.
	ended bool
	gone  bool
}

// live reports whether s may still commit stores.
func (s *session) live() bool { return !s.gone && !s.ended }

type region struct {
	handle    gpu.Handle
	pageBytes uint64
	pages     uint32
	pending   bool   // registration in flight
	seq       uint64 // its request's seq, while pending
	meta      int64
	socket    bool // registered by a RegionDescriptors message: answered on its connection, not the ring
}

// instance is one engine instance: the sessions (scheduler and ranks) that
// attached with the same instance, model, layout and salt strings. Its
// hash batches, lease visibility and load budget are shared.
type instance struct {
	name      string
	id        OwnerID
	ns        *nsRec
	width     int
	world     int
	sessions  int
	uid       uint32 // the uid charged for the instance and its orphaned batches
	batches   map[uint64]*batch
	hashBytes int
	waiting   []*query // FIFO of queries over budget
}

type batch struct {
	d      []byte
	owner  *session // charged to; nil once that session ended (then uid and total only)
	uid    uint32
	charge int64
}

type nsRec struct {
	id        cache.NamespaceID
	key       cache.NamespaceKey
	sessions  int
	pageBytes uint64 // the block size: every region's page size (0 until the first region)
	idleSince int64
}

// query is a lease as the protocol sees it: its state and its budget.
type query struct {
	lease    uint64
	inst     *instance
	owner    *session
	state    schema.State
	blocks   int
	bytes    int64
	budgeted bool
	loading  int
	meta     int64
}

// copyOp is one chunk of a Load or Store: at most ChunkBytes, run and
// completed on its own, so that a chunk stuck on a client's page fault
// holds only its own slots (the session's other chunks can be cancelled).
type copyOp struct {
	id      CopyID
	req     *copyReq
	meta    int64
	pages   int
	load    uint64 // load: the cache's load id of this chunk's pins
	tickets []cache.Ticket
}

// copyReq is the request a chunk belongs to: its reply is sent when its
// last chunk ends.
type copyReq struct {
	sess   *session
	uid    uint32
	typ    uint16
	seq    uint64
	dir    gpu.Direction
	q      *query // load
	left   int    // chunks not yet done
	pages  int
	err    error
	exited bool
	reply  schema.StoreReply
}

// New returns a Machine over c (which it owns from now on).
func New(cfg Config, c *cache.Cache) (*Machine, error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Machine{
		cfg: cfg, cache: c, budget: NewBudget(cfg.Budget), slots: c.Capacity(),
		sessions: map[SessionID]*session{}, instances: map[string]*instance{},
		namespaces: map[cache.NamespaceID]*nsRec{}, nsByKey: map[cache.NamespaceKey]*nsRec{}, queries: map[uint64]*query{},
		copies: map[CopyID]*copyOp{}, uids: map[uint32]*usage{},
	}
	m.st.QuotaRefusals = map[string]uint64{}
	m.foreign = c.Namespaces()
	if cfg.PoisonSlot != nil {
		c.OnFree(cfg.PoisonSlot)
	}
	return m, nil
}

// Prefill stores n synthetic blocks (digests from seed, no bytes) in a
// private namespace that no engine can attach to, so that benchmarks can
// measure per-step costs against a large cache.
func (m *Machine) Prefill(n int, seed uint64) error {
	if n > m.slots {
		return fmt.Errorf("prefill: %d blocks do not fit in %d slots", n, m.slots)
	}
	ns, err := m.cache.AddNamespace(cache.NamespaceKey{Model: "\x00ringside-prefill", Layout: 1, DigestWidth: 32, WorldSize: 1})
	if err != nil {
		return err
	}
	m.foreign++
	var d [32]byte
	binary.LittleEndian.PutUint64(d[24:], seed)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(d[:8], uint64(i))
		t, st, err := m.cache.BeginStore(ns, 0, d[:], 0, 0)
		if err != nil || st != cache.Allocated {
			return fmt.Errorf("prefill block %d: %v %v", i, st, err)
		}
		if err := m.cache.CommitStore(t); err != nil {
			return err
		}
	}
	return nil
}

// Cache returns the cache the Machine owns (for read-only inspection under
// the caller's lock).
func (m *Machine) Cache() *cache.Cache { return m.cache }

// Config returns the effective configuration.
func (m *Machine) Config() Config { return m.cfg }

// --- limits ---

func share(total int64, f float64) int64 { return int64(float64(total) * f) }

func (m *Machine) uidUse(uid uint32) *usage {
	u := m.uids[uid]
	if u == nil {
		u = &usage{}
		m.uids[uid] = u
	}
	return u
}

func (m *Machine) dropUIDIfIdle(uid uint32) {
	if u := m.uids[uid]; u != nil && u.zero() {
		delete(m.uids, uid)
	}
}

// refuse counts a quota refusal and returns its error.
func (m *Machine) refuse(limit, format string, args ...any) *schema.Error {
	m.st.QuotaRefusals[limit]++
	return schema.Errorf(schema.ErrCodeTooLarge, format, args...)
}

// chargeMeta charges n metadata bytes to s (nil: to uid and the total
// only), or refuses them with status 7 naming the limit.
func (m *Machine) chargeMeta(s *session, uid uint32, n int64) *schema.Error {
	if n <= 0 {
		return nil
	}
	if err := m.metaRoom(s, uid, n); err != nil { // events.go: block descriptions count too
		return err
	}
	m.charge(s, uid, usage{meta: n})
	return nil
}

func (m *Machine) charge(s *session, uid uint32, c usage) {
	m.total.add(c)
	m.uidUse(uid).add(c)
	if s != nil && !s.gone {
		s.use.add(c)
	}
}

func (m *Machine) uncharge(s *session, uid uint32, c usage) {
	m.total.sub(c)
	if u := m.uids[uid]; u != nil {
		u.sub(c)
		m.dropUIDIfIdle(uid)
	}
	if s != nil && !s.gone {
		s.use.sub(c)
	}
}

// pinLimit is the slots one uid's leases may pin (each block once).
func (m *Machine) pinLimit() int { return max(int(share(int64(m.slots), m.cfg.PinShare)), 1) }

// retainLimit is the slots the blocks one uid retains may take, apart
// from its pins.
func (m *Machine) retainLimit() int { return max(int(share(int64(m.slots), m.cfg.RetainShare)), 1) }

func (m *Machine) pendingLimit() int { return max(int(share(int64(m.slots), m.cfg.PendingShare)), 1) }

// --- attach and detach ---

// AttachArgs is an attach request with what the caller learned of its
// peer and decided about its rings.
type AttachArgs struct {
	UID uint32
	PID int
	Req *schema.AttachRequest
	// RingBytes is the shared memory the session's rings (and its queue of
	// replies waiting for room) take.
	RingBytes int64
	// MaxPayload is the largest payload of the session's completion ring.
	MaxPayload int
}

// Attached is what an attach gives the session.
type Attached struct {
	Session   SessionID
	Namespace uint32
}

// Attach admits a session, or refuses it with the status the protocol
// gives (docs/protocol.md, section 4.2).
func (m *Machine) Attach(now int64, a AttachArgs) (Attached, *schema.Error) {
	r := a.Req
	u := m.uids[a.UID]
	var uses, urings int64
	if u != nil {
		uses, urings = int64(u.sessions), u.rings
	}
	switch {
	case m.total.sessions >= m.cfg.MaxSessions:
		m.st.AttachRefusals++
		return Attached{}, m.refuse("sessions", "%d sessions attached, the maximum (--max-sessions)", m.total.sessions)
	case uses >= max(share(int64(m.cfg.MaxSessions), m.cfg.UIDShare), 1):
		m.st.AttachRefusals++
		return Attached{}, m.refuse("sessions-uid", "uid %d holds %d sessions, its share of --max-sessions", a.UID, uses)
	case m.total.rings+a.RingBytes > m.cfg.RingBytes:
		m.st.AttachRefusals++
		return Attached{}, m.refuse("rings", "the sessions' rings would exceed %d bytes (--limits.ring-bytes)", m.cfg.RingBytes)
	case urings+a.RingBytes > share(m.cfg.RingBytes, m.cfg.UIDShare):
		m.st.AttachRefusals++
		return Attached{}, m.refuse("rings-uid", "uid %d's rings would exceed %d bytes, its share of --limits.ring-bytes", a.UID, share(m.cfg.RingBytes, m.cfg.UIDShare))
	}
	if maxWorld := max(m.slots/m.cfg.WorldDivisor, 1); int(r.WorldSize) > maxWorld {
		m.st.AttachRefusals++
		return Attached{}, m.refuse("world", "world size %d: a block of this pool may span at most %d ranks (pool slots / %d)", r.WorldSize, maxWorld, m.cfg.WorldDivisor)
	}
	name := r.Instance + "\x00" + r.Model + "\x00" + r.Layout + "\x00" + r.Salt
	in := m.instances[name]
	if in != nil && (in.width != int(r.DigestWidth) || in.world != int(r.WorldSize)) {
		m.st.AttachRefusals++
		return Attached{}, schema.Errorf(schema.ErrCodeNotPermitted, "instance %q attached before with digest width %d and world size %d", r.Instance, in.width, in.world)
	}
	meta := int64(sessionMeta)
	var ns *nsRec
	if in == nil {
		key := cache.NamespaceKey{Model: r.Model, Layout: fingerprint(r.Layout), TenantSalt: fingerprint(r.Salt),
			DigestWidth: int(r.DigestWidth), WorldSize: int(r.WorldSize)}
		var err *schema.Error
		if ns, err = m.namespace(now, key); err != nil {
			m.st.AttachRefusals++
			return Attached{}, err
		}
		meta += instanceMeta
	} else {
		ns = in.ns
	}
	if err := m.chargeMeta(nil, a.UID, meta); err != nil {
		m.st.AttachRefusals++
		m.maybeRemoveNamespace(now, ns)
		return Attached{}, err
	}
	if in == nil {
		m.nextInst++
		in = &instance{name: name, id: m.nextInst, ns: ns, width: int(r.DigestWidth), world: int(r.WorldSize),
			uid: a.UID, batches: map[uint64]*batch{}}
		m.instances[name] = in
	}
	m.nextSess++
	s := &session{id: m.nextSess, uid: a.UID, pid: a.PID, role: r.Role, rank: int(r.Rank), inst: in,
		owner: cache.SessionID(m.nextSess), maxPayload: a.MaxPayload, regions: map[uint32]*region{}}
	// The session's fixed cost (and the instance's, if new) is charged to
	// the uid and the total already; the session holds its own part.
	s.use.meta = sessionMeta
	m.charge(s, a.UID, usage{rings: a.RingBytes, sessions: 1})
	in.sessions++
	ns.sessions++
	m.sessions[s.id] = s
	m.st.Attaches++
	m.check()
	return Attached{Session: s.id, Namespace: uint32(ns.id)}, nil
}

// namespace finds or creates the namespace of key, reclaiming an idle one
// when the bound on namespaces is reached.
func (m *Machine) namespace(now int64, key cache.NamespaceKey) (*nsRec, *schema.Error) {
	if n := m.nsByKey[key]; n != nil {
		return n, nil
	}
	if len(m.namespaces) >= m.cfg.MaxNamespaces && !m.reclaimNamespace() {
		return nil, m.refuse("namespaces", "%d namespaces in use, the maximum (--limits.namespaces), none of them idle", len(m.namespaces))
	}
	if m.total.meta+namespaceMeta > m.cfg.MetaBytes {
		return nil, m.refuse("metadata", "the sidecar's metadata would exceed %d bytes (--limits.metadata-bytes)", m.cfg.MetaBytes)
	}
	id, err := m.cache.AddNamespace(key)
	if err != nil {
		return nil, schema.Errorf(schema.ErrCodeTooLarge, "namespace: %v", err)
	}
	n := &nsRec{id: id, key: key, idleSince: now}
	m.namespaces[id] = n
	m.nsByKey[key] = n
	m.total.meta += namespaceMeta
	return n, nil
}

// reclaimNamespace drops the namespace idle for longest (no session), with
// its unpinned blocks, and reports whether one went.
func (m *Machine) reclaimNamespace() bool {
	var best *nsRec
	for _, n := range m.namespaces {
		if n.sessions == 0 && (best == nil || n.idleSince < best.idleSince || n.idleSince == best.idleSince && n.id < best.id) {
			if _, pending, doomed, _ := m.cache.NamespaceUsage(n.id); pending == 0 && doomed == 0 {
				best = n
			}
		}
	}
	if best == nil {
		return false
	}
	m.cache.Clear(best.id)
	if m.removeNamespace(best) {
		m.st.NamespacesReclaimed++
		return true
	}
	return false
}

// maybeRemoveNamespace removes a namespace nobody uses and nothing is
// stored in.
func (m *Machine) maybeRemoveNamespace(now int64, n *nsRec) {
	if n.sessions > 0 {
		return
	}
	n.idleSince = now
	if blocks, pending, doomed, err := m.cache.NamespaceUsage(n.id); err == nil && blocks+pending+doomed == 0 {
		m.removeNamespace(n)
	}
}

func (m *Machine) removeNamespace(n *nsRec) bool {
	if m.cache.RemoveNamespace(n.id) != nil {
		return false
	}
	delete(m.namespaces, n.id)
	delete(m.nsByKey, n.key)
	m.total.meta -= namespaceMeta
	m.st.NamespacesRemoved++
	return true
}

// AttachFailed undoes an Attach whose rings could not be set up.
func (m *Machine) AttachFailed(now int64, id SessionID, out *Output) {
	m.Detach(now, id, out)
	m.st.Detaches--
	m.st.Attaches--
	m.st.AttachRefusals++
}

// Detach ends a session: its leases are released (loads in flight keep
// their own pins), its queries forgotten and their budget returned, its
// regions handed back for unregistering (out.Unregister), and records
// nothing else refers to (instance, namespace) freed. Its copies in flight
// run on; their results are applied in CopyDone without a reply.
func (m *Machine) Detach(now int64, id SessionID, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	s := m.sessions[id]
	if s == nil {
		return
	}
	for lid, q := range m.queries {
		if q.owner == s {
			m.dropQuery(q)
			delete(m.queries, lid)
		}
	}
	m.cache.ReleaseLeases(s.owner)
	m.cache.ForgetDescOwner(s.owner) // its descriptions stay, charged to its uid
	for _, r := range s.regions {
		if !r.pending {
			out.Unregister = append(out.Unregister, r.handle)
		}
		m.uncharge(s, s.uid, usage{meta: r.meta})
	}
	in := s.inst
	in.sessions--
	if in.sessions == 0 {
		for bid, b := range in.batches {
			m.uncharge(b.owner, b.uid, usage{meta: b.charge})
			delete(in.batches, bid)
		}
		in.hashBytes = 0
		delete(m.instances, in.name)
		m.uncharge(nil, in.uid, usage{meta: instanceMeta})
	} else {
		for _, b := range in.batches {
			if b.owner == s {
				s.use.meta -= b.charge // the batch stays, charged to its uid and the total
				b.owner = nil
			}
		}
	}
	in.ns.sessions--
	m.maybeRemoveNamespace(now, in.ns)
	left := s.use
	left.meta -= s.copyMeta // stays charged to the uid and the total until each copy ends
	m.uncharge(s, s.uid, left)
	s.gone = true
	delete(m.sessions, id)
	m.st.Detaches++
	m.check()
}

// dropQuery releases a query's lease, budget and charges.
func (m *Machine) dropQuery(q *query) {
	if q.state != schema.StateMiss {
		m.cache.Release(q.lease)
	}
	m.unbudget(q)
	m.uncharge(q.owner, q.owner.uid, usage{meta: q.meta})
	q.meta = 0
	q.owner.leases--
	q.state = schema.StateReleased
}

// Tick reclaims expired leases (their queries become misses) and
// half-written blocks whose deadline passed.
func (m *Machine) Tick(now int64, out *Output) cache.ReapResult {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	var r cache.ReapResult
	r, m.reaped = m.cache.ReapLeases(now, m.reaped[:0])
	m.cache.ReapDescs(now)
	for _, id := range m.reaped {
		if q := m.queries[id]; q != nil {
			m.unbudget(q)
			q.state = schema.StateMiss
			m.st.ExpiredLeases++
		}
	}
	m.l2Tick(now)
	m.check()
	return r
}

// unbudget gives back a query's budget (or takes it off the wait queue)
// and admits waiting queries that now fit, oldest first.
func (m *Machine) unbudget(q *query) {
	in := q.inst
	if q.budgeted {
		q.budgeted = false
		m.budget.Done(in.id, q.bytes)
	} else if q.state == schema.StateWaiting {
		for i, w := range in.waiting {
			if w == q {
				in.waiting = append(in.waiting[:i], in.waiting[i+1:]...)
				break
			}
		}
	}
	for len(in.waiting) > 0 {
		w := in.waiting[0]
		if !m.budget.Admit(in.id, w.bytes) {
			break
		}
		w.budgeted = true
		w.state = schema.StateReady
		in.waiting = in.waiting[1:]
	}
}

// fingerprint reduces a namespace string to the cache's 64-bit key part.
// Namespaces are separated by the full model string plus these 64-bit
// fingerprints; block hits always compare full digests.
func fingerprint(s string) uint64 {
	if s == "" {
		return 0
	}
	h := sha256.Sum256([]byte(s))
	return binary.LittleEndian.Uint64(h[:8])
}

// --- inspection ---

// SessionInfo describes a session for /debug/state.
type SessionInfo struct {
	ID       SessionID
	Instance string
	Role     uint16
	Rank     int
	PID      int
	UID      uint32
	Regions  int
	Leases   int
	Meta     int64
	Pins     int // slots the leases of its uid pin (distinct blocks)
	Retained int // slots of the blocks its uid retains
}

// Sessions lists the live sessions.
func (m *Machine) Sessions() []SessionInfo {
	out := make([]SessionInfo, 0, len(m.sessions))
	for _, s := range m.sessions {
		name := s.inst.name
		for i := range name {
			if name[i] == 0 {
				name = name[:i]
				break
			}
		}
		out = append(out, SessionInfo{ID: s.id, Instance: name, Role: s.role, Rank: s.rank, PID: s.pid, UID: s.uid,
			Regions: len(s.regions), Leases: s.leases, Meta: s.use.meta + m.cache.DescOwned(s.owner), Pins: m.cache.PinnedCharged(s.uid + 1),
			Retained: m.cache.RetainedCharged(s.uid + 1)})
	}
	return out
}

// Usage is what the Machine holds against its limits.
type Usage struct {
	MetaBytes, MetaLimit int64
	RingBytes, RingLimit int64
	Sessions             int
	Namespaces           int
	Queries              int
	Waiting              int
	Copies               int
	UIDs                 int
}

// Usage reports the Machine's totals.
func (m *Machine) Usage() Usage {
	w := 0
	for _, in := range m.instances {
		w += len(in.waiting)
	}
	return Usage{MetaBytes: m.total.meta + m.cache.LogBytes() + m.cache.DescBytes(), MetaLimit: m.cfg.MetaBytes, RingBytes: m.total.rings,
		RingLimit: m.cfg.RingBytes, Sessions: m.total.sessions, Namespaces: len(m.namespaces),
		Queries: len(m.queries), Waiting: w, Copies: len(m.copies), UIDs: len(m.uids)}
}

// Counters returns the event counts (the map is a copy).
func (m *Machine) Counters() Counters {
	c := m.st
	c.QuotaRefusals = make(map[string]uint64, len(m.st.QuotaRefusals))
	for k, v := range m.st.QuotaRefusals {
		c.QuotaRefusals[k] = v
	}
	return c
}

// internal wraps a failure of the cache the caller cannot act on.
func internal(err error) *schema.Error {
	return schema.Errorf(schema.ErrCodeInternal, "%v", err)
}
