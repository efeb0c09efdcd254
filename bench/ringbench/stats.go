package ringbench

import (
	"slices"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
)

// samples collects latencies in nanoseconds. Every sample is kept (a row has
// at most a few hundred thousand), so percentiles are exact nearest-rank
// values, computed the same way as the Python peer's.
type samples struct {
	ns []int64
}

func newSamples(n int) *samples { return &samples{ns: make([]int64, 0, n)} }

func (s *samples) add(d time.Duration) { s.ns = append(s.ns, int64(d)) }

// summary is the latency part of a row.
type summary struct {
	n              int
	p50, p99, mean int64
}

func (s *samples) summary() summary {
	n := len(s.ns)
	if n == 0 {
		return summary{}
	}
	v := slices.Clone(s.ns)
	slices.Sort(v)
	var sum int64
	for _, x := range v {
		sum += x
	}
	return summary{n: n, p50: harness.Rank(v, 50), p99: harness.Rank(v, 99), mean: sum / int64(n)}
}
