// Package pollbench is `ringside-bench poll`: the control-path workload of a
// published cache-manager measurement. A real sidecar runs in its own
// process; the bench client publishes 1024 pages of 64 KiB, holds a lease
// that fills its instance's whole load budget, and queues queries of 64,
// 256 and 1024 hashes that stay admitted in state Waiting; then it times
// Poll calls on them, per call, over the ring (connector.Client), over a
// Unix socket carrying the same records (through a relay), and from the
// Python client when it is there.
package pollbench

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/schema"
)

// ReferenceNs is the published figure printed beside the rows: a Python
// client polling a Rust cache manager, 1024 hashes, median.
const ReferenceNs = 106_390

// Reference sizes.
const (
	ReferenceHashes = 1024
	instance        = "pollbench"
	model           = "pollbench-model"
	layout          = "bench/64KiB/pollbench"
)

// Config configures a run. Zero fields take defaults.
type Config struct {
	Exe        string        // the bench executable, re-run as the relay (`poll-relay`; default os.Executable())
	Ringside   string        // the ringside executable run as the sidecar (`serve`; default: see harness.FindRingside)
	Dir        string        // sidecar directory (default /dev/shm/ringside-pollbench-<pid>); removed at the end if the run created it
	Sizes      []int         // hashes per waiting query (default 64, 256, 1024)
	Polls      int           // timed polls per batch (default 1000)
	Batches    int           // batches per row (default 3)
	Warmup     int           // untimed polls before each row (default 200)
	Pages      int           // pages published and leased (default 1024)
	PageBytes  int           // bytes per page and pool slot (default 64 KiB)
	Timeout    time.Duration // bound on startup, every call and every child (default 60s)
	Python     string        // interpreter for the Python row (default python3; "" with NoPython)
	PythonPath string        // directory holding the ringside Python package
	NoPython   bool          // skip the Python row
	NoUDS      bool          // skip the socket baseline
	JSON       bool
	Quiet      bool
	Out, Log   io.Writer
}

// Row is one result line.
type Row struct {
	Bench      string  `json:"bench"`     // "poll"
	Client     string  `json:"client"`    // "go" or "python"
	Transport  string  `json:"transport"` // "ring" or "uds"
	Hashes     int     `json:"hashes"`
	P50Ns      int64   `json:"p50_ns"`       // median of the batches' medians
	BatchP50Ns []int64 `json:"batch_p50_ns"` // each batch's median
	P99Ns      int64   `json:"p99_ns"`       // over all batches
	Polls      int     `json:"polls"`        // timed polls per batch
	Skipped    string  `json:"skipped,omitempty"`
}

func (c *Config) defaults() error {
	if c.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		c.Exe = exe
	}
	ringside, err := harness.FindRingside(c.Ringside, c.Exe)
	if err != nil {
		return err
	}
	c.Ringside = ringside
	if c.Dir == "" {
		base := "/dev/shm"
		if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
			base = os.TempDir()
		}
		c.Dir = filepath.Join(base, fmt.Sprintf("ringside-pollbench-%d", os.Getpid()))
	}
	if c.Pages <= 0 {
		c.Pages = 1024
	}
	if c.PageBytes <= 0 {
		c.PageBytes = 64 << 10
	}
	if len(c.Sizes) == 0 {
		c.Sizes = []int{64, 256, 1024}
	}
	for _, s := range c.Sizes {
		if s <= 0 || s > c.Pages {
			return fmt.Errorf("size %d: want 1..%d hashes (--pages)", s, c.Pages)
		}
	}
	if c.Polls <= 0 {
		c.Polls = 1000
	}
	if c.Batches <= 0 {
		c.Batches = 3
	}
	if c.Warmup < 0 {
		return errors.New("negative warmup")
	}
	if c.Warmup == 0 {
		c.Warmup = 200
	}
	if c.Timeout <= 0 {
		c.Timeout = time.Minute
	}
	if c.Python == "" {
		c.Python = "python3"
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return nil
}

type bench struct {
	Config
	ctx     context.Context
	sock    string
	client  *connector.Client
	leases  map[int]uint64 // hashes -> waiting lease
	full    uint64         // the lease that fills the budget
	region  []byte
	created bool
}

func (b *bench) logf(format string, a ...any) {
	if !b.Quiet {
		fmt.Fprintf(b.Log, "poll: "+format+"\n", a...)
	}
}

// Run runs the benchmark and prints its rows.
func Run(ctx context.Context, cfg Config) (rows []Row, err error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if ctx == nil {
		ctx = context.Background()
	}
	b := &bench{Config: cfg, ctx: ctx, leases: map[int]uint64{}}
	if _, err := os.Stat(b.Dir); os.IsNotExist(err) {
		b.created = true
	}
	if err := os.MkdirAll(b.Dir, 0o700); err != nil {
		return nil, err
	}
	defer func() {
		if b.created {
			os.RemoveAll(b.Dir)
		}
	}()
	b.sock = filepath.Join(b.Dir, "ringside.sock")
	budget := b.Pages * b.PageBytes
	args := []string{"serve",
		"--dir", b.Dir, "--socket", b.sock, "--metrics.addr", "",
		"--pool.slot-bytes", strconv.Itoa(b.PageBytes), "--pool.bytes", strconv.Itoa(4 * budget),
		"--budget", strconv.Itoa(budget), "--lease.max-ttl", "24h", "--log.level", "warn",
		// One client pins most of the pool on purpose (its waiting
		// queries): the per-uid pin quota would shorten their leases.
		"--limits.pin-share", "1"}
	b.logf("starting the sidecar: %s %s", b.Ringside, strings.Join(args, " "))
	sc, err := harness.Start("sidecar", b.Ringside, args, harness.Options{Timeout: b.Timeout})
	if err != nil {
		return nil, err
	}
	defer func() {
		if b.client != nil {
			for _, id := range b.leases {
				b.client.Release(id)
			}
			if b.full != 0 {
				b.client.Release(b.full)
			}
			b.client.Close()
		}
		if serr := sc.Stop(b.Timeout); serr != nil && err == nil {
			err = fmt.Errorf("sidecar did not stop cleanly: %w", serr)
		}
		runtime.KeepAlive(b.region)
	}()
	if err := b.attach(sc); err != nil {
		return nil, err
	}
	if err := b.setup(); err != nil {
		return nil, err
	}
	b.logf("load average before the rows: %s", harness.LoadAvg())
	ringRows, err := b.measure("go", "ring", b.client.Poll)
	if err != nil {
		return rows, err
	}
	rows = append(rows, ringRows...)
	if !b.NoUDS {
		uds, err := b.udsRows()
		if err != nil {
			return rows, err
		}
		rows = append(rows, uds...)
	}
	if !b.NoPython {
		rows = append(rows, b.pythonRows()...)
	}
	return rows, b.print(rows)
}

// attach waits for the sidecar's socket and attaches the bench client.
func (b *bench) attach(sc *harness.Child) error {
	return sc.WaitUntil(b.ctx, b.Timeout, "attachable", func() error {
		c, err := connector.Dial(b.options())
		if err == nil {
			b.client = c
		}
		return err
	})
}

func (b *bench) options() connector.Options {
	return connector.Options{Socket: b.sock, Instance: instance, Model: model, Layout: layout, Timeout: b.Timeout}
}

// digests returns n chained 32-byte digests (as vLLM's sha256 block hashes).
func digests(n int) []byte {
	out := make([]byte, 0, n*32)
	prev := sha256.Sum256([]byte("pollbench"))
	for i := 0; i < n; i++ {
		prev = sha256.Sum256(append(prev[:], byte(i), byte(i>>8)))
		out = append(out, prev[:]...)
	}
	return out
}

// setup publishes the pages, fills the budget with one lease and queues the
// waiting queries.
func (b *bench) setup() error {
	c := b.client
	b.region = make([]byte, b.Pages*b.PageBytes)
	for i := 0; i < b.Pages; i++ {
		b.region[i*b.PageBytes] = byte(i)
	}
	reg := schema.RegisterRegion{
		Region: 1, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: shm.Addr(b.region), Length: uint64(len(b.region)),
		PageSize: uint64(b.PageBytes), PageCount: uint32(b.Pages),
	}
	if err := c.RegisterRegion(reg); err != nil {
		return fmt.Errorf("register region: %w", err)
	}
	d := digests(b.Pages)
	if _, err := c.PutHashes(1, d, false); err != nil {
		return fmt.Errorf("put hashes: %w", err)
	}
	stored := 0
	for first := 0; first < b.Pages; first += 256 {
		n := min(256, b.Pages-first)
		pages := make([]uint32, n)
		for i := range pages {
			pages[i] = uint32(first + i)
		}
		r, err := c.Store(schema.View{Batch: 1, Start: uint32(first), Count: uint32(n)}, 1, pages)
		if err != nil {
			return fmt.Errorf("store pages %d..%d: %w", first, first+n, err)
		}
		stored += int(r.Stored)
	}
	if stored != b.Pages {
		return fmt.Errorf("stored %d of %d pages", stored, b.Pages)
	}
	if n, err := c.Lookup(schema.View{Batch: 1, Count: uint32(b.Pages)}); err != nil || n != b.Pages {
		return fmt.Errorf("lookup after store: %d of %d (%v)", n, b.Pages, err)
	}
	full, err := c.Acquire(schema.View{Batch: 1, Count: uint32(b.Pages)}, 24*time.Hour)
	if err != nil {
		return fmt.Errorf("acquire all: %w", err)
	}
	b.full = full.Lease
	if full.State != schema.StateReady || int(full.Blocks) != b.Pages {
		return fmt.Errorf("acquire all: %d blocks, state %v; want %d, ready", full.Blocks, full.State, b.Pages)
	}
	for i, n := range b.Sizes {
		batch := uint64(10 + i)
		if _, err := c.PutHashes(batch, d[:n*32], false); err != nil {
			return fmt.Errorf("put hashes (%d): %w", n, err)
		}
		l, err := c.Acquire(schema.View{Batch: batch, Count: uint32(n)}, 24*time.Hour)
		if err != nil {
			return fmt.Errorf("acquire %d: %w", n, err)
		}
		b.leases[n] = l.Lease
		if l.State != schema.StateWaiting || int(l.Blocks) != n {
			return fmt.Errorf("query of %d hashes: %d blocks, state %v; want %d, waiting", n, l.Blocks, l.State, n)
		}
	}
	b.logf("published %d pages of %d bytes; one lease fills the budget; waiting queries: %v", b.Pages, b.PageBytes, b.Sizes)
	return nil
}

// measure times Batches batches of Polls polls on the waiting query of
// every size, each call on its own. Batches go round robin over the sizes
// (batch 1 of every size, then batch 2, ...), so that a burst of load from
// elsewhere on the machine spreads over the sizes instead of spoiling one.
func (b *bench) measure(client, transport string, poll func(uint64) (schema.LeaseReply, error)) ([]Row, error) {
	check := func(n int, r schema.LeaseReply, err error) error {
		if err != nil {
			return err
		}
		if id := b.leases[n]; r.State != schema.StateWaiting || int(r.Blocks) != n || r.Lease != id {
			return fmt.Errorf("poll answered lease %d, %d blocks, %v; want %d, %d, waiting", r.Lease, r.Blocks, r.State, id, n)
		}
		return nil
	}
	samples := make([][][]int64, len(b.Sizes)) // size, batch, call
	for j, n := range b.Sizes {
		for i := 0; i < b.Warmup; i++ {
			r, err := poll(b.leases[n])
			if err := check(n, r, err); err != nil {
				return nil, fmt.Errorf("%s/%s warm-up: %w", client, transport, err)
			}
		}
		samples[j] = make([][]int64, b.Batches)
	}
	for k := 0; k < b.Batches; k++ {
		for j, n := range b.Sizes {
			id := b.leases[n]
			s := make([]int64, b.Polls)
			for i := range s {
				t0 := time.Now()
				r, err := poll(id)
				s[i] = int64(time.Since(t0))
				if err := check(n, r, err); err != nil {
					return nil, fmt.Errorf("%s/%s poll: %w", client, transport, err)
				}
			}
			samples[j][k] = s
		}
	}
	rows := make([]Row, len(b.Sizes))
	for j, n := range b.Sizes {
		rows[j] = summarize(client, transport, n, samples[j])
		b.logf("%s/%s %d hashes: p50 %s", client, transport, n, us(rows[j].P50Ns))
	}
	return rows, nil
}

// summarize turns per-call samples into a row.
func summarize(client, transport string, n int, batches [][]int64) Row {
	r := Row{Bench: "poll", Client: client, Transport: transport, Hashes: n}
	var all []int64
	for _, s := range batches {
		r.BatchP50Ns = append(r.BatchP50Ns, harness.Median(s))
		all = append(all, s...)
		r.Polls = len(s)
	}
	slices.Sort(all)
	r.P99Ns = harness.Rank(all, 99)
	r.P50Ns = harness.Median(r.BatchP50Ns)
	return r
}

// udsRows runs the socket baseline through the relay process.
func (b *bench) udsRows() ([]Row, error) {
	listen := filepath.Join(b.Dir, "pollbench-uds.sock")
	args := []string{"poll-relay",
		"--sidecar", b.sock, "--listen", listen, "--instance", instance, "--model", model, "--layout", layout,
		"--timeout", b.Timeout.String()}
	rl, err := harness.Start("relay", b.Exe, args, harness.Options{Ready: true, Timeout: b.Timeout})
	if err != nil {
		return nil, err
	}
	u, err := dialUDS(listen, b.Timeout)
	if err != nil {
		rl.Kill()
		return nil, fmt.Errorf("dial relay: %w", err)
	}
	rows, err := b.measure("go", "uds", u.poll)
	u.close()
	if err != nil {
		rl.Kill()
		return rows, fmt.Errorf("%w (relay: %s)", err, rl.Stderr())
	}
	if err := rl.Wait(b.Timeout); err != nil {
		return rows, err
	}
	return rows, nil
}

func us(ns int64) string { return fmt.Sprintf("%.2f us", float64(ns)/1e3) }

func (b *bench) print(rows []Row) error {
	verdicts := Verdicts(rows)
	if b.JSON {
		out := slices.Clone(rows)
		for i := range out {
			if out[i].BatchP50Ns == nil {
				out[i].BatchP50Ns = []int64{}
			}
		}
		if err := harness.JSONLines(b.Out, out); err != nil {
			return err
		}
		harness.Verdicts(b.Out, b.Log, true, b.Quiet, verdicts)
		return nil
	}
	w := tabwriter.NewWriter(b.Out, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "client\ttransport\thashes\tp50\tbatch p50s\tp99\treference\t")
	for _, r := range rows {
		if r.Skipped != "" {
			fmt.Fprintf(w, "%s\t%s\t-\tskipped\t\t\t\t\n", r.Client, r.Transport)
			continue
		}
		var ps []string
		for _, p := range r.BatchP50Ns {
			ps = append(ps, fmt.Sprintf("%.2f", float64(p)/1e3))
		}
		ref := ""
		if r.Hashes == ReferenceHashes {
			ref = fmt.Sprintf("106.39 us (/%.1f)", float64(ReferenceNs)/float64(max(r.P50Ns, 1)))
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t\n", r.Client, r.Transport, r.Hashes, us(r.P50Ns), strings.Join(ps, " / "), us(r.P99Ns), ref)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, r := range rows {
		if r.Skipped != "" {
			fmt.Fprintf(b.Out, "%s/%s skipped: %s\n", r.Client, r.Transport, r.Skipped)
		}
	}
	fmt.Fprintf(b.Out, "reference: 106.39 us per poll at 1024 hashes (a Python client on a Rust manager)\n")
	fmt.Fprintf(b.Out, "machine: %d CPUs, load average %s after the rows\n\n", runtime.NumCPU(), harness.LoadAvg())
	harness.Verdicts(b.Out, b.Log, false, b.Quiet, verdicts)
	return nil
}

// Verdicts reads the rows against the targets (targets.go); it reports,
// never fails.
func Verdicts(rows []Row) []string {
	var out []string
	type key struct{ client, transport string }
	by := map[key][]Row{}
	var order []key
	for _, r := range rows {
		if r.Skipped != "" {
			continue
		}
		k := key{r.Client, r.Transport}
		if _, ok := by[k]; !ok {
			order = append(order, k)
		}
		by[k] = append(by[k], r)
	}
	for _, k := range order {
		rs := by[k]
		if t, ok := targetRingP50[k.client]; ok && k.transport == "ring" {
			worst := rs[0]
			var vals []string
			for _, r := range rs {
				if r.P50Ns > worst.P50Ns {
					worst = r
				}
				vals = append(vals, fmt.Sprintf("%d: %s", r.Hashes, us(r.P50Ns)))
			}
			out = append(out, t.Verdict(float64(worst.P50Ns)/1e3, strings.Join(vals, ", ")))
		}
		lo, hi := rs[0], rs[0]
		for _, r := range rs {
			if r.Hashes < lo.Hashes {
				lo = r
			}
			if r.Hashes > hi.Hashes {
				hi = r
			}
		}
		if lo.Hashes != hi.Hashes && lo.P50Ns > 0 {
			ratio := float64(hi.P50Ns) / float64(lo.P50Ns)
			t := targetFlat.At(fmt.Sprintf("%s/%s, %d vs %d hashes", k.client, k.transport, hi.Hashes, lo.Hashes))
			out = append(out, t.Verdict(ratio, fmt.Sprintf("%.2fx", ratio)))
		}
	}
	// The socket's own cost: the relay path minus the ring path.
	for _, u := range by[key{"go", "uds"}] {
		for _, r := range by[key{"go", "ring"}] {
			if r.Hashes == u.Hashes {
				out = append(out, fmt.Sprintf("socket hop at %d hashes: uds - ring = %s (the uds row also carries one ring round trip through the relay)", u.Hashes, us(u.P50Ns-r.P50Ns)))
			}
		}
	}
	for _, k := range order {
		for _, r := range by[k] {
			if r.Hashes == ReferenceHashes && r.P50Ns > 0 {
				out = append(out, fmt.Sprintf("%s/%s at %d hashes: %s vs reference 106.39 us: reference/measured = %.1f", k.client, k.transport, r.Hashes, us(r.P50Ns), float64(ReferenceNs)/float64(r.P50Ns)))
			}
		}
	}
	for _, r := range rows {
		if r.Skipped == "" {
			continue
		}
		if t, ok := targetRingP50[r.Client]; ok && r.Transport == "ring" {
			out = append(out, t.NotMeasured(r.Skipped))
		}
		out = append(out, targetFlat.At(r.Client+"/"+r.Transport).NotMeasured(r.Skipped))
	}
	return out
}

// ParseSizes parses "64,256,1024".
func ParseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		v, err := strconv.Atoi(f)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("size %q: want a positive number of hashes", f)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, errors.New("no sizes")
	}
	return out, nil
}
