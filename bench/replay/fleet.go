package replay

import "github.com/ringside-kv/ringside/sidecar/machine"

// FleetResult is what an exact offline model of several nodes gives: one
// LRU pool per node (OraclePages' model each) and, with a tier, a shared
// tier under them that never evicts and holds every page any node stored.
type FleetResult struct {
	OracleResult
	Nodes        int
	Tier         bool
	TierHitPages int64 // pages lookups found in the tier past the node's leading run
	FetchedPages int64 // pages fetched from the tier into a pool
	LoadedPages  int64 // pages the leases held (the engine loads them all)
	MissedLeases int64 // acquires that came back holding nothing
	// A node tier (OracleNodeTier): the tier is an LRU of TierCapacity
	// pages (0: unbounded, the shared tier's model).
	TierCapacity  int
	TierStored    int64 // pages written into the tier (new there)
	TierEvictions int64 // pages the tier evicted
}

// OracleFleet replays reqs one at a time, in order, request i on node
// nodeOf[i], through per-node models of sidecar/cache (world size 1,
// capacity slots each) and, with tier, the shared tier as sidecar/machine
// uses it (l2.go), following the replay engine's calls exactly:
//
//  1. Lookup: h = the node's leading run (its hits touched in reverse);
//     with the tier, c more pages: the leading run of the rest that the
//     tier holds. The engine is told h+c.
//  2. Acquire of [0, h+c): the local run is pinned. The rest is fetched:
//     for each page in order (at most capacity-h of them: the pin share is
//     the pool), a present one is passed over, an absent one takes a slot
//     (evicting the LRU's tail if none is free; none evictable, or
//     FetchPendingLimit pages reserved already: the fetch stops there). The fetched pages commit in
//     order (each to the front of the LRU), then the lease takes the
//     leading present pages after the local run (pinned). A lease of
//     nothing is a miss.
//  3. The engine loads what the lease holds and stores the rest from
//     there (OraclePages' store: present pages touched, absent ones take
//     a slot or are refused, then commit in order).
//  4. Write-through: every page the store committed goes to the tier. Its
//     write pins it while it reads the slot; with one writer the pins end
//     in commit order, each to the front (so the stored pages keep their
//     order), before the engine releases (the replay waits for the writes
//     in this mode).
//  5. Release: the leased pages return to the front in reverse order.
//
// With one node and no tier it is exactly OraclePages.
func OracleFleet(reqs [][]uint32, nodeOf []int, nodes, numIDs, capacity int, tier bool) FleetResult {
	return oracleFleet(reqs, nodeOf, nodes, numIDs, capacity, tier, 0)
}

// OracleNodeTier is OracleFleet with the node tier (`ringside node`,
// sidecar/node) for the tier: one LRU pool of tierCapacity pages that the
// pods (nodes, podCapacity slots each) share, as its index keeps it with
// --pod-share 1 (index.go): a lookup touches nothing; a fetch's Get pins
// each fetched page, making it the most recently used, in the fetch's
// order; a write of a page the tier holds changes nothing (Exists), of a
// page it lacks takes a free slot or evicts the least recently used page
// (nothing is pinned then: one request at a time) and commits it to the
// front, in the pod's commit order (one writer). Pages a pod fetched from
// the tier are not written back.
func OracleNodeTier(reqs [][]uint32, nodeOf []int, pods, numIDs, podCapacity, tierCapacity int) FleetResult {
	return oracleFleet(reqs, nodeOf, pods, numIDs, podCapacity, true, max(tierCapacity, 1))
}

func oracleFleet(reqs [][]uint32, nodeOf []int, nodes, numIDs, capacity int, tier bool, tierCap int) FleetResult {
	res := FleetResult{OracleResult: OracleResult{CapacityPages: capacity, Requests: len(reqs)}, Nodes: nodes, Tier: tier, TierCapacity: tierCap}
	pendLimit := FetchPendingLimit(capacity)
	ns := make([]*lruModel, nodes)
	for i := range ns {
		ns[i] = newLRUModel(numIDs, capacity)
	}
	var inTier []bool
	var nt *lruModel // the node tier's LRU (tierCap > 0)
	if tier && tierCap > 0 {
		nt = newLRUModel(numIDs, tierCap)
	} else if tier {
		inTier = make([]bool, numIDs)
	}
	held := func(p uint32) bool {
		if nt != nil {
			return nt.state[p] == present
		}
		return inTier[p]
	}
	var written, fetched []int32
	for k, pages := range reqs {
		m := ns[nodeOf[k]]
		res.TotalPages += int64(len(pages))
		h := 0
		for h < len(pages) && m.state[pages[h]] == present {
			h++
		}
		for i := h - 1; i >= 0; i-- {
			m.touch(int32(pages[i]))
		}
		c := 0
		if tier {
			for h+c < len(pages) && held(pages[h+c]) {
				c++
			}
		}
		res.HitPages += int64(h + c)
		res.TierHitPages += int64(c)
		leased := 0
		if h+c > 0 {
			for i := 0; i < h; i++ {
				m.remove(int32(pages[i]))
			}
			leased = h
			if c > 0 {
				fetched = fetched[:0]
				covered := 0
				// The Machine scans no more blocks than the uid may still
				// pin (the pin share is the whole pool: the local run is
				// pinned), and reserves no more than its pending share.
				for i := h; i < h+min(c, capacity-h); i++ {
					p := int32(pages[i])
					if m.state[p] == present {
						covered = i + 1
						continue
					}
					if len(fetched) >= pendLimit || !m.take() {
						break
					}
					m.state[p] = writing
					fetched = append(fetched, p)
					covered = i + 1
				}
				for _, p := range fetched {
					if nt != nil { // the Get's pin: the most recent
						nt.touch(p)
					}
				}
				for _, p := range fetched {
					m.state[p] = present
					m.pushFront(p)
					res.FetchedPages++
				}
				for i := h; i < covered && m.state[pages[i]] == present; i++ {
					m.remove(int32(pages[i]))
					leased++
				}
			}
			if leased == 0 {
				res.MissedLeases++
			}
		}
		res.LoadedPages += int64(leased)
		written = written[:0]
		for _, pg := range pages[leased:] {
			p := int32(pg)
			switch m.state[p] {
			case present:
				m.touch(p)
				res.PresentPages++
				continue
			case writing:
				res.PresentPages++
				continue
			}
			if !m.take() {
				res.SkippedPages++
				continue
			}
			m.state[p] = writing
			written = append(written, p)
		}
		for _, p := range written {
			m.state[p] = present
			m.pushFront(p)
			res.StoredPages++
		}
		if tier {
			for _, p := range written { // the writes' pins end in commit order
				switch {
				case nt == nil:
					inTier[p] = true
				case nt.state[p] != present:
					nt.take() // never refused: nothing is pinned between requests
					nt.state[p] = present
					nt.pushFront(p)
					res.TierStored++
				}
				m.remove(p)
				m.pushFront(p)
			}
		}
		for i := leased - 1; i >= 0; i-- {
			m.pushFront(int32(pages[i]))
		}
	}
	for _, m := range ns {
		res.Evictions += m.evictions
		res.Resident += m.used
	}
	if nt != nil {
		res.TierEvictions = nt.evictions
	}
	return res
}

// FetchPendingShare is the replay's sidecars' --limits.pending-share with
// a tier (serve's default): the part of the pool one uid's fetches may
// hold reserved, which bounds the pages one acquire fetches.
const FetchPendingShare = machine.DefaultPendingShare

// FetchPendingLimit is the pages one acquire may fetch into a pool of
// capacity slots (the Machine's pendingLimit).
func FetchPendingLimit(capacity int) int {
	return max(int(float64(capacity)*FetchPendingShare), 1)
}

const (
	absent uint8 = iota
	present
	writing
)

// lruModel is one node's pool: page states and the LRU list of present,
// unpinned pages (index n is the sentinel).
type lruModel struct {
	state      []uint8
	prev, next []int32
	s          int32
	lruLen     int
	used       int // present + writing slots
	capacity   int
	evictions  int64
}

func newLRUModel(n, capacity int) *lruModel {
	m := &lruModel{state: make([]uint8, n), prev: make([]int32, n+1), next: make([]int32, n+1), s: int32(n), capacity: capacity}
	m.prev[m.s], m.next[m.s] = m.s, m.s
	return m
}

func (m *lruModel) remove(p int32) {
	a, b := m.prev[p], m.next[p]
	m.next[a], m.prev[b] = b, a
	m.lruLen--
}

func (m *lruModel) pushFront(p int32) {
	f := m.next[m.s]
	m.prev[p], m.next[p] = m.s, f
	m.prev[f] = p
	m.next[m.s] = p
	m.lruLen++
}

func (m *lruModel) touch(p int32) {
	if m.next[m.s] == p {
		return
	}
	m.remove(p)
	m.pushFront(p)
}

// take reserves a slot, evicting the LRU's tail if none is free; false:
// none is free or evictable.
func (m *lruModel) take() bool {
	if m.capacity-m.used+m.lruLen < 1 {
		return false
	}
	if m.used == m.capacity {
		t := m.prev[m.s]
		m.remove(t)
		m.state[t] = absent
		m.used--
		m.evictions++
	}
	m.used++
	return true
}
