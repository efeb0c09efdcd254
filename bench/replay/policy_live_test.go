package replay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/benchcli"
	"github.com/ringside-kv/ringside/bench/internal/benchtest"
)

// replayJSON runs `ringside-bench replay --json --quiet` with args against
// real sidecar processes and returns its rows.
func replayJSON(t *testing.T, args ...string) []map[string]any {
	t.Helper()
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	argv := append([]string{"ringside-bench", "replay", "--json", "--quiet", "--no-uds", "--no-walk", "--out", "-", "--timeout", "60s"}, args...)
	if err := app.RunContext(ctx, append(argv, benchtest.Ringside(t)...)); err != nil {
		t.Fatalf("bench replay %v: %v\nstdout:\n%s\nstderr:\n%s", args, err, stdout.String(), stderr.String())
	}
	var rows []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var row map[string]any
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		rows = append(rows, row)
	}
	return rows
}

func num(row map[string]any, k string) float64 { v, _ := row[k].(float64); return v }

// checkMQPExact checks every run of a sequential --cache.policy mqp replay
// against the offline MQP (MQPPages, run by the command at the same
// time): hit pages, pages looked up, stored pages and the pool's blocks at
// the end (the change log's view against the model's resident pages). It
// returns, per capacity, whether the MQP differed from the offline LRU.
func checkMQPExact(t *testing.T, rows []map[string]any) map[float64]bool {
	t.Helper()
	return checkModelExact(t, rows, "mqp")
}

// checkModelExact is checkMQPExact for policy mqp or mqp2 (MQP2Pages).
func checkModelExact(t *testing.T, rows []map[string]any, policy string) map[float64]bool {
	t.Helper()
	differs := map[float64]bool{}
	runs := 0
	for _, row := range rows {
		switch row["bench"] {
		case "replay":
			runs++
			if row["policy"] != policy || row["oracle_match"] != true || num(row, "hit_pages") != num(row, "oracle_hit_pages") ||
				num(row, "stored_pages") != num(row, "oracle_stored_pages") || num(row, "view_blocks") != num(row, "oracle_resident_pages") {
				t.Errorf("live %s differs from its offline model: %v", policy, row)
			}
			if num(row, "oracle_skipped_pages") != -1 {
				t.Errorf("the %s model counts no refused stores (-1): %v", policy, row)
			}
		case "replay_policy":
			if row["policy"] != policy || row["live_equals_model"] != true || num(row, "live_hit_ratio") != num(row, policy+"_hit_ratio") {
				t.Errorf("live %s differs from its offline model: %v", policy, row)
			}
			differs[num(row, "capacity_pages")] = row["live_equals_lru"] != true
		}
	}
	if runs == 0 {
		t.Fatal("no replay rows")
	}
	return differs
}

// TestBenchReplayMQPExactAgentic replays the first 400 requests of the
// generated agentic workload (512-token pages) through live sidecars run
// with --cache.policy mqp, one request at a time: at 64 and 256 pages,
// where MQP's levels, tip history and lifetime act (the lifetime is
// measured there within the first few hundred requests), the live hits,
// stores and resident blocks equal the offline MQP's, and at 64 pages they
// differ from the LRU's (so the check would see a sidecar running LRU).
func TestBenchReplayMQPExactAgentic(t *testing.T) {
	if testing.Short() {
		t.Skip("starts sidecars")
	}
	rows := replayJSON(t, "--sequential", "--cache.policy", "mqp", "--workload", "agentic", "--seed", "3", "--limit", "400",
		"--page-tokens", "512", "--capacity-pages", "64", "--capacity-pages", "256")
	differs := checkMQPExact(t, rows)
	if !differs[64] {
		t.Errorf("at 64 pages MQP hit what LRU hits: the check cannot tell the policies apart (%v)", differs)
	}
}

// TestBenchReplayMQPExactMooncake does the same on the Mooncake trace:
// the shipped 300-request prefix (16-token pages, where MQP and LRU
// happen to agree) always; and, when the machine has the whole trace
// ($RINGSIDE_MOONCAKE_TRACE or /work/shared/traces), its first 3,000
// requests in 512-token pages at 1,024 pages, where they do not.
func TestBenchReplayMQPExactMooncake(t *testing.T) {
	if testing.Short() {
		t.Skip("starts sidecars")
	}
	checkMQPExact(t, replayJSON(t, "--sequential", "--cache.policy", "mqp", "--trace", "testdata/conversation_trace_300.jsonl",
		"--capacity-pages", "200", "--capacity-pages", "2000"))
	path := os.Getenv("RINGSIDE_MOONCAKE_TRACE")
	if path == "" {
		path = "/work/shared/traces/conversation_trace.jsonl"
	}
	if _, err := os.Stat(path); err != nil || raceEnabled {
		t.Skipf("the whole trace's part: no trace at %s, or the race detector", path)
	}
	differs := checkMQPExact(t, replayJSON(t, "--sequential", "--cache.policy", "mqp", "--trace", path, "--limit", "3000",
		"--page-tokens", "512", "--capacity-pages", "1024"))
	if !differs[1024] {
		t.Errorf("at 1024 pages MQP hit what LRU hits: the check cannot tell the policies apart")
	}
}

// TestBenchReplayMQP2Exact replays through live sidecars run with
// --cache.policy mqp2, one request at a time, at engine page sizes: the
// generated agentic workload's first 400 requests in 16-token pages (its
// scan's fresh requests, sessions whose new tails inherit, requests of
// thousands of pages in several copy chunks), and, where the machine has
// the whole Mooncake trace, its first 2,000 requests in 32-token pages
// (where the tip offset is learned and the lifetime measured): the live
// hits, stores and resident blocks equal the offline MQP2's, and differ
// from the LRU's.
func TestBenchReplayMQP2Exact(t *testing.T) {
	if testing.Short() {
		t.Skip("starts sidecars")
	}
	differs := checkModelExact(t, replayJSON(t, "--sequential", "--cache.policy", "mqp2", "--workload", "agentic", "--limit", "400",
		"--page-tokens", "16", "--capacity-pages", "2000", "--capacity-pages", "8000"), "mqp2")
	if !differs[2000] {
		t.Errorf("at 2000 pages MQP2 hit what LRU hits: the check cannot tell the policies apart (%v)", differs)
	}
	path := os.Getenv("RINGSIDE_MOONCAKE_TRACE")
	if path == "" {
		path = "/work/shared/traces/conversation_trace.jsonl"
	}
	if _, err := os.Stat(path); err != nil || raceEnabled {
		t.Skipf("the whole trace's part: no trace at %s, or the race detector", path)
	}
	differs = checkModelExact(t, replayJSON(t, "--sequential", "--cache.policy", "mqp2", "--trace", path, "--limit", "2000",
		"--page-tokens", "32", "--capacity-pages", "16000"), "mqp2")
	if !differs[16000] {
		t.Errorf("at 16000 pages MQP2 hit what LRU hits: the check cannot tell the policies apart")
	}
}
