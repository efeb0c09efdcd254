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
	return oracleFleet(reqs, nodeOf, nodes, numIDs, capacity, tier, 0, "lru")
}

// OracleNodeTier is OracleFleet with the node tier (`ringside node`,
// sidecar/node) for the tier and pods whose pools evict by policy
// ("lru", or "mqp" and "mqp2": MQPPages' and MQP2Pages' model of each
// pod's pool, driven through the same calls: fleetPool). The node tier
// is one LRU pool of tierCapacity pages that the pods (nodes,
// podCapacity slots each) share, as its index keeps it with --pod-share
// 1 (index.go): a lookup touches nothing; a fetch's Get pins each
// fetched page, making it the most recently used, in the fetch's order;
// a write of a page the tier holds changes nothing (Exists), of a page
// it lacks takes a free slot or evicts the least recently used page
// (nothing is pinned then: one request at a time) and commits it to the
// front, in the pod's commit order (one writer). Pages a pod fetched from
// the tier are not written back.
func OracleNodeTier(reqs [][]uint32, nodeOf []int, pods, numIDs, podCapacity, tierCapacity int, policy string) FleetResult {
	return oracleFleet(reqs, nodeOf, pods, numIDs, podCapacity, true, max(tierCapacity, 1), policy)
}

// newFleetPool is one node's pool of capacity slots under policy (lru,
// mqp or mqp2).
func newFleetPool(policy string, numIDs, capacity int) fleetPool {
	switch policy {
	case "mqp":
		return newMQPPool(newMQP(numIDs, capacity), numIDs, capacity)
	case "mqp2":
		return newMQPPool(newMQP2(numIDs, capacity), numIDs, capacity)
	}
	return newLRUModel(numIDs, capacity)
}

func oracleFleet(reqs [][]uint32, nodeOf []int, nodes, numIDs, capacity int, tier bool, tierCap int, policy string) FleetResult {
	res := FleetResult{OracleResult: OracleResult{CapacityPages: capacity, Requests: len(reqs)}, Nodes: nodes, Tier: tier, TierCapacity: tierCap}
	pendLimit := FetchPendingLimit(capacity)
	ns := make([]fleetPool, nodes)
	for i := range ns {
		ns[i] = newFleetPool(policy, numIDs, capacity)
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
		h := m.lookup(pages)
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
				m.pin(int32(pages[i]))
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
					if m.stateOf(p) == present {
						covered = i + 1
						continue
					}
					if len(fetched) >= pendLimit || !m.reserve(p) {
						break
					}
					fetched = append(fetched, p)
					covered = i + 1
				}
				for _, p := range fetched {
					if nt != nil { // the Get's pin: the most recent
						nt.touch(p)
					}
				}
				for _, p := range fetched {
					m.commit(p)
					res.FetchedPages++
				}
				for i := h; i < covered && m.stateOf(int32(pages[i])) == present; i++ {
					m.pin(int32(pages[i]))
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
			switch m.stateOf(p) {
			case present:
				m.access(p)
				res.PresentPages++
				continue
			case writing:
				res.PresentPages++
				continue
			}
			if !m.reserve(p) {
				res.SkippedPages++
				continue
			}
			written = append(written, p)
		}
		for _, p := range written {
			m.commit(p)
			res.StoredPages++
			if tier { // write-through: the write pins it as it commits
				m.pin(p)
			}
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
				m.unpin(p)
			}
		}
		for i := leased - 1; i >= 0; i-- {
			m.unpin(int32(pages[i]))
		}
	}
	for _, m := range ns {
		ev, used := m.counts()
		res.Evictions += ev
		res.Resident += used
	}
	if nt != nil {
		res.TierEvictions = nt.evictions
	}
	return res
}

// fleetPool is one node's pool in the fleet model, driven through the
// cache's calls: page states and the policy's eviction order.
type fleetPool interface {
	stateOf(p int32) uint8
	// lookup is Lookup: the leading run of present pages (its length
	// returned), the policy's per-request step and the run's hits
	// touched in reverse.
	lookup(pages []uint32) int
	pin(p int32)   // a present page's first pin: out of the eviction order
	unpin(p int32) // its last pin's end: back in, at the front
	access(p int32)
	// reserve takes a slot for absent p (a store's or a fetch's), evicting
	// if none is free; false: none is free or evictable.
	reserve(p int32) bool
	commit(p int32) // reserved p becomes present
	counts() (evictions int64, used int)
}

func (m *lruModel) stateOf(p int32) uint8 { return m.state[p] }

func (m *lruModel) lookup(pages []uint32) int {
	h := 0
	for h < len(pages) && m.state[pages[h]] == present {
		h++
	}
	for i := h - 1; i >= 0; i-- {
		m.touch(int32(pages[i]))
	}
	return h
}

func (m *lruModel) pin(p int32)    { m.remove(p) }
func (m *lruModel) unpin(p int32)  { m.pushFront(p) }
func (m *lruModel) access(p int32) { m.touch(p) }

func (m *lruModel) reserve(p int32) bool {
	if !m.take() {
		return false
	}
	m.state[p] = writing
	return true
}

func (m *lruModel) commit(p int32) {
	m.state[p] = present
	m.pushFront(p)
}

func (m *lruModel) counts() (int64, int) { return m.evictions, m.used }

// mqpPool is a pod's pool under MQP or MQP2 (m.r2 set): the policy's
// state (mqp.go, mqp2.go) with the page states MQPPages keeps, driven
// as the cache calls it (sidecar/cache: Lookup runs the per-request step
// and touches the hits; a reservation evicts the policy's victim and
// takes the page's hint; the commit places it; a pin takes a block out
// of its queue, the last pin's end puts it at the front of its level's).
type mqpPool struct {
	m         *mqp
	state     []uint8
	hint      []uint8 // the count a reserved page's reservation took, for its commit
	capacity  int
	used      int // present and reserved slots
	listed    int // present, unpinned pages: the evictable
	evictions int64
}

func newMQPPool(m *mqp, numIDs, capacity int) *mqpPool {
	return &mqpPool{m: m, state: make([]uint8, numIDs), hint: make([]uint8, numIDs), capacity: capacity}
}

func (q *mqpPool) stateOf(p int32) uint8 { return q.state[p] }

func (q *mqpPool) lookup(pages []uint32) int {
	h := 0
	for h < len(pages) && q.state[pages[h]] == present {
		h++
	}
	m := q.m
	if m.r2 != nil {
		m.begin2(0, pages, h)
	} else {
		m.begin(0, pages, h)
	}
	if m.r2 == nil || !m.r2.probe { // a probe touches nothing
		for i := h - 1; i >= 0; i-- {
			m.touch(pages[i], m.inf[i])
		}
	}
	return h
}

func (q *mqpPool) pin(p int32)    { q.m.pin(uint32(p)); q.listed-- }
func (q *mqpPool) unpin(p int32)  { q.m.unpin(uint32(p)); q.listed++ }
func (q *mqpPool) access(p int32) { q.m.touch(uint32(p), q.m.storeHint(uint32(p))) }

func (q *mqpPool) reserve(p int32) bool {
	if q.capacity-q.used+q.listed < 1 {
		return false
	}
	if q.used == q.capacity {
		v := q.m.victim()
		if q.state[v] != present {
			panic("replay: MQP chose a victim that is not present and unpinned")
		}
		q.state[v] = absent
		q.used--
		q.listed--
		q.evictions++
	}
	q.used++
	q.state[p] = writing
	q.hint[p] = q.m.storeHint(uint32(p))
	return true
}

func (q *mqpPool) commit(p int32) {
	q.state[p] = present
	q.listed++
	q.m.commit(uint32(p), q.hint[p])
}

func (q *mqpPool) counts() (int64, int) { return q.evictions, q.used }

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
