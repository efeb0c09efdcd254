// Package copybench is `ringside-bench copy`: copy-engine bandwidth between
// the pinned pool and engine memory held by a second process (a gputest
// peer), for the host backend (process_vm_readv/writev) or the CUDA backend
// (CUDA IPC, cuMemcpyBatchAsync), per page size, page count, direction and
// submission mode, against a ceiling: one plain copy of the same bytes.
package copybench

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/cuda"
	"github.com/ringside-kv/ringside/gpu/gputest"
	"github.com/ringside-kv/ringside/gpu/host"
)

// Config of a run. Zero fields take the defaults.
type Config struct {
	Backend   string   // "host" (default) or "cuda"
	PageBytes []uint64 // default 16 KiB, 64 KiB, 256 KiB, 2 MiB
	Pages     []int    // default 1, 4, 16, 64, 256, 1024, 4096
	// MaxBytes skips rows whose op moves more (default 1 GiB for host,
	// 8 GiB for cuda); the pools and the peer's buffer are this large.
	MaxBytes uint64
	MinTime  time.Duration // timed duration per row (default 40ms)
	PeerArgv []string      // command that runs gputest.PeerMain
	JSON     bool
	JSONOut  io.Writer // also write every row here as JSON Lines
	Quiet    bool
	Out, Log io.Writer
}

// Row is one measurement (one JSON Lines object).
type Row struct {
	Bench     string  `json:"bench"`
	Backend   string  `json:"backend"`
	Direction string  `json:"direction"` // "h2d": pool to engine (load); "d2h": engine to pool (store)
	PageBytes uint64  `json:"page_bytes"`
	Pages     int     `json:"pages"`
	Mode      string  `json:"mode"` // "batched", "per_range" or "ceiling"
	GBps      float64 `json:"gbps"`
	Bytes     uint64  `json:"bytes"`   // per op
	MeanUS    float64 `json:"mean_us"` // per op, submit to completion
	Reps      int     `json:"reps"`
	Ranges    int     `json:"ranges"` // per op, after merging
	Calls     int     `json:"calls"`  // driver or system calls per op
	Device    string  `json:"device,omitempty"`
	// "ok", "skipped", or "not_batched": a batched row whose ops were not
	// one cuMemcpyBatchAsync call per 8192 ranges (the driver rejected a
	// batch and the engine switched to per-range copies; Reason says why).
	Status string `json:"status"`
	Reason string `json:"reason,omitempty"`
}

var (
	defaultPageBytes = []uint64{16 << 10, 64 << 10, 256 << 10, 2 << 20}
	defaultPages     = []int{1, 4, 16, 64, 256, 1024, 4096}
)

type engineSet struct {
	batched, perRange gpu.Engine // the same engine for cuda
	cuda              *cuda.Engine
	poolB, poolP      []byte // host: one pool per engine; cuda: poolB only
	regB, regP        map[uint64]gpu.Handle
}

// Run measures every row and prints them (a table, or JSON Lines).
func Run(cfg Config) ([]Row, error) {
	if cfg.Backend == "" {
		cfg.Backend = "host"
	}
	if cfg.Backend != "host" && cfg.Backend != "cuda" {
		return nil, fmt.Errorf("--backend %q: want host or cuda", cfg.Backend)
	}
	if len(cfg.PageBytes) == 0 {
		cfg.PageBytes = defaultPageBytes
	}
	if len(cfg.Pages) == 0 {
		cfg.Pages = defaultPages
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = 1 << 30
		if cfg.Backend == "cuda" {
			cfg.MaxBytes = 8 << 30
		}
	}
	if cfg.MinTime <= 0 {
		cfg.MinTime = 40 * time.Millisecond
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	logf := func(format string, args ...any) {
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Log, format+"\n", args...)
		}
	}
	// The buffers only need to hold the largest row that runs.
	var need uint64
	for _, pb := range cfg.PageBytes {
		for _, n := range cfg.Pages {
			if b := pb * uint64(n); b <= cfg.MaxBytes {
				need = max(need, b)
			}
		}
	}
	if need == 0 {
		return nil, fmt.Errorf("every row exceeds --max-bytes %d", cfg.MaxBytes)
	}
	if len(cfg.PeerArgv) == 0 {
		return nil, errors.New("copybench: no peer command")
	}
	peer, err := gputest.StartPeer(cfg.Backend, cfg.PeerArgv)
	if err != nil {
		return nil, err
	}
	defer peer.Close()
	exp, err := peer.Alloc(need, 0)
	if err != nil {
		return nil, fmt.Errorf("peer: allocating %d bytes: %w", need, err)
	}
	defer peer.Free(exp.ID)

	es := &engineSet{regB: map[uint64]gpu.Handle{}, regP: map[uint64]gpu.Handle{}}
	if es.poolB, err = gputest.MapAnon(int(need)); err != nil {
		return nil, err
	}
	defer gputest.UnmapAnon(es.poolB)
	if cfg.Backend == "host" {
		if es.poolP, err = gputest.MapAnon(int(need)); err != nil {
			return nil, err
		}
		defer gputest.UnmapAnon(es.poolP)
	}
	// Touch the pools so that first-touch faults stay out of the rows.
	for _, p := range [][]byte{es.poolB, es.poolP} {
		for i := 0; i < len(p); i += 4096 {
			p[i] = 1
		}
	}
	device := ""
	batchReason := ""
	switch cfg.Backend {
	case "host":
		if es.batched, err = host.New(es.poolB, host.Options{Workers: 1}); err != nil {
			return nil, err
		}
		if es.perRange, err = host.New(es.poolP, host.Options{Workers: 1, PerRange: true}); err != nil {
			return nil, err
		}
	case "cuda":
		// The pool is pinned at the first registration (no context before):
		// its figures are logged then.
		c, err := cuda.New(es.poolB, cuda.Options{Copy: cuda.CopyPerRange, OnPinned: func(p cuda.PinInfo, err error) {
			logf("pinned %d bytes in %d chunk(s) in %v (err %v)", p.Bytes, p.Chunks, p.Took.Round(time.Millisecond), err)
		}})
		if err != nil {
			return nil, err
		}
		in := c.Info()
		logf("CUDA driver %d, %d GPU(s)", in.Driver, len(in.Devices))
		es.cuda, es.perRange, es.regP = c, c, es.regB
		if err := c.SetCopyMode(cuda.CopyBatched); err != nil {
			batchReason = err.Error()
			logf("batched rows skipped: %v", err)
		} else {
			es.batched = c
		}
		for _, d := range in.Devices {
			if d.UUID == cudaUUID(exp.IPC.GPU).String() {
				device = d.Name
			}
		}
	}
	defer func() {
		if es.batched != nil && es.batched != es.perRange {
			es.batched.Close()
		}
		es.perRange.Close()
	}()
	if device == "" {
		device = exp.Info
	}
	logf("ringside bench copy: backend %s, engine memory in peer pid %d (%s), %d bytes; at least %v per row",
		cfg.Backend, exp.PID, orDefault(device, "host memory"), need, cfg.MinTime)

	var rows []Row
	for _, dir := range []gpu.Direction{gpu.PoolToEngine, gpu.EngineToPool} {
		for _, pb := range cfg.PageBytes {
			for _, n := range cfg.Pages {
				for _, mode := range []string{"batched", "per_range", "ceiling"} {
					row := Row{Bench: "copy", Backend: cfg.Backend, Direction: dirName(dir), PageBytes: pb, Pages: n,
						Mode: mode, Bytes: pb * uint64(n), Device: device, Status: "ok"}
					switch {
					case row.Bytes > cfg.MaxBytes:
						row.Status, row.Reason = "skipped", fmt.Sprintf("op of %d bytes > --max-bytes", row.Bytes)
					case mode == "batched" && es.batched == nil:
						row.Status, row.Reason = "skipped", batchReason
					case mode == "batched" && es.cuda != nil && es.cuda.BatchDisabled() != nil:
						row.Status, row.Reason = "skipped", es.cuda.BatchDisabled().Error()
					default:
						if err := measure(&row, cfg, es, exp, dir); err != nil {
							return rows, fmt.Errorf("%s %s %d x %d: %w", row.Direction, mode, n, pb, err)
						}
						if mode == "batched" && es.cuda != nil {
							checkBatched(&row, es.cuda, logf)
						}
					}
					rows = append(rows, row)
					b, _ := json.Marshal(row)
					if cfg.JSON {
						fmt.Fprintf(cfg.Out, "%s\n", b)
					}
					if cfg.JSONOut != nil {
						fmt.Fprintf(cfg.JSONOut, "%s\n", b)
					}
				}
			}
		}
	}
	if !cfg.JSON {
		PrintTable(cfg.Out, rows)
	}
	harness.Verdicts(cfg.Out, cfg.Log, cfg.JSON, cfg.Quiet, Verdicts(rows))
	return rows, nil
}

// checkBatched marks a batched CUDA row whose ops were not batched: the
// engine switched to per-range copies during the row, or an op took more
// calls than one cuMemcpyBatchAsync per cuda.MaxBatch ranges.
func checkBatched(row *Row, c *cuda.Engine, logf func(string, ...any)) {
	want := (row.Ranges + cuda.MaxBatch - 1) / cuda.MaxBatch
	switch err := c.BatchDisabled(); {
	case err != nil:
		row.Status, row.Reason = "not_batched", fmt.Sprintf("batching was switched off (%v): the row measured per-range copies", err)
	case row.Calls != want:
		row.Status, row.Reason = "not_batched", fmt.Sprintf("%d driver calls per op of %d ranges, want %d cuMemcpyBatchAsync", row.Calls, row.Ranges, want)
	default:
		return
	}
	logf("NOT BATCHED: %s %s %d x %d: %s", row.Direction, row.Mode, row.Pages, row.PageBytes, row.Reason)
}

type cudaUUID [16]byte

func (u cudaUUID) String() string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

func dirName(d gpu.Direction) string {
	if d == gpu.PoolToEngine {
		return "h2d"
	}
	return "d2h"
}

// measure times one row. batched/per_range: one op of n pages in reverse
// engine order (nothing merges: n ranges). ceiling: host, one copy() of
// the same bytes between two buffers of this process; cuda, one op of n
// contiguous pages, merged into a single cuMemcpy{HtoD,DtoH}Async.
func measure(row *Row, cfg Config, es *engineSet, exp gputest.Export, dir gpu.Direction) error {
	n, pb := row.Pages, row.PageBytes
	var run func() (gpu.Result, error)
	if row.Mode == "ceiling" && cfg.Backend == "host" {
		src, dst := es.poolB[:row.Bytes], es.poolP[:row.Bytes]
		run = func() (gpu.Result, error) {
			copy(dst, src)
			return gpu.Result{Ranges: 1, Calls: 1}, nil
		}
	} else {
		e, regs := es.batched, es.regB
		if row.Mode != "batched" {
			e, regs = es.perRange, es.regP
		}
		if es.cuda != nil {
			mode := cuda.CopyPerRange // ceiling: one range, one cuMemcpy*Async
			if row.Mode == "batched" {
				mode = cuda.CopyBatched
			}
			if err := es.cuda.SetCopyMode(mode); err != nil {
				return err
			}
		}
		h, ok := regs[pb]
		if !ok {
			var err error
			if h, err = e.Register(exp.Region(pb, uint32(exp.Length/pb), nil)); err != nil {
				return err
			}
			regs[pb] = h
		}
		op := gpu.Op{Dir: dir, Region: h, Pages: make([]uint32, n), PoolOffsets: make([]uint64, n)}
		for i := range n {
			op.PoolOffsets[i] = uint64(i) * pb
			op.Pages[i] = uint32(n - 1 - i)
			if row.Mode == "ceiling" {
				op.Pages[i] = uint32(i)
			}
		}
		run = func() (gpu.Result, error) { return gpu.Do(e, op) }
	}
	// Warm up (IPC mapping, page tables, caches), then time.
	if _, err := run(); err != nil {
		return err
	}
	var res gpu.Result
	var err error
	reps := 0
	t0 := time.Now()
	for reps < 3 || (time.Since(t0) < cfg.MinTime && reps < 100000) {
		if res, err = run(); err != nil {
			return err
		}
		reps++
	}
	el := time.Since(t0)
	row.Reps = reps
	row.Ranges, row.Calls = res.Ranges, res.Calls
	row.MeanUS = float64(el.Microseconds()) / float64(reps)
	row.GBps = float64(row.Bytes) * float64(reps) / el.Seconds() / 1e9
	return nil
}

// PrintTable prints rows as one table.
func PrintTable(w io.Writer, rows []Row) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "BACKEND\tDIR\tPAGE\tPAGES\tMODE\tGB/S\tMEAN µs\tRANGES\tCALLS\tSTATUS")
	for _, r := range rows {
		if r.Status == "skipped" {
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%.2f\t%.1f\t%d\t%d\t%s\n",
			r.Backend, r.Direction, size(r.PageBytes), r.Pages, r.Mode, r.GBps, r.MeanUS, r.Ranges, r.Calls, r.Status)
	}
	tw.Flush()
	skipped := 0
	for _, r := range rows {
		if r.Status == "skipped" {
			skipped++
		}
	}
	if skipped > 0 {
		fmt.Fprintf(w, "(%d rows skipped: see --json for the reasons)\n", skipped)
	}
}

func size(b uint64) string {
	switch {
	case b >= 1<<20 && b%(1<<20) == 0:
		return fmt.Sprintf("%dM", b>>20)
	case b >= 1<<10 && b%(1<<10) == 0:
		return fmt.Sprintf("%dK", b>>10)
	}
	return fmt.Sprint(b)
}

// Verdicts states, for the CUDA backend, each target (targets.go) met or
// not: batched copies against the ceiling in each direction at the largest
// page count measured, and the load of a prefix as 32 KiB ranges and as
// 2 MiB blocks. A target whose rows were not measured says so.
func Verdicts(rows []Row) []string {
	if !slices.ContainsFunc(rows, func(r Row) bool { return r.Backend == "cuda" }) {
		return nil // the targets are for GPUs
	}
	var out []string
	find := func(dir, mode string, pb uint64, bytes uint64) *Row {
		var best *Row
		for i := range rows {
			r := &rows[i]
			if r.Status != "ok" || r.Direction != dir || r.Mode != mode {
				continue
			}
			if (pb != 0 && r.PageBytes != pb) || (bytes != 0 && r.Bytes != bytes) {
				continue
			}
			if best == nil || r.Pages > best.Pages {
				best = r
			}
		}
		return best
	}
	for _, t := range []struct {
		pb     uint64
		target harness.Target
	}{{crossLayerBytes, targetCrossLayer}, {perLayerBytes, targetPerLayer}} {
		for _, dir := range []string{"h2d", "d2h"} {
			b := find(dir, "batched", t.pb, 0)
			var c *Row
			if b != nil {
				c = find(dir, "ceiling", 0, b.Bytes)
			}
			if b == nil || c == nil {
				out = append(out, t.target.At(dir).NotMeasured("no batched and ceiling rows of that size"))
				continue
			}
			ratio := b.GBps / c.GBps
			out = append(out, t.target.At(fmt.Sprintf("%s, %d pages", dir, b.Pages)).Verdict(ratio, fmt.Sprintf("%.2f vs %.2f GB/s, %.2fx", b.GBps, c.GBps, ratio)))
		}
	}
	for _, pb := range []uint64{perLayerBytes, crossLayerBytes} {
		t := targetPrefixLoad.At(size(pb) + " ranges")
		b := find("h2d", "batched", pb, prefixBytes)
		if b == nil {
			out = append(out, t.NotMeasured(fmt.Sprintf("no h2d batched row of %d pages", prefixBytes/pb)))
			continue
		}
		took := time.Duration(b.MeanUS * float64(time.Microsecond))
		out = append(out, t.Verdict(took.Seconds()*1e3, fmt.Sprintf("%v, %d ranges", took.Round(10*time.Microsecond), b.Ranges)))
	}
	return out
}
