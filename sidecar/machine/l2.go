package machine

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"slices"
	"time"

	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// The shared tier (L2): a store every node of a fleet shares (a Redis
// Cluster, sidecar/l2), under the pools. The Machine decides, the sidecar
// does the I/O:
//
//   - after a commit makes a block present, the Machine pins it and asks
//     for it to be written (out.L2Writes, write-through); or, with
//     write-on-evict, it writes the blocks at the LRU's tail ahead of their
//     eviction. A write is skipped (counted) when the writes in flight pin
//     L2Config.WriteSlots slots already: a Store never waits for the tier.
//     L2WriteDone ends the pin once the write has read its slots.
//   - a Lookup (or PutHashes with FlagLookup) whose leading run stops at a
//     local miss asks the tier for the rest (out.L2Lookups); its reply is
//     held until L2LookupDone, or until the tier's timeout passes, and then
//     counts the local run plus the leading blocks the tier holds.
//   - an Acquire whose view runs past the local leading run reserves slots
//     for the blocks after it (cache.BeginFetch, charged like a store's)
//     and asks the tier to fill them (out.L2Fetches); the lease waits
//     until L2FetchDone, or the timeout, and then holds the local run and
//     the fetched blocks that lead on from it.
//
// Every deadline is the Machine's (Tick); every copy into or out of a slot
// ends before the slot can be reused (tickets, pins).

// L2Policy says when the Machine writes blocks to the tier.
type L2Policy uint8

const (
	// WriteThrough writes a block when it becomes present.
	WriteThrough L2Policy = iota
	// WriteOnEvict writes the blocks at the LRU's tail, ahead of their
	// eviction; an evicted block not yet written is lost to the tier
	// (counted).
	WriteOnEvict
)

func (p L2Policy) String() string {
	if p == WriteOnEvict {
		return "write-on-evict"
	}
	return "write-through"
}

// L2Config configures the Machine's side of the shared tier. Zero fields
// take their defaults (EnsureDefaults; WriteSlots and EvictAhead when
// EnableL2 knows the pool's size); Validate reports every bad field.
type L2Config struct {
	// Enabled is set by EnableL2: L2Config reports the tier off without it.
	Enabled bool
	Policy  L2Policy
	// Timeout bounds a lookup, FetchTimeout a fetch: one not answered by
	// then is a miss of the tier (its slots stay reserved until it ends).
	// Defaults DefaultL2Timeout and DefaultL2FetchTimeout; the sidecar
	// derives them from its client's own deadlines.
	Timeout, FetchTimeout time.Duration
	// WriteSlots bounds the pool slots that writes queued or in flight pin
	// (each write pins its block's every rank); past it, writes are
	// skipped. Default: a sixteenth of the pool.
	WriteSlots int
	// EvictAhead is, with WriteOnEvict, how many blocks at the LRU's tail
	// are kept written. Default: WriteSlots.
	EvictAhead int
	// MaxLookupBlocks bounds the blocks one lookup asks the tier about, and
	// MaxFetchBlocks those one acquire fetches (DefaultL2MaxBlocks each).
	MaxLookupBlocks int
	MaxFetchBlocks  int
}

// Defaults of L2Config.
const (
	DefaultL2Timeout      = 150 * time.Millisecond
	DefaultL2FetchTimeout = 2 * time.Second
	DefaultL2MaxBlocks    = 4096
)

// EnsureDefaults fills the zero fields whose default does not depend on
// the pool's size.
func (c *L2Config) EnsureDefaults() {
	orDefault(&c.Timeout, DefaultL2Timeout)
	orDefault(&c.FetchTimeout, DefaultL2FetchTimeout)
	orDefault(&c.MaxLookupBlocks, DefaultL2MaxBlocks)
	orDefault(&c.MaxFetchBlocks, DefaultL2MaxBlocks)
}

// ensureSlots fills WriteSlots and EvictAhead for a pool of slots.
func (c *L2Config) ensureSlots(slots int) {
	orDefault(&c.WriteSlots, max(slots/16, 1))
	orDefault(&c.EvictAhead, c.WriteSlots)
}

// Validate reports every bad field, each as a *FieldError.
func (c *L2Config) Validate() error {
	var p problems
	if c.Policy != WriteThrough && c.Policy != WriteOnEvict {
		p.add("Policy", "%d is no policy", c.Policy)
	}
	if c.Timeout < 0 {
		p.add("Timeout", "%v must not be negative", c.Timeout)
	}
	if c.FetchTimeout < 0 {
		p.add("FetchTimeout", "%v must not be negative", c.FetchTimeout)
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"WriteSlots", c.WriteSlots}, {"EvictAhead", c.EvictAhead}, {"MaxLookupBlocks", c.MaxLookupBlocks}, {"MaxFetchBlocks", c.MaxFetchBlocks}} {
		if f.v < 0 {
			p.add(f.name, "%d must not be negative", f.v)
		}
	}
	return errors.Join(p...)
}

// L2Namespace names a namespace in the tier: what its keys and its values'
// headers carry. FP is a fingerprint of the whole namespace key (model,
// layout, tenant salt, digest width, world size), so two tenants never
// share a key.
type L2Namespace struct {
	FP     [16]byte
	Layout uint64 // the layout string's fingerprint
	Width  int
	World  int
}

// L2Lookup asks which leading blocks of Digests (flat, Width bytes each)
// the tier holds, every rank of each; it must end in L2LookupDone.
type L2Lookup struct {
	ID      uint64
	NS      L2Namespace
	Digests []byte
}

// L2Fetch asks for blocks to be read from the tier into pool slots; it
// must end in L2FetchDone, after the last byte is in the pool (or never
// will be).
type L2Fetch struct {
	ID uint64
	NS L2Namespace
	// Length is every value's payload size (the namespace's block size);
	// 0: not known yet, any size up to MaxLength.
	Length, MaxLength uint64
	Blocks            []L2FetchBlock
}

// L2FetchBlock is one block of a fetch: rank r's value goes to the pool at
// PoolOffsets[r].
type L2FetchBlock struct {
	Digest      []byte
	PoolOffsets []uint64
}

// L2FetchResult is how one block of a fetch ended: OK when every rank's
// value was found, valid and copied, with Length payload bytes each.
type L2FetchResult struct {
	OK     bool
	Length uint64
}

// L2Write asks for a present block's every rank to be written to the
// tier, Length bytes from the pool at each of PoolOffsets (rank order); it
// must end in L2WriteDone once the write has read the pool (or was
// skipped): the slots are pinned until then.
type L2Write struct {
	ID          uint64
	NS          L2Namespace
	Digest      []byte
	Length      uint64
	PoolOffsets []uint64
}

// L2Counters are the Machine's counts of the tier's traffic.
type L2Counters struct {
	Lookups         uint64 // lookups that asked the tier
	LookupBlocks    uint64 // blocks they asked about
	LookupHitBlocks uint64 // leading blocks the tier held
	LookupTimeouts  uint64 // lookups answered without the tier (its timeout passed)
	Fetches         uint64 // acquires that fetched
	FetchBlocks     uint64 // blocks they reserved slots for
	FetchedBlocks   uint64 // blocks fetched and committed
	FetchMisses     uint64 // blocks the tier did not give (absent, invalid, failed)
	FetchTimeouts   uint64 // acquires resolved before their fetch ended
	FetchNoSpace    uint64 // blocks no slot could be reserved for (pool or quota)
	Writes          uint64 // blocks handed to the tier for writing
	WritesSkipped   uint64 // blocks not written: the write queue was full
	WritesNotTaken  uint64 // writes the tier refused at once (its queue full, or down)
	WritingSlots    int    // slots writes pin now
	PendingLookups  int
	PendingFetches  int
}

type l2State struct {
	cfg      L2Config
	nextID   uint64
	lookups  map[uint64]*l2Lookup
	fetches  map[uint64]*l2Fetch
	byLease  map[uint64]*l2Fetch   // unresolved fetches by lease id
	filling  map[string]*l2Fetch   // blocks being fetched, by fillKey, and whose fetch fills them
	stored   map[string]*storeWait // blocks an engine is storing that fetches wait for, by fillKey
	writes   map[uint64]*l2Write
	pinned   int // slots writes pin
	st       L2Counters
	scratch  []uint32
	evictBuf []l2Candidate
}

type l2Lookup struct {
	sess     *session
	typ      uint16
	seq      uint64
	local    int
	meta     int64
	deadline int64
}

// l2Fetch is an acquire's wait for the tier: its own fetch (the blocks it
// reserved slots for), and the fetches of other acquires that fill blocks
// it leads on to (deps). It resolves when both are done, or at its
// deadline, and is forgotten once resolved with its own fetch ended.
type l2Fetch struct {
	id       uint64
	sess     *session
	uid      uint32
	q        *query
	ns       *nsRec
	view     []byte // the view's digests after the lease's local blocks
	blocks   [][]cache.Ticket
	keys     []string // the blocks this fetch fills, in filling
	own      bool     // its own fetch is in flight (an L2Fetch asked for)
	deps     int      // fetches of others it waits for
	waiters  []*l2Fetch
	promised int
	meta     int64
	deadline int64
	resolved bool
}

// storeWait is a block an engine is storing (its store in flight) that
// acquires lead on to: they wait until it is present or gone, or for
// their deadline.
type storeWait struct {
	ns      cache.NamespaceID
	digest  []byte
	waiters []*l2Fetch
}

type l2Write struct {
	pin   uint64
	slots int
}

type l2Candidate struct {
	ns     cache.NamespaceID
	digest [cache.MaxDigestLen]byte
	width  int
}

const (
	l2LookupMeta = 192
	l2FetchMeta  = 256
)

// EnableL2 turns the shared tier on (before any session attaches).
func (m *Machine) EnableL2(c L2Config) {
	c.Enabled = true
	c.EnsureDefaults()
	c.ensureSlots(m.slots)
	m.l2 = &l2State{cfg: c, lookups: map[uint64]*l2Lookup{}, fetches: map[uint64]*l2Fetch{}, byLease: map[uint64]*l2Fetch{}, filling: map[string]*l2Fetch{}, stored: map[string]*storeWait{}, writes: map[uint64]*l2Write{}}
}

// L2Config returns the tier's configuration (Enabled false: off).
func (m *Machine) L2Config() L2Config {
	if m.l2 == nil {
		return L2Config{}
	}
	return m.l2.cfg
}

// L2Counters returns the tier's counts.
func (m *Machine) L2Counters() L2Counters {
	if m.l2 == nil {
		return L2Counters{}
	}
	c := m.l2.st
	c.WritingSlots, c.PendingLookups, c.PendingFetches = m.l2.pinned, len(m.l2.lookups), len(m.l2.fetches)
	return c
}

func (m *Machine) l2NS(n *nsRec) L2Namespace { return l2Namespace(n.key) }

// L2NamespaceFor is the tier's name of the namespace an attach with these
// strings joins (for tools and tests that look at the tier directly).
func L2NamespaceFor(model, layout, salt string, width, world int) L2Namespace {
	return l2Namespace(cache.NamespaceKey{Model: model, Layout: fingerprint(layout), TenantSalt: fingerprint(salt), DigestWidth: width, WorldSize: world})
}

func l2Namespace(k cache.NamespaceKey) L2Namespace {
	h := sha256.New()
	var b [8]byte
	h.Write([]byte("ringside-l2\x00"))
	h.Write([]byte(k.Model))
	for _, v := range []uint64{k.Layout, k.TenantSalt, uint64(k.DigestWidth), uint64(k.WorldSize)} {
		binary.LittleEndian.PutUint64(b[:], v)
		h.Write(b[:])
	}
	var ns L2Namespace
	copy(ns.FP[:], h.Sum(nil))
	ns.Layout, ns.Width, ns.World = k.Layout, k.DigestWidth, k.WorldSize
	return ns
}

// l2Reply reports whether a lookup reply (hits leading blocks of digests)
// is held for the tier, which is then asked about the rest.
func (h *handler) l2Lookup(digests []byte, hits int) bool {
	m, s := h.m, h.s
	t := m.l2
	w := s.inst.width
	n := len(digests) / w
	if t == nil || h.seq == 0 || hits >= n {
		return false
	}
	rest := digests[hits*w : min(n, hits+t.cfg.MaxLookupBlocks)*w]
	meta := int64(l2LookupMeta + len(rest))
	if m.chargeMeta(s, s.uid, meta) != nil {
		return false // no room for the record: the local answer it is
	}
	s.copyMeta += meta
	t.nextID++
	t.lookups[t.nextID] = &l2Lookup{sess: s, typ: h.typ, seq: h.seq, local: hits, meta: meta,
		deadline: h.now + int64(t.cfg.Timeout)}
	t.st.Lookups++
	t.st.LookupBlocks += uint64(len(rest) / w)
	h.out.L2Lookups = append(h.out.L2Lookups, L2Lookup{ID: t.nextID, NS: m.l2NS(s.inst.ns), Digests: append([]byte(nil), rest...)})
	return true
}

// L2LookupDone answers a lookup held for the tier: found is the number of
// leading blocks of its L2Lookup.Digests the tier holds (every rank).
func (m *Machine) L2LookupDone(now int64, id uint64, found int, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	if m.l2 == nil {
		return
	}
	if lk := m.l2.lookups[id]; lk != nil {
		m.l2.st.LookupHitBlocks += uint64(max(found, 0))
		m.endLookup(id, lk, max(found, 0))
	}
	m.check()
}

func (m *Machine) endLookup(id uint64, lk *l2Lookup, found int) {
	delete(m.l2.lookups, id)
	s := lk.sess
	m.uncharge(s, s.uid, usage{meta: lk.meta})
	if !s.gone {
		s.copyMeta -= lk.meta
		r := schema.Reply{Value: uint64(lk.local + found)}
		m.out.reply(s.id, lk.typ, lk.seq, r.Append)
	}
}

// fillKey names a block of a namespace in l2State.filling.
func fillKey(ns cache.NamespaceID, d []byte) string {
	return string([]byte{byte(ns), byte(ns >> 8)}) + string(d)
}

// l2Acquire pins the local leading blocks of digests under a lease, as
// AcquireCharged does, and, with the tier on, reserves slots for the
// blocks after them and asks the tier for those; blocks another acquire's
// fetch is filling are waited for instead. A non-nil fetch means the
// lease waits (the caller sets fetch.q); promised is how many blocks the
// lease may then hold.
func (h *handler) l2Acquire(digests []byte, ttl time.Duration) (l cache.Lease, short bool, fetch *l2Fetch, promised int, err error) {
	m, s, in := h.m, h.s, h.s.inst
	ch := cache.Charge{Key: s.uid + 1, Limit: m.pinLimit()}
	t := m.l2
	if t == nil {
		l, short, err = m.cache.AcquireCharged(in.ns.id, s.rank, digests, s.owner, ttl, h.now, ch)
		return l, short, nil, l.Blocks, err
	}
	l, short, err = m.cache.AcquireOpen(in.ns.id, s.rank, digests, s.owner, ttl, h.now, ch)
	if err != nil {
		return l, short, nil, 0, err
	}
	w := in.width
	n := len(digests) / w
	if short || l.Blocks >= n {
		return m.closeEmpty(l), short, nil, l.Blocks, nil
	}
	// What the tier may add: no more than the uid may still pin.
	room := (m.pinLimit() - m.cache.PinnedCharged(s.uid+1)) / in.world
	limit := min(n-l.Blocks, t.cfg.MaxFetchBlocks, max(room, 0))
	f := &l2Fetch{sess: s, uid: s.uid, ns: in.ns}
	// The slots a fetch reserves stay reserved until the tier answers,
	// whatever the world size: charged to the uid's pending share, so that
	// no uid's acquires can reserve the pool away from the others' stores.
	pend := cache.Charge{Key: s.uid + 1, Limit: m.pendingLimit()}
	view := digests[l.Blocks*w:]
	var req L2Fetch
	var offsets []uint64
	var deps []*l2Fetch
	var stores []string // fillKeys of blocks engines are storing, waited for
	// What is waited for already (sets: a view of 4096 blocks may name as
	// many stores or fetches, or repeat digests).
	var seenStore map[string]bool
	var seenDep map[*l2Fetch]bool
	covered := 0 // blocks of view up to the last one fetched, waited for or present
scan:
	for i := 0; i < limit; i++ {
		d := view[i*w : (i+1)*w]
		ts, st, err := m.cache.BeginFetch(in.ns.id, d, s.owner, h.now, pend)
		switch {
		case err != nil:
			break scan
		case st == cache.AlreadyPresent:
			covered = i + 1
			continue
		case st == cache.InFlight:
			// Another acquire's fetch fills it, or an engine stores it (a
			// request of the same prefix that missed it): wait for either
			// to end, the fetch's deadline at most (a store may never
			// come).
			k := fillKey(in.ns.id, d)
			if dep := t.filling[k]; dep != nil {
				if seenDep == nil {
					seenDep = map[*l2Fetch]bool{}
				}
				if !seenDep[dep] {
					seenDep[dep] = true
					deps = append(deps, dep)
				}
			} else {
				if seenStore == nil {
					seenStore = map[string]bool{}
				}
				if !seenStore[k] {
					seenStore[k] = true
					stores = append(stores, k)
				}
			}
			covered = i + 1
			continue
		case st != cache.Allocated:
			if st == cache.NoSpace || st == cache.OverQuota {
				t.st.FetchNoSpace++
			}
			break scan
		}
		f.blocks = append(f.blocks, ts)
		for _, tk := range ts {
			offsets = append(offsets, uint64(tk.Slot)*m.cfg.SlotBytes)
		}
		req.Blocks = append(req.Blocks, L2FetchBlock{Digest: append([]byte(nil), d...), PoolOffsets: offsets[len(offsets)-len(ts):]})
		covered = i + 1
	}
	if len(f.blocks) == 0 && len(deps) == 0 && len(stores) == 0 {
		// Nothing to wait for: whatever is present after the local run
		// joins the lease now.
		if covered > 0 {
			extra, _, _ := m.cache.ExtendLease(l.ID, in.ns.id, view[:covered*w], m.pinLimit())
			l.Blocks += extra
		}
		return m.closeEmpty(l), false, nil, l.Blocks, nil
	}
	f.meta = int64(l2FetchMeta + len(f.blocks)*(w+16*in.world+32) + covered*w)
	if err := m.chargeMeta(s, s.uid, f.meta); err != nil {
		for _, ts := range f.blocks {
			for _, tk := range ts {
				m.cache.AbortStore(tk)
			}
		}
		return m.closeEmpty(l), false, nil, l.Blocks, nil
	}
	s.copyMeta += f.meta
	f.view = append([]byte(nil), view[:covered*w]...)
	f.deadline = h.now + int64(t.cfg.FetchTimeout)
	f.promised = l.Blocks + covered
	for _, dep := range deps {
		dep.waiters = append(dep.waiters, f)
		f.deps++
	}
	for _, k := range stores {
		sw := t.stored[k]
		if sw == nil {
			sw = &storeWait{ns: in.ns.id, digest: []byte(k[2:])}
			t.stored[k] = sw
		}
		sw.waiters = append(sw.waiters, f)
		f.deps++
	}
	t.nextID++
	f.id = t.nextID
	t.fetches[f.id] = f
	t.byLease[l.ID] = f
	if len(f.blocks) > 0 {
		f.own = true
		for _, b := range req.Blocks {
			k := fillKey(in.ns.id, b.Digest)
			t.filling[k] = f
			f.keys = append(f.keys, k)
		}
		req.ID, req.NS = f.id, m.l2NS(in.ns)
		req.Length, req.MaxLength = in.ns.pageBytes, m.cfg.SlotBytes
		t.st.Fetches++
		t.st.FetchBlocks += uint64(len(f.blocks))
		h.out.L2Fetches = append(h.out.L2Fetches, req)
	}
	return l, false, f, f.promised, nil
}

// l2Blocks is what a LeaseReply says of q's blocks: while it waits for a
// fetch, the blocks it will hold if the fetch brings them all.
func (m *Machine) l2Blocks(q *query) int {
	if m.l2 != nil {
		if f := m.l2.byLease[q.lease]; f != nil && f.q == q && !f.resolved {
			return f.promised
		}
	}
	return q.blocks
}

// closeEmpty turns an open lease that holds nothing into no lease (ID 0),
// as AcquireCharged answers when nothing is present.
func (m *Machine) closeEmpty(l cache.Lease) cache.Lease {
	if l.ID != 0 && l.Blocks == 0 {
		m.cache.Release(l.ID)
		return cache.Lease{}
	}
	return l
}

// L2FetchDone ends a fetch: res[i] says how block i of its L2Fetch ended.
// Every block fetched is committed (and present: it serves every later
// lookup); the lease, unless it was resolved already or still waits for
// others' fetches, then holds the leading blocks and is admitted against
// the budget. So are the leases that waited for this fetch.
func (m *Machine) L2FetchDone(now int64, id uint64, res []L2FetchResult, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	if m.l2 == nil {
		return
	}
	f := m.l2.fetches[id]
	if f == nil || !f.own {
		return
	}
	f.own = false
	for _, k := range f.keys {
		if m.l2.filling[k] == f {
			delete(m.l2.filling, k)
		}
	}
	f.keys = nil
	ns := f.ns
	for i, ts := range f.blocks {
		ok := i < len(res) && res[i].OK && res[i].Length > 0 && res[i].Length <= m.cfg.SlotBytes &&
			(ns.pageBytes == 0 || res[i].Length == ns.pageBytes) && m.namespaces[ns.id] == ns
		if ok && ns.pageBytes == 0 {
			ns.pageBytes = res[i].Length // the block size, as a first Store would fix it
		}
		for _, tk := range ts {
			if !ok {
				m.cache.AbortStore(tk)
				continue
			}
			if m.cache.CommitStore(tk) != nil {
				ok = false
			}
		}
		if ok {
			var d []byte
			if _, d, ok = m.cache.SlotBlock(ts[0].Slot); ok {
				m.cache.Mark(ns.id, d) // the tier holds it: never written back
				m.l2.st.FetchedBlocks++
			}
		}
		if !ok {
			m.l2.st.FetchMisses++
		}
	}
	f.blocks = nil
	m.wake(f.waiters)
	f.waiters = nil
	if f.deps == 0 && !f.resolved {
		m.resolveFetch(f)
	}
	m.forgetFetch(f)
	m.check()
}

// wake ends one wait of each fetch in ws (a fetch or a store it waited
// for ended); a fetch with none left, and no fetch of its own in flight,
// resolves.
func (m *Machine) wake(ws []*l2Fetch) {
	for _, w := range ws {
		if w.deps--; w.deps == 0 && !w.own && !w.resolved {
			m.resolveFetch(w)
		}
	}
}

// l2StoresEnded, on every tick, wakes the fetches waiting for blocks
// whose store has ended otherwise than by a commit (aborted or reaped:
// absent; l2Committed wakes those a commit ends) and forgets the waits of
// fetches resolved meanwhile (at their deadline): a block that stays
// pending keeps no resolved fetch.
func (m *Machine) l2StoresEnded() {
	t := m.l2
	if len(t.stored) == 0 {
		return
	}
	for k, sw := range t.stored {
		sw.waiters = slices.DeleteFunc(sw.waiters, func(w *l2Fetch) bool { return w.resolved })
		if len(sw.waiters) == 0 {
			delete(t.stored, k)
			continue
		}
		if m.cache.State(sw.ns, sw.digest) != cache.Pending {
			delete(t.stored, k)
			m.wake(sw.waiters)
		}
	}
}

// forgetFetch drops a fetch record that is resolved and whose own fetch
// has ended, with its charge.
func (m *Machine) forgetFetch(f *l2Fetch) {
	if f.own || !f.resolved || m.l2.fetches[f.id] != f {
		return
	}
	delete(m.l2.fetches, f.id)
	m.uncharge(f.sess, f.uid, usage{meta: f.meta})
	if !f.sess.gone {
		f.sess.copyMeta -= f.meta
	}
}

// resolveFetch ends the wait of a fetch's lease: it takes the present
// blocks that lead on from its local run, and is admitted (or a miss).
func (m *Machine) resolveFetch(f *l2Fetch) {
	f.resolved = true
	defer m.forgetFetch(f)
	q := f.q
	if q != nil && m.l2.byLease[q.lease] == f {
		delete(m.l2.byLease, q.lease)
	}
	if q == nil || m.queries[q.lease] != q || q.state != schema.StateWaiting {
		return // released, expired, or its session ended
	}
	in := q.inst
	added, short, _ := m.cache.ExtendLease(q.lease, in.ns.id, f.view, m.pinLimit())
	if short {
		m.st.QuotaRefusals["pins"]++
	}
	q.blocks += added
	if q.blocks == 0 {
		m.cache.Release(q.lease)
		q.state = schema.StateMiss
		return
	}
	q.bytes = m.leaseBytes(in, q.blocks)
	if len(in.waiting) == 0 && m.budget.Admit(in.id, q.bytes) {
		q.budgeted, q.state = true, schema.StateReady
	} else {
		in.waiting = append(in.waiting, q)
	}
}

// l2Committed follows a store's commit of one rank's slot: once the block
// is present, the acquires that wait for it are woken and, with
// write-through, it is written to the tier.
func (m *Machine) l2Committed(slot uint32) {
	t := m.l2
	if t == nil {
		return
	}
	ns, d, ok := m.cache.SlotBlock(slot)
	if !ok {
		return // not present yet: other ranks still to come
	}
	if len(t.stored) > 0 {
		k := fillKey(ns, d)
		if sw := t.stored[k]; sw != nil {
			delete(t.stored, k)
			m.wake(sw.waiters)
		}
	}
	if t.cfg.Policy == WriteThrough {
		m.l2Write(ns, d, false)
	}
}

// l2Write pins a present block and asks for it to be written; toTail: its
// pin's end leaves it at the LRU's tail (a write ahead of eviction).
func (m *Machine) l2Write(id cache.NamespaceID, d []byte, toTail bool) bool {
	t := m.l2
	n := m.namespaces[id]
	if n == nil || n.pageBytes == 0 {
		return false
	}
	w := n.key.WorldSize
	if t.pinned+w > t.cfg.WriteSlots {
		t.st.WritesSkipped++
		return false
	}
	pin, slots, ok := m.cache.PinBlock(id, d, toTail, t.scratch[:0])
	t.scratch = slots[:0]
	if !ok {
		return false
	}
	m.cache.Mark(id, d)
	offsets := make([]uint64, len(slots))
	for i, sl := range slots {
		offsets[i] = uint64(sl) * m.cfg.SlotBytes
	}
	t.nextID++
	t.writes[t.nextID] = &l2Write{pin: pin, slots: len(slots)}
	t.pinned += len(slots)
	t.st.Writes++
	m.out.L2Writes = append(m.out.L2Writes, L2Write{ID: t.nextID, NS: m.l2NS(n), Digest: append([]byte(nil), d...),
		Length: n.pageBytes, PoolOffsets: offsets})
	return true
}

// L2WriteDone ends a write's pin: it has read the pool, or was not taken
// (refused: the tier's queue was full or the tier is down).
func (m *Machine) L2WriteDone(now int64, id uint64, refused bool, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	if m.l2 == nil {
		return
	}
	wr := m.l2.writes[id]
	if wr == nil {
		return
	}
	delete(m.l2.writes, id)
	m.l2.pinned -= wr.slots
	if refused {
		m.l2.st.WritesNotTaken++
	}
	m.cache.EndLoad(wr.pin)
	m.check()
}

// l2Tick resolves lookups and fetches past their deadline and, with
// write-on-evict, writes the LRU's tail ahead.
func (m *Machine) l2Tick(now int64) {
	t := m.l2
	if t == nil {
		return
	}
	for id, lk := range t.lookups {
		if now >= lk.deadline {
			t.st.LookupTimeouts++
			m.endLookup(id, lk, 0)
		}
	}
	for _, f := range t.fetches { // resolveFetch may delete f: allowed in a range
		if !f.resolved && now >= f.deadline {
			t.st.FetchTimeouts++
			m.resolveFetch(f)
		}
	}
	m.l2StoresEnded()
	m.l2EvictAhead()
}

// l2EvictAhead writes the unwritten blocks among the EvictAhead least
// recently used, while the write bound lets it.
func (m *Machine) l2EvictAhead() {
	t := m.l2
	if t == nil || t.cfg.Policy != WriteOnEvict || t.pinned >= t.cfg.WriteSlots {
		return
	}
	c := t.evictBuf[:0]
	m.cache.LRUTail(t.cfg.EvictAhead, func(ns cache.NamespaceID, d []byte, marked bool) bool {
		if !marked {
			e := l2Candidate{ns: ns, width: len(d)}
			copy(e.digest[:], d)
			c = append(c, e)
		}
		return true
	})
	t.evictBuf = c[:0]
	for i := range c {
		if t.pinned >= t.cfg.WriteSlots {
			break
		}
		m.l2Write(c[i].ns, c[i].digest[:c[i].width], true)
	}
}

// l2Meta is the part of s.copyMeta that the tier's lookups and fetches
// hold (for the invariants).
func (m *Machine) l2Meta(s *session) int64 {
	if m.l2 == nil {
		return 0
	}
	var n int64
	for _, lk := range m.l2.lookups {
		if lk.sess == s {
			n += lk.meta
		}
	}
	for _, f := range m.l2.fetches {
		if f.sess == s {
			n += f.meta
		}
	}
	return n
}

// l2Charges reports the tier's charged records to the invariants' tally.
func (m *Machine) l2Charges(at func(s *session, uid uint32, c usage)) {
	if m.l2 == nil {
		return
	}
	for _, lk := range m.l2.lookups {
		at(lk.sess, lk.sess.uid, usage{meta: lk.meta})
	}
	for _, f := range m.l2.fetches {
		at(f.sess, f.uid, usage{meta: f.meta})
	}
}

// l2Invariants checks the tier's own records.
func (m *Machine) l2Invariants(bad func(format string, args ...any)) {
	if m.l2 == nil {
		return
	}
	slots := 0
	for id, wr := range m.l2.writes {
		slots += wr.slots
		if wr.pin == 0 {
			bad("l2 write %d: no pin", id)
		}
	}
	if slots != m.l2.pinned {
		bad("l2: writes pin %d slots, counted %d", slots, m.l2.pinned)
	}
	for id, f := range m.l2.fetches {
		if f.q == nil || f.id != id {
			bad("l2 fetch %d: no query, or record of %d", id, f.id)
		}
		if f.resolved && !f.own {
			bad("l2 fetch %d: resolved with its own fetch ended, yet kept", id)
		}
		if !f.resolved && m.l2.byLease[f.q.lease] != f {
			bad("l2 fetch %d: unresolved, not found by its lease %d", id, f.q.lease)
		}
		if !f.own && (len(f.keys) > 0 || len(f.blocks) > 0) {
			bad("l2 fetch %d: no fetch of its own, yet fills blocks", id)
		}
		deps := 0
		for _, g := range m.l2.fetches {
			for _, w := range g.waiters {
				if w == f {
					deps++
				}
			}
		}
		for _, sw := range m.l2.stored {
			for _, w := range sw.waiters {
				if w == f {
					deps++
				}
			}
		}
		if !f.resolved && deps != f.deps {
			bad("l2 fetch %d: waits for %d fetches and stores, %d name it", id, f.deps, deps)
		}
	}
	for k, f := range m.l2.filling {
		if m.l2.fetches[f.id] != f || !f.own || !slices.Contains(f.keys, k) {
			bad("l2: a block filled by fetch %d, which does not fill it", f.id)
		}
	}
	for lease, f := range m.l2.byLease {
		if f.resolved || f.q == nil || f.q.lease != lease {
			bad("l2: lease %d names a resolved or foreign fetch", lease)
		}
	}
}

// L2Namespaces calls fn with each namespace of the Machine (each one its
// engines attached with) and the tiers' name of it.
func (m *Machine) L2Namespaces(fn func(id cache.NamespaceID, ns L2Namespace)) {
	for id, n := range m.namespaces {
		fn(id, m.l2NS(n))
	}
}
