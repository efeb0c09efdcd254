package cache

import (
	"fmt"
	"math"
	"time"
)

// Lease pins the leading present blocks of an Acquire. ID 0 means "no
// lease" (nothing was present); Release(0) is a no-op.
type Lease struct {
	ID     uint64   // unique within the Cache, never reused
	Blocks int      // leading present blocks pinned
	Slots  []uint32 // the requesting rank's slot of each pinned block
}

type leaseRec struct {
	id         uint64
	owner      SessionID
	key        uint32 // pin charge key (AcquireCharged); 0: none
	open       bool   // made by AcquireOpen: may hold no block
	heads      []uint32
	heapIdx    int32
	prev, next int32 // owner list (next doubles as free-list link)
}

type owner struct {
	leases  int32 // head of the owner's lease list, -1 if none
	writers int32 // head of the owner's writer list, -1 if none
}

// ReapResult counts what Reap or ReleaseOwner reclaimed.
type ReapResult struct {
	Leases   int // leases released
	Writes   int // write tickets aborted or dropped
	Blocks   int // incomplete logical blocks freed (Reap only)
	Retained int // retentions ended (Reap only)
}

func addDeadline(now int64, d time.Duration) int64 {
	if d > 0 && now > math.MaxInt64-int64(d) {
		return math.MaxInt64
	}
	return now + int64(d)
}

// leading scans digests (a flat array of width-byte digests) and appends
// the heads of the leading present blocks to c.scratch. It stops at the
// first miss and at the first digest the scan has already seen: a prefix
// of chained block hashes never repeats one, and a view that repeats a
// digest must not pin (or count) the same block twice, so a lease never
// holds more blocks than the pool.
func (c *Cache) leading(ns NamespaceID, digests []byte) (*namespace, []uint32, error) {
	n, err := c.ns(ns)
	if err != nil {
		return nil, nil, err
	}
	if len(digests)%n.width != 0 {
		return nil, nil, fmt.Errorf("%w: %d bytes is not a multiple of width %d", ErrBadDigest, len(digests), n.width)
	}
	heads := c.scratch[:0]
	for off := 0; off < len(digests); off += n.width {
		h := c.find(uint16(ns), digests[off:off+n.width])
		// A head collected already carries doomedBit (below), so its
		// done no longer equals the world size: a repeat ends the scan.
		if h == NoSlot || int(c.done[h]) != n.world || c.state(h) != stStored {
			break
		}
		c.done[h] |= doomedBit
		heads = append(heads, h)
	}
	for _, h := range heads {
		c.done[h] &^= doomedBit
	}
	c.scratch = heads
	return n, heads, nil
}

// Lookup returns how many leading digests (flat, namespace width each) are
// present: stored by every rank. It stops at the first miss. The answer
// does not depend on which rank asks. Hits are touched in reverse order,
// so the first block of a prefix ends up most recently used and eviction
// takes prefix tails first.
func (c *Cache) Lookup(ns NamespaceID, digests []byte) (int, error) {
	n, heads, err := c.leading(ns, digests)
	if err != nil {
		return 0, err
	}
	if c.mqp != nil {
		// MQP's per-request step (mqp.go): Lookup is the call the
		// engine makes once per request with its full digest list.
		// Under MQP2 a repeated lookup is a probe and changes nothing.
		probe := false
		if c.mqp.r2 == nil {
			c.mqpBegin(n, ns, digests, len(heads))
		} else {
			probe = c.mqpBegin2(n, ns, digests, len(heads))
		}
		for i := len(heads) - 1; i >= 0 && !probe; i-- {
			c.mqpAccess(heads[i], c.mqp.inf[i])
		}
	} else {
		for i := len(heads) - 1; i >= 0; i-- {
			c.touch(heads[i])
		}
	}
	c.st.lookups++
	c.st.lookupBlocks += uint64(len(digests) / n.width)
	c.st.hitBlocks += uint64(len(heads))
	c.sizing.lookedUp(uint16(ns), digests, n.width)
	return len(heads), nil
}

// Acquire pins the leading present blocks of digests for owner until
// Release, ReleaseOwner or, once ttl has passed since now, Reap. Slots are
// rank's shard slots. Pinned blocks are never evicted nor cleared.
func (c *Cache) Acquire(ns NamespaceID, rank int, digests []byte, owner SessionID, ttl time.Duration, now int64) (Lease, error) {
	l, _, err := c.AcquireCharged(ns, rank, digests, owner, ttl, now, Charge{})
	return l, err
}

// PinnedCharged returns the slots of distinct blocks that leases charged
// to key pin (a block pinned by several of them counts once).
func (c *Cache) PinnedCharged(key uint32) int { return c.pinByKey[key] }

// AcquireCharged is Acquire that charges the blocks its lease pins to
// ch.Key: the distinct blocks all of the key's leases pin, W slots each,
// may not exceed ch.Limit slots. The lease stops at the first block that
// would take the key past it (a shorter prefix; short reports it), so a
// key can never pin more of the pool than its limit, while many leases of
// one key over the same shared prefix cost it that prefix once.
func (c *Cache) AcquireCharged(ns NamespaceID, rank int, digests []byte, owner SessionID, ttl time.Duration, now int64, ch Charge) (l Lease, short bool, err error) {
	if ttl <= 0 {
		return Lease{}, false, fmt.Errorf("%w: %v", ErrBadTTL, ttl)
	}
	n, err := c.ns(ns)
	if err != nil {
		return Lease{}, false, err
	}
	if rank < 0 || rank >= n.world {
		return Lease{}, false, fmt.Errorf("%w: rank %d, world size %d", ErrBadRank, rank, n.world)
	}
	_, heads, err := c.leading(ns, digests)
	if err != nil {
		return Lease{}, false, err
	}
	heads, short = c.fitPins(ch.Key, ch.Limit, heads, n.world)
	if len(heads) == 0 {
		return Lease{}, short, nil
	}
	for _, h := range heads {
		if c.aux[h] > math.MaxUint32-uint32(len(heads)) {
			return Lease{}, false, fmt.Errorf("%w: slot %d", ErrTooManyPins, h)
		}
	}
	id := c.newLease(owner, ch.Key, false, heads, now, ttl)
	slots := make([]uint32, len(heads))
	for i, h := range heads {
		c.pin(h, n.world)
		slots[i] = c.member(h, rank)
	}
	if ch.Key != 0 {
		c.chargePins(ch.Key, heads, n.world)
	}
	c.st.acquires++
	c.st.acquiredBlocks += uint64(len(heads))
	return Lease{ID: id, Blocks: len(heads), Slots: slots}, short, nil
}

// newLease takes a lease record (from the free list, or a new one) for
// owner, holding heads (copied), charged to key, expiring ttl after now,
// and puts it at the head of owner's leases. It returns the lease's ID.
// The caller pins heads.
func (c *Cache) newLease(owner SessionID, key uint32, open bool, heads []uint32, now int64, ttl time.Duration) uint64 {
	var li int32
	if c.leaseFree >= 0 {
		li = c.leaseFree
		c.leaseFree = c.leases[li].next
	} else {
		c.leases = append(c.leases, leaseRec{})
		li = int32(len(c.leases) - 1)
	}
	c.nextLeaseID++
	r := &c.leases[li]
	r.id, r.owner, r.key, r.open, r.prev, r.next = c.nextLeaseID, owner, key, open, -1, -1
	r.heads = append(r.heads[:0], heads...)
	r.heapIdx = int32(c.timerPush(addDeadline(now, ttl), timerLease, uint32(li)))
	o := c.ownerGet(owner)
	if o.leases >= 0 {
		c.leases[o.leases].prev = li
		r.next = o.leases
	}
	o.leases = li
	c.leaseByID[r.id] = li
	return r.id
}

// fitPins cuts heads before the first block whose pin would take key past
// limit slots (key 0 or limit 0: no bound), a block key pins already costing
// nothing and any other world slots; short reports a cut.
func (c *Cache) fitPins(key uint32, limit int, heads []uint32, world int) (_ []uint32, short bool) {
	if key == 0 || limit <= 0 {
		return heads, false
	}
	have, room := c.pinKey[key], limit-c.pinByKey[key]
	for i, h := range heads {
		if have[h] == 0 {
			if room < world {
				return heads[:i], true
			}
			room -= world
		}
	}
	return heads, false
}

func (c *Cache) chargePins(key uint32, heads []uint32, world int) {
	m := c.pinKey[key]
	if m == nil {
		m = map[uint32]uint32{}
		c.pinKey[key] = m
	}
	for _, h := range heads {
		if m[h] == 0 {
			c.pinByKey[key] += world
		}
		m[h]++
	}
}

func (c *Cache) unchargePins(key uint32, heads []uint32) {
	m := c.pinKey[key]
	for _, h := range heads {
		if m[h]--; m[h] == 0 {
			delete(m, h)
			c.pinByKey[key] -= c.worldOf(h)
		}
	}
	if len(m) == 0 {
		delete(c.pinKey, key)
		delete(c.pinByKey, key)
	}
}

func (c *Cache) pin(h uint32, world int) {
	if c.aux[h] == 0 {
		c.unlist(h)
		c.evictable -= world
		c.pinned++
	}
	c.aux[h]++
}

func (c *Cache) unpin(h uint32) {
	c.aux[h]--
	if c.aux[h] == 0 {
		c.relist(h, false)
		c.evictable += c.worldOf(h)
		c.pinned--
	}
}

// Release releases a lease. Releasing an unknown or already released lease
// returns ErrUnknownLease; lease 0 (nothing pinned) is a no-op.
func (c *Cache) Release(id uint64) error {
	if id == 0 {
		return nil
	}
	li, ok := c.leaseByID[id]
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownLease, id)
	}
	c.timerRemove(int(c.leases[li].heapIdx))
	c.releaseLease(li)
	return nil
}

// LeaseSlots appends to dst the slots of rank's shards of the blocks that
// lease id pins, in view order. Any rank of the namespace may ask: a
// scheduler acquires, and each tensor-parallel worker loads its own shard.
func (c *Cache) LeaseSlots(id uint64, rank int, dst []uint32) ([]uint32, error) {
	li, ok := c.leaseByID[id]
	if !ok {
		return dst, fmt.Errorf("%w: %d", ErrUnknownLease, id)
	}
	l := &c.leases[li]
	if len(l.heads) > 0 {
		if w := c.worldOf(l.heads[0]); rank < 0 || rank >= w {
			return dst, fmt.Errorf("%w: rank %d, world size %d", ErrBadRank, rank, w)
		}
	}
	for _, h := range l.heads {
		dst = append(dst, c.member(h, rank))
	}
	return dst, nil
}

// LeaseBlocks returns how many blocks lease id pins.
func (c *Cache) LeaseBlocks(id uint64) (int, bool) {
	li, ok := c.leaseByID[id]
	if !ok {
		return 0, false
	}
	return len(c.leases[li].heads), true
}

// BeginLoad pins blocks [first, first+n) of lease id for a copy out of the
// pool by rank, and appends the rank's slots of those blocks to dst. The pin is the load's own:
// it holds even if the lease is released or expires while the copy runs,
// so that no slot the copy reads is freed or reused before EndLoad. The
// returned id is never reused.
func (c *Cache) BeginLoad(id uint64, rank, first, n int, dst []uint32) (uint64, []uint32, error) {
	li, ok := c.leaseByID[id]
	if !ok {
		return 0, dst, fmt.Errorf("%w: %d", ErrUnknownLease, id)
	}
	l := &c.leases[li]
	if first < 0 || n < 0 || first+n > len(l.heads) {
		return 0, dst, fmt.Errorf("cache: blocks [%d, %d) past the %d blocks of lease %d", first, first+n, len(l.heads), id)
	}
	if n > 0 {
		if w := c.worldOf(l.heads[0]); rank < 0 || rank >= w {
			return 0, dst, fmt.Errorf("%w: rank %d, world size %d", ErrBadRank, rank, w)
		}
	}
	heads := make([]uint32, n)
	copy(heads, l.heads[first:first+n])
	for _, h := range heads {
		if c.aux[h] == math.MaxUint32 {
			return 0, dst, fmt.Errorf("%w: slot %d", ErrTooManyPins, h)
		}
	}
	for _, h := range heads {
		c.pin(h, c.worldOf(h))
		dst = append(dst, c.member(h, rank))
	}
	c.nextLoad++
	c.loads[c.nextLoad] = heads
	return c.nextLoad, dst, nil
}

// EndLoad drops the pins of a load (its copy finished or was cancelled).
func (c *Cache) EndLoad(id uint64) error {
	heads, ok := c.loads[id]
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownLoad, id)
	}
	delete(c.loads, id)
	if _, tail := c.tailLoads[id]; tail {
		delete(c.tailLoads, id)
		for _, h := range heads {
			c.unpinTail(h)
		}
		return nil
	}
	for i := len(heads) - 1; i >= 0; i-- {
		c.unpin(heads[i])
	}
	return nil
}

// LeaseOwner returns the owner a lease was acquired for.
func (c *Cache) LeaseOwner(id uint64) (SessionID, bool) {
	li, ok := c.leaseByID[id]
	if !ok {
		return 0, false
	}
	return c.leases[li].owner, true
}

// Renew moves a lease's expiry to now+ttl.
func (c *Cache) Renew(id uint64, ttl time.Duration, now int64) error {
	if ttl <= 0 {
		return fmt.Errorf("%w: %v", ErrBadTTL, ttl)
	}
	li, ok := c.leaseByID[id]
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownLease, id)
	}
	i := int(c.leases[li].heapIdx)
	c.timers[i].deadline = addDeadline(now, ttl)
	c.timerFix(i)
	return nil
}

// releaseLease unpins and frees a lease record whose timer is already gone.
func (c *Cache) releaseLease(li int32) {
	l := &c.leases[li]
	if l.key != 0 {
		c.unchargePins(l.key, l.heads)
	}
	for i := len(l.heads) - 1; i >= 0; i-- {
		c.unpin(l.heads[i])
	}
	o := c.owners[l.owner]
	if l.prev >= 0 {
		c.leases[l.prev].next = l.next
	} else {
		o.leases = l.next
	}
	if l.next >= 0 {
		c.leases[l.next].prev = l.prev
	}
	c.ownerMaybeDrop(l.owner, o)
	delete(c.leaseByID, l.id)
	*l = leaseRec{heads: l.heads[:0], heapIdx: -1, prev: -1, next: c.leaseFree}
	c.leaseFree = li
}

// ReleaseOwner releases every lease of owner and aborts its writes (the
// session died). Cost is proportional to what the owner held. A caller
// whose copies may still be running must not abort their writes: see
// ReleaseLeases.
func (c *Cache) ReleaseOwner(owner SessionID) ReapResult {
	r := c.ReleaseLeases(owner)
	o, ok := c.owners[owner]
	if !ok {
		return r
	}
	for o.writers >= 0 {
		c.abortWriter(o.writers)
		r.Writes++
	}
	return r
}

// ReleaseLeases releases every lease of owner and leaves its writes alone.
func (c *Cache) ReleaseLeases(owner SessionID) ReapResult {
	var r ReapResult
	o, ok := c.owners[owner]
	if !ok {
		return r
	}
	for o.leases >= 0 {
		li := o.leases
		c.timerRemove(int(c.leases[li].heapIdx))
		c.releaseLease(li) // may delete o from the map; o stays valid
		r.Leases++
	}
	return r
}

// Reap reclaims expired leases and incomplete blocks whose write deadline
// has passed (deadline <= now). Its cost is proportional to what expired.
func (c *Cache) Reap(now int64) ReapResult {
	r, _ := c.ReapLeases(now, nil)
	return r
}

// ReapLeases is Reap that also appends the ids of the expired leases to ids,
// so the caller can resolve the queries that waited on them.
func (c *Cache) ReapLeases(now int64, ids []uint64) (ReapResult, []uint64) {
	var r ReapResult
	for len(c.timers) > 0 && c.timers[0].deadline <= now {
		t := c.timerPop()
		switch t.kind {
		case timerLease:
			ids = append(ids, c.leases[t.idx].id)
			c.releaseLease(int32(t.idx))
			c.st.reapedLeases++
			r.Leases++
		case timerGroup:
			before := c.st.reapedWrites
			c.dropPending(t.idx)
			r.Writes += int(c.st.reapedWrites - before)
			c.st.expiry++
			r.Blocks++
		case timerRetain:
			c.endRetention(t.idx)
			c.st.expiredRetain++
			r.Retained++
		}
	}
	return r, ids
}

// NextDeadline returns the earliest pending deadline, if any, so the
// caller can schedule the next Reap.
func (c *Cache) NextDeadline() (int64, bool) {
	if len(c.timers) == 0 {
		return 0, false
	}
	return c.timers[0].deadline, true
}

func (c *Cache) ownerGet(id SessionID) *owner {
	o, ok := c.owners[id]
	if !ok {
		if k := len(c.ownerPool); k > 0 {
			o = c.ownerPool[k-1]
			c.ownerPool = c.ownerPool[:k-1]
		} else {
			o = &owner{}
		}
		*o = owner{leases: -1, writers: -1}
		c.owners[id] = o
	}
	return o
}

// ownerMaybeDrop forgets an owner that holds nothing, so the owner map
// never grows with dead sessions. The struct is pooled for reuse.
func (c *Cache) ownerMaybeDrop(id SessionID, o *owner) {
	if o.leases < 0 && o.writers < 0 {
		delete(c.owners, id)
		if len(c.ownerPool) < 64 {
			c.ownerPool = append(c.ownerPool, o)
		}
	}
}

// --- deadline min-heap with back-pointers (O(log n) remove/fix) ---

const (
	timerLease uint8 = iota + 1
	timerGroup
	timerRetain
)

// timer orders by (deadline, seq): seq is the creation order, so ties
// expire deterministically, oldest first.
type timer struct {
	deadline int64
	seq      uint64
	idx      uint32 // lease record index, or pending or retained block head slot
	kind     uint8
}

func (a *timer) less(b *timer) bool {
	return a.deadline < b.deadline || a.deadline == b.deadline && a.seq < b.seq
}

func (c *Cache) timerSet(i int) {
	t := c.timers[i]
	switch t.kind {
	case timerLease:
		c.leases[t.idx].heapIdx = int32(i)
	case timerRetain:
		c.retains[t.idx].heap = int32(i)
	default:
		c.next[t.idx] = uint32(i)
	}
}

func (c *Cache) timerPush(deadline int64, kind uint8, idx uint32) int {
	c.timerSeq++
	c.timers = append(c.timers, timer{deadline: deadline, seq: c.timerSeq, idx: idx, kind: kind})
	i := c.timerUp(len(c.timers) - 1)
	return i
}

func (c *Cache) timerUp(i int) int {
	for i > 0 {
		p := (i - 1) / 2
		if !c.timers[i].less(&c.timers[p]) {
			break
		}
		c.timers[p], c.timers[i] = c.timers[i], c.timers[p]
		c.timerSet(i)
		i = p
	}
	c.timerSet(i)
	return i
}

func (c *Cache) timerDown(i int) int {
	n := len(c.timers)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && c.timers[r].less(&c.timers[l]) {
			m = r
		}
		if !c.timers[m].less(&c.timers[i]) {
			break
		}
		c.timers[i], c.timers[m] = c.timers[m], c.timers[i]
		c.timerSet(i)
		i = m
	}
	c.timerSet(i)
	return i
}

func (c *Cache) timerFix(i int) {
	if c.timerUp(i) == i {
		c.timerDown(i)
	}
}

func (c *Cache) timerRemove(i int) {
	last := len(c.timers) - 1
	if i != last {
		c.timers[i] = c.timers[last]
		c.timers = c.timers[:last]
		c.timerFix(i)
	} else {
		c.timers = c.timers[:last]
	}
}

func (c *Cache) timerPop() timer {
	t := c.timers[0]
	c.timerRemove(0)
	return t
}
