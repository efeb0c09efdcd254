package cache

import (
	"fmt"
	"time"
)

// Retention: a key asks that present blocks be kept for a while, at a
// priority. A retained block leaves the LRU list for the list of its
// priority (sentinels past the LRU's in prev/next); eviction takes the
// LRU's tail first and only then the tail of the lowest non-empty
// priority's list, so retention never makes a store fail. Each retained
// head has a record in a side table (the per-slot arrays do not grow), a
// deadline in the timer heap, and a charge on its key's retention counter
// (retainByKey), apart from the charges of its leases' pins (pinKey,
// pinByKey): a retention never takes room a lease needs. A retention
// belongs to its key and, within the key, to an owner the caller chooses.

// RetainPriorities is the number of retention priorities (0..3; 3 is kept
// longest).
const RetainPriorities = 4

// retainRec is the retention of one present head.
type retainRec struct {
	owner uint64 // who set it within its key (a caller's choice; 0: none)
	key   uint32 // the key that set it (and is charged for it)
	prio  uint8
	heap  int32 // index of its deadline in the timer heap
}

// holds reports whether the retention is key's and owner's.
func (r *retainRec) holds(key uint32, owner uint64) bool { return r.key == key && r.owner == owner }

// retSentinel returns the sentinel of priority p's list in prev/next.
func (c *Cache) retSentinel(p uint8) uint32 { return c.sentinel + 1 + uint32(p) }

// listOf returns the sentinel of the list an unpinned present head
// belongs in: its retention priority's, or the LRU's.
func (c *Cache) listOf(h uint32) uint32 {
	if r := c.retains[h]; r != nil && !c.retainsAsEvidence() {
		return c.retSentinel(r.prio)
	}
	if c.mqp != nil {
		return c.mqp.qSent[c.mqpLevelOf(h)]
	}
	return c.sentinel
}

// retainsAsEvidence reports whether retention is evidence for the
// policy rather than an order of its own (MQP2): a retained block stays
// in the policy's queues, one level up (mqp2Retain), and the retained
// lists stay empty.
func (c *Cache) retainsAsEvidence() bool { return c.mqp != nil && c.mqp.r2 != nil }

func (c *Cache) listCount(sent uint32, d int) {
	if sent > c.sentinel && sent <= c.retSentinel(RetainPriorities-1) {
		c.retLen[sent-c.sentinel-1] += d
		return
	}
	c.lruLen += d
	if c.mqp != nil {
		c.mqp.nb[c.queueIndex(sent)] += d
	}
}

func (c *Cache) listPushFront(sent, s uint32) {
	f := c.next[sent]
	c.prev[s], c.next[s] = sent, f
	c.prev[f] = s
	c.next[sent] = s
	c.listCount(sent, 1)
}

func (c *Cache) listPushBack(sent, s uint32) {
	b := c.prev[sent]
	c.prev[s], c.next[s] = b, sent
	c.next[b] = s
	c.prev[sent] = s
	c.listCount(sent, 1)
}

// listRemove unlinks s from sent's list.
func (c *Cache) listRemove(sent, s uint32) {
	p, n := c.prev[s], c.next[s]
	c.next[p] = n
	c.prev[n] = p
	c.prev[s], c.next[s] = NoSlot, NoSlot
	c.listCount(sent, -1)
}

// victim returns the block eviction takes next: the LRU's tail, else the
// tail of the lowest-priority retained list that holds one; NoSlot if
// nothing is evictable.
func (c *Cache) victim() uint32 {
	if c.mqp != nil && c.lruLen > 0 {
		return c.mqpVictim()
	}
	if c.lruLen > 0 {
		return c.prev[c.sentinel]
	}
	for p := uint8(0); p < RetainPriorities; p++ {
		if c.retLen[p] > 0 {
			return c.prev[c.retSentinel(p)]
		}
	}
	return NoSlot
}

// Retain keeps the leading present blocks of digests (flat, namespace
// width each; it stops at the first miss or repeat, as Lookup does) for
// ttl from now at priority prio (0..RetainPriorities-1), for ch.Key and
// owner. A block carries one retention, that of the key and owner that set
// it: a block another key, or the same key with another owner, retains is
// left as it is (not counted, nothing charged) and the run goes on past
// it; the same key and owner renew it (deadline now+ttl) and may change
// its priority. The blocks a key retains, whatever their owners, count
// against a bound of their own, apart from its leases' pins
// (AcquireCharged): the run stops at the first block that would take the
// key past ch.Limit retained slots (short reports it). n is the number of
// blocks whose retention this call set or renewed. When the deadline
// passes, Reap ends the retention and puts the block at the LRU's tail.
func (c *Cache) Retain(ns NamespaceID, digests []byte, ch Charge, owner uint64, ttl time.Duration, prio int, now int64) (n int, short bool, err error) {
	if ttl <= 0 {
		return 0, false, fmt.Errorf("%w: %v", ErrBadTTL, ttl)
	}
	if prio < 0 || prio >= RetainPriorities {
		return 0, false, fmt.Errorf("%w: %d", ErrBadPriority, prio)
	}
	nsr, heads, err := c.leading(ns, digests)
	if err != nil {
		return 0, false, err
	}
	// The blocks this key and owner may take: not anyone else's.
	mine := heads[:0]
	for _, h := range heads {
		if r := c.retains[h]; r == nil || r.holds(ch.Key, owner) {
			mine = append(mine, h)
		}
	}
	mine, short = c.fitRetains(ch.Key, ch.Limit, mine, nsr.world)
	deadline := addDeadline(now, ttl)
	p := uint8(prio)
	// Deadlines in view order (ties expire in creation order: the
	// prefix's head first, so its tail ends up at the LRU's tail).
	for _, h := range mine {
		if r := c.retains[h]; r != nil {
			c.timers[r.heap].deadline = deadline
			c.timerFix(int(r.heap))
			if c.aux[h] == 0 {
				c.listRemove(c.listOf(h), h)
			}
			r.prio = p
			continue
		}
		if c.aux[h] == 0 {
			c.unlist(h)
		}
		r := &retainRec{owner: owner, key: ch.Key, prio: p}
		c.retains[h] = r
		r.heap = int32(c.timerPush(deadline, timerRetain, h))
		if ch.Key != 0 {
			c.retainByKey[ch.Key] += nsr.world
		}
	}
	// Most recent in reverse, as Lookup touches: the prefix's first block
	// at the front of its list, its tail evicted first.
	for i := len(mine) - 1; i >= 0; i-- {
		h := mine[i]
		if c.retainsAsEvidence() {
			c.mqp2Retain(h)
		} else if c.aux[h] == 0 {
			c.listPushFront(c.retSentinel(p), h)
		}
	}
	c.st.retains += uint64(len(mine))
	return len(mine), short, nil
}

// fitRetains cuts heads (none retained by another key or owner) before
// the first block whose retention would take key past limit retained
// slots (key 0 or limit 0: no bound), a block it retains already costing
// nothing and any other world slots; short reports a cut.
func (c *Cache) fitRetains(key uint32, limit int, heads []uint32, world int) (_ []uint32, short bool) {
	if key == 0 || limit <= 0 {
		return heads, false
	}
	room := limit - c.retainByKey[key]
	for i, h := range heads {
		if c.retains[h] == nil {
			if room < world {
				return heads[:i], true
			}
			room -= world
		}
	}
	return heads, false
}

// RetainedCharged returns the slots of the blocks whose retention is
// charged to key (whatever their owners).
func (c *Cache) RetainedCharged(key uint32) int { return c.retainByKey[key] }

// unchargeRetain ends the charge of retention r of head h.
func (c *Cache) unchargeRetain(r *retainRec, h uint32) {
	if r.key == 0 {
		return
	}
	if c.retainByKey[r.key] -= c.worldOf(h); c.retainByKey[r.key] == 0 {
		delete(c.retainByKey, r.key)
	}
}

// EndRetain ends the retention that key and owner set on the blocks of
// digests (each present one, the run does not stop at a miss) and puts
// them at the LRU's tail, the last of the view last (evicted first).
// Blocks another key or owner retains, or none, are left alone. It returns
// how many retentions ended.
func (c *Cache) EndRetain(ns NamespaceID, digests []byte, key uint32, owner uint64) (int, error) {
	n, err := c.ns(ns)
	if err != nil {
		return 0, err
	}
	if len(digests)%n.width != 0 {
		return 0, fmt.Errorf("%w: %d bytes is not a multiple of width %d", ErrBadDigest, len(digests), n.width)
	}
	ended := 0
	for off := 0; off < len(digests); off += n.width {
		h := c.find(uint16(ns), digests[off:off+n.width])
		if h == NoSlot || !c.present(h) {
			continue
		}
		if r := c.retains[h]; r != nil && r.holds(key, owner) {
			c.timerRemove(int(r.heap))
			c.endRetention(h)
			ended++
			if c.retainsAsEvidence() {
				c.mqp2End(h)
			}
		}
	}
	c.st.retainEnds += uint64(ended)
	return ended, nil
}

// endRetention drops the retention of present head h, whose timer is
// gone already: its charge ends, and an unpinned block moves to the LRU's
// tail.
func (c *Cache) endRetention(h uint32) {
	r := c.retains[h]
	if c.retainsAsEvidence() {
		// MQP2: the block stays where its level put it (a session's end
		// demotes its tail: mqp2End).
		delete(c.retains, h)
		c.unchargeRetain(r, h)
		return
	}
	if c.aux[h] == 0 {
		c.listRemove(c.retSentinel(r.prio), h)
	}
	delete(c.retains, h)
	c.unchargeRetain(r, h)
	if c.aux[h] == 0 {
		c.coldest(h)
		c.listPushBack(c.listOf(h), h)
	}
}

// dropRetention forgets the retention of head h as the block leaves the
// pool (evicted or cleared): h is out of its list already.
func (c *Cache) dropRetention(h uint32) {
	r := c.retains[h]
	if r == nil {
		return
	}
	c.timerRemove(int(r.heap))
	delete(c.retains, h)
	c.unchargeRetain(r, h)
}

// Retained returns the blocks retained now and the slots they hold.
func (c *Cache) Retained() (blocks, slots int) {
	for h := range c.retains {
		slots += c.worldOf(h)
	}
	return len(c.retains), slots
}

// checkRetains verifies the retained lists, the side table, and their
// timers; it returns the retained heads per key (for the retention
// charges) and the timers they hold.
func (c *Cache) checkRetains(bad func(format string, args ...any)) (byKey map[uint32][]uint32, timers, listed int) {
	byKey = map[uint32][]uint32{}
	n := c.capacity
	for p := uint8(0); p < RetainPriorities; p++ {
		sent, k := c.retSentinel(p), 0
		for s := c.next[sent]; s != sent; s = c.next[s] {
			if s >= n {
				bad("retained list %d: slot %d out of range", p, s)
				break
			}
			if k++; k > int(n) {
				bad("retained list %d: cycle", p)
				break
			}
			if c.prev[c.next[s]] != s {
				bad("retained list %d: next(%d).prev != %d", p, s, s)
			}
			if c.rank(s) != 0 || !c.present(s) || c.aux[s] != 0 {
				bad("retained list %d: slot %d not an unpinned present head", p, s)
			}
			if r := c.retains[s]; r == nil || r.prio != p {
				bad("retained list %d: slot %d has retention %+v", p, s, r)
			}
		}
		if k != c.retLen[p] {
			bad("retained list %d: length %d, counter %d", p, k, c.retLen[p])
		}
		listed += k
	}
	for h, r := range c.retains {
		if h >= n || c.rank(h) != 0 || !c.present(h) {
			bad("retention of slot %d: not a present head", h)
			continue
		}
		if r.prio >= RetainPriorities {
			bad("retention of block %d: priority %d", h, r.prio)
		}
		if hi := r.heap; hi < 0 || int(hi) >= len(c.timers) || c.timers[hi].kind != timerRetain || c.timers[hi].idx != h {
			bad("retention of block %d: timer back-pointer %d broken", h, hi)
		} else {
			timers++
		}
		if r.key != 0 {
			byKey[r.key] = append(byKey[r.key], h)
		}
		if c.aux[h] != 0 && (c.prev[h] != NoSlot || c.next[h] != NoSlot) {
			bad("retained block %d: pinned, yet in a list", h)
		}
	}
	return byKey, timers, listed
}
