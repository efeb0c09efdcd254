package replay

import (
	"math"
	"math/bits"
)

// MQP replays w through MQPPages, every request in one namespace (as the
// replay's live sidecar serves them).
func MQP(w *Workload, capacity int) PolicyResult {
	return MQPPages(workloadPages(w), nil, w.NumPageIDs(), capacity)
}

// MQPPages is MQP, the candidate eviction policy (multi-queue with a
// history of request tips, a measured lifetime and a per-namespace scan
// guard), driven through the sidecar's call sequence exactly as
// OraclePages drives its LRU: per request, a lookup (the leading run of
// present pages is the prefix hit), the hits touched in reverse order
// (page h-1 first), pinned, the missing pages stored in prefix order (a
// present one touched, a slot taken when one is free or an unpinned page
// can be evicted, else the page refused), the written pages committed in
// prefix order, and the pins released in reverse order. ns[i] is request
// i's namespace (below 64); nil puts every request in namespace 0.
//
// # Why it fits this workload
//
// A prefix cache of chained blocks sees three kinds of block: shared
// heads (system prompts, tool definitions, a conversation's early turns)
// read by many requests; a session's growing tail, read again when the
// session's next turn comes, after a gap that is long in requests (many
// sessions are open at once); and one-off blocks (a request's new text
// that nobody extends, a scan). LRU orders them by the last touch only,
// so a burst of one-off blocks flushes heads and tails alike, and a
// session's tail has to survive a whole gap's worth of other stores to be
// hit. On the Mooncake trace (512-token blocks) 74% of the distinct
// blocks are read once, a new block is read again in about one case in
// four, about 10,000 block reads later at the median: beyond a small
// pool's reach under LRU, and the optimum, which keeps the re-read blocks
// and bypasses the one-offs, is 2 to 4.6 times LRU up to 8,000 blocks.
// MQP approximates that with state the sidecar can afford (3.32 bytes per
// slot):
//
//   - a count per block, so that blocks read more often sit in higher
//     queues and a scan of new blocks (count 1, queue 0) is evicted first;
//   - the count of a new block comes from a history of request tips: a
//     request's last block is remembered (in a table of fingerprints, not
//     in the pool), and when a later request's prompt contains an earlier
//     request's tip, that chain was read again, so its blocks, new or
//     evicted meanwhile, start with a count above 1: a session's turn that
//     extends the previous turn is seen to be a re-read, even when the
//     pool no longer held its blocks;
//   - a lifetime: a block keeps its level only for a while (the median
//     re-access distance, measured on a sample of tips), then falls one
//     queue per lifetime, so old popularity does not pin the pool; the
//     time is counted in block placements, so it follows the load;
//   - an extension rule: a request that hits a prefix and stores new
//     blocks extends a chain; its tip is recorded as an extending one, and
//     when more than half of the recent extending tips were found again
//     by a later request (so extended chains come back: a session's next
//     turn), an extending request's new blocks start at count 2, in
//     queue 1 with the chain they extend, instead of count 1 in queue 0,
//     where a chain's fresh tail was evicted before its older blocks and
//     the next turn's prefix hit stopped short of it. Measured, not
//     assumed: on the Mooncake trace a third of the extending tips come
//     back and the rule never acts; on the agentic workload 82-99% do;
//   - a scan guard per namespace: a namespace whose requests hit far
//     less than the others' (below a tenth of the global hit ratio) has
//     its brand-new blocks put at the LRU end of queue 0 (all but one in
//     32, so that a namespace turning warm is noticed).
//
// Where reuse is recency alone (the replay's generated agentic workload:
// a block's reuse is its session's next turn) the counts and the
// lifetime alone left MQP up to 1.3 points under LRU; with the extension
// rule it is 0.1-0.8 points above LRU at every capacity. Until 32
// distances are recorded the lifetime is 0: a touched block falls back
// to queue 0 within a couple of placements.
//
// # State
//
// C is the capacity in slots. Per block (the head slot in a
// tensor-parallel pool) one byte: the count (bits 0-3, saturating at 15)
// and the level (bits 4-5): level 0 for count 1, 1 for 2-3, 2 for 4-7, 3
// for 8 and more. Four LRU queues, one per level, share the pool's
// prev/next arrays (their sentinels after the blocks' entries), followed
// by 128 marker nodes: a marker is a node in queue 1, 2 or 3 with a time
// (a logical clock, one tick per block placement), at most 32 per queue,
// kept in a FIFO per queue (oldest first) and a free list. The tip table
// has C 16-bit entries (12-bit fingerprint, 0 meaning empty, and a 4-bit
// count; count 0 marks an extending request's tip not found yet, read
// as 1) in 4-way buckets, replacing an empty entry or else by a 2-bit
// round-robin hand per bucket. The distance sampler holds the tips whose
// hash has its low 4 bits zero (one in 16): max(64, C/16) entries of a
// 16-bit fingerprint and a 16-bit epoch (the clock / max(1, C/64)), 4-way,
// replaced the same way. The lifetime histogram has 64 bins, 4 per
// octave of distance, halved when its total reaches 1024. Two counters:
// extending tips inserted and found, both halved when the first reaches
// 1024. Per namespace:
// the EWMA of the request hit ratio, a cold flag, an explore counter; a
// global EWMA of the hit ratio. Per slot: 1 byte of state, 2 bytes of
// tip table, 0.06 of its hands (2 bits per bucket of 4), 0.25 of sampler
// (C/16 entries of 4 bytes): 3.32 bytes, plus about 2.3 KB fixed (the 132
// extra list nodes, the marker times, the histogram, the guard).
//
// # Operations
//
// Lookup and acquire of a request's n pages (begin), for i = n-1 down to
// 0: when page i's tip entry exists, run = max(run, its count) and its
// count is raised by 1 (saturating; a count 0 is read as 1, raised to 2
// and counted as an extending tip found); inf[i] = run, so inf[i] is the
// largest count of a recorded tip at or after i. The first sampled page
// (largest i) found in the sampler gives the distance (epoch now - its
// epoch) * max(1, C/64), and every found sampled page gets the current
// epoch. The request extends when 0 < h < n; when it does, its
// namespace is not cold, at least 32 extending tips were inserted and
// more than half of them found (2*found > inserted), inf[i] = max(inf[i],
// 1) for i >= h. Then the request's last page is inserted as a tip (when
// absent) with count 1, or 0 when the request extends (counted as an
// extending tip inserted), and into the sampler when sampled. A distance of at
// least C/4 goes into the histogram; once it holds 32 samples the
// lifetime is 2^((b+1)/4) for the bin b of the median. The guard: the
// namespace's EWMA and the global one move by 1/64 towards the request's
// hit ratio h/n, and the namespace is cold when its EWMA is below a tenth
// of the global one.
//
// Touch (a lookup hit, in reverse order, and a present page met by a
// store): count = min(15, max(count+1, inf[i]+1)); the block moves to the
// MRU end of the queue of its level; tick.
//
// Pin (the first lease): the block leaves its queue, keeping its level.
// Unpin (the last release): MRU end of its level's queue.
//
// Commit of a stored block: count = min(15, inf[i]+1) (the inf of the
// store's own request: only its tips at or after i count). In a cold
// namespace a block of count 1 goes to the LRU end of queue 0, except
// every 32nd; otherwise to the MRU end of its level's queue; tick.
//
// Evict: for q = 0 to 3, markers at the LRU end of q are dropped; the
// first block found at an LRU end is the victim. Pinned blocks are in no
// queue, so they are never victims.
//
// Tick: the clock advances; every max(1, life/8) ticks a marker stamped
// with the time goes to the MRU end of queues 1 to 3 (when the queue has
// fewer than 32 and one is free). Then for q = 1 to 3, at most twice:
// with m the oldest marker of q, stop unless now - time(m) > life/q; if
// the LRU end of q is m, drop it (not counted), else the block at the LRU
// end moves to the MRU end of queue q-1 (its level becomes q-1, its
// count is kept). So a block not touched for about life/q ticks falls a
// level, and the blocks behind an expired marker are exactly those
// placed before it.
//
// The per-page-id arrays here stand for per-slot state in the pool; the
// tip table and the sampler hash (namespace, page id) where the sidecar
// would hash (namespace, digest).
func MQPPages(reqs [][]uint32, ns []uint8, numIDs, capacity int) PolicyResult {
	if capacity <= 0 {
		res := PolicyResult{Policy: "mqp", CapacityPages: capacity, Requests: len(reqs)}
		for _, r := range reqs {
			res.TotalPages += int64(len(r))
		}
		return res
	}
	return newMQP(numIDs, capacity).replay(reqs, ns, capacity)
}

// replay drives m through reqs (MQPPages).
func (m *mqp) replay(reqs [][]uint32, ns []uint8, capacity int) PolicyResult {
	res := PolicyResult{Policy: "mqp", CapacityPages: capacity, Requests: len(reqs)}
	const (
		absent uint8 = iota
		present
		writing
		pinned // present and leased
	)
	state := make([]uint8, len(m.st))
	used, resident, leased := 0, 0, 0
	var written []uint32
	var hint []uint8
	for ri, pages := range reqs {
		var n uint8
		if ns != nil {
			n = ns[ri]
		}
		res.TotalPages += int64(len(pages))
		for _, p := range pages {
			if state[p] == present {
				res.BlockHitPages++
			}
		}
		h := 0
		for h < len(pages) && state[pages[h]] == present {
			h++
		}
		res.HitPages += int64(h)
		if m.r2 != nil {
			m.begin2(n, pages, h)
		} else {
			m.begin(n, pages, h)
		}
		if m.r2 == nil || !m.r2.probe { // a probe touches nothing
			for i := h - 1; i >= 0; i-- {
				m.touch(pages[i], m.inf[i])
			}
		}
		for i := 0; i < h; i++ {
			m.pin(pages[i])
			state[pages[i]] = pinned
			leased++
		}
		written, hint = written[:0], hint[:0]
		for i := h; i < len(pages); i++ {
			p := pages[i]
			switch state[p] {
			case present:
				m.touch(p, m.storeHint(p))
				continue
			case writing, pinned:
				continue
			}
			if capacity-used+resident-leased < 1 {
				continue // NoSpace
			}
			if used == capacity {
				v := m.victim()
				if state[v] != present {
					panic("replay: MQP chose a victim that is not present and unpinned")
				}
				state[v] = absent
				used--
				resident--
				res.Evictions++
			}
			state[p] = writing
			used++
			written = append(written, p)
			hint = append(hint, m.storeHint(p))
		}
		for k, p := range written {
			state[p] = present
			resident++
			m.commit(p, hint[k])
			res.StoredPages++
		}
		for i := h - 1; i >= 0; i-- {
			m.unpin(pages[i])
			state[pages[i]] = present
			leased--
		}
	}
	return res
}

const (
	mqpQueues    = 4
	mqpMarkersPQ = 32 // markers per queue at most
	mqpMarkers   = mqpQueues * mqpMarkersPQ
	mqpMaxCount  = 15
	mqpNS        = 64 // namespaces
	mqpExplore   = 32 // a cold namespace's every 32nd new block is placed normally
	mqpMinObs    = 32 // distances before the lifetime is set
	mqpHistHalve = 1024
	mqpGuardRel  = 0.1  // cold: namespace hit ratio below this times the global one
	mqpHintMin   = 1024 // the hint table's buckets, at least (capacity/128 above)
)

// mqp is MQP's state (see MQPPages).
type mqp struct {
	st   []uint8 // per block: count (bits 0-3), level (bits 4-5)
	prev []uint32
	next []uint32
	n    uint32 // first sentinel; markers from n+4
	inf  []uint8
	now  int64 // the clock: one tick per block placement

	mkTime []int64
	mkRing [mqpQueues][]int // per queue, marker indexes, oldest first
	mkFree []int
	lastMk int64
	life   int64

	tfp   []uint16 // tip table: fingerprint<<4 | count, 0 = empty
	thand []uint8  // replacement hand per bucket
	tnb   uint64   // buckets

	sfp   []uint16 // distance sampler: fingerprint, 0 = empty
	sep   []uint16 // and epoch
	shand []uint8
	snb   uint64
	sG    int64 // ticks per epoch

	hist [64]uint32
	hn   uint32
	dmin int64 // distances below are not recorded

	ns      uint8
	extIns  uint32 // extending requests' tips inserted (halved with extFnd)
	extFnd  uint32 // ... of which a later request found
	nsHR    [mqpNS]float64
	nsCold  [mqpNS]bool
	nsTick  [mqpNS]int
	gHR     float64
	nsKnown [mqpNS]bool

	hints *hintTable // the sidecar's hint table, which a store takes its count from
	r2    *mqp2State // MQP2's additions (mqp2.go); nil: MQP
}

func newMQP(numIDs, capacity int) *mqp {
	m := &mqp{n: uint32(numIDs), st: make([]uint8, numIDs)}
	k := numIDs + mqpQueues + mqpMarkers
	m.prev, m.next = make([]uint32, k), make([]uint32, k)
	for i := numIDs; i < k; i++ {
		m.prev[i], m.next[i] = uint32(i), uint32(i)
	}
	m.mkTime = make([]int64, mqpMarkers)
	for i := mqpMarkers - 1; i >= 0; i-- {
		m.mkFree = append(m.mkFree, i)
	}
	m.tnb = uint64(max(1, capacity/4))
	m.tfp = make([]uint16, m.tnb*4)
	m.thand = make([]uint8, m.tnb)
	se := max(64, capacity/16)
	m.snb = uint64(se / 4)
	m.sfp = make([]uint16, m.snb*4)
	m.sep = make([]uint16, m.snb*4)
	m.shand = make([]uint8, m.snb)
	m.sG = max(1, int64(capacity/64))
	m.dmin = int64(0.25 * float64(capacity))
	m.hints = newHintTable(max(mqpHintMin, capacity/128))
	return m
}

// hintTable is the sidecar's hint table (sidecar/cache, mqp.go): 4-way
// buckets of fp28<<4 | count4 (0 = empty), round-robin replacement. A
// lookup leaves a count for each digest past its leading hits, a store
// takes it. It is lossy: a request of thousands of small pages overflows
// buckets, and a store whose hint was lost stores its block at count 1
// (MQP) or at its namespace's last hint (MQP2). The models keep it so
// that the live sidecar equals them at any page size.
type hintTable struct {
	hint []uint32
	hand []uint8
	nb   uint64
}

func newHintTable(buckets int) *hintTable {
	return &hintTable{hint: make([]uint32, buckets*4), hand: make([]uint8, buckets), nb: uint64(buckets)}
}

func (t *hintTable) loc(key uint64) (uint64, uint32) {
	h := mqpMix(key ^ 0x5bd1e9955bd1e995)
	f := uint32(h) & 0xfffffff
	if f == 0 {
		f = 1
	}
	return mqpReduce(h, t.nb), f
}

func (t *hintTable) find(key uint64) (int, uint64, uint32) {
	b, f := t.loc(key)
	for i := range 4 {
		if j := int(b)*4 + i; t.hint[j]>>4 == f {
			return j, b, f
		}
	}
	return -1, b, f
}

// set records v for key; a zero forgets key unless zeros is set (MQP2
// records zeros, so that a store can tell one from a lost hint).
func (t *hintTable) set(key uint64, v uint8, zeros bool) {
	j, b, f := t.find(key)
	if v == 0 && !zeros {
		if j >= 0 {
			t.hint[j] = 0
		}
		return
	}
	if j < 0 {
		base := int(b) * 4
		for i := range 4 {
			if t.hint[base+i] == 0 {
				j = base + i
				break
			}
		}
		if j < 0 {
			j = base + int(t.hand[b])
			t.hand[b] = (t.hand[b] + 1) & 3
		}
	}
	t.hint[j] = f<<4 | uint32(v)
}

// take returns and forgets key's hint; ok is false when it has none.
func (t *hintTable) take(key uint64) (v uint8, ok bool) {
	j, _, _ := t.find(key)
	if j < 0 {
		return 0, false
	}
	v = uint8(t.hint[j] & 15)
	t.hint[j] = 0
	return v, true
}

// ---- lists: queue q's sentinel is n+q, marker j is node n+4+j ----

func (m *mqp) sentinel(q int) uint32 { return m.n + uint32(q) }

func (m *mqp) pushFront(q int, x uint32) { // MRU end
	s := m.sentinel(q)
	f := m.next[s]
	m.prev[x], m.next[x] = s, f
	m.prev[f] = x
	m.next[s] = x
}

func (m *mqp) pushBack(q int, x uint32) { // LRU end
	s := m.sentinel(q)
	t := m.prev[s]
	m.next[x], m.prev[x] = s, t
	m.next[t] = x
	m.prev[s] = x
}

func (m *mqp) unlink(x uint32) {
	a, c := m.prev[x], m.next[x]
	m.next[a], m.prev[c] = c, a
}

// tail is the LRU end of queue q.
func (m *mqp) tail(q int) (uint32, bool) {
	s := m.sentinel(q)
	t := m.prev[s]
	return t, t != s
}

func (m *mqp) isMarker(x uint32) bool { return x >= m.n+mqpQueues }

func mqpMix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func mqpReduce(h, n uint64) uint64 { hi, _ := bits.Mul64(h, n); return hi }

func (m *mqp) key(p uint32) uint64 { return uint64(p) ^ uint64(m.ns)<<32 }

// ---- tip table ----

func (m *mqp) tloc(p uint32) (uint64, uint16) {
	h := mqpMix(m.key(p) ^ 0xabcdef12345)
	f := uint16(h) & 0xfff
	if f == 0 {
		f = 1
	}
	return mqpReduce(h, m.tnb), f
}

func (m *mqp) tfind(p uint32) int {
	b, f := m.tloc(p)
	for i := range 4 {
		if j := int(b)*4 + i; m.tfp[j]>>4 == f {
			return j
		}
	}
	return -1
}

// tinsert records p as a tip (count 1; count 0 when ext, an extending
// request's tip, until a later request finds it) unless it is one;
// it reports whether it inserted.
func (m *mqp) tinsert(p uint32, ext bool) bool {
	if m.tfind(p) >= 0 {
		return false
	}
	b, f := m.tloc(p)
	j := -1
	for i := range 4 {
		if m.tfp[int(b)*4+i] == 0 {
			j = int(b)*4 + i
			break
		}
	}
	if j < 0 {
		j = int(b)*4 + int(m.thand[b])
		m.thand[b] = (m.thand[b] + 1) & 3
	}
	m.tfp[j] = f << 4
	if !ext {
		m.tfp[j] |= 1
	}
	return true
}

// extends reports whether the chains that requests extend come back:
// of the last (about) 1,024 tips of extending requests inserted, more
// than half found again, with at least 32 inserted.
func (m *mqp) extends() bool { return m.extIns >= mqpMinObs && 2*m.extFnd > m.extIns }

// ---- distance sampler ----

func (m *mqp) sampled(p uint32) bool { return mqpMix(m.key(p)^0x1234567)&15 == 0 }

func (m *mqp) sloc(p uint32) (uint64, uint16) {
	h := mqpMix(m.key(p) ^ 0x7777)
	f := uint16(h)
	if f == 0 {
		f = 1
	}
	return mqpReduce(h, m.snb), f
}

func (m *mqp) sfind(p uint32) int {
	b, f := m.sloc(p)
	for i := range 4 {
		if j := int(b)*4 + i; m.sfp[j] == f {
			return j
		}
	}
	return -1
}

func (m *mqp) sinsert(p uint32) {
	b, f := m.sloc(p)
	j := -1
	for i := range 4 {
		if m.sfp[int(b)*4+i] == 0 {
			j = int(b)*4 + i
			break
		}
	}
	if j < 0 {
		j = int(b)*4 + int(m.shand[b])
		m.shand[b] = (m.shand[b] + 1) & 3
	}
	m.sfp[j], m.sep[j] = f, uint16(m.now/m.sG)
}

// observe records a re-access distance and sets the lifetime to the
// upper edge of the median's bin.
func (m *mqp) observe(d int64) {
	if d < m.dmin {
		return
	}
	m.hist[min(63, int(4*math.Log2(float64(max(d, 1)))))]++
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
			m.life = int64(math.Exp(float64(i+1) / 4 * math.Log(2))) // as the simulator (and the sidecar) compute it: 7, not 8, at b+1 = 12
			return
		}
	}
}

// begin is a request's lookup: the guard, the tip history, the sampler.
func (m *mqp) begin(ns uint8, pages []uint32, h int) {
	m.ns = ns
	if len(pages) > 0 {
		r := float64(h) / float64(len(pages))
		if !m.nsKnown[ns] {
			m.nsKnown[ns], m.nsHR[ns] = true, r
		}
		m.nsHR[ns] += (r - m.nsHR[ns]) / 64
		m.gHR += (r - m.gHR) / 64
		m.nsCold[ns] = m.nsHR[ns] < mqpGuardRel*m.gHR
	}
	if cap(m.inf) < len(pages) {
		m.inf = make([]uint8, 2*len(pages))
	}
	m.inf = m.inf[:len(pages)]
	var run uint8
	found := false
	for i := len(pages) - 1; i >= 0; i-- {
		if j := m.tfind(pages[i]); j >= 0 {
			c := uint8(m.tfp[j] & 15)
			if c == 0 { // an extending request's tip, found the first time
				c = 1
				m.tfp[j]++
				m.extFnd++
			}
			run = max(run, c)
			if c < mqpMaxCount {
				m.tfp[j]++
			}
		}
		m.inf[i] = run
		if m.sampled(pages[i]) {
			if k := m.sfind(pages[i]); k >= 0 {
				if !found {
					found = true
					m.observe((m.now/m.sG - int64(m.sep[k])) & 0xffff * m.sG)
				}
				m.sep[k] = uint16(m.now / m.sG)
			}
		}
	}
	if len(pages) > 0 {
		last := pages[len(pages)-1]
		ext := h > 0 && h < len(pages)
		if ext && m.extends() && !m.nsCold[ns] {
			for i := h; i < len(pages); i++ {
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
		if m.sampled(last) && m.sfind(last) < 0 {
			m.sinsert(last)
		}
	}
	for i := h; i < len(pages); i++ {
		m.hints.set(m.key(pages[i]), m.inf[i], false)
	}
}

func mqpLevel(c uint8) int {
	switch {
	case c >= 8:
		return 3
	case c >= 4:
		return 2
	case c >= 2:
		return 1
	}
	return 0
}

func (m *mqp) level(p uint32) int { return int(m.st[p]>>4) & 3 }

// place puts p at the MRU end of its count's queue and ticks.
func (m *mqp) place(p uint32) {
	q := mqpLevel(m.st[p] & 15)
	m.st[p] = uint8(q)<<4 | m.st[p]&15
	m.pushFront(q, p)
	m.tick()
}

// storeHint is the count the request's lookup left for page p (past
// its leading hits), taken from the hint table (none:
// 0 under MQP, the namespace's last under MQP2; mqp2FreshHint: a fresh
// request's cold block).
func (m *mqp) storeHint(p uint32) uint8 {
	v, ok := m.hints.take(m.key(p))
	if m.r2 == nil || ok {
		if m.r2 != nil {
			m.r2.last[m.ns] = v
		}
		return v
	}
	// MQP2: a lost hint is the namespace's last one taken (mqp2.go).
	return m.r2.last[m.ns]
}

// touch is a reuse of p by a request that inherited count inf (a
// fresh request's mark counts as none).
func (m *mqp) touch(p uint32, inf uint8) {
	if m.r2 != nil && inf == mqp2FreshHint {
		inf = 0
	}
	m.unlink(p)
	c := min(mqpMaxCount, max(m.st[p]&15+1, inf+1))
	m.st[p] = m.st[p]&0x30 | c
	m.place(p)
}

func (m *mqp) pin(p uint32)   { m.unlink(p) }
func (m *mqp) unpin(p uint32) { m.pushFront(m.level(p), p) }

// commit places new block p at the count its request's lookup left for
// it plus one (under MQP2, a fresh request's cold block at the LRU end
// of queue 0).
func (m *mqp) commit(p uint32, inf uint8) {
	if m.r2 != nil && inf == mqp2FreshHint {
		m.st[p] = 1
		m.pushBack(0, p)
		m.tick()
		return
	}
	c := min(mqpMaxCount, inf+1)
	m.st[p] = c
	if c == 1 && m.nsCold[m.ns] {
		m.nsTick[m.ns]++
		if m.nsTick[m.ns]%mqpExplore != 0 {
			m.pushBack(0, p)
			m.tick()
			return
		}
	}
	m.place(p)
}

func (m *mqp) victim() uint32 {
	for q := range mqpQueues {
		for {
			x, ok := m.tail(q)
			if !ok {
				break
			}
			if m.isMarker(x) {
				m.dropMarker(q)
				continue
			}
			m.unlink(x)
			return x
		}
	}
	panic("replay: MQP has no evictable block")
}

func (m *mqp) dropMarker(q int) {
	k := m.mkRing[q][0]
	m.mkRing[q] = m.mkRing[q][1:]
	m.unlink(m.n + mqpQueues + uint32(k))
	m.mkFree = append(m.mkFree, k)
}

func (m *mqp) tick() {
	m.now++
	if m.now-m.lastMk >= max(1, m.life/8) {
		m.lastMk = m.now
		for q := 1; q < mqpQueues; q++ {
			if len(m.mkFree) == 0 || len(m.mkRing[q]) >= mqpMarkersPQ {
				continue
			}
			k := m.mkFree[len(m.mkFree)-1]
			m.mkFree = m.mkFree[:len(m.mkFree)-1]
			m.mkTime[k] = m.now
			m.mkRing[q] = append(m.mkRing[q], k)
			m.pushFront(q, m.n+mqpQueues+uint32(k))
		}
	}
	for q := 1; q < mqpQueues; q++ {
		for k := 0; k < 2; k++ {
			x, ok := m.tail(q)
			if !ok || len(m.mkRing[q]) == 0 {
				break
			}
			if m.now-m.mkTime[m.mkRing[q][0]] <= m.life/int64(q) {
				break
			}
			if m.isMarker(x) { // the oldest marker reached the end
				m.dropMarker(q)
				k--
				continue
			}
			m.unlink(x)
			m.st[x] = uint8(q-1)<<4 | m.st[x]&15
			m.pushFront(q-1, x)
		}
	}
}
