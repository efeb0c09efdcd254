package harness

import "testing"

func TestTargetLines(t *testing.T) {
	p50 := Target{What: "Go->Go ring p50", Cmp: AtMost, Bound: 0.5, Unit: "µs", Where: "16 B, spin"}
	ratio := Target{What: "batched blocks", Cmp: AtLeast, Bound: 0.9, Unit: "x the ceiling"}
	cpu := Target{What: "sidecar CPU", Cmp: Below, Bound: 25, Unit: "% of one core"}
	grows := Target{What: "walk p50 at the largest capacity", Cmp: Above, Bound: 2, Unit: "x at the smallest"}
	equal := Target{What: "hit rate equal to the offline LRU", Cmp: Statement}
	tests := []struct {
		got, want string
	}{
		{p50.Verdict(0.3, "0.30 µs"), "target Go->Go ring p50 <= 0.5 µs (16 B, spin): met (0.30 µs)"},
		{p50.Verdict(0.5, ""), "target Go->Go ring p50 <= 0.5 µs (16 B, spin): met"},
		{p50.Verdict(0.51, ""), "target Go->Go ring p50 <= 0.5 µs (16 B, spin): MISSED"},
		{ratio.At("h2d").At("128 pages").Verdict(0.89, "0.89x"), "target batched blocks >= 0.9x the ceiling (h2d, 128 pages): MISSED (0.89x)"},
		{ratio.Verdict(0.9, ""), "target batched blocks >= 0.9x the ceiling: met"},
		{cpu.Verdict(25, ""), "target sidecar CPU < 25% of one core: MISSED"},
		{cpu.Verdict(24.9, ""), "target sidecar CPU < 25% of one core: met"},
		{grows.Verdict(2, ""), "target walk p50 at the largest capacity > 2x at the smallest: MISSED"},
		{grows.Verdict(2.1, ""), "target walk p50 at the largest capacity > 2x at the smallest: met"},
		{equal.At("sequential").Holds(true, ""), "target hit rate equal to the offline LRU (sequential): met"},
		{equal.Holds(false, "3 runs differ"), "target hit rate equal to the offline LRU: MISSED (3 runs differ)"},
		{p50.NotMeasured(""), "target Go->Go ring p50 <= 0.5 µs (16 B, spin): not measured"},
		{ratio.NotMeasured("no rows"), "target batched blocks >= 0.9x the ceiling: not measured (no rows)"},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("got  %q\nwant %q", tt.got, tt.want)
		}
	}
}

func TestStatementHasNoBound(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("Met on a Statement did not panic")
		}
	}()
	Target{What: "x", Cmp: Statement}.Met(1)
}
