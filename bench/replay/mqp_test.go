package replay

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// mqpRun replays reqs through MQP with its lifetime set to life (the
// lifetime is measured only after 32 re-access distances, which these
// small sequences never give, so it stays as set).
func mqpRun(reqs [][]uint32, ids, capacity int, life int64) (PolicyResult, *mqp) {
	m := newMQP(ids, capacity)
	m.life = life
	return m.replay(reqs, nil, capacity), m
}

func singles(ids ...uint32) [][]uint32 {
	var reqs [][]uint32
	for _, p := range ids {
		reqs = append(reqs, []uint32{p})
	}
	return reqs
}

// TestMQPFrequentSurvivesScan: page 0 is read three times (count 3, queue
// 1), then six one-off pages (count 1, queue 0) go through a 4-page pool,
// then page 0 again. LRU evicts page 0 at the fifth one-off page. MQP with
// a long lifetime evicts from queue 0 first and keeps it; with lifetime 0
// page 0 falls to queue 0 two placements after its last touch and is
// evicted as under LRU.
func TestMQPFrequentSurvivesScan(t *testing.T) {
	reqs := singles(0, 0, 0, 1, 2, 3, 4, 5, 6, 0)
	lru := OraclePages(reqs, 7, 4)
	if lru.HitPages != 2 {
		t.Fatalf("LRU: %d hits, want 2 (page 0 evicted by the scan)", lru.HitPages)
	}
	for _, tc := range []struct {
		life int64
		hits int64
	}{{0, 2}, {1 << 20, 3}} {
		got, _ := mqpRun(reqs, 7, 4, tc.life)
		if got.HitPages != tc.hits {
			t.Errorf("life %d: %d hits, want %d", tc.life, got.HitPages, tc.hits)
		}
	}
}

// TestMQPTipHistory: a chain is stored, evicted by a one-off request and
// read again, extended by one page. Its earlier tip is found in the tip
// table, so the pages at or before the tip's position are stored with
// count 2 (queue 1); a page after it gets count 1. (A long lifetime
// keeps the levels where the counts put them.)
func TestMQPTipHistory(t *testing.T) {
	for _, tc := range []struct {
		first []uint32
		want  []uint8 // counts of pages 0, 1, 2 after the re-read
	}{
		{[]uint32{0, 1, 2}, []uint8{2, 2, 2}}, // tip 2: all three re-seen
		{[]uint32{0, 1}, []uint8{2, 2, 1}},    // tip 1: page 2 is new
		{[]uint32{7}, []uint8{1, 1, 1}},       // another chain: no history
	} {
		reqs := [][]uint32{tc.first, {4, 5, 6}, {0, 1, 2, 3}}
		res, m := mqpRun(reqs, 8, 3, 1<<20)
		if res.HitPages != 0 || res.StoredPages != int64(len(tc.first))+3+3 {
			t.Fatalf("first %v: %+v", tc.first, res)
		}
		var got []uint8
		for p := range 3 {
			got = append(got, m.st[p]&15)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("first %v: counts %v, want %v", tc.first, got, tc.want)
		}
		for p := range 3 {
			if want := mqpLevel(tc.want[p]); m.level(uint32(p)) != want {
				t.Errorf("first %v: page %d at level %d, want %d", tc.first, p, m.level(uint32(p)), want)
			}
		}
	}
}

// TestMQPPinnedNeverVictim: pages 0, 1, 2 are stored in that order (all
// count 1, page 0 at the LRU end of queue 0); with page 0 pinned the
// victim is page 1; once released page 0 is the most recent, so the
// victims are 2 and then 0.
func TestMQPPinnedNeverVictim(t *testing.T) {
	m := newMQP(4, 4)
	m.begin(0, []uint32{0, 1, 2}, 0)
	for p := range 3 {
		m.commit(uint32(p), m.inf[p])
	}
	m.pin(0)
	var got []uint32
	got = append(got, m.victim())
	m.unpin(0)
	got = append(got, m.victim(), m.victim())
	if want := []uint32{1, 2, 0}; !slices.Equal(got, want) {
		t.Errorf("victims %v, want %v", got, want)
	}
}

// TestMQPLifeZeroIsLRU: with lifetime 0 a touched block falls back to
// queue 0 within two placements, and on these sequences (worked by hand:
// no eviction falls in such a window) every count equals the LRU oracle's.
func TestMQPLifeZeroIsLRU(t *testing.T) {
	for _, tc := range []struct {
		name     string
		reqs     [][]uint32
		ids, cap int
	}{
		{"scan", singles(0, 0, 0, 1, 2, 3, 4, 5, 6, 0), 7, 4},
		{"alternate", singles(0, 1, 0, 2, 0, 1, 0), 3, 2},
		{"chains", [][]uint32{{0, 1}, {0, 1, 2}, {3, 4}, {0, 1, 2}, {5}, {3, 4}}, 6, 4},
	} {
		o := OraclePages(tc.reqs, tc.ids, tc.cap)
		got, _ := mqpRun(tc.reqs, tc.ids, tc.cap, 0)
		want := PolicyResult{Policy: "mqp", CapacityPages: tc.cap, Requests: len(tc.reqs), TotalPages: o.TotalPages,
			HitPages: o.HitPages, BlockHitPages: o.BlockHitPages, StoredPages: o.StoredPages, Evictions: o.Evictions}
		if got != want {
			t.Errorf("%s: MQP %+v, LRU %+v", tc.name, got, want)
		}
	}
}

// TestMQPColdNamespace: namespace 0 reads a 4-page chain twice, then
// forty times namespace 1 sends three requests of 2 new pages and
// namespace 0 reads the chain again, through an 8-page pool. Under LRU
// the 6 new pages push the chain's last 2 pages out every round (2 hits a
// round). Namespace 1 never hits, namespace 0 does, so namespace 1 turns
// cold: its new pages go to the LRU end of queue 0 and evict each other
// (all but every 32nd), and the chain is hit whole. In one namespace
// the guard cannot tell them apart and MQP hits less.
func TestMQPColdNamespace(t *testing.T) {
	const c = 8
	reqs := [][]uint32{{0, 1, 2, 3}, {0, 1, 2, 3}}
	ns := []uint8{0, 0}
	next := uint32(4)
	for range 40 {
		for range 3 {
			reqs = append(reqs, []uint32{next, next + 1})
			ns = append(ns, 1)
			next += 2
		}
		reqs = append(reqs, []uint32{0, 1, 2, 3})
		ns = append(ns, 0)
	}
	m := newMQP(int(next), c)
	res := m.replay(reqs, ns, c)
	if !m.nsCold[1] || m.nsCold[0] {
		t.Errorf("cold flags %v %v, want namespace 1 cold only", m.nsCold[0], m.nsCold[1])
	}
	lru := OraclePages(reqs, int(next), c)
	one := newMQP(int(next), c).replay(reqs, nil, c)
	t.Logf("hits: MQP %d, in one namespace %d, LRU %d", res.HitPages, one.HitPages, lru.HitPages)
	if lru.HitPages != 4+40*2 || res.HitPages < 4+38*4 {
		t.Errorf("hits: MQP %d, LRU %d; want LRU %d and MQP at least %d", res.HitPages, lru.HitPages, 4+40*2, 4+38*4)
	}
	if one.HitPages >= res.HitPages {
		t.Errorf("in one namespace (no guard) MQP hits %d, not fewer than %d", one.HitPages, res.HitPages)
	}
}

// TestMQPDeterministic: the same workload gives the same result.
func TestMQPDeterministic(t *testing.T) {
	g, err := Generate(smallAgentic, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	w, err := Load([]string{testTrace}, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []*Workload{g, w} {
		for _, c := range []int{16, 256, 1024} {
			a, b := MQP(w, c), MQP(w, c)
			if a != b {
				t.Errorf("%s, capacity %d: %+v then %+v", w.Files[0], c, a, b)
			}
			if m := MIN(w, c); a.BlockHitPages > m.BlockHitPages || a.HitPages > a.BlockHitPages {
				t.Errorf("%s, capacity %d: MQP %+v above MIN's bound %d", w.Files[0], c, a, m.BlockHitPages)
			}
		}
	}
}

// TestMQPBelowMIN: on random small workloads (random namespaces too) MQP's
// prefix hits are at most its block hits, at most MIN's bound; with room
// for every page it hits what a cache that never evicts hits. The
// driver panics if MQP ever picks a pinned or absent victim.
func TestMQPBelowMIN(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 2000 {
		ids := 3 + rng.IntN(30)
		reqs := randomRequests(rng, ids, 1+rng.IntN(60), 1+rng.IntN(min(ids, 8)))
		capacity := 1 + rng.IntN(ids)
		ns := make([]uint8, len(reqs))
		for i := range ns {
			ns[i] = uint8(rng.IntN(3))
		}
		q := MQPPages(reqs, ns, ids, capacity)
		m := MINPages(reqs, ids, capacity)
		if q.HitPages > q.BlockHitPages || q.BlockHitPages > m.BlockHitPages {
			t.Fatalf("trial %d, capacity %d, %v: MQP %+v, MIN's bound %d", trial, capacity, reqs, q, m.BlockHitPages)
		}
		if capacity == ids {
			if u := unbounded(reqs, ids); q.HitPages != u {
				t.Fatalf("trial %d, room for all: MQP %d, unbounded %d", trial, q.HitPages, u)
			}
		}
	}
}

// TestMQPExtensionInherits: one session, request j reading pages 0..j
// (j = 1..n), so each request extends the previous one by page j and the
// next request finds its tip. Once 32 extending requests' tips are
// recorded and more than half of them found again, a request's new pages
// are stored at count 2 (queue 1), not 1: the chains requests extend come
// back. Requests that each extend page 0 by a page of their own (tips
// never found) keep storing at count 1.
func TestMQPExtensionInherits(t *testing.T) {
	session := func(n int) [][]uint32 {
		var reqs [][]uint32
		for j := 1; j <= n; j++ {
			r := make([]uint32, j+1)
			for i := range r {
				r[i] = uint32(i)
			}
			reqs = append(reqs, r)
		}
		return reqs
	}
	oneOffs := func(n int) [][]uint32 {
		var reqs [][]uint32
		for j := 1; j <= n; j++ {
			reqs = append(reqs, []uint32{0, uint32(j)})
		}
		return reqs
	}
	for _, tc := range []struct {
		name string
		reqs [][]uint32
		want uint8 // count of page n, the last request's new page
	}{
		{"session of 20", session(20), 1},  // 19 extending tips: too few
		{"session of 40", session(40), 2},  // 39 inserted, 38 found
		{"one-offs of 40", oneOffs(40), 1}, // 39 inserted, none found
	} {
		n := len(tc.reqs)
		_, m := mqpRun(tc.reqs, n+1, 64, 1<<20)
		if got := m.st[n] & 15; got != tc.want {
			t.Errorf("%s: page %d at count %d, want %d (tips %d, found %d)", tc.name, n, got, tc.want, m.extIns, m.extFnd)
		}
	}
}
