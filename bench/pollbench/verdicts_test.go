package pollbench

import (
	"strings"
	"testing"
)

// The verdicts read the worst size against the client's ring target, the
// largest size against the smallest for flatness, and a skipped row's
// targets say why they were not measured.
func TestVerdicts(t *testing.T) {
	rows := []Row{
		{Client: "go", Transport: "ring", Hashes: 64, P50Ns: 800},
		{Client: "go", Transport: "ring", Hashes: 1024, P50Ns: 1100},
		{Client: "go", Transport: "uds", Hashes: 64, P50Ns: 20000},
		{Client: "go", Transport: "uds", Hashes: 1024, P50Ns: 21000},
		{Client: "python", Transport: "ring", Skipped: "no python"},
	}
	got := strings.Join(Verdicts(rows), "\n")
	for _, want := range []string{
		"target go/ring p50 <= 1 µs (every size): MISSED (64: 0.80 us, 1024: 1.10 us)",
		"target flat: p50 at the most hashes <= 1.2x p50 at the fewest (go/ring, 1024 vs 64 hashes): MISSED (1.38x)",
		"target flat: p50 at the most hashes <= 1.2x p50 at the fewest (go/uds, 1024 vs 64 hashes): met (1.05x)",
		"socket hop at 1024 hashes: uds - ring = 19.90 us",
		"target python/ring p50 <= 5 µs (every size): not measured (no python)",
		"target flat: p50 at the most hashes <= 1.2x p50 at the fewest (python/ring): not measured (no python)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("verdicts lack %q:\n%s", want, got)
		}
	}
}
