// Package l2bench is `ringside-bench l2`: store and fetch throughput of
// the shared tier through live sidecars, against the ceiling of a plain
// loop of the same client (github.com/redis/go-redis/v9, with the tier's
// settings: sidecar/l2.Dial) issuing SET and GET of the same values to the
// same server in the same run, for a single node and a cluster.
//
// Store: an engine (this process, host memory registered over the rings)
// stores N blocks of V bytes on sidecar A (--pool.slot-bytes V); the time
// runs from the Store record until A's tier has written them all (the
// engine-to-pool copy, the writers' copy out of the pool, CRC32C and the
// SETs). Fetch: an engine on sidecar B, whose pool holds none of them,
// acquires the N blocks; the time runs from the Acquire until its lease is
// ready (the pipelined GETs in parallel batches, the checks and the copies
// into B's pool). The ceiling's loops run the same concurrency as the
// tier: --l2.redis.writers goroutines of one SET each for the store, as
// many goroutines of pipelined GETs as a fetch runs batches.
package l2bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// Config configures a run.
type Config struct {
	Ringside   string
	Exe        string
	Topologies []string // "single", "cluster" (started here), or "addrs:H:P,..." (an existing server)
	ValueBytes []uint64 // default 256 KiB, 1, 4 and 16 MiB
	TotalBytes uint64   // bytes stored per value size and repetition (default 256 MiB)
	Reps       int      // repetitions; the median is reported (default 3)
	Writers    int      // the tier's writers (default l2.DefaultWriters)
	Dir        string
	Timeout    time.Duration
	JSON       bool
	Quiet      bool
	Out, Log   io.Writer
}

// Row is one measurement (bench "l2").
type Row struct {
	Bench          string  `json:"bench"` // "l2"
	Topology       string  `json:"topology"`
	Op             string  `json:"op"` // store or fetch
	ValueBytes     uint64  `json:"value_bytes"`
	Blocks         int     `json:"blocks"`
	SidecarGBps    float64 `json:"sidecar_gbps"`
	CeilingGBps    float64 `json:"ceiling_gbps"`
	Ratio          float64 `json:"ratio"`
	Concurrency    int     `json:"concurrency"`
	Reps           int     `json:"reps"`
	SidecarSeconds float64 `json:"sidecar_s"` // median
	CeilingSeconds float64 `json:"ceiling_s"`
	LoadAvg        string  `json:"load_avg"`
	CPUs           int     `json:"cpus"`
}

func (c *Config) defaults() error {
	if c.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		c.Exe = exe
	}
	r, err := harness.FindRingside(c.Ringside, c.Exe)
	if err != nil {
		return err
	}
	c.Ringside = r
	if len(c.Topologies) == 0 {
		c.Topologies = []string{"single", "cluster"}
	}
	if len(c.ValueBytes) == 0 {
		c.ValueBytes = []uint64{256 << 10, 1 << 20, 4 << 20, 16 << 20}
	}
	if c.TotalBytes == 0 {
		c.TotalBytes = 256 << 20
	}
	if c.Reps <= 0 {
		c.Reps = 3
	}
	if c.Writers <= 0 {
		c.Writers = l2.DefaultWriters
	}
	if c.Timeout <= 0 {
		c.Timeout = 2 * time.Minute
	}
	if c.Dir == "" {
		base := "/dev/shm"
		if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
			base = os.TempDir()
		}
		c.Dir = filepath.Join(base, fmt.Sprintf("ringside-l2bench-%d", os.Getpid()))
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return nil
}

// fetchBatches is how many batches of one fetch run side by side in the
// tier (sidecar/l2: max(in-flight/8, 2)).
func fetchBatches() int { return max(l2.DefaultInflight/8, 2) }

// Run measures every topology and value size and prints the rows.
func Run(ctx context.Context, cfg Config) ([]Row, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	logf := func(format string, a ...any) {
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Log, "l2: "+format+"\n", a...)
		}
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	defer os.RemoveAll(cfg.Dir)
	var rows []Row
	for _, topo := range cfg.Topologies {
		addrs, stop, err := cfg.tier(topo)
		if err != nil {
			return rows, err
		}
		name := topo
		if strings.HasPrefix(topo, "addrs:") {
			name = "given"
		}
		for _, v := range cfg.ValueBytes {
			logf("%s, values of %d bytes", name, v)
			rs, err := cfg.measure(ctx, name, addrs, v)
			if err != nil {
				stop()
				return rows, fmt.Errorf("%s, %d-byte values: %w", name, v, err)
			}
			rows = append(rows, rs...)
		}
		stop()
	}
	return rows, cfg.print(rows)
}

func (c *Config) tier(topo string) ([]string, func(), error) {
	if a, ok := strings.CutPrefix(topo, "addrs:"); ok {
		return strings.Split(a, ","), func() {}, nil
	}
	base := filepath.Join(os.TempDir(), fmt.Sprintf("ringside-l2bench-redis-%d", os.Getpid()))
	os.MkdirAll(base, 0o700)
	// No persistence, no eviction: every value stays for the run.
	o := redistest.Options{Args: []string{"--maxmemory", "0"}}
	switch topo {
	case "single":
		s, err := redistest.Start(base, o)
		if err != nil {
			return nil, nil, err
		}
		return []string{s.Addr}, func() { s.Close(); os.RemoveAll(base) }, nil
	case "cluster":
		cl, err := redistest.StartCluster(base, 3, 1, o)
		if err != nil {
			return nil, nil, err
		}
		return cl.Addrs(), func() { cl.Close(); os.RemoveAll(base) }, nil
	}
	return nil, nil, fmt.Errorf("topology %q: want single, cluster or addrs:HOST:PORT[,HOST:PORT]", topo)
}

type node struct {
	sc      *harness.Child
	sock    string
	metrics string
}

func (c *Config) startNode(dir string, addrs []string, value uint64, slots int, prefix string) (*node, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	n := &node{sock: filepath.Join(dir, "ringside.sock"), metrics: l.Addr().String()}
	l.Close()
	args := []string{"serve", "--dir", dir, "--socket", n.sock, "--metrics.addr", n.metrics, "--log.level", "warn",
		"--pool.slot-bytes", strconv.FormatUint(value, 10), "--pool.bytes", strconv.FormatUint(value*uint64(slots), 10),
		"--limits.pin-share", "1", "--limits.pending-share", "1", "--budget", strconv.FormatUint(value*uint64(slots), 10),
		"--l2.redis.addrs", strings.Join(addrs, ","), "--l2.redis.prefix", prefix,
		"--l2.redis.writers", strconv.Itoa(c.Writers), "--l2.redis.write-queue", strconv.Itoa(max(slots, 1024)),
		"--l2.redis.io-timeout", "60s", "--l2.redis.lookup-timeout", "10s",
		"--l2.write-slots", strconv.Itoa(slots), "--l2.max-fetch-blocks", strconv.Itoa(slots)}
	n.sc, err = harness.Start("sidecar", c.Ringside, args, harness.Options{Timeout: c.Timeout})
	if err != nil {
		return nil, err
	}
	err = n.sc.WaitUntil(context.Background(), c.Timeout, "connected to the tier", func() error {
		st, err := n.state()
		if err != nil {
			return err
		}
		if st.L2 == nil || !st.L2.Connected {
			return fmt.Errorf("not connected")
		}
		return nil
	})
	return n, err
}

type state struct {
	L2 *struct {
		Connected bool `json:"connected"`
		Machine   struct {
			Writes, WritesNotTaken, WritesSkipped uint64
		} `json:"machine"`
		Client struct {
			Writes map[string]float64 `json:"writes"`
		} `json:"client"`
	} `json:"l2"`
}

var hc = &http.Client{Timeout: 10 * time.Second}

func (n *node) state() (state, error) {
	var st state
	resp, err := hc.Get("http://" + n.metrics + "/debug/state")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(b, &st)
}

// written is how many writes the node's tier completed (ok), and whether
// any failed, was refused or skipped.
func (n *node) written() (int, bool, error) {
	st, err := n.state()
	if err != nil || st.L2 == nil {
		return 0, false, err
	}
	l := st.L2
	bad := l.Client.Writes["error"] > 0 || l.Machine.WritesNotTaken > 0 || l.Machine.WritesSkipped > 0
	return int(l.Client.Writes["ok"]), bad, nil
}

// engine is one engine attached to a node: host memory of N pages of V
// bytes, registered as region 1.
type engine struct {
	c   *connector.Client
	mem *shm.Mapping
	buf []byte
}

func (c *Config) attach(n *node, dir, instance, salt string, pages int, value uint64) (*engine, error) {
	cl, err := connector.Dial(connector.Options{Socket: n.sock, Instance: instance, Model: "l2bench", Layout: "l2bench", Salt: salt, Timeout: c.Timeout})
	if err != nil {
		return nil, err
	}
	m, err := shm.Create(filepath.Join(dir, instance+".kv"), pages*int(value), 0o600)
	if err != nil {
		cl.Close()
		return nil, err
	}
	e := &engine{c: cl, mem: m, buf: m.Bytes()[:pages*int(value)]}
	err = cl.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: shm.Addr(e.buf), Length: uint64(len(e.buf)), PageSize: value, PageCount: uint32(pages)})
	if err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

func (e *engine) close() {
	e.c.Close()
	e.mem.Close()
	shm.Unlink(e.mem.Path())
}

func digests(salt string, n int) []byte {
	out := make([]byte, 0, n*32)
	for i := 0; i < n; i++ {
		var d [32]byte
		copy(d[:], salt)
		binary.LittleEndian.PutUint64(d[24:], uint64(i))
		out = append(out, d[:]...)
	}
	return out
}

func pageList(n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(i)
	}
	return p
}

// measure runs Reps repetitions of the sidecars' store and fetch and of
// the ceiling's loops for one value size.
func (c *Config) measure(ctx context.Context, topo string, addrs []string, value uint64) ([]Row, error) {
	n := int(max(c.TotalBytes/value, 16))
	dir := filepath.Join(c.Dir, fmt.Sprintf("%s-%d", topo, value))
	defer os.RemoveAll(dir)
	prefix := fmt.Sprintf("l2bench-%d-%s-%d:", os.Getpid(), topo, value)
	a, err := c.startNode(filepath.Join(dir, "a"), addrs, value, n, prefix)
	if a != nil {
		defer a.sc.Stop(c.Timeout)
	}
	if err != nil {
		return nil, fmt.Errorf("sidecar A: %w", err)
	}
	b, err := c.startNode(filepath.Join(dir, "b"), addrs, value, n, prefix)
	if b != nil {
		defer b.sc.Stop(c.Timeout)
	}
	if err != nil {
		return nil, fmt.Errorf("sidecar B: %w", err)
	}
	var store, fetch []time.Duration
	for rep := 0; rep < c.Reps; rep++ {
		salt := fmt.Sprintf("rep%d", rep)
		ea, err := c.attach(a, dir, "engine-a-"+salt, salt, n, value)
		if err != nil {
			return nil, err
		}
		for i := range ea.buf {
			ea.buf[i] = byte(i*7 + rep)
		}
		before, _, err := a.written()
		if err != nil {
			ea.close()
			return nil, err
		}
		d := digests(salt, n)
		if _, err := ea.c.PutHashes(1, d, false); err != nil {
			ea.close()
			return nil, err
		}
		t0 := time.Now()
		r, err := ea.c.Store(schema.View{Batch: 1, Count: uint32(n)}, 1, pageList(n))
		if err != nil || r.Stored != uint32(n) {
			ea.close()
			return nil, fmt.Errorf("store: %+v %v", r, err)
		}
		for {
			w, bad, err := a.written()
			if err != nil {
				ea.close()
				return nil, err
			}
			if bad {
				ea.close()
				return nil, fmt.Errorf("a write failed, was refused or skipped: the measurement would not be of every block")
			}
			if w-before >= n {
				break
			}
			if time.Since(t0) > c.Timeout {
				ea.close()
				return nil, fmt.Errorf("the tier wrote %d of %d blocks in %v", w-before, n, c.Timeout)
			}
			// Each look costs the sidecar a /debug/state: rarely enough not
			// to take the CPU the writes need (2 ms is under 1% of a store
			// of the default 256 MiB at the rates measured here).
			time.Sleep(2 * time.Millisecond)
		}
		store = append(store, time.Since(t0))
		want := slices.Clone(ea.buf)
		ea.close()

		eb, err := c.attach(b, dir, "engine-b-"+salt, salt, n, value)
		if err != nil {
			return nil, err
		}
		eb.c.PutHashes(1, d, false)
		t0 = time.Now()
		l, err := eb.c.Acquire(schema.View{Batch: 1, Count: uint32(n)}, time.Minute)
		for err == nil && l.State == schema.StateWaiting {
			time.Sleep(time.Millisecond) // each Poll wakes the sidecar: not too often
			l, err = eb.c.Poll(l.Lease)
		}
		took := time.Since(t0)
		if err != nil || l.State != schema.StateReady || l.Blocks != uint32(n) {
			eb.close()
			return nil, fmt.Errorf("fetch: lease %+v %v", l, err)
		}
		fetch = append(fetch, took)
		// Every byte fetched is the byte stored.
		clear(eb.buf)
		if _, err := eb.c.Load(l.Lease, 1, 0, pageList(n)); err != nil {
			eb.close()
			return nil, err
		}
		if !bytes.Equal(eb.buf, want) {
			eb.close()
			return nil, fmt.Errorf("the fetched blocks differ from the stored ones")
		}
		eb.c.Release(l.Lease)
		eb.close()
	}
	cs, cf, err := c.ceiling(addrs, value, n)
	if err != nil {
		return nil, fmt.Errorf("ceiling: %w", err)
	}
	bytesMoved := float64(n) * float64(value)
	row := func(op string, side, ceil []time.Duration, conc int) Row {
		s, x := median(side), median(ceil)
		r := Row{Bench: "l2", Topology: topo, Op: op, ValueBytes: value, Blocks: n, Concurrency: conc, Reps: c.Reps,
			SidecarGBps: bytesMoved / s.Seconds() / 1e9, CeilingGBps: bytesMoved / x.Seconds() / 1e9,
			SidecarSeconds: s.Seconds(), CeilingSeconds: x.Seconds(), LoadAvg: harness.LoadAvg(), CPUs: runtime.NumCPU()}
		r.Ratio = r.SidecarGBps / r.CeilingGBps
		return r
	}
	return []Row{row("store", store, cs, c.Writers), row("fetch", fetch, cf, fetchBatches())}, nil
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// ceiling is the plain loop: the same client SETs and GETs n values of
// the same size (header included) with the tier's concurrency, Reps
// times.
func (c *Config) ceiling(addrs []string, value uint64, n int) (store, fetch []time.Duration, err error) {
	cl, _, err := l2.Dial(l2.Config{Addrs: addrs, IOTimeout: 60 * time.Second})
	if err != nil {
		return nil, nil, err
	}
	defer cl.Close()
	ns := machine.L2Namespace{FP: [16]byte{0xce, 0x11}, Width: 32, World: 1}
	payload := make([]byte, value)
	for i := range payload {
		payload[i] = byte(i * 13)
	}
	ctx := context.Background()
	key := func(rep, i int) string {
		return l2.Key(fmt.Sprintf("l2bench-ceiling-%d-%d:", os.Getpid(), rep), ns, digests("c", i+1)[i*32:], 0)
	}
	for rep := 0; rep < c.Reps; rep++ {
		// Store: Writers goroutines, one SET at a time each (as the tier's
		// writers), of a value built from the payload (as a writer does).
		t0 := time.Now()
		if err := parallel(c.Writers, n, func(i int) error {
			v := l2.AppendValue(nil, ns, digests("c", i+1)[i*32:], 0, payload)
			return cl.Set(ctx, key(rep, i), v, 0).Err()
		}); err != nil {
			return nil, nil, err
		}
		store = append(store, time.Since(t0))
		// Fetch: as many goroutines as a fetch runs batches, each a
		// pipeline of GETs of its share (as a batch).
		g := fetchBatches()
		per := max(1, int(l2.DefaultFetchBatchBytes/value))
		t0 = time.Now()
		var mu sync.Mutex
		var ferr error
		parallel(g, (n+per-1)/per, func(b int) error {
			pipe := cl.Pipeline()
			var cmds []*redis.StringCmd
			for i := b * per; i < min(n, (b+1)*per); i++ {
				cmds = append(cmds, pipe.Get(ctx, key(rep, i)))
			}
			if _, err := pipe.Exec(ctx); err != nil {
				mu.Lock()
				ferr = err
				mu.Unlock()
				return err
			}
			for _, cmd := range cmds {
				if v, _ := cmd.Bytes(); len(v) != l2.HeaderSize+int(value) {
					mu.Lock()
					ferr = fmt.Errorf("GET returned %d bytes", len(v))
					mu.Unlock()
				}
			}
			return nil
		})
		if ferr != nil {
			return nil, nil, ferr
		}
		fetch = append(fetch, time.Since(t0))
		for i := 0; i < n; i++ {
			cl.Del(ctx, key(rep, i))
		}
	}
	return store, fetch, nil
}

// parallel runs f(0..n-1) on g goroutines; the first error is returned.
func parallel(g, n int, f func(i int) error) error {
	var next int
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	for k := 0; k < g; k++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := first != nil
				mu.Unlock()
				if i >= n || stop {
					return
				}
				if err := f(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// verdicts reads the rows against the target (targets.go).
func verdicts(rows []Row) []string {
	if len(rows) == 0 {
		return nil
	}
	worst := rows[0].Ratio
	for _, r := range rows {
		worst = min(worst, r.Ratio)
	}
	return []string{targetVsPlainLoop.Verdict(worst, fmt.Sprintf("lowest %.2fx", worst))}
}

func (c *Config) print(rows []Row) error {
	if c.JSON {
		if err := harness.JSONLines(c.Out, rows); err != nil {
			return err
		}
		harness.Verdicts(c.Out, c.Log, true, c.Quiet, verdicts(rows))
		return nil
	}
	fmt.Fprintf(c.Out, "ringside bench l2: the shared tier through live sidecars against a plain go-redis loop (the ceiling), same server, same run\n")
	fmt.Fprintf(c.Out, "%d CPUs, load average %s; median of %d repetitions; %d writers\n\n", runtime.NumCPU(), harness.LoadAvg(), c.Reps, c.Writers)
	fmt.Fprintf(c.Out, "%-8s %-6s %10s %7s %12s %12s %7s\n", "topology", "op", "value", "blocks", "sidecar GB/s", "ceiling GB/s", "ratio")
	for _, r := range rows {
		fmt.Fprintf(c.Out, "%-8s %-6s %10s %7d %12.3f %12.3f %7.2f\n", r.Topology, r.Op, size(r.ValueBytes), r.Blocks, r.SidecarGBps, r.CeilingGBps, r.Ratio)
	}
	if v := verdicts(rows); len(v) > 0 {
		fmt.Fprintln(c.Out)
		harness.Verdicts(c.Out, c.Log, false, c.Quiet, v)
	}
	return nil
}

func size(b uint64) string {
	if b >= 1<<20 {
		return fmt.Sprintf("%d MiB", b>>20)
	}
	return fmt.Sprintf("%d KiB", b>>10)
}
