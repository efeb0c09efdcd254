package cache

import (
	"fmt"
	"strconv"
)

// Status is the outcome of BeginStore.
type Status uint8

const (
	// StatusInvalid is the zero Status; BeginStore never returns it without an error.
	StatusInvalid Status = iota
	// Allocated: the rank's slot is reserved in state Writing; write the
	// shard bytes, then CommitStore or AbortStore the ticket.
	Allocated
	// AlreadyPresent: this rank's shard is already stored; do not store twice.
	AlreadyPresent
	// InFlight: another writer is writing this rank's shard now; do not write.
	InFlight
	// NoSpace: not enough free or evictable slots (everything else is
	// pinned or being written).
	NoSpace
	// OverQuota: the block would need new slots beyond its charge's limit
	// (BeginStoreCharged); nothing was reserved.
	OverQuota
)

func (s Status) String() string {
	switch s {
	case Allocated:
		return "Allocated"
	case AlreadyPresent:
		return "AlreadyPresent"
	case InFlight:
		return "InFlight"
	case NoSpace:
		return "NoSpace"
	case OverQuota:
		return "OverQuota"
	}
	return "Status(" + strconv.Itoa(int(s)) + ")"
}

// Ticket identifies one write in progress: the slot to write and a unique,
// never-reused writer ID so that a late Commit/Abort after the write was
// reaped (and the slot reused) is detected instead of corrupting state.
type Ticket struct {
	Slot uint32
	ID   uint64
}

type writerRec struct {
	id         uint64
	owner      SessionID
	slot       uint32
	prev, next int32 // owner list (next doubles as free-list link)
	live       bool
}

// BeginStore starts storing rank's shard of (ns, digest) for owner.
//
// The first BeginStore of a logical block (any rank) reserves all W slots
// of the block at once (evicting LRU blocks if needed), so a TP group can
// never deadlock half-allocated. The block is incomplete (invisible to
// Lookup/Acquire, not evictable) until every rank has committed; if that
// does not happen within Config.WriteTimeout of the latest BeginStore,
// Reap reclaims the whole block.
func (c *Cache) BeginStore(ns NamespaceID, rank int, digest []byte, owner SessionID, now int64) (Ticket, Status, error) {
	return c.BeginStoreCharged(ns, rank, digest, owner, now, Charge{})
}

// Charge names who pays for the slots an incomplete block reserves, and
// how many such slots that payer may hold at once. Key 0 is not charged.
type Charge struct {
	Key   uint32
	Limit int // slots of incomplete blocks Key may hold; <= 0: no limit
}

// PendingCharged returns the slots of incomplete blocks charged to key.
func (c *Cache) PendingCharged(key uint32) int { return c.pendingByKey[key] }

// BeginStoreCharged is BeginStore that charges the slots a new incomplete
// block reserves (all W of them) to ch.Key until the block becomes present
// or is dropped, and answers OverQuota, reserving nothing, when that would
// take the key past ch.Limit. Joining a block another rank began costs no
// new slots and is never refused.
func (c *Cache) BeginStoreCharged(ns NamespaceID, rank int, digest []byte, owner SessionID, now int64, ch Charge) (Ticket, Status, error) {
	n, err := c.ns(ns)
	if err != nil {
		return Ticket{}, StatusInvalid, err
	}
	if rank < 0 || rank >= n.world {
		return Ticket{}, StatusInvalid, fmt.Errorf("%w: rank %d, world size %d", ErrBadRank, rank, n.world)
	}
	if len(digest) != n.width {
		return Ticket{}, StatusInvalid, fmt.Errorf("%w: got %d bytes, want %d", ErrBadDigest, len(digest), n.width)
	}
	deadline := addDeadline(now, c.cfg.WriteTimeout)
	h := hashKey(uint16(ns), digest)
	head := c.findH(uint16(ns), digest, h)
	if head != NoSlot {
		s := c.member(head, rank)
		switch c.state(s) {
		case stStored:
			if c.present(head) {
				if c.mqp == nil {
					c.touch(head)
				} else if rank == 0 {
					// Once per block and request: rank 0's store.
					c.mqpAccess(head, c.mqpTake(n, ns, digest))
				} else if c.retains[head] != nil {
					c.touch(head) // the retained lists stay LRU
				}
			}
			return Ticket{Slot: s}, AlreadyPresent, nil
		case stWriting:
			return Ticket{Slot: s}, InFlight, nil
		default: // stReserved: the block is pending
			c.extendGroup(head, deadline)
			return c.startWrite(s, owner), Allocated, nil
		}
	}
	w := n.world
	if ch.Key != 0 && ch.Limit > 0 && c.pendingByKey[ch.Key]+w > ch.Limit {
		c.st.overQuota++
		return Ticket{}, OverQuota, nil
	}
	if c.nFree+c.evictable < w {
		c.st.noSpace++
		return Ticket{}, NoSpace, nil
	}
	for c.nFree < w {
		c.evictBlock(c.victim(), true)
	}
	head = c.allocGroup(uint16(ns), digest, w)
	if c.mqp != nil {
		// The count its lookup inherited, until the commit (mqpCommit).
		c.mqp.pol[head] = c.mqpTake(n, ns, digest)
	}
	n.pending++
	if ch.Key != 0 {
		c.pendingKey[head] = ch.Key
		c.pendingByKey[ch.Key] += w
	}
	c.indexInsert(head, h)
	c.adoptDesc(uint16(ns), digest, head)
	c.next[head] = uint32(c.timerPush(deadline, timerGroup, head))
	return c.startWrite(c.member(head, rank), owner), Allocated, nil
}

// CommitStore makes the ticket's shard stored. When the last rank of the
// logical block commits, the block becomes present: visible to Lookup and
// Acquire, evictable, and a Stored change is logged. If the block was
// dropped while this write was in flight (its deadline passed), the write
// is discarded and ErrDoomed is returned; the slots are freed when the
// last write in flight on them ends.
func (c *Cache) CommitStore(t Ticket) error {
	wi, err := c.ticket(t)
	if err != nil {
		return err
	}
	s := t.Slot
	head := c.headOf(s)
	if c.isDoomed(head) {
		c.abortWriter(wi)
		return fmt.Errorf("%w: slot %d", ErrDoomed, s)
	}
	c.dropWriter(wi)
	c.setState(s, stStored)
	c.nWriting--
	c.nStored++
	c.done[head]++
	n := c.nsList[c.nsOf[head]-1]
	if int(c.done[head]) < n.world {
		return nil
	}
	c.timerRemove(int(c.next[head]))
	c.unchargePending(head)
	c.aux[head] = 0
	if c.mqp != nil {
		c.mqpCommit(n, head)
	} else {
		c.listPushFront(c.sentinel, head)
	}
	c.evictable += n.world
	n.pending--
	n.blocks++
	c.st.stores++
	c.sizing.stored(c.nsOf[head], c.digest[head][:n.width])
	c.logAppend(n, OpStored, head, c.digest[head][:n.width])
	c.describedPresent(n, head)
	return nil
}

// unchargePending ends the charge of an incomplete block.
func (c *Cache) unchargePending(head uint32) {
	key, ok := c.pendingKey[head]
	if !ok {
		return
	}
	delete(c.pendingKey, head)
	if left := c.pendingByKey[key] - c.worldOf(head); left > 0 {
		c.pendingByKey[key] = left
	} else {
		delete(c.pendingByKey, key)
	}
}

// AbortStore abandons the ticket's write. The rank's slot goes back to
// Reserved so the rank may retry; if no rank of the block has committed
// or is writing, the whole block is freed at once (for world size 1 this
// is always the case).
func (c *Cache) AbortStore(t Ticket) error {
	wi, err := c.ticket(t)
	if err != nil {
		return err
	}
	c.abortWriter(wi)
	return nil
}

func (c *Cache) abortWriter(wi int32) {
	s := c.writers[wi].slot
	c.dropWriter(wi)
	c.setState(s, stReserved)
	c.nWriting--
	c.nReserved++
	c.st.aborts++
	head := c.headOf(s)
	if c.isDoomed(head) {
		c.freeIfDone(head)
		return
	}
	if c.done[head] != 0 {
		return
	}
	m := head
	for {
		if c.state(m) == stWriting {
			return
		}
		if m = c.ring[m]; m == head {
			break
		}
	}
	c.timerRemove(int(c.next[head]))
	c.dropPending(head)
}

// dropPending drops an incomplete block whose timer is already gone. A
// block that no rank is writing now is freed at once. A block with writes
// in flight is doomed instead: it leaves the index (a new store of the
// digest starts afresh) but keeps its slots until the last of those writes
// commits or aborts (both then discard it), so that a copy still running
// never writes into a slot handed to another block.
func (c *Cache) dropPending(head uint32) {
	n := c.nsList[c.nsOf[head]-1]
	writing := 0
	for m := head; ; {
		if c.state(m) == stWriting {
			writing++
		}
		if m = c.ring[m]; m == head {
			break
		}
	}
	n.pending--
	c.unchargePending(head)
	c.dropDesc(head)
	c.indexRemove(head)
	if writing == 0 {
		c.freeGroup(head)
		return
	}
	c.done[head] |= doomedBit
	n.doomed++
	c.doomed++
	c.st.reapedWrites += uint64(writing)
}

// freeIfDone frees a doomed block once no rank writes it any more.
func (c *Cache) freeIfDone(head uint32) {
	for m := head; ; {
		if c.state(m) == stWriting {
			return
		}
		if m = c.ring[m]; m == head {
			break
		}
	}
	n := c.nsList[c.nsOf[head]-1]
	n.doomed--
	c.doomed--
	c.freeGroup(head)
}

func (c *Cache) ticket(t Ticket) (int32, error) {
	if t.Slot >= c.capacity || c.state(t.Slot) != stWriting {
		return 0, fmt.Errorf("%w: slot %d id %d", ErrStaleTicket, t.Slot, t.ID)
	}
	wi := int32(c.aux[t.Slot])
	if c.writers[wi].id != t.ID {
		return 0, fmt.Errorf("%w: slot %d id %d", ErrStaleTicket, t.Slot, t.ID)
	}
	return wi, nil
}

// extendGroup moves a pending block's deadline later (never earlier).
func (c *Cache) extendGroup(head uint32, deadline int64) {
	i := int(c.next[head])
	if c.timers[i].deadline < deadline {
		c.timers[i].deadline = deadline
		c.timerFix(i)
	}
}

// allocGroup pops w free slots and links them as one pending logical block:
// ring order is rank order, the head is rank 0 and holds the digest.
func (c *Cache) allocGroup(ns uint16, digest []byte, w int) uint32 {
	head := c.popFree()
	c.digest[head] = [MaxDigestLen]byte{}
	copy(c.digest[head][:], digest)
	c.nsOf[head] = ns
	c.meta[head] = stReserved
	c.done[head] = 0
	c.aux[head] = 0
	c.prev[head] = NoSlot
	last := head
	for r := 1; r < w; r++ {
		s := c.popFree()
		c.nsOf[s] = ns
		c.meta[s] = uint8(r)<<2 | stReserved
		c.prev[s] = head
		c.next[s] = NoSlot
		c.aux[s] = 0
		c.ring[last] = s
		last = s
	}
	c.ring[last] = head
	c.nReserved += w
	return head
}

func (c *Cache) popFree() uint32 {
	s := c.freeHead
	c.freeHead = c.next[s]
	c.nFree--
	return s
}

// freeGroup returns every slot of the block to the free list.
func (c *Cache) freeGroup(head uint32) {
	c.dropDesc(head)
	s := head
	for {
		nx := c.ring[s]
		switch c.state(s) {
		case stReserved:
			c.nReserved--
		case stWriting:
			c.nWriting--
		case stStored:
			c.nStored--
		}
		c.meta[s] = stFree
		c.clearMark(s)
		c.nsOf[s] = 0
		c.aux[s] = 0
		c.done[s] = 0
		c.ring[s] = NoSlot
		c.prev[s] = NoSlot
		c.next[s] = c.freeHead
		c.freeHead = s
		c.nFree++
		if c.onFree != nil {
			c.onFree(s)
		}
		if nx == head {
			break
		}
		s = nx
	}
}

// evictBlock removes a present, unpinned block (a member of the LRU or of
// a retained list; its retention goes with it).
func (c *Cache) evictBlock(head uint32, evicted bool) {
	n := c.nsList[c.nsOf[head]-1]
	c.unlist(head)
	c.dropRetention(head)
	c.evictable -= n.world
	n.blocks--
	if evicted {
		c.st.evictions++
		if !c.marked(head) {
			c.st.evictedUnmarked++
		}
		c.logAppend(n, OpEvicted, head, c.digest[head][:n.width])
	}
	c.indexRemove(head)
	c.freeGroup(head)
}

// --- writer records ---

func (c *Cache) startWrite(s uint32, owner SessionID) Ticket {
	var wi int32
	if c.writerFree >= 0 {
		wi = c.writerFree
		c.writerFree = c.writers[wi].next
	} else {
		c.writers = append(c.writers, writerRec{})
		wi = int32(len(c.writers) - 1)
	}
	c.nextWriterID++
	w := &c.writers[wi]
	*w = writerRec{id: c.nextWriterID, owner: owner, slot: s, prev: -1, next: -1, live: true}
	o := c.ownerGet(owner)
	if o.writers >= 0 {
		c.writers[o.writers].prev = wi
		w.next = o.writers
	}
	o.writers = wi
	c.aux[s] = uint32(wi)
	c.setState(s, stWriting)
	c.nReserved--
	c.nWriting++
	c.liveWriter++
	return Ticket{Slot: s, ID: w.id}
}

// dropWriter unlinks and frees a writer record (slot state is the caller's).
func (c *Cache) dropWriter(wi int32) {
	w := &c.writers[wi]
	o := c.owners[w.owner]
	if w.prev >= 0 {
		c.writers[w.prev].next = w.next
	} else {
		o.writers = w.next
	}
	if w.next >= 0 {
		c.writers[w.next].prev = w.prev
	}
	c.ownerMaybeDrop(w.owner, o)
	*w = writerRec{next: c.writerFree, prev: -1}
	c.writerFree = wi
	c.liveWriter--
}
