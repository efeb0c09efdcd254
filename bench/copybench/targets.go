package copybench

import (
	"fmt"

	"github.com/ringside-kv/ringside/bench/harness"
)

// The GPU targets, each against the same run's ceiling (one plain copy of
// the same bytes), declared once; Verdicts reads the rows against them.
// Per-layer ranges are a Llama-3-8B block's 32 KiB K or V of one layer (64
// ranges per 2 MiB block in FlashAttention's layout), cross-layer blocks
// the whole 2 MiB block as one range; a 2,048-token prefix of that model is
// 128 blocks, 256 MiB.
const (
	perLayerBytes   = 32 << 10
	crossLayerBytes = 2 << 20
	prefixBytes     = 256 << 20
)

var (
	// Batched copies at the largest page count measured, per direction.
	targetCrossLayer = harness.Target{What: "cross-layer 2 MiB blocks batched", Cmp: harness.AtLeast, Bound: 0.9, Unit: "x the ceiling"}
	targetPerLayer   = harness.Target{What: "per-layer 32 KiB ranges batched", Cmp: harness.AtLeast, Bound: 0.6, Unit: "x the ceiling"}
	// A prefix's load, as per-layer ranges and as whole blocks.
	targetPrefixLoad = harness.Target{What: fmt.Sprintf("load of a 2,048-token prefix (%d MiB)", prefixBytes>>20), Cmp: harness.Below, Bound: 8, Unit: "ms"}
)
