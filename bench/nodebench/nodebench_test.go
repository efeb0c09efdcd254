package nodebench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/benchcli"
)

// TestBenchNodeCommand runs `ringside-bench node` small and checks the
// rows' shape, that every fetched byte was compared and that every figure
// was measured: never the timings.
func TestBenchNodeCommand(t *testing.T) {
	var stdout, stderr bytes.Buffer
	app := benchcli.App()
	app.Writer, app.ErrWriter = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := app.RunContext(ctx, []string{"ringside-bench", "node", "--json", "--quiet", "--block-bytes", "16KiB,64KiB",
		"--blocks", "8", "--inflight", "2", "--working-bytes", "1MiB", "--total-bytes", "2MiB", "--reps", "2", "--dir", t.TempDir()})
	if err != nil {
		t.Fatalf("bench node: %v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("want 2 rows:\n%s", stdout.String())
	}
	for i, line := range lines {
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		num := func(k string) float64 { v, _ := r[k].(float64); return v }
		if r["bench"] != "node_fetch" || r["checked"] != true || num("block_bytes") != float64([]int{16 << 10, 64 << 10}[i]) ||
			num("blocks") != 8 || num("inflight") != 2 || num("fetch_gbps") <= 0 || num("copy_gbps") <= 0 || num("ratio") <= 0 || num("reps") != 2 || num("copy_crc_gbps") <= 0 || num("ratio_copy_crc") <= 0 ||
			num("bytes") < 2<<20 || num("working_bytes") < 1<<20 {
			t.Errorf("row %s", line)
		}
	}
}
