package sidecar

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// L2Config turns on the tiers beneath the pool: the node tier (Node, a
// `ringside node` process every sidecar of the node shares: sidecar/node,
// docs/architecture.md, "The node tier") and the shared tier (Redis, a
// Redis node or cluster every node's sidecar shares: sidecar/l2, "The
// shared tier"), either or both; the order is pod pool, node tier, Redis.
// Tier configures the Machine's side of them together: when blocks are
// written, and the bounds of writes, lookups and fetches.
type L2Config struct {
	// Redis is the shared tier's client; off when it names no address
	// and Node is set.
	Redis l2.Config
	// Node is the node tier's client; nil: off.
	Node *node.ClientConfig
	// Tier's Timeout and FetchTimeout left zero are the clients' lookup
	// and I/O deadlines (the node tier's plus Redis's, as a lookup or a
	// fetch asks one after the other) plus a margin, so that the clients'
	// own answers (with their counts) come first and the Machine's
	// deadlines are a backstop. New sets Enabled.
	Tier machine.L2Config
}

// RedisOn reports whether the Redis tier is on.
func (c *L2Config) RedisOn() bool { return len(c.Redis.Addrs) > 0 || c.Node == nil }

// The margins of the Machine's deadlines over the clients'.
const (
	l2LookupMargin = 50 * time.Millisecond
	l2FetchMargin  = 100 * time.Millisecond
)

// EnsureDefaults fills zero fields: the clients', then the Machine's.
func (c *L2Config) EnsureDefaults() {
	var lookup, io time.Duration
	if c.RedisOn() {
		c.Redis.EnsureDefaults()
		lookup, io = c.Redis.LookupTimeout, c.Redis.IOTimeout
	}
	if c.Node != nil {
		c.Node.EnsureDefaults()
		lookup, io = lookup+c.Node.LookupTimeout, io+c.Node.IOTimeout
	}
	if c.Tier.Timeout == 0 {
		c.Tier.Timeout = lookup + l2LookupMargin
	}
	if c.Tier.FetchTimeout == 0 {
		c.Tier.FetchTimeout = io + l2FetchMargin
	}
	c.Tier.EnsureDefaults()
}

// validate returns every bad setting of the tiers, each naming its flag.
func (c *L2Config) validate() []error {
	var errs []error
	if c.RedisOn() {
		if err := c.Redis.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if c.Node != nil {
		if err := c.Node.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	return append(errs, flagErrors(c.Tier.Validate())...)
}

// applyL2 carries out the tiers' part of an Output: every lookup, fetch
// and write goes to the clients, and its end back to the Machine. None of
// them waits here.
func (s *Server) applyL2(out *machine.Output) {
	if s.tier == nil && s.node == nil {
		return
	}
	for _, lk := range out.L2Lookups {
		id := lk.ID
		s.tierLookup(lk, func(found int) {
			s.machineCall(func(o *machine.Output) { s.m.L2LookupDone(monotonic(), id, found, o) })
		})
	}
	for _, f := range out.L2Fetches {
		id := f.ID
		s.tierFetch(f, func(res []machine.L2FetchResult) {
			s.machineCall(func(o *machine.Output) { s.m.L2FetchDone(monotonic(), id, res, o) })
		})
	}
	for _, w := range out.L2Writes {
		id := w.ID
		s.tierWrite(w, func(refused bool) {
			s.machineCall(func(o *machine.Output) { s.m.L2WriteDone(monotonic(), id, refused, o) })
		})
	}
}

// tierLookup asks the node tier, then Redis about the blocks after the
// node tier's leading run.
func (s *Server) tierLookup(lk machine.L2Lookup, done func(int)) {
	if s.node == nil {
		s.tier.Lookup(lk, done)
		return
	}
	s.node.Lookup(lk, func(found int) {
		w := lk.NS.Width
		if s.tier == nil || w == 0 || found >= len(lk.Digests)/w {
			done(found)
			return
		}
		rest := lk
		rest.Digests = lk.Digests[found*w:]
		s.tier.Lookup(rest, func(more int) { done(found + more) })
	})
}

// tierFetch fetches from the node tier, then the blocks it did not give
// from Redis. done comes after both have stopped touching the pool.
func (s *Server) tierFetch(f machine.L2Fetch, done func([]machine.L2FetchResult)) {
	if s.node == nil {
		s.tier.Fetch(f, done)
		return
	}
	s.node.Fetch(f, func(res []machine.L2FetchResult) {
		if s.tier == nil {
			done(res)
			return
		}
		var idx []int
		rest := f
		rest.Blocks = nil
		for i, r := range res {
			if !r.OK {
				idx = append(idx, i)
				rest.Blocks = append(rest.Blocks, f.Blocks[i])
			}
		}
		if len(idx) == 0 {
			done(res)
			return
		}
		s.tier.Fetch(rest, func(more []machine.L2FetchResult) {
			for k, i := range idx {
				if k < len(more) {
					res[i] = more[k]
					if more[k].OK {
						// Into the node tier too, while the slots are
						// still this fetch's: the node's other pods
						// then find it there.
						b := f.Blocks[i]
						s.node.Promote(machine.L2Write{NS: f.NS, Digest: b.Digest, Length: more[k].Length, PoolOffsets: b.PoolOffsets})
					}
				}
			}
			done(res)
		})
	})
}

// tierWrite writes to every tier on; copied comes once every one has read
// the pool, refused when none took the write.
func (s *Server) tierWrite(w machine.L2Write, copied func(refused bool)) {
	switch {
	case s.node == nil:
		s.tier.Write(w, copied)
		return
	case s.tier == nil:
		s.node.Write(w, copied)
		return
	}
	var left atomic.Int32
	var taken atomic.Bool
	left.Store(2)
	each := func(refused bool) {
		if !refused {
			taken.Store(true)
		}
		if left.Add(-1) == 0 {
			copied(!taken.Load())
		}
	}
	s.node.Write(w, each)
	s.tier.Write(w, each)
}

// L2State is the tiers in /debug/state and `ringside inspect sidecar`.
type L2State struct {
	Mode      string             `json:"mode"` // single or cluster; empty while not connected (or without Redis)
	Connected bool               `json:"connected"`
	Addrs     []string           `json:"addrs"`
	TLS       bool               `json:"tls"`
	Prefix    string             `json:"prefix"`
	TTL       string             `json:"ttl"`
	Policy    string             `json:"policy"`
	Machine   machine.L2Counters `json:"machine"`
	// EvictedUnwritten counts blocks the pool evicted that the tier was
	// never given (write-on-evict behind, or writes skipped).
	EvictedUnwritten uint64       `json:"evicted_unwritten"`
	Client           *l2.Snapshot `json:"client,omitempty"` // Redis's
	Node             *NodeState   `json:"node,omitempty"`
}

// NodeState is the node tier's client in /debug/state.
type NodeState struct {
	Socket    string `json:"socket"`
	Pod       string `json:"pod"`
	Connected bool   `json:"connected"`
	// LastError is why the latest attach failed ("" once attached).
	LastError string            `json:"last_error,omitempty"`
	Epoch     uint64            `json:"epoch"`
	Counts    map[string]uint64 `json:"counts"`
}

func nodeCounts(st *node.ClientStats, ev *nodeEventStats) map[string]uint64 {
	return map[string]uint64{
		"events_stored": ev.Stored.Load(), "events_removed": ev.Removed.Load(), "events_dropped": ev.Dropped.Load(),
		"events_rebuilds": ev.Rebuilds.Load(), "events_read_failures": ev.ReadFailures.Load(),
		"described": ev.Described.Load(), "describe_dropped": ev.DescribeDropped.Load(),
		"attaches": st.Attaches.Load(), "lookups": st.Lookups.Load(), "lookup_blocks": st.LookupBlocks.Load(),
		"lookup_hit_blocks": st.LookupHits.Load(), "lookups_unanswered": st.LookupMiss.Load(),
		"fetch_blocks": st.FetchBlocks.Load(), "fetched_blocks": st.FetchOK.Load(), "fetch_missed_blocks": st.FetchMiss.Load(),
		"fetch_rejected_values": st.FetchRejected.Load(), "fetch_unready": st.FetchUnready.Load(), "writes": st.Writes.Load(), "writes_stored": st.WritesOK.Load(),
		"writes_held_already": st.WritesExist.Load(), "writes_refused": st.WritesRefused.Load(), "writes_failed": st.WritesFailed.Load(),
		"promotions": st.Promotions.Load(),
		"timeouts":   st.Timeouts.Load(),
	}
}

func (s *Server) l2State(c machine.L2Counters, evictedUnmarked uint64) *L2State {
	if s.tier == nil && s.node == nil {
		return nil
	}
	st := &L2State{Policy: s.cfg.L2.Tier.Policy.String(), Machine: c, EvictedUnwritten: evictedUnmarked}
	if s.tier != nil {
		rc := s.tier.Config()
		snap := s.tier.Metrics().Snapshot()
		st.Mode, st.Connected, st.Addrs, st.Prefix, st.TTL, st.Client = s.tier.Mode(), s.tier.Connected(), rc.Addrs, rc.Prefix, rc.TTL.String(), &snap
		st.TLS = s.cfg.L2.Redis.TLS != nil || s.cfg.L2.Redis.TLSFiles != nil
	}
	if s.node != nil {
		nc := s.node.Config()
		st.Node = &NodeState{Socket: nc.Socket, Pod: nc.Pod, Connected: s.node.Connected(), LastError: s.node.LastError(), Epoch: s.node.Epoch(), Counts: nodeCounts(s.node.Stats(), &s.nodeEv.met)}
	}
	return st
}

// l2Metrics registers the tiers' series: the clients', and the Machine's
// decisions (read when scraped).
func (s *Server) l2Metrics(f func(prometheus.Collector)) {
	if s.tier == nil && s.node == nil {
		return
	}
	if s.tier != nil {
		for _, c := range s.tier.Metrics().Collectors() {
			f(c)
		}
	}
	if s.node != nil {
		s.nodeMetrics(f)
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

// nodeMetrics registers the node tier client's series.
func (s *Server) nodeMetrics(f func(prometheus.Collector)) {
	st := s.node.Stats()
	counter := func(name, help string, v *atomic.Uint64) {
		f(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(v.Load()) }))
	}
	counter("ringside_node_attaches_total", "Attaches to the node tier (a new one after each end of its connection).", &st.Attaches)
	counter("ringside_node_lookups_total", "Lookups asked of the node tier.", &st.Lookups)
	counter("ringside_node_lookup_hit_blocks_total", "Leading blocks the node tier held, of those lookups asked about.", &st.LookupHits)
	counter("ringside_node_fetched_blocks_total", "Blocks fetched from the node tier, checked and copied into the pool.", &st.FetchOK)
	counter("ringside_node_fetch_missed_blocks_total", "Blocks of fetches the node tier did not give (absent, rejected, too late, not attached).", &st.FetchMiss)
	counter("ringside_node_rejected_values_total", "Values from the node tier whose header or CRC32C did not match: never served.", &st.FetchRejected)
	counter("ringside_node_fetch_unready_total", "Fetches not asked of the node tier: the pool's pages they land in could not be allocated.", &st.FetchUnready)
	counter("ringside_node_writes_stored_total", "Blocks the node tier took.", &st.WritesOK)
	counter("ringside_node_writes_refused_total", "Writes not handed to the node tier: its queue full, no window slot free, or not attached.", &st.WritesRefused)
	counter("ringside_node_writes_failed_total", "Writes the node tier refused or did not answer in time.", &st.WritesFailed)
	counter("ringside_node_timeouts_total", "Requests to the node tier not answered within their deadline.", &st.Timeouts)
	ev := &s.nodeEv.met
	counter("ringside_node_event_stored_total", "Blocks of the node tier added to the set this sidecar announces (from the node's event logs of its namespaces).", &ev.Stored)
	counter("ringside_node_event_removed_total", "Blocks that left the node tier's set this sidecar announces (removed entries, and blocks a rebuild did not find again).", &ev.Removed)
	counter("ringside_node_event_dropped_total", "Node-tier blocks not announced: the node sets' bound (64 MiB of descriptions) was reached, or an entry failed its checks.", &ev.Dropped)
	counter("ringside_node_event_rebuilds_total", "Rebuilds of a namespace's node-tier set from the beginning of its log (a new node process, or a cursor the log no longer holds).", &ev.Rebuilds)
	counter("ringside_node_event_read_failures_total", "Reads of the node tier's event logs that failed or were not answered within --node.io-timeout.", &ev.ReadFailures)
	counter("ringside_node_described_total", "Descriptions of this pool's blocks the node tier took.", &ev.Described)
	counter("ringside_node_describe_dropped_total", "Blocks written to the node tier not described to it: the queue of blocks to describe (4,096) was full.", &ev.DescribeDropped)
	f(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ringside_node_event_blocks", Help: "Blocks of the node tier this sidecar announces (its node sets; some may be in its pool too)."}, func() float64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		n, _ := s.m.Cache().NodeBlocks()
		return float64(n)
	}))
	f(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ringside_node_connected", Help: "1 while attached to the node tier."}, func() float64 {
		if s.node.Connected() {
			return 1
		}
		return 0
	}))
}
