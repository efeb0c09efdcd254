package replay

import "math"

// PolicyResult is what an offline reference policy gives for a workload
// and a capacity (in pages = slots), one request at a time in order.
//
// A request's prefix hit is the leading run of its pages present when it
// is looked up (what an engine can load); its block hits are all of its
// pages present then, leading or not. Prefix hits <= block hits.
type PolicyResult struct {
	Policy        string // "arc" or "min"
	CapacityPages int
	Requests      int
	TotalPages    int64
	HitPages      int64 // prefix (leading-run) hits
	BlockHitPages int64 // pages present at lookup, anywhere in the request
	StoredPages   int64 // pages admitted
	Evictions     int64
	FailedStores  int64 // ARC: prepare_store calls that returned None
}

// HitRatio is the prefix-hit ratio, HitPages / TotalPages.
func (p PolicyResult) HitRatio() float64 { return ratio(p.HitPages, p.TotalPages) }

// BlockHitRatio is BlockHitPages / TotalPages.
func (p PolicyResult) BlockHitRatio() float64 { return ratio(p.BlockHitPages, p.TotalPages) }

func workloadPages(w *Workload) [][]uint32 {
	reqs := make([][]uint32, len(w.Requests))
	for i := range w.Requests {
		reqs[i] = w.Requests[i].Pages
	}
	return reqs
}

// ARC replays w through ARCPages.
func ARC(w *Workload, capacity int) PolicyResult {
	return ARCPages(workloadPages(w), w.NumPageIDs(), capacity)
}

// ARCPages is ARC as vLLM's offloading connector runs it, one request at
// a time, over dense page ids (distinct within a request, in [0, numIDs)).
//
// The policy is vLLM's ARCOffloadingManager, vllm/v1/kv_offload/
// arc_manager.py (vllm-project/vllm, read at commit 9dc49464); the calls
// and their order are the scheduler side of the offloading connector,
// vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py
// (OffloadingConnectorScheduler, read at commit 73689081). T1 and T2 are
// OrderedDicts whose end is the most recent; B1 and B2 are ghost lists;
// target_t1_size is a float starting at 0; cache_capacity is the pool's
// blocks (the capacity here). Per request with n full blocks:
//
//  1. get_num_new_matched_tokens calls manager.touch(all n blocks) before
//     the lookup. touch walks the blocks in reverse order (block n-1
//     first, so block 0 ends most recent): a ready block in T1 moves to
//     the end of T2; a block in T1 not yet ready (prepared, not completed)
//     is put back at the end of T1 ("just prepared to be stored, not
//     really touched twice"; the file pops it and calls move_to_end on
//     the popped key, which would raise, so this follows the comment and
//     vllm/v1/kv_offload/cpu/policies/arc.py, which re-inserts it at the
//     end); a block in T2 moves to the end of T2; a block in B1 raises
//     target_t1_size by max(1, |B2|/|B1|) (true division), capped at
//     cache_capacity, and moves to the end of B1; a block in B2 lowers it
//     by max(1, |B1|/|B2|), floored at 0, and moves to the end of B2. So
//     every block present when a request arrives is promoted to T2, hit
//     or not (a request's touch covers its whole prompt, not the hits).
//  2. lookup: the leading run of blocks in T1 or T2 and ready (the prefix
//     hit). prepare_load and complete_load only count references; the
//     request waits for its load before it computes, so every count is
//     back to 0 before its store.
//  3. _get_reqs_to_store calls prepare_store(blocks [hit, n)) once (the
//     whole prompt computed in one step; chunked prefill would call it
//     per chunk). It keeps the blocks in neither T1 nor T2, in order, and
//     evicts (count - free slots) blocks one at a time: from the front
//     (least recent) of T1 when |T1| >= int(target_t1_size), else (or
//     with T1 empty) from the front of T2, the evicted block appended to
//     B1 or B2; when T2 is empty there it returns None (the for-else of
//     its T2 loop), even with blocks left in T1 under the target: the
//     store is skipped, the blocks already evicted stay evicted
//     (FailedStores). Then each ghost
//     list is trimmed from its front to cache_capacity, and the kept
//     blocks are appended to T1 (not ready) and dropped from B1 and B2.
//     Nothing protects the request's own present blocks from eviction.
//  4. When prepare_store stored something, the connector calls
//     manager.touch(blocks [0, n)) again (step 1's rules): the new blocks
//     are not ready, so they are re-inserted at the end of T1 in reverse
//     order (the first stored block most recent, the last least recent),
//     and the present ones move to the end of T2 (block 0 last).
//  5. complete_store marks them ready (the store finishes before the
//     next request, one request at a time).
//
// Only prompt blocks are modelled (vLLM also stores the decode's blocks),
// and no GPU prefix cache sits in front (num_computed_tokens = 0).
func ARCPages(reqs [][]uint32, numIDs, capacity int) PolicyResult {
	a := newARC(numIDs, capacity)
	res := PolicyResult{Policy: "arc", CapacityPages: capacity, Requests: len(reqs)}
	for _, pages := range reqs {
		a.request(pages, &res)
	}
	return res
}

// request runs one request through steps 1 to 5 and counts it in res.
func (a *arcState) request(pages []uint32, res *PolicyResult) {
	res.TotalPages += int64(len(pages))
	if len(pages) == 0 {
		return
	}
	for _, p := range pages {
		if a.cached(p) {
			res.BlockHitPages++
		}
	}
	a.touch(pages) // 1
	h := 0         // 2
	for h < len(pages) && a.cached(pages[h]) && a.ready[pages[h]] {
		h++
	}
	res.HitPages += int64(h)
	a.store = a.store[:0] // 3
	for _, p := range pages[h:] {
		if !a.cached(p) {
			a.store = append(a.store, int32(p))
		}
	}
	if len(a.store) == 0 {
		return
	}
	ev, ok := a.prepareStore(a.store)
	res.Evictions += int64(ev)
	if !ok {
		res.FailedStores++
		return
	}
	res.StoredPages += int64(len(a.store))
	a.touch(pages) // 4
	for _, p := range a.store {
		a.ready[p] = true // 5
	}
}

const (
	arcNone uint8 = iota
	arcT1
	arcT2
	arcB1
	arcB2
)

// arcState holds T1, T2, B1 and B2 as doubly linked lists over the page
// ids (a page is in at most one), sentinel of list k at index n+k-1; the
// front (next of the sentinel) is the least recent, the back the most.
type arcState struct {
	n, capacity int
	target      float64
	where       []uint8
	ready       []bool
	prev, next  []int32
	size        [5]int
	store       []int32
}

func (a *arcState) cached(p uint32) bool { w := a.where[p]; return w == arcT1 || w == arcT2 }

// list returns the pages of list k, least recent first.
func (a *arcState) list(k uint8) []uint32 {
	var out []uint32
	s := a.sentinel(k)
	for p := a.next[s]; p != s; p = a.next[p] {
		out = append(out, uint32(p))
	}
	return out
}

func newARC(n, capacity int) *arcState {
	a := &arcState{n: n, capacity: capacity, where: make([]uint8, n), ready: make([]bool, n),
		prev: make([]int32, n+4), next: make([]int32, n+4)}
	for k := arcT1; k <= arcB2; k++ {
		s := a.sentinel(k)
		a.prev[s], a.next[s] = s, s
	}
	return a
}

func (a *arcState) sentinel(k uint8) int32 { return int32(a.n) + int32(k) - 1 }

func (a *arcState) remove(p int32) {
	x, y := a.prev[p], a.next[p]
	a.next[x], a.prev[y] = y, x
	a.size[a.where[p]]--
	a.where[p] = arcNone
}

func (a *arcState) pushBack(k uint8, p int32) {
	s := a.sentinel(k)
	l := a.prev[s]
	a.prev[p], a.next[p] = l, s
	a.next[l] = p
	a.prev[s] = p
	a.where[p] = k
	a.size[k]++
}

func (a *arcState) moveToEnd(p int32) {
	k := a.where[p]
	a.remove(p)
	a.pushBack(k, p)
}

// front is the least recent page of list k, or -1.
func (a *arcState) front(k uint8) int32 {
	s := a.sentinel(k)
	if f := a.next[s]; f != s {
		return f
	}
	return -1
}

func (a *arcState) touch(pages []uint32) {
	for i := len(pages) - 1; i >= 0; i-- {
		p := int32(pages[i])
		switch a.where[p] {
		case arcT1:
			a.remove(p)
			if a.ready[p] {
				a.pushBack(arcT2, p)
			} else {
				a.pushBack(arcT1, p)
			}
		case arcT2:
			a.moveToEnd(p)
		case arcB1:
			a.target = math.Min(a.target+math.Max(1, float64(a.size[arcB2])/float64(a.size[arcB1])), float64(a.capacity))
			a.moveToEnd(p)
		case arcB2:
			a.target = math.Max(a.target-math.Max(1, float64(a.size[arcB1])/float64(a.size[arcB2])), 0)
			a.moveToEnd(p)
		}
	}
}

// prepareStore evicts for and inserts the pages of store (none of them in
// T1 or T2); it returns the evictions and false when it ran out of pages
// to evict (nothing inserted, the evictions kept).
func (a *arcState) prepareStore(store []int32) (int, bool) {
	need := len(store) - (a.capacity - a.size[arcT1] - a.size[arcT2])
	ev := 0
	for ; need > 0; need-- {
		var p int32 = -1
		to := arcB1
		if a.size[arcT1] >= int(a.target) {
			p = a.front(arcT1) // every block is unreferenced here
		}
		if p < 0 {
			to = arcB2
			if p = a.front(arcT2); p < 0 {
				return ev, false
			}
		}
		a.remove(p)
		a.ready[p] = false
		a.pushBack(to, p)
		ev++
	}
	for _, k := range []uint8{arcB1, arcB2} {
		for a.size[k] > a.capacity {
			a.remove(a.front(k))
		}
	}
	for _, p := range store {
		if w := a.where[p]; w == arcB1 || w == arcB2 {
			a.remove(p)
		}
		a.ready[p] = false
		a.pushBack(arcT1, p)
	}
	return ev, true
}

// MIN replays w through MINPages.
func MIN(w *Workload, capacity int) PolicyResult {
	return MINPages(workloadPages(w), w.NumPageIDs(), capacity)
}

// MINPages is the offline optimum of the block hits, Belady's MIN with
// bypass, in O(N log N) for N page accesses.
//
// The setting: request r reads its pages B_r against the cache S_r as it
// stands when r arrives (its block hits are |B_r ∩ S_r|, its prefix hits
// the leading run of B_r in S_r), and after r the cache may be any S_{r+1}
// ⊆ S_r ∪ B_r of at most capacity pages: a page enters only with a
// request that reads it. The live sidecar, the LRU oracle and ARC all
// fit it. For unit-size pages, keeping after each request the capacity
// pages of S_r ∪ B_r whose next use comes soonest (and none that is never
// used again: a page never used again, or used later than every kept
// page, is not admitted, which is the bypass) maximises the total block
// hits (Belady's exchange argument, with time counted in requests). So
// for any policy of the setting
//
//	prefix hits <= its block hits <= MIN's block hits
//
// and BlockHitPages here bounds every policy's prefix hits. HitPages is
// the prefix hits of following MIN's decisions, a feasible offline
// schedule. Next uses are positions in the concatenation of the requests
// (precomputed backwards), so of two pages next used by the same request
// the earlier one is kept, which changes no block-hit count. When a page
// id names its whole prefix (a trace's chained pages, the generated
// workload), a page's parent is read before it by every request that
// reads it, so its next use comes first: MIN's cache is then closed
// under prefixes, its prefix hits equal its block hits, and the bound is
// attained: it is the prefix-hit optimum too.
func MINPages(reqs [][]uint32, numIDs, capacity int) PolicyResult {
	res := PolicyResult{Policy: "min", CapacityPages: capacity, Requests: len(reqs)}
	total := 0
	for _, r := range reqs {
		total += len(r)
	}
	if total >= math.MaxUint32 {
		panic("replay: MIN needs fewer than 2^32 page accesses")
	}
	const never = math.MaxUint32
	nextUse := make([]uint32, total)
	last := make([]uint32, numIDs)
	for i := range last {
		last[i] = never
	}
	pos := total
	for i := len(reqs) - 1; i >= 0; i-- {
		for j := len(reqs[i]) - 1; j >= 0; j-- {
			pos--
			p := reqs[i][j]
			nextUse[pos] = last[p]
			last[p] = uint32(pos)
		}
	}
	// key[p]: the next use of a cached page; never when not cached. The
	// heap holds key<<32|page, the largest on top; stale entries (key no
	// longer the page's) are dropped when they surface.
	key := last // reuse: every entry is overwritten below
	for i := range key {
		key[i] = never
	}
	var h maxHeap
	size := 0
	top := func() (uint32, uint32) {
		for len(h) > 0 {
			e := h[0]
			k, p := uint32(e>>32), uint32(e)
			if key[p] == k {
				return k, p
			}
			h.pop()
		}
		return never, 0
	}
	pos = 0
	for _, pages := range reqs {
		res.TotalPages += int64(len(pages))
		run := true
		for _, p := range pages {
			if key[p] != never {
				res.BlockHitPages++
				if run {
					res.HitPages++
				}
			} else {
				run = false
			}
		}
		// The cached pages of the request take their next use first, so
		// that the admissions below compare against true keys.
		for j, p := range pages {
			if key[p] == never {
				continue
			}
			if nu := nextUse[pos+j]; nu == never {
				key[p] = never
				size--
			} else {
				key[p] = nu
				h.push(uint64(nu)<<32 | uint64(p))
			}
		}
		for j, p := range pages {
			nu := nextUse[pos+j]
			if key[p] != never || nu == never || capacity <= 0 {
				continue
			}
			if nu < uint32(pos+len(pages)) {
				continue // a repeat within the request (not expected)
			}
			if size == capacity {
				k, q := top()
				if nu >= k {
					continue // bypass
				}
				key[q] = never
				h.pop()
				size--
				res.Evictions++
			}
			key[p] = nu
			h.push(uint64(nu)<<32 | uint64(p))
			size++
			res.StoredPages++
		}
		pos += len(pages)
	}
	return res
}

// maxHeap is a binary max-heap of uint64.
type maxHeap []uint64

func (h *maxHeap) push(x uint64) {
	*h = append(*h, x)
	s := *h
	i := len(s) - 1
	for i > 0 {
		parent := (i - 1) / 2
		if s[parent] >= s[i] {
			break
		}
		s[parent], s[i] = s[i], s[parent]
		i = parent
	}
}

func (h *maxHeap) pop() uint64 {
	s := *h
	x := s[0]
	n := len(s) - 1
	s[0] = s[n]
	s = s[:n]
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && s[l] > s[m] {
			m = l
		}
		if r < n && s[r] > s[m] {
			m = r
		}
		if m == i {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return x
}
