package ringbench

import (
	"fmt"

	"github.com/ringside-kv/ringside/bench/harness"
)

// The design targets of `ringside-bench ring`, declared once; Verdicts reads
// the rows against them.
var (
	// A Go client's round trip through the ring, absolute and against the
	// floor: two goroutines bouncing one word through shared memory.
	targetGoP50       = harness.Target{What: "Go->Go ring p50", Cmp: harness.AtMost, Bound: 0.5, Unit: "µs", Where: sizeName(SmallPayload) + ", spin"}
	targetGoPingPong  = harness.Target{What: "Go->Go ring p50", Cmp: harness.AtMost, Bound: 2, Unit: "x bare ping-pong"}
	targetPythonSmall = harness.Target{What: "Python->Go ring p50", Cmp: harness.AtMost, Bound: 5, Unit: "µs", Where: sizeName(SmallPayload) + ", spin"}
	targetPythonLarge = harness.Target{What: "Python->Go ring p50", Cmp: harness.AtMost, Bound: 10, Unit: "µs", Where: sizeName(LargePayload) + ", spin"}
	// The ring's round trip against the Unix socket's, per client and size.
	targetVsSocket   = harness.Target{What: "ring", Cmp: harness.AtLeast, Bound: 5, Unit: "x faster than socket at p50"}
	targetThroughput = harness.Target{What: "Go->Go throughput", Cmp: harness.AtLeast, Bound: 10, Unit: fmt.Sprintf("M %d-byte records/s", ThroughputBytes)}
)
