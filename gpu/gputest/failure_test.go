package gputest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/cuda"
	driver "github.com/ringside-kv/ringside/gpu/internal/cuda"
)

// More fake driver counters (enum counter in fakecuda.c, after cDeferred).
const (
	cCtxRetain = nCounters + iota
	cHostReg
	cSticky
)

// copyCalls is the copy calls this process made: cuMemcpyBatchAsync plus
// the per-range async copies.
func copyCalls(fc *counters) uint64 { return fc.get(cBatch) + fc.get(cRange) }

// buildFake builds testdata/fakecuda.c into a directory for LD_LIBRARY_PATH.
func buildFake(t *testing.T) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to build the fake driver")
	}
	dir := t.TempDir()
	build := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-o", filepath.Join(dir, "libcuda.so.1"), "testdata/fakecuda.c")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the fake driver: %v\n%s", err, out)
	}
	return dir
}

// TestCUDAFakeFailures runs the failure tests below against the fake
// driver, each in a process of its own with the fault it injects.
func TestCUDAFakeFailures(t *testing.T) {
	if underFake() {
		t.Skip("already running under the fake driver")
	}
	lib := buildFake(t)
	for _, v := range []struct {
		name, test string
		env        []string
	}{
		{"lazy-context", "TestCUDALazyContext", nil},
		{"exclusive-process", "TestCUDAExclusiveProcess", []string{"FAKECUDA_COMPUTE_MODE=3"}},
		{"sticky", "TestCUDASticky", []string{"FAKECUDA_STICKY_AFTER=1"}},
		{"sticky-per-range", "TestCUDASticky", []string{"FAKECUDA_STICKY_AFTER=1", "RINGSIDE_GPUTEST_PER_RANGE=1"}},
		{"exporter-death", "TestCUDAExporterDeath", nil},
		{"event-death", "TestCUDAEventDeath", nil},
		{"reregister-while-releasing", "TestCUDAReregisterWhileReleasing", nil},
		{"watchdog", "TestCUDAWatchdog", []string{"FAKECUDA_EVENT_US=150000"}},
		{"poll-latency", "TestCUDAPollLatency", []string{"FAKECUDA_EVENT_US=2000"}},
		{"pin-in-background", "TestCUDAPinInBackground", []string{"FAKECUDA_PIN_US_PER_MIB=51200"}},
	} {
		t.Run(v.name, func(t *testing.T) {
			args := []string{"-test.run=^" + v.test + "$", "-test.count=1"}
			if testing.Verbose() {
				args = append(args, "-test.v")
			}
			cmd := exec.Command(os.Args[0], args...)
			cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+lib, "RINGSIDE_GPUTEST_FAKE=1", "RINGSIDE_REQUIRE_GPU=1",
				"FAKECUDA_COUNTERS="+t.TempDir(), "FAKECUDA_COPY_HOLD="+filepath.Join(t.TempDir(), "copy-hold"))
			cmd.Env = append(cmd.Env, v.env...)
			out, err := cmd.CombinedOutput()
			if err != nil || !strings.Contains(string(out), "PASS") || strings.Contains(string(out), "SKIP") {
				t.Fatalf("under the fake driver: %v\n%s", err, out)
			}
			if testing.Verbose() {
				t.Logf("%s", out)
			}
		})
	}
}

func needFake(t *testing.T) *counters {
	t.Helper()
	if !underFake() {
		t.Skip("injects faults into the fake driver (TestCUDAFakeFailures runs it)")
	}
	fc := fakeCounters(t)
	if fc == nil {
		t.Fatal("FAKECUDA_COUNTERS is not set")
	}
	return fc
}

// copyHold makes the fake's copy calls block while it is held: the device
// thread is then busy inside the driver and the ops submitted meanwhile
// wait in the device's queue.
type copyHold string

func (h copyHold) hold(t *testing.T) {
	t.Helper()
	if err := os.WriteFile(string(h), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.release)
}

func (h copyHold) release() { os.Remove(string(h)) }

func getCopyHold(t *testing.T) copyHold {
	h := os.Getenv("FAKECUDA_COPY_HOLD")
	if h == "" {
		t.Fatal("FAKECUDA_COPY_HOLD is not set")
	}
	return copyHold(h)
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func result(t *testing.T, what string, ch <-chan gpu.Result) gpu.Result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not complete", what)
		return gpu.Result{}
	}
}

// TestCUDALazyContext: cuda.New takes no context and pins nothing (an
// engine starting beside the sidecar profiles all of the GPU's free
// memory); the first registration retains the device's primary context
// and pins the pool, and later ones do neither again.
func TestCUDALazyContext(t *testing.T) {
	fc := needFake(t)
	retained, pinned := fc.get(cCtxRetain), fc.get(cHostReg)
	pool := mapPool(t, 64<<20)
	pins := make(chan error, 1)
	c, err := cuda.New(pool, cuda.Options{PinChunk: 4 << 20, OnPinned: func(_ cuda.PinInfo, err error) { pins <- err }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if n := fc.get(cCtxRetain) - retained; n != 0 {
		t.Fatalf("cuda.New retained %d primary contexts, want none before a registration", n)
	}
	if n := fc.get(cHostReg) - pinned; n != 0 {
		t.Fatalf("cuda.New made %d cuMemHostRegister calls, want none before a registration", n)
	}
	if p := c.Info().Pin; p.Chunks != 0 {
		t.Fatalf("Info reports the pool pinned (%+v) before any registration", p)
	}
	peer := startPeer(t, "cuda")
	exp := peer.alloc(t, 1<<20, 0)
	t0 := time.Now()
	h, err := c.Register(exp.Region(4096, 256, nil))
	first := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-pins; err != nil {
		t.Fatalf("OnPinned: %v", err)
	}
	if n := fc.get(cCtxRetain) - retained; n != 1 {
		t.Errorf("the first registration retained %d contexts, want 1", n)
	}
	if n := fc.get(cHostReg) - pinned; n != 16 {
		t.Errorf("the first registration pinned %d chunks, want 16 (64 MiB in 4 MiB)", n)
	}
	if p := c.Info().Pin; p.Chunks != 16 || p.Bytes != 64<<20 {
		t.Errorf("Info().Pin = %+v after the first registration", p)
	}
	t0 = time.Now()
	h2, err := c.Register(exp.Region(4096, 128, nil))
	second := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if n := fc.get(cCtxRetain) - retained; n != 1 {
		t.Errorf("a second registration retained a context again (%d in all)", n)
	}
	if n := fc.get(cHostReg) - pinned; n != 16 {
		t.Errorf("a second registration pinned again (%d chunks in all)", n)
	}
	// The simulator's pinning costs nothing; on a GPU it is about 0.1 s
	// per GiB of pool (bench/gpu/run.sh measures it).
	t.Logf("first registration (context + pinning %d MiB in %d chunks, fake driver): %v; second: %v", len(pool)>>20, c.Info().Pin.Chunks, first, second)
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{3}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatal(err)
	}
	c.Unregister(h)
	c.Unregister(h2)
}

// TestCUDAExclusiveProcess: a GPU in EXCLUSIVE_PROCESS compute mode is
// refused at registration, with a message, before any context is made;
// the backend itself starts (it holds no context).
func TestCUDAExclusiveProcess(t *testing.T) {
	fc := needFake(t)
	retained := fc.get(cCtxRetain)
	pool := mapPool(t, 4<<20)
	c, err := cuda.New(pool, cuda.Options{})
	if err != nil {
		t.Fatalf("cuda.New with an EXCLUSIVE_PROCESS GPU: %v (it takes no context, so it must start)", err)
	}
	defer c.Close()
	peer := startPeer(t, "cuda")
	exp := peer.alloc(t, 1<<20, 0)
	_, err = c.Register(exp.Region(4096, 256, nil))
	if !errors.Is(err, gpu.ErrUnsupported) || !strings.Contains(err.Error(), "EXCLUSIVE_PROCESS") || !strings.Contains(err.Error(), "-c DEFAULT") {
		t.Fatalf("Register on an EXCLUSIVE_PROCESS GPU = %v, want ErrUnsupported naming the mode and the fix", err)
	}
	t.Log(err)
	if n := fc.get(cCtxRetain) - retained; n != 0 {
		t.Errorf("%d contexts retained on an EXCLUSIVE_PROCESS GPU, want none", n)
	}
}

// TestCUDASticky (FAKECUDA_STICKY_AFTER=1: the first copy call poisons
// the context with CUDA_ERROR_ILLEGAL_ADDRESS): the device is marked
// failed; the store started before it (waiting at the gate of the
// engine's event, not issued), the op whose call failed, and the ops
// waiting in the device's queue all fail with ErrDeviceFailed naming the
// GPU and the code; no copy call is made afterwards; new ops and
// registrations fail at once.
func TestCUDASticky(t *testing.T) {
	fc := needFake(t)
	hold := getCopyHold(t)
	mode := cuda.CopyAuto
	if os.Getenv("RINGSIDE_GPUTEST_PER_RANGE") != "" {
		mode = cuda.CopyPerRange
	}
	pool := mapPool(t, 4<<20)
	failures := make(chan cuda.DeviceFailure, 4)
	c, err := cuda.New(pool, cuda.Options{Copy: mode, OnDeviceFailed: func(f cuda.DeviceFailure) { failures <- f }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	evHold := filepath.Join(t.TempDir(), "event-hold")
	peer := startPeerEnv(t, "cuda", "FAKECUDA_EVENT_HOLD="+evHold)
	ev, err := peer.p.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	const pageLen, pages = 64 << 10, 8
	exp := peer.alloc(t, pageLen*pages, 0)
	r := exp.Region(pageLen, pages, nil)
	r.IPC.Event, r.IPC.HasEvent = ev.Handle, true
	h, err := c.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	// The engine is still writing: a store on the region stays in flight.
	if err := os.WriteFile(evHold, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(evHold)
	if err := peer.p.Record(ev.ID); err != nil {
		t.Fatal(err)
	}
	calls0, waits0 := copyCalls(fc), fc.get(cWaitEvent)
	submit := func(dir gpu.Direction, page uint32) chan gpu.Result {
		t.Helper()
		ch := make(chan gpu.Result, 1)
		if err := c.Submit(gpu.Op{Dir: dir, Region: h, Pages: []uint32{page}, PoolOffsets: []uint64{uint64(page) * pageLen}},
			func(r gpu.Result) { ch <- r }); err != nil {
			t.Fatal(err)
		}
		return ch
	}
	inFlight := submit(gpu.EngineToPool, 0) // gated behind the event: no copy call
	waitFor(t, "the store's wait at its gate", func() bool { return fc.get(cWaitEvent) == waits0+1 })
	// The next call blocks in the driver until released, then fails:
	// the ops submitted meanwhile wait in the device's queue.
	hold.hold(t)
	failing := submit(gpu.PoolToEngine, 1) // copy call 1: CUDA_ERROR_ILLEGAL_ADDRESS
	waitFor(t, "the load's copy call", func() bool { return copyCalls(fc) == calls0+1 })
	queued := []chan gpu.Result{submit(gpu.PoolToEngine, 2), submit(gpu.EngineToPool, 3), submit(gpu.PoolToEngine, 4)}
	hold.release()

	check := func(what string, res gpu.Result) {
		t.Helper()
		var ce *gpu.CopyError
		if !errors.Is(res.Err, gpu.ErrDeviceFailed) || !errors.As(res.Err, &ce) || ce.Region != h {
			t.Fatalf("%s: %v, want a *CopyError for region %d wrapping ErrDeviceFailed", what, res.Err, h)
		}
		msg := res.Err.Error()
		for _, want := range []string{"GPU 0", driver.UUID(exp.IPC.GPU).String(), "CUDA_ERROR_ILLEGAL_ADDRESS (700)"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: %q does not name %q", what, msg, want)
			}
		}
		if res.Bytes != 0 {
			t.Errorf("%s: %d bytes reported copied", what, res.Bytes)
		}
	}
	check("the op whose call failed", result(t, "the failing load", failing))
	check("the gated store", result(t, "the gated store", inFlight))
	for i, ch := range queued {
		check("queued op "+itoa(i+1), result(t, "a queued op", ch))
	}
	select {
	case f := <-failures:
		if f.Code != 700 || f.UUID != driver.UUID(exp.IPC.GPU).String() || f.Ordinal != 0 || !errors.Is(f.Err, gpu.ErrDeviceFailed) {
			t.Errorf("OnDeviceFailed got %+v", f)
		}
		t.Logf("device failure: %v", f.Err)
	case <-time.After(10 * time.Second):
		t.Fatal("OnDeviceFailed was not called")
	}
	if n := copyCalls(fc) - calls0; n != 1 {
		t.Fatalf("%d copy calls, want 1: neither the gated store nor the queued ops may be issued on a failed device", n)
	}
	// A new op fails at once, without a call.
	err = c.Submit(gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{5}, PoolOffsets: []uint64{0}}, func(gpu.Result) {
		t.Error("done called for an op refused by Submit")
	})
	if !errors.Is(err, gpu.ErrDeviceFailed) {
		t.Fatalf("Submit on a failed device = %v, want ErrDeviceFailed", err)
	}
	if _, err := c.Register(exp.Region(pageLen, pages, nil)); !errors.Is(err, gpu.ErrDeviceFailed) || !errors.Is(err, gpu.ErrUnsupported) {
		t.Fatalf("Register on a failed device = %v, want ErrDeviceFailed and ErrUnsupported (the engine's refusal: status 12)", err)
	}
	if n := copyCalls(fc) - calls0; n != 1 {
		t.Fatalf("%d copy calls after the failure, want none", n-1)
	}
	select {
	case f := <-failures:
		t.Fatalf("OnDeviceFailed called twice (%+v)", f)
	default:
	}
	if err := c.Unregister(h); err != nil {
		t.Fatal(err)
	}
}

// TestCUDAExporterDeath: an engine is SIGKILLed while copies on its memory
// wait in the device's queue (the device thread is busy in a call for
// another engine). Its session's end raises the ops' fences: they end
// with ErrFenced and none is issued, so the dead exporter's memory is
// never touched and the other engine keeps its GPU. Unfenced, the fake
// models such a copy as the review's hypothesis (probe exporter-death
// must confirm it): CUDA_ERROR_ILLEGAL_ADDRESS, and the device fails.
func TestCUDAExporterDeath(t *testing.T) {
	fc := needFake(t)
	hold := getCopyHold(t)
	pool := mapPool(t, 4<<20)
	failures := make(chan cuda.DeviceFailure, 4)
	c, err := cuda.New(pool, cuda.Options{OnDeviceFailed: func(f cuda.DeviceFailure) { failures <- f }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const pageLen, pages = 64 << 10, 8
	alive, doomed := startPeer(t, "cuda"), startPeer(t, "cuda")
	ea, ed := alive.alloc(t, pageLen*pages, 0), doomed.alloc(t, pageLen*pages, 0)
	ha, err := c.Register(ea.Region(pageLen, pages, nil))
	if err != nil {
		t.Fatal(err)
	}
	hd, err := c.Register(ed.Region(pageLen, pages, nil))
	if err != nil {
		t.Fatal(err)
	}
	calls0 := copyCalls(fc)
	submit := func(h gpu.Handle, dir gpu.Direction, page uint32, fence *gpu.Fence) chan gpu.Result {
		t.Helper()
		ch := make(chan gpu.Result, 1)
		if err := c.Submit(gpu.Op{Dir: dir, Region: h, Pages: []uint32{page}, PoolOffsets: []uint64{uint64(page) * pageLen}, Fence: fence},
			func(r gpu.Result) { ch <- r }); err != nil {
			t.Fatal(err)
		}
		return ch
	}
	hold.hold(t)
	busy := submit(ha, gpu.PoolToEngine, 0, nil) // the device thread is in this call
	waitFor(t, "the other engine's copy call", func() bool { return copyCalls(fc) == calls0+1 })
	var fences [3]gpu.Fence
	queued := []chan gpu.Result{
		submit(hd, gpu.PoolToEngine, 1, &fences[0]),
		submit(hd, gpu.EngineToPool, 2, &fences[1]),
		submit(hd, gpu.PoolToEngine, 3, &fences[2]),
	}
	if err := doomed.p.Kill(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // what the killed exporter could not remove
		left, _ := filepath.Glob(fmt.Sprintf("/dev/shm/fakecuda-%d-*", ed.PID))
		for _, f := range left {
			os.Remove(f)
		}
	})
	for i := range fences { // the session's end (the sidecar's scheduler does this)
		fences[i].Raise()
	}
	hold.release()
	if res := result(t, "the other engine's load", busy); res.Err != nil {
		t.Fatalf("the other engine's load: %v", res.Err)
	}
	for i, ch := range queued {
		res := result(t, "a queued op of the dead engine", ch)
		if !errors.Is(res.Err, gpu.ErrFenced) || res.Bytes != 0 {
			t.Fatalf("queued op %d of the dead engine: %v (%d bytes), want ErrFenced", i+1, res.Err, res.Bytes)
		}
	}
	if n := copyCalls(fc) - calls0; n != 1 {
		t.Fatalf("%d copy calls, want 1: a fenced op was issued", n)
	}
	// A raised fence also refuses at Submit.
	var f gpu.Fence
	f.Raise()
	err = c.Submit(gpu.Op{Dir: gpu.PoolToEngine, Region: hd, Pages: []uint32{0}, PoolOffsets: []uint64{0}, Fence: &f}, func(gpu.Result) {
		t.Error("done called for an op refused by Submit")
	})
	if !errors.Is(err, gpu.ErrFenced) {
		t.Fatalf("Submit with a raised fence = %v, want ErrFenced", err)
	}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.EngineToPool, Region: ha, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatalf("the other engine after the death: %v", err)
	}
	select {
	case f := <-failures:
		t.Fatalf("the device failed although nothing touched the dead exporter: %v", f.Err)
	default:
	}
	// What the fence prevents: a copy on the dead exporter's memory.
	calls1 := copyCalls(fc)
	_, err = gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: hd, Pages: []uint32{0}, PoolOffsets: []uint64{0}})
	if !errors.Is(err, gpu.ErrDeviceFailed) || !strings.Contains(err.Error(), "(700)") {
		t.Fatalf("a copy on the dead exporter's memory = %v, want ErrDeviceFailed with CUDA_ERROR_ILLEGAL_ADDRESS (the fake's model)", err)
	}
	select {
	case f := <-failures:
		t.Logf("unfenced: %v", f.Err)
	case <-time.After(10 * time.Second):
		t.Fatal("OnDeviceFailed was not called")
	}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: ha, Pages: []uint32{0}, PoolOffsets: []uint64{0}}); !errors.Is(err, gpu.ErrDeviceFailed) {
		t.Fatalf("the other engine on the failed device: %v, want ErrDeviceFailed", err)
	}
	if n := copyCalls(fc) - calls1; n != 1 {
		t.Errorf("%d copy calls after the dead exporter's, want 1 (its own)", n)
	}
	c.Unregister(ha)
	c.Unregister(hd)
}

// TestCUDAEventDeath: an engine is SIGKILLed while a store on its region
// waits for its store event, whose record is still pending (the work
// before it "still runs": FAKECUDA_EVENT_HOLD), so the record never
// completes (the fake's model of an exporter's death). The store is held
// at the event's gate, on the host: nothing of the other engine's waits
// behind it, stores and loads alike, however many; a store submitted on
// the dead engine's region after the death is gated too; the session's
// end (the fences) withdraws both without a copy of the dead engine's
// memory; Unregister returns, and the dead engine's mapping and event are
// closed.
func TestCUDAEventDeath(t *testing.T) {
	fc := needFake(t)
	pool := mapPool(t, 4<<20)
	failures := make(chan cuda.DeviceFailure, 4)
	c, err := cuda.New(pool, cuda.Options{OnDeviceFailed: func(f cuda.DeviceFailure) { failures <- f }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const pageLen, pages = 64 << 10, 8
	evHold := filepath.Join(t.TempDir(), "event-hold")
	alive, doomed := startPeer(t, "cuda"), startPeerEnv(t, "cuda", "FAKECUDA_EVENT_HOLD="+evHold)
	ea := alive.alloc(t, pageLen*pages, 0)
	ha, err := c.Register(ea.Region(pageLen, pages, nil))
	if err != nil {
		t.Fatal(err)
	}
	mapped, events := fc.get(cIPCOpen)-fc.get(cIPCClose), fc.get(cEventOpen)-fc.get(cEventClose)
	ev, err := doomed.p.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	ed := doomed.alloc(t, pageLen*pages, 0)
	rd := ed.Region(pageLen, pages, nil)
	rd.IPC.Event, rd.IPC.HasEvent = ev.Handle, true
	hd, err := c.Register(rd)
	if err != nil {
		t.Fatal(err)
	}
	submit := func(h gpu.Handle, dir gpu.Direction, page uint32, fence *gpu.Fence) chan gpu.Result {
		t.Helper()
		ch := make(chan gpu.Result, 1)
		if err := c.Submit(gpu.Op{Dir: dir, Region: h, Pages: []uint32{page}, PoolOffsets: []uint64{uint64(page) * pageLen}, Fence: fence},
			func(r gpu.Result) { ch <- r }); err != nil {
			t.Fatal(err)
		}
		return ch
	}
	// The engine's forward pass is still running when it records the
	// event and sends the store; then it is killed.
	if err := os.WriteFile(evHold, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := doomed.p.Record(ev.ID); err != nil {
		t.Fatal(err)
	}
	calls0, waits0 := copyCalls(fc), fc.get(cWaitEvent)
	var fences [2]gpu.Fence
	gated := []chan gpu.Result{submit(hd, gpu.EngineToPool, 0, &fences[0])}
	waitFor(t, "the store's wait at its gate", func() bool { return fc.get(cWaitEvent) == waits0+1 })
	if err := doomed.p.Kill(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // what the killed exporter could not remove
		left, _ := filepath.Glob(fmt.Sprintf("/dev/shm/fakecuda-*%d-*", ed.PID))
		for _, f := range left {
			os.Remove(f)
		}
	})
	os.Remove(evHold) // its work would have ended by now: the record still never runs
	gated = append(gated, submit(hd, gpu.EngineToPool, 1, &fences[1]))

	// The other engine: more stores than the stall limit cancels, and
	// loads, each done in time.
	for i := range 8 {
		dir := gpu.EngineToPool
		if i%2 == 1 {
			dir = gpu.PoolToEngine
		}
		if res := result(t, "the other engine's copy", submit(ha, dir, uint32(i%pages), nil)); res.Err != nil {
			t.Fatalf("the other engine's copy %d: %v", i, res.Err)
		}
	}
	for i, ch := range gated {
		select {
		case res := <-ch:
			t.Fatalf("the dead engine's store %d ended before its session did: %+v", i, res)
		default:
		}
	}
	if n := copyCalls(fc) - calls0; n != 8 {
		t.Fatalf("%d copy calls, want 8 (the other engine's): a store of the dead engine was issued", n)
	}
	for i := range fences { // the session's end (the sidecar's scheduler does this)
		fences[i].Raise()
	}
	for i, ch := range gated {
		if res := result(t, "a gated store of the dead engine", ch); !errors.Is(res.Err, gpu.ErrFenced) || res.Bytes != 0 {
			t.Fatalf("gated store %d of the dead engine: %v (%d bytes), want ErrFenced", i, res.Err, res.Bytes)
		}
	}
	unregistered := make(chan error, 1)
	go func() { unregistered <- c.Unregister(hd) }()
	select {
	case err := <-unregistered:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Unregister of the dead engine's region did not return")
	}
	if n := fc.get(cIPCOpen) - fc.get(cIPCClose); n != mapped {
		t.Errorf("%d mappings open after the dead engine's region went, want %d (the other engine's)", n, mapped)
	}
	if n := fc.get(cEventOpen) - fc.get(cEventClose); n != events {
		t.Errorf("%d events open after the dead engine's region went, want %d", n, events)
	}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.EngineToPool, Region: ha, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatalf("the other engine after the death: %v", err)
	}
	select {
	case f := <-failures:
		t.Fatalf("the device failed: %v", f.Err)
	default:
	}
	if err := c.Unregister(ha); err != nil {
		t.Fatal(err)
	}
}

// TestCUDAWatchdog (FAKECUDA_EVENT_US=150000: every copy's completion
// event fires 150 ms after its copies run): copies queued behind each
// other each count from when they reach the head of their stream, so a
// queue of copies longer than the bound, each within it, passes (with
// room for a loaded machine's late polls); a copy that outlives the
// bound fails the device with ErrWedged (code 0), with the ops behind it,
// and Unregister and Close return.
func TestCUDAWatchdog(t *testing.T) {
	needFake(t)
	if os.Getenv("FAKECUDA_EVENT_US") != "150000" {
		t.Fatal("FAKECUDA_EVENT_US is not 150000")
	}
	const pageLen, pages = 64 << 10, 8
	peer := startPeer(t, "cuda")
	exp := peer.alloc(t, pageLen*pages, 0)
	submit := func(c *cuda.Engine, h gpu.Handle, page uint32) chan gpu.Result {
		t.Helper()
		ch := make(chan gpu.Result, 1)
		if err := c.Submit(gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{page}, PoolOffsets: []uint64{uint64(page) * pageLen}},
			func(r gpu.Result) { ch <- r }); err != nil {
			t.Fatal(err)
		}
		return ch
	}

	failures := make(chan cuda.DeviceFailure, 4)
	onFail := func(f cuda.DeviceFailure) { failures <- f }
	c, err := cuda.New(mapPool(t, 4<<20), cuda.Options{Watchdog: 600 * time.Millisecond, OnDeviceFailed: onFail})
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.Register(exp.Region(pageLen, pages, nil))
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	var queued []chan gpu.Result
	for i := range 6 {
		queued = append(queued, submit(c, h, uint32(i)))
	}
	for i, ch := range queued {
		if res := result(t, "a queued load", ch); res.Err != nil {
			t.Fatalf("load %d of 6 queued (each 150 ms, bound 600 ms): %v", i, res.Err)
		}
	}
	if took := time.Since(t0); took < 6*150*time.Millisecond {
		t.Fatalf("6 loads of 150 ms each took %v: the simulator ran them side by side", took)
	} else {
		t.Logf("6 loads of 150 ms each, queued together, took %v under a 600 ms bound", took)
	}
	c.Unregister(h)
	c.Close()
	select {
	case f := <-failures:
		t.Fatalf("the watchdog failed a device whose copies progress: %v", f.Err)
	default:
	}

	c, err = cuda.New(mapPool(t, 4<<20), cuda.Options{Watchdog: 50 * time.Millisecond, OnDeviceFailed: onFail})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h, err = c.Register(exp.Region(pageLen, pages, nil))
	if err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	late, behind := submit(c, h, 0), submit(c, h, 1)
	for _, ch := range []chan gpu.Result{late, behind} {
		res := result(t, "a load past the bound", ch)
		if !errors.Is(res.Err, gpu.ErrDeviceFailed) || !errors.Is(res.Err, cuda.ErrWedged) || !strings.Contains(res.Err.Error(), "wedged") {
			t.Fatalf("a load of 150 ms under a 50 ms bound: %v, want ErrDeviceFailed wrapping ErrWedged", res.Err)
		}
		if ch == late {
			t.Logf("failed after %v: %v", time.Since(t0), res.Err)
		}
	}
	select {
	case f := <-failures:
		if f.Code != 0 || !errors.Is(f.Err, cuda.ErrWedged) || f.UUID != driver.UUID(exp.IPC.GPU).String() {
			t.Errorf("OnDeviceFailed got %+v", f)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("OnDeviceFailed was not called")
	}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{2}, PoolOffsets: []uint64{0}}); !errors.Is(err, gpu.ErrDeviceFailed) {
		t.Fatalf("a load after the watchdog fired: %v, want ErrDeviceFailed", err)
	}
	if err := c.Unregister(h); err != nil {
		t.Fatal(err)
	}
}

// TestCUDAReregisterWhileReleasing: an engine's region is being
// unregistered (its session ended; a copy on it is still in the driver:
// FAKECUDA_COPY_HOLD) when a registration of the same allocation handle
// by the same process comes, as after the engine freed its KV cache and
// allocated a new one that yields an identical handle. The driver would
// hand back the open mapping (it reference-counts a handle opened twice
// in a context), the old, freed pages; so the registration waits until
// the old region's mapping is closed, then opens the handle afresh.
func TestCUDAReregisterWhileReleasing(t *testing.T) {
	fc := needFake(t)
	hold := getCopyHold(t)
	pool := mapPool(t, 4<<20)
	c, err := cuda.New(pool, cuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const pageLen, pages = 64 << 10, 8
	peer := startPeer(t, "cuda")
	exp := peer.alloc(t, pageLen*pages, 0)
	h1, err := c.Register(exp.Region(pageLen, pages, nil))
	if err != nil {
		t.Fatal(err)
	}
	opens, closes, calls0 := fc.get(cIPCOpen), fc.get(cIPCClose), copyCalls(fc)
	hold.hold(t)
	copied := make(chan gpu.Result, 1)
	if err := c.Submit(gpu.Op{Dir: gpu.EngineToPool, Region: h1, Pages: []uint32{0}, PoolOffsets: []uint64{0}}, func(r gpu.Result) { copied <- r }); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the copy call", func() bool { return copyCalls(fc) == calls0+1 })
	unregistered := make(chan error, 1)
	go func() { unregistered <- c.Unregister(h1) }()
	time.Sleep(50 * time.Millisecond) // Unregister is waiting for the copy
	registered := make(chan error, 1)
	var h2 gpu.Handle
	go func() {
		var err error
		h2, err = c.Register(exp.Region(pageLen, pages, nil))
		registered <- err
	}()
	select {
	case err := <-registered:
		t.Fatalf("the registration of a handle whose mapping is being closed returned (%v) before it was closed: it shares the old mapping", err)
	case <-time.After(200 * time.Millisecond):
	}
	hold.release()
	if res := result(t, "the held copy", copied); res.Err != nil {
		t.Fatal(res.Err)
	}
	for what, ch := range map[string]chan error{"Unregister": unregistered, "Register": registered} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s did not return", what)
		}
	}
	if o, cl := fc.get(cIPCOpen)-opens, fc.get(cIPCClose)-closes; o != 1 || cl != 1 {
		t.Fatalf("%d opens and %d closes of the handle, want 1 and 1: the old mapping closed, then the handle opened afresh", o, cl)
	}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h2, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Unregister(h2); err != nil {
		t.Fatal(err)
	}
}

// TestCUDAPollLatency (FAKECUDA_EVENT_US=2000: every copy's completion
// event fires 2 ms after its copies run, past the device's 50 µs spin):
// how late the device goroutine notices a completion, the median of 100
// ops. Go's timer wakes a goroutine locked to its thread about 1 ms late,
// which would make it about half of that; the poll sleeps in nanosleep
// instead. The bound follows what this machine's own nanosleep does in
// the same test (on a loaded machine a thread's wake-up is late too), so
// that it cannot flake under load and still tells 1 ms from 50 µs.
func TestCUDAPollLatency(t *testing.T) {
	needFake(t)
	const opTime = 2 * time.Millisecond
	if os.Getenv("FAKECUDA_EVENT_US") != "2000" {
		t.Fatal("FAKECUDA_EVENT_US is not 2000")
	}
	c, err := cuda.New(mapPool(t, 4<<20), cuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	peer := startPeer(t, "cuda")
	exp := peer.alloc(t, 64<<10, 0)
	h, err := c.Register(exp.Region(4096, 16, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Unregister(h)
	// A loaded machine (others' tests on 2 vCPUs) delays the device
	// thread's wake-ups in bursts that a baseline measured a moment later
	// does not see; a poll that sleeps on a Go timer is late every time.
	// So: up to three rounds, each against its own baseline; one within
	// the bound passes.
	for round := 1; ; round++ {
		var late []time.Duration
		for i := range 100 {
			res, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{uint32(i % 16)}, PoolOffsets: []uint64{0}})
			if err != nil {
				t.Fatal(err)
			}
			late = append(late, res.Elapsed-opTime)
		}
		sleep := nanosleepLateness(t, 50*time.Microsecond)
		got, bound := median(late), 150*time.Microsecond+2*sleep
		t.Logf("round %d: a completion is noticed %v after it (median of 100; p90 %v); this machine's nanosleep of 50 µs ends %v late (median)",
			round, got, quantile(late, 0.9), sleep)
		if got <= bound {
			return
		}
		if round == 3 {
			t.Fatalf("completions are noticed %v late (median), more than %v, in 3 rounds: the poll's sleep is not the thread's own", got, bound)
		}
	}
}

// nanosleepLateness is the median of how late a nanosleep of d ends, on
// a thread locked like the device's, with the same timer slack.
func nanosleepLateness(t *testing.T, d time.Duration) time.Duration {
	t.Helper()
	ch := make(chan time.Duration)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		syscall.RawSyscall6(syscall.SYS_PRCTL, 29 /* PR_SET_TIMERSLACK */, 1000, 0, 0, 0, 0)
		var late []time.Duration
		ts := syscall.NsecToTimespec(int64(d))
		for range 200 {
			t0 := time.Now()
			syscall.Nanosleep(&ts, nil)
			late = append(late, time.Since(t0)-d)
		}
		ch <- median(late)
	}()
	return <-ch
}

func median(ds []time.Duration) time.Duration { return quantile(ds, 0.5) }

func quantile(ds []time.Duration, q float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[int(q*float64(len(s)-1))]
}

// TestCUDAPinInBackground (FAKECUDA_PIN_US_PER_MIB=51200: pinning the
// 64 MiB pool takes 3.3 s, what a 32 GiB pool takes on a GPU machine at
// 0.1 s per GiB): the first registration returns within the plugin's 2 s
// deadline (it waits for the pinning at most PinWait, 1 s by default), a
// copy submitted while the pinning goes on fails at once naming it, and
// once the pool is pinned copies run.
func TestCUDAPinInBackground(t *testing.T) {
	needFake(t)
	if os.Getenv("FAKECUDA_PIN_US_PER_MIB") != "51200" {
		t.Fatal("FAKECUDA_PIN_US_PER_MIB is not 51200")
	}
	pool := mapPool(t, 64<<20)
	pinned := make(chan cuda.PinInfo, 1)
	c, err := cuda.New(pool, cuda.Options{PinChunk: 4 << 20, OnPinned: func(p cuda.PinInfo, err error) {
		if err != nil {
			t.Errorf("pinning: %v", err)
		}
		pinned <- p
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	peer := startPeer(t, "cuda")
	exp := peer.alloc(t, 64<<10, 0)
	t0 := time.Now()
	h, err := c.Register(exp.Region(4096, 16, nil))
	took := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	// It returned before the pinning ended: the copy below fails, saying
	// so. Its time (about PinWait) is a figure.
	t.Logf("the first registration returned after %v with the pinning going on (PinWait 1 s)", took)
	op := gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{1}, PoolOffsets: []uint64{0}}
	if _, err := gpu.Do(c, op); !errors.Is(err, gpu.ErrTransfer) || !strings.Contains(err.Error(), "pinned") {
		t.Fatalf("a copy while the pool is being pinned: %v, want ErrTransfer saying so", err)
	} else {
		t.Log(err)
	}
	var p cuda.PinInfo
	select {
	case p = <-pinned:
	case <-time.After(30 * time.Second):
		t.Fatal("the pool was never pinned")
	}
	if _, err := gpu.Do(c, op); err != nil {
		t.Fatalf("a copy once the pool is pinned: %v", err)
	}
	t0 = time.Now()
	h2, err := c.Register(exp.Region(4096, 8, nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first registration %v (the pool's pinning took %v, %d chunks); a later one %v", took, p.Took, p.Chunks, time.Since(t0))
	c.Unregister(h2)
	c.Unregister(h)
}
