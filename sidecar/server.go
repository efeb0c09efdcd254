package sidecar

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/cuda"
	"github.com/ringside-kv/ringside/gpu/host"
	"github.com/ringside-kv/ringside/internal/invariants"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// Server is a running sidecar: the I/O around the protocol state machine
// (sidecar/machine). It accepts sessions, runs one goroutine per session
// that reads its submission ring and calls the machine, and carries out
// what the machine returns: replies into completion rings (outbox.go, which
// never waits for a client), copies on the copy engine (copysched.go, fair
// between sessions), region registrations.
type Server struct {
	cfg   Config
	log   zerolog.Logger
	epoch uint64

	pool   *shm.Mapping
	copier gpu.Engine
	sched  *scheduler
	exits  *sys.ExitWatcher
	ln     *net.UnixListener
	met    *metrics
	tier   *l2.Tier      // the shared tier (tier.go); nil: off
	node   *node.Client  // the node tier (tier.go); nil: off
	nodeEv *nodeFollower // the node tier's blocks in the KV events (nodeevents.go)
	// dirLock keeps a second sidecar off Dir (dirlock.go).
	dirLock *sys.FileLock

	// mu guards m. It is held for one call of the machine and nothing
	// else: never across a ring write or wait, a reply, a copy or a
	// registration with the copy engine.
	mu sync.Mutex
	m  *machine.Machine

	smu      sync.RWMutex // guards sessions
	sessions map[machine.SessionID]*session

	outs sync.Pool // *machine.Output for copy completions and the reaper

	// gpuMu guards gpuFailed: the GPUs whose CUDA context hit a sticky
	// error (or whose copies outlived the watchdog), by UUID
	// (deviceFailed). /readyz, /healthz and ringside_cuda_device_failed
	// all read it.
	gpuMu     sync.Mutex
	gpuFailed map[string]cuda.DeviceFailure
	gpus      []string // the UUIDs the CUDA backend sees; nil without it

	ready    atomic.Bool
	draining atomic.Bool
	wg       sync.WaitGroup
	bg       sync.WaitGroup // unregistrations in the background
	stop     chan struct{}
	stopOnce sync.Once
}

// New creates the pool, the copy engine and the socket. Call Serve to run.
func New(cfg Config, log zerolog.Logger) (_ *Server, err error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := ring.EnsureDir(cfg.Dir, cfg.dirMode()); err != nil {
		return nil, fmt.Errorf("--dir: %w", err)
	}
	if err := checkDir(cfg.Dir, cfg.GroupAccess); err != nil {
		return nil, err
	}
	lock, err := lockDir(cfg.Dir) // dirlock.go; released by closeResources
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			lock.Unlock()
		}
	}()
	free, ferr := sys.FreeBytes(cfg.Dir)
	if cfg.PoolBytes == 0 {
		cfg.PoolBytes = DefaultPoolBytes
		if ferr == nil && free/2 < cfg.PoolBytes {
			cfg.PoolBytes = free / 2 / cfg.Machine.SlotBytes * cfg.Machine.SlotBytes
			log.Warn().Uint64("free_bytes", free).Uint64("pool_bytes", cfg.PoolBytes).Msg("small shared-memory mount: pool sized to half of its free space (set --pool.bytes to choose)")
		}
		if cfg.PoolBytes/cfg.Machine.SlotBytes < 16 {
			return nil, fmt.Errorf("--pool.bytes: %s has only %d bytes free, not enough for 16 slots of %d bytes", cfg.Dir, free, cfg.Machine.SlotBytes)
		}
	}
	if ferr == nil && free < cfg.PoolBytes {
		return nil, fmt.Errorf("--pool.bytes: %s has %d bytes free, the pool needs %d: lower --pool.bytes or raise the size of the shared-memory mount (the emptyDir sizeLimit in Kubernetes)", cfg.Dir, free, cfg.PoolBytes)
	}
	s := &Server{
		cfg: cfg, log: log, epoch: ring.RandomEpoch(),
		sessions: map[machine.SessionID]*session{}, stop: make(chan struct{}), dirLock: lock,
	}
	s.outs.New = func() any { return new(machine.Output) }
	slots := cfg.PoolBytes / cfg.Machine.SlotBytes
	if err := s.memoryBudget(slots * cfg.Machine.SlotBytes); err != nil {
		return nil, err
	}
	c, err := cache.New(cache.Config{Capacity: int(slots), DeltaLogSize: cfg.DeltaLogSize, WriteTimeout: cfg.WriteTimeout,
		Epoch: s.epoch, MaxLogBytes: s.cfg.Machine.MetaBytes / 4, Policy: cfg.CachePolicy})
	if err != nil {
		return nil, err
	}
	// Rings left behind by an earlier sidecar that crashed are removed
	// (their epoch is not ours, and nobody may trust them).
	s.removeStaleRings()
	// The pool never survives a restart: a pool file left by an earlier
	// process is removed, so nothing written before a crash is ever served.
	poolPath := filepath.Join(cfg.Dir, "pool")
	if err := shm.Unlink(poolPath); err != nil {
		return nil, err
	}
	s.pool, err = shm.Create(poolPath, int(slots*cfg.Machine.SlotBytes), cfg.fileMode())
	if err != nil {
		return nil, fmt.Errorf("pool: %w", err)
	}
	// Nobody else may open the pool: it is reached only through the
	// sidecar's copies. Its name goes as soon as it is mapped.
	shm.Unlink(poolPath)
	if cfg.PoolReserve {
		t0 := time.Now()
		switch err := s.pool.Reserve(); {
		case errors.Is(err, shm.ErrReserveUnsupported):
			log.Warn().Str("dir", cfg.Dir).Msg("--pool.reserve: this file system cannot reserve the pool's pages ahead; the pool stays sparse")
		case err != nil:
			s.pool.Close()
			return nil, fmt.Errorf("--pool.reserve: %w: the pool (%d bytes) does not fit; lower --pool.bytes or raise the shared-memory mount's size and the sidecar's memory limit", err, slots*cfg.Machine.SlotBytes)
		default:
			log.Info().Uint64("pool_bytes", slots*cfg.Machine.SlotBytes).Dur("took", time.Since(t0)).Msg("pool reserved")
		}
	}
	// Each budget runs its base number of chunks at once, more only while
	// some are stalled or for sessions that have none running (copysched.go).
	host := budget{base: cfg.CopyWorkers, max: cfg.CopyWorkers * 8}
	cuda := budget{base: cfg.CopyCUDAInflight, max: cfg.CopyCUDAInflight * 8}
	s.copier, s.gpus, err = newCopier(cfg, s.pool.Bytes(), host.max, cuda.max, log, s.deviceFailed)
	if err != nil {
		s.pool.Close()
		return nil, err
	}
	s.sched = newScheduler(s.copier, host, cuda, cfg.CopyStall)
	mcfg := s.cfg.Machine // with the memory bounds memoryBudget derived
	mcfg.CUDAIPC, mcfg.RegionKind = gpu.Supports(s.copier, gpu.CUDAIPC), s.sched.kind
	if invariants.Enabled {
		// A freed slot is poisoned: a load that read it after it was freed
		// (or before a store wrote it) delivers invariants.Poison bytes,
		// which every byte-checking test notices. On a sparse pool over a
		// full mount a touch may fault: that slot then stays as it was
		// (poisoning is a check, not a duty).
		pool, sb := s.pool.Bytes(), cfg.Machine.SlotBytes
		mcfg.PoisonSlot = func(slot uint32) {
			faultSafe(func() { invariants.Mangle(pool[uint64(slot)*sb : uint64(slot+1)*sb]) })
		}
	}
	s.m, err = machine.New(mcfg, c)
	if err != nil {
		s.closeResources()
		return nil, err
	}
	if cfg.L2 != nil {
		s.m.EnableL2(cfg.L2.Tier)
		if cfg.L2.RedisOn() {
			if s.tier, err = l2.New(cfg.L2.Redis, s.pool.Bytes(), log); err != nil {
				s.closeResources()
				return nil, err
			}
		}
		if cfg.L2.Node != nil {
			if s.node, err = node.NewClient(*cfg.L2.Node, s.pool, cfg.Machine.SlotBytes, log); err != nil {
				s.closeResources()
				return nil, err
			}
			s.nodeEv = newNodeFollower(s)
		}
	}
	if cfg.PrefillBlocks > 0 {
		t0 := time.Now()
		if err := s.m.Prefill(cfg.PrefillBlocks, s.epoch); err != nil {
			s.closeResources()
			return nil, fmt.Errorf("--debug.prefill-blocks: %w", err)
		}
		log.Info().Int("blocks", cfg.PrefillBlocks).Dur("took", time.Since(t0)).Msg("prefilled the index with synthetic blocks")
	}
	if s.exits, err = sys.NewExitWatcher(); err != nil {
		log.Warn().Err(err).Msg("cannot watch client processes with pidfds: a session then ends only when its socket closes")
	}
	if err := shm.Unlink(cfg.Socket); err != nil {
		s.closeResources()
		return nil, err
	}
	addr := &net.UnixAddr{Name: cfg.Socket, Net: "unixpacket"}
	s.ln, err = net.ListenUnix("unixpacket", addr)
	if err != nil {
		s.closeResources()
		return nil, fmt.Errorf("--socket: %w", err)
	}
	os.Chmod(cfg.Socket, cfg.fileMode())
	s.met = newMetrics(s)
	log.Info().Str("dir", cfg.Dir).Str("socket", cfg.Socket).Uint64("pool_bytes", slots*cfg.Machine.SlotBytes).
		Uint64("slot_bytes", cfg.Machine.SlotBytes).Uint64("slots", slots).Str("copy_backend", s.copier.Name()).
		Str("cache_policy", cfg.CachePolicy.String()).Float64("index_bytes_per_slot", c.BytesPerBlock()).Int64("metadata_limit", s.cfg.Machine.MetaBytes).
		Int64("ring_limit", s.cfg.Machine.RingBytes).Msg("sidecar ready")
	return s, nil
}

// memoryBudget derives the metadata and ring bounds, and the Go heap's soft
// limit, from the memory the sidecar may use.
func (s *Server) memoryBudget(pool uint64) error {
	limit, from := s.cfg.MemoryLimit, "--limits.memory"
	if limit == 0 {
		if v, file, ok := sys.MemoryLimit(); ok {
			limit, from = v, file
		}
	}
	if limit == 0 {
		if s.cfg.Machine.MetaBytes == 0 {
			s.cfg.Machine.MetaBytes = machine.DefaultMetaBytes
		}
		if s.cfg.Machine.RingBytes == 0 {
			s.cfg.Machine.RingBytes = machine.DefaultRingBytes
		}
		return nil
	}
	left := limit - int64(pool)
	if left < 64<<20 {
		return fmt.Errorf("memory limit %d bytes (%s) leaves %d bytes beside the %d-byte pool: at least 64 MiB are needed (raise the limit or lower --pool.bytes)", limit, from, left, pool)
	}
	if s.cfg.Machine.MetaBytes == 0 {
		s.cfg.Machine.MetaBytes = left * 3 / 10
	}
	if s.cfg.Machine.RingBytes == 0 {
		s.cfg.Machine.RingBytes = left / 4
	}
	heap := left * 7 / 10
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(heap)
	}
	s.log.Info().Int64("memory_limit", limit).Str("from", from).Int64("heap_soft_limit", heap).
		Int64("metadata_limit", s.cfg.Machine.MetaBytes).Int64("ring_limit", s.cfg.Machine.RingBytes).Msg("memory budget")
	return nil
}

// newCopier builds the copy engine: "host" is the host backend alone;
// "auto" and "cuda" route CUDA IPC regions to the CUDA backend and host
// regions to the host backend. "auto" falls back to the host backend alone
// (and says why) when CUDA cannot run; "cuda" fails instead (the driver
// and device checks run here and take no GPU memory: the CUDA backend
// retains a GPU's context and pins the pool only at the first
// registration). workers is the most host copies the engine must be able
// to run at once, and perDevice the most CUDA copies of one GPU (the
// scheduler keeps to cfg.CopyWorkers and cfg.CopyCUDAInflight unless some
// are stalled). onFail is called when a GPU's context fails; gpus are the
// UUIDs of the GPUs the CUDA backend sees.
func newCopier(cfg Config, pool []byte, workers, perDevice int, log zerolog.Logger, onFail func(cuda.DeviceFailure)) (_ gpu.Engine, gpus []string, _ error) {
	// Copy threads run at a lower priority (nice +5): on a busy CPU the
	// session loops, which answer every client, go before bulk copies.
	h, err := host.New(pool, host.Options{Workers: workers, Queue: 2 * workers,
		ThreadSetup: func() { sys.NiceThread(5) }})
	if err != nil || cfg.CopyBackend == "host" {
		return h, nil, err
	}
	// A device's queue holds every copy the scheduler may have in flight
	// on it, so that Submit never blocks.
	onPinned := func(p cuda.PinInfo, err error) {
		if err != nil {
			log.Error().Err(err).Uint64("pool_bytes", p.Bytes).Dur("took", p.Took).
				Msg("CUDA: the pool could not be pinned at the first GPU registration: GPU regions are refused")
			return
		}
		log.Info().Uint64("pinned_bytes", p.Bytes).Int("pin_chunks", p.Chunks).Dur("pin_took", p.Took).
			Msg("CUDA: pool registered as pinned host memory (started at the first GPU registration, which waited for it at most 1 s; GPU copies before now failed, and run from now on)")
		if p.MemlockBelowPool() {
			log.Warn().Uint64("memlock_limit", p.MemlockSoft).Uint64("pool_bytes", p.Bytes).
				Msg("RLIMIT_MEMLOCK is below the pinned pool size; if pinning or copies fail, raise it (ulimit -l, or the container's memlock limit)")
		}
	}
	c, err := cuda.New(pool, cuda.Options{Queue: max(256, perDevice), OnPinned: onPinned, OnDeviceFailed: onFail})
	if err != nil {
		if cfg.CopyBackend == "cuda" {
			h.Close()
			return nil, nil, fmt.Errorf("--copy.backend cuda: %w", err)
		}
		ev := log.Warn()
		if errors.Is(err, cuda.ErrUnavailable) {
			ev = log.Info()
		}
		ev.Err(err).Msg("copy backend auto: the CUDA backend is unavailable, using the host backend (GPU memory cannot be registered)")
		return h, nil, nil
	}
	in := c.Info()
	for _, d := range in.Devices {
		gpus = append(gpus, d.UUID)
	}
	log.Info().Int("cuda_driver", in.Driver).Interface("gpus", in.Devices).Bool("batched_copies", in.Batch).
		Uint64("pool_bytes", uint64(len(pool))).
		Msg("CUDA copy backend ready: no GPU context and no pinning until the first GPU registration")
	return gpu.NewRouter(c, h), gpus, nil
}

// deviceFailDrain is how long a sidecar whose GPU failed keeps serving
// (everything but that GPU; /readyz already unready) before it shuts
// down: the status 11 replies of the GPU's failed copies reach their
// engines first.
var deviceFailDrain = time.Second

// deviceFailed handles a GPU whose CUDA context hit a sticky error: every
// copy on it already fails (gpu.ErrDeviceFailed, status 11 to its
// sessions) and nothing more is issued on it. The sidecar turns unready,
// says so in ringside_cuda_device_failed, drains its sessions and exits:
// Serve returns an error wrapping gpu.ErrDeviceFailed, so the process
// exits non-zero and is restarted with a fresh context (docs/architecture.md,
// failure model, says why it does not reset the device instead).
func (s *Server) deviceFailed(f cuda.DeviceFailure) {
	s.gpuMu.Lock()
	if s.gpuFailed == nil {
		s.gpuFailed = map[string]cuda.DeviceFailure{}
	}
	_, again := s.gpuFailed[f.UUID]
	s.gpuFailed[f.UUID] = f
	s.gpuMu.Unlock()
	if again {
		return
	}
	s.log.Error().Err(f.Err).Str("gpu", f.UUID).Int("cuda_error", f.Code).Dur("drain", deviceFailDrain).
		Msg("CUDA device failed: its copies fail with status 11; the sidecar drains its sessions and exits to be restarted with a fresh context")
	time.AfterFunc(deviceFailDrain, s.Shutdown)
}

// deviceFailure returns the first failed GPU's error, or nil.
func (s *Server) deviceFailure() error {
	s.gpuMu.Lock()
	defer s.gpuMu.Unlock()
	var first error
	for _, uuid := range s.failedGPUs() {
		if first == nil {
			first = s.gpuFailed[uuid].Err
		}
	}
	return first
}

// failedGPUs lists the failed GPUs' UUIDs, sorted. Caller holds gpuMu.
func (s *Server) failedGPUs() []string {
	out := make([]string, 0, len(s.gpuFailed))
	for uuid := range s.gpuFailed {
		out = append(out, uuid)
	}
	sort.Strings(out)
	return out
}

func (s *Server) removeStaleRings() {
	for _, pat := range []string{"s*-*.sub", "s*-*.cmp"} {
		paths, _ := filepath.Glob(filepath.Join(s.cfg.Dir, pat))
		for _, p := range paths {
			if removed, err := ring.RemoveStale(p); removed {
				s.log.Info().Str("ring", p).Msg("removed a ring left by an earlier sidecar")
			} else if err != nil {
				s.log.Warn().Err(err).Str("ring", p).Msg("could not remove a stale ring")
			}
		}
	}
}

// Epoch is this process's boot token: rings and change-log cursors carry it.
func (s *Server) Epoch() uint64 { return s.epoch }

// Config returns the effective configuration.
func (s *Server) Config() Config { return s.cfg }

// Serve accepts attach requests until ctx is done or Shutdown is called,
// then drains: every session is closed, its leases released, its rings
// removed.
func (s *Server) Serve(ctx context.Context) error {
	s.wg.Add(1)
	go s.reaper()
	if s.nodeEv != nil {
		s.wg.Add(1)
		go s.nodeEv.run()
	}
	var httpErr chan error
	if s.cfg.MetricsAddr != "" {
		httpErr = s.met.serve(s.cfg.MetricsAddr, s.deviceFailure)
		s.httpHandlers()
	}
	s.ready.Store(true)
	go func() {
		select {
		case <-ctx.Done():
		case <-s.stop:
		}
		s.Shutdown()
	}()
	var err error
	var delay time.Duration // accept backoff (accept.go)
	for {
		conn, aerr := s.ln.AcceptUnix()
		if aerr != nil {
			if s.draining.Load() {
				break
			}
			if errors.Is(aerr, net.ErrClosed) {
				err = aerr
				break
			}
			s.acceptFailed(aerr, &delay)
			continue
		}
		delay = 0
		accepted := time.Now()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.attach(conn, accepted)
		}()
	}
	s.Shutdown()
	s.wg.Wait()
	s.met.close()
	s.closeResources()
	if ferr := s.deviceFailure(); ferr != nil {
		err = errors.Join(err, fmt.Errorf("sidecar: exiting to be restarted: %w", ferr))
	}
	if httpErr != nil {
		select {
		case e := <-httpErr:
			err = errors.Join(err, e)
		default:
		}
	}
	s.log.Info().Msg("sidecar stopped")
	return err
}

// Shutdown stops accepting, closes every session and makes Serve return.
func (s *Server) Shutdown() {
	s.stopOnce.Do(func() {
		s.draining.Store(true)
		s.ready.Store(false)
		close(s.stop)
		s.ln.Close()
		s.smu.RLock()
		for _, ss := range s.sessions {
			ss.shutdown("the sidecar is shutting down")
		}
		s.smu.RUnlock()
	})
}

func (s *Server) closeResources() {
	if s.sched != nil {
		s.sched.close()
	}
	s.bg.Wait()
	if s.node != nil {
		s.node.Close() // nothing of it touches the pool once it returns
	}
	if s.tier != nil {
		s.tier.Close() // nothing of it touches the pool once it returns
	}
	if s.copier != nil {
		s.copier.Close()
	}
	if s.exits != nil {
		s.exits.Close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
	shm.Unlink(s.cfg.Socket)
	s.dirLock.Unlock() // last: the directory is free for another sidecar
}

// reaper reclaims expired leases and half-written blocks.
func (s *Server) reaper() {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.ReapInterval)
	defer t.Stop()
	out := new(machine.Output)
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.mu.Lock()
		r := s.m.Tick(monotonic(), out)
		s.mu.Unlock()
		s.apply(out)
		if r.Leases+r.Writes > 0 {
			s.log.Debug().Int("leases", r.Leases).Int("writes", r.Writes).Int("blocks", r.Blocks).Msg("reaped")
		}
	}
}

func (s *Server) session(id machine.SessionID) *session {
	s.smu.RLock()
	defer s.smu.RUnlock()
	return s.sessions[id]
}

// apply carries out what the machine asked for: replies, copies,
// registrations and unregistrations. It holds no lock of the Server's.
func (s *Server) apply(out *machine.Output) {
	var last *session
	// The replies are sent under smu (send never blocks): a session's
	// cleanup removes it under smu before it closes its completion ring,
	// so a reply from another goroutine (a copy's completion) is either
	// written before that or not at all.
	s.smu.RLock()
	for _, r := range out.Replies {
		if last == nil || last.id != r.Session {
			last = s.sessions[r.Session]
		}
		if len(r.Payload) >= 4 {
			s.met.status(r.Payload)
		}
		if last != nil {
			last.ob.send(r.Type, r.Seq, r.Payload)
		}
	}
	s.smu.RUnlock()
	for i := range out.Copies {
		s.submitCopy(out.Copies[i])
	}
	s.applyL2(out)
	for _, h := range out.Unregister {
		s.sched.unroute(h) // before the engine may issue h again
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			s.copier.Unregister(h) // waits for the region's copies
		}()
	}
	for _, rg := range out.Registers {
		h, err := s.copier.Register(rg.Region)
		if err == nil {
			s.sched.route(h, rg.Region) // before the machine may copy through h
			if ss := s.session(rg.Session); ss != nil && rg.Region.Kind == gpu.HostProcess {
				ss.probeAt.CompareAndSwap(0, rg.Region.Base)
			}
		}
		s.machineCall(func(o *machine.Output) { s.m.RegisterDone(monotonic(), rg.Session, rg.ID, h, err, o) })
	}
}

// machineCall makes one call of the Machine under its lock and carries out
// what it returns.
func (s *Server) machineCall(call func(o *machine.Output)) {
	o := s.outs.Get().(*machine.Output)
	s.mu.Lock()
	call(o)
	s.mu.Unlock()
	s.apply(o)
	s.outs.Put(o)
}

// submitCopy hands a copy to the scheduler; its completion goes back to
// the machine.
func (s *Server) submitCopy(c machine.Copy) {
	alive := func() bool { return false } // the session ended: its stores are not kept
	if ss := s.session(c.Session); ss != nil {
		alive = ss.alive
	}
	op := gpu.Op{Dir: c.Dir, Region: c.Region, Pages: c.Pages, PoolOffsets: c.PoolOffsets}
	s.sched.submit(uint64(c.Session), c.UID, op, alive, func(res gpu.Result, exited bool) {
		s.met.copied(c.Dir, res)
		s.machineCall(func(o *machine.Output) {
			s.m.CopyDone(monotonic(), c.ID, machine.CopyResult{Err: res.Err, Exited: exited, Bytes: res.Bytes}, o)
		})
	})
}

var monoBase = time.Now()

// monotonic is the machine's clock: nanoseconds on the monotonic clock, so
// that a wall-clock jump never expires or extends a lease.
func monotonic() int64 { return int64(time.Since(monoBase)) }
