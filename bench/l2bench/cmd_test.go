package l2bench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/benchcli"
	"github.com/ringside-kv/ringside/bench/internal/benchtest"
	"github.com/ringside-kv/ringside/internal/redistest"
)

func TestMain(m *testing.M) { benchtest.Main(m, "RINGSIDE_L2BENCH_TEST_CHILD") }

// TestBenchL2Command runs `ringside-bench l2` small, against a real
// redis-server and real sidecar processes, and checks the rows' shape and
// that every figure was measured (the command itself checks that every
// fetched byte is the stored one): never the timings.
func TestBenchL2Command(t *testing.T) {
	redistest.Require(t)
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, append([]string{"ringside-bench", "l2", "--json", "--quiet", "--topology", "single",
		"--value-bytes", "64KiB,256KiB", "--total-bytes", "4MiB", "--reps", "1", "--writers", "2"}, benchtest.Ringside(t)...))
	if err != nil {
		t.Fatalf("bench l2: %v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		num := func(k string) float64 { v, _ := r[k].(float64); return v }
		if r["bench"] != "l2" || r["topology"] != "single" || num("sidecar_gbps") <= 0 || num("ceiling_gbps") <= 0 || num("ratio") <= 0 || num("blocks") < 16 {
			t.Errorf("row %s", line)
		}
		seen[r["op"].(string)] = true
	}
	if !seen["store"] || !seen["fetch"] || len(strings.Split(strings.TrimSpace(stdout.String()), "\n")) != 4 {
		t.Fatalf("want 4 rows (store and fetch of two sizes):\n%s", stdout.String())
	}
}
