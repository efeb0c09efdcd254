package pollbench

import "github.com/ringside-kv/ringside/bench/harness"

// The design targets of `ringside-bench poll`, declared once; Verdicts reads
// the rows against them.
var (
	// One poll through the ring, per client, at every size measured.
	targetRingP50 = map[string]harness.Target{
		"go":     {What: "go/ring p50", Cmp: harness.AtMost, Bound: 1, Unit: "µs", Where: "every size"},
		"python": {What: "python/ring p50", Cmp: harness.AtMost, Bound: 5, Unit: "µs", Where: "every size"},
	}
	// A poll's cost does not grow with the hashes it carries; per client
	// and transport.
	targetFlat = harness.Target{What: "flat: p50 at the most hashes", Cmp: harness.AtMost, Bound: 1.2, Unit: "x p50 at the fewest"}
)
