// Package sidecar is ringside's server: it owns the KV block pool in shared
// memory and serves engines through per-session ring pairs. See
// docs/architecture.md for the whole picture and docs/protocol.md for the
// wire format.
package sidecar

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// Config configures a Server. The zero value of each field means its
// default; EnsureDefaults fills them in and Validate reports every bad
// setting at once, each naming its flag. The Machine's settings (slots,
// budgets, leases, quotas, copy chunks) and the shared tier's are nested,
// each defined and defaulted once, in the package that uses it.
type Config struct {
	// Dir holds the socket, the rings and the pool file.
	Dir string
	// Socket is the attach socket's path. Default Dir/ringside.sock.
	Socket string
	// PoolBytes is the size of the shared-memory block pool. Zero means
	// auto: DefaultPoolBytes, or half of the free space in Dir if that is
	// less. Its slots are Machine.SlotBytes each.
	PoolBytes uint64
	// PoolReserve allocates and maps in every page of the pool at start
	// (shm.Mapping.Reserve): the whole pool is charged to the sidecar's
	// memory and the mount now, so a limit or a mount too small for it
	// fails at start, not hours later as the pool fills, and no copy ever
	// takes a first-touch page fault. Off, the pool file is sparse. The
	// zero value is off; `ringside serve` defaults to on (--pool.reserve).
	PoolReserve bool
	// WriteTimeout bounds how long a block may stay half-written
	// (cache.DefaultWriteTimeout).
	WriteTimeout time.Duration
	// RingCapacity is the data capacity of each session ring.
	RingCapacity uint64
	// Spin is the ring wait spin budget; Yield follows it. Zero is no
	// spinning (or yielding); `ringside serve` defaults to
	// ring.DefaultWait's.
	Spin  time.Duration
	Yield time.Duration
	// CopyBackend: "auto", "host" or "cuda".
	CopyBackend string
	// CopyWorkers is the number of host copy goroutines: the chunks of
	// host regions in flight.
	CopyWorkers int
	// MetricsAddr serves /metrics, /healthz, /readyz and /debug/state;
	// empty disables it (`ringside serve` defaults to DefaultMetricsAddr).
	MetricsAddr string
	// AllowUIDs may attach besides the sidecar's own uid.
	AllowUIDs []uint32
	// GroupAccess makes rings and the pool group read-write (mode 0660).
	GroupAccess bool
	// DeltaLogSize is each namespace's change-log length, a power of two
	// (cache.DefaultDeltaLogSize).
	DeltaLogSize int
	// CachePolicy is the pool's eviction policy (the zero value is LRU;
	// `ringside serve` sets cache.DefaultPolicy, MQP2, unless told otherwise).
	CachePolicy cache.Policy
	// ReapInterval is how often expired leases and writes are reclaimed.
	ReapInterval time.Duration
	// PrefillBlocks fills the index with this many synthetic blocks of a
	// private namespace at start (metadata only: no bytes are written), so
	// that benchmarks can measure per-step costs against a large cache.
	PrefillBlocks int
	// ReplyTimeout bounds how long the sidecar waits for room in a
	// session's completion ring before it drops the session.
	ReplyTimeout time.Duration
	// HTTP bounds the metrics server's connections (httpserve.go).
	HTTP HTTPConfig

	// MemoryLimit is the memory the sidecar may use in all (0: its
	// cgroup's limit, when it has one). With a limit, the Go heap's soft
	// limit (GOMEMLIMIT, unless set in the environment) and the Machine's
	// MetaBytes and RingBytes default to shares of what the pool leaves.
	MemoryLimit int64
	// CopyStall is how long a copy chunk may run before it counts as
	// stuck: another worker then takes its turn, and its session's queued
	// chunks are cancelled until it returns.
	CopyStall time.Duration
	// CopyCUDAInflight is the chunks (of Machine.CUDAChunkBytes) in flight
	// per GPU for the regions the CUDA backend serves, in place of
	// CopyWorkers: its copies are asynchronous DMA, which costs no CPU
	// while it runs, so they need large pieces, many at a time, to keep
	// the PCIe link busy. Each GPU's chunks have a budget of their own,
	// apart from the host's: a slow host copy never takes a CUDA slot, nor
	// the reverse. A GPU copies its chunks in flight one after another, so
	// all of them must fit in CopyStall at PCIe speed, or the last count
	// as stuck.
	CopyCUDAInflight int

	// Machine configures the protocol state machine: slot size, admission
	// budget, leases, quotas and copy chunks. New sets its CUDAIPC,
	// RegionKind and PoisonSlot. Its MetaBytes and RingBytes left zero
	// are derived by New from MemoryLimit: 30% and 25% of the memory the
	// pool leaves, or the Machine's defaults without a limit.
	Machine machine.Config
	// L2 is the shared tier (tier.go); nil: off.
	L2 *L2Config
}

// Defaults of the sidecar's own settings; those of the Machine, the cache
// and the shared tier are their packages'.
const (
	DefaultPoolBytes        = 1 << 30
	DefaultRingCapacity     = 1 << 20
	DefaultMetricsAddr      = ":9477"
	DefaultCopyBackend      = "auto"
	DefaultCopyWorkers      = 2
	DefaultCopyStall        = time.Second
	DefaultCopyCUDAInflight = 8
	DefaultReapInterval     = 100 * time.Millisecond
	DefaultReplyTimeout     = 2 * time.Second
)

// The ring capacities the sidecar takes, each a power of two: its own
// (--ring.capacity) up to ring.MaxCapacity, and what a client asks for at
// attach up to maxAskedRingCapacity.
const (
	minRingCapacity      = 64 << 10
	maxAskedRingCapacity = 64 << 20
)

func ringCapacityOK(c, maxCap uint64) bool {
	return c >= minRingCapacity && c <= maxCap && c&(c-1) == 0
}

// minPCIeBytesPerSecond is the slowest host-to-GPU link the CUDA copy
// budget is checked against (PCIe 3.0 x16 moves about 12 GB/s).
const minPCIeBytesPerSecond = 8e9

// EnsureDefaults fills zero fields with defaults, the Machine's and the
// tier's included, except those New derives at start: PoolBytes, and the
// Machine's MetaBytes and RingBytes.
func (c *Config) EnsureDefaults() {
	if c.Dir == "" {
		c.Dir = ring.DefaultDir
	}
	if c.Socket == "" {
		c.Socket = filepath.Join(c.Dir, "ringside.sock")
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = cache.DefaultWriteTimeout
	}
	if c.RingCapacity == 0 {
		c.RingCapacity = DefaultRingCapacity
	}
	if c.CopyBackend == "" {
		c.CopyBackend = DefaultCopyBackend
	}
	if c.CopyWorkers == 0 {
		c.CopyWorkers = DefaultCopyWorkers
	}
	if c.DeltaLogSize == 0 {
		c.DeltaLogSize = cache.DefaultDeltaLogSize
	}
	if c.ReapInterval == 0 {
		c.ReapInterval = DefaultReapInterval
	}
	if c.ReplyTimeout == 0 {
		c.ReplyTimeout = DefaultReplyTimeout
	}
	c.HTTP.ensureDefaults()
	if c.CopyStall == 0 {
		c.CopyStall = DefaultCopyStall
	}
	if c.CopyCUDAInflight == 0 {
		c.CopyCUDAInflight = DefaultCopyCUDAInflight
	}
	meta, rings := c.Machine.MetaBytes, c.Machine.RingBytes
	c.Machine.EnsureDefaults()
	c.Machine.MetaBytes, c.Machine.RingBytes = meta, rings // zero: New's (memoryBudget)
	if c.L2 != nil {
		c.L2.EnsureDefaults()
	}
}

// machineFlags names the flag of each Machine field that has one, for the
// Machine's FieldErrors.
var machineFlags = map[string]string{
	"SlotBytes": "pool.slot-bytes", "Budget": "budget", "LeaseTTL": "lease.ttl", "MaxLeaseTTL": "lease.max-ttl",
	"MaxRetainTTL": "retain.max-ttl",
	"SnapshotScan": "snapshot-scan", "ChunkBytes": "copy.chunk-bytes", "CUDAChunkBytes": "copy.cuda-chunk-bytes",
	"MaxSessions": "max-sessions", "MetaBytes": "limits.metadata-bytes", "RingBytes": "limits.ring-bytes",
	"MaxNamespaces": "limits.namespaces", "PinShare": "limits.pin-share", "PendingShare": "limits.pending-share",
	"RetainShare": "limits.retain-share", "UIDShare": "limits.uid-share", "SessionShare": "limits.session-share",
	// L2Config's
	"Policy": "l2.policy", "WriteSlots": "l2.write-slots", "EvictAhead": "l2.evict-ahead",
	"MaxLookupBlocks": "l2.max-lookup-blocks", "MaxFetchBlocks": "l2.max-fetch-blocks",
}

// flagErrors returns the errors err joins, each of the Machine's
// FieldErrors as the flag's error.
func flagErrors(err error) []error {
	if err == nil {
		return nil
	}
	errs := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	}
	out := make([]error, 0, len(errs))
	for _, e := range errs {
		var fe *machine.FieldError
		if errors.As(e, &fe) {
			if flag, ok := machineFlags[fe.Field]; ok {
				e = fmt.Errorf("--%s: %s", flag, fe.Problem)
			}
		}
		out = append(out, e)
	}
	return out
}

// Validate reports every bad setting, each naming its flag.
func (c *Config) Validate() error {
	var errs []error
	bad := func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--%s: %s", flag, fmt.Sprintf(format, args...)))
	}
	if !filepath.IsAbs(c.Dir) {
		bad("dir", "%q must be an absolute path", c.Dir)
	}
	if len(c.Socket) > 100 {
		bad("socket", "path %q is longer than a Unix socket path may be", c.Socket)
	}
	slot := c.Machine.SlotBytes
	if slot < 4096 || slot > 1<<30 || slot%64 != 0 {
		bad("pool.slot-bytes", "%d must be a multiple of 64 in [4 KiB, 1 GiB]", slot)
	}
	if c.PoolBytes != 0 && slot > 0 && c.PoolBytes/max(slot, 1) < 16 {
		bad("pool.bytes", "%d holds fewer than 16 slots of %d bytes", c.PoolBytes, slot)
	}
	if c.PoolBytes > 1<<40 {
		bad("pool.bytes", "%d is over 1 TiB", c.PoolBytes)
	}
	if c.WriteTimeout <= 0 {
		bad("write-timeout", "%v must be positive", c.WriteTimeout)
	}
	if !c.CachePolicy.Valid() {
		bad("cache.policy", "%v is not %s", c.CachePolicy, cache.PolicyNames)
	}
	if !ringCapacityOK(c.RingCapacity, ring.MaxCapacity) {
		bad("ring.capacity", "%d must be a power of two in [%d KiB, %d GiB]", c.RingCapacity, minRingCapacity>>10, ring.MaxCapacity>>30)
	}
	if c.Spin < 0 || c.Yield < 0 {
		bad("ring.spin", "spin and yield budgets must not be negative")
	}
	switch c.CopyBackend {
	case "auto", "host", "cuda":
	default:
		bad("copy.backend", "%q: want auto, host or cuda", c.CopyBackend)
	}
	if c.CopyWorkers < 1 || c.CopyWorkers > 64 {
		bad("copy.workers", "%d outside [1, 64]", c.CopyWorkers)
	}
	if c.DeltaLogSize <= 0 || c.DeltaLogSize&(c.DeltaLogSize-1) != 0 {
		bad("delta-log-size", "%d must be a power of two", c.DeltaLogSize)
	}
	if c.ReapInterval <= 0 || c.ReplyTimeout <= 0 {
		bad("reap-interval", "reap interval and reply timeout must be positive")
	}
	errs = append(errs, c.HTTP.validate()...)
	if c.MemoryLimit < 0 {
		bad("limits.memory", "%d must not be negative", c.MemoryLimit)
	}
	m := c.Machine
	if m.MetaBytes == 0 {
		m.MetaBytes = machine.DefaultMetaBytes // derived at start (memoryBudget): at least 1 MiB
	}
	if m.RingBytes == 0 {
		m.RingBytes = machine.DefaultRingBytes
	}
	errs = append(errs, flagErrors(m.Validate())...)
	if m.ChunkBytes < 4096 {
		bad("copy.chunk-bytes", "%d must be at least 4 KiB", m.ChunkBytes)
	}
	if c.CopyStall <= 0 {
		bad("copy.stall", "%v must be positive", c.CopyStall)
	}
	if m.CUDAChunkBytes < 4096 || m.CUDAChunkBytes > 1<<30 {
		bad("copy.cuda-chunk-bytes", "%d outside [4 KiB, 1 GiB]", m.CUDAChunkBytes)
	}
	if c.CopyCUDAInflight < 1 || c.CopyCUDAInflight > 64 {
		bad("copy.cuda-inflight", "%d outside [1, 64]", c.CopyCUDAInflight)
	} else if queued := m.CUDAChunkBytes * uint64(c.CopyCUDAInflight); c.CopyStall > 0 && float64(queued) > minPCIeBytesPerSecond*c.CopyStall.Seconds() {
		// A GPU copies its chunks one after another (one stream per
		// direction), so the last one in flight ends after all the others.
		bad("copy.cuda-inflight", "%d chunks of --copy.cuda-chunk-bytes %d are %d bytes in flight per GPU, more than a PCIe link moves within --copy.stall (%v) at %g GB/s: the last ones would count as stuck", c.CopyCUDAInflight, m.CUDAChunkBytes, queued, c.CopyStall, minPCIeBytesPerSecond/1e9)
	}
	if c.L2 != nil {
		errs = append(errs, c.L2.validate()...)
	}
	return errors.Join(errs...)
}

func (c *Config) fileMode() os.FileMode {
	if c.GroupAccess {
		return 0o660
	}
	return 0o600
}

func (c *Config) dirMode() os.FileMode {
	if c.GroupAccess {
		return 0o770
	}
	return 0o700
}
