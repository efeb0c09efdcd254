package node

import (
	"net/http"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Handler serves the node process's /metrics (ringside_node_server_*),
// /healthz and /readyz (200 while it serves).
func (s *Server) Handler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	counter := func(name, help string, v *atomic.Uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ringside_node_server_" + name, Help: help}, func() float64 { return float64(v.Load()) }))
	}
	m := &s.met
	counter("attaches_total", "Sidecars attached.", &m.Attaches)
	counter("attaches_refused_total", "Attaches refused: no Hello in time, a bad one, a uid not allowed, too many pods, another version.", &m.AttachRefused)
	counter("attaches_refused_pod_limit_total", "Attaches refused because their pod had --conns-per-pod connections already (counted in attaches_refused_total too).", &m.AttachPodLimit)
	counter("connections_refused_pending_total", "Connections closed at once: their pod had --conns-per-pod connections without a Hello yet, or the node twice --max-pods (counted in attaches_refused_total too).", &m.PendingRefused)
	counter("accept_errors_total", "Connections the node could not accept (out of descriptors or memory): it retries, backing off to 1 s.", &m.AcceptErrors)
	counter("attaches_renamed_total", "Attaches declaring another pod name than their pod's first (one network namespace under --pod-identity netns): charged to one share.", &m.AttachRenamed)
	counter("lookups_total", "Lookups served.", &m.Lookups)
	counter("lookup_blocks_total", "Blocks lookups asked about.", &m.LookupBlocks)
	counter("lookup_hit_blocks_total", "Leading blocks lookups found.", &m.LookupHits)
	counter("get_values_total", "Values fetches asked for.", &m.GetItems)
	counter("get_hit_values_total", "Values a fetch copied into a pod's pool.", &m.GetHits)
	counter("fetch_not_resident_values_total", "Values not fetched: their place in the pod's pool was not in memory (the node allocates no pod memory).", &m.FetchNotResident)
	counter("fetch_fault_values_total", "Values whose copy into a pod's pool faulted (the pool truncated under it, or its mount full).", &m.FetchFaults)
	counter("put_values_total", "Values offered.", &m.PutItems)
	counter("put_stored_values_total", "Values checked and stored.", &m.PutStored)
	counter("put_held_values_total", "Values offered that the pool held already.", &m.PutExists)
	counter("put_no_space_values_total", "Values refused: no slot could be freed.", &m.PutFull)
	counter("rejected_values_total", "Values whose header or CRC32C did not match their Put: never stored.", &m.Rejected)
	counter("malformed_requests_total", "Requests answered status 3 (malformed).", &m.Malformed)
	counter("unregistered_requests_total", "Requests naming a namespace their connection did not register.", &m.NotRegistered)
	counter("dropped_connections_total", "Connections ended by the node: a bad header, an oversized message, or replies not read in time.", &m.Dropped)
	counter("bytes_in_total", "Bytes of values stored.", &m.BytesIn)
	counter("bytes_out_total", "Bytes of payloads copied into pods' pools.", &m.BytesOut)
	counter("described_blocks_total", "Block descriptions accepted, for KV events.", &m.Described)
	counter("describe_refused_total", "Block descriptions refused past --pool.desc-bytes: the block is cached but not announced.", &m.DescribeRefused)
	counter("event_reads_total", "Reads of a namespace's event log.", &m.EventReads)
	gauge := func(name, help string, get func(IndexStats) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ringside_node_server_" + name, Help: help}, func() float64 { return get(s.Index()) }))
	}
	gauge("slots", "Slots of the pool.", func(st IndexStats) float64 { return float64(st.Slots) })
	gauge("present_slots", "Slots holding a value.", func(st IndexStats) float64 { return float64(st.Present) })
	gauge("free_slots", "Slots free.", func(st IndexStats) float64 { return float64(st.Free) })
	gauge("pods", "Pods (by --pod-identity) with a connection or blocks charged.", func(st IndexStats) float64 { return float64(st.Owners) })
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ringside_node_server_connections", Help: "Sidecars attached now."},
		func() float64 { return float64(s.Conns()) }))
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ringside_node_server_evicted_total", Help: "Values evicted for room: the pool's (reason pool) or their pod's share (share)."},
		func() float64 { st := s.Index(); return float64(st.Evicted + st.EvictedShare) }))
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	ok := func(w http.ResponseWriter, _ *http.Request) {
		select {
		case <-s.stop:
			http.Error(w, "stopping", http.StatusServiceUnavailable)
		default:
			w.Write([]byte("ok\n"))
		}
	}
	mux.HandleFunc("/healthz", ok)
	mux.HandleFunc("/readyz", ok)
	return mux
}
