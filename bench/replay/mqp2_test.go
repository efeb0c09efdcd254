package replay

import (
	"os"
	"slices"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/sidecar/cache"
)

// cachePolicyReplay drives sidecar/cache in process under pol with the
// engine's calls (as cacheReplay does) and returns the hits per request,
// the stored pages and the evictions.
func cachePolicyReplay(t *testing.T, w *Workload, reqs [][]uint32, capacity int, pol cache.Policy) (hits []int, stored, evictions int64) {
	t.Helper()
	c, err := cache.New(cache.Config{Capacity: capacity, Epoch: 1, Policy: pol})
	if err != nil {
		t.Fatal(err)
	}
	ns, err := c.AddNamespace(cache.NamespaceKey{Model: "m", Layout: 1, DigestWidth: DigestWidth, WorldSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	var now int64
	for _, pages := range reqs {
		now++
		d := w.AppendDigests(nil, pages)
		h, err := c.Lookup(ns, d)
		if err != nil {
			t.Fatal(err)
		}
		hits = append(hits, h)
		var lease cache.Lease
		if h > 0 {
			if lease, err = c.Acquire(ns, 0, d[:h*DigestWidth], 1, time.Minute, now); err != nil {
				t.Fatal(err)
			}
		}
		var tickets []cache.Ticket
		for i := h; i < len(pages); i++ {
			tk, st, err := c.BeginStore(ns, 0, d[i*DigestWidth:(i+1)*DigestWidth], 1, now)
			if err != nil {
				t.Fatal(err)
			}
			if st == cache.Allocated {
				tickets = append(tickets, tk)
			}
		}
		for _, tk := range tickets {
			if err := c.CommitStore(tk); err != nil {
				t.Fatal(err)
			}
			stored++
		}
		if err := c.Release(lease.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	return hits, stored, int64(c.Stats().Evictions)
}

// checkMQP2Exact compares MQP2Pages with the cache under PolicyMQP2 on
// reqs (namespace 0 of the model is the replay's namespace); on a
// difference it finds the first request whose running hits differ.
func checkMQP2Exact(t *testing.T, name string, w *Workload, reqs [][]uint32, capacity int) PolicyResult {
	t.Helper()
	return checkModelExactIn(t, name, w, reqs, capacity, cache.PolicyMQP2, MQP2Pages)
}

// checkModelExactIn compares an offline model (MQPPages or MQP2Pages)
// with the cache under pol.
func checkModelExactIn(t *testing.T, name string, w *Workload, reqs [][]uint32, capacity int, pol cache.Policy,
	modelOf func([][]uint32, []uint8, int, int) PolicyResult) PolicyResult {
	t.Helper()
	model := modelOf(reqs, nil, w.NumPageIDs(), capacity)
	hits, stored, evictions := cachePolicyReplay(t, w, reqs, capacity, pol)
	var sum int64
	cum := make([]int64, len(hits))
	for i, h := range hits {
		sum += int64(h)
		cum[i] = sum
	}
	if model.HitPages == sum && model.StoredPages == stored && model.Evictions == evictions {
		return model
	}
	lo, hi := 0, len(reqs)
	for lo+1 < hi {
		mid := (lo + hi) / 2
		if modelOf(reqs[:mid], nil, w.NumPageIDs(), capacity).HitPages == cum[mid-1] {
			lo = mid
		} else {
			hi = mid
		}
	}
	t.Errorf("%v, %s at %d pages: model hits %d, stored %d, evictions %d; cache %d, %d, %d; first difference at request %d",
		pol, name, capacity, model.HitPages, model.StoredPages, model.Evictions, sum, stored, evictions, hi-1)
	return model
}

// TestMQP2MatchesCache checks MQP2's offline model against the sidecar's
// cache under PolicyMQP2, call for call: the agentic workload in 16-token
// pages (a scan of fresh requests, sessions whose new tails inherit,
// requests of thousands of pages that overflow hint buckets), the shipped
// trace in 32-token pages (a learned tip offset), and both with every
// fifth request repeated at once (a probe).
func TestMQP2MatchesCache(t *testing.T) {
	n := 900
	if testing.Short() {
		n = 300
	}
	ag, err := Generate(AgenticConfig{}, LoadOptions{PageTokens: 16, Limit: n})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := Load([]string{testTrace}, LoadOptions{PageTokens: 32})
	if err != nil {
		t.Fatal(err)
	}
	probes := func(reqs [][]uint32) [][]uint32 {
		var out [][]uint32
		for i, r := range reqs {
			out = append(out, r)
			if i%5 == 0 {
				out = append(out, r)
			}
		}
		return out
	}
	lru := func(w *Workload, reqs [][]uint32, c int) int64 { return OraclePages(reqs, w.NumPageIDs(), c).HitPages }
	type wl struct {
		name   string
		w      *Workload
		caps   []int
		differ bool // from LRU at the first capacity: the check can tell them apart
	}
	cases := []wl{{"agentic, 16-token pages", ag, []int{2000, 8000}, true}, {"trace, 32-token pages", tr, []int{4000, 16000}, false}}
	if p := mooncakeTrace(); p != "" && !testing.Short() {
		// 300 requests are too few for a lifetime; 2,000 are not.
		big, err := Load([]string{p}, LoadOptions{PageTokens: 32, Limit: 2000})
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, wl{"the whole trace's first 2,000 requests, 32-token pages", big, []int{16000}, true})
	}
	for _, tc := range cases {
		reqs := workloadPages(tc.w)
		for _, c := range tc.caps {
			m := checkMQP2Exact(t, tc.name, tc.w, reqs, c)
			if tc.differ && c == tc.caps[0] && m.HitPages == lru(tc.w, reqs, c) {
				t.Errorf("%s at %d pages: MQP2 hits what LRU hits; the check cannot tell them apart", tc.name, c)
			}
			checkMQP2Exact(t, tc.name+", with probes", tc.w, probes(reqs), c)
		}
	}
}

// TestMQP2LearnsTipOffset: conversations whose every prompt ends in 5
// pages no later prompt shares (the traces' partial last block, in small
// pages), among twice as many one-off prompts of the same shape after
// the same shared head. MQP's tip, a prompt's last page, is never found
// again: MQP hits what LRU hits, which keeps the latest prompts of
// either kind. MQP2 learns to put the tip 7 pages back (the smallest of
// the offsets 0, 1, 3, 7, ... past the unshared pages), finds the
// conversations' tips, keeps their chains above the one-offs and hits
// more.
func TestMQP2LearnsTipOffset(t *testing.T) {
	const convs, oneOffs, turns, shared, grow, tail = 20, 40, 16, 4, 6, 5
	var reqs [][]uint32
	next := uint32(shared)
	page := func() uint32 { next++; return next - 1 }
	hist := make([][]uint32, convs)
	for c := range hist {
		hist[c] = []uint32{0, 1, 2, 3}
	}
	for turn := 0; turn < turns; turn++ {
		for c := range convs {
			for range grow {
				hist[c] = append(hist[c], page())
			}
			r := append([]uint32(nil), hist[c]...)
			for range tail { // this turn's own ending, never sent again
				r = append(r, page())
			}
			reqs = append(reqs, r)
			for range oneOffs / convs {
				o := []uint32{0, 1, 2, 3}
				for range grow*(turn+1) + tail {
					o = append(o, page())
				}
				reqs = append(reqs, o)
			}
		}
	}
	capacity := convs * (turns*grow + shared + tail) * 5 / 4
	m := newMQP2(int(next), capacity)
	got := m.replay(reqs, nil, capacity)
	if m.r2.off != 7 {
		t.Errorf("learned tip offset %d, want 7 (offsets found: %v of %v)", m.r2.off, m.r2.offFnd, m.r2.offIns)
	}
	lru := OraclePages(reqs, int(next), capacity)
	mqp := MQPPages(reqs, nil, int(next), capacity)
	if mqp.HitPages != lru.HitPages {
		t.Errorf("MQP hits %d, LRU %d: MQP should find no tip here", mqp.HitPages, lru.HitPages)
	}
	if got.HitPages <= lru.HitPages*5/4 {
		t.Errorf("MQP2 hits %d, not 1.25x LRU's %d", got.HitPages, lru.HitPages)
	}
}

// TestMQP2PageSizes: on the agentic workload's first 3,000 requests the
// prefix-hit ratio of MQP2 at 16- and 32-token pages is within 5% of its
// ratio at 512-token pages, at the same pool size in bytes, and at or
// above LRU's and ARC's at each page size (MQP at 16-token pages, whose
// tips are never found again there, hits what LRU hits: logged).
func TestMQP2PageSizes(t *testing.T) {
	if testing.Short() {
		t.Skip("a few seconds of replays")
	}
	const requests, blocks = 3000, 1000
	ratios := map[int]float64{}
	for _, pt := range []int{512, 32, 16} {
		w, err := Generate(AgenticConfig{}, LoadOptions{PageTokens: pt, Limit: requests})
		if err != nil {
			t.Fatal(err)
		}
		c := blocks * 512 / pt
		m2, lru, arc := MQP2(w, c), Oracle(w, c), ARC(w, c)
		ratios[pt] = m2.HitRatio()
		if m2.HitPages < lru.HitPages || m2.HitPages < arc.HitPages {
			t.Errorf("%d-token pages: MQP2 %.4f under LRU %.4f or ARC %.4f", pt, m2.HitRatio(), lru.HitRatio(), arc.HitRatio())
		}
		if pt == 16 {
			t.Logf("16-token pages: MQP2 %.4f, MQP %.4f, LRU %.4f, ARC %.4f", m2.HitRatio(), MQP(w, c).HitRatio(), lru.HitRatio(), arc.HitRatio())
		}
	}
	for _, pt := range []int{32, 16} {
		if r := ratios[pt] / ratios[512]; r < 0.95 || r > 1.05 {
			t.Errorf("%d-token pages: MQP2 hits %.4f, %.3f of its %.4f at 512-token pages", pt, ratios[pt], r, ratios[512])
		}
	}
}

// mooncakeTrace is the whole Mooncake conversation trace when the
// machine has it ($RINGSIDE_MOONCAKE_TRACE or /work/shared/traces), else "".
func mooncakeTrace() string {
	p := os.Getenv("RINGSIDE_MOONCAKE_TRACE")
	if p == "" {
		p = "/work/shared/traces/conversation_trace.jsonl"
	}
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}

// TestMQPMatchesCacheSmallPages: MQP's model equals the cache under
// PolicyMQP at 16-token pages too, where requests of thousands of pages
// overflow the hint table's buckets and a store whose hint was lost puts
// its block at count 1: the model keeps the same table.
func TestMQPMatchesCacheSmallPages(t *testing.T) {
	n := 900
	if testing.Short() {
		n = 300
	}
	w, err := Generate(AgenticConfig{}, LoadOptions{PageTokens: 16, Limit: n})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []int{2000, 8000} {
		checkModelExactIn(t, "agentic, 16-token pages", w, workloadPages(w), c, cache.PolicyMQP, MQPPages)
	}
}

// TestMQP2AnchorPages: the anchor rule. A page is an anchor by its hash
// alone, one in max(1, (off+1)/2) for the tip's offset off, and the anchors
// of a longer offset are anchors of every shorter one. Only anchors are
// looked up in the tip table: a non-anchor page that shares an entry with
// a counted tip (a false find, as a 12-bit fingerprint gives one lookup
// in hundreds of pages) gives the pages before it no count, where an
// anchor's entry does. The tip is the nearest anchor at or before the
// offset, not the page at it.
func TestMQP2AnchorPages(t *testing.T) {
	const keys = 1 << 16
	for k := range mqp2OffK {
		off := mqp2OffOf(k)
		want := float64(keys) / float64(max(1, (off+1)/2))
		n := 0
		for x := range uint64(keys) {
			a := mqp2Anchor(x, off)
			if a {
				n++
			}
			if a != mqp2Anchor(x, off) {
				t.Fatalf("offset %d: key %d is an anchor or not by chance", off, x)
			}
			if k > 0 && a && !mqp2Anchor(x, mqp2OffOf(k-1)) {
				t.Fatalf("key %d: an anchor at offset %d, not at %d", x, off, mqp2OffOf(k-1))
			}
		}
		if f := float64(n) / want; f < 0.9 || f > 1.1 {
			t.Errorf("offset %d: %d anchors of %d keys, want about %.0f", off, n, keys, want)
		}
	}

	const off, n = 7, 40
	model := func() *mqp {
		m := newMQP2(1000, 1000)
		m.r2.off = off // fewer than mqp2OffMin records of any offset: it stays
		return m
	}
	isAnchor := func(m *mqp, p uint32) bool { return mqp2Anchor(m.key(p), off) }
	// A request of pages base..base+n-1 whose page at the offset is not an
	// anchor and that has an anchor before it.
	var pages []uint32
	for base := uint32(0); pages == nil; base += n {
		if base >= 100*n {
			t.Fatalf("no request of %d pages among 100 with an anchor before the offset %d and none at it", n, off)
		}
		m := model()
		r := make([]uint32, n)
		for i := range r {
			r[i] = base + uint32(i)
		}
		if !isAnchor(m, r[n-1-off]) && slices.ContainsFunc(r[:n-1-off], func(p uint32) bool { return isAnchor(m, p) }) {
			pages = r
		}
	}
	m := model()
	m.begin2(0, pages, 0)
	want := n - 1 - off
	for !isAnchor(m, pages[want]) {
		want--
	}
	for i, p := range pages {
		if got := m.tfind(p) >= 0; got != (i == want) {
			t.Errorf("page %d of %d (offset %d, anchor %v): a tip %v; want the tip at page %d, the nearest anchor at or before %d",
				i, n, n-1-i, isAnchor(m, p), got, want, n-1-off)
		}
	}

	for _, anchor := range []bool{false, true} {
		m := model()
		i := slices.IndexFunc(pages[1:], func(p uint32) bool { return isAnchor(m, p) == anchor }) + 1
		m.tinsert(pages[i], false)
		j := m.tfind(pages[i])
		m.tfp[j] = m.tfp[j]&^15 | 5 // a tip read five times
		m.begin2(0, pages, 0)
		for k := 0; k <= i; k++ {
			if got, wantInf := m.inf[k], map[bool]uint8{false: 0, true: 5}[anchor]; got != wantInf {
				t.Errorf("a counted tip at page %d (anchor %v): page %d inherits %d, want %d", i, anchor, k, got, wantInf)
			}
		}
	}
}

// TestMQP2TraceInvariance: on the whole Mooncake trace at 2,000 blocks,
// where a lookup in 16-token pages checks the tip table 32 times as often
// as in 512-token pages, MQP2 in 16-token pages keeps 95% of its hit ratio
// in 512-token pages (at every page the lookups checked, false finds in
// the tip table's 12-bit fingerprints gave pages unrelated tips' counts:
// 0.915).
func TestMQP2TraceInvariance(t *testing.T) {
	p := mooncakeTrace()
	if p == "" || testing.Short() {
		t.Skip("the whole Mooncake trace, tens of seconds")
	}
	const blocks = 2000
	ratio := map[int]float64{}
	for _, pt := range []int{512, 16} {
		w, err := Load([]string{p}, LoadOptions{PageTokens: pt})
		if err != nil {
			t.Fatal(err)
		}
		ratio[pt] = MQP2(w, blocks*512/pt).HitRatio()
	}
	if r := ratio[16] / ratio[512]; r < 0.95 {
		t.Errorf("MQP2 at %d blocks: %.4f in 16-token pages, %.3f of its %.4f in 512-token pages", blocks, ratio[16], r, ratio[512])
	}
}
