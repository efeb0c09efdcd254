package gputest

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"

	"github.com/ringside-kv/ringside/gpu/internal/cuda"
)

// CUDAEvent is an interprocess CUDA event of this process, exported as an
// engine exports its store event (for tests whose engine is this process):
// Record records it on a stream of its own, after whatever that stream
// holds (nothing: under the stand-in driver, FAKECUDA_EVENT_HOLD keeps the
// record pending instead).
type CUDAEvent struct {
	Handle [64]byte
	ctx    cuda.Context
	dev    cuda.Device
	ev     cuda.Event
	stream cuda.Stream
}

// NewCUDAEvent creates and exports an interprocess event on device 0.
func NewCUDAEvent() (*CUDAEvent, error) {
	runtime.LockOSThread() // the context is current on this thread only
	defer runtime.UnlockOSThread()
	if err := cuda.Init(); err != nil {
		return nil, err
	}
	d, err := cuda.DeviceGet(0)
	if err != nil {
		return nil, err
	}
	e := &CUDAEvent{dev: d}
	if e.ctx, err = d.Retain(); err != nil {
		return nil, err
	}
	if err = e.ctx.SetCurrent(); err == nil {
		e.stream, err = cuda.NewStream(0)
	}
	if err == nil {
		e.ev, err = cuda.NewIPCEvent()
	}
	if err == nil {
		e.Handle, err = cuda.IPCGetEventHandle(e.ev)
	}
	if err != nil {
		return nil, fmt.Errorf("exporting an interprocess event: %w", err)
	}
	return e, nil
}

// Record records the event on its stream.
func (e *CUDAEvent) Record() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := e.ctx.SetCurrent(); err != nil {
		return err
	}
	return e.ev.Record(e.stream)
}

// Fake driver counters a test can read in its own process (enum counter
// in testdata/fakecuda.c; FAKECUDA_COUNTERS names their directory).
const (
	FakeBatch      = 1 // cuMemcpyBatchAsync calls
	FakeRange      = 2 // cuMemcpyHtoDAsync + cuMemcpyDtoHAsync calls
	FakeIPCOpen    = 3 // successful cuIpcOpenMemHandle
	FakeIPCClose   = 4 // successful cuIpcCloseMemHandle
	FakeEventOpen  = 5 // successful cuIpcOpenEventHandle
	FakeEventClose = 6 // cuEventDestroy of an opened event
	FakeWaitEvent  = 7 // cuStreamWaitEvent calls
)

// FakeCount returns this process's counter i of the stand-in driver, or
// 0 without one (FAKECUDA_COUNTERS unset, or nothing counted yet).
func FakeCount(i int) uint64 {
	d := os.Getenv("FAKECUDA_COUNTERS")
	if d == "" {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(d, strconv.Itoa(os.Getpid())))
	if err != nil || len(b) < 8*(i+1) || binary.LittleEndian.Uint64(b) != 0x544e434b41464b46 {
		return 0
	}
	return binary.LittleEndian.Uint64(b[8*i:])
}
