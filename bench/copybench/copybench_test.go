package copybench

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu/gputest"
)

func TestMain(m *testing.M) {
	if k := os.Getenv(gputest.PeerEnv); k != "" {
		os.Exit(gputest.PeerMain(k))
	}
	os.Exit(m.Run())
}

func run(t *testing.T, backend string) []Row {
	rows, err := Run(Config{Backend: backend, PageBytes: []uint64{16 << 10}, Pages: []int{1, 64}, MinTime: time.Millisecond,
		PeerArgv: []string{os.Args[0], "-test.run=^$"}, Quiet: true})
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

func TestHostRows(t *testing.T) {
	for _, r := range run(t, "host") {
		if r.Status != "ok" || r.Reps < 3 || r.GBps <= 0 {
			t.Errorf("row %+v", r)
		}
	}
}

// TestCUDABatchedRows runs the CUDA rows against the fake driver
// (gpu/gputest/testdata/fakecuda.c): a batched row is one
// cuMemcpyBatchAsync per op, and when the driver rejects batches the
// batched rows say they were not batched instead of passing per-range
// copies off as batched ones.
func TestCUDABatchedRows(t *testing.T) {
	if os.Getenv("RINGSIDE_COPYBENCH_FAKE") != "" {
		want := "ok"
		if os.Getenv("FAKECUDA_BATCHFAIL") != "" {
			want = "not_batched"
		}
		batched, marked := 0, 0
		for _, r := range run(t, "cuda") {
			if r.Mode != "batched" {
				continue
			}
			batched++
			if r.Status == want {
				marked++
			}
			// After the first not_batched row the rest are skipped.
			if ok := r.Status == want || want == "not_batched" && r.Status == "skipped"; !ok {
				t.Errorf("batched row %d x %d: status %q (%s), want %q", r.Pages, r.PageBytes, r.Status, r.Reason, want)
			}
			if want == "ok" && r.Calls != 1 {
				t.Errorf("batched row %d x %d: %d calls per op, want 1", r.Pages, r.PageBytes, r.Calls)
			}
			t.Logf("%+v", r)
		}
		if batched == 0 || marked == 0 {
			t.Errorf("%d batched rows, %d of them %q", batched, marked, want)
		}
		return
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to build the fake driver")
	}
	dir := t.TempDir()
	build := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-o", filepath.Join(dir, "libcuda.so.1"), "../../gpu/gputest/testdata/fakecuda.c")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the fake driver: %v\n%s", err, out)
	}
	for _, env := range []string{"", "FAKECUDA_BATCHFAIL=1"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCUDABatchedRows$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+dir, "RINGSIDE_COPYBENCH_FAKE=1")
		if env != "" {
			cmd.Env = append(cmd.Env, env)
		}
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "PASS") {
			t.Fatalf("under the fake driver (%s): %v\n%s", env, err, out)
		}
		if testing.Verbose() {
			t.Logf("%s", out)
		}
	}
}

// The targets' verdicts: each compares its rows with the same run's
// ceiling of the same bytes, and a target without rows says so.
func TestVerdicts(t *testing.T) {
	row := func(dir, mode string, pb uint64, n int, gbps, us float64) Row {
		return Row{Backend: "cuda", Direction: dir, Mode: mode, PageBytes: pb, Pages: n, Bytes: pb * uint64(n), GBps: gbps, MeanUS: us, Status: "ok"}
	}
	rows := []Row{
		row("h2d", "batched", 2<<20, 128, 46, 5800), row("h2d", "ceiling", 2<<20, 128, 50, 5400),
		row("d2h", "batched", 2<<20, 128, 40, 6700), row("d2h", "ceiling", 2<<20, 128, 50, 5400),
		row("h2d", "batched", 32<<10, 8192, 25, 10700), row("h2d", "ceiling", 32<<10, 8192, 50, 5400),
		row("h2d", "batched", 32<<10, 16, 1, 500), // a smaller count: not the one judged
	}
	got := strings.Join(Verdicts(rows), "\n")
	for _, want := range []string{
		"target cross-layer 2 MiB blocks batched >= 0.9x the ceiling (h2d, 128 pages): met (46.00 vs 50.00 GB/s, 0.92x)",
		"target cross-layer 2 MiB blocks batched >= 0.9x the ceiling (d2h, 128 pages): MISSED (40.00 vs 50.00 GB/s, 0.80x)",
		"target per-layer 32 KiB ranges batched >= 0.6x the ceiling (h2d, 8192 pages): MISSED (25.00 vs 50.00 GB/s, 0.50x)",
		"target per-layer 32 KiB ranges batched >= 0.6x the ceiling (d2h): not measured",
		"target load of a 2,048-token prefix (256 MiB) < 8 ms (32K ranges): MISSED (10.7ms, 0 ranges)",
		"target load of a 2,048-token prefix (256 MiB) < 8 ms (2M ranges): met (5.8ms, 0 ranges)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("verdicts lack %q:\n%s", want, got)
		}
	}
	rows[0].Backend = "host"
	for i := range rows {
		rows[i].Backend = "host"
	}
	if v := Verdicts(rows); v != nil {
		t.Errorf("host rows got GPU verdicts: %v", v)
	}
}
