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
	srv, done := startCUDASidecar(t)
	get := func(path string) int {
		resp, err := http.Get("http://" + srv.Config().MetricsAddr + path)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}

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

// TestCUDADetachAfterRelease runs a sidecar with --copy.backend=cuda
// against the stand-in driver: an engine in another process registers GPU
// memory, stores, and detaches while a store of its is still in a copy
// call (FAKECUDA_COPY_HOLD). The Detach is answered only once the region's
// mapping is closed, after the copy ends: an engine that frees or reuses
// its memory (or destroys its store event) once its session is ended can
// never have the sidecar's copies touch it, nor find its next registration
// handed the old mapping.
func TestCUDADetachAfterRelease(t *testing.T) {
	counters, hold := t.TempDir(), filepath.Join(t.TempDir(), "copy-hold")
	if !underFakeCUDA(t, "TestCUDADetachAfterRelease", "FAKECUDA_COUNTERS="+counters, "FAKECUDA_COPY_HOLD="+hold) {
		return
	}
	hold = os.Getenv("FAKECUDA_COPY_HOLD") // the parent's
	srv, done := startCUDASidecar(t)
	eng, lines := startEventEngine(t, "detach", srv.Config().Socket)
	if l := <-lines; l != "stored" {
		t.Fatalf("the engine: %q", l)
	}
	if n := gputest.FakeCount(gputest.FakeIPCOpen) - gputest.FakeCount(gputest.FakeIPCClose); n != 1 {
		t.Fatalf("%d mappings open with the engine registered, want 1", n)
	}
	calls := func() uint64 { return gputest.FakeCount(gputest.FakeBatch) + gputest.FakeCount(gputest.FakeRange) }
	calls0 := calls()
	if err := os.WriteFile(hold, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(hold) })
	if l := <-lines; l != "storing" {
		t.Fatalf("the engine: %q", l)
	}
	waitUntil(t, "the held store's copy call", 10*time.Second, func() bool { return calls() == calls0+1 })
	if err := os.WriteFile(hold+".detach", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if l := <-lines; l != "detaching" {
		t.Fatalf("the engine: %q", l)
	}
	select {
	case l := <-lines:
		t.Fatalf("the Detach was answered (%q) while a copy on the region was in the driver and its mapping open", l)
	case <-time.After(300 * time.Millisecond):
	}
	os.Remove(hold)
	select {
	case l := <-lines:
		open := gputest.FakeCount(gputest.FakeIPCOpen) - gputest.FakeCount(gputest.FakeIPCClose)
		if l != "detached" || open != 0 {
			t.Fatalf("the engine: %q with %d mappings open, want detached with none", l, open)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the Detach was not answered after the copy ended")
	}
	if err := eng.Wait(); err != nil {
		t.Fatalf("the engine: %v", err)
	}
	srv.Shutdown()
	if err := <-done; err != nil {
		t.Fatalf("Serve = %v", err)
	}
}

// startCUDASidecar starts a sidecar with --copy.backend=cuda in this
// process and waits until /readyz answers 200; done gets Serve's result.
func startCUDASidecar(t *testing.T) (srv *sidecar.Server, done chan error) {
	t.Helper()
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
	srv, err = sidecar.New(sidecar.Config{Dir: dir, PoolBytes: 64 * slot, Machine: machine.Config{SlotBytes: slot}, RingCapacity: 64 << 10,
		CopyBackend: "cuda", MetricsAddr: addr}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	done = make(chan error, 1)
	go func() { done <- srv.Serve(context.Background()) }()
	waitUntil(t, "/readyz", 10*time.Second, func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return srv, done
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
			} else {
				fmt.Fprintf(os.Stderr, "%s engine: %s\n", role, sc.Text())
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
	if role == "detach" {
		detachEngine(t, sock, say)
		return
	}
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

// detachEngine is the engine of TestCUDADetachAfterRelease: it registers
// 8 slots of GPU memory, stores 8 blocks ("stored"), sends a second store
// without waiting for it ("storing"), detaches ("detaching") and says
// "detached" once the Detach is answered.
func detachEngine(t *testing.T, sock string, say func(string, ...any)) {
	exp, free, err := gputest.ExportCUDA(8 * slot)
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	c, err := connector.Dial(connector.Options{Socket: sock, Instance: "cuda-detach", Model: "llama", Layout: "bf16/16/HND", Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	a := exp.Alloc()
	extra := schema.CUDAExtra{GPU: exp.IPC.GPU, Allocations: []schema.CUDAAllocation{{Handle: a.Handle, Base: a.Base, Size: a.Size}}}
	if err := c.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionCUDAIPC, PID: uint64(os.Getpid()), Base: exp.Base,
		Length: exp.Length, PageSize: slot, PageCount: 8, Extra: extra.Append(nil)}); err != nil {
		t.Fatalf("registering GPU memory: %v", err)
	}
	pages := []uint32{0, 1, 2, 3, 4, 5, 6, 7}
	c.PutHashes(1, digests("detach-1", 8), false)
	if r, err := c.Store(schema.View{Batch: 1, Count: 8}, 1, pages); err != nil || r.Stored != 8 {
		t.Fatalf("store: %+v, %v", r, err)
	}
	say("stored")
	hold := os.Getenv("FAKECUDA_COPY_HOLD") // the test holds the sidecar's copy calls with it
	waitFile := func(path string) {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			if _, err := os.Stat(path); err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %s", path)
			}
		}
	}
	waitFile(hold)
	c.PutHashes(2, digests("detach-2", 8), false)
	if _, err := c.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 2, Count: 8}, Region: 1, Pages: pages}).Append(nil)); err != nil {
		t.Fatal(err)
	}
	say("storing")
	waitFile(hold + ".detach") // its copy call has started
	say("detaching")
	if err := c.Close(); err != nil {
		t.Fatalf("detach: %v", err)
	}
	say("detached")
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
