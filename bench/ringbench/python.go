package ringbench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// python is a usable interpreter with the ringside package on its path.
type python struct {
	exe  string // interpreter
	path string // directory holding the ringside package
}

// peerModule is the Python benchmark peer.
const peerModule = "ringside._benchpeer"

// findPython locates the interpreter and the connector package. pkgDir, when
// set, must hold ringside/_benchpeer.py; otherwise connector/python is
// searched next to the executable (and its parents) and in the working
// directory and its parents. A missing interpreter or package returns an
// error wrapping errSkipped.
func findPython(interp, pkgDir, exe string) (python, error) {
	py, err := exec.LookPath(interp)
	if err != nil {
		return python{}, fmt.Errorf("%w: no Python interpreter %q (set --python)", errSkipped, interp)
	}
	has := func(dir string) bool {
		fi, err := os.Stat(filepath.Join(dir, "ringside", "_benchpeer.py"))
		return err == nil && fi.Mode().IsRegular()
	}
	dir := ""
	if pkgDir != "" {
		if !has(pkgDir) {
			return python{}, fmt.Errorf("%w: %s has no ringside/_benchpeer.py (--python-path)", errSkipped, pkgDir)
		}
		dir = pkgDir
	} else {
		var starts []string
		if exe != "" {
			if real, err := filepath.EvalSymlinks(exe); err == nil {
				exe = real
			}
			starts = append(starts, filepath.Dir(exe))
		}
		if wd, err := os.Getwd(); err == nil {
			starts = append(starts, wd)
		}
	search:
		for _, s := range starts {
			for d := s; ; d = filepath.Dir(d) {
				if c := filepath.Join(d, "connector", "python"); has(c) {
					dir = c
					break search
				}
				if filepath.Dir(d) == d {
					break
				}
			}
		}
		if dir == "" {
			return python{}, fmt.Errorf("%w: connector/python/ringside not found near %s or the working directory (set --python-path)", errSkipped, exe)
		}
	}
	dir, _ = filepath.Abs(dir)
	p := python{exe: py, path: dir}
	// The package must import (it needs nothing beyond the standard library,
	// but an old interpreter may not parse it).
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := p.command(ctx, "-c", "import "+peerModule)
	if out, err := cmd.CombinedOutput(); err != nil {
		return python{}, fmt.Errorf("%w: %s cannot import %s from %s: %s", errSkipped, py, peerModule, dir, lastLine(out, err))
	}
	return p, nil
}

func (p python) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, p.exe, args...)
	pp := p.path
	if old := os.Getenv("PYTHONPATH"); old != "" {
		pp += string(os.PathListSeparator) + old
	}
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pp, "PYTHONDONTWRITEBYTECODE=1")
	return cmd
}

func lastLine(out []byte, err error) string {
	s := strings.TrimSpace(string(out))
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	if s == "" {
		return err.Error()
	}
	return s
}

// peerResult is the peer's JSON line.
type peerResult struct {
	P50  int64 `json:"p50_ns"`
	P99  int64 `json:"p99_ns"`
	N    int   `json:"n"`
	Mean int64 `json:"mean_ns"`
}

// runPeer runs the Python peer and parses its result. Python reports no
// wall time for its loop, so round trips per second are 1/mean.
func (b *bench) runPeer(p python, args ...string) (result, error) {
	ctx, cancel := context.WithTimeout(b.ctx, b.Timeout+10*time.Second)
	defer cancel()
	argv := append([]string{"-m", peerModule}, args...)
	argv = append(argv, "--warmup", strconv.Itoa(b.Warmup), "--count", strconv.Itoa(b.Rounds),
		"--timeout", strconv.FormatFloat(b.Timeout.Seconds(), 'f', -1, 64))
	cmd := p.command(ctx, argv...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return result{}, fmt.Errorf("python peer: %s", lastLine(stderr.Bytes(), err))
	}
	var pr peerResult
	line := bytes.TrimSpace(stdout.Bytes())
	if i := bytes.LastIndexByte(line, '\n'); i >= 0 {
		line = line[i+1:]
	}
	if err := json.Unmarshal(line, &pr); err != nil {
		return result{}, fmt.Errorf("python peer printed %q: %w", line, err)
	}
	if pr.N != b.Rounds {
		return result{}, fmt.Errorf("python peer timed %d round trips, want %d", pr.N, b.Rounds)
	}
	res := result{summary: summary{n: pr.N, p50: pr.P50, p99: pr.P99, mean: pr.Mean}}
	if pr.Mean > 0 {
		res.perSec = 1e9 / float64(pr.Mean)
	}
	return res, nil
}

func (b *bench) pyRing(p python, size int, wait string) (result, error) {
	req, resp, cleanup, err := b.ringPair()
	if err != nil {
		return result{}, err
	}
	defer cleanup()
	srv, err := b.startServer("--mode", ModeRing, "--req", req.Path(), "--resp", resp.Path(),
		"--wait", wait, "--count", strconv.Itoa(b.Warmup+b.Rounds))
	if err != nil {
		return result{}, err
	}
	res, err := b.runPeer(p, "ring", req.Path(), resp.Path(), "--size", strconv.Itoa(size), "--wait", wait,
		"--req-epoch", fmt.Sprintf("%#x", req.Epoch()), "--resp-epoch", fmt.Sprintf("%#x", resp.Epoch()))
	return res, srv.finish(err, b.Timeout)
}

func (b *bench) pyUDS(p python, size int) (result, error) {
	sock := b.path("sock")
	defer os.Remove(sock)
	srv, err := b.startServer("--mode", ModeUDS, "--socket", sock, "--count", strconv.Itoa(b.Warmup+b.Rounds))
	if err != nil {
		return result{}, err
	}
	res, err := b.runPeer(p, "uds", sock, "--size", strconv.Itoa(size))
	return res, srv.finish(err, b.Timeout)
}
