package l2

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Metrics are the tier client's Prometheus series (the sidecar registers
// them beside its own; the Machine's decisions, such as writes skipped for
// the bound on pinned slots, are the sidecar's series).
type Metrics struct {
	lookups      *prometheus.CounterVec // by result: ok, error, unavailable
	lookupBlocks *prometheus.CounterVec // by result: hit, miss
	fetchBlocks  *prometheus.CounterVec // by result: ok, miss, rejected, error, timeout, unavailable
	writes       *prometheus.CounterVec // by result: ok, error, queue_full, unavailable
	rejected     *prometheus.CounterVec // by reason (value.go)
	errors       *prometheus.CounterVec // by op: lookup, fetch, write, connect
	bytes        *prometheus.CounterVec // by direction: read, written
	seconds      *prometheus.HistogramVec
	queue        prometheus.GaugeFunc
	queueCap     prometheus.Gauge
	queueLen     func() int
}

func newMetrics(queueLen func() int) *Metrics {
	m := &Metrics{
		lookups:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_lookups_total", Help: "Lookups of the shared tier, by result (unavailable: not connected, or too many in flight)."}, []string{"result"}),
		lookupBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_lookup_blocks_total", Help: "Blocks the shared tier was asked about, by result (hit: every rank held, in the leading run)."}, []string{"result"}),
		fetchBlocks:  prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_fetch_blocks_total", Help: "Blocks fetched from the shared tier into the pool, by result."}, []string{"result"}),
		writes:       prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_writes_total", Help: "Blocks written to the shared tier, by result (queue_full: refused, never slowing a store)."}, []string{"result"}),
		rejected:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_rejected_values_total", Help: "Values read from the shared tier that were not the block asked for (never served), by reason."}, []string{"reason"}),
		errors:       prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_errors_total", Help: "Failed round trips to the shared tier, by operation."}, []string{"op"}),
		bytes:        prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_l2_bytes_total", Help: "Value bytes moved to and from the shared tier."}, []string{"direction"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "ringside_l2_seconds", Help: "Latency of the shared tier's round trips, by operation (a fetch or a write: all of its values).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 18)}, []string{"op"}),
		queueLen: queueLen,
		queueCap: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ringside_l2_write_queue_capacity", Help: "The most writes that may wait (--l2.write-queue)."}),
	}
	m.queue = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ringside_l2_write_queue", Help: "Writes waiting for a writer."}, func() float64 { return float64(queueLen()) })
	for _, r := range []string{"ok", "error", "unavailable"} {
		m.lookups.WithLabelValues(r)
	}
	for _, r := range []string{"hit", "miss"} {
		m.lookupBlocks.WithLabelValues(r)
	}
	for _, r := range []string{"ok", "miss", "rejected", "error", "timeout", "unavailable"} {
		m.fetchBlocks.WithLabelValues(r)
	}
	for _, r := range []string{"ok", "error", "queue_full", "unavailable"} {
		m.writes.WithLabelValues(r)
	}
	for _, r := range []string{RejectShort, RejectHeader, RejectIdentity, RejectLength, RejectChecksum, RejectTrailing} {
		m.rejected.WithLabelValues(r)
	}
	for _, r := range []string{"lookup", "fetch", "write", "connect"} {
		m.errors.WithLabelValues(r)
	}
	for _, op := range []string{"lookup", "fetch", "write"} {
		m.seconds.WithLabelValues(op)
	}
	for _, r := range []string{"read", "written"} {
		m.bytes.WithLabelValues(r)
	}
	return m
}

// Collectors are every series, to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.lookups, m.lookupBlocks, m.fetchBlocks, m.writes, m.rejected, m.errors, m.bytes, m.seconds, m.queue, m.queueCap}
}

// Snapshot is the counters' values, for /debug/state and tests.
type Snapshot struct {
	Lookups      map[string]float64 `json:"lookups"`
	LookupBlocks map[string]float64 `json:"lookup_blocks"`
	FetchBlocks  map[string]float64 `json:"fetch_blocks"`
	Writes       map[string]float64 `json:"writes"`
	Rejected     map[string]float64 `json:"rejected_values"`
	Errors       map[string]float64 `json:"errors"`
	Bytes        map[string]float64 `json:"bytes"`
	Queue        float64            `json:"write_queue"`
}

// Snapshot reads the counters.
func (m *Metrics) Snapshot() Snapshot {
	return Snapshot{Lookups: vec(m.lookups), LookupBlocks: vec(m.lookupBlocks), FetchBlocks: vec(m.fetchBlocks),
		Writes: vec(m.writes), Rejected: vec(m.rejected), Errors: vec(m.errors), Bytes: vec(m.bytes), Queue: float64(m.queueLen())}
}

func vec(v *prometheus.CounterVec) map[string]float64 {
	out := map[string]float64{}
	ch := make(chan prometheus.Metric, 64)
	go func() { v.Collect(ch); close(ch) }()
	for mt := range ch {
		var d dto.Metric
		if mt.Write(&d) == nil && d.Counter != nil && len(d.Label) == 1 {
			out[d.Label[0].GetValue()] = d.Counter.GetValue()
		}
	}
	return out
}
