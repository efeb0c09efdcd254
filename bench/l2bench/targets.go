package l2bench

import "github.com/ringside-kv/ringside/bench/harness"

// The design target of `ringside-bench l2`, declared once: the shared tier
// through live sidecars moves bytes nearly as fast as a plain go-redis loop
// against the same server, in the worst row.
var targetVsPlainLoop = harness.Target{What: "sidecar", Cmp: harness.AtLeast, Bound: 0.8, Unit: "x the plain loop", Where: "every row"}
