// Package gpu holds run.sh, the check of the CUDA copy engine on a GPU
// machine, its probes, and the test that runs it end to end in its dry
// mode against the stand-in driver (gpu/gputest/testdata/fakecuda.c).
package gpu

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"
)

// The files a run leaves in $OUT; a GPU run must bring back at most 8.
var outFiles = []string{
	"gpu.txt", "conformance.txt", "copy.jsonl", "copy.txt", "serve.txt", "probe_torch.txt", "probe_e2e.txt",
	"probe_ipc.txt",
}

var ipcProbes = []string{
	"ipc-range", "ipc-corrupt-handle", "vmm-export", "ipc-event", "vmm-fd-export", "vmm-fd-import",
	"vmm-release-mapped", "vmm-export-unrequested", "vmm-pointer-attrs", "exporter-death", "vmm-map-rules", "event-death",
}

// goFlags are the flags this test binary was built with that change what
// a package compiles to (-race, -tags, -trimpath): run.sh's builds reuse
// the packages `go test` compiled already instead of compiling them again.
func goFlags() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var flags []string
	for _, s := range bi.Settings {
		switch {
		case (s.Key == "-race" || s.Key == "-trimpath") && s.Value == "true":
			flags = append(flags, s.Key)
		case s.Key == "-tags" && s.Value != "":
			flags = append(flags, "-tags="+s.Value)
		}
	}
	return strings.Join(flags, " ")
}

// TestRunDry runs `run.sh dry`: every step of the GPU check (conformance
// with RINGSIDE_REQUIRE_GPU=1, the copy benchmark, the serve check, both
// probes) against the stand-in driver, and checks what lands in $OUT.
func TestRunDry(t *testing.T) {
	for _, tool := range []string{"bash", "gcc", "python3", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("run.sh dry needs %s (bash runs it, gcc builds the stand-in driver, python3 runs the probes, go builds the binaries): %v", tool, err)
		}
	}
	out, bin := t.TempDir(), t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "run.sh", "dry")
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		k, _, _ := strings.Cut(kv, "=")
		return k == "RINGSIDE_PREBUILT" || k == "COPY_ARGS" || k == "PYTHON" || strings.HasPrefix(k, "FAKECUDA_")
	})
	cmd.Env = append(env, "OUT="+out, "RINGSIDE_GPU_BIN="+bin, "RINGSIDE_GPU_GOFLAGS="+goFlags())
	start := time.Now()
	stdout, err := cmd.CombinedOutput()
	t.Logf("run.sh dry took %v (build flags %q)", time.Since(start).Round(time.Second), goFlags())
	if err != nil {
		t.Fatalf("run.sh dry: %v\n%s", err, stdout)
	}
	if testing.Verbose() {
		t.Logf("%s", stdout)
	}

	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	slices.Sort(got)
	want := slices.Sorted(slices.Values(outFiles))
	if !slices.Equal(got, want) || len(got) > 8 {
		t.Errorf("$OUT holds %v, want %v (at most 8 files come back from a GPU machine)", got, want)
	}
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		if len(bytes.TrimSpace(b)) == 0 {
			t.Errorf("%s is empty", name)
		}
		return string(b)
	}

	if g := read("gpu.txt"); !strings.Contains(g, "dry run:") {
		t.Errorf("gpu.txt does not say it is a dry run:\n%s", g)
	}

	conf := read("conformance.txt")
	for _, want := range []string{"--- PASS: TestConformance ", "--- PASS: TestConformance/cuda ", "--- PASS: TestCUDARegister ", "\nPASS\n", "ringside fake GPU"} {
		if !strings.Contains(conf, want) {
			t.Errorf("conformance.txt lacks %q", strings.TrimSpace(want))
		}
	}
	if m := regexp.MustCompile(`(?m)^\s*--- (FAIL|SKIP): .*`).FindAllString(conf, -1); len(m) > 0 {
		t.Errorf("conformance.txt has failed or skipped tests under RINGSIDE_REQUIRE_GPU=1: %q", m)
	}
	if !strings.Contains(string(stdout), "conformance: PASS") {
		t.Errorf("run.sh did not report conformance: PASS")
	}

	rows, ok := 0, 0
	sc := bufio.NewScanner(strings.NewReader(read("copy.jsonl")))
	for sc.Scan() {
		var r struct {
			Backend, Direction, Mode, Status, Device string
			PageBytes                                uint64 `json:"page_bytes"`
		}
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("copy.jsonl: %v: %s", err, sc.Bytes())
		}
		rows++
		if r.Backend != "cuda" || r.Device != "ringside fake GPU" {
			t.Errorf("copy.jsonl row of backend %q on %q, want cuda on the stand-in", r.Backend, r.Device)
		}
		if r.Status == "ok" {
			ok++
		}
	}
	if rows == 0 || ok == 0 {
		t.Errorf("copy.jsonl has %d rows, %d ok", rows, ok)
	}
	if c := read("copy.txt"); !strings.Contains(c, "BACKEND") || !strings.Contains(c, "5M") {
		t.Errorf("copy.txt has no table with 5 MiB pages:\n%s", c)
	}

	serve := read("serve.txt")
	for _, want := range []string{"serve gpu: PASS", "serve no-gpu: PASS", "CUDA copy backend ready"} {
		if !strings.Contains(serve, want) {
			t.Errorf("serve.txt lacks %q:\n%s", want, serve)
		}
	}

	probe := regexp.MustCompile(`(?m)^PROBE ([a-z0-9-]+): (.+) \((.*)\)$`)
	verdicts := func(file string) map[string]string {
		v := map[string]string{}
		for _, m := range probe.FindAllStringSubmatch(read(file), -1) {
			v[m[1]] = m[2]
			if m[2] == "error" {
				t.Errorf("%s: probe %s broke: %s", file, m[1], m[0])
			}
		}
		return v
	}
	// No CUDA torch here: the torch probe says so.
	if v := verdicts("probe_torch.txt"); v["torch"] != "skipped" {
		t.Errorf("probe_torch.txt: want `PROBE torch: skipped (...)` without CUDA torch, got %v", v)
	}
	// The connector's GPU path against the stand-in and a real sidecar: both
	// layouts round trip byte-exact, and a store whose event is recorded
	// behind the (stand-in's) GPU sleep waits for it.
	e2e := read("probe_e2e.txt")
	for p, want := range map[string]string{
		"e2e-lbnhc":          "round trip byte-exact",
		"e2e-blnhc":          "round trip byte-exact",
		"e2e-delayed-record": "the store waited",
	} {
		if v := verdicts("probe_e2e.txt")[p]; v != want {
			t.Errorf("probe_e2e.txt: %s: %q, want %q against the stand-in:\n%s", p, v, want, e2e)
		}
	}
	if m := regexp.MustCompile(`; pid (\d+)\n`).FindStringSubmatch(e2e); m == nil {
		t.Errorf("probe_e2e.txt has no header line with its pid")
	} else if left, _ := filepath.Glob("/dev/shm/fakecuda-" + m[1] + "-*"); len(left) > 0 {
		t.Errorf("probe_e2e.py left stand-in device memory behind: %v", left)
	}
	// The stand-in keeps device memory in /dev/shm files; the probe's own
	// must be gone, even after a sticky error refused their cuMemFree.
	if m := regexp.MustCompile(`(?m)^driver .*, pid (\d+)$`).FindStringSubmatch(read("probe_ipc.txt")); m == nil {
		t.Errorf("probe_ipc.txt has no header line with its pid")
	} else if left, _ := filepath.Glob("/dev/shm/fakecuda-" + m[1] + "-*"); len(left) > 0 {
		t.Errorf("probe_ipc.py left stand-in device memory behind: %v", left)
	}
	v := verdicts("probe_ipc.txt")
	for _, p := range ipcProbes {
		if _, ok := v[p]; !ok {
			t.Errorf("probe_ipc.txt has no line for probe %s", p)
		}
	}
	// What the stand-in implements has one answer.
	if r := v["ipc-corrupt-handle"]; !strings.HasPrefix(r, "open fails with ") {
		t.Errorf("ipc-corrupt-handle: %q; the stand-in refuses a corrupt handle", r)
	}
	if r := v["ipc-range"]; r != "exact" && !strings.HasPrefix(r, "rounded up") {
		t.Errorf("ipc-range: %q, want exact or rounded up", r)
	}
	// The VMM probes: the stand-in's model (fakecuda.c) has one answer each,
	// so a probe that stops exercising it, or a model that drifts from what
	// the probe checks on a GPU, fails here. (A prefix: the line's last
	// parenthesis holds the details, and verdicts may hold one too.)
	for p, want := range map[string]string{
		"vmm-export":             "export fails with CUDA_ERROR_INVALID_VALUE (1)",
		"vmm-fd-export":          "exports a file descriptor",
		"vmm-fd-import":          "bytes move both ways",
		"vmm-release-mapped":     "the memory lives until the last mapping goes",
		"vmm-export-unrequested": "export fails with CUDA_ERROR_INVALID_VALUE (1)",
		"vmm-pointer-attrs":      "as the stand-in models",
		"vmm-map-rules":          "as the stand-in models",
		// The stand-in's model of an exporter that dies with its event's
		// record pending (fakecuda.c, Interprocess events).
		"event-death": "the wait never ends; memory freed at the close",
	} {
		if !strings.HasPrefix(v[p], want) {
			t.Errorf("%s: %q, want %q against the stand-in", p, v[p], want)
		}
	}
}
