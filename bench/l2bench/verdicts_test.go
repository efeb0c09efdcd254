package l2bench

import (
	"slices"
	"testing"
)

// The verdict reads the worst row against the target.
func TestVerdicts(t *testing.T) {
	rows := []Row{{Ratio: 0.95}, {Ratio: 0.79}, {Ratio: 1.1}}
	want := []string{"target sidecar >= 0.8x the plain loop (every row): MISSED (lowest 0.79x)"}
	if got := verdicts(rows); !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	if got := verdicts(rows[:1]); got[0] != "target sidecar >= 0.8x the plain loop (every row): met (lowest 0.95x)" {
		t.Errorf("got %q", got)
	}
	if got := verdicts(nil); got != nil {
		t.Errorf("no rows gave %q", got)
	}
}
