// Package deltabench measures the cache's metadata cost per engine step:
// how much a consumer (a router) pays to keep its view of the cache in
// sync, by reading the delta log (ChangesSince) versus walking the whole
// index (Snapshot), with 10 thousand to 10 million cached blocks, and what
// the cache's metadata costs in memory per block.
//
// It runs in process against cache.Cache: no rings, no sidecar; the cost
// measured is the state machine's alone.
package deltabench

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// DefaultSizes are the cached-block counts of a default run.
var DefaultSizes = []int{10_000, 100_000, 1_000_000, 10_000_000}

// Config configures a run. Zero fields take defaults.
type Config struct {
	Sizes         []int         // cached blocks per row (default DefaultSizes)
	Steps         int           // timed steps per method and size (default 1000)
	Warmup        int           // untimed steps before each method (default 50)
	StoresPerStep int           // new blocks stored per step (default 32)
	WalkBudget    time.Duration // stop timing walks after this long once 11 steps are in (default 3s)
	Seed          uint64        // digest generator seed (default 1)
	Policy        string        // the cache's eviction policy, lru or mqp (default: serve's, cache.DefaultPolicy)
	JSON          bool          // JSON Lines on Out; the reading goes to Log
	Quiet         bool          // no progress lines
	Out, Log      io.Writer
}

// Row is one result line.
type Row struct {
	Bench          string  `json:"bench"`                      // "delta" or "memory"
	Policy         string  `json:"policy"`                     // the cache's eviction policy
	Method         string  `json:"method,omitempty"`           // "delta" or "walk"
	CachedBlocks   int     `json:"cached_blocks"`              // present blocks when the steps start
	StepNs         int64   `json:"step_ns,omitempty"`          // median consumer cost per step
	ChangesPerStep float64 `json:"changes_per_step,omitempty"` // entries (delta) or digests (walk) read per step
	MinStepNs      int64   `json:"min_step_ns,omitempty"`      // fastest step
	StoreNs        int64   `json:"store_ns,omitempty"`         // median engine-side cost of a step's stores (both methods pay it)
	Steps          int     `json:"steps,omitempty"`            // timed steps

	BytesPerBlock      float64 `json:"bytes_per_block,omitempty"`       // max of the two below
	ModelBytesPerBlock float64 `json:"model_bytes_per_block,omitempty"` // MemoryBytes / cached blocks
	HeapBytesPerBlock  float64 `json:"heap_bytes_per_block,omitempty"`  // heap growth while building / cached blocks
	Capacity           int     `json:"capacity,omitempty"`              // slots of the cache
	// memory_described: what a block's description for KV events adds
	// (sidecar/cache/meta.go), DescTokens token ids and a parent digest each.
	DescTokens    int     `json:"desc_tokens,omitempty"`
	DescCostBytes float64 `json:"desc_cost_bytes,omitempty"` // what the metadata bounds count (cache.DescCost)
}

// describedBlocks bounds the cache the memory_described row describes
// (its heap figure needs no more).
const describedBlocks = 1_000_000

// describedMemory fills a cache of n blocks, describes every one of them
// as the vLLM connector does (16 token ids and the parent's digest), and
// reports the heap that the descriptions add per block.
func describedMemory(n int, cfg *Config) (Row, error) {
	m, err := build(n, cfg)
	if err != nil {
		return Row{}, err
	}
	const tokens = 16
	tk := make([]byte, 4*tokens)
	var parent [32]byte
	ds := make([][32]byte, 0, n)
	m.c.Snapshot(m.ns, func(d []byte) bool { ds = append(ds, [32]byte(d)); return true })
	before := heapAlloc()
	for i := range ds {
		if _, err := m.c.Describe(m.ns, parent[:], ds[i][:], tk, tokens, nil, 1, owner, m.now); err != nil {
			return Row{}, err
		}
		parent = ds[i]
	}
	after := heapAlloc()
	if a, _ := m.c.Descriptions(); a != n {
		return Row{}, fmt.Errorf("described %d of %d blocks", a, n)
	}
	heap := 0.0
	if after > before {
		heap = float64(after-before) / float64(n)
	}
	runtime.KeepAlive(ds)
	return Row{Bench: "memory_described", CachedBlocks: n, HeapBytesPerBlock: heap, DescTokens: tokens,
		DescCostBytes: float64(m.c.DescBytes()) / float64(n), Capacity: m.c.Capacity()}, nil
}

func (c *Config) defaults() error {
	if len(c.Sizes) == 0 {
		c.Sizes = DefaultSizes
	}
	for _, n := range c.Sizes {
		if n < 1000 || n > cache.MaxCapacity/2 {
			return fmt.Errorf("size %d: want 1000..%d blocks", n, cache.MaxCapacity/2)
		}
	}
	if c.Steps <= 0 {
		c.Steps = 1000
	}
	if c.Warmup < 0 {
		return errors.New("negative warmup")
	}
	if c.Warmup == 0 {
		c.Warmup = 50
	}
	if c.StoresPerStep <= 0 {
		c.StoresPerStep = 32
	}
	if c.WalkBudget <= 0 {
		c.WalkBudget = 3 * time.Second
	}
	if c.Seed == 0 {
		c.Seed = 1
	}
	if c.Policy == "" {
		c.Policy = cache.DefaultPolicy.String()
	}
	if _, err := cache.ParsePolicy(c.Policy); err != nil {
		return err
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return nil
}

// model is one filled cache and its workload.
type model struct {
	c      *cache.Cache
	ns     cache.NamespaceID
	rng    *rand.ChaCha8
	digest [32]byte
	now    int64
	cur    cache.Cursor
	buf    []cache.Change
	stores int
}

const owner cache.SessionID = 1

// capacityFor leaves a little room over n (0.1%, at least 8 steps' worth):
// the fill never evicts; Run then uses up the room before timing, so the
// timed steps run on a full cache of n..capacity blocks that evicts as
// much as it stores.
func capacityFor(n, perStep int) int { return n + max(n/1000, 8*perStep) }

func build(n int, cfg *Config) (*model, error) {
	pol, err := cache.ParsePolicy(cfg.Policy)
	if err != nil {
		return nil, err
	}
	c, err := cache.New(cache.Config{Capacity: capacityFor(n, cfg.StoresPerStep), Epoch: 0x5eed, Policy: pol})
	if err != nil {
		return nil, err
	}
	ns, err := c.AddNamespace(cache.NamespaceKey{Model: "deltabench", Layout: 1, DigestWidth: 32, WorldSize: 1})
	if err != nil {
		return nil, err
	}
	var seed [32]byte
	seed[0] = byte(cfg.Seed)
	seed[1] = byte(cfg.Seed >> 8)
	seed[2] = byte(n)
	m := &model{c: c, ns: ns, rng: rand.NewChaCha8(seed), stores: cfg.StoresPerStep, buf: make([]cache.Change, 0, 4*cfg.StoresPerStep)}
	for i := 0; i < n; i++ {
		if err := m.store(); err != nil {
			return nil, fmt.Errorf("fill block %d: %w", i, err)
		}
	}
	if got := c.Len(ns); got != n {
		return nil, fmt.Errorf("filled %d blocks, cache holds %d", n, got)
	}
	return m, nil
}

// store stores one new block with a random digest.
func (m *model) store() error {
	m.rng.Read(m.digest[:])
	m.now++
	t, st, err := m.c.BeginStore(m.ns, 0, m.digest[:], owner, m.now)
	if err != nil {
		return err
	}
	if st != cache.Allocated {
		return fmt.Errorf("BeginStore: %v", st)
	}
	return m.c.CommitStore(t)
}

// stepStores is the engine side of one step.
func (m *model) stepStores() error {
	for i := 0; i < m.stores; i++ {
		if err := m.store(); err != nil {
			return err
		}
	}
	return nil
}

// readDelta is the consumer side of a step, method "delta".
func (m *model) readDelta() (int, error) {
	var err error
	m.buf, m.cur, err = m.c.ChangesSince(m.ns, m.cur, -1, m.buf)
	return len(m.buf), err
}

// readWalk is the consumer side of a step, method "walk".
func (m *model) readWalk() (int, error) {
	n := 0
	var x byte
	cur, err := m.c.Snapshot(m.ns, func(d []byte) bool {
		n++
		x ^= d[0]
		return true
	})
	runtime.KeepAlive(x)
	m.cur = cur
	return n, err
}

// measure runs warm-up and timed steps of one method.
func (m *model) measure(method string, cfg *Config) (Row, error) {
	read := m.readDelta
	steps, budget := cfg.Steps, time.Duration(0)
	if method == "walk" {
		read, budget = m.readWalk, cfg.WalkBudget
	}
	head, err := m.c.Head(m.ns)
	if err != nil {
		return Row{}, err
	}
	m.cur = head
	warm := cfg.Warmup
	if method == "walk" {
		warm = min(warm, 3)
	}
	for i := 0; i < warm; i++ {
		if err := m.stepStores(); err != nil {
			return Row{}, err
		}
		if _, err := read(); err != nil {
			return Row{}, err
		}
	}
	readNs := make([]int64, 0, steps)
	storeNs := make([]int64, 0, steps)
	changes := 0
	start := time.Now()
	for i := 0; i < steps; i++ {
		t0 := time.Now()
		if err := m.stepStores(); err != nil {
			return Row{}, err
		}
		t1 := time.Now()
		n, err := read()
		t2 := time.Now()
		if err != nil {
			return Row{}, fmt.Errorf("%s step %d: %w", method, i, err)
		}
		changes += n
		storeNs = append(storeNs, int64(t1.Sub(t0)))
		readNs = append(readNs, int64(t2.Sub(t1)))
		if budget > 0 && i >= 10 && time.Since(start) > budget {
			break
		}
	}
	r := Row{
		Bench: "delta", Method: method, CachedBlocks: m.c.Len(m.ns),
		StepNs: harness.Median(readNs), MinStepNs: slices.Min(readNs), StoreNs: harness.Median(storeNs),
		ChangesPerStep: float64(changes) / float64(len(readNs)), Steps: len(readNs),
	}
	return r, nil
}

func heapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// Run measures every size and prints the rows.
func Run(cfg Config) ([]Row, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	sizes := slices.Clone(cfg.Sizes)
	slices.Sort(sizes)
	sizes = slices.Compact(sizes)
	var rows []Row
	for _, n := range sizes {
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Log, "delta: filling a cache with %d blocks (eviction policy %s)...\n", n, cfg.Policy)
		}
		before := heapAlloc()
		m, err := build(n, &cfg)
		if err != nil {
			return rows, err
		}
		after := heapAlloc()
		// Use up the headroom, so that every timed step both stores and
		// evicts (the steady state of a full cache) at every size.
		for m.c.Stats().Free > 0 {
			if err := m.stepStores(); err != nil {
				return rows, err
			}
		}
		var mem Row
		if n == sizes[len(sizes)-1] {
			model := float64(m.c.MemoryBytes()) / float64(n)
			heap := 0.0
			if after > before {
				heap = float64(after-before) / float64(n)
			}
			mem = Row{Bench: "memory", CachedBlocks: n, ModelBytesPerBlock: model, HeapBytesPerBlock: heap,
				BytesPerBlock: max(model, heap), Capacity: m.c.Capacity()}
		}
		for _, method := range []string{"delta", "walk"} {
			r, err := m.measure(method, &cfg)
			if err != nil {
				return rows, err
			}
			r.CachedBlocks = n
			rows = append(rows, r)
			if !cfg.Quiet {
				fmt.Fprintf(cfg.Log, "delta: %d blocks, %s: %s per step (%d steps)\n", n, method, dur(r.StepNs), r.Steps)
			}
		}
		if mem.Bench != "" {
			rows = append(rows, mem)
		}
		runtime.KeepAlive(m)
		m = nil
	}
	n := min(sizes[len(sizes)-1], describedBlocks)
	if !cfg.Quiet {
		fmt.Fprintf(cfg.Log, "delta: describing %d blocks (KV events)...\n", n)
	}
	d, err := describedMemory(n, &cfg)
	if err != nil {
		return rows, err
	}
	rows = append(rows, d)
	for i := range rows {
		rows[i].Policy = cfg.Policy
	}
	return rows, print(cfg, rows)
}

func dur(ns int64) string {
	switch {
	case ns >= 1e6:
		return fmt.Sprintf("%.2f ms", float64(ns)/1e6)
	case ns >= 1e3:
		return fmt.Sprintf("%.2f us", float64(ns)/1e3)
	}
	return fmt.Sprintf("%d ns", ns)
}

func print(cfg Config, rows []Row) error {
	verdicts := Verdicts(rows)
	if cfg.JSON {
		if err := harness.JSONLines(cfg.Out, rows); err != nil {
			return err
		}
		harness.Verdicts(cfg.Out, cfg.Log, true, cfg.Quiet, verdicts)
		return nil
	}
	w := tabwriter.NewWriter(cfg.Out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "cached blocks\tmethod\tstep (median)\tfastest step\tchanges/step\tstores/step (both)\twalk/delta\t")
	byKey := map[string]Row{}
	for _, r := range rows {
		byKey[fmt.Sprint(r.Method, r.CachedBlocks)] = r
	}
	for _, r := range rows {
		if r.Bench != "delta" {
			continue
		}
		ratio := ""
		if r.Method == "walk" {
			if d, ok := byKey[fmt.Sprint("delta", r.CachedBlocks)]; ok && d.StepNs > 0 {
				ratio = fmt.Sprintf("%.0fx", float64(r.StepNs)/float64(d.StepNs))
			}
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%.0f\t%s\t%s\t\n", r.CachedBlocks, r.Method, dur(r.StepNs), dur(r.MinStepNs), r.ChangesPerStep, dur(r.StoreNs), ratio)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, r := range rows {
		if r.Bench == "memory" {
			fmt.Fprintf(cfg.Out, "\nmemory: %d cached blocks (capacity %d): %.2f bytes/block (model %.2f = MemoryBytes/blocks, heap growth %.2f)\n",
				r.CachedBlocks, r.Capacity, r.BytesPerBlock, r.ModelBytesPerBlock, r.HeapBytesPerBlock)
		}
		if r.Bench == "memory_described" {
			fmt.Fprintf(cfg.Out, "memory of a block's description (KV events: %d token ids, a parent digest): +%.2f bytes/block by heap growth at %d blocks (the metadata bounds count %.0f)\n",
				r.DescTokens, r.HeapBytesPerBlock, r.CachedBlocks, r.DescCostBytes)
		}
	}
	fmt.Fprintln(cfg.Out)
	harness.Verdicts(cfg.Out, cfg.Log, false, cfg.Quiet, verdicts)
	return nil
}

// Verdicts reads the rows against the targets (targets.go); it reports,
// never fails.
func Verdicts(rows []Row) []string {
	var out []string
	var delta []Row
	walk := map[int]Row{}
	for _, r := range rows {
		switch {
		case r.Bench == "delta" && r.Method == "delta":
			delta = append(delta, r)
		case r.Bench == "delta" && r.Method == "walk":
			walk[r.CachedBlocks] = r
		}
	}
	if len(delta) >= 2 {
		lo, hi := delta[0], delta[len(delta)-1]
		ratio := float64(hi.StepNs) / float64(lo.StepNs)
		t := targetDeltaFlat.At(fmt.Sprintf("%d vs %d blocks", hi.CachedBlocks, lo.CachedBlocks))
		out = append(out, t.Verdict(ratio, fmt.Sprintf("%s vs %s, %.2fx", dur(hi.StepNs), dur(lo.StepNs), ratio)))
	}
	for _, d := range delta {
		if w, ok := walk[d.CachedBlocks]; ok && d.StepNs > 0 {
			out = append(out, fmt.Sprintf("walk/delta at %d blocks: %.0fx", d.CachedBlocks, float64(w.StepNs)/float64(d.StepNs)))
		}
	}
	for _, r := range rows {
		if r.Bench == "memory" {
			t := targetMemory.At(fmt.Sprintf("%d blocks", r.CachedBlocks))
			out = append(out, t.Verdict(r.BytesPerBlock, fmt.Sprintf("%.2f", r.BytesPerBlock)))
		}
	}
	return out
}

// ParseSizes parses "10k,100k,1M,10M" (k = 1000, M = 1e6) into counts.
func ParseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		mult := 1
		switch {
		case strings.HasSuffix(f, "k"), strings.HasSuffix(f, "K"):
			mult, f = 1000, f[:len(f)-1]
		case strings.HasSuffix(f, "M"), strings.HasSuffix(f, "m"):
			mult, f = 1_000_000, f[:len(f)-1]
		}
		v, err := strconv.Atoi(f)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("size %q: want a count like 10k, 1M or 250000", f)
		}
		out = append(out, v*mult)
	}
	if len(out) == 0 {
		return nil, errors.New("no sizes")
	}
	return out, nil
}
