package main

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/ringside-kv/ringside"

// benchOnly are the trees of packages that only the benchmarks need; the
// product binary links none of them (they were 35% of it).
var benchOnly = []string{
	module + "/bench",       // the drivers, their command line and harness
	module + "/gpu/gputest", // the GPU test peer and the benchmarks' memory
	"gonum.org",             // plotting, for replay's PNGs
}

// under reports whether package pkg is root or below it.
func under(pkg, root string) bool {
	return pkg == root || strings.HasPrefix(pkg, root+"/")
}

// deps lists the packages that the main package dir links.
func deps(t *testing.T, dir string) []string {
	t.Helper()
	// go test puts its own GOROOT/bin first on PATH.
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go command to list the dependencies with: %v", err)
	}
	cmd := exec.Command(goTool, "list", "-deps", "-f", "{{.ImportPath}}", dir)
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list -deps %s: %v\n%s", dir, err, ee.Stderr)
		}
		t.Fatalf("go list -deps %s: %v", dir, err)
	}
	return strings.Fields(string(out))
}

// TestProductLinksNoBenchmarks keeps the benchmarks out of the product:
// they are ringside-bench's (cmd/ringside-bench).
func TestProductLinksNoBenchmarks(t *testing.T) {
	var bad []string
	for _, p := range deps(t, "./cmd/ringside") {
		for _, root := range benchOnly {
			if under(p, root) {
				bad = append(bad, p)
			}
		}
	}
	if len(bad) > 0 {
		t.Errorf("cmd/ringside links benchmark code (it belongs to cmd/ringside-bench):\n  %s", strings.Join(bad, "\n  "))
	}
}

// TestBenchBinaryLinksTheBenchmarks checks the check: the same listing of
// ringside-bench finds packages under every tree the test above forbids.
func TestBenchBinaryLinksTheBenchmarks(t *testing.T) {
	found := map[string]bool{}
	for _, p := range deps(t, "./cmd/ringside-bench") {
		for _, root := range benchOnly {
			if under(p, root) {
				found[root] = true
			}
		}
	}
	for _, root := range benchOnly {
		if !found[root] {
			t.Errorf("ringside-bench links nothing under %s: is the list stale?", root)
		}
	}
}
