package replay_test

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/benchcli"
	"github.com/ringside-kv/ringside/bench/internal/benchtest"
	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

func TestMain(m *testing.M) { benchtest.Main(m, "RINGSIDE_REPLAY_TEST_CHILD") }

// TestBenchReplayCommand replays the first requests of the shipped trace
// through the real command line, real sidecar processes (two small
// capacities, so that eviction and refused stores happen) and the socket
// relays, one request at a time, and checks that every hit rate equals the
// offline LRU's exactly, and the shape of every row and file: never
// timings.
func TestBenchReplayCommand(t *testing.T) {
	requests := "300"
	if raceEnabled || testing.Short() {
		requests = "120"
	}
	dir := fmt.Sprintf("/dev/shm/ringside-replay-test-%d", os.Getpid())
	if _, err := os.Stat("/dev/shm"); err != nil {
		dir = filepath.Join(t.TempDir(), "sidecars")
	}
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, append([]string{"ringside-bench", "replay", "--json", "--quiet", "--sequential", "--cache.policy", "lru",
		"--trace", "testdata/conversation_trace_300.jsonl", "--limit", requests,
		"--capacity-pages", "200", "--capacity-pages", "2000", "--uds-capacity-pages", "200",
		"--engines", "2", "--dir", dir, "--out", out, "--timeout", "60s"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench replay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("sidecar dir %s left behind (stat: %v)", dir, err)
	}
	need := map[string][]string{
		"replay":         {"capacity_pages", "pages_per_block", "hit_ratio", "oracle_hit_ratio", "transport", "hit_pages", "oracle_hit_pages", "stored_pages", "oracle_stored_pages"},
		"replay_op":      {"op", "transport", "p50_ns", "p99_ns", "p999_ns", "max_ns", "capacity_pages"},
		"replay_sidecar": {"cpu_fraction", "peak_rss_bytes", "copy_bytes_per_sec", "capacity_pages", "transport"},
		"replay_policy":  {"capacity_pages", "live_hit_ratio", "lru_hit_ratio", "arc_hit_ratio", "min_block_hit_ratio", "min_prefix_hit_ratio", "live_over_lru", "mqp_hit_ratio", "mqp_over_lru"},
	}
	policies := 0
	caps := map[string]bool{}
	ops := map[string]bool{}
	sidecars := 0
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	for _, line := range lines {
		var row map[string]any
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("not JSON: %q: %v", line, err)
		}
		bench, _ := row["bench"].(string)
		fields, ok := need[bench]
		if !ok {
			t.Errorf("unknown bench %q: %s", bench, line)
			continue
		}
		for _, f := range fields {
			if _, ok := row[f]; !ok {
				t.Errorf("%s row without %s: %s", bench, f, line)
			}
		}
		num := func(k string) float64 { v, _ := row[k].(float64); return v }
		switch bench {
		case "replay":
			caps[fmt.Sprint(row["transport"], "/", num("capacity_pages"))] = true
			if num("pages_per_block") != 32 {
				t.Errorf("pages_per_block %v, want 32", row["pages_per_block"])
			}
			if num("hit_pages") != num("oracle_hit_pages") || num("hit_ratio") != num("oracle_hit_ratio") || row["oracle_match"] != true {
				t.Errorf("hit rate differs from the offline LRU: %s", line)
			}
			if num("stored_pages") != num("oracle_stored_pages") || num("skipped_pages") != num("oracle_skipped_pages") {
				t.Errorf("stored or refused pages differ from the offline LRU: %s", line)
			}
			if num("view_blocks") != num("oracle_resident_pages") {
				t.Errorf("the change log's view differs from the oracle's resident pages: %s", line)
			}
			if num("hit_pages") <= 0 || num("requests") <= 0 {
				t.Errorf("nothing hit: %s", line)
			}
			if num("capacity_pages") == 200 && num("oracle_skipped_pages") == 0 {
				t.Errorf("200 pages should refuse stores: %s", line)
			}
		case "replay_op":
			key := fmt.Sprint(row["transport"], "/", row["op"], "/", row["method"])
			ops[key] = true
			if num("p50_ns") <= 0 || num("p50_ns") > num("p99_ns") || num("p99_ns") > num("p999_ns") || num("p999_ns") > num("max_ns") {
				t.Errorf("percentiles out of order: %s", line)
			}
		case "replay_policy":
			policies++
			if row["live_equals_lru"] != true || num("live_hit_ratio") != num("lru_hit_ratio") || num("live_over_lru") != 1 {
				t.Errorf("live sidecar differs from the LRU: %s", line)
			}
			if b := num("min_block_hit_ratio"); b < num("lru_block_hit_ratio") || b < num("arc_block_hit_ratio") || b < num("lru_hit_ratio") || b < num("arc_hit_ratio") || b < num("min_prefix_hit_ratio") || b < num("mqp_block_hit_ratio") || b < num("mqp_hit_ratio") {
				t.Errorf("the optimum's bound is below a policy: %s", line)
			}
			if num("arc_hit_ratio") <= 0 {
				t.Errorf("ARC hit nothing: %s", line)
			}
		case "replay_sidecar":
			sidecars++
			if num("cpu_fraction") <= 0 || num("peak_rss_bytes") <= 0 || num("copy_bytes_per_sec") <= 0 {
				t.Errorf("empty sidecar figures: %s", line)
			}
		}
	}
	for _, c := range []string{"ring/200", "ring/2000", "uds/200"} {
		if !caps[c] {
			t.Errorf("no replay row for %s (have %v)", c, caps)
		}
	}
	for _, tr := range []string{"ring", "uds"} {
		for _, op := range []string{"lookup/<nil>", "acquire/<nil>", "load/<nil>", "store/<nil>", "step/delta", "step/walk"} {
			if !ops[tr+"/"+op] {
				t.Errorf("no replay_op row for %s/%s", tr, op)
			}
		}
	}
	if policies != 2 {
		t.Errorf("%d replay_policy rows, want 2 (one per capacity of the ring)", policies)
	}
	if sidecars != 3 {
		t.Errorf("%d replay_sidecar rows, want 3 (one per sidecar process)", sidecars)
	}

	for _, f := range []string{"hit-rate.png", "policies.png", "latency.png", "step-cost.png"} {
		b, err := os.ReadFile(filepath.Join(out, f))
		if err != nil || len(b) < 2000 || !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) {
			t.Errorf("%s: not a PNG (%d bytes, %v)", f, len(b), err)
		}
	}
	for f, rows := range map[string]int{"capacity.csv": 3, "policies.csv": 2, "sidecar.csv": 3, "ops.csv": 10, "steps.csv": 300} {
		b, err := os.ReadFile(filepath.Join(out, f))
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		recs, err := csv.NewReader(bytes.NewReader(b)).ReadAll()
		if err != nil || len(recs) < 1+min(rows, 3) {
			t.Errorf("%s: %d records (%v)", f, len(recs), err)
			continue
		}
		if f == "capacity.csv" && (recs[0][0] != "bench" || !strings.Contains(strings.Join(recs[0], ","), "oracle_hit_ratio")) {
			t.Errorf("%s header: %v", f, recs[0])
		}
	}
	b, err := os.ReadFile(filepath.Join(out, "replay.jsonl"))
	if err != nil || strings.Count(string(b), "\n") != len(lines) {
		t.Errorf("replay.jsonl: %d lines, stdout %d (%v)", strings.Count(string(b), "\n"), len(lines), err)
	}
}

// TestBenchReplayText checks the human-readable report: the tables, the
// oracle column and the verdicts, from a short concurrent run under the
// default policy, serve's (named in the report and its verdict).
func TestBenchReplayText(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a sidecar")
	}
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, append([]string{"ringside-bench", "replay", "--quiet", "--no-uds",
		"--trace", "testdata/conversation_trace_300.jsonl", "--limit", "60",
		"--capacity-pages", "500", "--out", "-", "--timeout", "60s"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench replay: %v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	s := stdout.String()
	for _, want := range []string{"hit ratio", "oracle", "step (delta)", "step (walk)", "p99.9",
		"target lookup p99 < 20 µs", "target acquire-and-poll p99 < 50 µs", "target sidecar CPU < 25%",
		"target hit rate equal to the offline " + strings.ToUpper(cache.DefaultPolicy.String()), "eviction policy " + cache.DefaultPolicy.String(), "GiB equiv",
		"prefix-hit ratio by policy", "ARC (vLLM)", "optimum (bound)", "following MIN"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
}

// TestBenchReplayAgentic replays the first requests of the generated
// agentic workload in 512-token pages through a live sidecar, one at a
// time: the live hit rate equals the LRU's, and the optimum bounds LRU
// and ARC.
func TestBenchReplayAgentic(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a sidecar")
	}
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, append([]string{"ringside-bench", "replay", "--json", "--quiet", "--sequential", "--no-uds", "--no-walk",
		"--cache.policy", "lru", "--workload", "agentic", "--seed", "3", "--limit", "400", "--page-tokens", "512",
		"--capacity-pages", "64", "--capacity-pages", "1024", "--out", "-", "--timeout", "60s"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench replay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	rows := 0
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var row map[string]any
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		if row["bench"] != "replay_policy" {
			continue
		}
		rows++
		num := func(k string) float64 { v, _ := row[k].(float64); return v }
		if row["live_equals_lru"] != true || num("live_hit_ratio") <= 0 || num("page_tokens") != 512 || !strings.HasPrefix(row["workload"].(string), "agentic") {
			t.Errorf("live run: %s", line)
		}
		if b := num("min_block_hit_ratio"); b < num("lru_block_hit_ratio") || b < num("arc_block_hit_ratio") {
			t.Errorf("the optimum's bound is below a policy: %s", line)
		}
	}
	if rows != 2 {
		t.Errorf("%d replay_policy rows, want 2:\n%s", rows, stdout.String())
	}
}

// TestBenchReplayNodesSharingATier replays the trace on two nodes (two
// sidecar processes, a pool each) with and without a shared tier on a
// real redis-server, one request at a time: every hit rate, every page
// fetched from the tier and every page loaded equals the exact offline
// model of per-node LRU pools plus the tier, and the tier adds hits.
func TestBenchReplayNodesSharingATier(t *testing.T) {
	redistest.Require(t)
	srv := redistest.Single(t, redistest.Options{})
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	requests := "120"
	if raceEnabled || testing.Short() {
		requests = "60"
	}
	dir := fmt.Sprintf("/dev/shm/ringside-replay-fleet-test-%d", os.Getpid())
	if _, err := os.Stat("/dev/shm"); err != nil {
		dir = filepath.Join(t.TempDir(), "sidecars")
	}
	err := app.RunContext(ctx, append([]string{"ringside-bench", "replay", "--json", "--quiet", "--sequential", "--no-uds", "--no-walk",
		"--cache.policy", "lru", "--trace", "testdata/conversation_trace_300.jsonl", "--limit", requests,
		"--capacity-pages", "200", "--capacity-pages", "2000", "--engines", "2", "--nodes", "2",
		"--l2.redis.addrs", srv.Addr, "--dir", dir, "--out", "-", "--timeout", "60s"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench replay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	hit := map[string]float64{}
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var row map[string]any
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		if row["bench"] != "replay" {
			continue
		}
		num := func(k string) float64 { v, _ := row[k].(float64); return v }
		key := fmt.Sprint(row["transport"], "/", num("capacity_pages"))
		hit[key] = num("hit_ratio")
		if num("nodes") != 2 || row["oracle_match"] != true || num("stored_pages") != num("oracle_stored_pages") ||
			num("skipped_pages") != num("oracle_skipped_pages") || num("view_blocks") != num("oracle_resident_pages") {
			t.Errorf("differs from the model: %s", line)
		}
		if num("loaded_pages") != num("oracle_loaded_pages") || num("fetched_pages") != num("oracle_fetched_pages") {
			t.Errorf("loaded or fetched pages differ from the model: %s", line)
		}
		if row["tier"] == true && num("capacity_pages") == 2000 && num("fetched_pages") == 0 {
			t.Errorf("nothing came from the tier: %s", line)
		}
	}
	for _, c := range []string{"200", "2000"} {
		if _, ok := hit["ring+l2/"+c]; !ok {
			t.Fatalf("no tier row at %s pages: %v", c, hit)
		}
	}
	if hit["ring+l2/2000"] <= hit["ring/2000"] {
		t.Errorf("the tier added no hits: %v", hit)
	}
}

// TestBenchReplayOffline: --offline starts no sidecar (none is needed:
// --ringside names nothing) and prints, and writes, the policy rows alone
// at the sweep's capacities, MQP2 among them, with policies.png.
func TestBenchReplayOffline(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	err := app.Run([]string{"ringside-bench", "replay", "--offline", "--json", "--quiet", "--ringside", "/nonexistent/ringside",
		"--trace", "testdata/conversation_trace_300.jsonl", "--page-tokens", "32", "--capacity-pages", "500,2000", "--out", out})
	if err != nil {
		t.Fatalf("bench replay --offline: %v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	rows := 0
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var row map[string]any
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		if row["bench"] != "replay_policy" || row["transport"] != "offline" {
			t.Errorf("offline row: %s", line)
			continue
		}
		rows++
		if v, ok := row["mqp2_hit_ratio"].(float64); !ok || v <= 0 || row["page_tokens"] != 32.0 {
			t.Errorf("no MQP2 ratio or page size: %s", line)
		}
	}
	if rows != 2 {
		t.Errorf("%d policy rows, want 2 (one per capacity)", rows)
	}
	if b, err := os.ReadFile(filepath.Join(out, "policies.png")); err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Errorf("policies.png: %v", err)
	}
}

// TestBenchReplayNodeTier replays agentic requests through three pods'
// sidecars, first with pools of their share of the capacity each, then
// with smaller pools over one real `ringside node` process holding the
// rest, one request at a time, under the pods' default policy (MQP2) and
// under LRU, and checks every count against the model (OracleNodeTier:
// the pods' policy over an LRU node pool), the node process's own among
// them; that the node tier served hits; and that the two policies' hits
// differ (the check can tell them apart).
func TestBenchReplayNodeTier(t *testing.T) {
	requests := "200"
	if raceEnabled || testing.Short() {
		requests = "120"
	}
	dir := fmt.Sprintf("/dev/shm/ringside-replay-nodetier-test-%d", os.Getpid())
	if _, err := os.Stat("/dev/shm"); err != nil {
		dir = filepath.Join(t.TempDir(), "sidecars")
	}
	hit := map[string]float64{}
	for _, policy := range []string{"", "lru"} { // "": the default
		var stdout, stderr bytes.Buffer
		app := benchcli.App()
		app.Writer, app.ErrWriter = &stdout, &stderr
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		args := []string{"ringside-bench", "replay", "--json", "--quiet", "--sequential", "--no-uds", "--no-walk",
			"--workload", "agentic", "--limit", requests, "--page-tokens", "128",
			"--capacity-pages", "480,1920", "--engines", "3", "--node-tier", "--node-tier.pod-fraction", "0.25",
			"--dir", dir, "--out", "-", "--timeout", "60s"}
		if policy != "" {
			args = append(args, "--cache.policy", policy)
		}
		err := app.RunContext(ctx, append(args, benchtest.Ringside(t)...))
		cancel()
		if err != nil {
			t.Fatalf("bench replay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
		}
		runs := 0
		for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
			var row map[string]any
			if err := json.Unmarshal([]byte(line), &row); err != nil {
				t.Fatalf("not JSON: %q", line)
			}
			if row["bench"] != "replay" {
				continue
			}
			runs++
			num := func(k string) float64 { v, _ := row[k].(float64); return v }
			if want := policy; row["policy"] != want && (want != "" || row["policy"] != "mqp2") {
				t.Errorf("policy %v, want %q (mqp2 by default): %s", row["policy"], want, line)
			}
			key := fmt.Sprint(row["policy"], "/", row["transport"], "/", num("capacity_pages"))
			hit[key] = num("hit_ratio")
			if num("nodes") != 3 || row["oracle_match"] != true || num("stored_pages") != num("oracle_stored_pages") ||
				num("skipped_pages") != num("oracle_skipped_pages") || num("view_blocks") != num("oracle_resident_pages") ||
				num("loaded_pages") != num("oracle_loaded_pages") || num("fetched_pages") != num("oracle_fetched_pages") {
				t.Errorf("differs from the model: %s", line)
			}
			pods, node := num("pod_pages"), num("node_tier_pages")
			switch row["transport"] {
			case "ring":
				if row["node_tier"] != false || node != 0 || pods != num("capacity_pages")/3 {
					t.Errorf("the pods' own pools are not the capacity split three ways: %s", line)
				}
			case "ring+node":
				if row["node_tier"] != true || pods != num("capacity_pages")/12 || 3*pods+node != num("capacity_pages") {
					t.Errorf("the split is not pools of a quarter over a node tier of the rest: %s", line)
				}
				if num("node_tier_stored_pages") != num("oracle_node_tier_stored_pages") || num("node_tier_evictions") != num("oracle_node_tier_evictions") {
					t.Errorf("the node process's writes or evictions differ from the model: %s", line)
				}
				if num("fetched_pages") == 0 || num("node_tier_stored_pages") == 0 {
					t.Errorf("nothing went through the node tier: %s", line)
				}
			default:
				t.Errorf("unexpected transport: %s", line)
			}
		}
		if runs != 4 {
			t.Fatalf("policy %q: want 4 runs (2 capacities, 2 splits), got %d", policy, runs)
		}
	}
	for _, p := range []string{"mqp2", "lru"} {
		if hit[p+"/ring+node/480"] <= hit[p+"/ring/480"] {
			t.Errorf("%s: the node tier added no hits at 480 pages: %v", p, hit)
		}
	}
	same := true
	for k, v := range hit {
		if strings.HasPrefix(k, "mqp2/") && hit["lru/"+strings.TrimPrefix(k, "mqp2/")] != v {
			same = false
		}
	}
	if same {
		t.Errorf("MQP2 pods hit what LRU pods hit in every run; the check cannot tell them apart: %v", hit)
	}
}

// TestBenchReplayNodeTierFlags: --node-tier refuses what it cannot model
// or split.
func TestBenchReplayNodeTierFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--node-tier", "--nodes", "2", "--engines", "3"},
		{"--node-tier", "--l2.start", "single"},
		{"--node-tier", "--capacity-pages", "40", "--engines", "4"},
		{"--node-tier", "--node-tier.pod-fraction", "1.5"},
		{"--node-tier.pod-fraction", "0.5"},
	} {
		var stdout, stderr bytes.Buffer
		app := benchcli.App()
		app.Writer, app.ErrWriter = &stdout, &stderr
		full := append([]string{"ringside-bench", "replay", "--quiet", "--sequential", "--workload", "agentic", "--limit", "10", "--out", "-"}, args...)
		if err := app.Run(append(full, benchtest.Ringside(t)...)); err == nil {
			t.Errorf("%v: accepted", args)
		}
	}
}
