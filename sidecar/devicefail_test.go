package sidecar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/cuda"
	"github.com/ringside-kv/ringside/internal/testport"
)

// TestSchedulerCancelFencesIssuedChunks: chunks handed to the engine carry
// a fence. Cancelling a session's loads (what an ending session does
// first) drops its queued loads and raises its running loads' fences, not
// its stores'; cancelling the session raises the rest; another session's
// chunks are untouched.
func TestSchedulerCancelFencesIssuedChunks(t *testing.T) {
	e := newGateEngine()
	s := newScheduler(e, budget{2, 8}, budget{2, 8}, time.Hour)
	defer s.close()
	r := &results{errs: map[uint64][]error{}}
	for i, dir := range []gpu.Direction{gpu.PoolToEngine, gpu.EngineToPool, gpu.PoolToEngine, gpu.EngineToPool} {
		s.submit(1, 100, gpu.Op{Dir: dir, Region: 1, Pages: []uint32{uint32(i)}}, nil, r.done(1))
	}
	waitFor(t, "two of session 1's chunks", func() bool { return e.startedOf(1) == 2 })
	s.submit(2, 200, gpu.Op{Dir: gpu.PoolToEngine, Region: 2, Pages: []uint32{0}}, nil, r.done(2))
	waitFor(t, "session 2's chunk", func() bool { return e.startedOf(2) == 1 })
	started := func() []gpu.Op {
		e.mu.Lock()
		defer e.mu.Unlock()
		return append([]gpu.Op(nil), e.started...)
	}
	ops := started()
	for _, op := range ops {
		if op.Fence == nil || op.Fence.Raised() {
			t.Fatalf("op %+v reached the engine without a fence, or with a raised one", op)
		}
	}
	load, store, other := ops[0], ops[1], ops[2]
	if load.Dir != gpu.PoolToEngine || store.Dir != gpu.EngineToPool || other.Region != 2 {
		t.Fatalf("unexpected start order %+v", ops)
	}

	s.cancelLoads(1)
	if !load.Fence.Raised() {
		t.Error("cancelLoads left the running load's fence down")
	}
	if store.Fence.Raised() || other.Fence.Raised() {
		t.Error("cancelLoads raised a store's or another session's fence")
	}
	if _, failed := r.count(1); failed != 1 {
		t.Errorf("cancelLoads ended %d queued chunks, want 1 (the queued load)", failed)
	}
	s.cancel(1)
	if !store.Fence.Raised() {
		t.Error("cancel left the running store's fence down")
	}
	if other.Fence.Raised() {
		t.Error("cancel raised another session's fence")
	}
	if _, failed := r.count(1); failed != 2 {
		t.Errorf("cancel ended %d chunks in all, want 2 (both queued ones)", failed)
	}
	if n := len(started()); n != 3 {
		t.Errorf("%d chunks reached the engine, want 3: a cancelled one was issued", n)
	}
	for e.release(1, nil) || e.release(2, nil) {
	}
}

func freeAddr(t *testing.T) string { return testport.Addr() }

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestDeviceFailedExits: when the CUDA backend reports a failed GPU (the
// callback newCopier installs; gpu/gputest shows the backend calling it
// on a sticky error), /readyz and /healthz turn 503 naming the failure,
// ringside_cuda_device_failed is 1 for that GPU, and the sidecar drains
// and stops with an error wrapping gpu.ErrDeviceFailed (a non-zero exit).
func TestDeviceFailedExits(t *testing.T) {
	defer func(d time.Duration) { deviceFailDrain = d }(deviceFailDrain)
	deviceFailDrain = 200 * time.Millisecond
	addr := freeAddr(t)
	dir := filepath.Join(t.TempDir(), "d")
	cfg := Config{Dir: dir, PoolBytes: 64 * 4096, CopyBackend: "host", MetricsAddr: addr}
	cfg.Machine.SlotBytes = 4096
	srv, err := New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	srv.gpus = []string{"GPU-ok"}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(context.Background()) }()
	base := "http://" + addr
	waitFor(t, "/readyz", func() bool {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if code, _ := get(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz = %d before any failure", code)
	}
	ferr := fmt.Errorf("%w: GPU 0 (GPU-bad): cuda: CUDA_ERROR_ILLEGAL_ADDRESS (700)", gpu.ErrDeviceFailed)
	srv.deviceFailed(cuda.DeviceFailure{Ordinal: 0, UUID: "GPU-bad", Code: 700, Err: ferr})
	srv.deviceFailed(cuda.DeviceFailure{Ordinal: 0, UUID: "GPU-bad", Code: 700, Err: ferr}) // once is enough
	for _, path := range []string{"/readyz", "/healthz"} {
		code, body := get(t, base+path)
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "GPU-bad") || !strings.Contains(body, "(700)") {
			t.Errorf("%s after the failure = %d %q, want 503 naming the GPU and the code", path, code, body)
		}
	}
	_, metrics := get(t, base+"/metrics")
	for _, want := range []string{`ringside_cuda_device_failed{gpu="GPU-bad"} 1`, `ringside_cuda_device_failed{gpu="GPU-ok"} 0`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	select {
	case err := <-done:
		if !errors.Is(err, gpu.ErrDeviceFailed) || !strings.Contains(err.Error(), "GPU-bad") {
			t.Fatalf("Serve = %v, want an error wrapping ErrDeviceFailed naming the GPU", err)
		}
		t.Logf("Serve: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the sidecar did not stop after its GPU failed")
	}
}

// TestDeviceFailedMetricIsTheFailureState: ringside_cuda_device_failed is
// read from the same state as /readyz and /healthz (the failed GPUs), at
// each scrape: a scrape never reads 0 for a GPU /readyz already reports
// failed. (It was set after the failure was published, so a scrape in
// between, as TestCUDADeviceFailure's under load, read 0.)
func TestDeviceFailedMetricIsTheFailureState(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "d")
	cfg := Config{Dir: dir, PoolBytes: 64 * 4096, CopyBackend: "host"}
	cfg.Machine.SlotBytes = 4096
	srv, err := New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.closeResources()
	srv.gpus = []string{"GPU-a", "GPU-b"}
	gauge := func() map[string]float64 {
		t.Helper()
		mfs, err := srv.met.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, mf := range mfs {
			if mf.GetName() != "ringside_cuda_device_failed" {
				continue
			}
			for _, m := range mf.GetMetric() {
				out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
			}
		}
		return out
	}
	if g := gauge(); len(g) != 2 || g["GPU-a"] != 0 || g["GPU-b"] != 0 {
		t.Fatalf("before any failure: %v, want both GPUs at 0", g)
	}
	// The state /readyz reads, as deviceFailed publishes it, and nothing
	// else: the metric must follow from it.
	srv.gpuMu.Lock()
	srv.gpuFailed = map[string]cuda.DeviceFailure{"GPU-a": {UUID: "GPU-a", Code: 700, Err: gpu.ErrDeviceFailed}}
	srv.gpuMu.Unlock()
	if srv.deviceFailure() == nil {
		t.Fatal("deviceFailure reports nothing")
	}
	if g := gauge(); g["GPU-a"] != 1 || g["GPU-b"] != 0 {
		t.Fatalf("with GPU-a failed (what /readyz reports): %v, want GPU-a 1 and GPU-b 0", g)
	}
}
