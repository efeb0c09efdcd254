package replay

import "github.com/ringside-kv/ringside/bench/harness"

// The design targets of `ringside-bench replay`, declared once; the
// report's verdicts read the runs against them.
var (
	// Latency of the engine's calls through the ring, over every capacity
	// (stated for 2 engine instances).
	targetLookup  = harness.Target{What: "lookup p99", Cmp: harness.Below, Bound: 20, Unit: "µs", Where: "ring, all capacities"}
	targetAcquire = harness.Target{What: "acquire-and-poll p99", Cmp: harness.Below, Bound: 50, Unit: "µs", Where: "ring, all capacities"}
	// The change log's cost per change does not grow with the cache; the
	// full walk it replaces does.
	targetDeltaFlat = harness.Target{What: "per-step delta cost per change, largest over capacities", Cmp: harness.AtMost, Bound: 1.5, Unit: "x the smallest"}
	targetWalkGrows = harness.Target{What: "walk baseline p50 at the largest capacity", Cmp: harness.Above, Bound: 2, Unit: "x at the smallest"}
	targetCPU       = harness.Target{What: "sidecar CPU", Cmp: harness.Below, Bound: 25, Unit: "% of one core", Where: "at the trace's real pace"}
	// The sidecar's hits are the exact offline model's of its policy (the
	// LRU's; MQP's under --cache.policy mqp, the What naming it), and with
	// a shared tier the fleet model's.
	targetOracle = harness.Target{What: "hit rate equal to the offline LRU at every capacity", Cmp: harness.Statement}
	targetFleet  = harness.Target{What: "pages fetched from the tier and loaded equal to the model's", Cmp: harness.Statement, Where: "sequential"}
	// --node-tier: the pods' pools over one node process, against
	// OracleNodeTier, count for count.
	targetNodeTier = harness.Target{What: "pages fetched from the node tier, loaded, written into it, evicted from it and held at the end equal to the model's", Cmp: harness.Statement, Where: "sequential"}
)
