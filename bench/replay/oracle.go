package replay

// OracleResult is what an exact offline LRU simulation of the sidecar's
// cache gives for a workload and a capacity (in pages = pool slots).
type OracleResult struct {
	CapacityPages int
	Requests      int
	TotalPages    int64 // pages asked for (looked up)
	HitPages      int64 // leading-run hits
	BlockHitPages int64 // pages present at lookup, leading or not (the bound's unit; see MINPages)
	StoredPages   int64 // missed pages that got a slot
	PresentPages  int64 // missed pages found present when stored (behind the leading run)
	SkippedPages  int64 // missed pages refused for lack of space (NoSpace)
	Evictions     int64
	Resident      int // pages present at the end
}

// HitRatio is HitPages / TotalPages.
func (o OracleResult) HitRatio() float64 { return ratio(o.HitPages, o.TotalPages) }

// BlockHitRatio is BlockHitPages / TotalPages.
func (o OracleResult) BlockHitRatio() float64 { return ratio(o.BlockHitPages, o.TotalPages) }

// Oracle replays w one request at a time, in order, through an offline
// model of sidecar/cache with world size 1 and capacity slots, following
// the engine's sequence of calls exactly:
//
//  1. Lookup of the request's pages: h = the leading run of present
//     pages; the hits are touched in reverse order (page h-1 first), so
//     page 0 ends up most recently used.
//  2. Acquire of pages [0, h): they are pinned, which takes them out of the
//     LRU list (neither evictable nor counted as evictable).
//  3. Store of pages [h, n) in one call: for each page in prefix order, a
//     present page is touched (AlreadyPresent); otherwise, when no slot is
//     free and no unpinned present page exists, the page is refused
//     (NoSpace); otherwise the LRU tail is evicted if no slot is free and
//     the page takes a slot, being written (invisible, not evictable).
//     Then every written page commits in prefix order, each pushed to the
//     front of the LRU list (so the request's last page is the most
//     recent of them).
//  4. Release of the lease: pinned pages return to the front of the list
//     in reverse order (page h-1 first), so page 0 is the most recent.
//
// These are the semantics of sidecar/cache (doc.go, "Recency and
// eviction"); with --sequential the live sidecar must agree exactly.
func Oracle(w *Workload, capacity int) OracleResult {
	reqs := make([][]uint32, len(w.Requests))
	for i := range w.Requests {
		reqs[i] = w.Requests[i].Pages
	}
	return OraclePages(reqs, w.NumPageIDs(), capacity)
}

// OraclePages is Oracle over plain page-id sequences: reqs[i] holds the
// page ids of request i in prefix order (distinct within a request, as
// chained digests are), each in [0, numIDs), and the requests are replayed in slice order through
// the same model of sidecar/cache (world size 1, capacity slots). Any
// dense numbering of the digests will do: a page id stands for one
// digest.
func OraclePages(reqs [][]uint32, numIDs, capacity int) OracleResult {
	n := numIDs
	const (
		absent uint8 = iota
		present
		writing
	)
	state := make([]uint8, n)
	// LRU list of present, unpinned pages; index n is the sentinel.
	prev := make([]int32, n+1)
	next := make([]int32, n+1)
	s := int32(n)
	prev[s], next[s] = s, s
	lruLen := 0
	remove := func(p int32) {
		a, b := prev[p], next[p]
		next[a], prev[b] = b, a
		lruLen--
	}
	pushFront := func(p int32) {
		f := next[s]
		prev[p], next[p] = s, f
		prev[f] = p
		next[s] = p
		lruLen++
	}
	touch := func(p int32) {
		if next[s] == p {
			return
		}
		remove(p)
		pushFront(p)
	}
	used := 0 // present + writing slots
	res := OracleResult{CapacityPages: capacity, Requests: len(reqs)}
	var written []int32
	for _, pages := range reqs {
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
		for i := h - 1; i >= 0; i-- {
			touch(int32(pages[i]))
		}
		for i := 0; i < h; i++ { // pin
			remove(int32(pages[i]))
		}
		written = written[:0]
		for _, pg := range pages[h:] {
			p := int32(pg)
			switch state[p] {
			case present:
				touch(p)
				res.PresentPages++
				continue
			case writing: // pages of one request are distinct
				res.PresentPages++
				continue
			}
			if capacity-used+lruLen < 1 {
				res.SkippedPages++
				continue
			}
			if used == capacity {
				t := prev[s]
				remove(t)
				state[t] = absent
				used--
				res.Evictions++
			}
			state[p] = writing
			used++
			written = append(written, p)
		}
		for _, p := range written {
			state[p] = present
			pushFront(p)
			res.StoredPages++
		}
		for i := h - 1; i >= 0; i-- { // release
			pushFront(int32(pages[i]))
		}
	}
	res.Resident = used
	return res
}
