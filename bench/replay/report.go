package replay

import (
	"encoding/csv"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/ringside-kv/ringside/bench/harness"
)

// CapacityRow is one run's hit rates beside the oracle's (bench "replay").
type CapacityRow struct {
	Bench              string  `json:"bench"` // "replay"
	CapacityPages      int     `json:"capacity_pages"`
	CapacityGiBEquiv   float64 `json:"capacity_gib_equiv"` // pool size at the model's page bytes
	Transport          string  `json:"transport"`          // "ring" or "uds"
	PageTokens         int     `json:"page_tokens"`
	PagesPerBlock      int     `json:"pages_per_block"`
	PageBytes          int     `json:"page_bytes"`       // bytes each page really copies
	ModelPageBytes     int64   `json:"model_page_bytes"` // KV bytes of a page of the model
	Engines            int     `json:"engines"`
	Sequential         bool    `json:"sequential"`
	Pace               float64 `json:"pace"`   // 0: as fast as possible
	Policy             string  `json:"policy"` // the sidecar's eviction policy; the oracle_* fields are its offline model's
	Requests           int64   `json:"requests"`
	Pages              int64   `json:"pages"`
	HitPages           int64   `json:"hit_pages"`
	HitRatio           float64 `json:"hit_ratio"`
	OracleHitPages     int64   `json:"oracle_hit_pages"`
	OracleHitRatio     float64 `json:"oracle_hit_ratio"`
	OracleMatch        bool    `json:"oracle_match"` // hit pages equal (expected with --sequential)
	StoredPages        int64   `json:"stored_pages"`
	OracleStoredPages  int64   `json:"oracle_stored_pages"`
	SkippedPages       int64   `json:"skipped_pages"`        // NoSpace
	OracleSkippedPages int64   `json:"oracle_skipped_pages"` // -1: not modelled (MQP)
	OracleEvictions    int64   `json:"oracle_evictions"`
	LoadedPages        int64   `json:"loaded_pages"`
	ViewBlocks         int     `json:"view_blocks"`           // engine 0's view of the cache at the end (change log)
	OracleResident     int     `json:"oracle_resident_pages"` // pages the oracle holds at the end
	Resyncs            int     `json:"resyncs"`
	WallSec            float64 `json:"wall_s"`
	RequestsPerSec     float64 `json:"requests_per_sec"`
	// Several nodes and the shared tier (transport ring+l2).
	Nodes              int   `json:"nodes"`
	Tier               bool  `json:"tier"`
	FetchedPages       int64 `json:"fetched_pages"`        // pages the nodes fetched from the tier
	OracleFetchedPages int64 `json:"oracle_fetched_pages"` // and the model's
	OracleTierHitPages int64 `json:"oracle_tier_hit_pages"`
	OracleLoadedPages  int64 `json:"oracle_loaded_pages"`
	// Retention hints (transport ring+hints, --hints): no model covers
	// them, so the oracle_* fields are the run's without hints.
	Hints         bool  `json:"hints"`
	Retains       int64 `json:"retains"`        // Retain records that set a retention
	RetainedPages int64 `json:"retained_pages"` // blocks they retained or renewed
	Ends          int64 `json:"ends"`           // Retain records that ended a session's retentions
	EndedPages    int64 `json:"ended_pages"`    // retentions they ended
	// One node's pods (--node-tier): capacity_pages is the node's pages in
	// all, pod_pages each pod's pool, node_tier_pages the node tier's
	// (transport ring+node; 0: the pods' own pools alone, transport ring),
	// pod_fraction the split's. The node process's counts beside the
	// model's: pages written into it (new there) and evicted from it.
	NodeTier                bool    `json:"node_tier"`
	PodPages                int     `json:"pod_pages"`
	NodeTierPages           int     `json:"node_tier_pages"`
	PodFraction             float64 `json:"pod_fraction"`
	NodeTierStoredPages     int64   `json:"node_tier_stored_pages"`
	OracleNodeTierStored    int64   `json:"oracle_node_tier_stored_pages"`
	NodeTierEvictions       int64   `json:"node_tier_evictions"`
	OracleNodeTierEvictions int64   `json:"oracle_node_tier_evictions"`
	NodeTierHeldPages       int64   `json:"node_tier_held_pages"` // writes of pages it held already
	NodeTierCPUSec          float64 `json:"node_tier_cpu_s"`
	NodeTierPeakRSSBytes    int64   `json:"node_tier_peak_rss_bytes"`
	NodeTierBytesOut        int64   `json:"node_tier_bytes_out"` // value bytes copied out to pods
}

// PolicyRow is one capacity's prefix-hit ratios: the live sidecar's
// beside the offline policies' of the same workload (bench
// "replay_policy"). The optimum is MIN's block-hit ratio, an upper bound
// on every policy's prefix hits (policies.go, MINPages); MIN's prefix
// ratio is that of following MIN's decisions, not an optimum. MQP and MQP2
// are the cache's multi-queue policies (mqp.go, mqp2.go), offline. With
// --offline (transport "offline") no sidecar ran: the live fields are
// zero.
type PolicyRow struct {
	Bench             string  `json:"bench"` // "replay_policy"
	Workload          string  `json:"workload"`
	CapacityPages     int     `json:"capacity_pages"`
	Transport         string  `json:"transport"`
	PageTokens        int     `json:"page_tokens"`
	Sequential        bool    `json:"sequential"`
	Policy            string  `json:"policy"` // the live sidecar's eviction policy
	Requests          int     `json:"requests"`
	Pages             int64   `json:"pages"`
	LiveHitRatio      float64 `json:"live_hit_ratio"`       // the sidecar's policy, live
	LRUHitRatio       float64 `json:"lru_hit_ratio"`        // exact offline LRU (the oracle)
	LiveEqualsLRU     bool    `json:"live_equals_lru"`      // hit pages equal
	LiveEqualsModel   bool    `json:"live_equals_model"`    // hit pages equal to the offline model of the live policy's (LRU, MQP or MQP2)
	ARCHitRatio       float64 `json:"arc_hit_ratio"`        // vLLM's ARC offloading manager
	MINBlockHitRatio  float64 `json:"min_block_hit_ratio"`  // the optimum's block hits: the bound
	MINPrefixHitRatio float64 `json:"min_prefix_hit_ratio"` // prefix hits following MIN's decisions
	MQPHitRatio       float64 `json:"mqp_hit_ratio"`        // MQP (mqp.go)
	MQPOverLRU        float64 `json:"mqp_over_lru"`
	MQP2HitRatio      float64 `json:"mqp2_hit_ratio"` // MQP2 (mqp2.go)
	MQP2OverLRU       float64 `json:"mqp2_over_lru"`
	MQP2OverARC       float64 `json:"mqp2_over_arc"`
	MQP2OverMIN       float64 `json:"mqp2_over_min"` // of the optimum's bound
	LiveOverLRU       float64 `json:"live_over_lru"`
	LRUBlockHitRatio  float64 `json:"lru_block_hit_ratio"`
	ARCBlockHitRatio  float64 `json:"arc_block_hit_ratio"`
	ARCFailedStores   int64   `json:"arc_failed_stores"`
	MQPBlockHitRatio  float64 `json:"mqp_block_hit_ratio"`
	MQP2BlockHitRatio float64 `json:"mqp2_block_hit_ratio"`
	UnboundedHitRatio float64 `json:"unbounded_hit_ratio"` // a cache that never evicts
	// InformedHitRatio is, per InformedHorizons (0: ever), the LRU told
	// which pages come back (--informed; absent without).
	InformedHitRatio []float64 `json:"informed_hit_ratio,omitempty"`
	// LiveHintsHitRatio is the live run's with retention hints at the
	// same capacity (--hints; absent without).
	LiveHintsHitRatio *float64 `json:"live_hints_hit_ratio,omitempty"`
}

// OpRow is one operation's latency in one run (bench "replay_op").
type OpRow struct {
	Bench         string  `json:"bench"` // "replay_op"
	CapacityPages int     `json:"capacity_pages"`
	Transport     string  `json:"transport"`
	Op            string  `json:"op"`               // lookup, acquire, load, store, release, hashes, step, request
	Method        string  `json:"method,omitempty"` // step only: "delta" or "walk"
	Count         int64   `json:"count"`
	P50Ns         int64   `json:"p50_ns"`
	P90Ns         int64   `json:"p90_ns"`
	P99Ns         int64   `json:"p99_ns"`
	P999Ns        int64   `json:"p999_ns"`
	MaxNs         int64   `json:"max_ns"`
	MeanNs        float64 `json:"mean_ns"`
}

// SidecarRow is the sidecar process of one run (bench "replay_sidecar").
type SidecarRow struct {
	Bench                string  `json:"bench"` // "replay_sidecar"
	CapacityPages        int     `json:"capacity_pages"`
	Transport            string  `json:"transport"`
	CPUSeconds           float64 `json:"cpu_s"`
	LifetimeSec          float64 `json:"lifetime_s"`
	CPUFraction          float64 `json:"cpu_fraction"`            // CPU time / lifetime: cores used during this run
	TraceSec             float64 `json:"trace_s"`                 // the replayed requests' span in the trace
	CPUFractionTracePace float64 `json:"cpu_fraction_trace_pace"` // CPU time / trace span: cores at the trace's real pace
	PeakRSSBytes         int64   `json:"peak_rss_bytes"`          // pool pages touched included (shared memory)
	CopyBytes            int64   `json:"copy_bytes"`
	CopyBytesPerSec      float64 `json:"copy_bytes_per_sec"`
	PodFraction          float64 `json:"pod_fraction"` // --node-tier's split (ring+node)
}

func opRow(capacity int, transport, key string, s Summary) OpRow {
	r := OpRow{Bench: "replay_op", CapacityPages: capacity, Transport: transport, Op: key,
		Count: s.Count, P50Ns: s.P50, P90Ns: s.P90, P99Ns: s.P99, P999Ns: s.P999, MaxNs: s.Max, MeanNs: s.Mean}
	switch key {
	case stepOp:
		r.Op, r.Method = "step", "delta"
	case walkOp:
		r.Op, r.Method = "step", "walk"
	}
	return r
}

// opKeys are the histogram keys in report order.
func opKeys() []string {
	var out []string
	for _, o := range opNames {
		if o == "step" {
			out = append(out, stepOp, walkOp)
			continue
		}
		out = append(out, o)
	}
	return out
}

func (rep *Report) build() {
	c := &rep.Config
	w := rep.Workload
	mp := c.modelPageBytes()
	for _, r := range rep.Runs {
		cr := CapacityRow{
			Bench: "replay", CapacityPages: r.CapacityPages, CapacityGiBEquiv: float64(int64(r.CapacityPages)*mp) / (1 << 30),
			Transport: r.Transport, PageTokens: w.PageTokens, PagesPerBlock: w.PagesPerBlock, PageBytes: c.PageBytes, ModelPageBytes: mp,
			Engines: c.Engines, Sequential: c.Sequential, Pace: c.Pace, Policy: c.Policy,
			Requests: r.Counts.Requests, Pages: r.Counts.TotalPages,
			HitPages: r.Counts.HitPages, HitRatio: ratio(r.Counts.HitPages, r.Counts.TotalPages),
			OracleHitPages: r.Oracle.HitPages, OracleHitRatio: r.Oracle.HitRatio(),
			OracleMatch: r.Counts.HitPages == r.Oracle.HitPages && r.Counts.TotalPages == r.Oracle.TotalPages,
			StoredPages: r.Counts.StoredPages, OracleStoredPages: r.Oracle.StoredPages,
			SkippedPages: r.Counts.SkippedPages, OracleSkippedPages: r.Oracle.SkippedPages,
			OracleEvictions: r.Oracle.Evictions, LoadedPages: r.Counts.LoadedPages,
			ViewBlocks: r.ViewBlocks, OracleResident: r.Oracle.Resident, Resyncs: r.Resyncs,
			WallSec: r.Wall.Seconds(), RequestsPerSec: float64(r.Counts.Requests) / max(r.Wall.Seconds(), 1e-9),
			Nodes: c.Nodes, Tier: tiered(r.Transport), FetchedPages: r.FetchedPages,
			Hints: hinted(r.Transport), Retains: r.Counts.Retains, RetainedPages: r.Counts.RetainedPages,
			Ends: r.Counts.Ends, EndedPages: r.Counts.EndedPages,
			NodeTier: nodeTiered(r.Transport), PodPages: r.PodPages, NodeTierPages: r.NodeTierPages, PodFraction: r.PodFraction,
		}
		if f := r.Fleet; f != nil {
			cr.OracleFetchedPages, cr.OracleTierHitPages, cr.OracleLoadedPages = f.FetchedPages, f.TierHitPages, f.LoadedPages
			cr.OracleNodeTierStored, cr.OracleNodeTierEvictions = f.TierStored, f.TierEvictions
		} else {
			cr.OracleLoadedPages = r.Oracle.HitPages
		}
		if st := r.NodeTier; st != nil {
			cr.NodeTierStoredPages, cr.NodeTierEvictions, cr.NodeTierHeldPages, cr.NodeTierBytesOut = st.PutStored, st.Evicted, st.PutHeld, st.BytesOut
		}
		if u := r.NodeTierUsage; u != nil {
			cr.NodeTierCPUSec, cr.NodeTierPeakRSSBytes = u.CPU.Seconds(), u.MaxRSS
		}
		rep.Rows = append(rep.Rows, cr)
	}
	if c.Offline {
		for _, pt := range rep.PolicyCurve {
			if slices.Contains(c.CapacityPages, pt.CapacityPages) {
				rep.Rows = append(rep.Rows, rep.policyRow(pt, "offline"))
			}
		}
	}
	for _, r := range rep.runsOf("ring") {
		live := ratio(r.Counts.HitPages, r.Counts.TotalPages)
		var withHints *float64
		for _, h := range rep.runsOf("ring+hints") {
			if h.CapacityPages == r.CapacityPages {
				x := ratio(h.Counts.HitPages, h.Counts.TotalPages)
				withHints = &x
			}
		}
		row := rep.policyRow(PolicyPoint{CapacityPages: r.CapacityPages, LRU: r.LRU, ARC: r.ARC, MIN: r.MIN, MQP: r.MQP, MQP2: r.MQP2, Informed: r.Informed}, r.Transport)
		row.LiveHintsHitRatio, row.Pages = withHints, r.Counts.TotalPages
		row.LiveHitRatio, row.LiveEqualsLRU, row.LiveEqualsModel = live, r.Counts.HitPages == r.LRU.HitPages, r.Counts.HitPages == r.Oracle.HitPages
		row.LiveOverLRU = live / max(r.LRU.HitRatio(), 1e-12)
		rep.Rows = append(rep.Rows, row)
	}
	for _, r := range rep.Runs {
		for _, k := range opKeys() {
			if x, ok := r.Hists[k]; ok {
				rep.Rows = append(rep.Rows, opRow(r.CapacityPages, r.Transport, k, summarize(x)))
			}
		}
	}
	for _, r := range rep.Runs {
		trace := float64(w.SpanMs) / 1000
		sr := SidecarRow{
			Bench: "replay_sidecar", CapacityPages: r.CapacityPages, Transport: r.Transport,
			CPUSeconds: r.Sidecar.CPU.Seconds(), LifetimeSec: r.Sidecar.Elapsed.Seconds(),
			CPUFraction: r.Sidecar.CPU.Seconds() / max(r.Sidecar.Elapsed.Seconds(), 1e-9),
			TraceSec:    trace, PeakRSSBytes: r.Sidecar.MaxRSS,
			CopyBytes: r.CopyBytes(c.PageBytes), CopyBytesPerSec: float64(r.CopyBytes(c.PageBytes)) / max(r.Wall.Seconds(), 1e-9),
			PodFraction: r.PodFraction,
		}
		if trace > 0 {
			sr.CPUFractionTracePace = r.Sidecar.CPU.Seconds() / trace
		}
		rep.Rows = append(rep.Rows, sr)
	}
	rep.Verdicts = rep.verdicts()
}

// policyRow is the offline policies' row at one capacity (the live
// fields left for the caller).
func (rep *Report) policyRow(pt PolicyPoint, transport string) PolicyRow {
	c, w := &rep.Config, rep.Workload
	lru := max(pt.LRU.HitRatio(), 1e-12)
	var informed []float64
	for _, x := range pt.Informed {
		informed = append(informed, x.HitRatio())
	}
	return PolicyRow{
		InformedHitRatio: informed,
		Bench:            "replay_policy", Workload: strings.Join(w.Files, ","), CapacityPages: pt.CapacityPages, Transport: transport,
		PageTokens: w.PageTokens, Sequential: c.Sequential, Policy: c.Policy, Requests: len(w.Requests), Pages: pt.LRU.TotalPages,
		LRUHitRatio: pt.LRU.HitRatio(), ARCHitRatio: pt.ARC.HitRatio(), MINBlockHitRatio: pt.MIN.BlockHitRatio(), MINPrefixHitRatio: pt.MIN.HitRatio(),
		MQPHitRatio: pt.MQP.HitRatio(), MQPOverLRU: pt.MQP.HitRatio() / lru, MQPBlockHitRatio: pt.MQP.BlockHitRatio(),
		MQP2HitRatio: pt.MQP2.HitRatio(), MQP2OverLRU: pt.MQP2.HitRatio() / lru, MQP2BlockHitRatio: pt.MQP2.BlockHitRatio(),
		MQP2OverARC: pt.MQP2.HitRatio() / max(pt.ARC.HitRatio(), 1e-12), MQP2OverMIN: pt.MQP2.HitRatio() / max(pt.MIN.BlockHitRatio(), 1e-12),
		LRUBlockHitRatio: pt.LRU.BlockHitRatio(), ARCBlockHitRatio: pt.ARC.BlockHitRatio(), ARCFailedStores: pt.ARC.FailedStores,
		UnboundedHitRatio: rep.Unbound,
	}
}

// merged returns the histograms of every run of a transport, merged.
func (rep *Report) merged(transport string) hists {
	m := newHists()
	for _, r := range rep.Runs {
		if r.Transport == transport {
			m.merge(r.Hists)
		}
	}
	return m
}

func (rep *Report) runsOf(transport string) []*RunResult {
	var out []*RunResult
	for _, r := range rep.Runs {
		if r.Transport == transport {
			out = append(out, r)
		}
	}
	return out
}

func us(ns int64) string {
	switch {
	case ns >= 10e6:
		return fmt.Sprintf("%.0f ms", float64(ns)/1e6)
	case ns >= 1e6:
		return fmt.Sprintf("%.2f ms", float64(ns)/1e6)
	case ns >= 100e3:
		return fmt.Sprintf("%.0f us", float64(ns)/1e3)
	}
	return fmt.Sprintf("%.1f us", float64(ns)/1e3)
}

func bytesStr(b float64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%.2f GiB", b/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", b/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", b/(1<<10))
	}
	return fmt.Sprintf("%.0f B", b)
}

// verdicts reads the report against the targets (targets.go); it reports,
// never fails.
func (rep *Report) verdicts() []string {
	c := &rep.Config
	var out []string
	ring := rep.merged("ring")
	mode := fmt.Sprintf("%d engines, %s", c.Engines, map[bool]string{true: "sequential", false: "concurrent"}[c.Sequential])
	if s := summarize(ring["lookup"]); s.Count > 0 {
		out = append(out, targetLookup.At(mode).Verdict(float64(s.P99)/1e3, fmt.Sprintf("%s; p50 %s", us(s.P99), us(s.P50))))
	}
	if s := summarize(ring["acquire"]); s.Count > 0 {
		out = append(out, targetAcquire.At(mode).Verdict(float64(s.P99)/1e3, fmt.Sprintf("%s; p50 %s", us(s.P99), us(s.P50))))
	}
	if c.Engines != 2 {
		out = append(out, fmt.Sprintf("note: the latency targets are stated for 2 engine instances; this run had %d", c.Engines))
	}
	runs := rep.runsOf("ring")
	if len(runs) >= 2 {
		// The delta's cost follows the churn (changes per step), which
		// differs between capacities (a small pool refuses stores), so
		// flatness is read per change: cost that does not grow with the
		// cache. The walk is read per step.
		var per []string
		lo, hi := math.Inf(1), 0.0
		for _, r := range runs {
			pc := r.deltaPerChange()
			if pc <= 0 {
				continue
			}
			lo, hi = math.Min(lo, pc), math.Max(hi, pc)
			per = append(per, fmt.Sprintf("%d: %s p50, %.0f ns/change", r.CapacityPages, us(summarize(r.Hists[stepOp]).P50), pc))
		}
		if hi > 0 {
			out = append(out, targetDeltaFlat.Verdict(hi/lo, fmt.Sprintf("%.2fx; %s", hi/lo, strings.Join(per, "; "))))
		}
		first, last := runs[0], runs[len(runs)-1]
		wl, wh := summarize(first.Hists[walkOp]), summarize(last.Hists[walkOp])
		dh := summarize(last.Hists[stepOp])
		if wl.P50 > 0 && dh.P50 > 0 {
			f := float64(wh.P50) / float64(wl.P50)
			out = append(out, targetWalkGrows.Verdict(f, fmt.Sprintf("p50 %s at %d pages, %s at %d pages, %.1fx; walk/delta p50 at %d pages: %.2fx",
				us(wl.P50), first.CapacityPages, us(wh.P50), last.CapacityPages, f, last.CapacityPages, float64(wh.P50)/float64(dh.P50))))
		}
	}
	worst := 0.0
	var worstRun *RunResult
	for _, r := range rep.Runs {
		if t := float64(rep.Workload.SpanMs) / 1000; t > 0 {
			if f := r.Sidecar.CPU.Seconds() / t; f >= worst {
				worst, worstRun = f, r
			}
		}
	}
	if worstRun != nil {
		how := "CPU time of the whole replay over the trace's real span"
		if c.Pace == 1 {
			how = "measured at the trace's real pace"
		}
		out = append(out, targetCPU.Verdict(worst*100, fmt.Sprintf("%.1f%% at %d pages, %s; %s: %.1f s CPU over %.0f s of trace",
			worst*100, worstRun.CapacityPages, worstRun.Transport, how, worstRun.Sidecar.CPU.Seconds(), float64(rep.Workload.SpanMs)/1000)))
	}
	all, maxDiff := true, 0.0
	for _, r := range rep.Runs {
		if hinted(r.Transport) {
			continue // no model covers retention hints
		}
		if r.Counts.HitPages != r.Oracle.HitPages || r.Counts.TotalPages != r.Oracle.TotalPages {
			all = false
		}
		maxDiff = max(maxDiff, abs(ratio(r.Counts.HitPages, r.Counts.TotalPages)-r.Oracle.HitRatio()))
	}
	if len(rep.Runs) > 0 {
		target := targetOracle
		target.What = fmt.Sprintf("hit rate equal to the offline %s at every capacity", c.modelName())
		if c.Sequential {
			out = append(out, target.At("sequential, exact page counts").Holds(all, ""))
		} else {
			out = append(out, target.NotMeasured(fmt.Sprintf("not checkable exactly with concurrent engines, whose calls interleave; largest difference %.3f points%s; --sequential checks it exactly",
				maxDiff*100, map[bool]string{true: ", equal anyway", false: ""}[all])))
		}
	}
	if tr := rep.runsOf("ring+l2"); len(tr) > 0 {
		var parts []string
		for _, r := range tr {
			for _, b := range runs {
				if b.CapacityPages == r.CapacityPages {
					parts = append(parts, fmt.Sprintf("%s: %.2f%% without, %.2f%% with (%d pages fetched from the tier)", c.gibLabel(r.CapacityPages),
						100*ratio(b.Counts.HitPages, b.Counts.TotalPages), 100*ratio(r.Counts.HitPages, r.Counts.TotalPages), r.FetchedPages))
				}
			}
		}
		out = append(out, fmt.Sprintf("hit rate of %d nodes without and with the shared tier: %s", c.Nodes, strings.Join(parts, "; ")))
		if c.Sequential {
			ok := true
			for _, r := range tr {
				if r.Fleet == nil || r.FetchedPages != r.Fleet.FetchedPages || r.Counts.LoadedPages != r.Fleet.LoadedPages {
					ok = false
				}
			}
			out = append(out, targetFleet.Holds(ok, ""))
		}
	}
	if nr := rep.runsOf("ring+node"); len(nr) > 0 {
		var parts []string
		for _, r := range nr {
			for _, b := range runs {
				if b.CapacityPages == r.CapacityPages {
					hb, hn := ratio(b.Counts.HitPages, b.Counts.TotalPages), ratio(r.Counts.HitPages, r.Counts.TotalPages)
					parts = append(parts, fmt.Sprintf("%d pages: pods' own pools of %d %.2f%%, pools of %d over a node tier of %d %.2f%% (%.3fx; %d pages fetched from the node tier)",
						r.CapacityPages, b.PodPages, 100*hb, r.PodPages, r.NodeTierPages, 100*hn, hn/max(hb, 1e-12), r.FetchedPages))
				}
			}
		}
		out = append(out, fmt.Sprintf("hit rate of %d pods on one node, the same pages in all: %s", c.Engines, strings.Join(parts, "; ")))
		if c.Sequential {
			ok := true
			var bad []string
			for _, r := range nr {
				f, st := r.Fleet, r.NodeTier
				if f == nil || st == nil || r.FetchedPages != f.FetchedPages || r.Counts.LoadedPages != f.LoadedPages ||
					st.PutStored != f.TierStored || st.Evicted != f.TierEvictions || st.PresentSlots != f.TierStored-f.TierEvictions {
					ok = false
					bad = append(bad, fmt.Sprintf("%d pages, pods of %d", r.CapacityPages, r.PodPages))
				}
			}
			out = append(out, targetNodeTier.Holds(ok, strings.Join(bad, "; ")))
		}
	}
	if hr := rep.runsOf("ring+hints"); len(hr) > 0 {
		var parts []string
		for _, r := range hr {
			for _, b := range runs {
				if b.CapacityPages == r.CapacityPages {
					parts = append(parts, fmt.Sprintf("%d pages: %.2f%% without, %.2f%% with (%d retains of %d blocks, %d session ends of %d)", r.CapacityPages,
						100*ratio(b.Counts.HitPages, b.Counts.TotalPages), 100*ratio(r.Counts.HitPages, r.Counts.TotalPages),
						r.Counts.Retains, r.Counts.RetainedPages, r.Counts.Ends, r.Counts.EndedPages))
				}
			}
		}
		out = append(out, fmt.Sprintf("live hit rate without and with retention hints (%s; not checked against a model, none covers hints): %s", c.Policy, strings.Join(parts, "; ")))
	}
	if u := rep.runsOf("uds"); len(u) > 0 {
		uh := u[0].Hists
		for _, r := range runs {
			if r.CapacityPages != u[0].CapacityPages {
				continue
			}
			var parts []string
			for _, op := range []string{"lookup", "acquire", "store", "request"} {
				a, b := summarize(r.Hists[op]), summarize(uh[op])
				if a.P50 > 0 && b.P50 > 0 {
					parts = append(parts, fmt.Sprintf("%s %s vs %s (%.1fx)", op, us(b.P50), us(a.P50), float64(b.P50)/float64(a.P50)))
				}
			}
			out = append(out, fmt.Sprintf("socket baseline at %d pages, p50 uds vs ring: %s (the uds path also carries one ring round trip through the relay)", r.CapacityPages, strings.Join(parts, ", ")))
		}
	}
	for _, pt := range rep.PolicyCurve {
		if b := pt.MIN.BlockHitPages; b < pt.LRU.BlockHitPages || b < pt.ARC.BlockHitPages || b < pt.MQP.BlockHitPages || b < pt.MQP2.BlockHitPages {
			out = append(out, fmt.Sprintf("check: at %d pages MIN's block hits %d are below LRU's %d, ARC's %d, MQP's %d or MQP2's %d (MIN must bound them)", pt.CapacityPages, b, pt.LRU.BlockHitPages, pt.ARC.BlockHitPages, pt.MQP.BlockHitPages, pt.MQP2.BlockHitPages))
		}
	}
	for _, r := range rep.Runs {
		if c.Sequential && r.Resyncs == 0 && !hinted(r.Transport) && r.ViewBlocks != r.Oracle.Resident {
			out = append(out, fmt.Sprintf("check: at %d pages (%s) the change log's view holds %d blocks, the oracle %d", r.CapacityPages, r.Transport, r.ViewBlocks, r.Oracle.Resident))
		}
		if r.Resyncs > 0 {
			out = append(out, fmt.Sprintf("note: at %d pages (%s) engines resynchronised %d times (the change log overran a cursor)", r.CapacityPages, r.Transport, r.Resyncs))
		}
	}
	return out
}

// deltaPerChange is the delta method's cost per change-log entry read, in
// ns (steps that read nothing are left out).
func (r *RunResult) deltaPerChange() float64 {
	var ns, n int64
	for _, s := range r.Steps {
		if s.Changes > 0 {
			ns += s.DeltaNs
			n += int64(s.Changes)
		}
	}
	if n == 0 {
		return 0
	}
	return float64(ns) / float64(n)
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

func (rep *Report) print() error {
	c := &rep.Config
	out := c.Out
	if c.JSON {
		if err := harness.JSONLines(out, rep.Rows); err != nil {
			return err
		}
		harness.Verdicts(out, c.Log, true, c.Quiet, rep.Verdicts)
		return nil
	}
	w := rep.Workload
	fmt.Fprintf(out, "ringside bench replay: %s\n", strings.Join(w.Files, ", "))
	fmt.Fprintf(out, "%d requests over %.0f s of trace; %d pages of %d tokens (%d per %d-token block), %d distinct; a cache that never evicts hits %.2f%%\n",
		len(w.Requests), float64(w.SpanMs)/1000, w.TotalPages, w.PageTokens, w.PagesPerBlock, w.BlockTokens, w.DistinctPages, rep.Unbound*100)
	fmt.Fprintf(out, "page bytes %s copied per page; a model page (%s per token x %d tokens) is %s, so GiB equivalents are at %s per page%s\n",
		bytesStr(float64(c.PageBytes)), bytesStr(float64(c.KVBytesPerToken)), c.PageTokens, bytesStr(float64(c.modelPageBytes())), bytesStr(float64(c.modelPageBytes())),
		scaleNote(c))
	if c.Offline {
		fmt.Fprintf(out, "offline: no sidecar; the policies one request at a time; %d CPUs, load average %s after the run\n", runtime.NumCPU(), harness.LoadAvg())
		if err := rep.printPolicies(out); err != nil {
			return err
		}
		harness.Verdicts(out, c.Log, false, c.Quiet, rep.Verdicts)
		return nil
	}
	pace := "as fast as possible"
	if c.Pace > 0 {
		pace = fmt.Sprintf("at the trace's timestamps / %g", c.Pace)
	}
	nodes := "one sidecar process per run"
	if c.NodeTier {
		nodes = fmt.Sprintf("node tier: %d pods (sidecar processes) on one node, the capacity their pages in all: ring, pools of capacity/%d each; ring+node, smaller pools over one `ringside node` holding the rest", c.Engines, c.Engines)
	} else if c.Nodes > 1 || len(c.L2Addrs) > 0 {
		nodes = fmt.Sprintf("%d nodes (sidecar processes, pools of the capacity each) per run", c.Nodes)
		if len(c.L2Addrs) > 0 {
			nodes += fmt.Sprintf(", ring+l2: sharing the tier at %s", strings.Join(c.L2Addrs, ","))
		}
	}
	fmt.Fprintf(out, "%d engine instances, %s, %s; %s; eviction policy %s (the oracle columns: its exact offline model); %d CPUs, load average %s after the runs\n\n",
		c.Engines, map[bool]string{true: "sequential (one request at a time, trace order)", false: "concurrent"}[c.Sequential], pace, nodes, c.Policy, runtime.NumCPU(), harness.LoadAvg())

	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "capacity\tGiB equiv\ttransport\thit ratio\toracle\tequal\tstored\toracle stored\tno space\tloaded\tfrom tier\toracle\treq/s\tsidecar CPU\tpeak RSS\tcopied/s\t")
	for _, r := range rep.Runs {
		var sr SidecarRow
		for _, x := range rep.Rows {
			if s, ok := x.(SidecarRow); ok && s.CapacityPages == r.CapacityPages && s.Transport == r.Transport && s.PodFraction == r.PodFraction {
				sr = s
			}
		}
		eq := "yes"
		if hinted(r.Transport) {
			eq = "hints"
		} else if r.Counts.HitPages != r.Oracle.HitPages {
			eq = fmt.Sprintf("%+d", r.Counts.HitPages-r.Oracle.HitPages)
		}
		var ofetched int64
		if r.Fleet != nil {
			ofetched = r.Fleet.FetchedPages
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.4f\t%.4f\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%.0f\t%.1f%%\t%s\t%s/s\t\n",
			r.CapacityPages, c.gibLabel(r.CapacityPages), r.Transport,
			ratio(r.Counts.HitPages, r.Counts.TotalPages), r.Oracle.HitRatio(), eq,
			r.Counts.StoredPages, r.Oracle.StoredPages, r.Counts.SkippedPages, r.Counts.LoadedPages, r.FetchedPages, ofetched,
			float64(r.Counts.Requests)/max(r.Wall.Seconds(), 1e-9), sr.CPUFraction*100, bytesStr(float64(sr.PeakRSSBytes)), bytesStr(sr.CopyBytesPerSec))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out, "sidecar CPU: CPU time / process lifetime (cores busy during the run; all nodes' together); peak RSS counts the pool pages it touched (the largest node)")
	if c.NodeTier {
		if err := rep.printNodeTier(out); err != nil {
			return err
		}
	}
	var beyond []string
	for _, o := range rep.OracleCurve {
		if o.CapacityPages > slices.Max(c.CapacityPages) {
			beyond = append(beyond, fmt.Sprintf("%s %.2f%%", c.gibLabel(o.CapacityPages), o.HitRatio()*100))
		}
	}
	if len(beyond) > 0 {
		fmt.Fprintf(out, "offline LRU beyond the sweep: %s\n", strings.Join(beyond, ", "))
	}

	if err := rep.printPolicies(out); err != nil {
		return err
	}

	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "op\ttransport\tcalls\tp50\tp90\tp99\tp99.9\tmax\t")
	for _, tr := range []string{"ring", "uds"} {
		m := rep.merged(tr)
		for _, k := range opKeys() {
			s := summarize(m[k])
			if s.Count == 0 {
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t\n", k, tr, s.Count, us(s.P50), us(s.P90), us(s.P99), us(s.P999), us(s.Max))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out, "latencies over all runs of a transport (HDR histograms, 3 significant digits); acquire includes polling until ready;")
	fmt.Fprintln(out, "step = per-step metadata: delta (change log over the transport, applied to the engine's view) or walk (every block of that view)")

	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "capacity\ttransport\tdelta p50\tdelta p99\tchanges/step\twalk p50\twalk p99\tblocks at end\twalk/delta\t")
	for _, r := range rep.Runs {
		d, wk := summarize(r.Hists[stepOp]), summarize(r.Hists[walkOp])
		changes := 0
		for _, s := range r.Steps {
			changes += s.Changes
		}
		wr := "-"
		if wk.P50 > 0 && d.P50 > 0 {
			wr = fmt.Sprintf("%.1fx", float64(wk.P50)/float64(d.P50))
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%.0f\t%s\t%s\t%d\t%s\t\n", r.CapacityPages, r.Transport, us(d.P50), us(d.P99),
			float64(changes)/float64(max(len(r.Steps), 1)), us(wk.P50), us(wk.P99), r.ViewBlocks, wr)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out)
	harness.Verdicts(out, c.Log, false, c.Quiet, rep.Verdicts)
	return nil
}

func scaleNote(c *Config) string {
	if int64(c.PageBytes) == c.modelPageBytes() {
		return ""
	}
	return fmt.Sprintf(" (copies scaled 1/%.0f to fit this machine's /dev/shm and time; --page-bytes %d for real sizes)",
		float64(c.modelPageBytes())/float64(c.PageBytes), c.modelPageBytes())
}

// writeFiles writes the JSON Lines, CSV and PNG files into OutDir.
func (rep *Report) writeFiles() error {
	dir := rep.Config.OutDir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	write := func(name string, fn func(io.Writer) error) error {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		if err := fn(f); err != nil {
			f.Close()
			return fmt.Errorf("%s: %w", name, err)
		}
		if err := f.Close(); err != nil {
			return err
		}
		rep.Files = append(rep.Files, name)
		return nil
	}
	if err := write("replay.jsonl", func(w io.Writer) error {
		return harness.JSONLines(w, rep.Rows)
	}); err != nil {
		return err
	}
	for _, f := range []struct {
		name  string
		bench string
	}{{"capacity.csv", "replay"}, {"policies.csv", "replay_policy"}, {"ops.csv", "replay_op"}, {"sidecar.csv", "replay_sidecar"}} {
		if err := write(f.name, func(w io.Writer) error { return rep.writeCSV(w, f.bench) }); err != nil {
			return err
		}
	}
	if err := write("steps.csv", rep.writeStepsCSV); err != nil {
		return err
	}
	if err := write("verdicts.txt", func(w io.Writer) error {
		_, err := io.WriteString(w, strings.Join(rep.Verdicts, "\n")+"\n")
		return err
	}); err != nil {
		return err
	}
	for _, p := range []struct {
		name string
		fn   func(string) error
	}{{"hit-rate.png", rep.plotHitRate}, {"policies.png", rep.plotPolicies}, {"latency.png", rep.plotLatency}, {"step-cost.png", rep.plotStepCost}} {
		if rep.Config.Offline && p.name != "policies.png" {
			continue // no sidecar ran: only the policies have figures
		}
		if err := p.fn(filepath.Join(dir, p.name)); err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
		rep.Files = append(rep.Files, p.name)
	}
	return nil
}

// writeCSV writes the rows of one bench kind, with their JSON field names
// as the header.
func (rep *Report) writeCSV(w io.Writer, bench string) error {
	cw := csv.NewWriter(w)
	wrote := false
	for _, r := range rep.Rows {
		v := reflect.ValueOf(r)
		if v.Field(0).String() != bench {
			continue
		}
		t := v.Type()
		if !wrote {
			var header []string
			for i := 0; i < t.NumField(); i++ {
				header = append(header, strings.Split(t.Field(i).Tag.Get("json"), ",")[0])
			}
			if err := cw.Write(header); err != nil {
				return err
			}
			wrote = true
		}
		rec := make([]string, t.NumField())
		for i := range rec {
			switch f := v.Field(i); f.Kind() {
			case reflect.Float64:
				rec[i] = strconv.FormatFloat(f.Float(), 'g', -1, 64)
			case reflect.Pointer: // an optional figure: empty when absent
				if !f.IsNil() {
					rec[i] = fmt.Sprint(f.Elem().Interface())
				}
			default:
				rec[i] = fmt.Sprint(f.Interface())
			}
		}
		if err := cw.Write(rec); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

func (rep *Report) writeStepsCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	cw.Write([]string{"capacity_pages", "transport", "request", "at_s", "engine", "delta_ns", "walk_ns", "changes", "view_blocks"})
	for _, r := range rep.Runs {
		for _, s := range r.Steps {
			cw.Write([]string{strconv.Itoa(r.CapacityPages), r.Transport, strconv.Itoa(s.Request), strconv.FormatFloat(s.AtSec, 'f', 4, 64),
				strconv.Itoa(s.Engine), strconv.FormatInt(s.DeltaNs, 10), strconv.FormatInt(s.WalkNs, 10), strconv.Itoa(s.Changes), strconv.Itoa(s.Blocks)})
		}
	}
	cw.Flush()
	return cw.Error()
}

// printPolicies prints the policy comparison: per capacity of the sweep,
// the prefix-hit ratio of the live sidecar, the offline LRU, vLLM's ARC,
// the optimum's bound and the candidate MQP.
func (rep *Report) printPolicies(out io.Writer) error {
	var rows []PolicyRow
	for _, x := range rep.Rows {
		if r, ok := x.(PolicyRow); ok {
			rows = append(rows, r)
		}
	}
	if len(rows) == 0 {
		return nil
	}
	fmt.Fprintf(out, "\nprefix-hit ratio by policy (%s, %d-token pages, one request at a time for the offline ones):\n", rows[0].Workload, rows[0].PageTokens)
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "capacity\tlive sidecar\tLRU\tARC (vLLM)\toptimum (bound)\tfollowing MIN\tMQP\tMQP2\tlive/LRU\tMQP/LRU\tMQP2/LRU\tMQP2/ARC\tMQP2/optimum\t")
	for _, r := range rows {
		live, liveLRU := "-", "-"
		if r.Transport != "offline" {
			live, liveLRU = fmt.Sprintf("%.2f%%", 100*r.LiveHitRatio), fmt.Sprintf("%.3f", r.LiveOverLRU)
		}
		fmt.Fprintf(tw, "%d\t%s\t%.2f%%\t%.2f%%\t%.2f%%\t%.2f%%\t%.2f%%\t%.2f%%\t%s\t%.3f\t%.3f\t%.3f\t%.3f\t\n", r.CapacityPages, live, 100*r.LRUHitRatio,
			100*r.ARCHitRatio, 100*r.MINBlockHitRatio, 100*r.MINPrefixHitRatio, 100*r.MQPHitRatio, 100*r.MQP2HitRatio, liveLRU, r.MQPOverLRU,
			r.MQP2OverLRU, r.MQP2OverARC, r.MQP2OverMIN)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "optimum (bound): MIN's block-hit ratio, at least any policy's prefix-hit ratio; following MIN: the prefix hits of MIN's own decisions; MQP, MQP2: the cache's multi-queue policies, offline; never evicting: %.2f%%\n", 100*rep.Unbound)
	if len(rows[0].InformedHitRatio) == 0 {
		return nil
	}
	fmt.Fprintln(out, "\nwhat an online policy lacks: LRU told which pages are read again (a hot list before a cold one), beside the optimum:")
	tw = tabwriter.NewWriter(out, 2, 8, 2, ' ', tabwriter.AlignRight)
	head := "capacity\tLRU\t"
	for _, hz := range InformedHorizons {
		if hz == 0 {
			head += "told: read again ever\t"
		} else {
			head += fmt.Sprintf("within %d requests\t", hz)
		}
	}
	fmt.Fprintln(tw, head+"MQP2\toptimum (bound)\t")
	for _, r := range rows {
		line := fmt.Sprintf("%d\t%.2f%%\t", r.CapacityPages, 100*r.LRUHitRatio)
		for _, x := range r.InformedHitRatio {
			line += fmt.Sprintf("%.2f%%\t", 100*x)
		}
		fmt.Fprintln(tw, line+fmt.Sprintf("%.2f%%\t%.2f%%\t", 100*r.MQP2HitRatio, 100*r.MINBlockHitRatio))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return nil
}

// printNodeTier is --node-tier's table: each split of a capacity beside
// the pods' own pools of the same pages.
func (rep *Report) printNodeTier(out io.Writer) error {
	c := &rep.Config
	fmt.Fprintf(out, "\nnode tier: %d pods, the capacity their pages in all (node-tier slots take %d bytes more each for the value's header)\n", c.Engines, 4096)
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "capacity\tGiB equiv\tpod pools\tnode tier\thit ratio\tmodel\tx pods' own\tfrom node tier\tmodel\tnode stored\tmodel\tnode evicted\tmodel\tpods' no space\tnode CPU\t")
	for _, r := range rep.Runs {
		if r.Transport != "ring" && !nodeTiered(r.Transport) {
			continue
		}
		var base float64
		for _, b := range rep.runsOf("ring") {
			if b.CapacityPages == r.CapacityPages {
				base = ratio(b.Counts.HitPages, b.Counts.TotalPages)
			}
		}
		hr := ratio(r.Counts.HitPages, r.Counts.TotalPages)
		node, ostored, oevicted, stored, evicted, cpu := "-", "-", "-", "-", "-", "-"
		if r.NodeTierPages > 0 {
			node = strconv.Itoa(r.NodeTierPages)
		}
		if f := r.Fleet; f != nil && f.TierCapacity > 0 {
			ostored, oevicted = strconv.FormatInt(f.TierStored, 10), strconv.FormatInt(f.TierEvictions, 10)
		}
		if st := r.NodeTier; st != nil {
			stored, evicted = strconv.FormatInt(st.PutStored, 10), strconv.FormatInt(st.Evicted, 10)
		}
		if u := r.NodeTierUsage; u != nil {
			cpu = fmt.Sprintf("%.1f s", u.CPU.Seconds())
		}
		var ofetched int64
		if r.Fleet != nil {
			ofetched = r.Fleet.FetchedPages
		}
		fmt.Fprintf(tw, "%d\t%s\t%d x %d\t%s\t%.4f\t%.4f\t%.3f\t%d\t%d\t%s\t%s\t%s\t%s\t%d\t%s\t\n",
			r.CapacityPages, c.gibLabel(r.CapacityPages), c.Engines, r.PodPages, node, hr, r.Oracle.HitRatio(), hr/max(base, 1e-12),
			r.FetchedPages, ofetched, stored, ostored, evicted, oevicted, r.Counts.SkippedPages, cpu)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out, "hit ratio: prefix pages served from the pod's pool or the node tier; x pods' own: over the run whose pods keep capacity/pods each and no node tier")
	return nil
}
