package sidecar

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// L2Config turns on the shared tier (sidecar/l2, docs/architecture.md,
// "The shared tier"): a Redis node or cluster every node's sidecar shares.
type L2Config struct {
	Redis l2.Config
	// Policy: machine.WriteThrough (default) or machine.WriteOnEvict.
	Policy machine.L2Policy
	// WriteSlots bounds the pool slots that writes queued or running pin
	// (0: a sixteenth of the pool); EvictAhead is how many blocks at the
	// LRU's tail write-on-evict keeps written (0: WriteSlots).
	WriteSlots, EvictAhead int
	// MaxLookupBlocks and MaxFetchBlocks bound what one lookup asks and one
	// acquire fetches (0: 4096).
	MaxLookupBlocks, MaxFetchBlocks int
}

func (c *L2Config) validate() error {
	c.Redis.EnsureDefaults()
	if err := c.Redis.Validate(); err != nil {
		return err
	}
	if c.WriteSlots < 0 || c.EvictAhead < 0 || c.MaxLookupBlocks < 0 || c.MaxFetchBlocks < 0 {
		return fmt.Errorf("--l2.write-slots, --l2.evict-ahead, --l2.max-lookup-blocks, --l2.max-fetch-blocks must not be negative")
	}
	return nil
}

// machineL2 is the Machine's side of c. Its deadlines are the client's
// plus a margin, so that the client's own answer (with its counts) comes
// first and the Machine's are a backstop.
func (c *L2Config) machineL2() machine.L2Config {
	return machine.L2Config{Enabled: true, Policy: c.Policy,
		Timeout: c.Redis.LookupTimeout + 50*time.Millisecond, FetchTimeout: c.Redis.IOTimeout + 100*time.Millisecond,
		WriteSlots: c.WriteSlots, EvictAhead: c.EvictAhead, MaxLookupBlocks: c.MaxLookupBlocks, MaxFetchBlocks: c.MaxFetchBlocks}
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
		Policy: s.cfg.L2.Policy.String(), Machine: c, EvictedUnwritten: evictedUnmarked, Client: s.tier.Metrics().Snapshot()}
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
