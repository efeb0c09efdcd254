package pollbench_test

import (
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
	"github.com/ringside-kv/ringside/bench/pollbench"
)

func TestMain(m *testing.M) { benchtest.Main(m, "RINGSIDE_POLLBENCH_TEST_CHILD") }

// TestBenchPollCommand runs `ringside-bench poll --json` briefly through the
// real command line, a real sidecar process and the relay, and checks the
// rows and their fields: shape, never timing.
func TestBenchPollCommand(t *testing.T) {
	dir := fmt.Sprintf("/dev/shm/ringside-pollbench-test-%d", os.Getpid())
	if _, err := os.Stat("/dev/shm"); err != nil {
		dir = t.TempDir() + "/bench"
	}
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, append([]string{"ringside-bench", "poll", "--json", "--quiet",
		"--polls", "50", "--warmup", "10", "--dir", dir, "--timeout", "60s"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench poll: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("bench dir %s left behind (stat: %v)", dir, err)
	}
	type key struct {
		client, transport string
		hashes            int
	}
	got := map[key]pollbench.Row{}
	pythonSkipped := ""
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var raw map[string]any
		if err := json.Unmarshal([]byte(line), &raw); err != nil {
			t.Fatalf("not JSON: %q: %v", line, err)
		}
		for _, f := range []string{"bench", "client", "transport", "hashes", "p50_ns", "batch_p50_ns", "p99_ns"} {
			if _, ok := raw[f]; !ok {
				t.Errorf("row without %s: %s", f, line)
			}
		}
		var r pollbench.Row
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatal(err)
		}
		if r.Bench != "poll" {
			t.Errorf("bench %q: %s", r.Bench, line)
		}
		if r.Skipped != "" {
			if r.Client != "python" {
				t.Errorf("only the python row may be skipped: %s", line)
			}
			pythonSkipped = r.Skipped
			continue
		}
		k := key{r.Client, r.Transport, r.Hashes}
		if _, dup := got[k]; dup {
			t.Errorf("duplicate row %+v", k)
		}
		got[k] = r
		if len(r.BatchP50Ns) != 3 || r.Polls != 50 {
			t.Errorf("%+v: %d batches of %d polls, want 3 of 50", k, len(r.BatchP50Ns), r.Polls)
		}
		lo, hi := r.BatchP50Ns[0], r.BatchP50Ns[0]
		for _, p := range r.BatchP50Ns {
			lo, hi = min(lo, p), max(hi, p)
		}
		if r.P50Ns <= 0 || r.P50Ns < lo || r.P50Ns > hi || r.P99Ns < lo {
			t.Errorf("%+v: p50 %d not the median of %v, or p99 %d below it", k, r.P50Ns, r.BatchP50Ns, r.P99Ns)
		}
	}
	for _, n := range []int{64, 256, 1024} {
		for _, tr := range []string{"ring", "uds"} {
			if _, ok := got[key{"go", tr, n}]; !ok {
				t.Errorf("no go/%s row for %d hashes", tr, n)
			}
		}
		if _, ok := got[key{"python", "ring", n}]; !ok && pythonSkipped == "" {
			t.Errorf("python row for %d hashes neither measured nor skipped", n)
		}
	}
	if pythonSkipped != "" {
		t.Logf("python row skipped: %s", pythonSkipped)
	}
}

// TestBenchPollText checks the human-readable output: a table, the
// reference and the verdicts.
func TestBenchPollText(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a sidecar")
	}
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, append([]string{"ringside-bench", "poll", "--quiet", "--no-python", "--no-uds",
		"--polls", "20", "--warmup", "5", "--sizes", "64,1024", "--timeout", "60s"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench poll: %v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"transport", "106.39 us", "target go/ring p50 <= 1 µs (every size)", "flat: p50 at the most hashes <= 1.2x p50 at the fewest (go/ring, 1024 vs 64 hashes)"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}
