package deploy

import (
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/internal/units"
)

// gpuModels are the models the GPU overlay's slot must hold, with their
// real configurations (config.json: num_hidden_layers,
// num_key_value_heads, head_dim).
var gpuModels = []struct {
	name                     string
	layers, kvHeads, headDim uint64
}{
	{"Llama-3.1-8B", 32, 8, 128},
	{"Qwen3-8B", 36, 8, 128},
	{"Mixtral-8x7B", 32, 8, 128},
	{"Llama-3.1-70B", 80, 8, 128},
	{"Qwen2.5-72B", 80, 8, 128},
}

var (
	gpuTPs        = []uint64{1, 2, 4, 8}
	gpuDtypeBytes = []uint64{2, 1} // fp16/bf16, fp8
)

const (
	gpuBlockTokens = 16   // vLLM's default block size on CUDA
	gpuMinSlots    = 4096 // blocks the pool must hold at the largest page
	// Seconds the startup probe must allow per GiB of pool: reserving ran
	// at ~0.65 s a GiB on the project's VM, and pinning for the GPU comes
	// on top.
	gpuStartupSecondsPerGiB = 1
)

// gpuPage is one engine page: one KV block of one tensor-parallel rank
// across all layers (K and V), with at least one KV head per rank.
func gpuPage(layers, kvHeads, headDim, tp, dtype uint64) uint64 {
	return layers * 2 * gpuBlockTokens * max(kvHeads/tp, 1) * headDim * dtype
}

// readmeGPUTable returns the rows of deploy/README.md's page-size table
// (the lines that start with "| <model> |"), cells trimmed.
func readmeGPUTable(t *testing.T) map[string][]string {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string][]string{}
	for _, l := range strings.Split(string(readme), "\n") {
		cells := strings.Split(strings.Trim(strings.TrimSpace(l), "|"), "|")
		if len(cells) < 2 {
			continue
		}
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		for _, m := range gpuModels {
			if cells[0] == m.name {
				rows[m.name] = cells
			}
		}
	}
	return rows
}

// TestGPUPageTable checks deploy/README.md's table of page sizes against
// the formula: each listed model, its configuration, and per TP the page
// in fp16/bf16 and fp8 ("2 MiB / 1 MiB").
func TestGPUPageTable(t *testing.T) {
	rows := readmeGPUTable(t)
	for _, m := range gpuModels {
		cells, ok := rows[m.name]
		if !ok {
			t.Errorf("deploy/README.md's GPU table has no row for %s", m.name)
			continue
		}
		if len(cells) != 4+len(gpuTPs) {
			t.Errorf("%s: %d cells, want model, layers, KV heads, head dim and one per TP %v", m.name, len(cells), gpuTPs)
			continue
		}
		for i, want := range []uint64{m.layers, m.kvHeads, m.headDim} {
			if got, err := strconv.ParseUint(cells[1+i], 10, 64); err != nil || got != want {
				t.Errorf("%s: cell %d is %q, want %d", m.name, 1+i, cells[1+i], want)
			}
		}
		for i, tp := range gpuTPs {
			parts := strings.Split(cells[4+i], "/")
			if len(parts) != len(gpuDtypeBytes) {
				t.Errorf("%s TP=%d: cell %q is not \"bf16 / fp8\"", m.name, tp, cells[4+i])
				continue
			}
			for j, dt := range gpuDtypeBytes {
				want := gpuPage(m.layers, m.kvHeads, m.headDim, tp, dt)
				part := strings.TrimSpace(parts[j])
				got, err := units.ParseBytes(part)
				if err != nil || got != want {
					t.Errorf("%s TP=%d %d-byte dtype: the table says %q, the formula gives %d bytes", m.name, tp, dt, part, want)
				}
			}
		}
	}
}

// TestGPUOverlay renders overlays/gpu and checks what makes it work on a
// GPU node: the CUDA backend required, the cgo image, and a pool whose
// slot holds every listed model's page.
func TestGPUOverlay(t *testing.T) {
	objs, err := renderAndDecode("overlays/gpu")
	if err != nil {
		t.Fatal(err)
	}
	d := deployment(t, objs)
	spec := &d.Spec.Template.Spec
	if len(spec.InitContainers) == 0 || spec.InitContainers[0].Name != "ringside" {
		t.Fatalf("no ringside init container")
	}
	sc := &spec.InitContainers[0]
	cfg, err := parseServe(sc)
	if err != nil {
		t.Fatalf("the sidecar's command line: %v", err)
	}
	if cfg.CopyBackend != "cuda" {
		t.Errorf("the sidecar runs --copy.backend=%s; want cuda, so that a node without a usable driver fails at start", cfg.CopyBackend)
	}
	// The image built by deploy/Dockerfile.gpu: registry/.../ringside-gpu:TAG.
	repo, _, _ := strings.Cut(sc.Image, "@")
	if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	if path.Base(repo) != "ringside-gpu" || !strings.Contains(repo, "/") {
		t.Errorf("the sidecar's image is %q; want the GPU image REGISTRY/ringside-gpu (deploy/Dockerfile.gpu)", sc.Image)
	}
	var largest uint64
	for _, m := range gpuModels {
		for _, tp := range gpuTPs {
			for _, dt := range gpuDtypeBytes {
				p := gpuPage(m.layers, m.kvHeads, m.headDim, tp, dt)
				largest = max(largest, p)
				if cfg.Machine.SlotBytes < p {
					t.Errorf("--pool.slot-bytes %d is under the %d-byte page of %s at TP=%d with %d-byte KV: the sidecar refuses it", cfg.Machine.SlotBytes, p, m.name, tp, dt)
				}
			}
		}
	}
	if slots := cfg.PoolBytes / cfg.Machine.SlotBytes; slots < gpuMinSlots {
		t.Errorf("--pool.bytes %d holds %d slots of %d bytes; want at least %d blocks", cfg.PoolBytes, slots, cfg.Machine.SlotBytes, gpuMinSlots)
	}
	// A slot much larger than every page wastes most of the pool.
	if cfg.Machine.SlotBytes > 2*largest {
		t.Errorf("--pool.slot-bytes %d is over twice the largest listed page (%d)", cfg.Machine.SlotBytes, largest)
	}
	if p := sc.StartupProbe; p == nil {
		t.Errorf("the sidecar has no startup probe")
	} else {
		allow := int64(max(p.PeriodSeconds, 1)) * int64(max(p.FailureThreshold, 1))
		if need := int64(cfg.PoolBytes>>30) * gpuStartupSecondsPerGiB; allow < need {
			t.Errorf("the startup probe allows %d s; reserving and pinning %d GiB needs about %d s", allow, cfg.PoolBytes>>30, need)
		}
	}
}

// TestDockerfileGPU checks the GPU image recipe the way TestDockerfiles
// checks the others: the module's Go, cgo on, a glibc runtime of the
// builder's Debian release, nothing that links statically.
func TestDockerfileGPU(t *testing.T) {
	b, err := os.ReadFile("Dockerfile.gpu")
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	gomod, err := os.ReadFile(filepath.Join("..", "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVer := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(string(gomod))
	if goVer == nil || !strings.Contains(df, "ARG GO_VERSION="+goVer[1]+"\n") {
		t.Errorf("deploy/Dockerfile.gpu's GO_VERSION does not match go.mod's go %v", goVer)
	}
	for _, want := range []string{
		"CGO_ENABLED=1 go build", "./cmd/ringside", "FROM golang:${GO_VERSION}-bookworm AS build",
		"FROM ${RUNTIME}", "USER 65532:65532", `ENTRYPOINT ["/usr/local/bin/ringside"]`,
	} {
		if !strings.Contains(df, want) {
			t.Errorf("deploy/Dockerfile.gpu lacks %q", want)
		}
	}
	// The runtime has glibc (base or cc, not static) and is Debian 12, the
	// builder's bookworm: the binary needs the glibc it was linked with.
	rt := regexp.MustCompile(`(?m)^ARG RUNTIME=(\S+)$`).FindStringSubmatch(df)
	if rt == nil || !regexp.MustCompile(`^gcr\.io/distroless/(base|cc)(-nossl)?-debian12(:[a-z0-9-]+)?$`).MatchString(rt[1]) {
		t.Errorf("deploy/Dockerfile.gpu's runtime %v is not a glibc distroless Debian 12 image (base-debian12 or cc-debian12)", rt)
	}
	for _, bad := range []string{"CGO_ENABLED=0", "static-debian12", "-static", "netgo", "osusergo", "-extldflags", "scratch"} {
		if strings.Contains(df, bad) {
			t.Errorf("deploy/Dockerfile.gpu contains %q: the CUDA backend needs cgo and the dynamic loader (dlopen of libcuda.so.1)", bad)
		}
	}
	ign, err := os.ReadFile("Dockerfile.gpu.dockerignore")
	if err != nil {
		t.Fatalf("deploy/Dockerfile.gpu has no .dockerignore: %v", err)
	}
	for _, want := range []string{".git", ".venv*", "bin"} {
		if !slices.Contains(strings.Fields(string(ign)), want) {
			t.Errorf("deploy/Dockerfile.gpu.dockerignore does not exclude %s", want)
		}
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "docker build -f deploy/Dockerfile.gpu") || !strings.Contains(string(readme), "/ringside-gpu:") {
		t.Errorf("deploy/README.md does not say how to build the GPU image (docker build -f deploy/Dockerfile.gpu ... REG/ringside-gpu:TAG)")
	}
}
