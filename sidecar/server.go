package sidecar

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// Server is a running sidecar.
type Server struct {
	cfg   Config
	log   zerolog.Logger
	epoch uint64

	pool   *shm.Mapping
	copier gpu.Engine
	ln     *net.UnixListener
	met    *metrics
	// dirLock keeps a second sidecar off Dir (dirlock.go).
	dirLock *sys.FileLock

	// mu guards everything below: the cache, the budget, instances,
	// queries and the session table. Handlers hold it only for bookkeeping,
	// never across a copy or a ring wait.
	mu        sync.Mutex
	cache     *cache.Cache
	budget    *cache.Budget
	instances map[string]*instance
	queries   map[uint64]*query
	sessions  map[uint64]*session
	nextSess  uint64
	nextInst  uint64
	reaped    []uint64

	ready    atomic.Bool
	draining atomic.Bool
	wg       sync.WaitGroup
	stop     chan struct{}
	stopOnce sync.Once
}

// instance is one engine instance: all the sessions (scheduler and ranks)
// that attached with the same instance id and namespace.
type instance struct {
	name      string
	id        cache.SessionID // budget owner
	ns        cache.NamespaceID
	width     int
	world     int
	sessions  int
	batches   map[uint64][]byte
	hashBytes int      // digest bytes held by batches
	waiting   []*query // FIFO of queries over budget
}

// query is a lease as the protocol sees it: its state and its budget.
type query struct {
	lease    uint64
	inst     *instance
	owner    *session
	state    schema.State
	blocks   int
	bytes    int64
	budgeted bool
	loading  int
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
			cfg.PoolBytes = free / 2 / cfg.SlotBytes * cfg.SlotBytes
			log.Warn().Uint64("free_bytes", free).Uint64("pool_bytes", cfg.PoolBytes).Msg("small shared-memory mount: pool sized to half of its free space (set --pool.bytes to choose)")
		}
		if cfg.PoolBytes/cfg.SlotBytes < 16 {
			return nil, fmt.Errorf("--pool.bytes: %s has only %d bytes free, not enough for 16 slots of %d bytes", cfg.Dir, free, cfg.SlotBytes)
		}
	}
	s := &Server{
		cfg: cfg, log: log, epoch: ring.RandomEpoch(),
		instances: map[string]*instance{}, queries: map[uint64]*query{}, sessions: map[uint64]*session{},
		stop: make(chan struct{}), dirLock: lock,
	}
	if ferr == nil && free < cfg.PoolBytes {
		return nil, fmt.Errorf("--pool.bytes: %s has %d bytes free, the pool needs %d: lower --pool.bytes or raise the size of the shared-memory mount (the emptyDir sizeLimit in Kubernetes)", cfg.Dir, free, cfg.PoolBytes)
	}
	slots := cfg.PoolBytes / cfg.SlotBytes
	c, err := cache.New(cache.Config{Capacity: int(slots), DeltaLogSize: cfg.DeltaLogSize, WriteTimeout: cfg.WriteTimeout, Epoch: s.epoch})
	if err != nil {
		return nil, err
	}
	s.cache = c
	s.budget = cache.NewBudget(cfg.Budget)
	if cfg.PrefillBlocks > 0 {
		if err := s.prefill(cfg.PrefillBlocks); err != nil {
			return nil, err
		}
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
	s.pool, err = shm.Create(poolPath, int(slots*cfg.SlotBytes), cfg.fileMode())
	if err != nil {
		return nil, fmt.Errorf("pool: %w", err)
	}
	if cfg.PoolReserve {
		t0 := time.Now()
		switch err := s.pool.Reserve(); {
		case errors.Is(err, shm.ErrReserveUnsupported):
			log.Warn().Str("dir", cfg.Dir).Msg("--pool.reserve: this file system cannot reserve the pool's pages ahead; the pool stays sparse")
		case err != nil:
			s.pool.Close()
			shm.Unlink(poolPath)
			return nil, fmt.Errorf("--pool.reserve: %w: the pool (%d bytes) does not fit; lower --pool.bytes or raise the shared-memory mount's size and the sidecar's memory limit", err, slots*cfg.SlotBytes)
		default:
			log.Info().Uint64("pool_bytes", slots*cfg.SlotBytes).Dur("took", time.Since(t0)).Msg("pool reserved")
		}
	}
	s.copier, err = newCopier(cfg, s.pool.Bytes(), log)
	if err != nil {
		s.pool.Close()
		return nil, err
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
	log.Info().Str("dir", cfg.Dir).Str("socket", cfg.Socket).Uint64("pool_bytes", slots*cfg.SlotBytes).
		Uint64("slot_bytes", cfg.SlotBytes).Uint64("slots", slots).Str("copy_backend", s.copier.Name()).
		Float64("index_bytes_per_slot", c.BytesPerBlock()).Msg("sidecar ready")
	return s, nil
}

// newCopier builds the copy engine: "host" is the host backend alone;
// "auto" and "cuda" route CUDA IPC regions to the CUDA backend and host
// regions to the host backend. "auto" falls back to the host backend alone
// (and says why) when CUDA cannot run; "cuda" fails instead.
func newCopier(cfg Config, pool []byte, log zerolog.Logger) (gpu.Engine, error) {
	host, err := gpu.NewHost(pool, gpu.HostOptions{Workers: cfg.CopyWorkers})
	if err != nil || cfg.CopyBackend == "host" {
		return host, err
	}
	c, err := gpu.NewCUDA(pool, gpu.CUDAOptions{})
	if err != nil {
		if cfg.CopyBackend == "cuda" {
			host.Close()
			return nil, fmt.Errorf("--copy.backend cuda: %w", err)
		}
		ev := log.Warn()
		if errors.Is(err, gpu.ErrCUDAUnavailable) {
			ev = log.Info()
		}
		ev.Err(err).Msg("copy backend auto: the CUDA backend is unavailable, using the host backend (GPU memory cannot be registered)")
		return host, nil
	}
	in := c.Info()
	log.Info().Int("cuda_driver", in.Driver).Interface("gpus", in.Devices).Bool("batched_copies", in.Batch).
		Uint64("pinned_bytes", in.Pin.Bytes).Int("pin_chunks", in.Pin.Chunks).Dur("pin_took", in.Pin.Took).
		Msg("CUDA copy backend ready: pool registered as pinned host memory")
	if in.Pin.MemlockBelowPool() {
		log.Warn().Uint64("memlock_limit", in.Pin.MemlockSoft).Uint64("pool_bytes", in.Pin.Bytes).
			Msg("RLIMIT_MEMLOCK is below the pinned pool size; if pinning or copies fail, raise it (ulimit -l, or the container's memlock limit)")
	}
	return gpu.NewRouter(c, host), nil
}

// prefill stores n synthetic blocks (random digests, no bytes) in a private
// namespace that no engine can attach to with the same key.
func (s *Server) prefill(n int) error {
	if n > s.cache.Capacity() {
		return fmt.Errorf("--debug.prefill-blocks: %d blocks do not fit in %d slots", n, s.cache.Capacity())
	}
	ns, err := s.cache.AddNamespace(cache.NamespaceKey{Model: "\x00ringside-prefill", Layout: 1, DigestWidth: 32, WorldSize: 1})
	if err != nil {
		return err
	}
	var d [32]byte
	binary.LittleEndian.PutUint64(d[24:], s.epoch)
	t0 := time.Now()
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(d[:8], uint64(i))
		t, st, err := s.cache.BeginStore(ns, 0, d[:], 0, 0)
		if err != nil || st != cache.Allocated {
			return fmt.Errorf("prefill block %d: %v %v", i, st, err)
		}
		if err := s.cache.CommitStore(t); err != nil {
			return err
		}
	}
	s.log.Info().Int("blocks", n).Dur("took", time.Since(t0)).Msg("prefilled the index with synthetic blocks")
	return nil
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
	var httpErr chan error
	if s.cfg.MetricsAddr != "" {
		httpErr = s.met.serve(s.cfg.MetricsAddr)
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
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.attach(conn)
		}()
	}
	s.Shutdown()
	s.wg.Wait()
	s.met.close()
	s.closeResources()
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
		s.mu.Lock()
		for _, ss := range s.sessions {
			ss.shutdown()
		}
		s.mu.Unlock()
	})
}

func (s *Server) closeResources() {
	if s.copier != nil {
		s.copier.Close()
	}
	if s.pool != nil {
		shm.Unlink(s.pool.Path())
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
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.mu.Lock()
		var r cache.ReapResult
		r, s.reaped = s.cache.ReapLeases(monotonic(), s.reaped[:0])
		for _, id := range s.reaped {
			if q := s.queries[id]; q != nil {
				s.expireLocked(q)
			}
		}
		s.mu.Unlock()
		if r.Leases+r.Writes > 0 {
			s.log.Debug().Int("leases", r.Leases).Int("writes", r.Writes).Int("blocks", r.Blocks).Msg("reaped")
		}
	}
}

// expireLocked resolves a query whose lease the cache reclaimed: it becomes a
// miss (the engine recomputes) and gives back its budget.
func (s *Server) expireLocked(q *query) {
	s.unbudgetLocked(q)
	q.state = schema.StateMiss
	s.met.expired.Inc()
}

// unbudgetLocked gives back a query's budget (or removes it from the wait
// queue) and admits waiting queries that now fit, oldest first.
func (s *Server) unbudgetLocked(q *query) {
	in := q.inst
	if q.budgeted {
		q.budgeted = false
		s.budget.Done(in.id, q.bytes)
	} else if q.state == schema.StateWaiting {
		for i, w := range in.waiting {
			if w == q {
				in.waiting = append(in.waiting[:i], in.waiting[i+1:]...)
				break
			}
		}
	}
	for len(in.waiting) > 0 {
		w := in.waiting[0]
		if !s.budget.Admit(in.id, w.bytes) {
			break
		}
		w.budgeted = true
		w.state = schema.StateReady
		in.waiting = in.waiting[1:]
	}
}

// instanceLocked finds or creates the instance for an attach request.
func (s *Server) instanceLocked(req *schema.AttachRequest) (*instance, error) {
	key := cache.NamespaceKey{
		Model: req.Model, Layout: fingerprint(req.Layout), TenantSalt: fingerprint(req.Salt),
		DigestWidth: int(req.DigestWidth), WorldSize: int(req.WorldSize),
	}
	name := req.Instance + "\x00" + req.Model + "\x00" + req.Layout + "\x00" + req.Salt
	if in, ok := s.instances[name]; ok {
		if in.width != int(req.DigestWidth) || in.world != int(req.WorldSize) {
			return nil, schema.Errorf(schema.ErrCodeNotPermitted, "instance %q attached before with digest width %d and world size %d", req.Instance, in.width, in.world)
		}
		return in, nil
	}
	ns, err := s.cache.AddNamespace(key)
	if err != nil {
		return nil, schema.Errorf(schema.ErrCodeTooLarge, "namespace: %v", err)
	}
	s.nextInst++
	in := &instance{name: name, id: cache.SessionID(s.nextInst), ns: ns, width: int(req.DigestWidth), world: int(req.WorldSize), batches: map[uint64][]byte{}}
	s.instances[name] = in
	return in, nil
}

// fingerprint reduces a namespace string to the cache's 64-bit key part.
// Namespaces are separated by the full model string plus these 64-bit
// fingerprints; block hits always compare full digests.
func fingerprint(s string) uint64 {
	if s == "" {
		return 0
	}
	h := sha256.Sum256([]byte(s))
	return binary.LittleEndian.Uint64(h[:8])
}

var monoBase = time.Now()

// monotonic is the cache's clock: nanoseconds on the monotonic clock, so
// that a wall-clock jump never expires or extends a lease.
func monotonic() int64 { return int64(time.Since(monoBase)) }
