package pollbench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
)

// driverModule is the Python driver: it attaches with the Python session
// client (ringside.client) as another session of the bench's engine
// instance and polls the bench's waiting queries.
const driverModule = "ringside._pollbench"

var defPoll = regexp.MustCompile(`(?m)^\s+def poll\(`)

// findPython returns the interpreter and the directory holding
// ringside/client.py (with a poll method) and ringside/_pollbench.py, or
// an error saying why not.
func (b *bench) findPython() (harness.Python, error) {
	p, err := harness.FindPython(b.Python, b.PythonPath, b.Exe, "ringside/client.py", "ringside/_pollbench.py")
	if err != nil {
		return p, err
	}
	src, err := os.ReadFile(filepath.Join(p.Path, "ringside", "client.py"))
	if err != nil {
		return p, err
	}
	if !defPoll.Match(src) {
		return p, fmt.Errorf("%s/ringside/client.py has no poll method", p.Path)
	}
	return p, nil
}

// pythonRows runs the Python driver; every failure becomes a skipped row
// with its reason, never a failed run.
func (b *bench) pythonRows() []Row {
	skipped := func(format string, a ...any) []Row {
		reason := fmt.Sprintf(format, a...)
		b.logf("python row skipped: %s", reason)
		return []Row{{Bench: "poll", Client: "python", Transport: "ring", Skipped: reason}}
	}
	py, err := b.findPython()
	if err != nil {
		return skipped("%v", err)
	}
	args := []string{"-m", driverModule, "--socket", b.sock, "--instance", instance, "--model", model, "--layout", layout,
		"--polls", strconv.Itoa(b.Polls), "--batches", strconv.Itoa(b.Batches), "--warmup", strconv.Itoa(b.Warmup)}
	for _, n := range b.Sizes {
		args = append(args, "--lease", fmt.Sprintf("%d=%d", n, b.leases[n]))
	}
	ctx, cancel := context.WithTimeout(b.ctx, b.Timeout+time.Duration(len(b.Sizes)*b.Batches*b.Polls)*100*time.Microsecond)
	defer cancel()
	cmd := py.Command(ctx, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return skipped("driver failed: %v: %s", err, harness.LastLine(stderr.Bytes(), nil))
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
