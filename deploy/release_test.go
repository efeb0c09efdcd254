package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReleaseBuilds checks that every recipe that ships a binary stamps the
// version where `ringside version` reads it, and that `make dist`
// (deploy/dist.sh) builds its binaries as deploy/Dockerfile.gpu builds the
// GPU image's: cgo on (the CUDA backend), -trimpath, stripped.
func TestReleaseBuilds(t *testing.T) {
	read := func(f string) string {
		t.Helper()
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	gomod := read(filepath.Join("..", "go.mod"))
	mod := regexp.MustCompile(`(?m)^module (\S+)$`).FindStringSubmatch(gomod)
	if mod == nil {
		t.Fatal("go.mod names no module")
	}
	mk := read(filepath.Join("..", "Makefile"))

	// The Makefile's -X targets name a `var Version` of the package each
	// binary's version command prints.
	stamps := map[string]string{} // Makefile variable -> package.Version
	for _, v := range []struct{ name, dir string }{{"LDFLAGS", "internal/cli"}, {"BENCH_LDFLAGS", "bench/benchcli"}} {
		m := regexp.MustCompile(`(?m)^` + v.name + `\s*:?=\s*-X (\S+)=\$\(VERSION\)\s*$`).FindStringSubmatch(mk)
		want := mod[1] + "/" + v.dir + ".Version"
		if m == nil || m[1] != want {
			t.Errorf("the Makefile's %s is %v; want -X %s=$(VERSION)", v.name, m, want)
			continue
		}
		stamps[v.name] = m[1]
		files, _ := filepath.Glob(filepath.Join("..", v.dir, "*.go"))
		found := false
		for _, f := range files {
			if !strings.HasSuffix(f, "_test.go") && regexp.MustCompile(`(?m)^var Version = `).MatchString(read(f)) {
				found = true
			}
		}
		if !found {
			t.Errorf("%s has no `var Version = ...` for %s to set", v.dir, v.name)
		}
	}

	// The sidecar images stamp VERSION the Makefile's way.
	for _, f := range []string{"Dockerfile", "Dockerfile.gpu"} {
		df := read(f)
		for _, want := range []string{"ARG VERSION=", "-X " + stamps["LDFLAGS"] + "=${VERSION}", "go build -trimpath", `-ldflags "-s -w `} {
			if !strings.Contains(df, want) {
				t.Errorf("deploy/%s lacks %q: the image's `ringside version` must say the tag", f, want)
			}
		}
	}
	// The vLLM images install the connector with its version derived from VERSION.
	for _, f := range []string{"Dockerfile.vllm", "Dockerfile.vllm-cpu"} {
		df := read(f)
		if !strings.Contains(df, "ARG VERSION=") || !strings.Contains(df, `RINGSIDE_VERSION="${VERSION}"`) {
			t.Errorf("deploy/%s does not install the connector with RINGSIDE_VERSION from ARG VERSION", f)
		}
	}

	// make dist passes the Makefile's version and ldflags to deploy/dist.sh ...
	dist := regexp.MustCompile(`(?m)^dist:.*\n\t(.*)$`).FindStringSubmatch(mk)
	if dist == nil {
		t.Fatal("the Makefile has no dist target")
	}
	for _, want := range []string{"VERSION='$(VERSION)'", "LDFLAGS='$(LDFLAGS)'", "BENCH_LDFLAGS='$(BENCH_LDFLAGS)'", "deploy/dist.sh"} {
		if !strings.Contains(dist[1], want) {
			t.Errorf("make dist's recipe %q lacks %s", dist[1], want)
		}
	}
	// ... which builds both binaries as the GPU image is built.
	sh := read("dist.sh")
	for _, want := range []string{
		`CGO_ENABLED=1 GOOS=linux GOARCH=amd64 "$GO" build -trimpath -ldflags "-s -w $3"`,
		`build ringside ./cmd/ringside "$LDFLAGS"`,
		`build ringside-bench ./cmd/ringside-bench "$BENCH_LDFLAGS"`,
		"sha256sum", "--no-build-isolation",
	} {
		if !strings.Contains(sh, want) {
			t.Errorf("deploy/dist.sh lacks %q", want)
		}
	}
	gpu := read("Dockerfile.gpu")
	if !strings.Contains(gpu, "CGO_ENABLED=1 go build -trimpath") || strings.Contains(gpu, "-tags") || strings.Contains(sh, "-tags") {
		t.Errorf("deploy/Dockerfile.gpu and deploy/dist.sh must both build with CGO_ENABLED=1 -trimpath and no build tags")
	}
}
