// Package replay is `ringside-bench replay`: real traces (the Mooncake
// conversation trace's JSON Lines format) replayed through a live sidecar
// process from simulated engine instances, over the real rings, with the
// page bytes really copied; one sidecar per pool capacity of a sweep, each
// compared with an exact offline LRU simulation of the same trace and
// capacity (Oracle), plus a Unix-socket baseline of the same replay and a
// walk-the-cache baseline of the per-step metadata against the change
// log. Reports: a table, JSON Lines, CSV, HDR latency percentiles and PNG
// plots.
package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/bench/internal/uds"
	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// Defaults.
const (
	DefaultPageTokens      = 16
	DefaultKVBytesPerToken = 128 << 10 // Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
	DefaultPageBytes       = 4 << 10   // what a page really copies by default on a small machine
	DefaultEngines         = 2
	model                  = "replay-model"
)

// DefaultNodeTierPodFractions are the pods' pools of a --node-tier run,
// as fractions of an even split of the capacity: a quarter (each pod
// keeps its hot prefixes and the largest request's pages; the node tier
// holds three quarters of the bytes) and a sixteenth (pools near the
// smallest that still stage a request's pages).
var DefaultNodeTierPodFractions = []float64{0.25, 0.0625}

// DefaultCapacityGiB are the pool sizes of a default sweep, in GiB of
// model KV (at KVBytesPerToken x PageTokens per page).
var DefaultCapacityGiB = []int{1, 4, 16, 64}

// Config configures a run. Zero fields take defaults.
type Config struct {
	Traces          []string
	Workload        string        // "trace" (default: the Traces), "agentic" (generated, AgenticConfig) or "agentic-scan" (ScanHeavy)
	Seed            uint64        // the generated workload's seed (default 1)
	PageTokens      int           // tokens per engine page (default 16)
	BlockTokens     int           // tokens per trace block (default 512)
	CapacityPages   []int         // pool capacities, in pages (default: DefaultCapacityGiB of model KV)
	Engines         int           // simulated engine instances (default 2)
	Sequential      bool          // one request at a time, in trace order: deterministic hit rates
	Pace            float64       // 0: as fast as possible; F: at the trace's timestamps divided by F (1 = real time)
	PrefillTPS      float64       // modelled prefill, tokens per second (0: none)
	PageBytes       int           // bytes a page really copies (and pool slot bytes); 0: auto
	KVBytesPerToken int           // model KV bytes per token, for the GiB equivalents (default 128 KiB)
	Limit           int           // replay the first Limit requests (0: all)
	NoUDS           bool          // skip the Unix-socket baseline
	UDSCapacity     int           // capacity of the socket run (default: the smallest of the sweep)
	NoWalk          bool          // skip the walk baseline
	Dir             string        // base directory of the sidecars (default /dev/shm/ringside-replay-<pid>)
	OutDir          string        // report directory (default ./ringside-replay); "-" writes no files
	Exe             string        // the bench executable, re-run as the relays (`replay-relay`; default os.Executable())
	Ringside        string        // the ringside executable run as the sidecars (`serve`; default: see harness.FindRingside)
	Timeout         time.Duration // bound on startup, every call and every child (default 1m)
	// Policy is the sidecars' eviction policy (serve --cache.policy): "lru",
	// "mqp" or "mqp2"; empty is serve's default (cache.DefaultPolicy). The
	// runs are checked against the offline model of it: OraclePages for
	// LRU, MQPPages for MQP, MQP2Pages for MQP2. Several nodes or the shared
	// tier are modelled with LRU pools only; --node-tier's pods with any
	// of the three (OracleNodeTier).
	Policy string
	// Offline runs no sidecar: the offline policies alone, at the sweep's
	// capacities (the policy rows, without live columns). Bounded by CPU
	// and memory, not by /dev/shm: what a sweep at engine page sizes and
	// large pools needs.
	Offline bool
	// Informed adds, at the sweep's capacities, LRUs told which pages come
	// back (InformedPages at InformedHorizons): what an online policy
	// lacks, beside the optimum.
	Informed bool
	// Hints adds, at every capacity, a run that sends each request's
	// retention hint (RequestMeta, hintOf) to the sidecar: transport
	// "ring+hints", beside the plain "ring" run. No model covers hints:
	// these runs are not checked exactly.
	Hints bool
	// Nodes is the number of sidecars (separate pools) the engines are
	// spread over: engine e attaches to node e mod Nodes (default 1).
	Nodes int
	// L2Addrs is a Redis node or cluster the nodes share as their tier;
	// L2Start starts one instead ("single" or "cluster": real redis-server
	// processes, internal/redistest). With a tier, every capacity runs
	// twice: without it ("ring") and with it ("ring+l2").
	L2Addrs []string
	L2Start string
	// NodeTier runs each capacity as the total bytes of one node's pods:
	// every engine its own pod (a sidecar, Nodes = Engines), first with
	// pools of capacity/Engines each and nothing beneath ("ring"), then,
	// for each of NodeTierPodFractions, with pools of that fraction of
	// capacity/Engines over one real `ringside node` process holding the
	// rest of the capacity ("ring+node"): the same bytes, split otherwise.
	NodeTier bool
	// NodeTierPodFractions are the pods' pools of the ring+node runs, as
	// fractions of capacity/Engines (default DefaultNodeTierPodFractions);
	// each pool at least 16 slots.
	NodeTierPodFractions []float64
	JSON                 bool
	Quiet                bool
	Progress             bool // draw a progress bar on Log (the CLI sets it when Log is a terminal)
	Out, Log             io.Writer
}

func (c *Config) modelPageBytes() int64 { return int64(c.KVBytesPerToken) * int64(c.PageTokens) }

func (c *Config) defaults() error {
	if c.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		c.Exe = exe
	}
	if !c.Offline {
		ringside, err := harness.FindRingside(c.Ringside, c.Exe)
		if err != nil {
			return err
		}
		c.Ringside = ringside
	}
	if c.PageTokens <= 0 {
		c.PageTokens = DefaultPageTokens
	}
	if c.BlockTokens <= 0 {
		c.BlockTokens = 512
	}
	switch c.Workload {
	case "", "trace":
		c.Workload = "trace"
	case "agentic", "agentic-scan":
		if len(c.Traces) > 0 {
			return fmt.Errorf("--workload %s generates its requests: give no --trace", c.Workload)
		}
	default:
		return fmt.Errorf("--workload %q: want trace, agentic or agentic-scan", c.Workload)
	}
	if c.KVBytesPerToken <= 0 {
		c.KVBytesPerToken = DefaultKVBytesPerToken
	}
	if c.PageBytes == 0 {
		c.PageBytes = int(min(int64(DefaultPageBytes), c.modelPageBytes()))
		c.PageBytes = max(c.PageBytes, 4096)
	}
	if c.PageBytes < 4096 || c.PageBytes%64 != 0 {
		return fmt.Errorf("--page-bytes %d: want a multiple of 64, at least 4096 (the sidecar's smallest slot)", c.PageBytes)
	}
	if len(c.CapacityPages) == 0 {
		for _, g := range DefaultCapacityGiB {
			c.CapacityPages = append(c.CapacityPages, int(max(16, (int64(g)<<30)/c.modelPageBytes())))
		}
	}
	for _, p := range c.CapacityPages {
		if p < 16 {
			return fmt.Errorf("--capacity-pages %d: the sidecar needs at least 16 slots", p)
		}
	}
	c.CapacityPages = slices.Compact(slices.Sorted(slices.Values(c.CapacityPages)))
	if c.UDSCapacity == 0 {
		c.UDSCapacity = c.CapacityPages[0] // the quickest run of the sweep
	}
	if c.Engines <= 0 {
		c.Engines = DefaultEngines
	}
	if c.Engines > 64 {
		return fmt.Errorf("--engines %d: at most 64", c.Engines)
	}
	if c.Nodes <= 0 {
		c.Nodes = 1
	}
	if c.Nodes > c.Engines {
		return fmt.Errorf("--nodes %d: more nodes than --engines %d (each node serves at least one engine)", c.Nodes, c.Engines)
	}
	switch c.L2Start {
	case "", "single", "cluster":
	default:
		return fmt.Errorf("--l2.start %q: want single or cluster", c.L2Start)
	}
	if c.L2Start != "" && len(c.L2Addrs) > 0 {
		return errors.New("--l2.start and --l2.redis.addrs: give one")
	}
	if c.Policy == "" {
		c.Policy = cache.DefaultPolicy.String()
	}
	if c.NodeTier {
		if c.Nodes > 1 && c.Nodes != c.Engines {
			return fmt.Errorf("--node-tier: every engine is a pod of its own (--nodes %d, --engines %d: give --nodes %d or leave it out)", c.Nodes, c.Engines, c.Engines)
		}
		if len(c.L2Addrs) > 0 || c.L2Start != "" || c.Hints || c.Offline {
			return errors.New("--node-tier: not with --l2.*, --hints or --offline")
		}
		c.Nodes = c.Engines
		if len(c.NodeTierPodFractions) == 0 {
			c.NodeTierPodFractions = DefaultNodeTierPodFractions
		}
		for _, f := range c.NodeTierPodFractions {
			if !(f > 0 && f < 1) {
				return fmt.Errorf("--node-tier.pod-fraction %g: want a fraction between 0 and 1", f)
			}
		}
		for _, p := range c.CapacityPages {
			if p/c.Engines < 16 {
				return fmt.Errorf("--capacity-pages %d: %d pods' pools of %d pages; the sidecar needs at least 16 slots", p, c.Engines, p/c.Engines)
			}
			for _, f := range c.NodeTierPodFractions {
				if _, n := c.split(p, f); n < 16 {
					return fmt.Errorf("--capacity-pages %d, --node-tier.pod-fraction %g: the node tier gets %d pages, under 16", p, f, n)
				}
			}
		}
	} else if len(c.NodeTierPodFractions) > 0 {
		return errors.New("--node-tier.pod-fraction: only with --node-tier")
	}
	switch c.Policy {
	case "lru":
	case "mqp", "mqp2":
		// --node-tier's model takes the pods' policy (OracleNodeTier).
		if (c.Nodes > 1 && !c.NodeTier) || len(c.L2Addrs) > 0 || c.L2Start != "" {
			return fmt.Errorf("--cache.policy %s: its offline model is of one node without a tier, or of --node-tier's pods; the model of several nodes and the shared tier is of LRU pools (give --cache.policy lru, or --nodes 1 and no --l2.*)", c.Policy)
		}
	default:
		return fmt.Errorf("--cache.policy %q: want lru, mqp or mqp2", c.Policy)
	}
	if c.Offline && (c.Hints || c.Nodes > 1 || len(c.L2Addrs) > 0 || c.L2Start != "") {
		return errors.New("--offline runs no sidecar: not with --hints, --nodes or --l2.*")
	}
	if c.Hints && (len(c.L2Addrs) > 0 || c.L2Start != "") {
		return errors.New("--hints: not with the tier (give one of --hints, --l2.*)")
	}
	if c.Pace < 0 || c.PrefillTPS < 0 {
		return errors.New("--pace and --prefill-tps must not be negative")
	}
	if c.Timeout <= 0 {
		c.Timeout = time.Minute
	}
	if c.Dir == "" {
		base := "/dev/shm"
		if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
			base = os.TempDir()
		}
		c.Dir = filepath.Join(base, fmt.Sprintf("ringside-replay-%d", os.Getpid()))
	}
	if c.OutDir == "" {
		c.OutDir = "ringside-replay"
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return nil
}

// Report is everything a run measured.
type Report struct {
	Config   Config
	Workload *Workload
	Runs     []*RunResult
	Unbound  float64 // hit ratio of a cache that never evicts
	// OracleCurve is the offline LRU at the sweep's capacities and at
	// doublings of the largest up to the trace's distinct pages (cheap:
	// no sidecar), for the hit-rate plot.
	OracleCurve []OracleResult
	// PolicyCurve is vLLM's ARC, the optimum (MIN), MQP and MQP2 at the
	// same capacities, beside the LRU (policies.go, mqp.go, mqp2.go).
	PolicyCurve []PolicyPoint
	Rows        []any // the JSON Lines rows, in order
	Verdicts    []string
	Files       []string // written under OutDir
}

// RunResult is one sidecar process: one capacity, one transport.
type RunResult struct {
	CapacityPages int
	Transport     string // "ring" or "uds"
	Counts        runCounts
	// Oracle is the exact offline model of the sidecar's policy (the LRU,
	// or MQP: mqpModel) at this capacity; LRU is the offline LRU's.
	Oracle, LRU OracleResult
	Hists       hists
	Steps       []stepSample
	Wall        time.Duration // the replay, from the first request to the last
	Sidecar     harness.Usage
	ViewBlocks  int // engine 0's view of the cache after the run
	Resyncs     int
	// Fleet is the model of several nodes and the tier (nil: one node, no
	// tier: Oracle alone); FetchedPages what the nodes fetched from the
	// tier (their /debug/state).
	Fleet        *FleetResult
	FetchedPages int64
	// PodPages is each node's (pod's) pool, NodeTierPages the node tier's
	// (--node-tier: ring+node; 0 otherwise), PodFraction the split's;
	// NodeTier the node process's counts at the end, NodeTierUsage its
	// CPU and memory.
	PodPages, NodeTierPages int
	PodFraction             float64
	NodeTier                *NodeTierStats
	NodeTierUsage           *harness.Usage
	// ARC and MIN are the reference policy and the optimum at this
	// capacity, offline (policies.go); MQP and MQP2 (mqp.go, mqp2.go).
	ARC, MIN, MQP, MQP2 PolicyResult
	Informed            []PolicyResult // --informed
}

// PolicyPoint is the offline policies at one capacity.
type PolicyPoint struct {
	CapacityPages       int
	LRU                 OracleResult
	ARC, MIN, MQP, MQP2 PolicyResult
	Informed            []PolicyResult // InformedPages at InformedHorizons (--informed)
}

// loadWorkload loads the traces or generates the workload.
func (c *Config) loadWorkload() (*Workload, error) {
	o := LoadOptions{PageTokens: c.PageTokens, BlockTokens: c.BlockTokens, Limit: c.Limit}
	switch c.Workload {
	case "agentic":
		return Generate(AgenticConfig{Seed: c.Seed}, o)
	case "agentic-scan":
		a := ScanHeavy
		a.Seed = c.Seed
		return Generate(a, o)
	}
	return Load(c.Traces, o)
}

// split is a run's pool sizes, in pages: each pod's pool and the node
// tier's (0: none). Without --node-tier every node's pool is the capacity.
// With it, frac 0 is the pods' own pools of capacity/Engines; frac > 0 a
// pool of that fraction of it (at least 16 slots) for each pod, and the
// rest of the capacity for the node tier.
func (c *Config) split(capacity int, frac float64) (pod, node int) {
	if !c.NodeTier {
		return capacity, 0
	}
	even := capacity / c.Engines
	if frac <= 0 {
		return even, 0
	}
	pod = max(16, int(frac*float64(even)))
	return pod, capacity - c.Engines*pod
}

// nodeTiered reports whether a transport's pods attach to a node tier.
func nodeTiered(transport string) bool { return strings.HasSuffix(transport, "+node") }

// tiered reports whether a transport runs with the shared tier.
func tiered(transport string) bool { return strings.HasSuffix(transport, "+l2") }

// hinted reports whether a transport's run sends retention hints.
func hinted(transport string) bool { return strings.HasSuffix(transport, "+hints") }

// CopyBytes are the bytes the sidecar copied (loads and stores).
func (r *RunResult) CopyBytes(pageBytes int) int64 {
	return (r.Counts.LoadedPages + r.Counts.StoredPages) * int64(pageBytes)
}

// Run replays the traces and prints the report.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if ctx == nil {
		ctx = context.Background()
	}
	logf := func(format string, a ...any) {
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Log, "replay: "+format+"\n", a...)
		}
	}
	t0 := time.Now()
	w, err := cfg.loadWorkload()
	if err != nil {
		return nil, err
	}
	logf("%d requests, %d pages of %d tokens (%d distinct), largest request %d pages; loaded in %v",
		len(w.Requests), w.TotalPages, w.PageTokens, w.DistinctPages, w.MaxPages, time.Since(t0).Round(time.Millisecond))
	rep := &Report{Config: cfg, Workload: w, Unbound: w.UnboundedHitRatio()}

	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	created := true
	defer func() {
		if created {
			os.RemoveAll(cfg.Dir)
		}
	}()
	if err := cfg.checkSpace(w); err != nil && !cfg.Offline {
		return nil, err
	}
	type plan struct {
		capacity  int
		transport string
		frac      float64 // ring+node: the pods' pools (split)
	}
	var plans []plan
	if cfg.L2Start != "" {
		stop, err := cfg.startTier()
		if err != nil {
			return nil, err
		}
		defer stop()
		rep.Config.L2Addrs = cfg.L2Addrs
	}
	for _, c := range cfg.CapacityPages {
		if cfg.Offline {
			break
		}
		plans = append(plans, plan{c, "ring", 0})
		if len(cfg.L2Addrs) > 0 {
			plans = append(plans, plan{c, "ring+l2", 0})
		}
		if cfg.Hints {
			plans = append(plans, plan{c, "ring+hints", 0})
		}
		if cfg.NodeTier {
			for _, f := range cfg.NodeTierPodFractions {
				plans = append(plans, plan{c, "ring+node", f})
			}
		}
	}
	if !cfg.NoUDS && !cfg.Offline {
		plans = append(plans, plan{cfg.UDSCapacity, "uds", 0})
	}
	oracles := map[int]OracleResult{} // the offline LRU
	for _, p := range plans {
		if _, ok := oracles[p.capacity]; !ok {
			oracles[p.capacity] = Oracle(w, p.capacity)
		}
	}
	fleets := map[plan]*FleetResult{}
	if cfg.Nodes > 1 || len(cfg.L2Addrs) > 0 {
		reqs := make([][]uint32, len(w.Requests))
		nodeOf := make([]int, len(w.Requests))
		for i := range w.Requests {
			reqs[i] = w.Requests[i].Pages
			nodeOf[i] = (i % cfg.Engines) % cfg.Nodes // the sequential replay's routing
		}
		for _, p := range plans {
			pod, node := cfg.split(p.capacity, p.frac)
			var f FleetResult
			if node > 0 {
				f = OracleNodeTier(reqs, nodeOf, cfg.Nodes, w.NumPageIDs(), pod, node, cfg.Policy)
			} else {
				f = oracleFleet(reqs, nodeOf, cfg.Nodes, w.NumPageIDs(), pod, tiered(p.transport), 0, cfg.Policy)
			}
			fleets[p] = &f
		}
	}
	curve := slices.Clone(cfg.CapacityPages)
	for c := slices.Max(curve) * 2; c < 2*w.DistinctPages; c *= 2 {
		curve = append(curve, c)
	}
	tp := time.Now()
	policies := map[int]PolicyPoint{}
	for _, c := range curve {
		o, ok := oracles[c]
		if !ok {
			o = Oracle(w, c)
		}
		rep.OracleCurve = append(rep.OracleCurve, o)
		pt := PolicyPoint{CapacityPages: c, LRU: o, ARC: ARC(w, c), MIN: MIN(w, c), MQP: MQP(w, c), MQP2: MQP2(w, c)}
		rep.PolicyCurve = append(rep.PolicyCurve, pt)
		policies[c] = pt
	}
	for _, p := range plans {
		if _, ok := policies[p.capacity]; !ok {
			policies[p.capacity] = PolicyPoint{CapacityPages: p.capacity, LRU: oracles[p.capacity], ARC: ARC(w, p.capacity), MIN: MIN(w, p.capacity), MQP: MQP(w, p.capacity), MQP2: MQP2(w, p.capacity)}
		}
	}
	if cfg.Informed {
		reqs := workloadPages(w)
		for i, pt := range rep.PolicyCurve {
			if !slices.Contains(cfg.CapacityPages, pt.CapacityPages) {
				continue
			}
			for _, hz := range InformedHorizons {
				pt.Informed = append(pt.Informed, InformedPages(reqs, w.NumPageIDs(), pt.CapacityPages, hz))
			}
			rep.PolicyCurve[i] = pt
			policies[pt.CapacityPages] = pt
		}
	}
	logf("offline policies: LRU, ARC, MIN, MQP and MQP2 at %d capacities in %v", len(curve), time.Since(tp).Round(time.Millisecond))
	prog := newProgress(cfg.Progress && !cfg.Quiet, cfg.Log, int64(len(plans)*len(w.Requests)))
	defer prog.finish()
	if prog.bar != nil {
		logf = func(string, ...any) {} // the bar tells the runs
	}
	for k, p := range plans {
		logf("run %d/%d: %d pages (%s), %s, %d engines", k+1, len(plans), p.capacity, cfg.gibLabel(p.capacity), p.transport, cfg.Engines)
		prog.describe(fmt.Sprintf("%s %s", cfg.gibLabel(p.capacity), p.transport))
		r, err := cfg.runOne(ctx, w, p.capacity, p.transport, p.frac, k, prog)
		if err != nil {
			return rep, fmt.Errorf("capacity %d pages, %s: %w", p.capacity, p.transport, err)
		}
		r.Oracle, r.LRU = oracles[p.capacity], oracles[p.capacity]
		pp := policies[p.capacity]
		r.ARC, r.MIN, r.MQP, r.MQP2, r.Informed = pp.ARC, pp.MIN, pp.MQP, pp.MQP2, pp.Informed
		switch cfg.Policy {
		case "mqp":
			r.Oracle = mqpModel(r.MQP)
		case "mqp2":
			r.Oracle = mqpModel(r.MQP2)
		}
		if f := fleets[p]; f != nil {
			r.Fleet, r.Oracle = f, f.OracleResult
			r.Oracle.CapacityPages = p.capacity
		}
		rep.Runs = append(rep.Runs, r)
		logf("  hit ratio %.4f (offline %s %.4f), %v, sidecar CPU %v", ratio(r.Counts.HitPages, r.Counts.TotalPages), cfg.modelName(), r.Oracle.HitRatio(), r.Wall.Round(time.Millisecond), r.Sidecar.CPU.Round(time.Millisecond))
	}
	prog.finish()
	rep.build()
	if err := rep.print(); err != nil {
		return rep, err
	}
	if cfg.OutDir != "-" {
		if err := rep.writeFiles(); err != nil {
			return rep, err
		}
		if !cfg.JSON && !cfg.Quiet {
			fmt.Fprintf(cfg.Out, "\nreport: %s (%s)\n", cfg.OutDir, strings.Join(rep.Files, ", "))
		}
	}
	return rep, nil
}

// modelName names the offline model the live runs are checked against.
func (c *Config) modelName() string { return strings.ToUpper(c.Policy) }

// mqpModel is MQP's offline result as the exactness check reads it. The
// model counts no refused stores (SkippedPages and PresentPages are -1:
// not modelled); with equal hits and stored pages their sum is equal
// anyway (both are the missed pages not stored). Nothing leaves the
// model's pool but by eviction, so it holds StoredPages - Evictions at
// the end.
func mqpModel(m PolicyResult) OracleResult {
	return OracleResult{
		CapacityPages: m.CapacityPages, Requests: m.Requests, TotalPages: m.TotalPages,
		HitPages: m.HitPages, BlockHitPages: m.BlockHitPages, StoredPages: m.StoredPages,
		PresentPages: -1, SkippedPages: -1, Evictions: m.Evictions, Resident: int(m.StoredPages - m.Evictions),
	}
}

func (c *Config) gibLabel(pages int) string {
	g := float64(int64(pages)*c.modelPageBytes()) / (1 << 30)
	switch {
	case g >= 1024 && g/1024 == float64(int64(g/1024)):
		return fmt.Sprintf("%d TiB", int64(g/1024))
	case g >= 1 && g == float64(int64(g)):
		return fmt.Sprintf("%d GiB", int64(g))
	case g >= 1:
		return fmt.Sprintf("%.1f GiB", g)
	}
	return fmt.Sprintf("%.0f MiB", g*1024)
}

// checkSpace checks that the largest pool and the engines' memory fit the
// shared-memory mount.
func (c *Config) checkSpace(w *Workload) error {
	free, err := sys.FreeBytes(c.Dir)
	if err != nil {
		return nil // not fatal: the sidecar checks again
	}
	largest := slices.Max(c.CapacityPages)
	need := uint64(largest)*uint64(c.PageBytes) + uint64(c.Engines)*uint64(max(w.MaxPages, 1))*uint64(c.PageBytes) + uint64(4*c.Engines+4)<<20
	if need > free {
		return fmt.Errorf("%s has %d MiB free; the largest pool (%d pages of %d bytes) and %d engines' memory (%d pages each) need %d MiB: lower --page-bytes or the largest --capacity-pages",
			c.Dir, free>>20, largest, c.PageBytes, c.Engines, w.MaxPages, need>>20)
	}
	return nil
}

func (c *Config) layout() string {
	return fmt.Sprintf("replay/%dtok/%dB", c.PageTokens, c.PageBytes)
}

// runOne starts a sidecar with capacity slots on each node, replays the
// workload through them and stops them.
func (c *Config) runOne(ctx context.Context, w *Workload, capacity int, transport string, frac float64, k int, prog *progress) (res *RunResult, err error) {
	dir := filepath.Join(c.Dir, fmt.Sprintf("run%d", k))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	pod, nodePages := c.split(capacity, frac)
	res = &RunResult{CapacityPages: capacity, Transport: transport, Hists: newHists(), PodPages: pod, NodeTierPages: nodePages, PodFraction: frac}
	var nt *nodeTier
	if nodeTiered(transport) {
		if nt, err = c.startNodeTier(ctx, filepath.Join(dir, "node"), nodePages); err != nil {
			return res, fmt.Errorf("node tier: %w", err)
		}
		defer func() {
			st, serr := nt.stats()
			if serr == nil {
				res.NodeTier = &st
			}
			peak := nt.sc.PeakRSS()
			if serr := nt.sc.Stop(c.Timeout); serr != nil && err == nil {
				err = fmt.Errorf("the node tier did not stop cleanly: %w", serr)
			}
			u := nt.sc.Usage(peak)
			res.NodeTierUsage = &u
		}()
	}
	var nodes []*sidecarNode
	var engines []*engine
	var relays []*harness.Child
	defer func() {
		for _, e := range engines {
			if e.rpc.c != nil {
				e.rpc.c.Close()
			}
			if e.mem != nil {
				e.mem.Close()
				shm.Unlink(e.mem.Path())
			}
		}
		for _, r := range relays {
			if rerr := r.Wait(c.Timeout); rerr != nil && err == nil {
				err = rerr
			}
		}
		for i, n := range nodes {
			if st, serr := n.state(); serr == nil && st.L2 != nil {
				res.FetchedPages += int64(st.L2.Machine.FetchedBlocks)
			}
			peak := n.sc.PeakRSS()
			if serr := n.sc.Stop(c.Timeout); serr != nil && err == nil {
				err = fmt.Errorf("sidecar %d did not stop cleanly: %w", i, serr)
			}
			u := n.sc.Usage(peak)
			res.Sidecar.CPU += u.CPU
			res.Sidecar.MaxRSS = max(res.Sidecar.MaxRSS, u.MaxRSS)
			res.Sidecar.Elapsed = max(res.Sidecar.Elapsed, u.Elapsed)
		}
	}()
	for i := 0; i < c.Nodes; i++ {
		n, err := c.startNode(ctx, w, filepath.Join(dir, fmt.Sprintf("node%d", i)), pod, transport, nt, k, i)
		if n != nil {
			nodes = append(nodes, n)
		}
		if err != nil {
			return res, fmt.Errorf("node %d: %w", i, err)
		}
	}
	for i := 0; i < c.Engines; i++ {
		n := nodes[i%len(nodes)]
		e, relay, err := c.newEngine(w, i, n.dir, n.sock, transport)
		if relay != nil {
			relays = append(relays, relay)
		}
		if e != nil {
			engines = append(engines, e)
		}
		if err != nil {
			return res, fmt.Errorf("engine %d: %w", i, err)
		}
		if (tiered(transport) || nodeTiered(transport)) && c.Sequential {
			// The next request may run on another node: this one's writes
			// must be in the tier first (and, for the exact model, before
			// the release).
			e.beforeRelease = n.waitWrites(c.Timeout)
		}
	}
	start := time.Now()
	if c.Sequential {
		err = c.replaySequential(ctx, w, engines, start, prog)
	} else {
		err = c.replayConcurrent(ctx, w, engines, start, prog)
	}
	res.Wall = time.Since(start)
	if err != nil {
		return res, err
	}
	for _, e := range engines {
		if _, err := e.syncDelta(); err != nil {
			return res, fmt.Errorf("engine %d: final changes: %w", e.id, err)
		}
		res.Counts.add(e.st)
		res.Hists.merge(e.h)
		res.Steps = append(res.Steps, e.steps...)
		res.Resyncs += e.resyncs
	}
	slices.SortStableFunc(res.Steps, func(a, b stepSample) int { return a.Request - b.Request })
	// Engine 0's view is of its node's pool; the others' pools add theirs.
	res.ViewBlocks = 0
	for i, e := range engines {
		if i < len(nodes) {
			res.ViewBlocks += len(e.view.keys)
		}
	}
	return res, nil
}

// waitAttachable waits until a session can attach to the sidecar. The
// probe attaches in the engines' namespace (layout), so that theirs is the
// sidecar's first (alignDigest), whether or not the probe's detach has
// removed it when the first engine attaches.
func waitAttachable(ctx context.Context, sc *harness.Child, sock, layout string, timeout time.Duration) error {
	return sc.WaitUntil(ctx, timeout, "attachable", func() error {
		c, err := connector.Dial(connector.Options{Socket: sock, Instance: "replay-probe", Model: model, Layout: layout, Timeout: timeout})
		if err != nil {
			return err
		}
		return c.Close()
	})
}

// newEngine attaches engine i over transport, with its memory in a
// shared-memory file registered as region 1 of its session.
func (c *Config) newEngine(w *Workload, i int, dir, sock, transport string) (*engine, *harness.Child, error) {
	pages := max(w.MaxPages, 1)
	e := &engine{id: i, w: w, pageBytes: c.PageBytes, walk: !c.NoWalk, prefill: c.PrefillTPS, h: newHists()}
	e.view.reset()
	path := filepath.Join(dir, fmt.Sprintf("engine%d.kv", i))
	m, err := shm.Create(path, pages*c.PageBytes, 0o600)
	if err != nil {
		return nil, nil, err
	}
	e.mem = m
	e.region = m.Bytes()[:pages*c.PageBytes]
	instance := fmt.Sprintf("replay-engine-%d", i)
	e.hints, e.pace = hinted(transport), c.Pace
	switch transport {
	case "ring", "ring+l2", "ring+hints", "ring+node":
		cl, err := connector.Dial(connector.Options{Socket: sock, Instance: instance, Model: model, Layout: c.layout(), Timeout: c.Timeout})
		if err != nil {
			return e, nil, err
		}
		e.rpc.c = ringCaller{cl}
		err = e.rpc.registerRegion(schema.RegisterRegion{
			Region: regionID, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
			Base: shm.Addr(e.region), Length: uint64(len(e.region)),
			PageSize: uint64(c.PageBytes), PageCount: uint32(pages),
		})
		if err != nil {
			return e, nil, fmt.Errorf("register region: %w", err)
		}
		return e, nil, nil
	case "uds":
		listen := filepath.Join(dir, fmt.Sprintf("uds%d.sock", i))
		region := uds.RegionFile{ID: regionID, Path: path, PageBytes: c.PageBytes, Pages: pages}
		args := []string{"replay-relay",
			"--sidecar", sock, "--listen", listen, "--instance", instance, "--model", model, "--layout", c.layout(),
			"--timeout", c.Timeout.String(), "--region", region.String()}
		rl, err := harness.Start(fmt.Sprintf("relay %d", i), c.Exe, args, harness.Options{Ready: true, Timeout: c.Timeout})
		if err != nil {
			return e, nil, err
		}
		u, err := uds.Dial(listen, c.Timeout)
		if err != nil {
			rl.Kill()
			return e, rl, fmt.Errorf("dial relay: %w", err)
		}
		e.rpc.c = udsCaller{u}
		return e, rl, nil
	}
	return e, nil, fmt.Errorf("unknown transport %q", transport)
}

// pace waits until request idx is due.
func (c *Config) pace(ctx context.Context, w *Workload, idx int, start time.Time) error {
	if c.Pace <= 0 {
		return ctx.Err()
	}
	due := start.Add(time.Duration(float64(w.Requests[idx].ArrivalMs) / c.Pace * float64(time.Millisecond)))
	if d := time.Until(due); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return ctx.Err()
}

// replaySequential runs one request at a time in trace order, request i
// on engine i mod Engines: the sidecar sees exactly the oracle's sequence.
func (c *Config) replaySequential(ctx context.Context, w *Workload, engines []*engine, start time.Time, prog *progress) error {
	for i := range w.Requests {
		if err := c.pace(ctx, w, i, start); err != nil {
			return err
		}
		e := engines[i%len(engines)]
		if err := e.step(i, start); err != nil {
			return fmt.Errorf("engine %d, request %d: %w", e.id, i, err)
		}
		prog.add(1)
	}
	return nil
}

// replayConcurrent runs the engines side by side: each takes the next
// request of the trace when it is free (and, when paced, waits for it to
// arrive), so the trace's order is kept but calls of different engines
// interleave at the sidecar.
func (c *Config) replayConcurrent(ctx context.Context, w *Workload, engines []*engine, start time.Time, prog *progress) error {
	var next atomic.Int64
	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make([]error, len(engines))
	for k, e := range engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				i := int(next.Add(1) - 1)
				if i >= len(w.Requests) {
					return
				}
				if err := c.pace(ctx, w, i, start); err != nil {
					errs[k] = err
					stop.Store(true)
					return
				}
				if err := e.step(i, start); err != nil {
					errs[k] = fmt.Errorf("engine %d, request %d: %w", e.id, i, err)
					stop.Store(true)
					return
				}
				prog.add(1)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
