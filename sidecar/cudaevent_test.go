package sidecar_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/gpu/gputest"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

const (
	eventDeathTest = "TestCUDAEventDeath"
	eventEngineEnv = "RINGSIDE_SIDECAR_EVENT_ENGINE" // role,socket: this process is an engine of TestCUDAEventDeath
)

// underFakeCUDA runs test in a process of its own against the stand-in
// driver (gpu/gputest/testdata/fakecuda.c) with env added, and reports
// false; in that process it reports true.
func underFakeCUDA(t *testing.T, test string, env ...string) bool {
	t.Helper()
	if os.Getenv(fakeCUDAEnv) != "" {
		return true
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to build the fake driver")
	}
	lib := t.TempDir()
	if out, err := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-o", filepath.Join(lib, "libcuda.so.1"), fakeCUDASource).CombinedOutput(); err != nil {
		t.Fatalf("building the fake driver: %v\n%s", err, out)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.v")
	cmd.Env = append(append(os.Environ(), "LD_LIBRARY_PATH="+lib, fakeCUDAEnv+"=1"), env...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+test) {
		t.Fatalf("under the fake driver: %v\n%s", err, out)
	}
	if testing.Verbose() {
		t.Logf("%s", out)
	}
	return false
}

// TestCUDAEventDeath runs a sidecar with --copy.backend=cuda against the
// stand-in driver. An engine in another process registers GPU memory with
// its store event, records the event while its forward pass still runs
// (FAKECUDA_EVENT_HOLD) and sends a store; it is SIGKILLed before the
// record runs, so the record never does (the stand-in's model of an
// engine's death, probe event-death on a GPU). The sidecar ends the
// session, withdraws the store waiting for the event, and closes the
// dead engine's mapping and event; another engine then registers, stores
// and loads on the same GPU as usual, /healthz and /readyz stay 200, and
// the sidecar shuts down cleanly.
func TestCUDAEventDeath(t *testing.T) {
	counters := t.TempDir()
	if !underFakeCUDA(t, eventDeathTest, "FAKECUDA_COUNTERS="+counters) {
		return
	}
	addr := freeTCPAddr(t)
	base := "/dev/shm"
	if _, err := os.Stat(base); err != nil {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "rs-cuda-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	srv, err := sidecar.New(sidecar.Config{Dir: dir, PoolBytes: 64 * slot, Machine: machine.Config{SlotBytes: slot}, RingCapacity: 64 << 10,
		CopyBackend: "cuda", MetricsAddr: addr}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(context.Background()) }()
	get := func(path string) int {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	waitUntil(t, "/readyz", 10*time.Second, func() bool { return get("/readyz") == http.StatusOK })

	hold := filepath.Join(t.TempDir(), "forward-pass")
	if err := os.WriteFile(hold, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	doomed, lines := startEventEngine(t, "doomed", srv.Config().Socket, "FAKECUDA_EVENT_HOLD="+hold)
	if l := <-lines; l != "stored" {
		t.Fatalf("the doomed engine: %q", l)
	}
	waitUntil(t, "the store's wait for the engine's event", 10*time.Second, func() bool { return gputest.FakeCount(gputest.FakeWaitEvent) >= 1 })
	if n := gputest.FakeCount(gputest.FakeIPCOpen) - gputest.FakeCount(gputest.FakeIPCClose); n != 1 {
		t.Fatalf("%d mappings open with the doomed engine registered, want 1", n)
	}
	doomed.Process.Signal(syscall.SIGKILL)
	doomed.Wait()
	t.Cleanup(func() { // what the killed engine could not remove
		left, _ := filepath.Glob(fmt.Sprintf("/dev/shm/fakecuda-*%d-*", doomed.Process.Pid))
		for _, f := range left {
			os.Remove(f)
		}
	})
	os.Remove(hold) // the forward pass would have ended: the record never runs
	waitUntil(t, "the dead engine's mapping and event closed", 10*time.Second, func() bool {
		return gputest.FakeCount(gputest.FakeIPCOpen) == gputest.FakeCount(gputest.FakeIPCClose) &&
			gputest.FakeCount(gputest.FakeEventOpen) == gputest.FakeCount(gputest.FakeEventClose)
	})
	if n := len(srv.State().Sessions); n != 0 {
		t.Fatalf("%d sessions after the engine's death", n)
	}

	alive, lines := startEventEngine(t, "alive", srv.Config().Socket)
	for l := range lines {
		t.Logf("the other engine: %s", l)
		if l != "ok" {
			t.Errorf("the other engine: %s", l)
		}
	}
	if err := alive.Wait(); err != nil {
		t.Fatalf("the other engine: %v", err)
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		if code := get(path); code != http.StatusOK {
			t.Errorf("%s = %d after an engine died waiting for its event, want 200", path, code)
		}
	}
	srv.Shutdown()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve = %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the sidecar did not shut down")
	}
}

// startEventEngine starts an engine of TestCUDAEventDeath; its output
// lines come on the channel, closed when it exits.
func startEventEngine(t *testing.T, role, sock string, env ...string) (*exec.Cmd, chan string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+eventDeathTest+"Engine$", "-test.count=1")
	cmd.Env = append(append(os.Environ(), eventEngineEnv+"="+role+","+sock), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	lines := make(chan string, 64)
	go func() {
		defer close(lines)
		for sc := bufio.NewScanner(out); sc.Scan(); {
			if s, ok := strings.CutPrefix(sc.Text(), "engine: "); ok {
				lines <- s
			}
		}
	}()
	return cmd, lines
}

// TestCUDAEventDeathEngine is an engine of TestCUDAEventDeath (it runs
// only in the processes that test starts). "doomed" registers 8 slots of
// GPU memory with its store event, records the event, sends a store of 8
// blocks without waiting for it, says "stored" and waits to be killed.
// "alive" registers 8 slots without an event and, 4 times, stores 8
// blocks and loads them back, then says "ok" (or what failed).
func TestCUDAEventDeathEngine(t *testing.T) {
	role, sock, ok := strings.Cut(os.Getenv(eventEngineEnv), ",")
	if !ok {
		t.Skip("an engine process of " + eventDeathTest)
	}
	say := func(format string, args ...any) { fmt.Printf("engine: "+format+"\n", args...) }
	exp, free, err := gputest.ExportCUDA(8 * slot)
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	c, err := connector.Dial(connector.Options{Socket: sock, Instance: "cuda-" + role, Model: "llama", Layout: "bf16/16/HND", Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a := exp.Alloc()
	extra := schema.CUDAExtra{GPU: exp.IPC.GPU, Allocations: []schema.CUDAAllocation{{Handle: a.Handle, Base: a.Base, Size: a.Size}}}
	var ev *gputest.CUDAEvent
	if role == "doomed" {
		if ev, err = gputest.NewCUDAEvent(); err != nil {
			t.Fatal(err)
		}
		extra.Flags, extra.Event = schema.CUDAExtraFlagEvent, ev.Handle
	}
	if err := c.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionCUDAIPC, PID: uint64(os.Getpid()), Base: exp.Base,
		Length: exp.Length, PageSize: slot, PageCount: 8, Extra: extra.Append(nil)}); err != nil {
		t.Fatalf("registering GPU memory: %v", err)
	}
	pages := []uint32{0, 1, 2, 3, 4, 5, 6, 7}
	if role == "doomed" {
		c.PutHashes(1, digests("doomed", 8), false)
		if err := ev.Record(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: 8}, Region: 1, Pages: pages}).Append(nil)); err != nil {
			t.Fatal(err)
		}
		say("stored")
		time.Sleep(time.Minute)
		return
	}
	msg := "ok"
	for i := uint64(1); i <= 4 && msg == "ok"; i++ {
		c.PutHashes(i, digests(fmt.Sprintf("alive-%d", i), 8), false)
		if r, err := c.Store(schema.View{Batch: i, Count: 8}, 1, pages); err != nil || r.Stored != 8 {
			msg = fmt.Sprintf("store %d: %d stored, %v", i, r.Stored, err)
			break
		}
		l, err := c.Acquire(schema.View{Batch: i, Count: 8}, time.Minute)
		if err != nil || l.Lease == 0 {
			msg = fmt.Sprintf("acquire %d: %+v, %v", i, l, err)
			break
		}
		if n, err := c.Load(l.Lease, 1, 0, pages); err != nil {
			msg = fmt.Sprintf("load %d: %d, %v", i, n, err)
		}
		c.Release(l.Lease)
	}
	say("%s", msg)
}

func freeTCPAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// waitUntil polls cond every millisecond until it holds, or fails t after d.
func waitUntil(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
