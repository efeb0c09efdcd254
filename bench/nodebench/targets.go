package nodebench

import "github.com/ringside-kv/ringside/bench/harness"

// The design target of `ringside-bench node`, declared once: a fetch from
// the node tier at least 0.8x a plain copy of the same bytes, in every
// block size (docs/benchmarks.md, "At a glance").
var targetFetch = harness.Target{What: "node-tier fetch throughput", Cmp: harness.AtLeast, Bound: 0.8, Unit: "x Go's copy() of the same bytes", Where: "every block size"}
