package replay

import "math"

// MQP2 replays w through MQP2Pages, every request in one namespace.
func MQP2(w *Workload, capacity int) PolicyResult {
	return MQP2Pages(workloadPages(w), nil, w.NumPageIDs(), capacity)
}

// MQP2Pages is MQP revised for engine page sizes (`--cache.policy
// mqp2`), driven through the sidecar's call sequence exactly as
// MQPPages drives MQP. Everything of MQPPages holds but these, each of
// which made MQP depend on how many pages a prompt is cut into:
//
//   - The tip is not always a request's last page. A learner measures,
//     counting back from a request's last page, where a later request
//     finds it: one request in 8 (by the hash of its last page) records
//     its pages at 0, 1, 3, 7, 15, 31, 63 and 127 pages from its end
//     (those past its leading hits) in a table of 1,024 entries, and a
//     lookup that meets one counts it found once. The tip is the page at
//     the smallest of those offsets found at least 3/4 as often as the
//     best (0 until 32 of each are recorded). Where a prompt's last page
//     is the start of the next turn's prompt (an engine's real chat
//     history) that is 0, MQP's tip; where the last part of a prompt is
//     never sent again (the traces' hashed blocks expanded into engine
//     pages: a partial last block hashes as itself, the next turn's full
//     block as another), it is the page a block or so back that the next
//     turn does share, at any page size. MQP's tip at 16- and 32-token
//     pages lies in that unshared part: no tip was ever found, the
//     lifetime never measured, and MQP evicted as LRU does.
//   - Only anchor pages are tips and only anchors are looked up in the
//     tip table: a page is an anchor when the low log2((off+1)/2) bits of
//     its hash are zero (mqp2Anchor; every page while the offset is 0 or
//     1), and the tip is the nearest anchor at or before the offset (a
//     request with none there records no tip). A tip table entry is a
//     12-bit fingerprint; probed at every page, a lookup at 16-token
//     pages checked it 32 times as often as at 512 and its false finds
//     gave pages an unrelated tip's count (the trace at 2,000 blocks:
//     0.915 of the 512-token ratio; with anchors 0.968).
//   - The lifetime histogram counts distances relative to the capacity
//     (distance x 64 / capacity, 4 bins per octave), so its 64 bins span
//     C/4 to 1,024 C whatever a block's size; MQP's span 1 to 2^16
//     ticks, which at 16-token pages cut the lifetime short.
//   - The distance sampler takes one tip in 4 (MQP: 16) into
//     max(1,024, C/16) entries (MQP: max(64, C/16)): a tip is one per
//     request whatever the page size, and at 512-token pages MQP's 64
//     entries left the lifetime to chance (a different hash moved its
//     hit ratio by up to 7%).
//   - A fresh request (no leading hit, no tip found) that comes back
//     rarely is a scan: one fresh request in 8 records its tip in the
//     learner's table too, and while under a tenth of those are found
//     again (32 at least), a fresh request's new blocks go to the LRU end
//     of queue 0, except every 32nd fresh request's (MQP's scan guard
//     does the same per namespace, and cannot see one tenant's scan).
//   - A lookup identical to one of its namespace's last 16 (the same
//     last digest and length) is a probe, a repeat of a request already
//     counted: it changes no count, tip or history and touches nothing.
//   - The counts a lookup leaves for its missed pages wait in the hint
//     table as in the sidecar, max(4,096, C/64) buckets of 4, and this
//     model keeps that table too (it is lossy: a request of thousands
//     of pages may overflow a bucket, and the live sidecar must equal it).
func MQP2Pages(reqs [][]uint32, ns []uint8, numIDs, capacity int) PolicyResult {
	if capacity <= 0 {
		res := PolicyResult{Policy: "mqp2", CapacityPages: capacity, Requests: len(reqs)}
		for _, r := range reqs {
			res.TotalPages += int64(len(r))
		}
		return res
	}
	m := newMQP2(numIDs, capacity)
	res := m.replay(reqs, ns, capacity)
	res.Policy = "mqp2"
	return res
}

const (
	mqp2OffK       = 8 // offsets 2^k - 1 pages from a request's end, k < 8
	mqp2Fresh      = mqp2OffK
	mqp2OffEntries = 1024 // the learner's table
	mqp2OffRate    = 8    // one request in 8 records its offsets
	mqp2OffMin     = 32   // records of an offset before it is chosen
	mqp2Probes     = 16   // a namespace's last lookups a probe is checked against
	mqp2HintMin    = 4096 // hint table buckets, at least
	mqp2SampleMin  = 1024 // distance sampler entries, at least
	// mqp2FreshHint is the hint a cold fresh request leaves for its
	// missed blocks: stored at count 1 at the LRU end of queue 0 (a
	// count's hint is at most 14, which gives the same count 15).
	mqp2FreshHint = 15
)

// mqp2State is what MQP2 adds to MQP's state.
type mqp2State struct {
	offFP   [mqp2OffEntries]uint16 // learner: fingerprint, 0 = empty
	offTag  [mqp2OffEntries]uint8  // offset index (mqp2Fresh: a fresh request's tip) | 0x80 once found
	offHand [mqp2OffEntries / 4]uint8
	offIns  [mqp2OffK + 1]uint32
	offFnd  [mqp2OffK + 1]uint32
	off     int // the tip's offset from a request's last page

	fresh  bool   // the current request's new blocks go to the cold end (mqp2FreshHint)
	freshN uint32 // fresh requests while fresh ones are cold (explore)

	probes  [mqpNS][mqp2Probes]uint64
	probeAt [mqpNS]uint8
	probe   bool // the current request is a probe

	last     [mqpNS]uint8 // per namespace, the last hint taken (hintTake)
	capacity int
}

func newMQP2(numIDs, capacity int) *mqp {
	m := newMQP(numIDs, capacity)
	r := &mqp2State{capacity: capacity}
	se := max(mqp2SampleMin, capacity/16)
	m.snb = uint64(se / 4)
	m.sfp = make([]uint16, m.snb*4)
	m.sep = make([]uint16, m.snb*4)
	m.shand = make([]uint8, m.snb)
	m.hints = newHintTable(max(mqp2HintMin, capacity/64))
	m.r2 = r
	m.life = int64(capacity) // until the lifetime is measured: one pass of the pool
	return m
}

func mqp2OffOf(k int) int { return 1<<k - 1 }

// mqp2Anchor reports whether the page of history key k is an anchor while
// the tip's offset is off (2^j - 1): one page in max(1, (off+1)/2), by
// the page's hash alone (every page at offset 0 or 1). Only anchors are
// tips and only anchors are looked up in the tip table.
func mqp2Anchor(k uint64, off int) bool {
	return mqpMix(k^0xa7c4)&(max(1, uint64(off+1)>>1)-1) == 0
}

func (r *mqp2State) offLoc(key uint64) (int, uint16) {
	h := mqpMix(key ^ 0x0ff5e7)
	f := uint16(h>>32) | 1
	return int(mqpReduce(h, mqp2OffEntries/4)), f
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

// offInsert records key under tag k (an offset index, or mqp2Fresh).
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
	// The smallest offset found at least 3/4 as often as the best.
	var best uint64 // found/inserted as a 32.32 fixed-point fraction
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

// freshCold reports whether fresh requests' tips come back rarely: under
// a tenth of at least 32 recorded.
func (r *mqp2State) freshCold() bool {
	return r.offIns[mqp2Fresh] >= mqp2OffMin && 10*r.offFnd[mqp2Fresh] < r.offIns[mqp2Fresh]
}

// isProbe reports whether a lookup of pages in namespace ns repeats one
// of its namespace's last mqp2Probes lookups; otherwise it records it.
func (m *mqp) isProbe(ns uint8, pages []uint32) bool {
	r := m.r2
	fp := mqpMix(m.key(pages[len(pages)-1])^uint64(len(pages))<<40^0x9b0be5) | 1
	for _, x := range r.probes[ns] {
		if x == fp {
			return true
		}
	}
	r.probes[ns][r.probeAt[ns]] = fp
	r.probeAt[ns] = (r.probeAt[ns] + 1) % mqp2Probes
	return false
}

// ---- MQP2's versions of MQP's steps ----

func (m *mqp) sampled2(p uint32) bool { return mqpMix(m.key(p)^0x1234567)&3 == 0 }

// observe2 is observe with distances relative to the capacity.
func (m *mqp) observe2(d int64) {
	if d < m.dmin {
		return
	}
	r := d * 64 / int64(m.r2.capacity)
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

// mqp2Life is the lifetime, in ticks, of the median's bin b: its upper
// edge, 2^((b+1)/4) x capacity / 64 (as the sidecar computes it).
func mqp2Life(b, capacity int) int64 {
	return int64(math.Exp(float64(b+1)/4*math.Log(2)) * float64(capacity) / 64)
}

// begin2 is MQP2's lookup step (MQPPages's begin, with the changes of
// MQP2Pages).
func (m *mqp) begin2(ns uint8, pages []uint32, h int) {
	r := m.r2
	m.ns = ns
	r.probe, r.fresh = false, false
	if len(pages) == 0 {
		return
	}
	if m.isProbe(ns, pages) {
		r.probe = true
		return
	}
	n := len(pages)
	hr := float64(h) / float64(n)
	if !m.nsKnown[ns] {
		m.nsKnown[ns], m.nsHR[ns] = true, hr
	}
	m.nsHR[ns] += (hr - m.nsHR[ns]) / 64
	m.gHR += (hr - m.gHR) / 64
	m.nsCold[ns] = m.nsHR[ns] < mqpGuardRel*m.gHR
	if cap(m.inf) < n {
		m.inf = make([]uint8, 2*n)
	}
	m.inf = m.inf[:n]
	var run uint8
	found := false
	for i := n - 1; i >= 0; i-- {
		k := m.key(pages[i])
		if !mqp2Anchor(k, r.off) {
			// not an anchor: no tip is recorded here, none looked for
		} else if j := m.tfind(pages[i]); j >= 0 {
			c := uint8(m.tfp[j] & 15)
			if c == 0 {
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
		r.offProbe(k)
		if m.sampled2(pages[i]) {
			if s := m.sfind(pages[i]); s >= 0 {
				if !found {
					found = true
					m.observe2((m.now/m.sG - int64(m.sep[s])) & 0xffff * m.sG)
				}
				m.sep[s] = uint16(m.now / m.sG)
			}
		}
	}
	last := m.key(pages[n-1])
	if mqpMix(last^0x0ff5e7a)%mqp2OffRate == 0 {
		for k := range mqp2OffK {
			if j := n - 1 - mqp2OffOf(k); j >= h && j >= 0 {
				r.offInsert(m.key(pages[j]), k)
			}
		}
	}
	// The tip: the nearest anchor at or before the offset (none in a
	// request shorter than it, or with no anchor there; the sampler and
	// the fresh record then take the page at the offset, or the first).
	t, tip := pages[max(0, n-1-r.off)], false
	for i := n - 1 - r.off; i >= 0; i-- {
		if mqp2Anchor(m.key(pages[i]), r.off) {
			t, tip = pages[i], true
			break
		}
	}
	ext := h > 0 && h < n
	if ext && m.extends() && !m.nsCold[ns] {
		for i := h; i < n; i++ {
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
	if m.sampled2(t) && m.sfind(t) < 0 {
		m.sinsert(t)
	}
	if h == 0 && run == 0 {
		if mqpMix(m.key(t)^0xf7e5)%mqp2OffRate == 0 {
			r.offInsert(m.key(t), mqp2Fresh)
		}
		if r.freshCold() {
			r.freshN++
			r.fresh = r.freshN%mqpExplore != 0
		}
	}
	for i := h; i < n; i++ {
		v := min(m.inf[i], mqp2FreshHint-1)
		if r.fresh {
			v = mqp2FreshHint
		}
		if i == h {
			r.last[ns] = v
		}
		m.hints.set(m.key(pages[i]), v, true)
	}
}
