package sidecar

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// L2Config turns on the shared tier (sidecar/l2, docs/architecture.md,
// "The shared tier"): a Redis node or cluster every node's sidecar shares.
// Redis configures the client, Tier the Machine's side: when blocks are
// written, and the bounds of writes, lookups and fetches.
type L2Config struct {
	Redis l2.Config
	// Tier's Timeout and FetchTimeout left zero are the client's
	// LookupTimeout and IOTimeout plus a margin, so that the client's own
	// answer (with its counts) comes first and the Machine's deadlines are
	// a backstop. New sets Enabled.
	Tier machine.L2Config
}

// The margins of the Machine's deadlines over the client's.
const (
	l2LookupMargin = 50 * time.Millisecond
	l2FetchMargin  = 100 * time.Millisecond
)

// EnsureDefaults fills zero fields: the client's, then the Machine's.
func (c *L2Config) EnsureDefaults() {
	c.Redis.EnsureDefaults()
	if c.Tier.Timeout == 0 {
		c.Tier.Timeout = c.Redis.LookupTimeout + l2LookupMargin
	}
	if c.Tier.FetchTimeout == 0 {
		c.Tier.FetchTimeout = c.Redis.IOTimeout + l2FetchMargin
	}
	c.Tier.EnsureDefaults()
}

// validate returns every bad setting of the tier, each naming its flag.
func (c *L2Config) validate() []error {
	var errs []error
	if err := c.Redis.Validate(); err != nil {
		errs = append(errs, err)
	}
	return append(errs, flagErrors(c.Tier.Validate())...)
}

// applyL2 carries out the tier's part of an Output: every lookup, fetch
// and write goes to the client, and its end back to the Machine. None of
// them waits here.
func (s *Server) applyL2(out *machine.Output) {
	if s.tier == nil {
		return
	}
	for _, lk := range out.L2Lookups {
		id := lk.ID
		s.tier.Lookup(lk, func(found int) {
			s.machineCall(func(o *machine.Output) { s.m.L2LookupDone(monotonic(), id, found, o) })
		})
	}
	for _, f := range out.L2Fetches {
		id := f.ID
		s.tier.Fetch(f, func(res []machine.L2FetchResult) {
			s.machineCall(func(o *machine.Output) { s.m.L2FetchDone(monotonic(), id, res, o) })
		})
	}
	for _, w := range out.L2Writes {
		id := w.ID
		s.tier.Write(w, func(refused bool) {
			s.machineCall(func(o *machine.Output) { s.m.L2WriteDone(monotonic(), id, refused, o) })
		})
	}
}

// L2State is the tier in /debug/state and `ringside inspect sidecar`.
type L2State struct {
	Mode      string             `json:"mode"` // single or cluster; empty while not connected
	Connected bool               `json:"connected"`
	Addrs     []string           `json:"addrs"`
	TLS       bool               `json:"tls"`
	Prefix    string             `json:"prefix"`
	TTL       string             `json:"ttl"`
	Policy    string             `json:"policy"`
	Machine   machine.L2Counters `json:"machine"`
	// EvictedUnwritten counts blocks the pool evicted that the tier was
	// never given (write-on-evict behind, or writes skipped).
	EvictedUnwritten uint64      `json:"evicted_unwritten"`
	Client           l2.Snapshot `json:"client"`
}

func (s *Server) l2State(c machine.L2Counters, evictedUnmarked uint64) *L2State {
	if s.tier == nil {
		return nil
	}
	rc := s.tier.Config()
	return &L2State{Mode: s.tier.Mode(), Connected: s.tier.Connected(), Addrs: rc.Addrs, TLS: s.cfg.L2.Redis.TLS != nil || s.cfg.L2.Redis.TLSFiles != nil, Prefix: rc.Prefix, TTL: rc.TTL.String(),
		Policy: s.cfg.L2.Tier.Policy.String(), Machine: c, EvictedUnwritten: evictedUnmarked, Client: s.tier.Metrics().Snapshot()}
}

// l2Metrics registers the tier's series: the client's, and the Machine's
// decisions (read when scraped).
func (s *Server) l2Metrics(f func(prometheus.Collector)) {
	if s.tier == nil {
		return
	}
	for _, c := range s.tier.Metrics().Collectors() {
		f(c)
	}
	read := func() (machine.L2Counters, uint64) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.m.L2Counters(), s.m.Cache().Stats().EvictedUnmarked
	}
	counter := func(name, help string, get func(c machine.L2Counters, ev uint64) float64) {
		f(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { c, ev := read(); return get(c, ev) }))
	}
	gauge := func(name, help string, get func(c machine.L2Counters) float64) {
		f(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { c, _ := read(); return get(c) }))
	}
	counter("ringside_l2_writes_skipped_total", "Blocks not handed to the shared tier: the writes in flight pinned --l2.write-slots already.", func(c machine.L2Counters, _ uint64) float64 { return float64(c.WritesSkipped) })
	counter("ringside_l2_evicted_unwritten_total", "Blocks evicted from the pool that the shared tier was never given.", func(_ machine.L2Counters, ev uint64) float64 { return float64(ev) })
	counter("ringside_l2_lookup_timeouts_total", "Lookups answered without the shared tier: its deadline passed.", func(c machine.L2Counters, _ uint64) float64 { return float64(c.LookupTimeouts) })
	counter("ringside_l2_fetch_timeouts_total", "Acquires that stopped waiting for their fetch: its deadline passed.", func(c machine.L2Counters, _ uint64) float64 { return float64(c.FetchTimeouts) })
	counter("ringside_l2_fetched_blocks_total", "Blocks fetched from the shared tier and committed to the pool.", func(c machine.L2Counters, _ uint64) float64 { return float64(c.FetchedBlocks) })
	counter("ringside_l2_lookup_hit_blocks_total", "Blocks lookups found in the shared tier, past the pool's leading run.", func(c machine.L2Counters, _ uint64) float64 { return float64(c.LookupHitBlocks) })
	gauge("ringside_l2_writing_slots", "Pool slots pinned by writes to the shared tier (bounded by --l2.write-slots).", func(c machine.L2Counters) float64 { return float64(c.WritingSlots) })
	gauge("ringside_l2_pending", "Lookups and fetches of the shared tier in flight.", func(c machine.L2Counters) float64 { return float64(c.PendingLookups + c.PendingFetches) })
}
