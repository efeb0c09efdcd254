package cache

import (
	"fmt"
	"math"
	"time"
)

// What a shared tier (the sidecar's L2, sidecar/l2) needs of the pool: a
// lease that grows once fetched blocks are in, slots reserved for a fetch
// like a store's tickets, pins for a copy out of the pool that are not a
// lease's, and one bit per block saying that the tier holds it.

// BlockState is where a block of a namespace stands in the pool.
type BlockState uint8

const (
	// Absent: not in the index (never stored, evicted, dropped).
	Absent BlockState = iota
	// Present: stored by every rank; visible.
	Present
	// Pending: reserved or written by some ranks, not yet by all.
	Pending
)

// State returns where (ns, digest) stands.
func (c *Cache) State(ns NamespaceID, digest []byte) BlockState {
	n, err := c.ns(ns)
	if err != nil || len(digest) != n.width {
		return Absent
	}
	h := c.find(uint16(ns), digest)
	switch {
	case h == NoSlot:
		return Absent
	case c.present(h):
		return Present
	}
	return Pending
}

// AcquireOpen is AcquireCharged that creates the lease even when no block
// is present (Blocks 0, a non-zero ID), so that ExtendLease can add the
// blocks a fetch brings in later. The lease pins what it covers, like any.
func (c *Cache) AcquireOpen(ns NamespaceID, rank int, digests []byte, owner SessionID, ttl time.Duration, now int64, ch Charge) (Lease, bool, error) {
	l, short, err := c.AcquireCharged(ns, rank, digests, owner, ttl, now, ch)
	if err != nil || l.ID != 0 {
		return l, short, err
	}
	return Lease{ID: c.newLease(owner, ch.Key, true, nil, now, ttl)}, short, nil
}

// ExtendLease pins, under lease id, the leading present blocks of digests
// (the view's digests after the lease's last block), in namespace ns,
// stopping at the first block that is not present, at a block the lease
// already holds or the scan has taken, and where the pins charged to the
// lease's key (AcquireCharged's ch.Key) would pass limit (short reports
// that; limit <= 0: no limit). It returns how many blocks were added. The
// lease must be of ns (an empty one may be of any).
func (c *Cache) ExtendLease(id uint64, ns NamespaceID, digests []byte, limit int) (added int, short bool, err error) {
	li, ok := c.leaseByID[id]
	if !ok {
		return 0, false, fmt.Errorf("%w: %d", ErrUnknownLease, id)
	}
	n, err := c.ns(ns)
	if err != nil {
		return 0, false, err
	}
	l := &c.leases[li]
	if len(l.heads) > 0 && NamespaceID(c.nsOf[l.heads[0]]) != ns {
		return 0, false, fmt.Errorf("%w: lease %d is of namespace %d, not %d", ErrUnknownNamespace, id, c.nsOf[l.heads[0]], ns)
	}
	if len(digests)%n.width != 0 {
		return 0, false, fmt.Errorf("%w: %d bytes is not a multiple of width %d", ErrBadDigest, len(digests), n.width)
	}
	// The heads the lease holds are flagged for the scan, so that a repeat
	// ends it (as in leading).
	for _, h := range l.heads {
		c.done[h] |= doomedBit
	}
	start := len(l.heads)
	for off := 0; off < len(digests); off += n.width {
		h := c.find(uint16(ns), digests[off:off+n.width])
		if h == NoSlot || int(c.done[h]) != n.world || c.state(h) != stStored {
			break
		}
		c.done[h] |= doomedBit
		l.heads = append(l.heads, h)
	}
	for _, h := range l.heads {
		c.done[h] &^= doomedBit
	}
	heads, short := c.fitPins(l.key, limit, l.heads[start:], n.world)
	for _, h := range heads {
		if c.aux[h] == math.MaxUint32 {
			heads = nil
			err = fmt.Errorf("%w: slot %d", ErrTooManyPins, h)
			break
		}
	}
	l.heads = l.heads[:start+len(heads)]
	for _, h := range heads {
		c.pin(h, n.world)
	}
	if l.key != 0 && len(heads) > 0 {
		c.chargePins(l.key, heads, n.world)
	}
	c.st.acquiredBlocks += uint64(len(heads))
	return len(heads), short, err
}

// BeginFetch reserves every rank's slot of an absent block for a copy into
// the pool from elsewhere (the shared tier) and returns one write ticket
// per rank, in rank order: the block is then incomplete, invisible and not
// evictable until every ticket is committed (CommitStore; the last one
// makes it present) or aborted, exactly as if each rank stored it. It
// answers AlreadyPresent for a present block and InFlight for an
// incomplete one (nothing is reserved either way), NoSpace and OverQuota
// as BeginStoreCharged does.
func (c *Cache) BeginFetch(ns NamespaceID, digest []byte, owner SessionID, now int64, ch Charge) ([]Ticket, Status, error) {
	n, err := c.ns(ns)
	if err != nil {
		return nil, StatusInvalid, err
	}
	if len(digest) != n.width {
		return nil, StatusInvalid, fmt.Errorf("%w: got %d bytes, want %d", ErrBadDigest, len(digest), n.width)
	}
	switch h := c.find(uint16(ns), digest); {
	case h == NoSlot:
	case c.present(h):
		return nil, AlreadyPresent, nil
	default:
		return nil, InFlight, nil
	}
	t, st, err := c.BeginStoreCharged(ns, 0, digest, owner, now, ch)
	if err != nil || st != Allocated {
		return nil, st, err
	}
	ts := make([]Ticket, n.world)
	ts[0] = t
	for r := 1; r < n.world; r++ {
		tr, st, err := c.BeginStoreCharged(ns, r, digest, owner, now, ch)
		if err != nil || st != Allocated {
			// Cannot happen: the block was just reserved, every rank's slot
			// is Reserved. Undo what was started.
			for _, x := range ts[:r] {
				c.AbortStore(x)
			}
			return nil, StatusInvalid, fmt.Errorf("cache: fetch of a new block: rank %d got %v %v", r, st, err)
		}
		ts[r] = tr
	}
	return ts, Allocated, nil
}

// PinBlock pins a present block for one copy out of the pool that is no
// lease's (a write to the shared tier) and appends every rank's slot, in
// rank order, to dst. EndLoad ends the pin. With toTail, a block that the
// pin's end leaves unpinned goes back to the least recently used end of
// the LRU list instead of the most recent (a write ahead of eviction must
// not make the block look used). ok is false when the block is not
// present.
func (c *Cache) PinBlock(ns NamespaceID, digest []byte, toTail bool, dst []uint32) (uint64, []uint32, bool) {
	n, err := c.ns(ns)
	if err != nil || len(digest) != n.width {
		return 0, dst, false
	}
	h := c.find(uint16(ns), digest)
	if h == NoSlot || !c.present(h) || c.aux[h] == math.MaxUint32 {
		return 0, dst, false
	}
	c.pin(h, n.world)
	for m, r := h, 0; r < n.world; r++ {
		dst = append(dst, m)
		m = c.ring[m]
	}
	c.nextLoad++
	c.loads[c.nextLoad] = []uint32{h}
	if toTail {
		if c.tailLoads == nil {
			c.tailLoads = map[uint64]struct{}{}
		}
		c.tailLoads[c.nextLoad] = struct{}{}
	}
	return c.nextLoad, dst, true
}

// unpinTail is unpin that puts a block left unpinned at the tail of its
// list (the LRU's, or its retention priority's).
func (c *Cache) unpinTail(h uint32) {
	c.aux[h]--
	if c.aux[h] == 0 {
		c.relist(h, true)
		c.evictable += c.worldOf(h)
		c.pinned--
	}
}

// Mark records that the shared tier holds the present block (ns, digest)
// and reports whether the block is present. The mark goes with the block:
// it ends when the block leaves the pool.
func (c *Cache) Mark(ns NamespaceID, digest []byte) bool {
	n, err := c.ns(ns)
	if err != nil || len(digest) != n.width {
		return false
	}
	h := c.find(uint16(ns), digest)
	if h == NoSlot || !c.present(h) {
		return false
	}
	c.setMark(h)
	return true
}

// Marked reports whether (ns, digest) is present and marked.
func (c *Cache) Marked(ns NamespaceID, digest []byte) bool {
	n, err := c.ns(ns)
	if err != nil || len(digest) != n.width {
		return false
	}
	h := c.find(uint16(ns), digest)
	return h != NoSlot && c.present(h) && c.marked(h)
}

func (c *Cache) setMark(h uint32) {
	if c.marks == nil {
		c.marks = make([]uint64, (c.capacity+63)/64)
	}
	c.marks[h/64] |= 1 << (h % 64)
}

func (c *Cache) clearMark(s uint32) {
	if c.marks != nil {
		c.marks[s/64] &^= 1 << (s % 64)
	}
}

func (c *Cache) marked(h uint32) bool {
	return c.marks != nil && c.marks[h/64]&(1<<(h%64)) != 0
}

// LRUTail visits up to n present, unpinned blocks in the order eviction
// takes them (the LRU from its tail, then the retained lists from the
// lowest priority's tail), with whether each is marked, until fn returns
// false. fn must not change the cache.
func (c *Cache) LRUTail(n int, fn func(ns NamespaceID, digest []byte, marked bool) bool) {
	i := 0
	for _, sent := range c.evictionLists() {
		for s := c.prev[sent]; s != sent; s = c.prev[s] {
			if s >= c.capacity {
				continue // an MQP marker
			}
			if i++; i > n {
				return
			}
			ns := c.nsList[c.nsOf[s]-1]
			if !fn(NamespaceID(c.nsOf[s]), c.digest[s][:ns.width], c.marked(s)) {
				return
			}
		}
	}
}

// SlotBlock returns the block whose slot s is (any rank's), if it is
// present: its namespace and its digest (valid until the cache changes).
func (c *Cache) SlotBlock(s uint32) (NamespaceID, []byte, bool) {
	if s >= c.capacity || c.state(s) == stFree {
		return 0, nil, false
	}
	h := c.headOf(s)
	if !c.present(h) {
		return 0, nil, false
	}
	ns := c.nsList[c.nsOf[h]-1]
	return NamespaceID(c.nsOf[h]), c.digest[h][:ns.width], true
}
