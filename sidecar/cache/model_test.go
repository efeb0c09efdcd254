package cache

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"testing"
	"time"
)

// Reference model: maps and linear scans, no cleverness.

type mKey struct {
	ns NamespaceID
	d  string
}

const (
	rReserved = iota
	rWriting
	rStored
)

type mBlock struct {
	ranks    []int
	writers  []uint64 // ticket id per rank while writing
	pins     int
	recency  int64 // within its list (the LRU, or its retention priority's)
	deadline int64
	tseq     uint64 // timer creation order (tie-break)
	ret      *mRet  // its retention, if any
}

// mRet is a block's retention (Retain): the key charged for it and, within
// the key, the owner that set it.
type mRet struct {
	key      SessionID
	owner    uint64
	prio     int
	deadline int64
	tseq     uint64
}

type mLease struct {
	owner    SessionID
	keys     []mKey
	deadline int64
	tseq     uint64
}

type mTicket struct {
	key    mKey
	rank   int
	owner  SessionID
	tk     Ticket
	doomed *mDoomed // the block was reaped while this write was in flight
}

// mDoomed is a block reaped with writes in flight: its slots stay used
// until the last of them ends.
type mDoomed struct {
	world   int
	writers int
}

type model struct {
	capacity int
	world    map[NamespaceID]int
	blocks   map[mKey]*mBlock
	leases   map[uint64]*mLease
	order    []uint64 // lease ids in creation order
	tickets  map[uint64]*mTicket
	doomed   map[*mDoomed]bool
	loads    map[uint64][]mKey
	charge   map[mKey]SessionID // pending block -> charge key (its first writer's owner)
	clock    int64              // recency of the most recent block (counts up)
	low      int64              // recency of the least recent one (counts down: a block put at a list's tail)
	tseq     uint64
	wt       int64
	// retainedEvicted counts evicted blocks that had a retention.
	retainedEvicted int
	// Under PolicyMQP (and MQP2) the model does not know which unretained block the
	// policy evicts: gone holds the blocks the cache's call evicted, and
	// evictOne takes an unretained one of them while any unretained
	// block is evictable (else the exact retained victim, which must be
	// among them).
	mqp  bool
	gone map[mKey]bool
	// Under PolicyMQP2 retention is evidence for the policy, not an order
	// of its own: a retained block may be the victim too (evictOne takes
	// any evictable block the cache's call evicted).
	evidence bool
	// Under PolicyMQP2 a lookup that repeats one of its namespace's last
	// mqp2Probes (mqp2.go) is a probe and touches nothing: probes holds
	// each namespace's last lookups' fingerprints (nil: not MQP2).
	probes map[NamespaceID]*mProbes
}

type mProbes struct {
	fp [mqp2Probes]uint64
	at int
}

// probe reports whether a lookup of flat (k digests) in ns is an MQP2
// probe, recording it when it is not.
func (m *model) probe(ns NamespaceID, flat []byte, k int) bool {
	if m.probes == nil || k == 0 {
		return false
	}
	p := m.probes[ns]
	if p == nil {
		p = &mProbes{}
		m.probes[ns] = p
	}
	fp := mqp2ProbeFP(tipKey(uint16(ns), flat[len(flat)-len(flat)/k:]), k)
	for _, x := range p.fp {
		if x == fp {
			return true
		}
	}
	p.fp[p.at] = fp
	p.at = (p.at + 1) % mqp2Probes
	return false
}

const modelChargeLimit = 9 // slots of incomplete blocks one owner may hold
const modelPinLimit = 2    // slots of distinct blocks one owner's leases may pin
const modelRetainLimit = 3 // slots of the blocks one key retains, apart from its pins

// pinnedBy returns the distinct blocks the leases of owner pin, as a set,
// and their slots.
func (m *model) pinnedBy(owner SessionID) (map[mKey]bool, int) {
	set, slots := map[mKey]bool{}, 0
	for _, l := range m.leases {
		if l.owner != owner {
			continue
		}
		for _, k := range l.keys {
			if !set[k] {
				set[k] = true
				slots += m.world[k.ns]
			}
		}
	}
	return set, slots
}

// retainedBy returns the slots of the blocks key retains, whatever their
// owners: its retention charge, apart from its pins.
func (m *model) retainedBy(key SessionID) int {
	slots := 0
	for k, b := range m.blocks {
		if b.ret != nil && b.ret.key == key {
			slots += m.world[k.ns]
		}
	}
	return slots
}

// toTail puts an unpinned present block at the tail of its list.
func (m *model) toTail(b *mBlock) {
	if m.present(b) && b.pins == 0 {
		m.low--
		b.recency = m.low
	}
}

func (m *model) charged(owner SessionID) int {
	n := 0
	for k, o := range m.charge {
		if o == owner {
			n += m.world[k.ns]
		}
	}
	return n
}

func (m *model) present(b *mBlock) bool {
	for _, r := range b.ranks {
		if r != rStored {
			return false
		}
	}
	return true
}

func (m *model) used() int {
	u := 0
	for k := range m.blocks {
		u += m.world[k.ns]
	}
	for d := range m.doomed {
		u += d.world
	}
	return u
}

func (m *model) evictable() int {
	e := 0
	for k, b := range m.blocks {
		if m.present(b) && b.pins == 0 {
			e += m.world[k.ns]
		}
	}
	return e
}

func (m *model) touch(b *mBlock) {
	if m.present(b) && b.pins == 0 {
		m.clock++
		b.recency = m.clock
	}
}

// evictOne removes the least recent present unpinned block without a
// retention, else the least recent retained one of the lowest priority, and
// returns it.
func (m *model) evictOne() mKey {
	var best mKey
	var bb *mBlock
	rank := func(b *mBlock) int { // retention orders first, then recency
		if b.ret == nil {
			return -1
		}
		return b.ret.prio
	}
	var ubest mKey
	var ub *mBlock
	unretained := false
	for k, b := range m.blocks {
		if !m.present(b) || b.pins != 0 {
			continue
		}
		if m.mqp && (b.ret == nil || m.evidence) {
			// Any unretained block may go, but only one the cache chose;
			// the smallest first, so that the model frees no less than the
			// cache did before it stops.
			unretained = true
			if wk, wb := m.world[k.ns], m.world[ubest.ns]; m.gone[k] && (ub == nil || wk < wb ||
				wk == wb && (k.d < ubest.d || k.d == ubest.d && k.ns < ubest.ns)) {
				ubest, ub = k, b
			}
			continue
		}
		if bb == nil || rank(b) < rank(bb) || rank(b) == rank(bb) && b.recency < bb.recency {
			best, bb = k, b
		}
	}
	if unretained {
		best, bb = ubest, ub
		if ub == nil {
			panic(fmt.Sprintf("mqp: the cache evicted no unretained block while one was evictable (gone %v)", m.gone))
		}
	}
	if m.mqp {
		if !m.gone[best] {
			panic(fmt.Sprintf("mqp: the cache did not evict %v: unretained evictable blocks first, then the retained lists' tails (gone %v)", best, m.gone))
		}
		delete(m.gone, best)
	}
	if bb.ret != nil {
		m.retainedEvicted++
	}
	delete(m.blocks, best)
	return best
}

func (m *model) begin(k mKey, rank int, owner SessionID, now int64) (Status, []mKey) {
	w := m.world[k.ns]
	if b, ok := m.blocks[k]; ok {
		switch b.ranks[rank] {
		case rStored:
			if m.present(b) {
				m.touch(b)
			}
			return AlreadyPresent, nil
		case rWriting:
			return InFlight, nil
		}
		b.ranks[rank] = rWriting
		if d := now + m.wt; d > b.deadline {
			b.deadline = d
		}
		return Allocated, nil
	}
	if m.charged(owner)+w > modelChargeLimit {
		return OverQuota, nil
	}
	if m.capacity-m.used()+m.evictable() < w {
		return NoSpace, nil
	}
	var evicted []mKey
	for m.capacity-m.used() < w {
		evicted = append(evicted, m.evictOne())
	}
	m.tseq++
	b := &mBlock{ranks: make([]int, w), writers: make([]uint64, w), deadline: now + m.wt, tseq: m.tseq}
	b.ranks[rank] = rWriting
	m.blocks[k] = b
	m.charge[k] = owner
	return Allocated, evicted
}

func (m *model) leading(k mKey, ds []string) []mKey {
	var out []mKey
	seen := map[string]bool{}
	for _, d := range ds {
		kk := mKey{k.ns, d}
		b, ok := m.blocks[kk]
		if !ok || !m.present(b) || seen[d] {
			break
		}
		seen[d] = true
		out = append(out, kk)
	}
	return out
}

func (m *model) unpinLease(l *mLease) {
	for i := len(l.keys) - 1; i >= 0; i-- {
		b := m.blocks[l.keys[i]]
		b.pins--
		m.touch(b)
	}
}

func (m *model) dropLease(id uint64) {
	m.unpinLease(m.leases[id])
	delete(m.leases, id)
}

// endDoomed ends a write of a doomed block.
func (m *model) endDoomed(t *mTicket) {
	t.doomed.writers--
	if t.doomed.writers == 0 {
		delete(m.doomed, t.doomed)
	}
}

func (m *model) abort(tid uint64) {
	t := m.tickets[tid]
	delete(m.tickets, tid)
	if t.doomed != nil {
		m.endDoomed(t)
		return
	}
	b := m.blocks[t.key]
	b.ranks[t.rank] = rReserved
	for _, r := range b.ranks {
		if r != rReserved {
			return
		}
	}
	delete(m.blocks, t.key)
	delete(m.charge, t.key)
}

func TestModelRandomized(t *testing.T) {
	ops := 100_000
	if testing.Short() {
		ops = 30_000
	}
	for _, pol := range []Policy{PolicyLRU, PolicyMQP, PolicyMQP2} {
		for _, seed := range []uint64{1, 2} {
			t.Run(fmt.Sprintf("%v/seed%d", pol, seed), func(t *testing.T) { runModel(t, pol, seed, ops/2) })
		}
	}
}

func runModel(t *testing.T, pol Policy, seed uint64, ops int) {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	const capacity = 24
	c, err := New(Config{Capacity: capacity, DeltaLogSize: 16, WriteTimeout: 50 * time.Millisecond, Epoch: 99, Policy: pol})
	if err != nil {
		t.Fatal(err)
	}
	x := &tc{t: t, c: c}
	type nsDef struct {
		id    NamespaceID
		width int
		world int
		ds    []string
	}
	var nss []nsDef
	for i, def := range []struct{ width, world int }{{8, 1}, {8, 1}, {16, 2}, {32, 3}} {
		id := x.ns(def.width, def.world, uint64(i))
		n := nsDef{id: id, width: def.width, world: def.world}
		for j := 0; j < 12; j++ {
			n.ds = append(n.ds, string(dig(j, def.width))) // identical low bytes across namespaces
		}
		nss = append(nss, n)
	}
	m := &model{capacity: capacity, world: map[NamespaceID]int{}, blocks: map[mKey]*mBlock{},
		leases: map[uint64]*mLease{}, tickets: map[uint64]*mTicket{}, doomed: map[*mDoomed]bool{},
		loads: map[uint64][]mKey{}, charge: map[mKey]SessionID{}, wt: int64(50 * time.Millisecond),
		mqp: pol.multiQueue(), gone: map[mKey]bool{}}
	if pol == PolicyMQP2 {
		m.probes = map[NamespaceID]*mProbes{}
		m.evidence = true
	}
	for _, n := range nss {
		m.world[n.id] = n.world
	}
	// Delta consumers, one per namespace.
	type consumer struct {
		cur     Cursor
		set     map[string]bool
		resyncs int
	}
	cons := make([]*consumer, len(nss))
	for i := range cons {
		cons[i] = &consumer{set: map[string]bool{}}
	}
	var dead []Ticket
	var deadLeases []uint64
	removed, doomedSeen, pinShort := 0, 0, 0
	indexOf := func(nss []nsDef, id NamespaceID) int {
		for i, n := range nss {
			if n.id == id {
				return i
			}
		}
		return -1
	}
	now := int64(0)
	owners := []SessionID{1, 2, 3}
	var buf []Change

	for op := 0; op < ops; op++ {
		now += rng.Int64N(int64(3 * time.Millisecond))
		n := nss[rng.IntN(len(nss))]
		owner := owners[rng.IntN(len(owners))]
		query := func() ([]string, []byte) {
			start, l := rng.IntN(len(n.ds)), 1+rng.IntN(5)
			var ds []string
			var flat []byte
			for i := 0; i < l && start+i < len(n.ds); i++ {
				d := n.ds[start+i]
				if i > 0 && rng.IntN(8) == 0 { // now and then a repeated digest
					d = ds[rng.IntN(len(ds))]
				}
				ds = append(ds, d)
				flat = append(flat, d...)
			}
			return ds, flat
		}
		switch p := rng.IntN(110); {
		case p >= 106: // EndRetain
			ds, flat := query()
			rowner := uint64(rng.IntN(2))
			want := 0
			for _, d := range ds {
				if b, ok := m.blocks[mKey{n.id, d}]; ok && m.present(b) && b.ret != nil && b.ret.key == owner && b.ret.owner == rowner {
					b.ret = nil
					m.toTail(b)
					want++
				}
			}
			got, err := c.EndRetain(n.id, flat, uint32(owner), rowner)
			if err != nil || got != want {
				t.Fatalf("op %d: EndRetain = %d %v, model %d", op, got, err, want)
			}
		case p >= 100: // Retain
			ds, flat := query()
			rowner := uint64(rng.IntN(2))
			var mine []mKey
			for _, k := range m.leading(mKey{ns: n.id}, ds) {
				if r := m.blocks[k].ret; r == nil || (r.key == owner && r.owner == rowner) {
					mine = append(mine, k)
				}
			}
			slots := m.retainedBy(owner)
			wantShort := false
			for i, k := range mine {
				if m.blocks[k].ret == nil {
					if slots+n.world > modelRetainLimit {
						mine, wantShort = mine[:i], true
						break
					}
					slots += n.world
				}
			}
			ttl := time.Duration(1+rng.IntN(100)) * time.Millisecond
			prio := rng.IntN(RetainPriorities)
			got, short, err := c.Retain(n.id, flat, Charge{Key: uint32(owner), Limit: modelRetainLimit}, rowner, ttl, prio, now)
			if err != nil || got != len(mine) || short != wantShort {
				t.Fatalf("op %d: Retain = %d short %v %v, model %d short %v", op, got, short, err, len(mine), wantShort)
			}
			for _, k := range mine {
				b := m.blocks[k]
				if b.ret == nil {
					m.tseq++
					b.ret = &mRet{key: owner, owner: rowner, tseq: m.tseq}
				}
				b.ret.prio, b.ret.deadline = prio, now+int64(ttl)
			}
			for i := len(mine) - 1; i >= 0; i-- {
				m.touch(m.blocks[mine[i]])
			}
		case p < 30: // BeginStore
			d := n.ds[rng.IntN(len(n.ds))]
			rank := rng.IntN(n.world)
			k := mKey{n.id, d}
			tk, got, err := c.BeginStoreCharged(n.id, rank, []byte(d), owner, now, Charge{Key: uint32(owner), Limit: modelChargeLimit})
			if m.mqp { // what the cache evicted
				for kk, b := range m.blocks {
					if m.present(b) && b.pins == 0 && c.find(uint16(kk.ns), []byte(kk.d)) == NoSlot {
						m.gone[kk] = true
					}
				}
			}
			want, _ := m.begin(k, rank, owner, now)
			if len(m.gone) != 0 {
				t.Fatalf("op %d: the cache evicted more than it needed: %v (status %v, model %v, stats %+v)", op, m.gone, got, want, c.Stats())
			}
			if err != nil || got != want {
				t.Fatalf("op %d: BeginStore = %v %v, model %v", op, got, err, want)
			}
			if got == Allocated {
				m.blocks[k].writers[rank] = tk.ID
				m.tickets[tk.ID] = &mTicket{key: k, rank: rank, owner: owner, tk: tk}
			}
		case p < 48: // CommitStore
			if len(m.tickets) == 0 {
				continue
			}
			id := pickTicket(rng, m)
			mt := m.tickets[id]
			err := c.CommitStore(mt.tk)
			dead = append(dead, mt.tk)
			delete(m.tickets, id)
			if mt.doomed != nil {
				if !errors.Is(err, ErrDoomed) {
					t.Fatalf("op %d: commit of a doomed block: %v", op, err)
				}
				m.endDoomed(mt)
				break
			}
			if err != nil {
				t.Fatalf("op %d: commit: %v", op, err)
			}
			b := m.blocks[mt.key]
			b.ranks[mt.rank] = rStored
			if m.present(b) {
				delete(m.charge, mt.key)
				m.touch(b)
			}
		case p < 53: // AbortStore
			if len(m.tickets) == 0 {
				continue
			}
			id := pickTicket(rng, m)
			mt := m.tickets[id]
			if err := c.AbortStore(mt.tk); err != nil {
				t.Fatalf("op %d: abort: %v", op, err)
			}
			m.abort(id)
			dead = append(dead, mt.tk)
		case p < 55: // stale ticket
			if len(dead) == 0 {
				continue
			}
			tk := dead[rng.IntN(len(dead))]
			if err := c.CommitStore(tk); !errors.Is(err, ErrStaleTicket) {
				t.Fatalf("op %d: stale commit err %v", op, err)
			}
		case p < 70: // Lookup
			ds, flat := query()
			want := m.leading(mKey{ns: n.id}, ds)
			got, err := c.Lookup(n.id, flat)
			if err != nil || got != len(want) {
				t.Fatalf("op %d: Lookup = %d %v, model %d", op, got, err, len(want))
			}
			probe := m.probe(n.id, flat, len(ds))
			for i := len(want) - 1; i >= 0 && !probe; i-- {
				m.touch(m.blocks[want[i]])
			}
		case p < 80: // Acquire
			ds, flat := query()
			want := m.leading(mKey{ns: n.id}, ds)
			set, slots := m.pinnedBy(owner)
			wantShort := false
			for i, k := range want {
				if !set[k] {
					if slots+n.world > modelPinLimit {
						want, wantShort = want[:i], true
						break
					}
					slots += n.world
				}
			}
			ttl := time.Duration(1+rng.IntN(100)) * time.Millisecond
			rank := rng.IntN(n.world)
			l, short, err := c.AcquireCharged(n.id, rank, flat, owner, ttl, now, Charge{Key: uint32(owner), Limit: modelPinLimit})
			if err != nil || l.Blocks != len(want) || len(l.Slots) != len(want) || short != wantShort {
				t.Fatalf("op %d: Acquire = %+v short %v %v, model %d short %v", op, l, short, err, len(want), wantShort)
			}
			if short {
				pinShort++
			}
			for _, s := range l.Slots {
				if c.rank(s) != rank {
					t.Fatalf("op %d: lease slot %d has rank %d, want %d", op, s, c.rank(s), rank)
				}
			}
			if l.ID == 0 {
				continue
			}
			if _, dup := m.leases[l.ID]; dup {
				t.Fatalf("lease id %d reused", l.ID)
			}
			m.tseq++
			ml := &mLease{owner: owner, keys: want, deadline: now + int64(ttl), tseq: m.tseq}
			for _, k := range want {
				m.blocks[k].pins++
			}
			m.leases[l.ID] = ml
			m.order = append(m.order, l.ID)
		case p < 88: // Release (sometimes a dead id)
			if len(deadLeases) > 0 && rng.IntN(4) == 0 {
				id := deadLeases[rng.IntN(len(deadLeases))]
				if err := c.Release(id); !errors.Is(err, ErrUnknownLease) {
					t.Fatalf("op %d: release of dead lease: %v", op, err)
				}
				continue
			}
			if len(m.leases) == 0 {
				continue
			}
			id := pickLease(rng, m)
			if err := c.Release(id); err != nil {
				t.Fatalf("op %d: release: %v", op, err)
			}
			m.dropLease(id)
			deadLeases = append(deadLeases, id)
		case p < 90: // Renew
			if len(m.leases) == 0 {
				continue
			}
			id := pickLease(rng, m)
			ttl := time.Duration(1+rng.IntN(100)) * time.Millisecond
			if err := c.Renew(id, ttl, now); err != nil {
				t.Fatal(err)
			}
			m.leases[id].deadline = now + int64(ttl)
		case p < 92: // ReleaseOwner
			r := c.ReleaseOwner(owner)
			nl := 0
			for i := len(m.order) - 1; i >= 0; i-- { // newest first
				id := m.order[i]
				if l, ok := m.leases[id]; ok && l.owner == owner {
					m.dropLease(id)
					deadLeases = append(deadLeases, id)
					nl++
				}
			}
			nw := 0
			var ids []uint64
			for id, mt := range m.tickets {
				if mt.owner == owner {
					ids = append(ids, id)
				}
			}
			for _, id := range ids {
				dead = append(dead, m.tickets[id].tk)
				m.abort(id)
				nw++
			}
			if r.Leases != nl || r.Writes != nw {
				t.Fatalf("op %d: ReleaseOwner = %+v, model %d/%d", op, r, nl, nw)
			}
		case p < 95: // Reap
			type exp struct {
				deadline int64
				tseq     uint64
				lease    uint64
				key      mKey
				retain   bool // key's retention
			}
			var es []exp
			for id, l := range m.leases {
				if l.deadline <= now {
					es = append(es, exp{l.deadline, l.tseq, id, mKey{}, false})
				}
			}
			for k, b := range m.blocks {
				if !m.present(b) && b.deadline <= now {
					es = append(es, exp{b.deadline, b.tseq, 0, k, false})
				}
				if b.ret != nil && b.ret.deadline <= now {
					es = append(es, exp{b.ret.deadline, b.ret.tseq, 0, k, true})
				}
			}
			sort.Slice(es, func(i, j int) bool {
				return es[i].deadline < es[j].deadline || es[i].deadline == es[j].deadline && es[i].tseq < es[j].tseq
			})
			var want ReapResult
			for _, e := range es {
				if e.retain {
					b := m.blocks[e.key]
					b.ret = nil
					m.toTail(b)
					want.Retained++
					continue
				}
				if e.lease != 0 {
					m.dropLease(e.lease)
					deadLeases = append(deadLeases, e.lease)
					want.Leases++
					continue
				}
				for _, r := range m.blocks[e.key].ranks {
					if r == rWriting {
						want.Writes++
					}
				}
				var d *mDoomed
				for _, mt := range m.tickets {
					if mt.key == e.key && mt.doomed == nil {
						if d == nil {
							d = &mDoomed{world: m.world[e.key.ns]}
							m.doomed[d] = true
							doomedSeen++
						}
						d.writers++
						mt.doomed = d
					}
				}
				delete(m.blocks, e.key)
				delete(m.charge, e.key)
				want.Blocks++
			}
			if got := c.Reap(now); got != want {
				t.Fatalf("op %d: Reap = %+v, model %+v", op, got, want)
			}
		case p < 97: // BeginLoad / EndLoad
			if len(m.loads) > 0 && rng.IntN(2) == 0 {
				var id uint64
				for id = range m.loads {
					break
				}
				if err := c.EndLoad(id); err != nil {
					t.Fatalf("op %d: EndLoad: %v", op, err)
				}
				for i := len(m.loads[id]) - 1; i >= 0; i-- {
					b := m.blocks[m.loads[id][i]]
					b.pins--
					m.touch(b)
				}
				delete(m.loads, id)
				break
			}
			if len(m.leases) == 0 {
				continue
			}
			lid := pickLease(rng, m)
			ml := m.leases[lid]
			first := rng.IntN(len(ml.keys))
			cnt := rng.IntN(len(ml.keys) - first + 1)
			world := m.world[ml.keys[0].ns]
			id, slots, err := c.BeginLoad(lid, rng.IntN(world), first, cnt, nil)
			if err != nil || len(slots) != cnt {
				t.Fatalf("op %d: BeginLoad = %d %v %v", op, id, slots, err)
			}
			keys := append([]mKey(nil), ml.keys[first:first+cnt]...)
			for _, k := range keys {
				m.blocks[k].pins++
			}
			m.loads[id] = keys
		case p < 98 && rng.IntN(2) == 0: // RemoveNamespace (of an empty one), then add it back
			in := 0
			for k := range m.blocks {
				if k.ns == n.id {
					in++
				}
			}
			doomedIn := 0
			for _, mt := range m.tickets {
				if mt.doomed != nil && mt.key.ns == n.id {
					doomedIn++
				}
			}
			err := c.RemoveNamespace(n.id)
			if in > 0 || doomedIn > 0 {
				if !errors.Is(err, ErrNamespaceInUse) {
					t.Fatalf("op %d: RemoveNamespace of a namespace in use: %v", op, err)
				}
				break
			}
			if err != nil {
				t.Fatalf("op %d: RemoveNamespace: %v", op, err)
			}
			key := NamespaceKey{Model: "m", Layout: 1, TenantSalt: uint64(indexOf(nss, n.id)), DigestWidth: n.width, WorldSize: n.world}
			id, err := c.AddNamespace(key)
			if err != nil || id != n.id {
				t.Fatalf("op %d: re-adding namespace %d gave %d %v", op, n.id, id, err)
			}
			if m.probes != nil {
				delete(m.probes, id) // a namespace's MQP2 state starts afresh
			}
			removed++
		case p < 98: // Clear
			got, err := c.Clear(n.id)
			want := 0
			for k, b := range m.blocks {
				if k.ns == n.id && m.present(b) && b.pins == 0 {
					delete(m.blocks, k)
					want++
				}
			}
			if err != nil || got != want {
				t.Fatalf("op %d: Clear = %d %v, model %d", op, got, err, want)
			}
		default: // delta consumer catch-up
			i := rng.IntN(len(nss))
			cn := cons[i]
			for {
				var err error
				buf, cn.cur, err = c.ChangesSince(nss[i].id, cn.cur, 1+rng.IntN(8), buf)
				if errors.Is(err, ErrResync) {
					cn.resyncs++
					clear(cn.set)
					cn.cur, _ = c.Snapshot(nss[i].id, func(d []byte) bool { cn.set[string(d)] = true; return true })
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				if len(buf) == 0 {
					break
				}
				for _, ch := range buf {
					switch ch.Op {
					case OpStored:
						cn.set[string(ch.Digest())] = true
					case OpEvicted:
						delete(cn.set, string(ch.Digest()))
					case OpCleared:
						clear(cn.set)
					}
				}
			}
			want := 0
			for k, b := range m.blocks {
				if k.ns == nss[i].id && m.present(b) {
					want++
					if !cn.set[k.d] {
						t.Fatalf("op %d: consumer misses %x", op, k.d)
					}
				}
			}
			if len(cn.set) != want {
				t.Fatalf("op %d: consumer has %d blocks, model %d", op, len(cn.set), want)
			}
		}
		x.check()
		// Cross-check accounting with the model.
		s := c.Stats()
		present, pinned, retained := 0, 0, 0
		for _, b := range m.blocks {
			if m.present(b) {
				present++
				if b.pins > 0 {
					pinned++
				}
			}
			if b.ret != nil {
				retained++
			}
		}
		if s.RetainedBlocks != retained {
			t.Fatalf("op %d: %d retained blocks, model %d", op, s.RetainedBlocks, retained)
		}
		for owner := range owners {
			if got, want := c.PendingCharged(uint32(owners[owner])), m.charged(owners[owner]); got != want {
				t.Fatalf("op %d: owner %d charged %d slots, model %d", op, owners[owner], got, want)
			}
			if _, want := m.pinnedBy(owners[owner]); c.PinnedCharged(uint32(owners[owner])) != want {
				t.Fatalf("op %d: owner %d pins %d charged slots, model %d", op, owners[owner], c.PinnedCharged(uint32(owners[owner])), want)
			}
			if want := m.retainedBy(owners[owner]); c.RetainedCharged(uint32(owners[owner])) != want {
				t.Fatalf("op %d: owner %d retains %d charged slots, model %d", op, owners[owner], c.RetainedCharged(uint32(owners[owner])), want)
			}
		}
		if s.Used != m.used() || s.Blocks != present || s.PinnedBlocks != pinned || s.DoomedBlocks != len(m.doomed) ||
			s.Loads != len(m.loads) ||
			s.Leases != len(m.leases) || s.Writers != len(m.tickets) || s.PendingBlocks != len(m.blocks)-present {
			t.Fatalf("op %d: stats %+v; model used %d present %d pinned %d leases %d writers %d",
				op, s, m.used(), present, pinned, len(m.leases), len(m.tickets))
		}
	}
	s := c.Stats()
	t.Logf("seed %d: %+v (namespaces removed %d, blocks doomed %d)", seed, s, removed, doomedSeen)
	resyncs := 0
	for _, cn := range cons {
		resyncs += cn.resyncs
	}
	if s.Evictions == 0 || s.NoSpace == 0 || s.ExpiredLeases == 0 || s.ExpiredBlocks == 0 || s.Stores == 0 || resyncs == 0 ||
		s.OverQuota == 0 || removed == 0 || s.Aborts == 0 || doomedSeen == 0 || pinShort == 0 ||
		s.Retains == 0 || s.RetainEnds == 0 || s.ExpiredRetains == 0 || m.retainedEvicted == 0 {
		t.Fatalf("random walk did not cover enough: %+v resyncs %d namespaces removed %d doomed %d pins cut short %d retained evicted %d",
			s, resyncs, removed, doomedSeen, pinShort, m.retainedEvicted)
	}
}

func pickTicket(rng *rand.Rand, m *model) uint64 {
	ids := make([]uint64, 0, len(m.tickets))
	for id := range m.tickets {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids[rng.IntN(len(ids))]
}

func pickLease(rng *rand.Rand, m *model) uint64 {
	ids := make([]uint64, 0, len(m.leases))
	for id := range m.leases {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids[rng.IntN(len(ids))]
}
