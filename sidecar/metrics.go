package sidecar

import (
	"encoding/json"
	"errors"
	"net"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// metrics are the sidecar's Prometheus series. Pool and cache figures are
// read from the cache when scraped; request counters are kept as they
// happen.
type metrics struct {
	reg          *prometheus.Registry
	requests     *prometheus.CounterVec
	errors       *prometheus.CounterVec
	copyBytes    *prometheus.CounterVec
	copySeconds  *prometheus.CounterVec
	ringWait     prometheus.Counter
	attaches     prometheus.Counter
	detaches     prometheus.Counter
	attachErrors prometheus.Counter
	expired      prometheus.Counter
	acceptErrors prometheus.Counter
	srv          *http.Server
	http         HTTPConfig
}

func newMetrics(s *Server) *metrics {
	m := &metrics{reg: prometheus.NewRegistry(), http: s.cfg.HTTP}
	f := func(c prometheus.Collector) { m.reg.MustRegister(c) }
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_requests_total", Help: "Ring records served, by type."}, []string{"type"})
	m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_errors_total", Help: "Error replies, by status."}, []string{"status"})
	m.copyBytes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_copy_bytes_total", Help: "Bytes moved by the copy engine, by direction."}, []string{"direction"})
	m.copySeconds = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringside_copy_seconds_total", Help: "Time spent copying, by direction."}, []string{"direction"})
	m.ringWait = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_ring_wait_seconds_total", Help: "Time session loops spent waiting for submissions."})
	m.attaches = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_attaches_total", Help: "Sessions attached."})
	m.detaches = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_detaches_total", Help: "Sessions ended (clean or not)."})
	m.attachErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_attach_errors_total", Help: "Attach requests refused."})
	m.expired = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_leases_expired_total", Help: "Leases whose deadline passed (their queries resolved as misses)."})
	m.acceptErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "ringside_accept_errors_total", Help: "Failed accepts on the attach socket (EMFILE and the like); each is retried after a backoff of 5 ms to 1 s."})
	for _, c := range []prometheus.Collector{m.requests, m.errors, m.copyBytes, m.copySeconds, m.ringWait, m.attaches, m.detaches, m.attachErrors, m.expired, m.acceptErrors} {
		f(c)
	}
	f(collectors.NewGoCollector())
	f(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	stat := func(get func(st *cache.Stats, s *Server) float64) func() float64 {
		return func() float64 {
			s.mu.Lock()
			st := s.cache.Stats()
			v := get(&st, s)
			s.mu.Unlock()
			return v
		}
	}
	gauge := func(name, help string, get func(st *cache.Stats, s *Server) float64) {
		f(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, stat(get)))
	}
	counter := func(name, help string, get func(st *cache.Stats, s *Server) float64) {
		f(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, stat(get)))
	}
	slot := float64(s.cfg.SlotBytes)
	gauge("ringside_pool_slots", "Pool capacity in slots.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Capacity) })
	gauge("ringside_pool_slots_free", "Free pool slots.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Free) })
	gauge("ringside_pool_bytes_used", "Bytes of pool slots in use.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Used) * slot })
	gauge("ringside_blocks", "Present blocks.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Blocks) })
	gauge("ringside_blocks_pinned", "Present blocks under a lease.", func(st *cache.Stats, _ *Server) float64 { return float64(st.PinnedBlocks) })
	gauge("ringside_leases", "Live leases.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Leases) })
	gauge("ringside_queries_waiting", "Queries admitted but waiting for load budget.", func(_ *cache.Stats, s *Server) float64 {
		n := 0
		for _, in := range s.instances {
			n += len(in.waiting)
		}
		return float64(n)
	})
	gauge("ringside_sessions", "Attached sessions.", func(_ *cache.Stats, s *Server) float64 { return float64(len(s.sessions)) })
	counter("ringside_lookups_total", "Lookup calls.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Lookups) })
	counter("ringside_lookup_blocks_total", "Blocks asked by lookups.", func(st *cache.Stats, _ *Server) float64 { return float64(st.LookupBlocks) })
	counter("ringside_hit_blocks_total", "Leading blocks found by lookups.", func(st *cache.Stats, _ *Server) float64 { return float64(st.HitBlocks) })
	counter("ringside_stores_total", "Blocks that became present.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Stores) })
	counter("ringside_evictions_total", "Blocks evicted for space.", func(st *cache.Stats, _ *Server) float64 { return float64(st.Evictions) })
	counter("ringside_store_no_space_total", "Stores refused because nothing was evictable.", func(st *cache.Stats, _ *Server) float64 { return float64(st.NoSpace) })
	return m
}

func (m *metrics) copied(dir gpu.Direction, r gpu.Result) {
	d := "load"
	if dir == gpu.EngineToPool {
		d = "store"
	}
	m.copyBytes.WithLabelValues(d).Add(float64(r.Bytes))
	m.copySeconds.WithLabelValues(d).Add(r.Elapsed.Seconds())
}

// State is what /debug/state and `ringside inspect sidecar` show.
type State struct {
	Epoch     string         `json:"epoch"`
	Dir       string         `json:"dir"`
	Socket    string         `json:"socket"`
	Ready     bool           `json:"ready"`
	SlotBytes uint64         `json:"slot_bytes"`
	Pool      cache.Stats    `json:"pool"`
	Sessions  []SessionState `json:"sessions"`
}

// SessionState describes one session.
type SessionState struct {
	ID             uint64 `json:"id"`
	Instance       string `json:"instance"`
	Role           uint16 `json:"role"`
	Rank           int    `json:"rank"`
	PID            int    `json:"pid"`
	SubmissionRing string `json:"submission_ring"`
	CompletionRing string `json:"completion_ring"`
	SubmissionUsed uint64 `json:"submission_used_bytes"`
	CompletionUsed uint64 `json:"completion_used_bytes"`
	Regions        int    `json:"regions"`
}

// State returns a snapshot of the sidecar's live state.
func (s *Server) State() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := State{Epoch: formatEpoch(s.epoch), Dir: s.cfg.Dir, Socket: s.cfg.Socket, Ready: s.ready.Load(), SlotBytes: s.cfg.SlotBytes, Pool: s.cache.Stats()}
	for _, ss := range s.sessions {
		var t1, h1, t2, h2 uint64
		faultSafe(func() { // a truncated ring must not crash the endpoint
			t1, h1 = ss.sub.Positions()
			t2, h2 = ss.cmp.Positions()
		})
		name := ss.inst.name
		for i := range name {
			if name[i] == 0 {
				name = name[:i]
				break
			}
		}
		st.Sessions = append(st.Sessions, SessionState{
			ID: ss.id, Instance: name, Role: ss.role, Rank: ss.rank, PID: ss.cred.PID,
			SubmissionRing: ss.sub.Path(), CompletionRing: ss.cmp.Path(),
			SubmissionUsed: t1 - h1, CompletionUsed: t2 - h2, Regions: len(ss.regions),
		})
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

// serve runs the HTTP endpoint; the returned channel gets its exit error.
func (m *metrics) serve(addr string) chan error {
	errc := make(chan error, 1)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
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
