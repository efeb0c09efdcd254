package pollbench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// driverModule is the Python driver: it attaches with the Python session
// client (ringside.client) as another session of the bench's engine
// instance and polls the bench's waiting queries.
const driverModule = "ringside._pollbench"

var defPoll = regexp.MustCompile(`(?m)^\s+def poll\(`)

// findPackage returns the directory holding ringside/client.py (with a
// poll method) and ringside/_pollbench.py, or an error saying why not.
func (b *bench) findPackage() (string, error) {
	ok := func(dir string) error {
		src, err := os.ReadFile(filepath.Join(dir, "ringside", "client.py"))
		if err != nil {
			return fmt.Errorf("no Python session client (%s/ringside/client.py)", dir)
		}
		if !defPoll.Match(src) {
			return fmt.Errorf("%s/ringside/client.py has no poll method", dir)
		}
		if _, err := os.Stat(filepath.Join(dir, "ringside", "_pollbench.py")); err != nil {
			return fmt.Errorf("no driver %s/ringside/_pollbench.py", dir)
		}
		return nil
	}
	if b.PythonPath != "" {
		return b.PythonPath, ok(b.PythonPath)
	}
	var starts []string
	if exe, err := filepath.EvalSymlinks(b.Exe); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	for _, s := range starts {
		for d := s; ; d = filepath.Dir(d) {
			c := filepath.Join(d, "connector", "python")
			if fi, err := os.Stat(filepath.Join(c, "ringside")); err == nil && fi.IsDir() {
				return c, ok(c)
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", fmt.Errorf("connector/python/ringside not found near %s or the working directory (set --python-path)", b.Exe)
}

// pythonRows runs the Python driver; every failure becomes a skipped row
// with its reason, never a failed run.
func (b *bench) pythonRows() []Row {
	skipped := func(format string, a ...any) []Row {
		reason := fmt.Sprintf(format, a...)
		b.logf("python row skipped: %s", reason)
		return []Row{{Bench: "poll", Client: "python", Transport: "ring", Skipped: reason}}
	}
	py, err := exec.LookPath(b.Python)
	if err != nil {
		return skipped("no Python interpreter %q (set --python)", b.Python)
	}
	dir, err := b.findPackage()
	if err != nil {
		return skipped("%v", err)
	}
	dir, _ = filepath.Abs(dir)
	args := []string{"-m", driverModule, "--socket", b.sock, "--instance", instance, "--model", model, "--layout", layout,
		"--polls", strconv.Itoa(b.Polls), "--batches", strconv.Itoa(b.Batches), "--warmup", strconv.Itoa(b.Warmup)}
	for _, n := range b.Sizes {
		args = append(args, "--lease", fmt.Sprintf("%d=%d", n, b.leases[n]))
	}
	ctx, cancel := context.WithTimeout(b.ctx, b.Timeout+time.Duration(len(b.Sizes)*b.Batches*b.Polls)*100*time.Microsecond)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, args...)
	pp := dir
	if old := os.Getenv("PYTHONPATH"); old != "" {
		pp += string(os.PathListSeparator) + old
	}
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pp, "PYTHONDONTWRITEBYTECODE=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
			msg = msg[i+1:]
		}
		return skipped("driver failed: %v: %s", err, msg)
	}
	var rows []Row
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var res struct {
			Hashes  int       `json:"hashes"`
			Samples [][]int64 `json:"samples_ns"`
		}
		if err := json.Unmarshal(sc.Bytes(), &res); err != nil {
			return skipped("driver output: %v", err)
		}
		if len(res.Samples) == 0 || len(res.Samples[0]) == 0 {
			return skipped("driver gave no samples for %d hashes", res.Hashes)
		}
		rows = append(rows, summarize("python", "ring", res.Hashes, res.Samples))
	}
	if len(rows) != len(b.Sizes) {
		return skipped("driver gave %d rows, want %d", len(rows), len(b.Sizes))
	}
	return rows
}
