package replay

import (
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"
)

const (
	pa = iota
	pb
	pc
	pd
)

// TestARCHandWorked follows vLLM's ARC (policies.go, ARCPages) through a
// sequence at capacity 2, state by state (lists least recent first).
func TestARCHandWorked(t *testing.T) {
	type want struct {
		prefix, block int64
		t1, t2        []uint32
		b1, b2        []uint32
		target        float64
	}
	steps := []struct {
		pages []uint32
		want  want
	}{
		// r1 [a b]: nothing present; store a, b into T1 (a then b); the
		// second touch re-inserts them last first: T1 [b a].
		{[]uint32{pa, pb}, want{0, 0, []uint32{pb, pa}, nil, nil, nil, 0}},
		// r2 [a b]: the lookup's touch (b first) promotes both: T2 [b a];
		// 2 prefix hits, nothing to store.
		{[]uint32{pa, pb}, want{2, 2, nil, []uint32{pb, pa}, nil, nil, 0}},
		// r3 [c]: full; |T1| 0 >= int(0) but T1 is empty, so T2's front b
		// goes to B2; c enters T1.
		{[]uint32{pc}, want{0, 0, []uint32{pc}, []uint32{pa}, nil, []uint32{pb}, 0}},
		// r4 [b]: b in B2: target max(0 - max(1, 0/1), 0) = 0; storing b
		// evicts T1's front c to B1 (|T1| 1 >= 0); b leaves B2 for T1.
		{[]uint32{pb}, want{0, 0, []uint32{pb}, []uint32{pa}, []uint32{pc}, nil, 0}},
		// r5 [c a]: touch a (T2, to the end), then c in B1: target
		// min(0 + max(1, 0/1), 2) = 1. Lookup: c absent, 0 prefix hits,
		// 1 block hit (a). Store c: |T1| 1 >= int(1): T1's front b to B1;
		// c leaves B1 for T1.
		{[]uint32{pc, pa}, want{0, 1, []uint32{pc}, []uint32{pa}, []uint32{pb}, nil, 1}},
		// r6 [a c]: touch c (T1, ready: to T2), then a (T2, to the end):
		// T2 [c a]; 2 prefix hits.
		{[]uint32{pa, pc}, want{2, 2, nil, []uint32{pc, pa}, []uint32{pb}, nil, 1}},
		// r7 [b d]: b in B1: target min(1 + max(1, 0/1), 2) = 2. Store b,
		// d: two evictions, |T1| 0 < 2 both times: T2's c then a go to B2.
		// T1 [b d], then the touch (d first): T1 [d b].
		{[]uint32{pb, pd}, want{0, 0, []uint32{pd, pb}, nil, nil, []uint32{pc, pa}, 2}},
		// r8 [a]: a in B2: target max(2 - max(1, 0/2), 0) = 1, a to B2's
		// end. Store a: |T1| 2 >= 1: T1's front d to B1; a to T1.
		{[]uint32{pa}, want{0, 0, []uint32{pb, pa}, nil, []uint32{pd}, []uint32{pc}, 1}},
	}
	a := newARC(4, 2)
	var res PolicyResult
	for i, s := range steps {
		before := res
		a.request(s.pages, &res)
		got := want{res.HitPages - before.HitPages, res.BlockHitPages - before.BlockHitPages,
			a.list(arcT1), a.list(arcT2), a.list(arcB1), a.list(arcB2), a.target}
		if got.prefix != s.want.prefix || got.block != s.want.block || !slices.Equal(got.t1, s.want.t1) || !slices.Equal(got.t2, s.want.t2) ||
			!slices.Equal(got.b1, s.want.b1) || !slices.Equal(got.b2, s.want.b2) || got.target != s.want.target {
			t.Fatalf("request %d %v:\n got %+v\nwant %+v", i+1, s.pages, got, s.want)
		}
	}
	// Stored: 2 + 1 + 1 + 1 + 2 + 1; evicted: 1 + 1 + 1 + 2 + 1.
	if res.StoredPages != 8 || res.Evictions != 6 || res.FailedStores != 0 || res.HitPages != 4 || res.BlockHitPages != 5 {
		t.Errorf("totals %+v", res)
	}
	var reqs [][]uint32
	for _, s := range steps {
		reqs = append(reqs, s.pages)
	}
	if got := ARCPages(reqs, 4, 2); got != (PolicyResult{Policy: "arc", CapacityPages: 2, Requests: 8, TotalPages: 13, HitPages: 4, BlockHitPages: 5, StoredPages: 8, Evictions: 6}) {
		t.Errorf("ARCPages: %+v", got)
	}
}

// TestARCStoreTooBig: a store larger than the pool evicts what it can,
// returns None (nothing stored) and keeps the evictions.
func TestARCStoreTooBig(t *testing.T) {
	// capacity 2: [a] stored; [b c d] needs 3 - 1 = 2 evictions, finds
	// only a (to B1), fails; [a] then misses (a is a ghost).
	got := ARCPages([][]uint32{{pa}, {pb, pc, pd}, {pa}}, 4, 2)
	want := PolicyResult{Policy: "arc", CapacityPages: 2, Requests: 3, TotalPages: 5, StoredPages: 2, Evictions: 1, FailedStores: 1}
	if got != want {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
}

func TestMINHandWorked(t *testing.T) {
	for _, tc := range []struct {
		name          string
		reqs          [][]uint32
		capacity      int
		prefix, block int64
		stored        int64
	}{
		// Positions a0 b1 | c2 | a3 | b4 | c5. After r1 keep a (next 3)
		// and b (next 4); c (next 5) is used later than both: bypass.
		// r3 and r4 hit; c misses again. LRU hits nothing here.
		{"bypass", [][]uint32{{pa, pb}, {pc}, {pa}, {pb}, {pc}}, 2, 2, 2, 2},
		// Capacity 1: after r1 keep a (read by r2); r2 reads b and a (a
		// hits behind the missed b: no prefix hit), then keeps b for r3.
		// 2 block hits, 1 prefix hit: a cache may drop a page the same
		// request reads, as LRU does here too.
		{"batched", [][]uint32{{pa}, {pb, pa}, {pb}}, 1, 1, 2, 2},
		// Capacity 2, r2 repeats r1's three pages: a and b are kept (the
		// earlier next uses), c bypassed: 2 prefix hits.
		{"prefix ties", [][]uint32{{pa, pb, pc}, {pa, pb, pc}}, 2, 2, 2, 2},
		// Nothing is used twice: nothing is admitted.
		{"no reuse", [][]uint32{{pa, pb}, {pc, pd}}, 2, 0, 0, 0},
	} {
		got := MINPages(tc.reqs, 4, tc.capacity)
		if got.HitPages != tc.prefix || got.BlockHitPages != tc.block || got.StoredPages != tc.stored {
			t.Errorf("%s: got %+v, want prefix %d, block %d, stored %d", tc.name, got, tc.prefix, tc.block, tc.stored)
		}
	}
	// The LRU oracle on "batched": 1 prefix hit, and a (present at r2's
	// lookup, then evicted by b's store) counts as a block hit: 2.
	if o := OraclePages([][]uint32{{pa}, {pb, pa}, {pb}}, 4, 1); o.HitPages != 1 || o.BlockHitPages != 2 {
		t.Errorf("LRU on batched: %+v", o)
	}
}

// bestBlockHits is the block-hit optimum by exhaustive search: after each
// request the cache is any subset of (cache ∪ the request's pages) of at
// most capacity pages (ids < 8).
func bestBlockHits(reqs [][]uint32, capacity int) int64 {
	best := map[uint8]int64{0: 0}
	for _, r := range reqs {
		var m uint8
		for _, p := range r {
			m |= 1 << p
		}
		next := map[uint8]int64{}
		for s, v := range best {
			v += int64(bits.OnesCount8(s & m))
			u := s | m
			for sub := u; ; sub = (sub - 1) & u {
				if bits.OnesCount8(sub) <= capacity {
					if old, ok := next[sub]; !ok || v > old {
						next[sub] = v
					}
				}
				if sub == 0 {
					break
				}
			}
		}
		best = next
	}
	var out int64
	for _, v := range best {
		out = max(out, v)
	}
	return out
}

func randomRequests(rng *rand.Rand, ids, n, maxLen int) [][]uint32 {
	reqs := make([][]uint32, n)
	for i := range reqs {
		perm := rng.Perm(ids)
		k := 1 + rng.IntN(maxLen)
		for _, p := range perm[:k] {
			reqs[i] = append(reqs[i], uint32(p))
		}
	}
	return reqs
}

// TestMINBoundsPolicies: on random small workloads MIN's block hits are
// the exhaustive optimum (tiny cases) and at least LRU's and ARC's block
// hits, which are at least their prefix hits; with room for every page
// all of them hit what a cache that never evicts hits.
func TestMINBoundsPolicies(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 3000; trial++ {
		ids := 3 + rng.IntN(5) // < 8 for the exhaustive search
		reqs := randomRequests(rng, ids, 1+rng.IntN(8), min(ids, 4))
		capacity := 1 + rng.IntN(ids)
		m := MINPages(reqs, ids, capacity)
		l := OraclePages(reqs, ids, capacity)
		a := ARCPages(reqs, ids, capacity)
		if best := bestBlockHits(reqs, capacity); m.BlockHitPages != best {
			t.Fatalf("trial %d, capacity %d, %v: MIN %d block hits, optimum %d", trial, capacity, reqs, m.BlockHitPages, best)
		}
		if m.BlockHitPages < l.BlockHitPages || m.BlockHitPages < a.BlockHitPages {
			t.Fatalf("trial %d, capacity %d, %v: MIN %d < LRU %d or ARC %d", trial, capacity, reqs, m.BlockHitPages, l.BlockHitPages, a.BlockHitPages)
		}
		if l.HitPages > l.BlockHitPages || a.HitPages > a.BlockHitPages || m.HitPages > m.BlockHitPages {
			t.Fatalf("trial %d: a prefix count above its block count: LRU %+v ARC %+v MIN %+v", trial, l, a, m)
		}
		if capacity == ids {
			if u := unbounded(reqs, ids); l.HitPages != u || a.HitPages != u || m.HitPages != u {
				t.Fatalf("trial %d, room for all: LRU %d ARC %d MIN %d, unbounded %d", trial, l.HitPages, a.HitPages, m.HitPages, u)
			}
		}
	}
	// Larger random workloads (no exhaustive check), with ARC failures and
	// long reuse distances.
	for trial := 0; trial < 200; trial++ {
		ids := 20 + rng.IntN(200)
		reqs := randomRequests(rng, ids, 50+rng.IntN(300), 1+rng.IntN(16))
		capacity := 1 + rng.IntN(ids)
		m, l, a := MINPages(reqs, ids, capacity), OraclePages(reqs, ids, capacity), ARCPages(reqs, ids, capacity)
		if m.BlockHitPages < l.BlockHitPages || m.BlockHitPages < a.BlockHitPages {
			t.Fatalf("trial %d, capacity %d: MIN %d < LRU %d or ARC %d", trial, capacity, m.BlockHitPages, l.BlockHitPages, a.BlockHitPages)
		}
	}
}

func unbounded(reqs [][]uint32, ids int) int64 {
	seen := make([]bool, ids)
	var hits int64
	for _, r := range reqs {
		h := 0
		for h < len(r) && seen[r[h]] {
			h++
		}
		hits += int64(h)
		for _, p := range r {
			seen[p] = true
		}
	}
	return hits
}

// TestPoliciesOnTrace: on the test trace and the generated workload, in
// 512-token blocks, MIN bounds LRU and ARC at every capacity, grows with
// the pool, and (a block id naming its whole prefix) keeps prefix-closed
// sets, so that its prefix hits reach its bound.
func TestPoliciesOnTrace(t *testing.T) {
	w, err := Load([]string{testTrace}, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	g, err := Generate(smallAgentic, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []*Workload{w, g} {
		policiesOn(t, w)
	}
}

func policiesOn(t *testing.T, w *Workload) {
	prev := int64(-1)
	for _, c := range []int{16, 64, 256, 1024, w.DistinctPages} {
		m, l, a := MIN(w, c), Oracle(w, c), ARC(w, c)
		if m.BlockHitPages < l.BlockHitPages || m.BlockHitPages < a.BlockHitPages || m.BlockHitPages < l.HitPages {
			t.Errorf("%s, capacity %d: MIN %d, LRU %d (prefix %d), ARC %d", w.Files[0], c, m.BlockHitPages, l.BlockHitPages, l.HitPages, a.BlockHitPages)
		}
		if m.BlockHitPages < prev {
			t.Errorf("capacity %d: MIN's bound fell to %d from %d", c, m.BlockHitPages, prev)
		}
		prev = m.BlockHitPages
		if m.HitPages != m.BlockHitPages {
			t.Errorf("%s, capacity %d: MIN's prefix hits %d differ from its block hits %d", w.Files[0], c, m.HitPages, m.BlockHitPages)
		}
		if c == w.DistinctPages && (a.HitRatio() != w.UnboundedHitRatio() || l.HitRatio() != w.UnboundedHitRatio()) {
			t.Errorf("room for all: ARC %v LRU %v, unbounded %v", a.HitRatio(), l.HitRatio(), w.UnboundedHitRatio())
		}
	}
}

// TestARCGhostsAndTarget: the adaptive target moves by true division
// (arc_manager.py's max(1, len(b2) / len(b1))), a touched ghost moves to
// its list's end, and eviction compares |T1| with int(target).
func TestARCGhostsAndTarget(t *testing.T) {
	a := newARC(8, 4)
	for _, p := range []int32{0, 4} {
		a.pushBack(arcB1, p)
	}
	for _, p := range []int32{1, 2, 3} {
		a.pushBack(arcB2, p)
	}
	a.touch([]uint32{0}) // B1 hit: + max(1, 3/2) = 1.5
	if a.target != 1.5 || !slices.Equal(a.list(arcB1), []uint32{4, 0}) {
		t.Fatalf("after a B1 hit: target %v, B1 %v; want 1.5, [4 0]", a.target, a.list(arcB1))
	}
	a.touch([]uint32{2}) // B2 hit: - max(1, 2/3) = 1
	a.touch([]uint32{1}) // again: max(0.5 - 1, 0) = 0
	if a.target != 0 || !slices.Equal(a.list(arcB2), []uint32{3, 2, 1}) {
		t.Fatalf("after two B2 hits: target %v, B2 %v; want 0, [3 2 1]", a.target, a.list(arcB2))
	}
	// |T1| = 1 >= int(1.5) = 1: the store evicts T1's block, not T2's.
	b := newARC(8, 2)
	b.pushBack(arcT1, 5)
	b.pushBack(arcT2, 6)
	b.ready[5], b.ready[6] = true, true
	b.target = 1.5
	if ev, ok := b.prepareStore([]int32{7}); ev != 1 || !ok || !slices.Equal(b.list(arcB1), []uint32{5}) || !slices.Equal(b.list(arcT2), []uint32{6}) {
		t.Fatalf("evicted %d (ok %v), B1 %v, T2 %v; want T1's 5 to B1", ev, ok, b.list(arcB1), b.list(arcT2))
	}
}

// TestInformedPages: an LRU told which pages come back keeps a prefix
// read every fifth request through a scan of one-off pages that flushes
// it under LRU, and never beats the optimum's bound on random workloads.
func TestInformedPages(t *testing.T) {
	var reqs [][]uint32
	next := uint32(4)
	for i := range 50 {
		if i%5 == 0 {
			reqs = append(reqs, []uint32{0, 1, 2, 3})
			continue
		}
		reqs = append(reqs, []uint32{next, next + 1, next + 2})
		next += 3
	}
	lru, inf := OraclePages(reqs, int(next), 8), InformedPages(reqs, int(next), 8, 0)
	if lru.HitPages != 0 || inf.HitPages != 4*9 {
		t.Errorf("prefix through a scan: LRU %d hits (want 0), informed %d (want 36)", lru.HitPages, inf.HitPages)
	}
	rng := rand.New(rand.NewPCG(7, 7))
	for trial := range 50 {
		var rs [][]uint32
		for range 40 {
			n := 1 + rng.IntN(6)
			var r []uint32
			seen := map[uint32]bool{}
			for len(r) < n {
				p := uint32(rng.IntN(20))
				if !seen[p] {
					seen[p] = true
					r = append(r, p)
				}
			}
			rs = append(rs, r)
		}
		c := 2 + rng.IntN(10)
		m := MINPages(rs, 20, c)
		for _, hz := range InformedHorizons {
			if i := InformedPages(rs, 20, c, hz); i.BlockHitPages > m.BlockHitPages {
				t.Fatalf("trial %d: informed (horizon %d) block hits %d above MIN's %d", trial, hz, i.BlockHitPages, m.BlockHitPages)
			}
		}
	}
}
