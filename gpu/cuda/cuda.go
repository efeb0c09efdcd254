// Package cuda is the copy engine's GPU backend (a gpu.Engine): CUDA IPC
// regions and regions shared by file descriptor (virtual memory management
// allocations) copied with cuMemcpyBatchAsync through the cgo shim in
// gpu/internal/cuda, which loads libcuda.so.1 with dlopen. docs/architecture.md
// ("The copy path") has the ordering rules and the IPC pitfalls.
package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	driver "github.com/ringside-kv/ringside/gpu/internal/cuda"
	"github.com/ringside-kv/ringside/gpu/internal/regions"
)

// ErrUnavailable: the CUDA backend cannot run here (no libcuda.so.1, no
// device, a driver older than CUDA 12, or a build without cgo). New's
// error wraps it in those cases.
var ErrUnavailable = driver.ErrUnavailable

// ErrWedged: a copy issued to a GPU did not complete within its bound
// (Options.Watchdog): the device is failed with it (gpu.ErrDeviceFailed),
// as for a sticky error, and the sidecar exits so that the process's exit
// frees what the driver holds for it.
var ErrWedged = errors.New("gpu: a CUDA copy outlived its bound")

// MaxBatch is the most ranges one cuMemcpyBatchAsync call carries: a
// batched op of more ranges takes one call per MaxBatch of them.
const MaxBatch = driver.MaxBatch

// CopyMode chooses how the CUDA backend issues the ranges of one op.
type CopyMode uint8

const (
	// CopyAuto uses cuMemcpyBatchAsync where the driver has it (CUDA
	// 12.8+) and one cuMemcpy{HtoD,DtoH}Async per range otherwise; a batch
	// call the driver rejects switches the engine to per-range copies.
	CopyAuto CopyMode = iota
	// CopyBatched requires cuMemcpyBatchAsync (New fails without it).
	CopyBatched
	// CopyPerRange always issues one async copy per range.
	CopyPerRange
)

// DefaultPinChunk is the size of one cuMemHostRegister call: a single
// registration of 512 GiB or more fails on recent drivers.
const DefaultPinChunk = 64 << 30

// maxPinChunk is the exclusive upper bound on Options.PinChunk.
const maxPinChunk = 512 << 30

// Options configures New. The zero value is usable.
type Options struct {
	Copy CopyMode
	// PinChunk is the bytes registered per cuMemHostRegister call
	// (default DefaultPinChunk; must be below 512 GiB).
	PinChunk uint64
	// Queue is the number of accepted ops per device that may wait for the
	// device's submission thread before Submit blocks (default 256).
	Queue int
	// PinWait bounds how long a registration waits for the pool's
	// pinning, which starts at the first registration, counted from the
	// registration's start (default DefaultPinWait). Past it the
	// registration returns, and the copies submitted until the pinning has
	// ended fail at once (gpu.ErrTransfer).
	PinWait time.Duration
	// OnPinned, if set, is called once when the pool's pinning has ended
	// (err nil: pinned), from the goroutine that pinned it.
	OnPinned func(p PinInfo, err error)
	// OnDeviceFailed, if set, is called once per GPU whose context hit a
	// sticky error, or whose copies outlived Watchdog, from a goroutine of
	// its own.
	OnDeviceFailed func(DeviceFailure)
	// Watchdog bounds an issued copy: one that has been at the head of
	// its stream for longer than Watchdog plus its bytes at
	// WatchdogBytesPerSecond has not completed because the GPU's copies
	// are wedged, and fails the device (ErrWedged). Default
	// DefaultWatchdog.
	Watchdog time.Duration
}

// DefaultWatchdog is Options.Watchdog's default: far beyond any copy's
// time (an op of 5 GiB, the largest the benchmarks issue, takes 0.2 s at
// PCIe 4.0 speed; its bound is 30 s).
const DefaultWatchdog = 10 * time.Second

// WatchdogBytesPerSecond is the slowest copy rate the watchdog allows for
// before it adds an op's bytes to its bound: a quarter of a PCIe 3.0 x1
// link's.
const WatchdogBytesPerSecond = 256 << 20

// DefaultPinWait is how long a registration waits for the pool to be
// pinned by default: pinning takes about 0.1 s per GiB, so a pool of up to
// about 10 GiB is pinned by the time the first registration returns, and
// that registration, the GPU's context included (0.3-1 s), stays within
// the plugin's deadline of 2 s (the deployment's timeout) whatever the
// pool's size.
const DefaultPinWait = time.Second

// DeviceFailure describes a GPU whose context is unusable.
type DeviceFailure struct {
	Ordinal int
	UUID    string
	Code    int   // the CUresult that poisoned the context, e.g. 700; 0 for a copy that outlived its bound (ErrWedged)
	Err     error // wraps ErrDeviceFailed; every op on the GPU fails with it
}

// Info describes a running CUDA backend, for the startup log.
type Info struct {
	Driver  int  // driver's CUDA version, e.g. 12080
	Batch   bool // cuMemcpyBatchAsync in use
	Devices []Device
	Pin     PinInfo
}

// Device is one visible GPU.
type Device struct {
	Ordinal int
	Name    string
	UUID    string
}

// PinInfo reports the registration of the pool as pinned host memory.
type PinInfo struct {
	Bytes  uint64
	Chunks int
	Took   time.Duration
	// RLIMIT_MEMLOCK of the process (driver.Unlimited = ^0 = none). Whether
	// the driver's registration is charged against it is unverified; a
	// limit below Bytes is worth a warning.
	MemlockSoft, MemlockHard uint64
	MemlockErr               error
}

// MemlockBelowPool reports whether a finite locked-memory limit is smaller
// than the pinned pool.
func (p PinInfo) MemlockBelowPool() bool {
	return p.MemlockErr == nil && p.MemlockSoft != driver.Unlimited && p.MemlockSoft < p.Bytes
}

// Engine is the GPU backend: gpu.CUDAIPC regions (device memory another
// process exported with cudaIpcGetMemHandle) are copied to and from the
// pinned pool with the CUDA copy engines. Every op is one submission on its
// device: one cuMemcpyBatchAsync (or one async copy per range) on the
// direction's stream, then an event; completion is found by polling that
// event from the device's goroutine, which is locked to its OS thread and
// holds the device's primary context. Loads (pool to engine) and stores
// have a stream each, so that a load never queues behind stores issued
// before it on one stream. (The streams are created with priorities, loads
// highest, but CUDA documents that stream priorities have no effect on
// host-to-device and device-to-host memory operations,
// cuStreamCreateWithPriority: they order nothing here.) A region may carry
// an interprocess event: every store on it first makes the store stream
// wait for the event's latest record. A gpu.CUDAFD region's allocations
// come as file descriptors (cuMemExportToShareableHandle in the engine):
// each is imported (cuMemImportFromShareableHandle), mapped whole into a
// reservation of its own (cuMemAddressReserve, cuMemMap) and made
// accessible to the device (cuMemSetAccess); unregistering the region, or
// Close, unmaps it, frees the reservation and releases the handle. Other
// region kinds are rejected with gpu.ErrUnsupported; a gpu.Router combines
// it with the host backend.
type Engine struct {
	pool     []byte
	poolAddr uint64
	chunk    uint64
	queue    int
	batch    atomic.Bool
	batchErr atomic.Value // error: why batching was switched off

	info    Info
	devInfo []cudaDevInfo

	regions regions.Table[*cudaRegion]

	devMu      sync.Mutex
	devs       map[int]*cudaDevice // by ordinal
	devsClosed bool
	pin        *cudaDevice // the device whose context pinned the pool; nil until the first registration

	pinWait  time.Duration
	watchdog time.Duration
	onPinned func(PinInfo, error)
	onFail   func(DeviceFailure)
	// pinDone is closed when the pool's pinning has ended; pinRes, pinErr
	// and pinned are written before that and only read after it.
	pinDone chan struct{}
	pinRes  PinInfo
	pinErr  error
	pinned  [][]byte

	// releasing counts, by allocation handle (ipcKey) and event handle
	// (ipcEventKey), the regions being unregistered that hold it; released
	// is closed, and replaced, whenever a count drops to zero.
	relMu     sync.Mutex
	releasing map[any]int
	released  chan struct{}

	completions chan cudaCompletion
	compDone    chan struct{}
	closeOnce   sync.Once
	closeDone   chan struct{}
}

var _ gpu.Engine = (*Engine)(nil)

type cudaDevInfo struct {
	ordinal int
	dev     driver.Device
	uuid    driver.UUID
	name    string
}

type cudaRegion struct {
	r    gpu.Region
	dev  *cudaDevice
	keys []ipcKey // CUDAIPC: one per allocation, each opened once by Register
	// vmm (CUDAFD): one mapping per allocation, imported from its
	// descriptor by Register and owned by this region alone.
	vmm []*vmmMapping
	// segs translates each segment (the one span of a flat region) from
	// the exporter's addresses to this process's: local = engine + delta
	// (mod 2^64), inside the mapping of allocation alloc.
	segs     []cudaSeg
	event    driver.Event // opened store event, 0 without one
	eventKey ipcEventKey
	gate     driver.Stream // the event's gate stream (ipcEvent.gate)
	inflight sync.WaitGroup
}

type cudaSeg struct {
	alloc int
	delta uint64
}

type ipcKey struct {
	pid    int
	handle driver.IPCHandle
}

type ipcEventKey struct {
	pid    int
	handle driver.IPCEventHandle
}

// ipcEvent is an engine's store event opened in this context, with its
// gate: a stream of its own on which a store's wait for the event is
// issued (cuStreamWaitEvent), followed by an event of ours that the device
// goroutine polls; the store's copies are issued only once that has
// fired. No copy ever waits on the GPU behind an engine's event, so an
// engine that dies with a record pending (which never completes) wedges
// nothing but its own gate.
type ipcEvent struct {
	ev   driver.Event
	gate driver.Stream
	refs int
}

type ipcMapping struct {
	ptr  driver.DevicePtr
	size uint64
	refs int
}

// vmmMapping is an allocation imported from a descriptor
// (cuMemImportFromShareableHandle), mapped whole into a reservation of its
// own and made accessible to the device: released by unmapping it,
// freeing the reservation and releasing the handle.
type vmmMapping struct {
	h    driver.MemHandle
	ptr  driver.DevicePtr // 0 until reserved
	size uint64
	// mapped: cuMemMap succeeded (cuMemUnmap is due).
	mapped bool
}

type cudaJob struct {
	dir       gpu.Direction
	h         gpu.Handle
	reg       *cudaRegion
	fence     *gpu.Fence
	issuedAt  *gpu.IssueClock // marked when its copies are enqueued (the op's Issued)
	fail      error           // ended before it was issued (fenced, device failed): the op's whole error
	dst, src  []uint64
	lens      []uint64
	bytes     int64
	submitted time.Time
	started   time.Time
	issued    time.Time // its copies were enqueued
	calls     int
	err       error
	ev        driver.Event // completion event, recorded after the copies
	gate      driver.Event // a store's gate: fires when the engine's event has (ipcEvent)
	done      func(gpu.Result)
}

type cudaCompletion struct {
	reg  *cudaRegion
	res  gpu.Result
	done func(gpu.Result)
}

// New loads the CUDA driver, checks that a device is visible and
// returns the backend. It takes no GPU memory: no context is created here
// (an engine that profiles free GPU memory at its start, as vLLM does,
// must find all of it, and in EXCLUSIVE_PROCESS mode a context of ours
// would keep the engine off the GPU). A device's primary context is
// retained at the first registration on it, and the pool (the sidecar's
// mapping of the block pool; it must be mmapped memory, not Go heap) is
// registered as pinned host memory, in chunks, at the first registration
// on any device, in the background; registrations wait for it, up to
// PinWait, and copies submitted before it has ended fail.
// Without a usable driver or device the error wraps ErrUnavailable.
func New(pool []byte, opts Options) (*Engine, error) {
	if len(pool) == 0 {
		return nil, fmt.Errorf("%w: empty pool", gpu.ErrInvalidOp)
	}
	if err := driver.Init(); err != nil {
		return nil, fmt.Errorf("gpu: CUDA backend: %w", err)
	}
	if opts.PinChunk == 0 {
		opts.PinChunk = DefaultPinChunk
	}
	ps := uint64(os.Getpagesize())
	if opts.PinChunk >= maxPinChunk || opts.PinChunk < ps || opts.PinChunk%ps != 0 {
		return nil, fmt.Errorf("%w: pin chunk %d bytes: want a multiple of the page size below 512 GiB", gpu.ErrInvalidOp, opts.PinChunk)
	}
	if opts.Queue <= 0 {
		opts.Queue = 256
	}
	if opts.PinWait <= 0 {
		opts.PinWait = DefaultPinWait
	}
	if opts.Watchdog <= 0 {
		opts.Watchdog = DefaultWatchdog
	}
	e := &Engine{
		pool: pool, poolAddr: driver.Addr(pool), chunk: opts.PinChunk, queue: opts.Queue,
		regions: regions.New[*cudaRegion](), devs: map[int]*cudaDevice{},
		pinWait: opts.PinWait, watchdog: opts.Watchdog, onPinned: opts.OnPinned, onFail: opts.OnDeviceFailed, pinDone: make(chan struct{}),
		completions: make(chan cudaCompletion, 1024), compDone: make(chan struct{}), closeDone: make(chan struct{}),
		releasing: map[any]int{}, released: make(chan struct{}),
	}
	var err error
	if e.info.Driver, err = driver.DriverVersion(); err != nil {
		return nil, fmt.Errorf("gpu: CUDA backend: %w", err)
	}
	n, err := driver.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("gpu: CUDA backend: %w", err)
	}
	for i := range n {
		d, err := driver.DeviceGet(i)
		if err != nil {
			return nil, fmt.Errorf("gpu: CUDA device %d: %w", i, err)
		}
		u, err := d.UUID()
		if err != nil {
			return nil, fmt.Errorf("gpu: CUDA device %d: uuid: %w", i, err)
		}
		name, _ := d.Name()
		e.devInfo = append(e.devInfo, cudaDevInfo{ordinal: i, dev: d, uuid: u, name: name})
		e.info.Devices = append(e.info.Devices, Device{Ordinal: i, Name: name, UUID: u.String()})
	}
	switch opts.Copy {
	case CopyAuto:
		e.batch.Store(driver.HasBatch())
	case CopyBatched:
		if !driver.HasBatch() {
			return nil, fmt.Errorf("gpu: CUDA backend: the driver (CUDA %d.%d) has no cuMemcpyBatchAsync (needs 12.8)", e.info.Driver/1000, e.info.Driver%1000/10)
		}
		e.batch.Store(true)
	case CopyPerRange:
	default:
		return nil, fmt.Errorf("%w: copy mode %d", gpu.ErrInvalidOp, opts.Copy)
	}
	go e.completer()
	e.info.Batch = e.batch.Load()
	return e, nil
}

// pinPool registers the pool as pinned host memory from d's context on a
// thread of its own (the device's thread stays free to open handles);
// PORTABLE makes it pinned for every context of this process. It runs
// once, started by the first device, and ends by closing pinDone.
func (e *Engine) pinPool(d *cudaDevice) {
	runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
	p := PinInfo{Bytes: uint64(len(e.pool))}
	p.MemlockSoft, p.MemlockHard, p.MemlockErr = driver.MemlockLimit()
	t0 := time.Now()
	err := d.ctx.SetCurrent()
	if err != nil {
		err = fmt.Errorf("gpu: pinning the pool: cuCtxSetCurrent: %w", err)
	}
	for off := uint64(0); err == nil && off < uint64(len(e.pool)); off += e.chunk {
		end := min(off+e.chunk, uint64(len(e.pool)))
		if rerr := driver.HostRegister(e.pool[off:end], driver.HostRegisterPortable); rerr != nil {
			msg := fmt.Sprintf("gpu: registering pool bytes [%d, %d) of %d as pinned memory: %v", off, end, len(e.pool), rerr)
			if p.MemlockBelowPool() {
				msg += fmt.Sprintf(" (RLIMIT_MEMLOCK is %d bytes; raise it, e.g. ulimit -l unlimited)", p.MemlockSoft)
			}
			err = errors.New(msg)
			break
		}
		e.pinned = append(e.pinned, e.pool[off:end])
		p.Chunks++
	}
	p.Took = time.Since(t0)
	e.pinRes, e.pinErr = p, err
	close(e.pinDone)
	if e.onPinned != nil {
		e.onPinned(p, err)
	}
}

// waitPinned waits, until deadline, for the pool's pinning to end: it
// fails if the pinning failed, and returns nil once the pool is pinned or
// at the deadline (the pinning goes on; pinReady refuses copies until it
// has ended).
func (e *Engine) waitPinned(deadline time.Time) error {
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-e.pinDone:
		if e.pinErr != nil {
			return fmt.Errorf("%w: the pool could not be pinned, so no GPU memory can be served: %w", gpu.ErrUnsupported, e.pinErr)
		}
		return nil
	case <-t.C:
		return nil
	}
}

// pinReady returns nil once the pool is pinned, and why no copy can run
// otherwise: the pinning still going on (started by the first
// registration), or its failure.
func (e *Engine) pinReady() error {
	select {
	case <-e.pinDone:
		if e.pinErr != nil {
			return fmt.Errorf("%w: the pool could not be pinned, so no GPU copy can run: %w", gpu.ErrTransfer, e.pinErr)
		}
		return nil
	default:
		return fmt.Errorf("%w: the pool (%d bytes) is still being registered as pinned host memory (it started at the first GPU "+
			"registration; about 0.1 s per GiB): GPU copies run once it is pinned", gpu.ErrTransfer, len(e.pool))
	}
}

// SetCopyMode switches how later ops are issued (benchmarks compare
// batched and per-range submission on one engine). CopyBatched fails
// without cuMemcpyBatchAsync.
func (e *Engine) SetCopyMode(m CopyMode) error {
	switch m {
	case CopyAuto:
		e.batch.Store(driver.HasBatch() && e.BatchDisabled() == nil)
	case CopyBatched:
		if !driver.HasBatch() {
			return fmt.Errorf("%w: the driver has no cuMemcpyBatchAsync (needs CUDA 12.8)", gpu.ErrUnsupported)
		}
		e.batch.Store(true)
	case CopyPerRange:
		e.batch.Store(false)
	default:
		return fmt.Errorf("%w: copy mode %d", gpu.ErrInvalidOp, m)
	}
	return nil
}

// Info describes the backend: driver, devices, batching, and the pool's
// pinning once it has ended (zero before the first registration).
func (e *Engine) Info() Info {
	i := e.info
	i.Batch = e.batch.Load()
	select {
	case <-e.pinDone:
		i.Pin = e.pinRes
	default:
	}
	return i
}

// BatchDisabled returns why batched copies were switched off at run time
// (nil if they were not).
func (e *Engine) BatchDisabled() error {
	err, _ := e.batchErr.Load().(error)
	return err
}

// Name returns "cuda".
func (e *Engine) Name() string { return "cuda" }

// Supports reports true for device memory: gpu.CUDAIPC and gpu.CUDAFD.
func (e *Engine) Supports(k gpu.Kind) bool { return k.CUDA() }

// Register opens the handle of each of the region's allocations in the
// context of the GPU named by r.IPC.GPU (once per allocation and device:
// regions of one allocation share the mapping), bounds each allocation by
// the smaller of its declared size and the size of the mapping, checks
// that every segment lies inside its allocation's bound, and opens the
// store event if there is one. Nothing stays open when it fails. The
// first registration on a GPU retains its primary context (a GPU in
// EXCLUSIVE_PROCESS or PROHIBITED compute mode is refused), the first on
// any GPU starts pinning the pool, and every registration waits for the
// pinning, up to PinWait from its start (then it returns, and copies fail
// until the pool is pinned). A failed GPU (gpu.ErrDeviceFailed) refuses it. A
// gpu.CUDAFD region's allocations are imported from their descriptors and
// mapped instead of opened (each region its own, never shared); Register
// keeps none of the descriptors, which the caller closes once it returns.
func (e *Engine) Register(r gpu.Region) (gpu.Handle, error) {
	start := time.Now()
	if !r.Kind.CUDA() {
		return 0, fmt.Errorf("%w: the CUDA backend serves only %v and %v regions, not %v", gpu.ErrUnsupported, gpu.CUDAIPC, gpu.CUDAFD, r.Kind)
	}
	if r.Kind == gpu.CUDAFD && !driver.HasVMM() {
		return 0, fmt.Errorf("%w: the CUDA driver lacks the virtual memory management entry points (cuMemImportFromShareableHandle, cuMemMap, ...) that memory shared by file descriptor needs", gpu.ErrUnsupported)
	}
	if err := r.Validate(); err != nil {
		return 0, err
	}
	segAlloc, err := r.SegmentAllocations()
	if err != nil {
		return 0, err
	}
	var di *cudaDevInfo
	var visible []string
	for i := range e.devInfo {
		if e.devInfo[i].uuid == r.IPC.GPU {
			di = &e.devInfo[i]
		}
		visible = append(visible, e.devInfo[i].uuid.String())
	}
	if di == nil {
		return 0, fmt.Errorf("%w: GPU %s is not visible to the sidecar (it sees %s): give the sidecar the engine's GPU (NVIDIA_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES or a shared DRA claim)",
			gpu.ErrUnsupported, driver.UUID(r.IPC.GPU), strings.Join(visible, ", "))
	}
	if e.regions.IsClosed() {
		return 0, fmt.Errorf("gpu: register: %w", os.ErrClosed)
	}
	d, err := e.device(*di)
	if err != nil {
		return 0, err
	}
	if err := e.waitPinned(start.Add(e.pinWait)); err != nil {
		return 0, err
	}
	r.Segments = append([]gpu.Segment(nil), r.Segments...)
	r.IPC.Allocations = append([]gpu.IPCAllocation(nil), r.IPC.Allocations...)
	// A handle of this process whose mapping is being closed (its region's
	// session ended, Unregister waits for its copies) may name the same
	// allocation, or new memory of that process that yields an identical
	// handle (freed and allocated again): the driver would hand back the
	// open mapping of the old pages. Open it only once that is closed.
	e.waitReleased(regionKeys(&r))
	reg := &cudaRegion{r: r, dev: d}
	if err := d.call(func() error {
		if err := d.failed(); err != nil {
			return fmt.Errorf("%w: %w", gpu.ErrUnsupported, err)
		}
		err := d.open(reg, segAlloc)
		if driver.Sticky(err) {
			d.markFailed(err)
		}
		return err
	}); err != nil {
		return 0, err
	}
	for i := range reg.r.IPC.Allocations {
		reg.r.IPC.Allocations[i].FD = -1 // the caller closes its descriptors: the imports hold the memory
	}
	h, err := e.regions.Add(reg)
	if err != nil {
		d.call(func() error { d.release(reg); return nil })
		return 0, err
	}
	return h, nil
}

// open runs on the device goroutine: it opens reg's allocations and event
// and fills in reg.keys, reg.segs and reg.event, or releases everything
// it opened and returns why.
func (d *cudaDevice) open(reg *cudaRegion, segAlloc []int) error {
	r := &reg.r
	local := make([]uint64, len(r.IPC.Allocations))
	mapped := make([]uint64, len(r.IPC.Allocations))
	if r.Kind == gpu.CUDAFD {
		gran, err := driver.MemGranularity(d.info.dev)
		if err != nil || gran == 0 {
			return fmt.Errorf("%w: cuMemGetAllocationGranularity: %v", gpu.ErrUnsupported, err)
		}
		for i, a := range r.IPC.Allocations {
			m, err := d.vmmImport(i, a, gran)
			if m != nil {
				reg.vmm = append(reg.vmm, m)
			}
			if err != nil {
				d.release(reg)
				return err
			}
			local[i], mapped[i] = uint64(m.ptr), m.size
		}
	}
	for i, a := range r.IPC.Allocations {
		if r.Kind != gpu.CUDAIPC {
			break
		}
		key := ipcKey{pid: r.PID, handle: a.Handle}
		m, err := d.ipcOpen(key)
		if err != nil {
			d.release(reg)
			return fmt.Errorf("allocation %d: %w", i, err)
		}
		reg.keys = append(reg.keys, key)
		local[i], mapped[i] = uint64(m.ptr), m.size
	}
	spans := r.SegmentSpans()
	reg.segs = make([]cudaSeg, len(spans))
	for i, sp := range spans {
		k := segAlloc[i]
		a := r.IPC.Allocations[k]
		// Validate kept the span inside the declared size; the mapping
		// bounds it too: the allocation is the smaller of the two.
		if sp[1]-a.Base > mapped[k] {
			d.release(reg)
			return fmt.Errorf("%w: segment %d [%#x,%#x) runs past allocation %d: it is declared as %d bytes at %#x, but the sidecar's "+
				"mapping of its handle holds %d (cuMemGetAddressRange of the opened pointer)",
				gpu.ErrInvalidRegion, i, sp[0], sp[1], k, a.Size, a.Base, mapped[k])
		}
		reg.segs[i] = cudaSeg{alloc: k, delta: local[k] - a.Base}
	}
	if r.IPC.HasEvent {
		key := ipcEventKey{pid: r.PID, handle: r.IPC.Event}
		ev, err := d.ipcEventOpen(key)
		if err != nil {
			d.release(reg)
			return err
		}
		reg.event, reg.eventKey, reg.gate = ev.ev, key, ev.gate
	}
	return nil
}

// release closes what open opened for reg (on the device goroutine). On a
// failed device it only forgets them: the driver may still hold copies
// that touch them (a wedged stream), and the process exits anyway.
func (d *cudaDevice) release(reg *cudaRegion) {
	for _, k := range reg.keys {
		d.ipcRelease(k)
	}
	reg.keys = nil
	for _, m := range reg.vmm {
		d.vmmRelease(m)
	}
	reg.vmm = nil
	if reg.event != 0 {
		d.ipcEventRelease(reg.eventKey)
		reg.event, reg.gate = 0, 0
	}
}

// Unregister waits for the region's ops and releases its allocations'
// mappings (an IPC mapping closed when no other region uses it; a mapping
// imported from a descriptor unmapped, its reservation freed and its
// handle released) and its event.
// Until it returns, a registration of any of the region's allocation or
// event handles by the same process waits (waitReleased).
func (e *Engine) Unregister(h gpu.Handle) error {
	reg, err := e.regions.Remove(h)
	if err != nil {
		return err
	}
	keys := regionKeys(&reg.r)
	e.markReleasing(keys, 1)
	defer e.markReleasing(keys, -1)
	reg.inflight.Wait()
	// A device already stopped by Close closed its mappings itself.
	reg.dev.call(func() error { reg.dev.release(reg); return nil })
	return nil
}

// regionKeys are the keys a CUDA IPC region's mappings and event are
// shared by (a region shared by file descriptor imports its own).
func regionKeys(r *gpu.Region) []any {
	var keys []any
	if r.Kind == gpu.CUDAIPC {
		for _, a := range r.IPC.Allocations {
			keys = append(keys, ipcKey{pid: r.PID, handle: a.Handle})
		}
	}
	if r.IPC.HasEvent {
		keys = append(keys, ipcEventKey{pid: r.PID, handle: r.IPC.Event})
	}
	return keys
}

func (e *Engine) markReleasing(keys []any, d int) {
	e.relMu.Lock()
	defer e.relMu.Unlock()
	done := false
	for _, k := range keys {
		if e.releasing[k] += d; e.releasing[k] <= 0 {
			delete(e.releasing, k)
			done = true
		}
	}
	if done {
		close(e.released)
		e.released = make(chan struct{})
	}
}

// waitReleased waits until no region being unregistered holds any of keys.
func (e *Engine) waitReleased(keys []any) {
	for {
		e.relMu.Lock()
		busy := false
		for _, k := range keys {
			busy = busy || e.releasing[k] > 0
		}
		ch := e.released
		e.relMu.Unlock()
		if !busy {
			return
		}
		<-ch
	}
}

// Submit bounds-checks and plans op (gpu.PlanRanges), translates every range
// to this process's device addresses, merges what is contiguous there on
// both sides and within one allocation (localRanges), splits at pin chunk
// boundaries, then queues it to the region's device.
func (e *Engine) Submit(op gpu.Op, done func(gpu.Result)) error {
	return e.regions.Submit(op, done, func(reg *cudaRegion, now time.Time) error {
		if err := reg.dev.failed(); err != nil {
			return err
		}
		if err := e.pinReady(); err != nil {
			return err
		}
		if op.Fence.Raised() {
			return gpu.ErrFenced
		}
		ranges, err := gpu.PlanRanges(nil, &reg.r, uint64(len(e.pool)), op.Pages, op.PoolOffsets)
		if err != nil {
			return err
		}
		ranges = splitRanges(localRanges(ranges, reg.segs), e.chunk, uint64(len(e.pool)))
		j := &cudaJob{dir: op.Dir, h: op.Region, reg: reg, fence: op.Fence, issuedAt: op.Issued, submitted: now, done: done,
			dst: make([]uint64, len(ranges)), src: make([]uint64, len(ranges)), lens: make([]uint64, len(ranges))}
		for i, rg := range ranges {
			host := e.poolAddr + rg.Pool
			if op.Dir == gpu.PoolToEngine {
				j.dst[i], j.src[i] = rg.Engine, host
			} else {
				j.dst[i], j.src[i] = host, rg.Engine
			}
			j.lens[i] = rg.Len
			j.bytes += int64(rg.Len)
		}
		reg.inflight.Add(1)
		// Close closes the table before stopping devices, so the device is
		// running while we hold the table's read lock; its loop never takes
		// that lock.
		reg.dev.jobs <- j
		return nil
	})
}

// localRanges translates planned ranges (gpu.PlanRanges' order: page-major,
// one range per segment, or one per page of a flat region) to this
// process's device addresses, in place: Engine becomes the local address.
// It merges a range into the previous one only where both are contiguous
// in the pool and in the sidecar's mapping and lie in one allocation: two
// allocations adjacent in the engine's address space are mapped wherever
// cuIpcOpenMemHandle put them, and one copy never spans two mappings even
// when they happen to be adjacent.
func localRanges(rs []gpu.Range, segs []cudaSeg) []gpu.Range {
	out := rs[:0]
	lastAlloc := -1
	for i, r := range rs {
		s := segs[i%len(segs)]
		r.Engine += s.delta
		if k := len(out) - 1; k >= 0 && lastAlloc == s.alloc {
			last := &out[k]
			if last.Pool+last.Len == r.Pool && last.Engine+last.Len == r.Engine {
				last.Len += r.Len
				continue
			}
		}
		out = append(out, r)
		lastAlloc = s.alloc
	}
	return out
}

// splitRanges cuts ranges at multiples of chunk in the pool, where one
// cuMemHostRegister ends and the next begins: a copy never spans two
// registrations.
func splitRanges(rs []gpu.Range, chunk, poolLen uint64) []gpu.Range {
	if poolLen <= chunk {
		return rs
	}
	var out []gpu.Range
	for i, r := range rs {
		if r.Pool/chunk == (r.Pool+r.Len-1)/chunk {
			if out != nil {
				out = append(out, r)
			}
			continue
		}
		if out == nil {
			out = append(make([]gpu.Range, 0, len(rs)+4), rs[:i]...)
		}
		for r.Len > 0 {
			n := min(r.Len, (r.Pool/chunk+1)*chunk-r.Pool)
			out = append(out, gpu.Range{Pool: r.Pool, Engine: r.Engine, Len: n})
			r.Pool, r.Engine, r.Len = r.Pool+n, r.Engine+n, r.Len-n
		}
	}
	if out == nil {
		return rs
	}
	return out
}

// Close stops accepting ops, completes the accepted ones, closes every IPC
// mapping, unregisters the pool and releases the contexts.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		e.regions.Close()
		e.devMu.Lock()
		e.devsClosed = true
		pin := e.pin
		devs := make([]*cudaDevice, 0, len(e.devs))
		for _, d := range e.devs {
			if d != pin {
				devs = append(devs, d)
			}
		}
		e.devMu.Unlock()
		if pin != nil {
			<-e.pinDone // the pinning thread uses pin's context
		}
		// The pool stays pinned until every device has drained.
		for _, d := range devs {
			d.stop()
		}
		if pin != nil {
			pin.stop()
		}
		close(e.completions)
		<-e.compDone
		close(e.closeDone)
	})
	<-e.closeDone
	return nil
}

func (e *Engine) completer() {
	defer close(e.compDone)
	for c := range e.completions {
		// The callback runs before the op stops counting as in flight, so
		// Unregister returns only after every callback of the region ran.
		c.done(c.res)
		c.reg.inflight.Done()
	}
}

// device returns the running device for di, starting it on first use
// (the first device started also starts pinning the pool).
func (e *Engine) device(di cudaDevInfo) (*cudaDevice, error) {
	e.devMu.Lock()
	defer e.devMu.Unlock()
	if d := e.devs[di.ordinal]; d != nil {
		if err := d.failed(); err != nil {
			// The GPU cannot be served until the sidecar restarts: a
			// configuration-like refusal for the registering engine.
			return nil, fmt.Errorf("%w: %w", gpu.ErrUnsupported, err)
		}
		return d, nil
	}
	if e.devsClosed {
		return nil, fmt.Errorf("gpu: CUDA backend: %w", os.ErrClosed)
	}
	// Before any context: in EXCLUSIVE_PROCESS mode one process may hold
	// a context on the GPU, and the engine needs it.
	switch mode, err := di.dev.Attribute(driver.AttrComputeMode); {
	case err != nil:
		return nil, fmt.Errorf("%w: GPU %d (%s): reading its compute mode (cuDeviceGetAttribute): %v", gpu.ErrUnsupported, di.ordinal, di.uuid, err)
	case mode == driver.ComputeExclusiveProcess:
		return nil, fmt.Errorf("%w: GPU %d (%s) is in EXCLUSIVE_PROCESS compute mode: only one process may hold a context on it, "+
			"and the engine holds it, so the sidecar cannot map its memory; set the compute mode to DEFAULT "+
			"(nvidia-smi -i %d -c DEFAULT, or the GPU operator's compute-mode setting) to use the GPU KV cache", gpu.ErrUnsupported, di.ordinal, di.uuid, di.ordinal)
	case mode == driver.ComputeProhibited:
		return nil, fmt.Errorf("%w: GPU %d (%s) is in PROHIBITED compute mode: no process may create a context on it", gpu.ErrUnsupported, di.ordinal, di.uuid)
	}
	d := &cudaDevice{e: e, info: di, jobs: make(chan *cudaJob, e.queue), calls: make(chan func()),
		quit: make(chan struct{}), exited: make(chan struct{}), ipc: map[ipcKey]*ipcMapping{}, ipcEvent: map[ipcEventKey]*ipcEvent{},
		vmm: map[*vmmMapping]struct{}{}}
	ready := make(chan error, 1)
	go d.run(ready)
	if err := <-ready; err != nil {
		return nil, fmt.Errorf("gpu: CUDA device %d (%s): %w", di.ordinal, di.uuid, err)
	}
	e.devs[di.ordinal] = d
	if e.pin == nil {
		e.pin = d
		go e.pinPool(d)
	}
	return d, nil
}

// cudaDevice is one GPU's submission and completion thread: a goroutine
// locked to its OS thread with the device's primary context current. All
// driver calls for the device run on it.
type cudaDevice struct {
	e           *Engine
	info        cudaDevInfo
	ctx         driver.Context
	load, store driver.Stream
	events      []driver.Event
	jobs        chan *cudaJob
	calls       chan func()
	quit        chan struct{}
	exited      chan struct{}
	stopOnce    sync.Once
	// fault is set once, on the device goroutine, when the context hits a
	// sticky error: the error every op on the device fails with.
	fault atomic.Pointer[error]

	// Owned by the device goroutine.
	ipc           map[ipcKey]*ipcMapping
	ipcEvent      map[ipcEventKey]*ipcEvent
	vmm           map[*vmmMapping]struct{} // every CUDAFD allocation imported and not yet released
	loads, stores []*cudaJob               // issued, in stream order
	// gated are stores waiting at their engine's event's gate (ipcEvent):
	// nothing of them is issued yet.
	gated []*cudaJob
	// headSince is when the job now at the head of loads (0) and stores
	// (1) became the head: the watchdog's clock.
	headSince [2]time.Time
	quitting  bool
}

// failed returns the device's failure (wrapping gpu.ErrDeviceFailed), or nil.
func (d *cudaDevice) failed() error {
	if p := d.fault.Load(); p != nil {
		return *p
	}
	return nil
}

// markFailed records that the context hit the sticky error cause: every
// op issued and not yet completed fails now (its completion event would
// only return the same error), and nothing is issued on the device again.
// Runs on the device goroutine.
func (d *cudaDevice) markFailed(cause error) {
	if d.failed() != nil {
		return
	}
	code := driver.Code(cause)
	var err error
	if code != driver.Success {
		err = fmt.Errorf("%w: GPU %d (%s): %w: the sidecar's CUDA context on this GPU is unusable (a sticky error); "+
			"nothing more is issued on it and every copy on it fails until the sidecar restarts", gpu.ErrDeviceFailed, d.info.ordinal, d.info.uuid, code)
	} else {
		err = fmt.Errorf("%w: GPU %d (%s): %w; nothing more is issued on it and every copy on it fails until the sidecar restarts",
			gpu.ErrDeviceFailed, d.info.ordinal, d.info.uuid, cause)
	}
	d.fault.Store(&err)
	for _, q := range []*[]*cudaJob{&d.loads, &d.stores, &d.gated} {
		for _, j := range *q {
			j.fail = err
			d.finish(j)
		}
		*q = nil
	}
	if d.e.onFail != nil {
		f := DeviceFailure{Ordinal: d.info.ordinal, UUID: d.info.uuid.String(), Code: int(code), Err: err}
		go d.e.onFail(f)
	}
}

// sticky fails j and the device if err carries a sticky code.
func (d *cudaDevice) sticky(j *cudaJob, err error) bool {
	if !driver.Sticky(err) {
		return false
	}
	d.markFailed(err)
	j.fail = d.failed()
	d.finish(j)
	return true
}

var errDeviceStopped = errors.New("gpu: CUDA device stopped")

// call runs f on the device goroutine and returns its error.
func (d *cudaDevice) call(f func() error) error {
	ch := make(chan error, 1)
	select {
	case d.calls <- func() { ch <- f() }:
		return <-ch
	case <-d.exited:
		return errDeviceStopped
	}
}

func (d *cudaDevice) stop() {
	d.stopOnce.Do(func() { close(d.quit) })
	<-d.exited
}

// Polling while ops are in flight: spin for pollSpin after progress, then
// sleep between polls (pollSleep: the thread's own nanosleep), pollMin
// doubling up to pollMax. pollMax bounds how late a completed copy is
// noticed (plus the thread's wake-up): a load's reply, and so the engine's
// next step, waits for it. With nothing in flight the goroutine blocks on
// its channels instead.
const (
	pollSpin = 50 * time.Microsecond // poll without sleeping this long after progress
	pollMin  = 20 * time.Microsecond
	pollMax  = 50 * time.Microsecond
)

// nextPollSleep is the sleep after one of d, while ops are in flight.
func nextPollSleep(d time.Duration) time.Duration { return min(2*d, pollMax) }

func (d *cudaDevice) run(ready chan<- error) {
	// The goroutine stays locked until it exits, and the thread exits
	// with it: nothing else ever runs with this context current.
	runtime.LockOSThread()
	setTimerSlack()
	defer close(d.exited)
	if err := d.setup(); err != nil {
		d.teardown()
		ready <- err
		return
	}
	ready <- nil
	quit := d.quit
	lastProgress := time.Now()
	sleep := pollMin
	for {
		if len(d.loads)+len(d.stores)+len(d.gated) == 0 {
			if d.quitting && len(d.jobs) == 0 {
				d.teardown()
				return
			}
			select {
			case j := <-d.jobs:
				d.start(j)
			case f := <-d.calls:
				f()
			case <-quit:
				quit, d.quitting = nil, true
			}
			lastProgress, sleep = time.Now(), pollMin
			continue
		}
	drain:
		for {
			select {
			case j := <-d.jobs:
				d.start(j)
			case f := <-d.calls:
				f()
			case <-quit:
				quit, d.quitting = nil, true
			default:
				break drain
			}
		}
		if d.pollGated()+d.poll(&d.loads, 0)+d.poll(&d.stores, 1) > 0 {
			lastProgress, sleep = time.Now(), pollMin
			continue
		}
		d.watch()
		if time.Since(lastProgress) < pollSpin {
			// Spin without yielding: Gosched on a locked thread hands the
			// P to another thread and back, which costs more than a copy.
			continue
		}
		pollSleep(sleep)
		sleep = nextPollSleep(sleep)
	}
}

// watch fails the device when the op at the head of a stream has been
// there longer than its bound (Options.Watchdog plus its bytes at
// WatchdogBytesPerSecond): a stream runs its work in order, so the head's
// time there is its own copy's time. Nothing of ours ever waits on the GPU
// for another process (stores are gated on the host), so only a wedged
// driver or device gets here; the sidecar then exits, as for a sticky
// error, and the process's exit frees what the driver holds for it (the
// mappings of engines' memory included).
func (d *cudaDevice) watch() {
	now := time.Now()
	for i, q := range [2][]*cudaJob{d.loads, d.stores} {
		if len(q) == 0 {
			continue
		}
		j := q[0]
		bound := d.e.watchdog + time.Duration(float64(j.bytes)/WatchdogBytesPerSecond*float64(time.Second))
		if late := now.Sub(d.headSince[i]); late > bound {
			dir := "device-to-host (store)"
			if j.dir == gpu.PoolToEngine {
				dir = "host-to-device (load)"
			}
			d.markFailed(fmt.Errorf("%w: a %s copy of %d bytes issued %v ago has not completed after %v at the head of its stream "+
				"(bound %v): the GPU's copies are wedged", ErrWedged, dir, j.bytes, now.Sub(j.issued).Round(time.Millisecond),
				late.Round(time.Millisecond), bound))
			return
		}
	}
}

func (d *cudaDevice) setup() error {
	var err error
	if d.ctx, err = d.info.dev.Retain(); err != nil {
		return fmt.Errorf("retaining the primary context: %w", err)
	}
	if err := d.ctx.SetCurrent(); err != nil {
		return fmt.Errorf("cuCtxSetCurrent: %w", err)
	}
	least, greatest, err := driver.StreamPriorityRange()
	if err != nil {
		return fmt.Errorf("stream priorities: %w", err)
	}
	// One stream per direction, so that a load never waits behind the
	// stores queued before it (loads gate time to first token). The
	// priorities (loads highest) are kept for kernels a later version
	// might launch; for copies CUDA documents they have no effect
	// (cuStreamCreateWithPriority).
	if d.load, err = driver.NewStream(greatest); err != nil {
		return fmt.Errorf("load stream: %w", err)
	}
	if d.store, err = driver.NewStream(least); err != nil {
		return fmt.Errorf("store stream: %w", err)
	}
	return nil
}

// teardown runs on the device goroutine with nothing in flight. A failed
// device's resources are left to the process's exit: its context is
// unusable, or its copies are wedged in the driver.
func (d *cudaDevice) teardown() {
	if d.ctx == 0 || d.failed() != nil {
		return
	}
	for k, m := range d.ipc {
		driver.IPCClose(m.ptr)
		delete(d.ipc, k)
	}
	for m := range d.vmm {
		d.vmmRelease(m)
	}
	for k, ev := range d.ipcEvent {
		ev.gate.Destroy()
		ev.ev.Destroy()
		delete(d.ipcEvent, k)
	}
	if d == d.e.pin {
		for _, b := range d.e.pinned {
			driver.HostUnregister(b)
		}
		d.e.pinned = nil
	}
	for _, ev := range d.events {
		ev.Destroy()
	}
	d.events = nil
	if d.load != 0 {
		d.load.Destroy()
	}
	if d.store != 0 {
		d.store.Destroy()
	}
	d.info.dev.Release()
}

// ipcOpen opens key's allocation once per context and counts its users.
func (d *cudaDevice) ipcOpen(key ipcKey) (*ipcMapping, error) {
	if m := d.ipc[key]; m != nil {
		m.refs++
		return m, nil
	}
	p, err := driver.IPCOpen(key.handle)
	if err != nil {
		return nil, ipcOpenError(key.pid, err)
	}
	base, size, err := driver.AddressRange(p)
	if err != nil || base != p {
		driver.IPCClose(p)
		return nil, fmt.Errorf("%w: the opened allocation's range is unknown (base %#x, opened at %#x): %v", gpu.ErrUnsupported, base, p, err)
	}
	m := &ipcMapping{ptr: p, size: size, refs: 1}
	d.ipc[key] = m
	return m, nil
}

func (d *cudaDevice) ipcRelease(key ipcKey) {
	m := d.ipc[key]
	if m == nil {
		return
	}
	if m.refs--; m.refs == 0 {
		if d.failed() == nil {
			driver.IPCClose(m.ptr)
		}
		delete(d.ipc, key)
	}
}

// vmmImport imports allocation i of a CUDAFD region from its descriptor,
// reserves address space for it, maps its a.Size bytes and gives the
// device read-write access (on the device goroutine). What it made is in
// the mapping it returns, also with an error; vmmRelease undoes it.
func (d *cudaDevice) vmmImport(i int, a gpu.IPCAllocation, gran uint64) (*vmmMapping, error) {
	if a.Size%gran != 0 {
		return nil, fmt.Errorf("%w: allocation %d: %d bytes is not a multiple of the GPU's allocation granularity (%d bytes): "+
			"a VMM allocation is mapped whole, and its size is a multiple of the granularity", gpu.ErrInvalidRegion, i, a.Size, gran)
	}
	h, err := driver.MemImportFD(a.FD)
	if err != nil {
		return nil, fmt.Errorf("%w: allocation %d: cuMemImportFromShareableHandle of its descriptor failed: %w: the descriptor is not "+
			"a CUDA allocation exported as a POSIX file descriptor (cuMemExportToShareableHandle of memory created with "+
			"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), or the driver cannot import it here", gpu.ErrUnsupported, i, err)
	}
	m := &vmmMapping{h: h, size: a.Size}
	d.vmm[m] = struct{}{}
	if m.ptr, err = driver.MemAddressReserve(a.Size); err != nil {
		m.ptr = 0
		return m, fmt.Errorf("%w: allocation %d: cuMemAddressReserve of %d bytes: %w", gpu.ErrUnsupported, i, a.Size, err)
	}
	if err := driver.MemMap(m.ptr, a.Size, h); err != nil {
		return m, fmt.Errorf("%w: allocation %d: cuMemMap of %d bytes failed: %w: the allocation behind the descriptor is smaller "+
			"than the %d bytes declared", gpu.ErrInvalidRegion, i, a.Size, err, a.Size)
	}
	m.mapped = true
	if err := driver.MemSetAccess(m.ptr, a.Size, d.info.dev); err != nil {
		return m, fmt.Errorf("%w: allocation %d: cuMemSetAccess: %w", gpu.ErrUnsupported, i, err)
	}
	return m, nil
}

// vmmRelease unmaps m, frees its reservation and releases its handle (on
// the device goroutine).
func (d *cudaDevice) vmmRelease(m *vmmMapping) {
	if _, ok := d.vmm[m]; !ok {
		return
	}
	delete(d.vmm, m)
	if d.failed() != nil {
		return
	}
	if m.mapped {
		driver.MemUnmap(m.ptr, m.size)
	}
	if m.ptr != 0 {
		driver.MemAddressFree(m.ptr, m.size)
	}
	m.h.Release()
}

// ipcEventOpen opens key's event once per context, with its gate stream,
// and counts its users.
func (d *cudaDevice) ipcEventOpen(key ipcEventKey) (*ipcEvent, error) {
	if ev := d.ipcEvent[key]; ev != nil {
		ev.refs++
		return ev, nil
	}
	ev, err := driver.IPCOpenEvent(key.handle)
	if err != nil {
		return nil, fmt.Errorf("%w: cuIpcOpenEventHandle of pid %d's store event failed: %v (the handle must come from "+
			"cuIpcGetEventHandle of an event created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, and the event must still exist)",
			gpu.ErrUnsupported, key.pid, err)
	}
	least, _, err := driver.StreamPriorityRange()
	var gate driver.Stream
	if err == nil {
		gate, err = driver.NewStream(least)
	}
	if err != nil {
		ev.Destroy()
		return nil, fmt.Errorf("%w: creating the gate stream of pid %d's store event: %w", gpu.ErrUnsupported, key.pid, err)
	}
	e := &ipcEvent{ev: ev, gate: gate, refs: 1}
	d.ipcEvent[key] = e
	return e, nil
}

// ipcEventRelease drops a user of key's event; the last one destroys the
// gate stream (the driver releases it once its work is done, which for the
// wait on a dead engine's event is never: a stream's worth of driver
// memory, kept until the process exits) and then the event. Their
// stores have ended by then: none is gated, none issued (Unregister waits
// for them), so nothing of ours waits on the event.
func (d *cudaDevice) ipcEventRelease(key ipcEventKey) {
	ev := d.ipcEvent[key]
	if ev == nil {
		return
	}
	if ev.refs--; ev.refs == 0 {
		if d.failed() == nil {
			ev.gate.Destroy()
			ev.ev.Destroy()
		}
		delete(d.ipcEvent, key)
	}
}

// ipcOpenError explains the usual reasons a handle cannot be opened.
func ipcOpenError(pid int, err error) error {
	var why string
	switch {
	case errors.Is(err, driver.ErrorInvalidValue):
		why = "the handle is not a valid cudaIpcMemHandle_t: corrupted, or stale (the exporter freed the allocation). " +
			"Memory that legacy CUDA IPC cannot share (virtual-memory-management memory from cuMemCreate, PyTorch's " +
			"expandable_segments:True or vLLM's sleep-mode allocator) fails earlier, in the engine's cuIpcGetMemHandle"
	case errors.Is(err, driver.ErrorInvalidContext):
		why = "the exporter and the sidecar share a pid value in different PID namespaces, or the handle " +
			"comes from this process (share the pod's PID namespace: shareProcessNamespace: true)"
	case errors.Is(err, driver.ErrorMapFailed), errors.Is(err, driver.ErrorOutOfMemory):
		why = "the driver could not map the allocation (out of resources, or the exporter has exited)"
	case errors.Is(err, driver.ErrorAlreadyMapped):
		why = "the allocation is already mapped in this context"
	default:
		why = "unexpected driver error"
	}
	return fmt.Errorf("%w: cuIpcOpenMemHandle of pid %d's allocation failed: %w: %s", gpu.ErrUnsupported, pid, err, why)
}

func (d *cudaDevice) event() (driver.Event, error) {
	if n := len(d.events); n > 0 {
		ev := d.events[n-1]
		d.events = d.events[:n-1]
		return ev, nil
	}
	return driver.NewEvent()
}

// start issues j's copies and its completion event, unless the device
// has failed or j's fence is raised: then j ends without a driver call. A
// store on a region with the engine's event waits for the event first, on
// the host: if the event's latest record has completed its copies are
// issued at once, otherwise the wait goes on the event's gate stream and
// the store joins d.gated (pollGated issues it once the gate fires).
func (d *cudaDevice) start(j *cudaJob) {
	j.started = time.Now()
	if j.fence.Raised() {
		j.fail = fmt.Errorf("%w: CUDA device %d (%s)", gpu.ErrFenced, d.info.ordinal, d.info.uuid)
		d.finish(j)
		return
	}
	if err := d.failed(); err != nil {
		j.fail = err
		d.finish(j)
		return
	}
	if j.dir == gpu.EngineToPool && j.reg.event != 0 {
		// The engine recorded the event after the work that writes the
		// pages, then sent the store: its copies read them only once that
		// work is done. The query and the gate's wait capture the event's
		// latest record (that one or a later one: never too early).
		fired, err := j.reg.event.Query()
		j.calls++
		if err != nil {
			if d.sticky(j, err) {
				return
			}
			j.err = fmt.Errorf("cuEventQuery of the engine's store event: %w", err)
			d.finish(j)
			return
		}
		if !fired {
			d.gate(j)
			return
		}
	}
	d.issue(j)
}

// gate issues the wait for j's engine event on the event's gate stream,
// then records an event of ours after it, and parks j in d.gated. Nothing
// else is ever queued on a gate stream, so a wait that never ends (an
// engine that died with its record pending) holds back no copy: the
// session's end raises j's fence and pollGated withdraws it.
func (d *cudaDevice) gate(j *cudaJob) {
	gate := j.reg.gate
	err := gate.WaitEvent(j.reg.event)
	j.calls++
	var ev driver.Event
	if err == nil {
		if ev, err = d.event(); err == nil {
			if err = ev.Record(gate); err != nil {
				ev.Destroy()
			}
		}
	}
	if err != nil {
		if d.sticky(j, err) {
			return
		}
		j.err = fmt.Errorf("waiting for the engine's store event (cuStreamWaitEvent on its gate stream, then an event): %w", err)
		d.finish(j)
		return
	}
	j.gate = ev
	d.gated = append(d.gated, j)
}

// pollGated issues the gated stores whose gates have fired, withdraws
// those whose fences were raised (the session ended: an engine that died
// before its event completed) or whose device is closing, and returns how
// many left d.gated.
func (d *cudaDevice) pollGated() int {
	n := 0
	for i := 0; i < len(d.gated); {
		j := d.gated[i]
		withdraw := j.fence.Raised() || d.quitting
		fired, err := false, error(nil)
		if !withdraw {
			fired, err = j.gate.Query()
			if !fired {
				i++
				continue
			}
		}
		d.gated = append(d.gated[:i], d.gated[i+1:]...)
		n++
		switch {
		case withdraw:
			// A gate whose wait may never end: the driver destroys the
			// event once it has fired ("resources ... released
			// automatically once the device has completed hEvent").
			j.gate.Destroy()
			j.fail = fmt.Errorf("%w: CUDA device %d (%s): the store was waiting for its engine's event", gpu.ErrFenced, d.info.ordinal, d.info.uuid)
			if d.quitting && !j.fence.Raised() {
				j.fail = fmt.Errorf("gpu: CUDA device %d (%s) closed while the store waited for its engine's event: %w", d.info.ordinal, d.info.uuid, os.ErrClosed)
			}
			d.finish(j)
		case err != nil:
			j.gate.Destroy()
			if d.sticky(j, err) {
				return n
			}
			j.err = fmt.Errorf("waiting for the engine's store event: %w", err)
			d.finish(j)
		default:
			d.events = append(d.events, j.gate)
			j.gate = 0
			d.issue(j)
		}
	}
	return n
}

// issue enqueues j's copies on its direction's stream and records its
// completion event after them.
func (d *cudaDevice) issue(j *cudaJob) {
	stream, dir, q, head := d.store, driver.DtoH, &d.stores, 1
	if j.dir == gpu.PoolToEngine {
		stream, dir, q, head = d.load, driver.HtoD, &d.loads, 0
	}
	batch := d.e.batch.Load()
	calls, failed, err := driver.CopyAsync(dir, batch, j.dst, j.src, j.lens, stream)
	if err != nil && batch && batchRejected(err) {
		// Known driver failures of cuMemcpyBatchAsync: switch to per-range
		// copies from the first range not enqueued, for good.
		if d.e.batch.CompareAndSwap(true, false) {
			d.e.batchErr.Store(fmt.Errorf("cuMemcpyBatchAsync failed, using per-range copies: %w", err))
		}
		var c int
		c, f, err2 := driver.CopyAsync(dir, false, j.dst[failed:], j.src[failed:], j.lens[failed:], stream)
		calls, failed, err = calls+c, failed+f, err2
	}
	j.calls += calls
	if err != nil {
		if d.sticky(j, err) {
			return
		}
		j.err = fmt.Errorf("enqueueing range %d of %d: %w", failed, len(j.lens), err)
	}
	ev, err := d.event()
	if err == nil {
		err = ev.Record(stream)
		if err != nil {
			ev.Destroy()
		}
	}
	if err != nil {
		// No event: wait for what was enqueued, so that nothing touches
		// the pool or the engine's memory after the op completes.
		serr := stream.Synchronize()
		if d.sticky(j, errors.Join(err, serr)) {
			return
		}
		j.err = errors.Join(j.err, fmt.Errorf("recording the completion event: %w", err), serr)
		d.finish(j)
		return
	}
	j.ev = ev
	j.issued = time.Now()
	j.issuedAt.Mark(j.issued)
	if len(*q) == 0 {
		d.headSince[head] = j.issued
	}
	*q = append(*q, j)
}

func batchRejected(err error) bool {
	return errors.Is(err, driver.ErrorInvalidValue) || errors.Is(err, driver.ErrorNotSupported) || errors.Is(err, driver.ErrorNotLoaded)
}

// poll completes the jobs at the head of q (stream head: 0 loads, 1
// stores) whose events have fired (a stream runs its work in order) and
// returns how many.
func (d *cudaDevice) poll(q *[]*cudaJob, head int) int {
	n := 0
	for len(*q) > 0 {
		j := (*q)[0]
		fired, err := j.ev.Query()
		if !fired {
			break
		}
		if driver.Sticky(err) {
			// Every op issued on the device fails with it, j first.
			d.markFailed(err)
			return n + 1
		}
		if err != nil {
			j.err = errors.Join(j.err, err)
			j.ev.Destroy()
		} else {
			d.events = append(d.events, j.ev)
		}
		copy(*q, (*q)[1:])
		(*q)[len(*q)-1] = nil
		*q = (*q)[:len(*q)-1]
		d.finish(j)
		n++
	}
	if n > 0 {
		d.headSince[head] = time.Now()
	}
	return n
}

func (d *cudaDevice) finish(j *cudaJob) {
	res := gpu.Result{Bytes: j.bytes, Ranges: len(j.lens), Calls: j.calls, Queued: j.started.Sub(j.submitted), Elapsed: time.Since(j.started)}
	if j.fail != nil {
		res.Bytes = 0
		res.Err = &gpu.CopyError{Dir: j.dir, Region: j.h, Index: -1, Err: j.fail}
	} else if j.err != nil {
		res.Bytes = 0
		res.Err = &gpu.CopyError{Dir: j.dir, Region: j.h, Index: -1,
			Err: fmt.Errorf("%w: CUDA device %d (%s): %w", gpu.ErrTransfer, d.info.ordinal, d.info.uuid, j.err)}
	}
	d.e.completions <- cudaCompletion{reg: j.reg, res: res, done: j.done}
}
