package ringbench_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/benchcli"
	"github.com/ringside-kv/ringside/bench/internal/benchtest"
)

func TestMain(m *testing.M) { benchtest.Main(m, "RINGSIDE_RINGBENCH_TEST_CHILD") }

// TestBenchRingCommand runs `ringside-bench ring --json` in a short mode,
// through the real command line and real server processes, and checks the
// shape of the output: every row and every field, never a timing.
func TestBenchRingCommand(t *testing.T) {
	dir := fmt.Sprintf("/dev/shm/ringside-bench-test-%d", os.Getpid())
	if _, err := os.Stat("/dev/shm"); err != nil {
		dir = t.TempDir() + "/bench" // still removed by the run, since it creates it
	}
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, []string{"ringside-bench", "ring", "--json", "--quiet",
		"--rounds", "200", "--warmup", "20", "--msgs", "20000", "--dir", dir, "--timeout", "60s"})
	if err != nil {
		t.Fatalf("bench ring: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("bench dir %s left behind (stat: %v)", dir, err)
	}

	type key struct {
		client, transport, metric string
		payload                   int
		wait                      string
	}
	want := map[key]bool{}
	for _, size := range []int{16, 8192} {
		for _, client := range []string{"go", "python"} {
			want[key{client, "ring", "rtt", size, "spin"}] = true
			want[key{client, "ring", "rtt", size, "park"}] = true
			want[key{client, "uds", "rtt", size, "park"}] = true
		}
	}
	want[key{"go", "pingpong", "rtt", 8, "spin"}] = true
	want[key{"go", "ring", "one-way", 64, "spin"}] = true

	fields := []string{"bench", "client", "transport", "metric", "payload_bytes", "wait", "n", "p50_ns", "p99_ns", "mean_ns", "msgs_per_sec", "status"}
	sc := bufio.NewScanner(&stdout)
	seen := map[key]bool{}
	for sc.Scan() {
		line := sc.Bytes()
		var m map[string]any
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatalf("not a JSON line: %q: %v", line, err)
		}
		for _, f := range fields {
			if _, ok := m[f]; !ok {
				t.Errorf("row %s lacks %q", line, f)
			}
		}
		var r struct {
			Bench, Client, Transport, Metric, Wait, Status, Reason string
			Payload                                                int     `json:"payload_bytes"`
			N                                                      int     `json:"n"`
			P50                                                    int64   `json:"p50_ns"`
			P99                                                    int64   `json:"p99_ns"`
			Rate                                                   float64 `json:"msgs_per_sec"`
		}
		if err := json.Unmarshal(line, &r); err != nil {
			t.Fatal(err)
		}
		k := key{r.Client, r.Transport, r.Metric, r.Payload, r.Wait}
		if !want[k] {
			t.Errorf("unexpected row %s", line)
		}
		if seen[k] {
			t.Errorf("duplicate row %s", line)
		}
		seen[k] = true
		if r.Bench != "ring" {
			t.Errorf("bench %q in %s", r.Bench, line)
		}
		switch {
		case r.Status == "ok":
			if r.N <= 0 || r.P50 <= 0 || r.P99 < r.P50 || r.Rate <= 0 {
				t.Errorf("ok row without figures: %s", line)
			}
		case r.Status == "skipped" && r.Client == "python":
			if r.Reason == "" {
				t.Errorf("skipped row without a reason: %s", line)
			}
			t.Logf("skipped: %s", line)
		default:
			t.Errorf("row not ok: %s", line)
		}
	}
	for k := range want {
		if !seen[k] {
			t.Errorf("missing row %+v", k)
		}
	}
	if t.Failed() {
		t.Logf("stderr:\n%s", stderr.String())
	}
}

// TestBenchRingPythonSkipped checks that a missing interpreter skips the
// Python rows with a reason instead of failing the run.
func TestBenchRingPythonSkipped(t *testing.T) {
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	err := app.Run([]string{"ringside-bench", "ring", "--json", "--quiet", "--python", "/nonexistent/python3",
		"--rounds", "20", "--warmup", "2", "--msgs", "2000", "--timeout", "60s"})
	if err != nil {
		t.Fatalf("bench ring: %v\n%s", err, stderr.String())
	}
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var r struct{ Client, Status, Reason string }
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		if r.Client == "python" {
			n++
			if r.Status != "skipped" || !strings.Contains(r.Reason, "interpreter") {
				t.Errorf("python row not skipped with a reason: %s", line)
			}
		}
	}
	if n != 6 {
		t.Errorf("%d python rows, want 6", n)
	}
}
