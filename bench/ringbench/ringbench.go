// Package ringbench is `ringside-bench ring`: round-trip latency and one-way
// throughput of the shared-memory ring between two real processes, next to
// a Unix-socket baseline and a bare cache-line ping-pong, for a Go client and
// for the Python connector.
//
// The client side runs in the benchmark process (Go rows) or in a spawned
// `python3 -m ringside._benchpeer` (Python rows); the server side always runs
// in a separate process, the bench executable re-executed with the hidden
// `ring-server` subcommand (see Serve).
package ringbench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/ring"
)

// Config configures a run.
type Config struct {
	// Exe and ServerArgs start the server process: Exe ServerArgs... --mode
	// ... Default: os.Executable() and ["ring-server"].
	Exe        string
	ServerArgs []string
	// Dir holds the rings, the socket and the ping-pong word. Default
	// /dev/shm/ringside-bench-<pid>. A directory this run creates is removed
	// at the end; in one that existed only the run's own files are removed.
	Dir string
	// Rounds is the number of timed round trips per latency row, after
	// Warmup untimed ones.
	Rounds, Warmup int
	// Msgs is the number of 64-byte records of the throughput row.
	Msgs int
	// Batch is the throughput row's records per Publish and per Commit.
	Batch int
	// Capacity is the data area of every ring. Default 64 KiB.
	Capacity uint64
	// Timeout bounds every row (each wait of both sides).
	Timeout time.Duration
	// Python is the interpreter; PythonPath the directory holding the
	// ringside package (connector/python), searched for when empty.
	Python, PythonPath string
	// JSON prints JSON Lines instead of the table; Quiet drops progress
	// lines and, with JSON, the verdicts (which go to Log then).
	JSON, Quiet bool
	Out, Log    io.Writer
}

// Row is one line of the result. Latency rows are round trips (metric
// "rtt"); msgs_per_sec is then round trips per second. The throughput row
// (metric "one-way") reports records per second; its p50/p99/mean are the
// nanoseconds per record over windows of throughputWindow records, measured
// at the producer.
type Row struct {
	Bench        string  `json:"bench"`
	Client       string  `json:"client"`
	Transport    string  `json:"transport"`
	Metric       string  `json:"metric"`
	PayloadBytes int     `json:"payload_bytes"`
	Wait         string  `json:"wait"`
	N            int     `json:"n"`
	P50          int64   `json:"p50_ns"`
	P99          int64   `json:"p99_ns"`
	Mean         int64   `json:"mean_ns"`
	MsgsPerSec   float64 `json:"msgs_per_sec"`
	Status       string  `json:"status"` // ok, skipped, failed
	Reason       string  `json:"reason,omitempty"`
}

// Payload sizes of the latency rows: one lookup, and a batch of 1024 hashes.
const (
	SmallPayload     = 16
	LargePayload     = 8 << 10
	PingPongBytes    = 8
	ThroughputBytes  = 64
	throughputWindow = 4096
)

func (c *Config) defaults() error {
	if c.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("bench ring: cannot find the bench executable to re-run as server: %w", err)
		}
		c.Exe = exe
	}
	if c.ServerArgs == nil {
		c.ServerArgs = []string{"ring-server"}
	}
	if c.Dir == "" {
		c.Dir = fmt.Sprintf("/dev/shm/ringside-bench-%d", os.Getpid())
	}
	if c.Rounds <= 0 {
		c.Rounds = 20000
	}
	if c.Warmup < 0 {
		c.Warmup = 0
	}
	if c.Msgs <= 0 {
		c.Msgs = 5_000_000
	}
	if c.Batch <= 0 {
		c.Batch = 32
	}
	if c.Capacity == 0 {
		c.Capacity = 64 << 10
	}
	if c.Timeout <= 0 {
		c.Timeout = 30 * time.Second
	}
	if c.Python == "" {
		c.Python = "python3"
	}
	if c.Out == nil {
		c.Out = os.Stdout
	}
	if c.Log == nil {
		c.Log = os.Stderr
	}
	if ring.RecordSize(LargePayload) > int(ring.DefaultMaxRecord(c.Capacity)) {
		return fmt.Errorf("bench ring: capacity %d too small for %d-byte records", c.Capacity, LargePayload)
	}
	return nil
}

// bench is one run's state.
type bench struct {
	Config
	ctx     context.Context
	seq     int
	created bool
}

// Run runs every row, prints the table (or JSON Lines) and the verdicts, and
// returns the rows. It fails only when a Go row fails; Python rows are
// skipped when Python or the connector package is missing.
func Run(ctx context.Context, cfg Config) ([]Row, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	b := &bench{Config: cfg, ctx: ctx}
	if err := b.makeDir(); err != nil {
		return nil, err
	}
	defer b.removeDir()

	var rows []Row
	add := func(r Row) {
		r.Bench = "ring"
		if r.Status == "" {
			r.Status = "ok"
		}
		if r.Metric == "" {
			r.Metric = "rtt"
		}
		rows = append(rows, r)
		if !b.Quiet {
			fmt.Fprintf(b.Log, "bench ring: %-6s %-8s %5d B %-4s  %s\n", r.Client, r.Transport, r.PayloadBytes, r.Wait, describe(r))
		}
	}
	fail := func(r Row, err error) Row {
		if errors.Is(err, errSkipped) {
			r.Status, r.Reason = "skipped", strings.TrimPrefix(err.Error(), errSkipped.Error()+": ")
		} else if err != nil {
			r.Status, r.Reason = "failed", err.Error()
		}
		return r
	}

	// The physical limit first.
	{
		r := Row{Client: "go", Transport: "pingpong", PayloadBytes: PingPongBytes, Wait: "spin"}
		s, err := b.goPingPong()
		add(fail(s.fill(r), err))
	}
	for _, size := range []int{SmallPayload, LargePayload} {
		for _, wait := range []string{"spin", "park"} {
			r := Row{Client: "go", Transport: "ring", PayloadBytes: size, Wait: wait}
			s, err := b.goRing(size, wait)
			add(fail(s.fill(r), err))
		}
	}
	for _, size := range []int{SmallPayload, LargePayload} {
		r := Row{Client: "go", Transport: "uds", PayloadBytes: size, Wait: "park"}
		s, err := b.goUDS(size)
		add(fail(s.fill(r), err))
	}
	py, pyErr := findPython(b.Python, b.PythonPath, b.Exe)
	for _, size := range []int{SmallPayload, LargePayload} {
		for _, wait := range []string{"spin", "park"} {
			r := Row{Client: "python", Transport: "ring", PayloadBytes: size, Wait: wait}
			var s result
			err := pyErr
			if err == nil {
				s, err = b.pyRing(py, size, wait)
			}
			add(fail(s.fill(r), err))
		}
	}
	for _, size := range []int{SmallPayload, LargePayload} {
		r := Row{Client: "python", Transport: "uds", PayloadBytes: size, Wait: "park"}
		var s result
		err := pyErr
		if err == nil {
			s, err = b.pyUDS(py, size)
		}
		add(fail(s.fill(r), err))
	}
	{
		r := Row{Client: "go", Transport: "ring", Metric: "one-way", PayloadBytes: ThroughputBytes, Wait: "spin"}
		s, err := b.goThroughput()
		add(fail(s.fill(r), err))
	}

	if err := b.print(rows); err != nil {
		return rows, err
	}
	var failed []string
	for _, r := range rows {
		if r.Status == "failed" {
			failed = append(failed, fmt.Sprintf("%s %s %d B %s: %s", r.Client, r.Transport, r.PayloadBytes, r.Wait, r.Reason))
		}
	}
	if len(failed) > 0 {
		return rows, fmt.Errorf("bench ring: %d row(s) failed:\n  %s", len(failed), strings.Join(failed, "\n  "))
	}
	return rows, nil
}

// result is what a row's measurement produced.
type result struct {
	summary
	perSec float64
}

func (s result) fill(r Row) Row {
	r.N, r.P50, r.P99, r.Mean, r.MsgsPerSec = s.n, s.p50, s.p99, s.mean, s.perSec
	return r
}

func describe(r Row) string {
	switch r.Status {
	case "ok":
		return fmt.Sprintf("p50 %s µs  p99 %s µs  %s/s", us(r.P50), us(r.P99), rate(r.MsgsPerSec))
	default:
		return r.Status + ": " + r.Reason
	}
}

func us(ns int64) string {
	v := float64(ns) / 1e3
	switch {
	case v < 10:
		return strconv.FormatFloat(v, 'f', 2, 64)
	case v < 100:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func rate(v float64) string {
	switch {
	case v >= 1e6:
		return strconv.FormatFloat(v/1e6, 'f', 2, 64) + " M"
	case v >= 1e3:
		return strconv.FormatFloat(v/1e3, 'f', 1, 64) + " k"
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func (b *bench) makeDir() error {
	err := os.Mkdir(b.Dir, 0o700)
	switch {
	case err == nil:
		b.created = true
	case errors.Is(err, os.ErrExist):
		if err := ring.EnsureDir(b.Dir, 0o700); err != nil {
			return err
		}
	default:
		return fmt.Errorf("bench ring: %w", err)
	}
	return nil
}

func (b *bench) removeDir() {
	if b.created {
		os.RemoveAll(b.Dir)
	}
}

// path names a new file of this run in Dir; the caller removes it.
func (b *bench) path(kind string) string {
	b.seq++
	return filepath.Join(b.Dir, fmt.Sprintf("%s-%d", kind, b.seq))
}

// server is a running server process.
type server struct{ *harness.Child }

// startServer re-executes the bench binary as the server and waits for
// its ready line.
func (b *bench) startServer(args ...string) (server, error) {
	argv := append(append([]string{}, b.ServerArgs...), args...)
	argv = append(argv, "--timeout", (b.Timeout + 5*time.Second).String())
	c, err := harness.Start("server", b.Exe, argv, harness.Options{Ready: true, Timeout: b.Timeout, Context: b.ctx})
	return server{c}, err
}

// finish combines the client's error with the server's exit.
func (s server) finish(clientErr error, timeout time.Duration) error {
	if clientErr != nil {
		s.Kill()
		if msg := s.Stderr(); msg != "" {
			return fmt.Errorf("%w (server: %s)", clientErr, msg)
		}
		return clientErr
	}
	return s.Wait(timeout)
}

// ringPair creates a request and a response ring.
func (b *bench) ringPair() (req, resp *ring.File, cleanup func(), err error) {
	req, err = ring.Create(b.path("req"), ring.Options{Capacity: b.Capacity, CreatorProducer: true})
	if err != nil {
		return nil, nil, nil, err
	}
	resp, err = ring.Create(b.path("resp"), ring.Options{Capacity: b.Capacity})
	if err != nil {
		req.Remove()
		req.Close()
		return nil, nil, nil, err
	}
	return req, resp, func() {
		req.Remove()
		resp.Remove()
		req.Close()
		resp.Close()
	}, nil
}

func (b *bench) goRing(size int, wait string) (result, error) {
	wc, err := WaitConfig(wait)
	if err != nil {
		return result{}, err
	}
	req, resp, cleanup, err := b.ringPair()
	if err != nil {
		return result{}, err
	}
	defer cleanup()
	total := b.Warmup + b.Rounds
	srv, err := b.startServer("--mode", ModeRing, "--req", req.Path(), "--resp", resp.Path(),
		"--wait", wait, "--count", strconv.Itoa(total))
	if err != nil {
		return result{}, err
	}
	var res result
	err = func() error {
		p, err := ring.NewProducer(req.Ring, wc)
		if err != nil {
			return err
		}
		defer p.Close()
		c, err := ring.NewConsumer(resp.Ring, wc)
		if err != nil {
			return err
		}
		defer c.Close()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		deadline := time.Now().Add(b.Timeout)
		payload := make([]byte, size)
		lat := newSamples(b.Rounds)
		// One clock read per round trip: each round trip is the time between
		// consecutive reads.
		var start time.Time
		prev := time.Now()
		for i := 0; i < total; i++ {
			if i == b.Warmup {
				prev = time.Now()
				start = prev
			}
			binary.LittleEndian.PutUint64(payload, uint64(i)) // a request that changes
			if err := p.Write(1, 0, uint64(i), payload, deadline); err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
			rec, err := next(c, deadline)
			if err != nil {
				return fmt.Errorf("response %d: %w", i, err)
			}
			seq := rec.Seq
			c.Commit()
			now := time.Now()
			if seq != uint64(i) {
				return fmt.Errorf("response seq %d, want %d", seq, i)
			}
			if i >= b.Warmup {
				lat.add(now.Sub(prev))
			}
			prev = now
		}
		res = result{summary: lat.summary(), perSec: float64(b.Rounds) / time.Since(start).Seconds()}
		return nil
	}()
	return res, srv.finish(err, b.Timeout)
}

func (b *bench) goUDS(size int) (result, error) {
	sock := b.path("sock")
	defer os.Remove(sock)
	total := b.Warmup + b.Rounds
	srv, err := b.startServer("--mode", ModeUDS, "--socket", sock, "--count", strconv.Itoa(total))
	if err != nil {
		return result{}, err
	}
	var res result
	err = func() error {
		conn, err := net.DialTimeout("unix", sock, b.Timeout)
		if err != nil {
			return err
		}
		defer conn.Close()
		if err := conn.SetDeadline(time.Now().Add(b.Timeout)); err != nil {
			return err
		}
		msg := make([]byte, frameHeader+size)
		in := make([]byte, frameHeader+size)
		lat := newSamples(b.Rounds)
		var start time.Time
		prev := time.Now()
		for i := 0; i < total; i++ {
			if i == b.Warmup {
				prev = time.Now()
				start = prev
			}
			ring.PutRecordHeader(msg, ring.RecordHeader{Len: uint32(size), Type: 1, Seq: uint64(i)})
			if _, err := conn.Write(msg); err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
			if _, err := io.ReadFull(conn, in[:frameHeader]); err != nil {
				return fmt.Errorf("response %d: %w", i, err)
			}
			n := int(binary.LittleEndian.Uint32(in))
			if n != size {
				return fmt.Errorf("response %d: %d bytes, want %d", i, n, size)
			}
			if _, err := io.ReadFull(conn, in[frameHeader:frameHeader+n]); err != nil {
				return fmt.Errorf("response %d: %w", i, err)
			}
			now := time.Now()
			if seq := binary.LittleEndian.Uint64(in[8:]); seq != uint64(i) {
				return fmt.Errorf("response seq %d, want %d", seq, i)
			}
			if i >= b.Warmup {
				lat.add(now.Sub(prev))
			}
			prev = now
		}
		res = result{summary: lat.summary(), perSec: float64(b.Rounds) / time.Since(start).Seconds()}
		return nil
	}()
	return res, srv.finish(err, b.Timeout)
}

func (b *bench) goPingPong() (result, error) {
	file := b.path("pingpong")
	m, err := shm.Create(file, 4096, 0o600)
	if err != nil {
		return result{}, err
	}
	defer func() { m.Close(); shm.Unlink(file) }()
	w := shm.U64(m.Bytes(), 0)
	total := b.Warmup + b.Rounds
	srv, err := b.startServer("--mode", ModePingPong, "--file", file, "--count", strconv.Itoa(total))
	if err != nil {
		return result{}, err
	}
	var res result
	err = func() error {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		deadline := time.Now().Add(b.Timeout)
		lat := newSamples(b.Rounds)
		var start time.Time
		prev := time.Now()
		for i := 0; i < total; i++ {
			if i == b.Warmup {
				prev = time.Now()
				start = prev
			}
			w.Store(uint64(2*i + 1))
			want := uint64(2*i + 2)
			for spins := 1; w.Load() != want; spins++ {
				if spins%spinCheck == 0 && time.Now().After(deadline) {
					return fmt.Errorf("pong %d: %w", i, errDeadline)
				}
			}
			now := time.Now()
			if i >= b.Warmup {
				lat.add(now.Sub(prev))
			}
			prev = now
		}
		res = result{summary: lat.summary(), perSec: float64(b.Rounds) / time.Since(start).Seconds()}
		return nil
	}()
	return res, srv.finish(err, b.Timeout)
}

// goThroughput streams Msgs 64-byte records one way: Batch Appends per
// Publish here, Batch Nexts per Commit in the server, which acknowledges the
// last record on the response ring; the rate is records over the time from
// the first Append to the acknowledgement.
func (b *bench) goThroughput() (result, error) {
	wc, _ := WaitConfig("spin")
	req, resp, cleanup, err := b.ringPair()
	if err != nil {
		return result{}, err
	}
	defer cleanup()
	srv, err := b.startServer("--mode", ModeThroughput, "--req", req.Path(), "--resp", resp.Path(),
		"--wait", "spin", "--count", strconv.Itoa(b.Msgs), "--batch", strconv.Itoa(b.Batch))
	if err != nil {
		return result{}, err
	}
	var res result
	err = func() error {
		p, err := ring.NewProducer(req.Ring, wc)
		if err != nil {
			return err
		}
		defer p.Close()
		c, err := ring.NewConsumer(resp.Ring, wc)
		if err != nil {
			return err
		}
		defer c.Close()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		deadline := time.Now().Add(b.Timeout)
		payload := make([]byte, ThroughputBytes)
		for i := range payload {
			payload[i] = byte(i)
		}
		perRecord := newSamples(b.Msgs/throughputWindow + 1)
		start := time.Now()
		win, winStart := 0, start
		for sent := 0; sent < b.Msgs; {
			n := min(b.Batch, b.Msgs-sent)
			k := 0
			for ; k < n; k++ {
				err := p.Append(1, 0, uint64(sent+k), payload)
				if err == ring.ErrFull {
					break
				}
				if err != nil {
					return err
				}
			}
			p.Publish()
			sent += k
			win += k
			if k < n {
				if err := p.WaitSpace(ring.RecordSize(ThroughputBytes), deadline); err != nil {
					return fmt.Errorf("after %d records: %w", sent, err)
				}
			}
			if win >= throughputWindow {
				now := time.Now()
				perRecord.add(now.Sub(winStart) / time.Duration(win))
				win, winStart = 0, now
			}
		}
		rec, err := next(c, deadline)
		if err != nil {
			return fmt.Errorf("acknowledgement: %w", err)
		}
		if rec.Seq != uint64(b.Msgs) {
			return fmt.Errorf("acknowledgement seq %d, want %d", rec.Seq, b.Msgs)
		}
		c.Commit()
		elapsed := time.Since(start)
		res = result{summary: perRecord.summary(), perSec: float64(b.Msgs) / elapsed.Seconds()}
		res.n = b.Msgs
		return nil
	}()
	return res, srv.finish(err, b.Timeout)
}

// print writes the table or the JSON Lines, then the verdicts.
func (b *bench) print(rows []Row) error {
	verdicts := Verdicts(rows)
	if b.JSON {
		if err := harness.JSONLines(b.Out, rows); err != nil {
			return err
		}
		harness.Verdicts(b.Out, b.Log, true, b.Quiet, verdicts)
		return nil
	}
	fmt.Fprintf(b.Out, "ringside bench ring: %d round trips per row after %d warm-up; %d records one-way (%d per publish/commit); ring capacity %d KiB; GOMAXPROCS %d, %d CPUs\n\n",
		b.Rounds, b.Warmup, b.Msgs, b.Batch, b.Capacity>>10, runtime.GOMAXPROCS(0), runtime.NumCPU())
	tw := tabwriter.NewWriter(b.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CLIENT\tTRANSPORT\tMETRIC\tPAYLOAD\tWAIT\tN\tP50 µs\tP99 µs\tMEAN µs\tMSGS/S\tSTATUS")
	for _, r := range rows {
		if r.Status != "ok" {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t-\t-\t-\t-\t-\t%s: %s\n", r.Client, r.Transport, r.Metric, r.PayloadBytes, r.Wait, r.Status, r.Reason)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", r.Client, r.Transport, r.Metric, r.PayloadBytes, r.Wait, r.N,
			us(r.P50), us(r.P99), us(r.Mean), rate(r.MsgsPerSec), r.Status)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(b.Out, "\nrtt: one request and its echoed response; msgs/s = round trips per second. one-way: records per second; p50/p99 = ns per record over 4096-record windows.")
	fmt.Fprintln(b.Out)
	harness.Verdicts(b.Out, b.Log, false, b.Quiet, verdicts)
	return nil
}

// Verdicts compares the rows with the design targets (targets.go), one line
// per target. They report; they never fail a run.
func Verdicts(rows []Row) []string {
	find := func(client, transport, metric string, size int, wait string) *Row {
		for i := range rows {
			r := &rows[i]
			if r.Client == client && r.Transport == transport && r.Metric == metric && r.PayloadBytes == size && r.Wait == wait && r.Status == "ok" {
				return r
			}
		}
		return nil
	}
	var out []string
	pp := find("go", "pingpong", "rtt", PingPongBytes, "spin")
	gs := find("go", "ring", "rtt", SmallPayload, "spin")
	if gs != nil {
		out = append(out, targetGoP50.Verdict(float64(gs.P50)/1e3, us(gs.P50)+" µs"))
	} else {
		out = append(out, targetGoP50.NotMeasured(""))
	}
	if gs != nil && pp != nil {
		f := float64(gs.P50) / float64(max(pp.P50, 1))
		out = append(out, targetGoPingPong.Verdict(f, fmt.Sprintf("%s µs vs ping-pong %s µs, %.1fx", us(gs.P50), us(pp.P50), f)))
	} else {
		out = append(out, targetGoPingPong.NotMeasured(""))
	}
	for _, t := range []struct {
		size   int
		target harness.Target
	}{{SmallPayload, targetPythonSmall}, {LargePayload, targetPythonLarge}} {
		if r := find("python", "ring", "rtt", t.size, "spin"); r != nil {
			out = append(out, t.target.Verdict(float64(r.P50)/1e3, us(r.P50)+" µs"))
		} else {
			out = append(out, t.target.NotMeasured(""))
		}
	}
	for _, client := range []string{"go", "python"} {
		for _, size := range []int{SmallPayload, LargePayload} {
			t := targetVsSocket.At(fmt.Sprintf("%s client, %s, spin", client, sizeName(size)))
			rr, ur := find(client, "ring", "rtt", size, "spin"), find(client, "uds", "rtt", size, "park")
			if rr == nil || ur == nil {
				out = append(out, t.NotMeasured(""))
				continue
			}
			f := float64(ur.P50) / float64(max(rr.P50, 1))
			out = append(out, t.Verdict(f, fmt.Sprintf("ring %s µs, socket %s µs, %.1fx", us(rr.P50), us(ur.P50), f)))
		}
	}
	if r := find("go", "ring", "one-way", ThroughputBytes, "spin"); r != nil {
		detail := rate(r.MsgsPerSec) + "/s"
		if r.P50 > 0 {
			// The median window shows the steady rate when a few windows
			// stalled (a descheduled side on a shared machine).
			detail += fmt.Sprintf("; median window %s/s", rate(1e9/float64(r.P50)))
		}
		out = append(out, targetThroughput.Verdict(r.MsgsPerSec/1e6, detail))
	} else {
		out = append(out, targetThroughput.NotMeasured(""))
	}
	return out
}

func sizeName(n int) string {
	if n >= 1<<10 && n%(1<<10) == 0 {
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}
