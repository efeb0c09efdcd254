package ringbench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
)

// peerModule is the Python benchmark peer.
const peerModule = "ringside._benchpeer"

// findPython locates the interpreter and the connector package (see
// harness.FindPython; the package must hold ringside/_benchpeer.py) and
// checks that the peer imports. A missing interpreter or package returns
// an error wrapping errSkipped.
func findPython(interp, pkgDir, exe string) (harness.Python, error) {
	p, err := harness.FindPython(interp, pkgDir, exe, "ringside/_benchpeer.py")
	if err != nil {
		return p, fmt.Errorf("%w: %v", errSkipped, err)
	}
	// The package must import (it needs nothing beyond the standard library,
	// but an old interpreter may not parse it).
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := p.Command(ctx, "-c", "import "+peerModule)
	if out, err := cmd.CombinedOutput(); err != nil {
		return harness.Python{}, fmt.Errorf("%w: %s cannot import %s from %s: %s", errSkipped, p.Exe, peerModule, p.Path, harness.LastLine(out, err))
	}
	return p, nil
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
func (b *bench) runPeer(p harness.Python, args ...string) (result, error) {
	ctx, cancel := context.WithTimeout(b.ctx, b.Timeout+10*time.Second)
	defer cancel()
	argv := append([]string{"-m", peerModule}, args...)
	argv = append(argv, "--warmup", strconv.Itoa(b.Warmup), "--count", strconv.Itoa(b.Rounds),
		"--timeout", strconv.FormatFloat(b.Timeout.Seconds(), 'f', -1, 64))
	cmd := p.Command(ctx, argv...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return result{}, fmt.Errorf("python peer: %s", harness.LastLine(stderr.Bytes(), err))
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

func (b *bench) pyRing(p harness.Python, size int, wait string) (result, error) {
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

func (b *bench) pyUDS(p harness.Python, size int) (result, error) {
	sock := b.path("sock")
	defer os.Remove(sock)
	srv, err := b.startServer("--mode", ModeUDS, "--socket", sock, "--count", strconv.Itoa(b.Warmup+b.Rounds))
	if err != nil {
		return result{}, err
	}
	res, err := b.runPeer(p, "uds", sock, "--size", strconv.Itoa(size))
	return res, srv.finish(err, b.Timeout)
}
