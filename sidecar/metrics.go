package sidecar

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// metrics are the sidecar's Prometheus series. Pool, cache and machine
// figures are read when scraped (under the server's lock, briefly);
// request counters are kept as they happen.
type metrics struct {
	reg          *prometheus.Registry
	requests     *prometheus.CounterVec
	errors       *prometheus.CounterVec
	copyBytes    *prometheus.CounterVec
	copySeconds  *prometheus.CounterVec
	copyLatency  *prometheus.HistogramVec
	ringWait     prometheus.Counter
	attaches     prometheus.Counter
	detaches     prometheus.Counter
	attachErrors prometheus.Counter
	dropped      prometheus.Counter
	acceptErrors prometheus.Counter
	srv          *http.Server
	http         HTTPConfig

	// Request and status labels come from a fixed set: a client that sends
	// random record types must not grow the registry (one series each).
	reqByType [256]prometheus.Counter
	reqOther  prometheus.Counter
	errByCode [32]prometheus.Counter
	errOther  prometheus.Counter
}

func newMetrics(s *Server) *metrics {
	m := &metrics{reg: prometheus.NewRegistry(), http: s.cfg.HTTP}
	f := func(c prometheus.Collector) { m.reg.MustRegister(c) }
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_requests_total", Help: "Ring records served, by type (unknown types as \"unknown\")."}, []string{"type"})
	m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_errors_total", Help: "Error replies, by status."}, []string{"status"})
	m.copyBytes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_copy_bytes_total", Help: "Bytes moved by the copy engine, by direction."}, []string{"direction"})
	m.copySeconds = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_copy_seconds_total", Help: "Time spent copying, by direction."}, []string{"direction"})
	// One observation a load or store: from its submission to the copy
	// engine (queueing behind other sessions' copies included) to the end
	// of its copy; 10 µs to 2.6 s in steps of 4x.
	m.copyLatency = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "ringside_copy_duration_seconds", Help: "Time from a load's or store's submission to the copy engine to the end of its copy (queueing included), by direction.",
		Buckets: prometheus.ExponentialBuckets(10e-6, 4, 10)}, []string{"direction"})
	m.ringWait = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_ring_wait_seconds_total", Help: "Time session loops spent waiting for submissions."})
	m.attaches = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_attaches_total", Help: "Sessions attached."})
	m.detaches = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_detaches_total", Help: "Sessions ended (clean or not)."})
	m.attachErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_attach_errors_total", Help: "Attach requests refused."})
	m.dropped = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_sessions_dropped_total", Help: "Sessions dropped because their completion ring stayed full (the client stopped reading)."})
	m.acceptErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_accept_errors_total", Help: "Failed accepts on the attach socket (EMFILE and the like); each is retried after a backoff of 5 ms to 1 s."})
	cudaFailed := gpuFailures{s: s, desc: prometheus.NewDesc("ringside_cuda_device_failed", "1 for a GPU whose CUDA context in the sidecar hit a sticky error, or whose copies outlived the watchdog's bound (every copy on it fails; the sidecar drains and exits to be restarted), 0 for the others the CUDA backend sees.", []string{"gpu"}, nil)}
	for _, c := range []prometheus.Collector{m.requests, m.errors, m.copyBytes, m.copySeconds, m.copyLatency, m.ringWait, m.attaches, m.detaches, m.attachErrors, m.dropped, m.acceptErrors, cudaFailed} {
		f(c)
	}
	for t := uint16(1); t < 256; t++ {
		if n := schema.TypeName(t); !strings.HasPrefix(n, "type(") {
			m.reqByType[t] = m.requests.WithLabelValues(n)
		}
	}
	m.reqOther = m.requests.WithLabelValues("unknown")
	for c := schema.Status(1); int(c) < len(m.errByCode); c++ {
		if n := c.String(); !strings.HasPrefix(n, "status(") {
			m.errByCode[c] = m.errors.WithLabelValues(n)
		}
	}
	m.errOther = m.errors.WithLabelValues("unknown")
	f(collectors.NewGoCollector())
	f(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	type view struct {
		st cache.Stats
		z  cache.SizingStats
		u  machine.Usage
		c  machine.Counters
	}
	read := func() view {
		s.mu.Lock()
		defer s.mu.Unlock()
		return view{st: s.m.Cache().Stats(), z: s.m.Cache().Sizing(), u: s.m.Usage(), c: s.m.Counters()}
	}
	gauge := func(name, help string, get func(v *view) float64) {
		f(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { v := read(); return get(&v) }))
	}
	counter := func(name, help string, get func(v *view) float64) {
		f(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { v := read(); return get(&v) }))
	}
	slot := float64(s.cfg.Machine.SlotBytes)
	gauge("ringside_pool_slots", "Pool capacity in slots.", func(v *view) float64 { return float64(v.st.Capacity) })
	gauge("ringside_pool_slots_free", "Free pool slots.", func(v *view) float64 { return float64(v.st.Free) })
	gauge("ringside_pool_bytes_used", "Bytes of pool slots in use.", func(v *view) float64 { return float64(v.st.Used) * slot })
	gauge("ringside_blocks", "Present blocks.", func(v *view) float64 { return float64(v.st.Blocks) })
	gauge("ringside_blocks_pinned", "Present blocks under a lease or a load.", func(v *view) float64 { return float64(v.st.PinnedBlocks) })
	gauge("ringside_blocks_doomed", "Blocks dropped while a store copy still ran, waiting for it to end.", func(v *view) float64 { return float64(v.st.DoomedBlocks) })
	gauge("ringside_blocks_retained", "Present blocks under a retention hint (Retain): evicted after every block without one.", func(v *view) float64 { return float64(v.st.RetainedBlocks) })
	gauge("ringside_leases", "Live leases.", func(v *view) float64 { return float64(v.st.Leases) })
	gauge("ringside_queries_waiting", "Queries admitted but waiting for load budget.", func(v *view) float64 { return float64(v.u.Waiting) })
	gauge("ringside_sessions", "Attached sessions.", func(v *view) float64 { return float64(v.u.Sessions) })
	gauge("ringside_namespaces", "Live namespaces.", func(v *view) float64 { return float64(v.u.Namespaces) })
	gauge("ringside_copies_in_flight", "Copies submitted and not yet ended.", func(v *view) float64 { return float64(v.u.Copies) })
	gauge("ringside_metadata_bytes", "Metadata held by clients (batches, queries, regions, copies, sessions, namespaces, change logs).", func(v *view) float64 { return float64(v.u.MetaBytes) })
	gauge("ringside_metadata_limit_bytes", "The bound on ringside_metadata_bytes (--limits.metadata-bytes).", func(v *view) float64 { return float64(v.u.MetaLimit) })
	gauge("ringside_ring_bytes", "Shared memory of the sessions' rings and reply queues.", func(v *view) float64 { return float64(v.u.RingBytes) })
	counter("ringside_lookups_total", "Lookup calls.", func(v *view) float64 { return float64(v.st.Lookups) })
	counter("ringside_lookup_blocks_total", "Blocks asked by lookups.", func(v *view) float64 { return float64(v.st.LookupBlocks) })
	counter("ringside_hit_blocks_total", "Leading blocks found by lookups.", func(v *view) float64 { return float64(v.st.HitBlocks) })
	counter("ringside_sizing_sampled_lookup_blocks_total", "Looked-up blocks in the sizing sample (a fixed hash sample of block keys).", func(v *view) float64 { return float64(v.z.SampledLookupBlocks) })
	counter("ringside_sizing_sampled_seen_blocks_total", "Of the sampled looked-up blocks, those stored at some time since the sidecar started: over ringside_sizing_sampled_lookup_blocks_total, the hit ratio of a pool of unbounded size.", func(v *view) float64 { return float64(v.z.SampledSeenBlocks) })
	gauge("ringside_sizing_distinct_blocks", "Distinct blocks stored since the sidecar started (estimated from the sizing sample): the blocks a pool that never evicted would hold.", func(v *view) float64 { return v.z.DistinctBlocks })
	counter("ringside_stores_total", "Blocks that became present.", func(v *view) float64 { return float64(v.st.Stores) })
	counter("ringside_evictions_total", "Blocks evicted for space.", func(v *view) float64 { return float64(v.st.Evictions) })
	counter("ringside_store_no_space_total", "Stores refused because nothing was evictable.", func(v *view) float64 { return float64(v.st.NoSpace) })
	counter("ringside_retains_total", "Retentions set or renewed by Retain, by block.", func(v *view) float64 { return float64(v.st.Retains) })
	counter("ringside_retains_ended_total", "Retentions ended by a session-end hint (Retain with END), by block.", func(v *view) float64 { return float64(v.st.RetainEnds) })
	counter("ringside_retains_expired_total", "Retentions that reached their deadline, by block.", func(v *view) float64 { return float64(v.st.ExpiredRetains) })
	counter("ringside_leases_expired_total", "Leases whose deadline passed (their queries resolved as misses).", func(v *view) float64 { return float64(v.c.ExpiredLeases) })
	counter("ringside_quota_refusals_total", "Requests refused, or leases shortened, by a quota (any limit).", func(v *view) float64 {
		n := uint64(0)
		for _, c := range v.c.QuotaRefusals {
			n += c
		}
		return float64(n)
	})
	counter("ringside_namespaces_reclaimed_total", "Idle namespaces dropped to make room for a new one.", func(v *view) float64 { return float64(v.c.NamespacesReclaimed) })
	counter("ringside_store_doomed_total", "Store copies that ended after their block's write deadline: discarded.", func(v *view) float64 { return float64(v.c.DoomedWrites) })
	counter("ringside_store_exited_total", "Stores discarded because their process exited during the copy.", func(v *view) float64 { return float64(v.c.DiscardedExitedStores) })
	gauge("ringside_copy_chunks_stalled", "Copy chunks running longer than --copy.stall.", func(*view) float64 {
		_, st, _ := s.sched.stats()
		return float64(st)
	})
	s.l2Metrics(f)
	gauge("ringside_copy_chunks_queued", "Copy chunks waiting for a worker.", func(*view) float64 {
		_, _, q := s.sched.stats()
		return float64(q)
	})
	return m
}

// request counts one request by type.
func (m *metrics) request(t uint16) {
	if int(t) < len(m.reqByType) && m.reqByType[t] != nil {
		m.reqByType[t].Inc()
		return
	}
	m.reqOther.Inc()
}

// status counts an error reply by the status at the start of its payload.
func (m *metrics) status(payload []byte) {
	st := schema.Status(binary.LittleEndian.Uint32(payload))
	if st == schema.OK {
		return
	}
	if int(st) < len(m.errByCode) && m.errByCode[st] != nil {
		m.errByCode[st].Inc()
		return
	}
	m.errOther.Inc()
}

func (m *metrics) copied(dir gpu.Direction, r gpu.Result) {
	d := "load"
	if dir == gpu.EngineToPool {
		d = "store"
	}
	m.copyBytes.WithLabelValues(d).Add(float64(r.Bytes))
	m.copySeconds.WithLabelValues(d).Add(r.Elapsed.Seconds())
	m.copyLatency.WithLabelValues(d).Observe((r.Queued + r.Elapsed).Seconds())
}

// State is what /debug/state and `ringside inspect sidecar` show.
type State struct {
	Epoch     string         `json:"epoch"`
	Dir       string         `json:"dir"`
	Socket    string         `json:"socket"`
	Ready     bool           `json:"ready"`
	SlotBytes uint64         `json:"slot_bytes"`
	Pool      cache.Stats    `json:"pool"`
	Usage     machine.Usage  `json:"usage"`
	Sessions  []SessionState `json:"sessions"`
	L2        *L2State       `json:"l2,omitempty"` // the shared tier, when on
}

// SessionState describes one session.
type SessionState struct {
	ID             uint64 `json:"id"`
	Instance       string `json:"instance"`
	Role           uint16 `json:"role"`
	Rank           int    `json:"rank"`
	PID            int    `json:"pid"`
	UID            uint32 `json:"uid"`
	SubmissionRing string `json:"submission_ring"`
	CompletionRing string `json:"completion_ring"`
	SubmissionUsed uint64 `json:"submission_used_bytes"`
	CompletionUsed uint64 `json:"completion_used_bytes"`
	RepliesQueued  int    `json:"replies_queued"`
	Regions        int    `json:"regions"`
	Leases         int    `json:"leases"`
	MetaBytes      int64  `json:"metadata_bytes"`
	PinnedSlots    int    `json:"pinned_slots"`
	RetainedSlots  int    `json:"retained_slots"`
}

// State returns a snapshot of the sidecar's live state.
func (s *Server) State() State {
	s.mu.Lock()
	st := State{Epoch: formatEpoch(s.epoch), Dir: s.cfg.Dir, Socket: s.cfg.Socket, Ready: s.ready.Load(), SlotBytes: s.cfg.Machine.SlotBytes,
		Pool: s.m.Cache().Stats(), Usage: s.m.Usage()}
	infos := s.m.Sessions()
	l2c := s.m.L2Counters()
	s.mu.Unlock()
	st.L2 = s.l2State(l2c, st.Pool.EvictedUnmarked)
	sort.Slice(infos, func(i, j int) bool { return infos[i].ID < infos[j].ID })
	for _, in := range infos {
		ss := s.session(in.ID)
		e := SessionState{ID: uint64(in.ID), Instance: in.Instance, Role: in.Role, Rank: in.Rank, PID: in.PID, UID: in.UID,
			Regions: in.Regions, Leases: in.Leases, MetaBytes: in.Meta, PinnedSlots: in.Pins,
			RetainedSlots: in.Retained}
		if ss != nil {
			ss.lifeMu.Lock()
			if !ss.unmapped {
				var t1, h1, t2, h2 uint64
				faultSafe(func() { // a truncated ring must not crash the endpoint
					t1, h1 = ss.sub.Positions()
					t2, h2 = ss.cmp.Positions()
				})
				e.SubmissionUsed, e.CompletionUsed = t1-h1, t2-h2
			}
			ss.lifeMu.Unlock()
			e.SubmissionRing, e.CompletionRing = ss.sub.Path(), ss.cmp.Path()
			e.RepliesQueued = ss.ob.pending()
		}
		st.Sessions = append(st.Sessions, e)
	}
	return st
}

func formatEpoch(e uint64) string {
	const hex = "0123456789abcdef"
	b := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		b[i] = hex[e&15]
		e >>= 4
	}
	return string(b)
}

// gpuFailures is ringside_cuda_device_failed, read at each scrape from the
// state /readyz and /healthz read (the failed GPUs): one state, so that a
// scrape never reads 0 for a GPU the probes already report failed.
type gpuFailures struct {
	s    *Server
	desc *prometheus.Desc
}

func (g gpuFailures) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

func (g gpuFailures) Collect(ch chan<- prometheus.Metric) {
	g.s.gpuMu.Lock()
	defer g.s.gpuMu.Unlock()
	for _, uuid := range g.s.gpus {
		v := 0.0
		if _, failed := g.s.gpuFailed[uuid]; failed {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, v, uuid)
	}
	for _, uuid := range g.s.failedGPUs() {
		if !slices.Contains(g.s.gpus, uuid) {
			ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, 1, uuid)
		}
	}
}

// serve runs the HTTP endpoint; the returned channel gets its exit error.
// /healthz answers 503 while healthy returns an error (a failed GPU: the
// sidecar is exiting, and a liveness probe restarts it if it does not).
func (m *metrics) serve(addr string, healthy func() error) chan error {
	errc := make(chan error, 1)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := healthy(); err != nil {
			http.Error(w, "unhealthy: "+err.Error()+"\n", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	var lim *connLimit
	m.srv, lim = newHTTPServer(mux, m.http)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		errc <- err
		return errc
	}
	go func() {
		if err := m.srv.Serve(lim.listen(ln)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	return errc
}

func (m *metrics) handle(pattern string, h http.HandlerFunc) {
	if mux, ok := m.srv.Handler.(*http.ServeMux); ok {
		mux.HandleFunc(pattern, h)
	}
}

func (m *metrics) close() {
	if m.srv != nil {
		m.srv.Close()
	}
}

func (s *Server) httpHandlers() {
	s.met.handle("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := s.deviceFailure(); err != nil {
			http.Error(w, "not ready: "+err.Error()+"\n", http.StatusServiceUnavailable)
			return
		}
		if !s.ready.Load() || s.draining.Load() {
			http.Error(w, "not ready\n", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ready\n"))
	})
	s.met.handle("/debug/state", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(s.State())
	})
}
