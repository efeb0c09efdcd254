package replay

// InformedHorizons are the horizons (in requests) of the informed LRUs
// `replay --informed` reports: 0 is "ever".
var InformedHorizons = []int{0, 1000, 300, 100}

// InformedPages is an LRU told the future, a measure of what information
// an online policy lacks: driven through the sidecar's call sequence as
// OraclePages is, but a page that a request reads or stores goes to the
// front of a hot list when it is read again within horizon requests (any
// time later when horizon is 0), and to the front of a cold list
// otherwise; eviction takes the cold list's tail first. With horizon 0 it
// knows which pages come back, not when: what a perfect predictor of
// reuse (a session's next turn, a scan's one-offs) could give a policy
// that keeps recency order. With a horizon it knows when, roughly, as MIN
// does exactly. It is an analysis, not a policy: no cache can run it.
func InformedPages(reqs [][]uint32, numIDs, capacity, horizon int) PolicyResult {
	res := PolicyResult{Policy: "informed", CapacityPages: capacity, Requests: len(reqs)}
	next := nextUses(reqs, numIDs)
	const (
		absent uint8 = iota
		present
		writing
		pinned
	)
	state := make([]uint8, numIDs)
	// Two lists, hot (sentinel numIDs) and cold (numIDs+1).
	prev := make([]uint32, numIDs+2)
	nxt := make([]uint32, numIDs+2)
	for s := numIDs; s < numIDs+2; s++ {
		prev[s], nxt[s] = uint32(s), uint32(s)
	}
	unlink := func(p uint32) {
		a, b := prev[p], nxt[p]
		nxt[a], prev[b] = b, a
	}
	push := func(p uint32, cold bool) {
		s := uint32(numIDs)
		if cold {
			s++
		}
		f := nxt[s]
		prev[p], nxt[p] = s, f
		prev[f] = p
		nxt[s] = p
	}
	victim := func() uint32 {
		for s := uint32(numIDs + 1); s >= uint32(numIDs); s-- {
			if t := prev[s]; t != s {
				unlink(t)
				return t
			}
		}
		panic("replay: the informed LRU has no evictable page")
	}
	coldAt := func(ri, i int) bool {
		n := next[ri][i]
		return n < 0 || (horizon > 0 && int(n)-ri > horizon)
	}
	used, resident, leased := 0, 0, 0
	type w struct {
		p    uint32
		cold bool
	}
	var written []w
	for ri, pages := range reqs {
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
		for i := h - 1; i >= 0; i-- { // touched, then pinned
			unlink(pages[i])
			state[pages[i]] = pinned
			leased++
		}
		written = written[:0]
		for i := h; i < len(pages); i++ {
			p := pages[i]
			switch state[p] {
			case present:
				unlink(p)
				push(p, coldAt(ri, i))
				continue
			case writing, pinned:
				continue
			}
			if capacity-used+resident-leased < 1 {
				continue
			}
			if used == capacity {
				state[victim()] = absent
				used--
				resident--
				res.Evictions++
			}
			state[p] = writing
			used++
			written = append(written, w{p, coldAt(ri, i)})
		}
		for _, x := range written {
			state[x.p] = present
			resident++
			push(x.p, x.cold)
			res.StoredPages++
		}
		for i := h - 1; i >= 0; i-- {
			push(pages[i], coldAt(ri, i))
			state[pages[i]] = present
			leased--
		}
	}
	return res
}

// nextUses returns, for each request and position, the index of the next
// request that reads the page (-1: none).
func nextUses(reqs [][]uint32, numIDs int) [][]int32 {
	last := make([]int32, numIDs)
	for i := range last {
		last[i] = -1
	}
	out := make([][]int32, len(reqs))
	for r := len(reqs) - 1; r >= 0; r-- {
		out[r] = make([]int32, len(reqs[r]))
		for i, p := range reqs[r] {
			out[r][i] = last[p]
		}
		for _, p := range reqs[r] {
			last[p] = int32(r)
		}
	}
	return out
}
