package deltabench

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestShape checks how the costs scale, from one run with small sizes,
// never an absolute time: following the delta log costs about the same at
// every size, walking the index grows with it, and every row is there.
func TestShape(t *testing.T) {
	for _, pol := range []string{"lru", "mqp"} {
		t.Run(pol, func(t *testing.T) { testShape(t, pol) })
	}
	if _, err := Run(Config{Sizes: []int{10_000}, Policy: "arc", Quiet: true}); err == nil {
		t.Fatal("policy arc accepted")
	}
}

func testShape(t *testing.T, policy string) {
	sizes := []int{10_000, 100_000, 1_000_000}
	if testing.Short() || raceEnabled || policy != "lru" {
		sizes = []int{10_000, 100_000}
	}
	var out bytes.Buffer
	rows, err := Run(Config{Sizes: sizes, Steps: 300, Warmup: 20, WalkBudget: 300 * time.Millisecond, JSON: true, Quiet: true, Out: &out, Policy: policy})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Policy != policy {
			t.Fatalf("row %+v: policy %q, want %q", r, r.Policy, policy)
		}
	}
	// JSON Lines: one object per row with the documented fields.
	dec := json.NewDecoder(&out)
	n := 0
	for dec.More() {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			t.Fatal(err)
		}
		n++
		switch m["bench"] {
		case "delta":
			for _, f := range []string{"method", "cached_blocks", "step_ns", "changes_per_step"} {
				if _, ok := m[f]; !ok {
					t.Errorf("delta row without %s: %v", f, m)
				}
			}
		case "memory":
			for _, f := range []string{"cached_blocks", "bytes_per_block"} {
				if _, ok := m[f]; !ok {
					t.Errorf("memory row without %s: %v", f, m)
				}
			}
			if m["cached_blocks"].(float64) != float64(sizes[len(sizes)-1]) {
				t.Errorf("memory row for %v blocks, want the largest size", m["cached_blocks"])
			}
		case "memory_described":
			// What a description adds per block, within what the metadata
			// bounds count for it.
			h, c := m["heap_bytes_per_block"].(float64), m["desc_cost_bytes"].(float64)
			if h <= 64 || h > c || m["desc_tokens"].(float64) != 16 {
				t.Errorf("memory_described row: heap %.1f bytes per description, counted %.1f: %v", h, c, m)
			}
		default:
			t.Errorf("unknown row %v", m)
		}
	}
	if want := 2*len(sizes) + 2; n != want || len(rows) != want {
		t.Fatalf("%d JSON rows, %d rows, want %d", n, len(rows), want)
	}
	get := func(method string, size int) Row {
		for _, r := range rows {
			if r.Bench == "delta" && r.Method == method && r.CachedBlocks == size {
				return r
			}
		}
		t.Fatalf("no %s row for %d", method, size)
		return Row{}
	}
	small, large := sizes[0], sizes[len(sizes)-1]
	// Every timed step logs its 32 stores and as many evictions.
	if d := get("delta", large); d.ChangesPerStep != 64 {
		t.Errorf("delta reads %.1f changes per step, want 64 (32 stored, 32 evicted)", d.ChangesPerStep)
	}
	if w := get("walk", large); w.ChangesPerStep < float64(large) {
		t.Errorf("walk reads %.0f digests per step, want at least %d", w.ChangesPerStep, large)
	}
	// Min of repeats cuts the noise of a shared machine.
	if lo, hi := get("delta", small).MinStepNs, get("delta", large).MinStepNs; float64(hi) > 3*float64(lo) {
		t.Errorf("delta step at %d blocks costs %d ns, %.1fx its cost at %d (%d ns); want <= 3x", large, hi, float64(hi)/float64(lo), small, lo)
	}
	if lo, hi := get("walk", small).MinStepNs, get("walk", large).MinStepNs; float64(hi) < 3*float64(lo) {
		t.Errorf("walk at %d blocks (%d ns) is not clearly dearer than at %d (%d ns)", large, hi, small, lo)
	}
	for _, r := range rows {
		if r.Bench == "memory" && (r.BytesPerBlock <= 0 || r.BytesPerBlock < r.ModelBytesPerBlock) {
			t.Errorf("memory row %+v", r)
		}
	}
}

func TestParseSizes(t *testing.T) {
	got, err := ParseSizes("10k, 1M,250000")
	if err != nil || len(got) != 3 || got[0] != 10_000 || got[1] != 1_000_000 || got[2] != 250_000 {
		t.Fatalf("%v %v", got, err)
	}
	for _, bad := range []string{"", "x", "10x", "-5", "1.5M"} {
		if _, err := ParseSizes(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// The verdicts read the largest size's delta against the smallest's and the
// memory row against its bound.
func TestVerdicts(t *testing.T) {
	rows := []Row{
		{Bench: "delta", Method: "delta", CachedBlocks: 10_000, StepNs: 2000},
		{Bench: "delta", Method: "walk", CachedBlocks: 10_000, StepNs: 40_000},
		{Bench: "delta", Method: "delta", CachedBlocks: 1_000_000, StepNs: 2600},
		{Bench: "memory", CachedBlocks: 1_000_000, BytesPerBlock: 70.5},
	}
	got := strings.Join(Verdicts(rows), "\n")
	for _, want := range []string{
		"target delta cost at the most cached blocks <= 1.5x at the fewest (1000000 vs 10000 blocks): met (2.60 us vs 2.00 us, 1.30x)",
		"walk/delta at 10000 blocks: 20x",
		"target memory <= 64 bytes/block (1000000 blocks): MISSED (70.50)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("verdicts lack %q:\n%s", want, got)
		}
	}
}
