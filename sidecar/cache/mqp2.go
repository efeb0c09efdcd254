package cache

import "math"

// MQP2 (PolicyMQP2) is MQP revised for engine page sizes. MQP was chosen
// on replays with 512-token pages; an engine's page is its block, 16
// tokens on vLLM's GPUs and 32 on its CPU build, and there MQP evicted as
// LRU does: its tip (a lookup's last digest) lay in the part of a prompt
// the next request does not send again (the traces' hashed blocks
// expanded into engine pages: a partial last block hashes as itself),
// so no tip was ever found and the lifetime was never measured; and its
// lifetime histogram spanned 2^16 ticks, which smaller blocks outgrow.
// MQP2 is MQP (mqp.go) with these changes, each of which does not depend
// on how many pages a prompt is cut into:
//
//   - A learned tip offset. One lookup in mqp2OffRate (by the hash of its
//     last digest) records its digests at 2^k-1 from its end (k <
//     mqp2OffK; those past its leading hits) in a fixed table of
//     mqp2OffEntries fingerprints; every lookup probes its digests there
//     and counts the records found for the first time. The tip is the
//     digest at the smallest offset found at least 3/4 as often as the
//     best (each with mqp2OffMin records at least; 0 before). A chat's
//     next prompt starts with the last one (offset 0, MQP's tip); the
//     traces' next turn shares all but the partial last block (a block or
//     so back, whatever the page size).
//   - Anchors. A digest is an anchor when the low log2((off+1)/2) bits of
//     its hash are zero (mqp2Anchor; every digest at offset 0 or 1): one
//     in (off+1)/2. Only anchors are tips (the tip is the nearest anchor
//     at or before the offset; a lookup with none there records no tip)
//     and only anchors are looked up in the tip table. An entry is a
//     12-bit fingerprint, and a lookup that checked every digest checked
//     the table 32 times as often at 16-token pages as at 512: its false
//     finds gave digests an unrelated (often hot) tip's count. The offset
//     grows with the digests a block is cut into, and so does the gap
//     between anchors: the checks a lookup makes stay about as many at any
//     page size. No state per block: the test is a hash of the digest.
//   - The lifetime histogram counts a distance d as d x 64 / capacity, so
//     its bins span capacity/4 to 1,024 x capacity at any block size; the
//     lifetime is the median bin's upper edge times capacity/64.
//   - The distance sampler takes one tip in 4 (MQP: 16), into at least
//     mqp2SampleMin entries (MQP: 64): a lookup has one tip whatever its
//     length, and too few samples left the lifetime to chance.
//   - A fresh lookup (no leading hit, no tip found) is a scan's when such
//     lookups rarely come back: one in mqp2OffRate records its tip in the
//     learner's table (tag mqp2Fresh), and while under a tenth of at least
//     mqp2OffMin are found again, a fresh lookup leaves the hint
//     mqp2FreshHint for its digests: their blocks are stored at count 1
//     at the LRU end of queue 0, except every mqpExplore-th fresh
//     lookup's. (MQP's scan guard is per namespace and cannot see one
//     tenant's scan among its sessions.)
//   - A lookup equal to one of its namespace's last mqp2Probes (same
//     length, same last digest) is a probe: it returns its hits and
//     changes nothing, no count, tip, sample or recency.
//   - Hints: a lookup records one for each digest past its leading hits,
//     zero included, in max(mqp2HintMin, capacity/64) buckets. A store
//     that finds none (the table is lossy) takes its namespace's last hint
//     taken: a lookup's hints never rise along the prefix and its stores
//     come in prefix order, so a lost hint in a chain of hundreds of
//     small blocks no longer stores one block at count 1, evicted first,
//     cutting every later block off the chain's next prefix hit.
//
// bench/replay's offline model (MQP2Pages) is this, call for call; the
// replay's and the soak's sequential runs check the live sidecar against
// it exactly.
const (
	mqp2OffK       = 8 // offsets 2^k - 1 digests from a lookup's end, k < 8
	mqp2Fresh      = mqp2OffK
	mqp2OffEntries = 1024 // the learner's table
	mqp2OffRate    = 8    // one lookup in 8 records its offsets
	mqp2OffMin     = 32   // records of an offset before it is chosen
	mqp2Probes     = 16   // a namespace's last lookups a probe is checked against
	mqp2HintMin    = 4096 // hint table buckets, at least
	mqp2SampleMin  = 1024 // distance sampler entries, at least
	// mqp2FreshHint is the hint a cold fresh lookup leaves for its
	// digests; a count's hint is at most 14 (count 15 either way).
	mqp2FreshHint = 15

	mqp2FixedBytes = 3*mqp2OffEntries + mqp2OffEntries/4 + 8*(mqp2OffK+1)
)

// mqp2State is what MQP2 adds to MQP's state: fixed size.
type mqp2State struct {
	offFP   [mqp2OffEntries]uint16 // learner: fingerprint, 0 = empty
	offTag  [mqp2OffEntries]uint8  // offset index (or mqp2Fresh) | 0x80 once found
	offHand [mqp2OffEntries / 4]uint8
	offIns  [mqp2OffK + 1]uint32
	offFnd  [mqp2OffK + 1]uint32
	off     int // the tip's offset from a lookup's last digest

	freshN   uint32 // fresh lookups while fresh ones are cold (explore)
	capacity int64
}

func mqp2OffOf(k int) int { return 1<<k - 1 }

// mqp2Anchor reports whether the digest of history key k is an anchor
// while the tip's offset is off (2^j - 1): one digest in max(1, (off+1)/2),
// by its hash alone (every digest at offset 0 or 1). Only anchors are tips
// and only anchors are looked up in the tip table.
func mqp2Anchor(k uint64, off int) bool {
	return mix64(k^0xa7c4)&(max(1, uint64(off+1)>>1)-1) == 0
}

func (r *mqp2State) offLoc(key uint64) (int, uint16) {
	h := mix64(key ^ 0x0ff5e7)
	f := uint16(h>>32) | 1
	return int(reduce(h, mqp2OffEntries/4)), f
}

// offProbe counts the records of key found for the first time.
func (r *mqp2State) offProbe(key uint64) {
	b, f := r.offLoc(key)
	for i := range 4 {
		if j := b*4 + i; r.offFP[j] == f && r.offTag[j]&0x80 == 0 {
			r.offTag[j] |= 0x80
			r.offFnd[r.offTag[j]&0x7f]++
		}
	}
}

// offInsert records key under tag k (an offset index, or mqp2Fresh), and
// chooses the tip's offset anew.
func (r *mqp2State) offInsert(key uint64, k int) {
	b, f := r.offLoc(key)
	j := -1
	for i := range 4 {
		if r.offFP[b*4+i] == 0 {
			j = b*4 + i
			break
		}
	}
	if j < 0 {
		j = b*4 + int(r.offHand[b])
		r.offHand[b] = (r.offHand[b] + 1) & 3
	}
	r.offFP[j], r.offTag[j] = f, uint8(k)
	r.offIns[k]++
	if r.offIns[k] >= mqpHistHalve {
		lo, hi := 0, mqp2OffK
		if k == mqp2Fresh {
			lo, hi = mqp2Fresh, mqp2Fresh+1
		}
		for i := lo; i < hi; i++ {
			r.offIns[i] /= 2
			r.offFnd[i] /= 2
		}
	}
	if k == mqp2Fresh {
		return
	}
	var best uint64 // found/inserted, 32.32 fixed point
	for i := range mqp2OffK {
		if r.offIns[i] >= mqp2OffMin {
			best = max(best, uint64(r.offFnd[i])<<32/uint64(r.offIns[i]))
		}
	}
	for i := range mqp2OffK {
		if r.offIns[i] >= mqp2OffMin && 4*(uint64(r.offFnd[i])<<32/uint64(r.offIns[i])) >= 3*best {
			r.off = mqp2OffOf(i)
			return
		}
	}
}

// freshCold reports whether fresh lookups' tips come back rarely.
func (r *mqp2State) freshCold() bool {
	return r.offIns[mqp2Fresh] >= mqp2OffMin && 10*r.offFnd[mqp2Fresh] < r.offIns[mqp2Fresh]
}

// mqp2Probe reports whether a lookup of k digests whose last has history
// key last repeats one of namespace n's last mqp2Probes lookups; else it
// records it.
func mqp2Probe(g *nsGuard, last uint64, k int) bool {
	fp := mqp2ProbeFP(last, k)
	for _, x := range g.probes {
		if x == fp {
			return true
		}
	}
	g.probes[g.probeAt] = fp
	g.probeAt = (g.probeAt + 1) % mqp2Probes
	return false
}

// mqp2ProbeFP is the fingerprint of a lookup of k digests whose last has
// history key last.
func mqp2ProbeFP(last uint64, k int) uint64 { return mix64(last^uint64(k)<<40^0x9b0be5) | 1 }

func mqp2Sampled(k uint64) bool { return mix64(k^0x1234567)&3 == 0 }

// observe2 is observe with distances relative to the capacity.
func (m *mqpState) observe2(d int64) {
	if d < m.dmin {
		return
	}
	r := d * 64 / m.r2.capacity
	m.hist[min(63, int(4*math.Log2(float64(max(r, 1)))))]++
	m.hn++
	if m.hn >= mqpHistHalve {
		var s uint32
		for i := range m.hist {
			m.hist[i] /= 2
			s += m.hist[i]
		}
		m.hn = s
	}
	if m.hn < mqpMinObs {
		return
	}
	var acc uint32
	want := m.hn / 2
	for i := range m.hist {
		acc += m.hist[i]
		if acc >= want {
			m.life = mqp2Life(i, m.r2.capacity)
			return
		}
	}
}

// mqp2Life is the lifetime of the median's bin b: its upper edge,
// 2^((b+1)/4) x capacity/64 ticks.
func mqp2Life(b int, capacity int64) int64 {
	return int64(math.Exp(float64(b+1)/4*math.Log(2)) * float64(capacity) / 64)
}

// hintSet2 records v for k, zero included.
func (m *mqpState) hintSet2(k uint64, v uint8) {
	j, b, f := m.hfind(k)
	if j < 0 {
		base := int(b) * 4
		for i := 0; i < 4; i++ {
			if m.hint[base+i] == 0 {
				j = base + i
				break
			}
		}
		if j < 0 {
			j = base + int(getHand(m.hHand, b))
			bumpHand(m.hHand, b)
		}
	}
	m.hint[j] = f<<4 | uint32(v)
}

// hintTake2 returns and forgets k's hint; none (lost) is the namespace's
// last hint taken.
func (m *mqpState) hintTake2(g *nsGuard, k uint64) uint8 {
	j, _, _ := m.hfind(k)
	if j < 0 {
		return g.lastHint
	}
	v := uint8(m.hint[j] & 15)
	m.hint[j] = 0
	g.lastHint = v
	return v
}

// mqpTake is the hint a store of digest d of namespace ns takes.
func (c *Cache) mqpTake(n *namespace, ns NamespaceID, d []byte) uint8 {
	k := tipKey(uint16(ns), d)
	if c.mqp.r2 != nil {
		return c.mqp.hintTake2(&n.guard, k)
	}
	return c.mqp.hintTake(k)
}

// mqpBegin2 is MQP2's per-request step (mqpBegin's, changed as above);
// it reports whether the lookup is a probe (then it changed nothing).
func (c *Cache) mqpBegin2(n *namespace, ns NamespaceID, digests []byte, h int) (probe bool) {
	m, r := c.mqp, c.mqp.r2
	k := len(digests) / n.width
	if k == 0 {
		return false
	}
	g := &n.guard
	if mqp2Probe(g, tipKey(uint16(ns), digests[(k-1)*n.width:]), k) {
		return true
	}
	hr := float64(h) / float64(k)
	if g.hr < 0 {
		g.hr = hr
	}
	g.hr += (hr - g.hr) / 64
	m.gHR += (hr - m.gHR) / 64
	g.cold = g.hr < 0.1*m.gHR
	if cap(m.inf) < k {
		m.inf = make([]uint8, 2*k)
		m.keys = make([]uint64, 2*k)
	}
	m.inf, m.keys = m.inf[:k], m.keys[:k]
	var run uint8
	found := false
	for i := k - 1; i >= 0; i-- {
		key := tipKey(uint16(ns), digests[i*n.width:(i+1)*n.width])
		m.keys[i] = key
		if !mqp2Anchor(key, r.off) {
			// not an anchor: never a tip, not looked up
		} else if j := m.tfind(key); j >= 0 {
			cnt := uint8(m.tip[j] & 15)
			if cnt == 0 {
				cnt = 1
				m.tip[j]++
				m.extFnd++
			}
			run = max(run, cnt)
			if cnt < 15 {
				m.tip[j]++
			}
		}
		m.inf[i] = run
		r.offProbe(key)
		if mqp2Sampled(key) {
			if j := m.sfind(key); j >= 0 {
				if !found {
					found = true
					m.observe2((m.now/m.sG - int64(m.sep[j])) & 0xffff * m.sG)
				}
				m.sep[j] = uint16(m.now / m.sG)
			}
		}
	}
	if mix64(m.keys[k-1]^0x0ff5e7a)%mqp2OffRate == 0 {
		for o := range mqp2OffK {
			if j := k - 1 - mqp2OffOf(o); j >= h && j >= 0 {
				r.offInsert(m.keys[j], o)
			}
		}
	}
	// The tip: the nearest anchor at or before the offset (none in a
	// lookup shorter than it, or with no anchor there; the sampler and the
	// fresh record then take the digest at the offset, or the first).
	t, tip := m.keys[max(0, k-1-r.off)], false
	for i := k - 1 - r.off; i >= 0; i-- {
		if mqp2Anchor(m.keys[i], r.off) {
			t, tip = m.keys[i], true
			break
		}
	}
	ext := h > 0 && h < k
	if ext && m.extends() && !g.cold {
		for i := h; i < k; i++ {
			m.inf[i] = max(m.inf[i], 1)
		}
	}
	if tip && m.tinsert(t, ext) && ext {
		m.extIns++
		if m.extIns >= mqpHistHalve {
			m.extIns /= 2
			m.extFnd /= 2
		}
	}
	if mqp2Sampled(t) && m.sfind(t) < 0 {
		m.sinsert(t)
	}
	fresh := false
	if h == 0 && run == 0 {
		if mix64(t^0xf7e5)%mqp2OffRate == 0 {
			r.offInsert(t, mqp2Fresh)
		}
		if r.freshCold() {
			r.freshN++
			fresh = r.freshN%mqpExplore != 0
		}
	}
	for i := h; i < k; i++ {
		v := min(m.inf[i], mqp2FreshHint-1)
		if fresh {
			v = mqp2FreshHint
		}
		if i == h {
			g.lastHint = v
		}
		m.hintSet2(m.keys[i], v)
	}
	return false
}

// mqp2Retain is a retention's evidence on present head h (a retention set
// or renewed): a block kept on purpose is kept longer than its peers, not
// above every shared prefix. A retention counts as a second read: a block
// read once (count 1, level 0) rises to count 2 (level 1), one read more
// keeps its count (a retention says less than a request did: lifting
// those too cost hits where the pool holds many sessions' retentions), and
// an unpinned block goes to the front of its level's queue (a tick), where
// it ages as any other: one level, one lifetime longer than its peers.
// Expiry changes nothing.
func (c *Cache) mqp2Retain(h uint32) {
	m := c.mqp
	cnt := max(c.mqpCount(h), 2)
	if c.aux[h] != 0 {
		m.pol[h] = mqpLevel(cnt)<<4 | cnt
		return
	}
	m.pol[h] = cnt
	c.mqpPlace(h)
}

// mqp2End is a session's end (EndRetain) over present head h, whose
// retention, if it had one, the call ended: a block counted fewer than 8
// times (levels 0 to 2: the session's own tail, which it will not read
// again; a session's turn may count twice on its prefix, by its lookup's
// hit and by a store that finds the block present, and its retention
// counts once, so a short conversation's blocks reach count 4) goes to
// the LRU end of queue 0 at count 1, the first to go; a block counted
// more (a prefix that many requests share) stays where it is, and so does
// a pinned one or one another key or owner retains.
func (c *Cache) mqp2End(h uint32) {
	m := c.mqp
	if c.aux[h] != 0 || c.retains[h] != nil || c.mqpLevelOf(h) > 2 || mqpLevel(c.mqpCount(h)) > 2 {
		return
	}
	c.unlist(h)
	m.pol[h] = 1
	c.listPushBack(m.qSent[0], h)
}
