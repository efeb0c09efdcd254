package reliability

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	longFlag = flag.Bool("long", false, "run the heavier variants of the reliability suite")
	soakFlag = flag.Duration("soak", 0, "run the soak for this long (also RINGSIDE_SOAK)")
)

// ringsideBin is the sidecar binary built once for the whole run.
var ringsideBin string

// childEnv selects a child role when the test binary is re-executed as an
// engine, a ring creator, a process of another uid or a soak engine.
const childEnv = "RINGSIDE_REL_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(childMain(role))
	}
	flag.Parse()
	tmp, err := os.MkdirTemp("", "rs-rel-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	// World-readable and executable: a child of another uid runs a copy of
	// the test binary from here.
	os.Chmod(tmp, 0o755)
	ringsideBin = filepath.Join(tmp, "ringside")
	// With invariants (internal/invariants): the sidecar under attack runs
	// its internal checks and poisons released ring records.
	build := exec.Command("go", "build", "-tags", "invariants", "-o", ringsideBin, "github.com/ringside-kv/ringside/cmd/ringside")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building ringside:", err)
		os.RemoveAll(tmp)
		os.Exit(2)
	}
	binDir = tmp
	code := m.Run()
	if path := os.Getenv("RINGSIDE_RELIABILITY_REPORT"); path != "" {
		if err := writeReport(path); err != nil {
			fmt.Fprintln(os.Stderr, "report:", err)
			code = 1
		}
	}
	os.RemoveAll(tmp)
	os.Exit(code)
}

var binDir string

func long() bool { return *longFlag || os.Getenv("RINGSIDE_RELIABILITY_LONG") != "" }

func mode() string {
	switch {
	case long():
		return "long"
	case testing.Short():
		return "short"
	}
	return "default"
}

var (
	rowsMu sync.Mutex
	rows   []Row
)

// record registers the test's report row; the result is filled in when the
// test ends (PASS, FAIL or SKIP with the reason). numbers may be updated
// through the returned pointer until then.
func record(t *testing.T, area, attack, checks, survey string) *Row {
	t.Helper()
	r := &Row{Test: t.Name(), Area: area, Attack: attack, Checks: checks, Survey: survey}
	t.Cleanup(func() {
		switch {
		case t.Failed():
			r.Result = "FAIL"
		case t.Skipped():
			r.Result = "SKIP"
		default:
			r.Result = "PASS"
		}
		rowsMu.Lock()
		rows = append(rows, *r)
		rowsMu.Unlock()
	})
	return r
}

func (r *Row) add(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	if r.Numbers == "" {
		r.Numbers = s
	} else {
		r.Numbers += "; " + s
	}
}

func writeReport(path string) error {
	if !filepath.IsAbs(path) {
		root, err := moduleRoot()
		if err != nil {
			return err
		}
		path = filepath.Join(root, path)
	}
	rowsMu.Lock()
	defer rowsMu.Unlock()
	if len(rows) == 0 {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	env := Env{
		Date: time.Now().UTC().Format("2006-01-02 15:04 UTC"), GoVersion: runtime.Version(),
		Platform: runtime.GOOS + "/" + runtime.GOARCH, CPUs: runtime.NumCPU(), Race: raceEnabled, Mode: mode(),
		Command: "RINGSIDE_RELIABILITY_REPORT=docs/reliability.md go test -count=1 ./reliability/",
	}
	if d := soakDuration(); d > 0 {
		env.Command = fmt.Sprintf("RINGSIDE_SOAK=%v %s -timeout 0", d, env.Command)
	}
	err = WriteReport(f, env, rows)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod above the working directory")
		}
		dir = parent
	}
}

// childRoles are the roles a re-executed test binary can take. Test files
// register theirs in an init function (childRoles["name"] = fn), so that
// no file needs to know the others' roles.
var childRoles = map[string]func() int{
	"engine": engineChild,
	"ringer": ringerChild,
	"nobody": nobodyChild,
	"soak":   soakChild,
}

// childMain runs the role of a re-executed test binary.
func childMain(role string) int {
	if f, ok := childRoles[role]; ok {
		return f()
	}
	fmt.Fprintln(os.Stderr, "unknown child role", role)
	return 2
}

// child starts the test binary again in a child role.
func child(role string, env ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), childEnv+"="+role), env...)
	return cmd
}

func envInt(name string, def int) int {
	var v int
	if _, err := fmt.Sscan(os.Getenv(name), &v); err != nil {
		return def
	}
	return v
}

func short(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
