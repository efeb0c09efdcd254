// Package nodebench is `ringside-bench node`: the node tier's fetch
// throughput (sidecar/node: a node process's pool, copied by the node
// straight into a sidecar's pool) against a plain in-process copy of the
// same bytes, in the same blocks, measured alternately in the same run.
//
// The node tier runs in this process (node.NewServer and node.NewClient,
// as sidecar/node's BenchmarkNodeTier, which uses Start): the real Unix
// socket (SEQPACKET), the node's pool and the pod's pool as memfds (the
// pod's passed to the node with the Hello), the node's goroutine copying
// each value's payload into the pod's pool with its CRC32C in one pass and
// the client checking the reply's header and checksum. A fetch is what an
// acquire's fetch from the node tier does: one Client.Fetch of Blocks
// blocks, sent as Fetches of up to 64 values each, all at once. The
// ceiling is Go's copy() of the same number of blocks of the same size
// from one buffer into the same pod-pool slots.
package nodebench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// Tier is a node tier in this process: a server whose pool holds Blocks
// values of BlockBytes, and a client over Pool, a pod pool of 2 x Blocks
// slots (the first half the written blocks' source, the second half where
// fetches land).
type Tier struct {
	Server     *node.Server
	Client     *node.Client
	Pool       []byte
	poolMap    *shm.Mapping
	NS         machine.L2Namespace
	BlockBytes int
	Blocks     int
	cancel     context.CancelFunc
	dir        string
}

// Start starts a node tier in dir (created; removed by Close) for blocks
// values of blockBytes, with the window's default size.
func Start(dir string, blockBytes, blocks int) (*Tier, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	t := &Tier{BlockBytes: blockBytes, Blocks: blocks, dir: dir, NS: machine.L2NamespaceFor("m", "l", "", 16, 1)}
	s, err := node.NewServer(node.ServerConfig{Dir: filepath.Join(dir, "n"), PoolBytes: uint64(blocks+2) * uint64(blockBytes+node.SlotHeadroom),
		SlotBytes: uint64(blockBytes), PodShare: 1}, zerolog.Nop())
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Server, t.cancel = s, cancel
	go s.Serve(ctx)
	// The pod's pool as the sidecar's is: a file in memory, its pages
	// allocated at start (--pool.reserve).
	if t.poolMap, err = shm.CreateMemfd("bench-pod-pool", 2*blocks*blockBytes, true); err == nil {
		err = t.poolMap.Reserve()
	}
	if err != nil {
		t.Close()
		return nil, err
	}
	t.Pool = t.poolMap.Bytes()
	for i := range t.Pool[:blocks*blockBytes] {
		t.Pool[i] = byte(i * 7)
	}
	c, err := node.NewClient(node.ClientConfig{Socket: s.Socket(), Pod: "bench", IOTimeout: 10 * time.Second, LookupTimeout: time.Second}, t.poolMap, uint64(blockBytes), zerolog.Nop())
	if err != nil {
		t.Close()
		return nil, err
	}
	t.Client = c
	if !c.WaitConnected(10 * time.Second) {
		t.Close()
		return nil, errors.New("the client did not attach to the node tier")
	}
	return t, nil
}

// Close stops the client and the server and removes the directory.
func (t *Tier) Close() {
	if t.Client != nil {
		t.Client.Close()
	}
	t.cancel()
	<-t.Server.Done()
	if t.poolMap != nil {
		t.poolMap.Close()
	}
	os.RemoveAll(t.dir)
}

// Digest is block i's digest.
func Digest(i int) []byte { return []byte(fmt.Sprintf("%016d", i)) }

// Write writes the block of digest d from pod-pool slot i and waits until
// the client has handed it to the node (copied out of the pool); false:
// refused.
func (t *Tier) Write(d []byte, slot int) bool {
	done := make(chan bool, 1)
	t.Client.Write(machine.L2Write{NS: t.NS, Digest: d, Length: uint64(t.BlockBytes), PoolOffsets: []uint64{uint64(slot) * uint64(t.BlockBytes)}}, func(refused bool) { done <- refused })
	return !<-done
}

// WriteAll writes blocks 0..Blocks-1 from the first half of the pod pool
// and waits until the node has answered them all (WaitWrites).
func (t *Tier) WriteAll(timeout time.Duration) error {
	for i := 0; i < t.Blocks; i++ {
		if !t.Write(Digest(i), i) {
			return fmt.Errorf("write of block %d refused", i)
		}
	}
	return t.WaitWrites(timeout)
}

// WaitWrites waits until the node has answered every write handed to the
// client, and fails if any was not stored (or held already).
func (t *Tier) WaitWrites(timeout time.Duration) error {
	st := t.Client.Stats()
	deadline := time.Now().Add(timeout)
	for {
		ok, bad := st.WritesOK.Load()+st.WritesExist.Load(), st.WritesRefused.Load()+st.WritesFailed.Load()
		if bad > 0 {
			return fmt.Errorf("%d writes refused or failed", bad)
		}
		if ok >= st.Writes.Load() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d writes answered after %v", ok, st.Writes.Load(), timeout)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// FetchRange fetches blocks first..first+n-1 into the second half of the
// pod pool (block i into slot Blocks+i).
func (t *Tier) FetchRange(first, n int) machine.L2Fetch {
	f := machine.L2Fetch{NS: t.NS, Length: uint64(t.BlockBytes), MaxLength: uint64(t.BlockBytes)}
	for k := first; k < first+n; k++ {
		f.Blocks = append(f.Blocks, machine.L2FetchBlock{Digest: Digest(k), PoolOffsets: []uint64{uint64(t.Blocks+k) * uint64(t.BlockBytes)}})
	}
	return f
}

// FetchAll runs the fetches fs at once and reports how many of their
// blocks came.
func (t *Tier) FetchAll(fs []machine.L2Fetch) int {
	if len(fs) == 1 {
		return t.Fetch(fs[0])
	}
	ch := make(chan []machine.L2FetchResult, len(fs))
	for _, f := range fs {
		t.Client.Fetch(f, func(r []machine.L2FetchResult) { ch <- r })
	}
	ok := 0
	for range fs {
		for _, r := range <-ch {
			if r.OK {
				ok++
			}
		}
	}
	return ok
}

// Fetch runs f and reports how many of its blocks came.
func (t *Tier) Fetch(f machine.L2Fetch) int {
	ch := make(chan []machine.L2FetchResult, 1)
	t.Client.Fetch(f, func(r []machine.L2FetchResult) { ch <- r })
	ok := 0
	for _, r := range <-ch {
		if r.OK {
			ok++
		}
	}
	return ok
}

// DefaultBlockBytes are real models' KV blocks (bf16, every layer's K and V
// of one rank): Qwen2.5-0.5B at 16 tokens (24 layers, 2 KV heads of 64:
// 192 KiB), Llama-3.1-70B per rank at tensor parallelism 8 and 16 tokens
// (80 layers, 1 KV head of 128: 640 KiB), Llama-3.1-8B at 16 and 32 tokens
// (32 layers, 8 KV heads of 128: 2 and 4 MiB).
var DefaultBlockBytes = []int{192 << 10, 640 << 10, 2 << 20, 4 << 20}

// Config configures a run. Zero fields take defaults.
type Config struct {
	BlockBytes []int // default DefaultBlockBytes
	Blocks     int   // blocks per fetch (default 64)
	TotalBytes int64 // bytes fetched (and copied) per block size and repetition (default 256 MiB)
	// WorkingBytes are the blocks the node holds and the fetches cycle
	// through (default 128 MiB; at least one fetch's): beyond the caches,
	// as a pool's are.
	WorkingBytes int64
	Reps         int // repetitions, alternating fetch and copy (default 5)
	// Inflight is the fetches in flight at once, of different groups of
	// blocks, as concurrent acquires' (default 1); each copy then copies
	// as many groups.
	Inflight int
	Dir          string
	JSON         bool
	Quiet        bool
	Out, Log     io.Writer
}

// Row is one block size's figures (bench "node_fetch").
type Row struct {
	Bench        string  `json:"bench"` // "node_fetch"
	BlockBytes   int     `json:"block_bytes"`
	Blocks       int     `json:"blocks"`        // per fetch
	Inflight     int     `json:"inflight"`      // fetches at once
	Bytes        int64   `json:"bytes"`         // per repetition, each side
	WorkingBytes int64   `json:"working_bytes"` // the blocks the fetches cycle through
	Reps         int     `json:"reps"`
	FetchGBps    float64 `json:"fetch_gbps"` // median over the repetitions
	CopyGBps     float64 `json:"copy_gbps"`  // the same, Go's copy()
	Ratio        float64 `json:"ratio"`      // median of the repetitions' fetch/copy
	RatioMin     float64 `json:"ratio_min"`  // lowest repetition's
	RatioMax     float64 `json:"ratio_max"`  // highest repetition's
	// CopyCRCGBps is a fetch's copy without its messages, on one thread
	// (the node's copy into the pod's pool with CRC32C, l2.CopyCRC),
	// timed beside the others; RatioCopyCRC the median of fetch over it.
	CopyCRCGBps  float64   `json:"copy_crc_gbps"`
	RatioCopyCRC float64   `json:"ratio_copy_crc"`
	CopyCRCEach  []float64 `json:"copy_crc_each"`
	FetchEach    []float64 `json:"fetch_each"` // GB/s of each repetition
	CopyEach     []float64 `json:"copy_each"`  // GB/s of each repetition
	LoadAvg      string    `json:"loadavg"`    // at the row's end
	Checked      bool      `json:"checked"`    // every fetched byte compared with the written block
	CPUs         int       `json:"cpus"`
}

func (c *Config) defaults() {
	if len(c.BlockBytes) == 0 {
		c.BlockBytes = DefaultBlockBytes
	}
	if c.Blocks <= 0 {
		c.Blocks = 64
	}
	if c.TotalBytes <= 0 {
		c.TotalBytes = 256 << 20
	}
	if c.Reps <= 0 {
		c.Reps = 5
	}
	if c.Inflight <= 0 {
		c.Inflight = 1
	}
	if c.WorkingBytes <= 0 {
		c.WorkingBytes = 128 << 20
	}
	if c.Dir == "" {
		c.Dir = filepath.Join(os.TempDir(), fmt.Sprintf("ringside-nodebench-%d", os.Getpid()))
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
}

// Run measures every block size and prints the rows and the verdicts.
func Run(ctx context.Context, cfg Config) ([]Row, error) {
	cfg.defaults()
	var rows []Row
	for _, bs := range cfg.BlockBytes {
		if bs < 4096 || bs%64 != 0 {
			return rows, fmt.Errorf("block size %d: want a multiple of 64, at least 4KiB", bs)
		}
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Log, "node: %d blocks of %d bytes a fetch, %d MiB a repetition, %d repetitions\n", cfg.Blocks, bs, cfg.TotalBytes>>20, cfg.Reps)
		}
		r, err := measure(ctx, cfg, bs)
		if err != nil {
			return rows, fmt.Errorf("%d-byte blocks: %w", bs, err)
		}
		rows = append(rows, r)
	}
	return rows, report(cfg, rows)
}

func measure(ctx context.Context, cfg Config, bs int) (Row, error) {
	row := Row{Bench: "node_fetch", BlockBytes: bs, Blocks: cfg.Blocks, Inflight: cfg.Inflight, Reps: cfg.Reps, CPUs: runtime.NumCPU()}
	// The working set: fetches of Blocks blocks each cycle through it, so
	// that neither side runs out of a cache the other cannot use; at
	// least two rounds of Inflight fetches.
	k := cfg.Inflight
	groups := max(2*k, int(cfg.WorkingBytes/(int64(cfg.Blocks)*int64(bs))))
	groups -= groups % k
	held := groups * cfg.Blocks
	row.WorkingBytes = int64(held) * int64(bs)
	t, err := Start(filepath.Join(cfg.Dir, fmt.Sprint(bs)), bs, held)
	if err != nil {
		return row, err
	}
	defer t.Close()
	if err := t.WriteAll(time.Minute); err != nil {
		return row, err
	}
	fs := make([]machine.L2Fetch, groups)
	for g := range fs {
		fs[g] = t.FetchRange(g*cfg.Blocks, cfg.Blocks)
	}
	per := int64(k) * int64(cfg.Blocks) * int64(bs) // a round's bytes
	rounds := max(groups/k, int(cfg.TotalBytes/per))
	row.Bytes = int64(rounds) * per
	src := make([]byte, held*bs) // the copy's source: the node pool's bytes, in this process
	copy(src, t.Pool[:held*bs])
	dst := t.Pool[held*bs:]
	span := cfg.Blocks * bs // a group's bytes
	// Warm both paths (page faults of the pools and dst).
	for g := range fs {
		if t.Fetch(fs[g]) != cfg.Blocks {
			return row, errors.New("a warm-up fetch missed")
		}
	}
	copyBlocks(dst, src, bs)
	var ratios, floor []float64
	for rep := 0; rep < cfg.Reps; rep++ {
		if err := ctx.Err(); err != nil {
			return row, err
		}
		clear(dst)
		// Interleaved at each fetch, so that both sides see the same
		// machine (on a shared one, its load moves within a second); the
		// copy takes the group half the working set away from the one
		// just fetched, whose bytes are in no cache.
		var fd, cd, wd time.Duration
		for i := 0; i < rounds; i++ {
			g := (i * k) % groups // this round's first group: k groups from it
			t0 := time.Now()
			if n := t.FetchAll(fs[g : g+k]); n != k*cfg.Blocks {
				return row, fmt.Errorf("%d fetches got %d of %d blocks", k, n, k*cfg.Blocks)
			}
			t1 := time.Now()
			o := ((g + groups/2) % groups) * span
			o -= o % (k * span)
			copyBlocks(dst[o:o+k*span], src[o:o+k*span], bs)
			t2 := time.Now()
			o = ((g + groups/4) % groups) * span
			o -= o % (k * span)
			copyCRCBlocks(dst[o:o+k*span], src[o:o+k*span], bs)
			fd, cd, wd = fd+t1.Sub(t0), cd+t2.Sub(t1), wd+time.Since(t2)
		}
		if string(dst) != string(src) {
			return row, errors.New("the fetched bytes differ from the written ones")
		}
		fg, cg, tg := gbps(row.Bytes, fd), gbps(row.Bytes, cd), gbps(row.Bytes, wd)
		row.FetchEach, row.CopyEach, row.CopyCRCEach = append(row.FetchEach, fg), append(row.CopyEach, cg), append(row.CopyCRCEach, tg)
		ratios = append(ratios, fg/cg)
		floor = append(floor, fg/tg)
	}
	row.Checked = true
	row.FetchGBps, row.CopyGBps, row.Ratio = median(row.FetchEach), median(row.CopyEach), median(ratios)
	row.RatioMin, row.RatioMax = slices.Min(ratios), slices.Max(ratios)
	row.CopyCRCGBps, row.RatioCopyCRC = median(row.CopyCRCEach), median(floor)
	row.LoadAvg = harness.LoadAvg()
	return row, nil
}

// copyCRCBlocks is a fetch's work without its messages, on one thread:
// each block copied into dst with its CRC32C (the node's l2.CopyOutCRC).
func copyCRCBlocks(dst, src []byte, bs int) {
	for off := 0; off < len(src); off += bs {
		l2.CopyOutCRC(dst[off:off+bs], src[off:off+bs])
	}
}

// copyBlocks copies src into dst block by block, as a fetch lands.
func copyBlocks(dst, src []byte, bs int) {
	for off := 0; off < len(src); off += bs {
		copy(dst[off:off+bs], src[off:off+bs])
	}
}

func gbps(n int64, d time.Duration) float64 { return float64(n) / max(d.Seconds(), 1e-9) / 1e9 }

func median(v []float64) float64 {
	s := slices.Sorted(slices.Values(v))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func report(cfg Config, rows []Row) error {
	var verdicts []string
	worst, ok := 0.0, true
	for i, r := range rows {
		if i == 0 || r.Ratio < worst {
			worst = r.Ratio
		}
		ok = ok && targetFetch.Met(r.Ratio)
	}
	if len(rows) > 0 {
		verdicts = append(verdicts, targetFetch.Holds(ok, fmt.Sprintf("lowest %.2fx", worst)))
	}
	if cfg.JSON {
		enc := json.NewEncoder(cfg.Out)
		for _, r := range rows {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		harness.Verdicts(cfg.Out, cfg.Log, true, cfg.Quiet, verdicts)
		return nil
	}
	fmt.Fprintf(cfg.Out, "node tier fetch (in-process node and client, real socket and memfds, the node copying into the pod's pool) against Go's copy() of the same blocks; %d CPUs, load average %s\n\n",
		runtime.NumCPU(), harness.LoadAvg())
	tw := tabwriter.NewWriter(cfg.Out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "block\tblocks/fetch\tworking set MiB\tMiB/rep\treps\tfetch GB/s\tcopy GB/s\tfetch/copy\tmin\tmax\tcopy+CRC GB/s\tfetch/copy+CRC\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d KiB\t%d\t%d\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t\n", r.BlockBytes>>10, r.Blocks, r.WorkingBytes>>20, r.Bytes>>20, r.Reps, r.FetchGBps, r.CopyGBps, r.Ratio, r.RatioMin, r.RatioMax, r.CopyCRCGBps, r.RatioCopyCRC)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(cfg.Out, "GB/s: the medians of the repetitions; fetch/copy: the median of each repetition's ratio (each fetch followed by a copy of as many bytes, each timed alone);\ncopy+CRC: the fetch's copy without its messages, one thread (l2.CopyCRC: copied and checksummed in 16 KiB pieces), timed beside them")
	harness.Verdicts(cfg.Out, cfg.Log, false, cfg.Quiet, verdicts)
	return nil
}
