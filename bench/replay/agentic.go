package replay

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// RequestMeta is what a generated workload knows of a request beyond its
// prompt; a trace knows none of it (Session -1). The policies do not read
// it yet: it is data for session-aware retention.
type RequestMeta struct {
	Session    int     // session id, -1 when unknown (traces)
	Tenant     int     // tenant id (generated workloads)
	Turn       int     // turn within the session, from 0
	SessionEnd bool    // the session's last turn: its prefix is not read again by it
	RetainSec  float64 // retention hint: keep this request's prefix this many seconds (0: no hint)
	Priority   int     // retention priority hint: -1 one-off (scan), 0 normal, 1 expected back
}

// AgenticConfig are the parameters of the generated agentic workload
// (`--workload agentic`); the zero value of a field takes its default
// (DefaultAgentic). Token counts are drawn uniformly in [lo, hi].
type AgenticConfig struct {
	Seed         uint64  // random seed (1)
	Sessions     int     // agent sessions (1200)
	Tenants      int     // tenants; each has one system prompt its sessions share (8)
	SystemTokens int     // a tenant's system prompt and tool definitions (3072 tokens: 6 blocks)
	TaskTokens   [2]int  // the user's task, the first turn's new text ([200, 1500])
	Turns        [2]int  // turns per session ([2, 16])
	ToolTokens   [2]int  // a tool result appended by a turn ([100, 4000])
	TextTokens   [2]int  // the model's tool call and new text appended by a turn ([20, 400])
	ForkProb     float64 // a session starts from an earlier session's history (0.2)
	ForkWindow   int     // ... one of the last this many sessions of its tenant (20)
	SessionRate  float64 // sessions starting per second, Poisson (0.5)
	ShortGapSec  float64 // mean idle gap before a turn after a tool call, exponential (15 s)
	LongGapProb  float64 // a gap is long instead (a person, a slow job) (0.25)
	LongGapSec   float64 // mean long gap, exponential (600 s)
	HintProb     float64 // a non-final turn carries a retention hint (0.5)
	ScanRequests int     // one-off requests of the scan tenant, no reuse (2000)
	ScanTokens   [2]int  // a scan request's prompt ([1024, 8192])
	ScanAt       float64 // the scan starts at this fraction of the sessions' arrival span (0.4)
	ScanRate     float64 // scan requests per second (10)
}

// DefaultAgentic are the defaults of AgenticConfig.
var DefaultAgentic = AgenticConfig{
	Seed: 1, Sessions: 1200, Tenants: 8, SystemTokens: 3072, TaskTokens: [2]int{200, 1500},
	Turns: [2]int{2, 16}, ToolTokens: [2]int{100, 4000}, TextTokens: [2]int{20, 400},
	ForkProb: 0.2, ForkWindow: 20, SessionRate: 0.5, ShortGapSec: 15, LongGapProb: 0.25, LongGapSec: 600,
	HintProb: 0.5, ScanRequests: 2000, ScanTokens: [2]int{1024, 8192}, ScanAt: 0.4, ScanRate: 10,
}

// ScanHeavy is the agentic workload with a scan three times as long, of
// longer one-off prompts (`--workload agentic-scan`): 6,000 requests of
// 2,048 to 16,384 tokens at 20 a second from 40% of the sessions' span,
// about half the workload's pages, none read twice. Where the default's
// scan is one tenant among eight, this one is a batch job beside them.
var ScanHeavy = AgenticConfig{ScanRequests: 6000, ScanRate: 20, ScanTokens: [2]int{2048, 16384}}

func (c *AgenticConfig) defaults() {
	d := DefaultAgentic
	setI := func(v *int, dv int) {
		if *v == 0 {
			*v = dv
		}
	}
	setF := func(v *float64, dv float64) {
		if *v == 0 {
			*v = dv
		}
	}
	setR := func(v *[2]int, dv [2]int) {
		if *v == ([2]int{}) {
			*v = dv
		}
	}
	if c.Seed == 0 {
		c.Seed = d.Seed
	}
	setI(&c.Sessions, d.Sessions)
	setI(&c.Tenants, d.Tenants)
	setI(&c.SystemTokens, d.SystemTokens)
	setR(&c.TaskTokens, d.TaskTokens)
	setR(&c.Turns, d.Turns)
	setR(&c.ToolTokens, d.ToolTokens)
	setR(&c.TextTokens, d.TextTokens)
	setF(&c.ForkProb, d.ForkProb)
	setI(&c.ForkWindow, d.ForkWindow)
	setF(&c.SessionRate, d.SessionRate)
	setF(&c.ShortGapSec, d.ShortGapSec)
	setF(&c.LongGapProb, d.LongGapProb)
	setF(&c.LongGapSec, d.LongGapSec)
	setF(&c.HintProb, d.HintProb)
	setI(&c.ScanRequests, d.ScanRequests)
	setR(&c.ScanTokens, d.ScanTokens)
	setF(&c.ScanAt, d.ScanAt)
	setF(&c.ScanRate, d.ScanRate)
}

// String names the workload and its seed.
func (c AgenticConfig) String() string {
	if c.ScanRequests == ScanHeavy.ScanRequests && c.ScanRate == ScanHeavy.ScanRate && c.ScanTokens == ScanHeavy.ScanTokens {
		return fmt.Sprintf("agentic-scan (generated, seed %d)", c.Seed)
	}
	return fmt.Sprintf("agentic (generated, seed %d)", c.Seed)
}

// genBlockTokens is the generator's block size: ids name 512-token blocks
// as the Mooncake trace's do.
const genBlockTokens = 512

// Agentic generates the agentic workload in the trace's raw form (block
// ids naming whole prefixes, timestamps in ms), sorted by arrival.
//
// A session belongs to a tenant; its first prompt is the tenant's system
// prompt and a task (or, with ForkProb, the history of one of the tenant's
// last ForkWindow sessions as of one of its turns already sent, and a new
// task: a branch); each later turn extends the previous prompt by a tool
// result and new text, after an idle gap (short, or long with
// LongGapProb). Sessions start as a Poisson process, so hundreds are open
// at once and a session's turns lie far apart in the request order. The
// scan tenant (id Tenants) sends ScanRequests unique prompts at ScanRate
// from ScanAt of the sessions' span. A block id is new whenever the
// block's content is (a partial last block changes when a turn fills it).
func Agentic(c AgenticConfig) []rawRequest {
	c.defaults()
	rng := rand.New(rand.NewPCG(c.Seed, 0x61676e74))
	uni := func(r [2]int) int { return r[0] + rng.IntN(max(r[1]-r[0]+1, 1)) }
	nextID := uint64(0)
	newID := func() uint64 { nextID++; return nextID }
	// extend appends tokens to a prompt of l tokens with block ids ids
	// (the last one partial when l%512 != 0).
	extend := func(ids []uint64, l, tokens int) ([]uint64, int) {
		full := l / genBlockTokens
		ids = slices.Clone(ids[:full])
		l += tokens
		for len(ids) < (l+genBlockTokens-1)/genBlockTokens {
			ids = append(ids, newID())
		}
		return ids, l
	}
	system := make([][]uint64, c.Tenants)
	for t := range system {
		system[t], _ = extend(nil, 0, c.SystemTokens)
	}
	type turn struct {
		at  float64
		ids []uint64
		l   int
	}
	var out []rawRequest
	emit := func(at float64, ids []uint64, l int, m RequestMeta) {
		ts := int64(math.Round(at * 1000))
		out = append(out, rawRequest{Timestamp: &ts, InputLength: &l, OutputLength: uni(c.TextTokens), HashIDs: ids, meta: m})
	}
	history := make([][]turn, c.Sessions)
	byTenant := make([][]int, c.Tenants)
	gap := func() (float64, float64) { // the gap and the hint for it
		if rng.Float64() < c.LongGapProb {
			return rng.ExpFloat64() * c.LongGapSec, 2 * c.LongGapSec
		}
		return rng.ExpFloat64() * c.ShortGapSec, 2 * c.ShortGapSec
	}
	t := 0.0
	for s := 0; s < c.Sessions; s++ {
		t += rng.ExpFloat64() / c.SessionRate
		tenant := rng.IntN(c.Tenants)
		ids, l := system[tenant], c.SystemTokens
		if rng.Float64() < c.ForkProb {
			recent := byTenant[tenant][max(0, len(byTenant[tenant])-c.ForkWindow):]
			var choices []turn
			for _, p := range recent {
				for _, h := range history[p] {
					if h.at <= t {
						choices = append(choices, h)
					}
				}
			}
			if len(choices) > 0 {
				h := choices[rng.IntN(len(choices))]
				ids, l = h.ids, h.l
			}
		}
		ids, l = extend(ids, l, uni(c.TaskTokens))
		turns := uni(c.Turns)
		at := t
		for k := 0; k < turns; k++ {
			m := RequestMeta{Session: s, Tenant: tenant, Turn: k, SessionEnd: k == turns-1}
			g, hint := gap()
			if !m.SessionEnd && rng.Float64() < c.HintProb {
				m.RetainSec, m.Priority = hint, 1
			}
			emit(at, ids, l, m)
			history[s] = append(history[s], turn{at, ids, l})
			at += g
			ids, l = extend(ids, l, uni(c.ToolTokens)+uni(c.TextTokens))
		}
		byTenant[tenant] = append(byTenant[tenant], s)
	}
	at := c.ScanAt * t
	for i := 0; i < c.ScanRequests; i++ {
		ids, l := extend(nil, 0, uni(c.ScanTokens))
		emit(at, ids, l, RequestMeta{Session: c.Sessions + i, Tenant: c.Tenants, SessionEnd: true, Priority: -1})
		at += rng.ExpFloat64() / c.ScanRate
	}
	slices.SortStableFunc(out, func(a, b rawRequest) int { return int(*a.Timestamp - *b.Timestamp) })
	return out
}
