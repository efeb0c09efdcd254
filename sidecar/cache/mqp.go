package cache

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
)

// Policy selects how the cache orders present, unpinned, unretained
// blocks for eviction.
type Policy uint8

const (
	// PolicyLRU evicts the least recently used block (the default).
	PolicyLRU Policy = iota
	// PolicyMQP is the multi-queue policy with tip history, a measured
	// lifetime and a per-namespace scan guard (mqp.go, doc.go).
	PolicyMQP
	// PolicyMQP2 is MQP revised for engine page sizes: a learned tip
	// offset, a lifetime relative to the capacity, a scan guard for
	// fresh requests, probes that count nothing (mqp2.go, doc.go).
	PolicyMQP2
)

// String returns the policy's flag name.
func (p Policy) String() string {
	switch p {
	case PolicyLRU:
		return "lru"
	case PolicyMQP:
		return "mqp"
	case PolicyMQP2:
		return "mqp2"
	}
	return fmt.Sprintf("policy(%d)", uint8(p))
}

// DefaultPolicy is the policy `ringside serve` runs without
// --cache.policy: MQP2, chosen by bench/replay's measurements at engine
// page sizes (16 and 32 tokens: at least LRU's and ARC's hits at every
// capacity of every workload, retention hints never below no hints;
// docs/benchmarks.md), with the live sidecar checked against its offline
// model. A zero Config.Policy is LRU: a library user that sets no policy
// gets exact LRU.
const DefaultPolicy = PolicyMQP2

// PolicyNames lists the policies' flag names: lru|mqp|mqp2.
const PolicyNames = "lru|mqp|mqp2"

// ParsePolicy parses a policy name: lru, mqp or mqp2.
func ParsePolicy(s string) (Policy, error) {
	switch s {
	case "lru":
		return PolicyLRU, nil
	case "mqp":
		return PolicyMQP, nil
	case "mqp2":
		return PolicyMQP2, nil
	}
	return 0, fmt.Errorf("%w: eviction policy %q is not %s", ErrBadConfig, s, PolicyNames)
}

// Valid reports whether p is a policy of this package.
func (p Policy) Valid() bool { return p <= PolicyMQP2 }

// multiQueue reports whether p is MQP or MQP2 (mqpState).
func (p Policy) multiQueue() bool { return p == PolicyMQP || p == PolicyMQP2 }

// MQP (PolicyMQP), the policy of the research simulator's variant
// MQP/ldiv=1/compact=1/hb=1, ported to the slot arrays:
//
//   - Each present head has a count (1..15, saturating) and a level:
//     0 (count 1), 1 (2-3), 2 (4-7), 3 (8+), in one byte (pol). Four LRU
//     queues, one per level, share prev/next: queue 0's sentinel is the
//     LRU's (c.sentinel), queues 1-3's follow the retained lists'.
//   - A logical clock (tick) counts block placements. Every life/8 ticks
//     a marker node stamped with the tick goes to the front of queues
//     1-3 (at most mqpMarkersPerQ per queue, mqpMarkers nodes past the
//     sentinels in prev/next). Blocks behind a queue's oldest marker once
//     it is older than life/q are demoted to queue q-1, two per tick.
//   - The tip table keeps, per request's last digest (its tip), a 12-bit
//     fingerprint and a 4-bit count, in 4-way buckets (capacity entries
//     of 16 bits). Lookup probes every digest of the request from its end:
//     the count a digest inherits is the largest count of a tip at or
//     after it (inf), so a prefix that several requests extended starts
//     at their level; the request's own tip is inserted with count 1.
//   - Extension (not in the simulator; bench/replay's model has it): a
//     lookup that hits 0 < h < k digests extends a chain; its tip goes in
//     at count 0 (read as 1), and a later lookup finding a count-0 tip
//     counts it found (extFnd; extIns counts them inserted, both halved
//     at mqpHistHalve). While more than half of at least mqpMinObs are
//     found, an extending lookup of a namespace that is not cold gives
//     its missed digests inf >= 1, so their blocks are stored at count 2
//     (queue 1, with the chain they extend) and a session's fresh tail is
//     not evicted before its older blocks. It acts on the replay's agentic
//     workload (82-99% found) and never on the Mooncake trace (about a
//     third found).
//   - 1/16 of the tips (by hash) also sit in a distance sampler (fp16,
//     epoch16): the ticks since a sampled tip was last asked for is a
//     reuse distance; the median of those at least capacity/4, kept in a
//     64-bin histogram of 4 bins per octave, is the lifetime (life).
//   - The scan guard keeps per namespace an EWMA of the hit ratio of its
//     lookups, and one over all: a namespace under a tenth of the global
//     is cold, and a brand-new block it stores (count 1) goes to the LRU
//     end of queue 0, except every 32nd.
//   - Lookup computes inf for the digests it did not hit and leaves it in
//     a hint table (4-way, fp28|count4) for the stores of those blocks:
//     a store takes its block's hint and the commit places the block at
//     count hint+1. It is lossy (a full bucket overwrites round-robin),
//     and so is the tip table; a lost hint only means count 1.
//
// Eviction takes the LRU end of queue 0, then 1, 2, 3 (dropping markers
// found at an end), then the retained lists as under LRU. Everything is
// O(1) amortized per operation; no clock and no randomness.
const (
	mqpQueues      = 4
	mqpMarkersPerQ = 32
	mqpMarkers     = (mqpQueues - 1) * mqpMarkersPerQ // queues 1-3
	mqpExplore     = 32                               // a cold namespace's every 32nd new block is placed normally
	mqpDemote      = 2                                // demotions per queue per tick
	mqpMinObs      = 32                               // distance samples before a lifetime is used
	mqpHistHalve   = 1024                             // the histogram halves at this many samples
	mqpHintMin     = 1024                             // hint table buckets, at least
)

type mqpState struct {
	pol    []uint8 // per slot (head): count bits 0-3, level bits 4-5
	qSent  [mqpQueues]uint32
	nb     [mqpQueues]int // blocks listed per queue (markers not counted)
	mkBase uint32         // prev/next index of marker 0

	mk      [mqpMarkers]int64 // marker tick by marker id
	mkRing  [mqpQueues][mqpMarkersPerQ]uint8
	mkHead  [mqpQueues]uint8 // index of the oldest marker in mkRing[q]
	mkLen   [mqpQueues]uint8
	mkFree  [mqpMarkers]uint8
	mkFreeN int

	now, lastMk, life int64
	lifeDiv           [mqpQueues]float64

	tip     []uint16 // fp12<<4 | count4; 0 = empty
	tipHand []uint8  // 2-bit round-robin hand per bucket, 4 per byte
	tnb     uint64

	sfp, sep []uint16 // sampler: fp16, epoch16
	sHand    []uint8
	snb      uint64
	sG       int64

	hint  []uint32 // fp28<<4 | count4; 0 = empty
	hHand []uint8
	hnb   uint64

	hist [64]uint32
	hn   uint32
	dmin int64
	gHR  float64

	extIns uint32 // extending lookups' tips inserted (halved with extFnd)
	extFnd uint32 // ... of which a later lookup found

	inf  []uint8
	keys []uint64

	r2 *mqp2State // PolicyMQP2's additions (mqp2.go); nil under MQP
}

// nsGuard is a namespace's scan-guard state (reset with the namespace).
type nsGuard struct {
	hr      float64 // EWMA of the hit ratio of its lookups; -1: none yet
	cold    bool
	explore uint32

	// MQP2 (mqp2.go): the namespace's last lookups (probes repeat one)
	// and the last hint its stores took.
	probes   [mqp2Probes]uint64
	probeAt  uint8
	lastHint uint8
}

func newMQP(capacity uint32, policy Policy) *mqpState {
	c := int(capacity)
	m := &mqpState{pol: make([]uint8, capacity)}
	m.tnb = uint64(max(1, c/4))
	m.tip = make([]uint16, m.tnb*4)
	m.tipHand = make([]uint8, (m.tnb+3)/4)
	sMin, hMin, hDiv := 64, mqpHintMin, 128
	if policy == PolicyMQP2 {
		sMin, hMin, hDiv = mqp2SampleMin, mqp2HintMin, 64
		m.r2 = &mqp2State{capacity: int64(c)}
		m.life = int64(c) // until the lifetime is measured: one pass of the pool
	}
	se := max(sMin, int(float64(c)/16))
	m.snb = uint64(se / 4)
	m.sfp = make([]uint16, m.snb*4)
	m.sep = make([]uint16, m.snb*4)
	m.sHand = make([]uint8, (m.snb+3)/4)
	m.sG = max(1, int64(c/64))
	m.hnb = uint64(max(hMin, c/hDiv))
	m.hint = make([]uint32, m.hnb*4)
	m.hHand = make([]uint8, (m.hnb+3)/4)
	m.dmin = int64(0.25 * float64(c))
	for q := 1; q < mqpQueues; q++ {
		m.lifeDiv[q] = math.Exp(-1 * math.Log(float64(q)))
	}
	for i := range m.mkFree {
		m.mkFree[i] = uint8(mqpMarkers - 1 - i) // popped from the end: id 0 first
	}
	m.mkFreeN = mqpMarkers
	return m
}

// mqpExtraNodes is the prev/next entries MQP adds past the retained
// lists' sentinels: queues 1-3's sentinels and the marker nodes.
const mqpExtraNodes = mqpQueues - 1 + mqpMarkers

// bytes is the memory MQP adds that scales with capacity (prev/next's
// extra entries are counted with prev/next).
func (m *mqpState) bytes() int64 {
	b := int64(len(m.pol)) + 2*int64(len(m.tip)) + int64(len(m.tipHand)) +
		2*int64(len(m.sfp)+len(m.sep)) + int64(len(m.sHand)) +
		4*int64(len(m.hint)) + int64(len(m.hHand))
	if m.r2 != nil {
		b += mqp2FixedBytes
	}
	return b
}

func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func reduce(h, n uint64) uint64 { hi, _ := bits.Mul64(h, n); return hi }

// tipNSMix is what a namespace XORs into its digests' history key.
func tipNSMix(ns uint16) uint64 { return uint64(ns-1) * 0x9E3779B97F4A7C15 }

// tipKey is the 64-bit history key of (ns, digest): the digest's first
// word (digests are hashes), the other words mixed in, and the namespace.
func tipKey(ns uint16, d []byte) uint64 {
	k := binary.LittleEndian.Uint64(d) ^ tipNSMix(ns)
	for j := 8; j < len(d); j += 8 {
		k ^= bits.RotateLeft64(mix64(binary.LittleEndian.Uint64(d[j:])), 17*j)
	}
	return k
}

func getHand(h []uint8, b uint64) uint8 { return h[b>>2] >> ((b & 3) * 2) & 3 }
func bumpHand(h []uint8, b uint64) {
	sh := (b & 3) * 2
	v := (h[b>>2]>>sh + 1) & 3
	h[b>>2] = h[b>>2]&^(3<<sh) | v<<sh
}

// --- tip table ---

func (m *mqpState) tloc(k uint64) (uint64, uint16) {
	h := mix64(k ^ 0xabcdef12345)
	f := uint16(h) & 0xfff
	if f == 0 {
		f = 1
	}
	return reduce(h, m.tnb), f
}

func (m *mqpState) tfind(k uint64) int {
	b, f := m.tloc(k)
	for i := 0; i < 4; i++ {
		if j := int(b)*4 + i; m.tip[j]>>4 == f {
			return j
		}
	}
	return -1
}

// tinsert records k as a tip (count 1; count 0 when ext, an extending
// lookup's tip, until a later lookup finds it) unless it is one; it
// reports whether it inserted.
func (m *mqpState) tinsert(k uint64, ext bool) bool {
	if m.tfind(k) >= 0 {
		return false
	}
	b, f := m.tloc(k)
	base := int(b) * 4
	j := -1
	for i := 0; i < 4; i++ {
		if m.tip[base+i] == 0 {
			j = base + i
			break
		}
	}
	if j < 0 {
		j = base + int(getHand(m.tipHand, b))
		bumpHand(m.tipHand, b)
	}
	m.tip[j] = f << 4
	if !ext {
		m.tip[j] |= 1
	}
	return true
}

// extends reports whether the chains that lookups extend come back: of
// the last (about) mqpHistHalve tips of extending lookups inserted, more
// than half found again, with at least mqpMinObs inserted.
func (m *mqpState) extends() bool { return m.extIns >= mqpMinObs && 2*m.extFnd > m.extIns }

// --- distance sampler ---

func sampled(k uint64) bool { return mix64(k^0x1234567)&15 == 0 }

func (m *mqpState) sloc(k uint64) (uint64, uint16) {
	h := mix64(k ^ 0x7777)
	f := uint16(h)
	if f == 0 {
		f = 1
	}
	return reduce(h, m.snb), f
}

func (m *mqpState) sfind(k uint64) int {
	b, f := m.sloc(k)
	for i := 0; i < 4; i++ {
		if j := int(b)*4 + i; m.sfp[j] == f {
			return j
		}
	}
	return -1
}

func (m *mqpState) sinsert(k uint64) {
	b, f := m.sloc(k)
	base := int(b) * 4
	j := -1
	for i := 0; i < 4; i++ {
		if m.sfp[base+i] == 0 {
			j = base + i
			break
		}
	}
	if j < 0 {
		j = base + int(getHand(m.sHand, b))
		bumpHand(m.sHand, b)
	}
	m.sfp[j], m.sep[j] = f, uint16(m.now/m.sG)
}

// --- hints: a lookup's inherited counts for the blocks it missed ---

func (m *mqpState) hloc(k uint64) (uint64, uint32) {
	h := mix64(k ^ 0x5bd1e9955bd1e995)
	f := uint32(h) & 0xfffffff
	if f == 0 {
		f = 1
	}
	return reduce(h, m.hnb), f
}

func (m *mqpState) hfind(k uint64) (int, uint64, uint32) {
	b, f := m.hloc(k)
	for i := 0; i < 4; i++ {
		if j := int(b)*4 + i; m.hint[j]>>4 == f {
			return j, b, f
		}
	}
	return -1, b, f
}

// hintSet records count v (1..15) for k; v 0 forgets k.
func (m *mqpState) hintSet(k uint64, v uint8) {
	j, b, f := m.hfind(k)
	if v == 0 {
		if j >= 0 {
			m.hint[j] = 0
		}
		return
	}
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

// hintTake returns and forgets k's hint (0: none).
func (m *mqpState) hintTake(k uint64) uint8 {
	j, _, _ := m.hfind(k)
	if j < 0 {
		return 0
	}
	v := uint8(m.hint[j] & 15)
	m.hint[j] = 0
	return v
}

// --- lifetime ---

func mqpBin(d int64) int {
	if d < 1 {
		d = 1
	}
	return min(63, int(4*math.Log2(float64(d))))
}

func mqpBinLow(b int) float64 { return math.Exp(float64(b) / 4 * math.Log(2)) }

func (m *mqpState) observe(d int64) {
	if d < m.dmin {
		return
	}
	m.hist[mqpBin(d)]++
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
	want := uint32(0.5 * float64(m.hn))
	for i := range m.hist {
		acc += m.hist[i]
		if acc >= want {
			m.life = int64(mqpBinLow(i + 1))
			return
		}
	}
}

func mqpLevel(cnt uint8) uint8 {
	switch {
	case cnt >= 8:
		return 3
	case cnt >= 4:
		return 2
	case cnt >= 2:
		return 1
	}
	return 0
}

// --- the cache's side ---

// mqpBegin is the per-request step, run by Lookup (once per engine
// request in the live sidecar) after it found h leading hits and before
// it touches them: the scan guard's hit ratios, the tip history (inf per
// digest into m.inf), the lifetime sample, the request's tip, and hints
// for the digests past the leading run.
func (c *Cache) mqpBegin(n *namespace, ns NamespaceID, digests []byte, h int) {
	m := c.mqp
	k := len(digests) / n.width
	if k > 0 {
		r := float64(h) / float64(k)
		g := &n.guard
		if g.hr < 0 {
			g.hr = r
		}
		g.hr += (r - g.hr) / 64
		m.gHR += (r - m.gHR) / 64
		g.cold = g.hr < 0.1*m.gHR
	}
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
		if j := m.tfind(key); j >= 0 {
			cnt := uint8(m.tip[j] & 15)
			if cnt == 0 { // an extending lookup's tip, found the first time
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
		if sampled(key) {
			if j := m.sfind(key); j >= 0 {
				if !found {
					found = true
					m.observe((m.now/m.sG - int64(m.sep[j])) & 0xffff * m.sG)
				}
				m.sep[j] = uint16(m.now / m.sG)
			}
		}
	}
	if k > 0 {
		last := m.keys[k-1]
		ext := h > 0 && h < k
		if ext && m.extends() && !n.guard.cold {
			for i := h; i < k; i++ {
				m.inf[i] = max(m.inf[i], 1)
			}
		}
		if m.tinsert(last, ext) && ext {
			m.extIns++
			if m.extIns >= mqpHistHalve {
				m.extIns /= 2
				m.extFnd /= 2
			}
		}
		if sampled(last) && m.sfind(last) < 0 {
			m.sinsert(last)
		}
	}
	for i := h; i < k; i++ {
		m.hintSet(m.keys[i], m.inf[i])
	}
}

func (c *Cache) mqpCount(head uint32) uint8 { return c.mqp.pol[head] & 15 }
func (c *Cache) mqpLevelOf(head uint32) uint8 {
	return c.mqp.pol[head] >> 4 & 3
}

// mqpAccess is a reuse of present head h (a lookup hit, or a store that
// found it present) whose request inherited count inf: its count rises,
// and an unpinned, unretained block moves to the front of its level's
// queue (a tick). A retained block moves to the front of its retained
// list; a pinned one only counts (its last unpin lists it).
func (c *Cache) mqpAccess(h uint32, inf uint8) {
	m := c.mqp
	if m.r2 != nil && inf == mqp2FreshHint {
		inf = 0 // a fresh lookup's mark is no count
	}
	cnt := min(15, max(c.mqpCount(h)+1, inf+1))
	if c.aux[h] != 0 {
		m.pol[h] = mqpLevel(cnt)<<4 | cnt
		return
	}
	if c.retains[h] != nil && m.r2 == nil {
		m.pol[h] = mqpLevel(cnt)<<4 | cnt
		c.touch(h)
		return
	}
	c.unlist(h)
	m.pol[h] = cnt
	c.mqpPlace(h)
}

// mqpPlace puts unlisted head h at the front of its count's level queue
// and ticks.
func (c *Cache) mqpPlace(h uint32) {
	m := c.mqp
	q := mqpLevel(m.pol[h] & 15)
	m.pol[h] = q<<4 | m.pol[h]&15
	c.listPushFront(m.qSent[q], h)
	c.mqpTick()
}

// mqpCommit lists a head that just became present: at count hint+1 (the
// hint its first store took), or at the LRU end of queue 0 when its
// namespace is cold and it is brand new (except every mqpExplore-th).
func (c *Cache) mqpCommit(n *namespace, h uint32) {
	m := c.mqp
	if m.r2 != nil && m.pol[h]&15 == mqp2FreshHint {
		// MQP2: a block of a cold fresh lookup (a scan's).
		m.pol[h] = 1
		c.listPushBack(m.qSent[0], h)
		c.mqpTick()
		return
	}
	cnt := min(15, m.pol[h]&15+1)
	m.pol[h] = cnt
	if cnt == 1 && n.guard.cold {
		n.guard.explore++
		if n.guard.explore%mqpExplore != 0 {
			c.listPushBack(m.qSent[0], h)
			c.mqpTick()
			return
		}
	}
	c.mqpPlace(h)
}

func (c *Cache) isMarker(x uint32) bool { return c.mqp != nil && x >= c.mqp.mkBase }

// mqpTick advances the logical clock: it stamps markers and demotes
// blocks that outlived their level's lifetime.
func (c *Cache) mqpTick() {
	m := c.mqp
	m.now++
	step := max(1, m.life/8)
	if m.now-m.lastMk >= step {
		m.lastMk = m.now
		for q := 1; q < mqpQueues; q++ {
			if m.mkFreeN == 0 || m.mkLen[q] >= mqpMarkersPerQ {
				continue
			}
			m.mkFreeN--
			id := m.mkFree[m.mkFreeN]
			m.mk[id] = m.now
			m.mkRing[q][(int(m.mkHead[q])+int(m.mkLen[q]))%mqpMarkersPerQ] = id
			m.mkLen[q]++
			x, sent := m.mkBase+uint32(id), m.qSent[q]
			f := c.next[sent]
			c.prev[x], c.next[x] = sent, f
			c.prev[f] = x
			c.next[sent] = x
		}
	}
	for q := 1; q < mqpQueues; q++ {
		sent := m.qSent[q]
		for k := 0; k < mqpDemote; k++ {
			x := c.prev[sent]
			if x == sent || m.mkLen[q] == 0 {
				break
			}
			oldest := m.mkRing[q][m.mkHead[q]]
			if m.now-m.mk[oldest] <= int64(float64(m.life)*m.lifeDiv[q]) {
				break
			}
			if c.isMarker(x) {
				c.mqpDropMarker(q)
				k--
				continue
			}
			c.listRemove(sent, x)
			m.pol[x] = uint8(q-1)<<4 | m.pol[x]&15
			c.listPushFront(m.qSent[q-1], x)
		}
	}
}

// mqpDropMarker unlinks queue q's oldest marker (at its LRU end).
func (c *Cache) mqpDropMarker(q int) {
	m := c.mqp
	id := m.mkRing[q][m.mkHead[q]]
	m.mkHead[q] = uint8((int(m.mkHead[q]) + 1) % mqpMarkersPerQ)
	m.mkLen[q]--
	x := m.mkBase + uint32(id)
	p, nx := c.prev[x], c.next[x]
	c.next[p] = nx
	c.prev[nx] = p
	c.prev[x], c.next[x] = NoSlot, NoSlot
	m.mkFree[m.mkFreeN] = id
	m.mkFreeN++
}

// mqpVictim returns the first block at an LRU end of queues 0..3,
// dropping the markers it finds there; NoSlot if the queues hold none.
func (c *Cache) mqpVictim() uint32 {
	m := c.mqp
	for q := 0; q < mqpQueues; q++ {
		sent := m.qSent[q]
		for {
			x := c.prev[sent]
			if x == sent {
				break
			}
			if c.isMarker(x) {
				c.mqpDropMarker(q)
				continue
			}
			return x
		}
	}
	return NoSlot
}

// queueIndex returns which MQP queue sent is the sentinel of, or -1.
func (c *Cache) queueIndex(sent uint32) int {
	if c.mqp == nil {
		if sent == c.sentinel {
			return 0
		}
		return -1
	}
	for q, s := range c.mqp.qSent {
		if s == sent {
			return q
		}
	}
	return -1
}

// evictionLists returns the sentinels of the lists eviction takes from,
// in order: the policy's queue(s), then the retained lists by priority.
func (c *Cache) evictionLists() []uint32 {
	var out []uint32
	if c.mqp != nil {
		out = append(out, c.mqp.qSent[:]...)
	} else {
		out = append(out, c.sentinel)
	}
	for p := uint8(0); p < RetainPriorities; p++ {
		out = append(out, c.retSentinel(p))
	}
	return out
}
