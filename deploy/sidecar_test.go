package deploy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/ringside-kv/ringside/connector"
	rcli "github.com/ringside-kv/ringside/internal/cli"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/internal/testport"
	"github.com/ringside-kv/ringside/schema"
)

// serveEnv makes the test binary a `ringside serve` (the real CLI,
// cli.App()) with the JSON list of arguments it holds: the dashboard test
// starts it so, under the stand-in CUDA driver.
const serveEnv = "RINGSIDE_DEPLOY_SERVE"

func TestMain(m *testing.M) {
	if a, ok := os.LookupEnv(serveEnv); ok {
		var args []string
		if err := json.Unmarshal([]byte(a), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		if err := rcli.App().Run(append([]string{"ringside"}, args...)); err != nil {
			fmt.Fprintln(os.Stderr, "ringside:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// exposition is what a sidecar's /metrics said: each family's type, and
// each sample name's labels with the values seen.
type exposition struct {
	types   map[string]string                     // family -> counter, gauge, histogram, ...
	samples map[string]map[string]map[string]bool // sample name -> label -> values
}

// family resolves a series name a query may use: a family that is not a
// histogram or summary, or one of those with its _bucket, _sum or _count
// suffix (the bare name of a histogram has no samples).
func (e *exposition) family(name string) (string, error) {
	if typ, ok := e.types[name]; ok {
		if typ == "histogram" || typ == "summary" {
			return "", fmt.Errorf("%s is a %s: its series are %[1]s_bucket, %[1]s_sum and %[1]s_count", name, typ)
		}
		return name, nil
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suf)
		if !ok {
			continue
		}
		if typ := e.types[base]; typ == "histogram" || (typ == "summary" && suf != "_bucket") {
			return base, nil
		}
	}
	return "", fmt.Errorf("the sidecar exposes no series %s", name)
}

// parseExposition reads the Prometheus text format (version 0.0.4).
func parseExposition(r io.Reader) (*exposition, error) {
	e := &exposition{types: map[string]string{}, samples: map[string]map[string]map[string]bool{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			e.types[f[2]] = f[3]
			continue
		}
		if line == "" || line[0] == '#' {
			continue
		}
		end := strings.IndexAny(line, "{ ")
		if end <= 0 {
			return nil, fmt.Errorf("bad sample line %q", line)
		}
		name := line[:end]
		labels := e.samples[name]
		if labels == nil {
			labels = map[string]map[string]bool{}
			e.samples[name] = labels
		}
		if line[end] != '{' {
			continue
		}
		rest := line[end+1:]
		for !strings.HasPrefix(rest, "}") {
			k, v, ok := strings.Cut(rest, `="`)
			if !ok {
				return nil, fmt.Errorf("bad labels in %q", line)
			}
			var val strings.Builder
			i := 0
			for ; i < len(v) && v[i] != '"'; i++ {
				if v[i] == '\\' && i+1 < len(v) {
					i++
					if v[i] == 'n' {
						val.WriteByte('\n')
						continue
					}
				}
				val.WriteByte(v[i])
			}
			if i == len(v) {
				return nil, fmt.Errorf("unterminated label value in %q", line)
			}
			if labels[k] == nil {
				labels[k] = map[string]bool{}
			}
			labels[k][val.String()] = true
			rest = strings.TrimPrefix(v[i+1:], ",")
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for name := range e.samples {
		if _, err := e.family(name); err != nil && e.types[name] == "" {
			// An untyped sample: its own family.
			e.types[name] = "untyped"
		}
	}
	return e, nil
}

func freeAddr(t *testing.T) string { return testport.Addr() }

// runningSidecarMetrics starts a real sidecar (`ringside serve`, this test
// binary through cli.App()) with every optional part on: the CUDA copy
// backend under the stand-in driver (gpu/gputest/testdata/fakecuda.c, built
// with gcc) so that it reports a GPU, and a shared tier (at an address where
// nothing listens: the tier's series exist whether it is reached or not).
// An engine session then stores two blocks from this process's memory,
// acquires and loads them back, so that the series created by the first
// copy exist too. It returns what /metrics said then.
func runningSidecarMetrics(t *testing.T) *exposition {
	t.Helper()
	skip := func(why string) {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI: %s", why)
		}
		t.Skip(why)
	}
	if !cgoEnabled {
		skip("built without cgo: the sidecar has no CUDA backend to report a GPU")
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		skip("no gcc to build the stand-in CUDA driver")
	}
	lib := t.TempDir()
	if out, err := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-o", filepath.Join(lib, "libcuda.so.1"),
		filepath.Join("..", "gpu", "gputest", "testdata", "fakecuda.c")).CombinedOutput(); err != nil {
		t.Fatalf("building the stand-in driver: %v\n%s", err, out)
	}
	base := "/dev/shm"
	if _, err := os.Stat(base); err != nil {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "rs-deploy-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	const slot = 4096
	metrics := freeAddr(t)
	args, _ := json.Marshal([]string{"serve", "--dir", filepath.Join(dir, "s"), "--pool.bytes", "1MiB", "--pool.slot-bytes", "4KiB",
		"--copy.backend", "cuda", "--metrics.addr", metrics, "--l2.redis.addrs", freeAddr(t), "--l2.redis.mode", "single"})
	cmd := exec.Command(os.Args[0])
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "RINGSIDE_") && !strings.HasPrefix(kv, "LD_LIBRARY_PATH=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "LD_LIBRARY_PATH="+lib, serveEnv+"="+string(args))
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("the sidecar exited with %v:\n%s", err, stderr.String())
			}
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-exited
			t.Errorf("the sidecar did not stop on SIGTERM:\n%s", stderr.String())
		}
	}
	t.Cleanup(stop)
	get := func(path string) (int, []byte) {
		resp, err := http.Get("http://" + metrics + path)
		if err != nil {
			return 0, nil
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if code, _ := get("/readyz"); code == http.StatusOK {
			break
		}
		select {
		case err := <-exited:
			stopped = true
			t.Fatalf("the sidecar exited before it was ready (%v):\n%s", err, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sidecar never answered ready:\n%s", stderr.String())
		}
	}

	// An engine session: two blocks stored from this process's memory,
	// then acquired and loaded back into two other pages.
	sys.AllowPtracer(cmd.Process.Pid) // Yama ptrace_scope 1: the sidecar reads this process
	c, err := connector.Dial(connector.Options{Socket: filepath.Join(dir, "s", "ringside.sock"), Instance: "deploy-test",
		Model: "m", Layout: "bf16/16/HND", Timeout: 10 * time.Second})
	if err != nil {
		t.Fatalf("attach: %v\n%s", err, stderr.String())
	}
	defer c.Close()
	buf := make([]byte, 4*slot)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	if err := c.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint64(len(buf)), PageSize: slot, PageCount: 4}); err != nil {
		t.Fatalf("register: %v", err)
	}
	digests := make([]byte, 2*32)
	for i := range digests {
		digests[i] = byte(i + 1)
	}
	if _, err := c.PutHashes(1, digests, false); err != nil {
		t.Fatalf("put hashes: %v", err)
	}
	v := schema.View{Batch: 1, Count: 2}
	if sr, err := c.Store(v, 1, []uint32{0, 1}); err != nil || sr.Stored != 2 {
		t.Fatalf("store: %+v %v", sr, err)
	}
	l, err := c.Acquire(v, 10*time.Second)
	for err == nil && l.State == schema.StateWaiting {
		time.Sleep(5 * time.Millisecond)
		l, err = c.Poll(l.Lease)
	}
	if err != nil || l.State != schema.StateReady || l.Blocks != 2 {
		t.Fatalf("acquire: %+v %v", l, err)
	}
	if _, err := c.Load(l.Lease, 1, 0, []uint32{2, 3}); err != nil {
		t.Fatalf("load: %v", err)
	}
	if !bytes.Equal(buf[:2*slot], buf[2*slot:]) {
		t.Fatal("the loaded pages differ from the stored ones")
	}
	c.Release(l.Lease)

	code, body := get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics answered %d", code)
	}
	c.Close()
	stop()
	e, err := parseExposition(bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return e
}
