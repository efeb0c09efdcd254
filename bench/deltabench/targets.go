package deltabench

import "github.com/ringside-kv/ringside/bench/harness"

// The design targets of `ringside-bench delta`, declared once; Verdicts reads
// the rows against them.
var (
	// A step's delta costs the same however many blocks are cached.
	targetDeltaFlat = harness.Target{What: "delta cost at the most cached blocks", Cmp: harness.AtMost, Bound: 1.5, Unit: "x at the fewest"}
	// The sidecar's own memory per cached block.
	targetMemory = harness.Target{What: "memory", Cmp: harness.AtMost, Bound: 64, Unit: "bytes/block"}
)
