package replay

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/sidecar/cache"
)

const testTrace = "testdata/conversation_trace_300.jsonl"

// cacheReplay drives the sidecar's real state machine in process with the
// engine's sequence of calls (as sidecar/session.go makes them) and
// returns the same counts as Oracle.
func cacheReplay(t *testing.T, w *Workload, capacity int) OracleResult {
	t.Helper()
	c, err := cache.New(cache.Config{Capacity: capacity, Epoch: 1})
	if err != nil {
		t.Fatal(err)
	}
	ns, err := c.AddNamespace(cache.NamespaceKey{Model: "m", Layout: 1, DigestWidth: DigestWidth, WorldSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	res := OracleResult{CapacityPages: capacity, Requests: len(w.Requests)}
	var now int64
	for _, r := range w.Requests {
		now++
		d := w.AppendDigests(nil, r.Pages)
		h, err := c.Lookup(ns, d)
		if err != nil {
			t.Fatal(err)
		}
		res.TotalPages += int64(len(r.Pages))
		res.HitPages += int64(h)
		var lease cache.Lease
		if h > 0 {
			if lease, err = c.Acquire(ns, 0, d[:h*DigestWidth], 1, time.Minute, now); err != nil {
				t.Fatal(err)
			}
			if lease.Blocks != h {
				t.Fatalf("acquire pinned %d of %d", lease.Blocks, h)
			}
		}
		var tickets []cache.Ticket
		for i := h; i < len(r.Pages); i++ {
			tk, st, err := c.BeginStore(ns, 0, d[i*DigestWidth:(i+1)*DigestWidth], 1, now)
			if err != nil {
				t.Fatal(err)
			}
			switch st {
			case cache.Allocated:
				tickets = append(tickets, tk)
			case cache.AlreadyPresent, cache.InFlight:
				res.PresentPages++
			case cache.NoSpace:
				res.SkippedPages++
			}
		}
		for _, tk := range tickets {
			if err := c.CommitStore(tk); err != nil {
				t.Fatal(err)
			}
			res.StoredPages++
		}
		if err := c.Release(lease.ID); err != nil {
			t.Fatal(err)
		}
	}
	st := c.Stats()
	res.Evictions = int64(st.Evictions)
	res.Resident = c.Len(ns)
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	return res
}

// TestOracleMatchesCache checks the offline LRU against the sidecar's own
// state machine, call for call, on the first 300 requests of the shipped
// trace at capacities small enough to evict and to refuse stores.
func TestOracleMatchesCache(t *testing.T) {
	w, err := Load([]string{testTrace}, LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, capacity := range []int{16, 100, 512, 4096, 65536, 1 << 20} {
		got, want := Oracle(w, capacity), cacheReplay(t, w, capacity)
		// The cache cannot count the pages present behind the leading run
		// without touching them; policies_test checks BlockHitPages.
		want.BlockHitPages = got.BlockHitPages
		if got != want {
			t.Errorf("capacity %d:\noracle %+v\ncache  %+v", capacity, got, want)
		}
		if capacity >= 100 && capacity <= 4096 && got.Evictions == 0 {
			t.Errorf("capacity %d: no evictions; the test should exercise them", capacity)
		}
	}
	// A cache that never evicts gives the unbounded hit ratio.
	if got, want := Oracle(w, w.DistinctPages).HitRatio(), w.UnboundedHitRatio(); got != want {
		t.Errorf("oracle at %d pages (every distinct page) = %v, unbounded = %v", w.DistinctPages, got, want)
	}
}

// TestOraclePagesRenumbered checks that OraclePages depends only on which
// requests share which pages, not on the ids: the trace renumbered densely
// in order of first use gives Oracle's result.
func TestOraclePagesRenumbered(t *testing.T) {
	w, err := Load([]string{testTrace}, LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[uint32]uint32{}
	reqs := make([][]uint32, len(w.Requests))
	for i, r := range w.Requests {
		for _, p := range r.Pages {
			id, ok := ids[p]
			if !ok {
				id = uint32(len(ids))
				ids[p] = id
			}
			reqs[i] = append(reqs[i], id)
		}
	}
	for _, capacity := range []int{16, 512, 4096} {
		if got, want := OraclePages(reqs, len(ids), capacity), Oracle(w, capacity); got != want {
			t.Errorf("capacity %d:\npages  %+v\noracle %+v", capacity, got, want)
		}
	}
}

func TestOracleSemantics(t *testing.T) {
	// Hand-made pages: w.Requests with page ids only (digests unused).
	mk := func(reqs ...[]uint32) *Workload {
		w := &Workload{PagesPerBlock: 1}
		for _, p := range reqs {
			w.Requests = append(w.Requests, Request{Pages: p})
			for _, x := range p {
				w.Blocks = max(w.Blocks, int(x)+1)
			}
		}
		return w
	}
	// Capacity 3: store A B C; then A B (hits 2: touched, pinned,
	// released: A most recent); then D evicts C (the LRU: B and A are
	// more recent); then A B C hits 2 (C was evicted) and stores C,
	// evicting D.
	w := mk([]uint32{0, 1, 2}, []uint32{0, 1}, []uint32{3}, []uint32{0, 1, 2})
	o := Oracle(w, 3)
	if o.HitPages != 4 || o.StoredPages != 5 || o.Evictions != 2 || o.Resident != 3 {
		t.Errorf("got %+v", o)
	}
	// A request larger than the pool: the tail is refused (NoSpace).
	o = Oracle(mk([]uint32{0, 1, 2, 3, 4}), 3)
	if o.StoredPages != 3 || o.SkippedPages != 2 || o.Evictions != 0 {
		t.Errorf("got %+v", o)
	}
	// Pinned hits are not evictable: capacity 2 holding {0,1}; request
	// 0 1 5 hits 2 and cannot store 5.
	o = Oracle(mk([]uint32{0, 1}, []uint32{0, 1, 5}), 2)
	if o.HitPages != 2 || o.SkippedPages != 1 {
		t.Errorf("got %+v", o)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	a := filepath.Join(dir, "a.jsonl")
	b := filepath.Join(dir, "b.jsonl")
	os.WriteFile(a, []byte(strings.Join([]string{
		`{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]}`,
		`{"timestamp": 30, "input_length": 700, "output_length": 5, "hash_ids": [1, 3]}`,
		``,
		`{"timestamp": 50, "input_length": 10, "output_length": 5, "hash_ids": [1]}`,
	}, "\n")), 0o644)
	os.WriteFile(b, []byte(`{"timestamp": 20, "input_length": 512, "output_length": 1, "hash_ids": [1]}`+"\n"), 0o644)
	w, err := Load([]string{a, b}, LoadOptions{PageTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 4 || w.PagesPerBlock != 32 {
		t.Fatalf("%d requests, %d pages per block", len(w.Requests), w.PagesPerBlock)
	}
	r0, rb, r1, r2 := w.Requests[0], w.Requests[1], w.Requests[2], w.Requests[3]
	if rb.Trace != 1 || rb.ArrivalMs != 20 || r1.ArrivalMs != 30 {
		t.Fatalf("merge order: %+v", w.Requests)
	}
	// 1024 tokens: 64 pages; 700 tokens: 43 full pages; 10 tokens: none.
	if len(r0.Pages) != 64 || len(r1.Pages) != 43 || len(r2.Pages) != 0 || len(rb.Pages) != 32 {
		t.Fatalf("pages: %d %d %d %d", len(r0.Pages), len(r1.Pages), len(r2.Pages), len(rb.Pages))
	}
	// Shared prefix (block 1) gives the same pages; block 3 after 1 differs
	// from block 2 after 1; trace b's block 1 shares nothing with a's.
	for i := 0; i < 32; i++ {
		if r0.Pages[i] != r1.Pages[i] || r0.Pages[i] == rb.Pages[i] {
			t.Fatalf("page %d: %d %d %d", i, r0.Pages[i], r1.Pages[i], rb.Pages[i])
		}
	}
	if r0.Pages[32] == r1.Pages[32] {
		t.Fatal("different blocks share a page")
	}
	// Digests are distinct and chained.
	seen := map[string]bool{}
	for p := 0; p < w.NumPageIDs(); p++ {
		d := string(w.Digest(uint32(p)))
		if seen[d] {
			t.Fatalf("page %d: duplicate digest", p)
		}
		seen[d] = true
	}
	if w.TotalPages != 64+43+32 || w.MaxPages != 64 || w.SpanMs != 50 {
		t.Errorf("totals %d max %d span %d", w.TotalPages, w.MaxPages, w.SpanMs)
	}
	if w, err := Load([]string{a}, LoadOptions{Limit: 1}); err != nil || len(w.Requests) != 1 {
		t.Errorf("limit: %v", err)
	}
	os.WriteFile(b, []byte(`{"timestamp": 20}`+"\n"), 0o644)
	if _, err := Load([]string{b}, LoadOptions{}); err == nil || !strings.Contains(err.Error(), "b.jsonl:1") {
		t.Errorf("bad line: %v", err)
	}
	if _, err := Load(nil, LoadOptions{}); err == nil {
		t.Error("no trace accepted")
	}
	if _, err := Load([]string{a}, LoadOptions{PageTokens: 24}); err == nil {
		t.Error("page tokens that do not divide the block accepted")
	}
}

func ExampleOracle() {
	w, _ := Load([]string{testTrace}, LoadOptions{Limit: 100})
	o := Oracle(w, 1024)
	fmt.Printf("%d pages, %d hits\n", o.TotalPages, o.HitPages)
	// Output: 95248 pages, 3168 hits
}

// TestWriteCSVOptionalFigure: an optional figure (a pointer field, as
// live_hints_hit_ratio) is its value in the CSV, or empty when absent;
// never the pointer's address.
func TestWriteCSVOptionalFigure(t *testing.T) {
	r := 0.25
	rep := &Report{Rows: []any{
		PolicyRow{Bench: "replay_policy", CapacityPages: 1, LiveHintsHitRatio: &r},
		PolicyRow{Bench: "replay_policy", CapacityPages: 2},
	}}
	var b strings.Builder
	if err := rep.writeCSV(&b, "replay_policy"); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 || !strings.HasSuffix(lines[1], ",0.25") || !strings.HasSuffix(lines[2], ",") {
		t.Fatalf("CSV:\n%s", b.String())
	}
}
