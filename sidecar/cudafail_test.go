package sidecar_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/gputest"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

const (
	fakeCUDAEnv     = "RINGSIDE_SIDECAR_FAKE_CUDA"   // this process runs against the stand-in driver
	cudaEngineEnv   = "RINGSIDE_SIDECAR_CUDA_ENGINE" // this process is the engine of TestCUDADeviceFailure
	cudaEngineTest  = "TestCUDADeviceFailureEngine"  // the test that plays it
	cudaFailureTest = "TestCUDADeviceFailure"        // the sidecar's side
	fakeCUDASource  = "../gpu/gputest/testdata/fakecuda.c"
)

// TestCUDADeviceFailure runs a sidecar with --copy.backend=cuda against the
// stand-in driver (gpu/gputest/testdata/fakecuda.c) with
// FAKECUDA_STICKY_AFTER=1: the first copy poisons the context with
// CUDA_ERROR_ILLEGAL_ADDRESS. An engine in another process exports GPU
// memory, registers it and stores: the store fails with status 11 naming
// the failed GPU, /readyz turns 503, ringside_cuda_device_failed is 1 for
// the GPU while the sidecar drains, and Serve ends with an error wrapping
// gpu.ErrDeviceFailed (the sidecar exits to be restarted). The drain is
// made long here, and the test ends it itself once it has looked:
// TestDeviceFailedExits shows the drain ending on its own. (With the
// second of the default drain, a loaded machine could end it before the
// test's scrape.)
func TestCUDADeviceFailure(t *testing.T) {
	if os.Getenv(fakeCUDAEnv) == "" {
		gcc, err := exec.LookPath("gcc")
		if err != nil {
			t.Skip("no gcc to build the fake driver")
		}
		lib := t.TempDir()
		if out, err := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-o", filepath.Join(lib, "libcuda.so.1"), fakeCUDASource).CombinedOutput(); err != nil {
			t.Fatalf("building the fake driver: %v\n%s", err, out)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^"+cudaFailureTest+"$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+lib, fakeCUDAEnv+"=1", "FAKECUDA_STICKY_AFTER=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: "+cudaFailureTest) {
			t.Fatalf("under the fake driver: %v\n%s", err, out)
		}
		if testing.Verbose() {
			t.Logf("%s", out)
		}
		return
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	base := "/dev/shm"
	if _, err := os.Stat(base); err != nil {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "rs-cuda-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sidecar.SetDeviceFailDrain(time.Hour) // this process runs this test alone
	srv, err := sidecar.New(sidecar.Config{Dir: dir, PoolBytes: 64 * slot, Machine: machine.Config{SlotBytes: slot}, RingCapacity: 64 << 10,
		CopyBackend: "cuda", MetricsAddr: addr}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(context.Background()) }()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if code, _ := get("/readyz"); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("/readyz never answered ready")
		}
	}

	engine := exec.Command(os.Args[0], "-test.run=^"+cudaEngineTest+"$", "-test.count=1", "-test.v")
	engine.Env = append(os.Environ(), cudaEngineEnv+"="+srv.Config().Socket)
	engine.Stderr = os.Stderr
	out, err := engine.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := engine.Start(); err != nil {
		t.Fatal(err)
	}
	var line, gpuID string
	for sc := bufio.NewScanner(out); sc.Scan(); {
		if s, ok := strings.CutPrefix(sc.Text(), "gpu "); ok {
			gpuID = s
		}
		if s, ok := strings.CutPrefix(sc.Text(), "store "); ok {
			line = s
		}
	}
	if err := engine.Wait(); err != nil {
		t.Fatalf("engine: %v (%s)", err, line)
	}
	t.Logf("engine's store: %s", line)
	if !strings.HasPrefix(line, "status 11 ") || !strings.Contains(line, "CUDA device failed") || !strings.Contains(line, "(700)") || !strings.Contains(line, gpuID) {
		t.Fatalf("the engine's store got %q, want status 11 naming the failed GPU %s and CUDA_ERROR_ILLEGAL_ADDRESS (700)", line, gpuID)
	}
	// The failure reaches the sidecar beside the store's reply: /readyz
	// turns 503 naming it, and from then on the metric reads 1.
	var readyz string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		code, body := get("/readyz")
		if code == http.StatusServiceUnavailable {
			readyz = body
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz still answers %d %q after the GPU failed", code, body)
		}
	}
	_, metrics := get("/metrics")
	if !strings.Contains(readyz, "CUDA device failed") || !strings.Contains(readyz, gpuID) {
		t.Errorf("/readyz while draining = %q, want 503 naming the failed GPU", readyz)
	}
	if !strings.Contains(metrics, `ringside_cuda_device_failed{gpu="`+gpuID+`"} 1`) {
		t.Errorf("/metrics while draining does not report GPU %s failed", gpuID)
	}
	srv.Shutdown() // the drain's end
	select {
	case err := <-done:
		if !errors.Is(err, gpu.ErrDeviceFailed) {
			t.Fatalf("Serve = %v, want an error wrapping gpu.ErrDeviceFailed (the sidecar exits to be restarted)", err)
		}
		t.Logf("Serve: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the sidecar did not stop after its GPU failed")
	}
}

// TestCUDADeviceFailureEngine is the engine of TestCUDADeviceFailure (it
// runs only in the process that test starts): it exports 8 slots of GPU
// memory, registers them, stores 8 blocks and prints the store's status.
func TestCUDADeviceFailureEngine(t *testing.T) {
	sock := os.Getenv(cudaEngineEnv)
	if sock == "" {
		t.Skip("the engine process of " + cudaFailureTest)
	}
	exp, free, err := gputest.ExportCUDA(8 * slot)
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	u := exp.IPC.GPU
	fmt.Printf("gpu GPU-%x-%x-%x-%x-%x\n", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
	c, err := connector.Dial(connector.Options{Socket: sock, Instance: "cuda-engine", Model: "llama", Layout: "bf16/16/HND", Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a := exp.Alloc()
	extra := schema.CUDAExtra{GPU: exp.IPC.GPU, Allocations: []schema.CUDAAllocation{{Handle: a.Handle, Base: a.Base, Size: a.Size}}}
	if err := c.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionCUDAIPC, PID: uint64(os.Getpid()), Base: exp.Base,
		Length: exp.Length, PageSize: slot, PageCount: 8, Extra: extra.Append(nil)}); err != nil {
		t.Fatalf("registering GPU memory: %v", err)
	}
	c.PutHashes(1, digests("cuda", 8), false)
	_, err = c.Store(schema.View{Batch: 1, Count: 8}, 1, []uint32{0, 1, 2, 3, 4, 5, 6, 7})
	msg := "ok"
	if err != nil {
		msg = strings.ReplaceAll(err.Error(), "\n", " ")
	}
	fmt.Printf("store status %d %s\n", status(err), msg)
}
