// Package lint holds the repository's lint rules as Go tests, in the style
// of pebble's internal/lint: they run in every `go test ./...` (so in make
// test and CI) without any tool beyond the Go toolchain, and each failure
// names the file and line.
package lint

import (
	"bufio"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

const root = "../.."

// goFile is one Go source file of the module.
type goFile struct {
	path    string // slash-separated, relative to the module root
	test    bool
	imports []goImport
}

type goImport struct {
	path string
	line int
}

// goFiles parses the imports of every Go file in the module: hidden
// directories (.git, .tools, the Python virtual environments), testdata and
// vendor are skipped, as the go command skips them.
func goFiles(t *testing.T) []goFile {
	t.Helper()
	var out []goFile
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		g := goFile{path: filepath.ToSlash(rel), test: strings.HasSuffix(name, "_test.go")}
		for _, im := range f.Imports {
			path, _ := strconv.Unquote(im.Path.Value)
			g.imports = append(g.imports, goImport{path: path, line: fset.Position(im.Pos()).Line})
		}
		out = append(out, g)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) < 50 {
		t.Fatalf("found only %d Go files under %s: is the walk broken?", len(out), root)
	}
	return out
}

// under reports whether path lies in one of the directories.
func under(path string, dirs ...string) bool {
	for _, d := range dirs {
		if strings.HasPrefix(path, d+"/") {
			return true
		}
	}
	return false
}

// cgo stays in gpu/internal: the product builds without a C toolchain
// everywhere else, and only those packages deal with C memory.
func TestCgoOnlyInGPUInternal(t *testing.T) {
	n := 0
	for _, f := range goFiles(t) {
		for _, im := range f.imports {
			if im.path != "C" {
				continue
			}
			n++
			if !under(f.path, "gpu/internal") {
				t.Errorf("%s:%d: import \"C\" outside gpu/internal/ (cgo is fenced there)", f.path, im.line)
			}
		}
	}
	if n == 0 {
		t.Error("no file imports \"C\": the CUDA driver binding moved? update this rule")
	}
}

// Fenced imports: unsafe, raw system calls and mmap stay in small internal
// packages (HELPERS.md, .golangci.yml's depguard rule "fenced", which this
// test repeats so that `go test` enforces it without golangci-lint). Test
// files may use them.
var fencedImports = map[string]string{
	"unsafe":                    "unsafe is fenced in internal/shm, internal/sys, internal/memcopy and gpu/internal",
	"golang.org/x/sys/unix":     "raw system calls are fenced in internal/shm, internal/sys and gpu/internal",
	"github.com/edsrzf/mmap-go": "mmap is fenced in internal/shm",
}

// fencedDirs may import them.
var fencedDirs = []string{"internal/shm", "internal/sys", "internal/memcopy", "gpu/internal"}

// fencedExceptions are files outside fencedDirs allowed one fenced import,
// each with its reason. None today.
var fencedExceptions = map[string]string{}

func TestFencedImports(t *testing.T) {
	for _, f := range goFiles(t) {
		if f.test || under(f.path, fencedDirs...) {
			continue
		}
		for _, im := range f.imports {
			why, fenced := fencedImports[im.path]
			if !fenced {
				continue
			}
			if _, ok := fencedExceptions[f.path+" "+im.path]; ok {
				continue
			}
			t.Errorf("%s:%d: imports %q: %s", f.path, im.line, im.path, why)
		}
	}
}

var (
	fuzzFunc = regexp.MustCompile(`^func (Fuzz\w*)\(\w+ \*testing\.F\)`)
	// One line of the Makefile's fuzz recipe, as written there.
	fuzzLine = regexp.MustCompile(`^\t\$\(GO\) test -run '\^\$\$' -fuzz '\^(Fuzz\w*)\$\$' -fuzztime \$\(FUZZTIME\)(?: -tags \$\(GOTAGS\))? \./([\w/]+)/$`)
)

// make fuzz runs every fuzzer of the module, each once, for FUZZTIME.
func TestMakeFuzzRunsEveryFuzzer(t *testing.T) {
	want := map[string]string{} // "pkg FuzzX" -> where it is defined
	for _, f := range goFiles(t) {
		if !f.test {
			continue
		}
		fh, err := os.Open(filepath.Join(root, f.path))
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(fh)
		for line := 1; sc.Scan(); line++ {
			if m := fuzzFunc.FindStringSubmatch(sc.Text()); m != nil {
				want[filepath.ToSlash(filepath.Dir(f.path))+" "+m[1]] = f.path + ":" + strconv.Itoa(line)
			}
		}
		fh.Close()
		if err := sc.Err(); err != nil {
			t.Fatal(err)
		}
	}
	if len(want) == 0 {
		t.Fatal("no fuzzers found: is the pattern broken?")
	}

	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	inFuzz := false
	for i, line := range strings.Split(string(mk), "\n") {
		switch {
		case strings.HasPrefix(line, "fuzz:"):
			inFuzz = true
			continue
		case !inFuzz:
			continue
		case !strings.HasPrefix(line, "\t"):
			inFuzz = false
			continue
		}
		m := fuzzLine.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("Makefile:%d: fuzz recipe line is not `$(GO) test -run '^$$' -fuzz '^FuzzX$$' -fuzztime $(FUZZTIME) [-tags $(GOTAGS)] ./pkg/`: %q", i+1, line)
			continue
		}
		key := m[2] + " " + m[1]
		if _, dup := got[key]; dup {
			t.Errorf("Makefile:%d: %s runs twice", i+1, key)
		}
		got[key] = i + 1
	}
	var missing []string
	for k, where := range want {
		if _, ok := got[k]; !ok {
			missing = append(missing, where+": "+k)
		}
	}
	sort.Strings(missing)
	for _, m := range missing {
		t.Errorf("%s is not run by make fuzz: add a line to the Makefile's fuzz target", m)
	}
	for k, line := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("Makefile:%d: make fuzz runs %s, which does not exist", line, k)
		}
	}
}

// Every fuzzer has a committed seed corpus beside it, so that the seeds
// run in every `go test` and a fuzzer starts from meaningful inputs.
func TestEveryFuzzerHasASeedCorpus(t *testing.T) {
	for _, f := range goFiles(t) {
		if !f.test {
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, f.path))
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			m := fuzzFunc.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			dir := filepath.Join(root, filepath.Dir(f.path), "testdata", "fuzz", m[1])
			es, err := os.ReadDir(dir)
			if err != nil || len(es) == 0 {
				t.Errorf("%s:%d: %s has no seed corpus in %s", f.path, i+1, m[1], filepath.ToSlash(filepath.Join(filepath.Dir(f.path), "testdata", "fuzz", m[1])))
			}
		}
	}
}

// Wire constants that other packages restate for their own use agree with
// schema, the source of truth (the Python client's are generated, see
// internal/wiregen).
func TestWireConstantCopies(t *testing.T) {
	for _, c := range []struct {
		name      string
		got, want int
	}{
		{"cache.MaxWorldSize", cache.MaxWorldSize, schema.MaxWorldSize},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, schema says %d", c.name, c.got, c.want)
		}
	}
}
