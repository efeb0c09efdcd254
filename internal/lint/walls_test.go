package lint

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/ringside-kv/ringside"

// pureDirs are the packages that hold the protocol's state and decide, and
// do nothing else: no I/O, no lock, no clock, no cgo. The sidecar feeds
// them calls and times and carries out what they return
// (sidecar/machine/doc.go). These tests make that a wall, not a promise.
var pureDirs = []string{"sidecar/machine", "sidecar/cache"}

// pureForbidden are the imports a pure package may not name itself: I/O,
// locks and raw system calls. A path ending in "/" forbids the packages
// below it (os/exec, net/http).
var pureForbidden = map[string]string{
	"os":                    "I/O",
	"os/":                   "I/O and processes",
	"net":                   "I/O",
	"net/":                  "I/O",
	"syscall":               "system calls",
	"golang.org/x/sys/unix": "system calls",
	"sync":                  "locks: the caller serialises calls into the machine",
	"unsafe":                "raw memory",
}

// clockFuncs are the package time functions that read or wait on the
// clock; a pure package is given the time by its caller.
var clockFuncs = map[string]bool{
	"Now": true, "Since": true, "Until": true, "Sleep": true, "After": true,
	"AfterFunc": true, "Tick": true, "NewTicker": true, "NewTimer": true,
}

// forbiddenImport returns why path may not be imported by a pure package,
// or "".
func forbiddenImport(path string) string {
	if why, ok := pureForbidden[path]; ok {
		return why
	}
	for p, why := range pureForbidden {
		if strings.HasSuffix(p, "/") && strings.HasPrefix(path, p) {
			return why
		}
	}
	return ""
}

// wallViolations parses the non-test Go files of dir (every build tag) and
// returns each forbidden import and each use of the clock, as file:line.
func wallViolations(t *testing.T, dir string) []string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	fset := token.NewFileSet()
	n := 0
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		n++
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		timeName := ""
		for _, im := range f.Imports {
			path, _ := strconv.Unquote(im.Path.Value)
			if why := forbiddenImport(path); why != "" {
				out = append(out, fmt.Sprintf("%s: imports %q (%s)", fset.Position(im.Pos()), path, why))
			}
			if path == "time" {
				timeName = "time"
				if im.Name != nil {
					timeName = im.Name.Name
				}
			}
		}
		if timeName == "" || timeName == "_" {
			continue
		}
		ast.Inspect(f, func(nd ast.Node) bool {
			sel, ok := nd.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if x, ok := sel.X.(*ast.Ident); ok && x.Name == timeName && clockFuncs[sel.Sel.Name] {
				out = append(out, fmt.Sprintf("%s: uses time.%s (the clock: take the time from the caller)", fset.Position(sel.Pos()), sel.Sel.Name))
			}
			return true
		})
	}
	if n == 0 {
		t.Fatalf("no Go files in %s: did the package move? update pureDirs", dir)
	}
	return out
}

// The pure packages do no I/O, take no lock and read no clock: their
// non-test files import none of pureForbidden and call no clock function.
func TestPurePackagesDoNoIOTakeNoLockReadNoClock(t *testing.T) {
	for _, d := range pureDirs {
		for _, v := range wallViolations(t, filepath.Join(root, d)) {
			t.Error(strings.TrimPrefix(v, root+"/"))
		}
	}
}

// goList runs `go list -deps` on pkgs with cgo enabled (so that cgo
// packages show their cgo files even where no C compiler is set up) and
// returns each package of the closure with whether it has cgo files.
func goList(t *testing.T, pkgs ...string) map[string]bool {
	t.Helper()
	// go test puts its own GOROOT/bin first on PATH.
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go command to list the dependencies with: %v", err)
	}
	args := append([]string{"list", "-deps", "-f", "{{.ImportPath}} {{len .CgoFiles}}"}, pkgs...)
	cmd := exec.Command(goTool, args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	b, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, ee.Stderr)
		}
		t.Fatalf("go %s: %v", strings.Join(args, " "), err)
	}
	out := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		path, n, _ := strings.Cut(line, " ")
		out[path] = n != "0"
	}
	return out
}

// The pure packages link no cgo package: not the CUDA shim, not runtime/cgo.
// They take the copy engine's plain types from gpu, whose backends (and
// their cgo) live in gpu/host and gpu/cuda.
func TestPurePackagesLinkNoCgo(t *testing.T) {
	for _, d := range pureDirs {
		var bad []string
		for p, cgo := range goList(t, "./"+d) {
			if cgo {
				bad = append(bad, p)
			}
		}
		sort.Strings(bad)
		if len(bad) > 0 {
			t.Errorf("%s links cgo packages:\n  %s", d, strings.Join(bad, "\n  "))
		}
	}
}

// The checks check: the listing sees the CUDA shim's cgo, and the scan sees
// a planted clock, lock and file.
func TestWallChecksSeeViolations(t *testing.T) {
	shim := module + "/gpu/internal/cuda"
	if !goList(t, shim)[shim] {
		t.Errorf("go list shows no cgo files in %s: the cgo check cannot see cgo", shim)
	}
	dir := t.TempDir()
	src := "package p\n\nimport (\n\t\"os\"\n\tsyncx \"sync\"\n\tclock \"time\"\n)\n\n" +
		"var mu syncx.Mutex\n\nfunc f() { os.Exit(int(clock.Since(clock.Time{}))) }\n"
	if err := os.WriteFile(filepath.Join(dir, "p.go"), []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(wallViolations(t, dir), "\n")
	for _, want := range []string{`p.go:4:2: imports "os"`, `p.go:5:2: imports "sync"`, "p.go:11:24: uses time.Since"} {
		if !strings.Contains(got, want) {
			t.Errorf("the scan missed %q; it found:\n%s", want, got)
		}
	}
}
