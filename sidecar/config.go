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
)

// Config configures a Server. The zero value of each field means its
// default; EnsureDefaults fills them in and Validate reports every bad
// setting at once.
type Config struct {
	// Dir holds the socket, the rings and the pool file.
	Dir string
	// Socket is the attach socket's path. Default Dir/ringside.sock.
	Socket string
	// PoolBytes is the size of the shared-memory block pool. Zero means
	// auto: 1 GiB, or half of the free space in Dir if that is less.
	PoolBytes uint64
	// SlotBytes is the size of one pool slot: one rank's shard of one
	// block. An engine page must not be larger.
	SlotBytes uint64
	// PoolReserve allocates and maps in every page of the pool at start
	// (shm.Mapping.Reserve): the whole pool is charged to the sidecar's
	// memory and the mount now, so a limit or a mount too small for it
	// fails at start, not hours later as the pool fills, and no copy ever
	// takes a first-touch page fault. Off, the pool file is sparse. The
	// zero value is off; `ringside serve` defaults to on (--pool.reserve).
	PoolReserve bool
	// Budget is the bytes an engine instance may have admitted for loading
	// at once; queries over it wait in state Waiting.
	Budget int64
	// LeaseTTL is the default lease time-to-live; MaxLeaseTTL bounds what a
	// client may ask for.
	LeaseTTL    time.Duration
	MaxLeaseTTL time.Duration
	// WriteTimeout bounds how long a block may stay half-written.
	WriteTimeout time.Duration
	// RingCapacity is the data capacity of each session ring.
	RingCapacity uint64
	// Spin is the ring wait spin budget; Yield follows it.
	Spin  time.Duration
	Yield time.Duration
	// CopyBackend: "auto", "host" or "cuda".
	CopyBackend string
	// CopyWorkers is the number of host copy goroutines: the chunks of
	// host regions in flight.
	CopyWorkers int
	// MetricsAddr serves /metrics, /healthz, /readyz and /debug/state;
	// empty disables it.
	MetricsAddr string
	// AllowUIDs may attach besides the sidecar's own uid.
	AllowUIDs []uint32
	// GroupAccess makes rings and the pool group read-write (mode 0660).
	GroupAccess bool
	// MaxSessions bounds concurrent sessions.
	MaxSessions int
	// MaxBatches bounds the hash batches of one engine instance, and
	// MaxBatchHashes the length of one batch.
	MaxBatches     int
	MaxBatchHashes int
	// MaxHashBytes bounds the digest bytes all batches of one engine
	// instance hold together (default 256 MiB).
	MaxHashBytes int
	// MaxLeases bounds the live leases (queries) of one session.
	MaxLeases int
	// DeltaLogSize is each namespace's change-log length (power of two).
	DeltaLogSize int
	// SnapshotScan bounds the pool slots one Snapshot page scans (under
	// the sidecar's lock), default 16,384: a page of a large, sparse pool
	// may then hold few digests, or none.
	SnapshotScan int
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
	// limit (GOMEMLIMIT, unless set in the environment) and the metadata
	// and ring bounds below default to shares of what the pool leaves.
	MemoryLimit int64
	// MetaBytes bounds the metadata of all clients together (hash batches,
	// queries, regions, copies in flight, sessions, instances, namespaces,
	// change logs); RingBytes the shared memory of all sessions' rings and
	// reply queues. Zero: 30% and 25% of the memory the pool leaves under
	// MemoryLimit, or 512 MiB and 1 GiB without a limit.
	MetaBytes int64
	RingBytes int64
	// MaxNamespaces bounds namespaces; an idle one is reclaimed when the
	// bound is reached.
	MaxNamespaces int
	// PinShare is the part of the pool the leases of one uid may pin
	// (distinct blocks); PendingShare the part one uid may hold in blocks
	// that some tensor-parallel ranks have not written yet or that fetches
	// from the shared tier reserved; UIDShare and SessionShare the parts
	// of MetaBytes (and of RingBytes and MaxSessions, for a uid) one uid
	// and one session may hold. Zero: the defaults of sidecar/machine.
	PinShare     float64
	PendingShare float64
	UIDShare     float64
	SessionShare float64
	// CopyChunkBytes is the largest piece a copy is split into for fair
	// scheduling between sessions (default 4 MiB); CopyStall how long a
	// piece may run before it counts as stuck (default 1 s): another
	// worker then takes its turn, and its session's queued pieces are
	// cancelled until it returns.
	CopyChunkBytes uint64
	CopyStall      time.Duration
	// CopyCUDAChunkBytes and CopyCUDAInflight are the chunk size and the
	// chunks in flight per GPU for the regions the CUDA backend serves
	// (default 64 MiB and 8), in place of CopyChunkBytes and CopyWorkers:
	// its copies are asynchronous DMA, which costs no CPU while it runs,
	// so they need large pieces, many at a time, to keep the PCIe link
	// busy. Each GPU's chunks have a budget of their own, apart from the
	// host's: a slow host copy never takes a CUDA slot, nor the reverse.
	// A GPU copies its chunks in flight one after another, so all of them
	// must fit in CopyStall at PCIe speed, or the last count as stuck.
	CopyCUDAChunkBytes uint64
	CopyCUDAInflight   int
	// L2 is the shared tier (tier.go); nil: off.
	L2 *L2Config
}

// Defaults.
const (
	DefaultPoolBytes    = 1 << 30
	DefaultSlotBytes    = 256 << 10
	DefaultBudget       = 64 << 20
	DefaultLeaseTTL     = 30 * time.Second
	DefaultMaxLeaseTTL  = 5 * time.Minute
	DefaultWriteTimeout = 30 * time.Second
	DefaultRingCapacity = 1 << 20
	DefaultMetricsAddr  = ":9477"
	DefaultSnapshotScan = 1 << 14
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

// EnsureDefaults fills zero fields with defaults.
func (c *Config) EnsureDefaults() {
	if c.Dir == "" {
		c.Dir = ring.DefaultDir
	}
	if c.Socket == "" {
		c.Socket = filepath.Join(c.Dir, "ringside.sock")
	}
	if c.SlotBytes == 0 {
		c.SlotBytes = DefaultSlotBytes
	}
	if c.Budget == 0 {
		c.Budget = DefaultBudget
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.MaxLeaseTTL == 0 {
		c.MaxLeaseTTL = DefaultMaxLeaseTTL
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = DefaultWriteTimeout
	}
	if c.RingCapacity == 0 {
		c.RingCapacity = DefaultRingCapacity
	}
	if c.CopyBackend == "" {
		c.CopyBackend = "auto"
	}
	if c.CopyWorkers == 0 {
		c.CopyWorkers = 2
	}
	if c.MaxSessions == 0 {
		c.MaxSessions = 256
	}
	if c.MaxBatches == 0 {
		c.MaxBatches = 1 << 16
	}
	if c.MaxBatchHashes == 0 {
		c.MaxBatchHashes = 1 << 20
	}
	if c.MaxHashBytes == 0 {
		c.MaxHashBytes = 256 << 20
	}
	if c.MaxLeases == 0 {
		c.MaxLeases = 1 << 16
	}
	if c.DeltaLogSize == 0 {
		c.DeltaLogSize = 1 << 16
	}
	if c.SnapshotScan == 0 {
		c.SnapshotScan = DefaultSnapshotScan
	}
	if c.ReapInterval == 0 {
		c.ReapInterval = 100 * time.Millisecond
	}
	if c.ReplyTimeout == 0 {
		c.ReplyTimeout = 2 * time.Second
	}
	c.HTTP.ensureDefaults()
	if c.MaxNamespaces == 0 {
		c.MaxNamespaces = 1024
	}
	if c.CopyChunkBytes == 0 {
		c.CopyChunkBytes = 4 << 20
	}
	if c.CopyStall == 0 {
		c.CopyStall = time.Second
	}
	if c.CopyCUDAChunkBytes == 0 {
		c.CopyCUDAChunkBytes = 64 << 20
	}
	if c.CopyCUDAInflight == 0 {
		c.CopyCUDAInflight = 8
	}
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
	if c.SlotBytes < 4096 || c.SlotBytes > 1<<30 || c.SlotBytes%64 != 0 {
		bad("pool.slot-bytes", "%d must be a multiple of 64 in [4 KiB, 1 GiB]", c.SlotBytes)
	}
	if c.PoolBytes != 0 && c.SlotBytes > 0 && c.PoolBytes/max(c.SlotBytes, 1) < 16 {
		bad("pool.bytes", "%d holds fewer than 16 slots of %d bytes", c.PoolBytes, c.SlotBytes)
	}
	if c.PoolBytes > 1<<40 {
		bad("pool.bytes", "%d is over 1 TiB", c.PoolBytes)
	}
	if c.Budget <= 0 {
		bad("budget", "%d must be positive", c.Budget)
	}
	if c.LeaseTTL <= 0 || c.LeaseTTL > c.MaxLeaseTTL {
		bad("lease.ttl", "%v must be positive and at most --lease.max-ttl (%v)", c.LeaseTTL, c.MaxLeaseTTL)
	}
	if c.WriteTimeout <= 0 {
		bad("write-timeout", "%v must be positive", c.WriteTimeout)
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
	if c.MaxSessions < 1 {
		bad("max-sessions", "%d must be positive", c.MaxSessions)
	}
	if c.DeltaLogSize <= 0 || c.DeltaLogSize&(c.DeltaLogSize-1) != 0 {
		bad("delta-log-size", "%d must be a power of two", c.DeltaLogSize)
	}
	if c.SnapshotScan < 1 {
		bad("snapshot-scan", "%d must be positive", c.SnapshotScan)
	}
	if c.ReapInterval <= 0 || c.ReplyTimeout <= 0 {
		bad("reap-interval", "reap interval and reply timeout must be positive")
	}
	errs = append(errs, c.HTTP.validate()...)
	if c.MemoryLimit < 0 || c.MetaBytes < 0 || c.RingBytes < 0 {
		bad("limits.memory", "memory limits must not be negative")
	}
	if c.MetaBytes != 0 && c.MetaBytes < 1<<20 {
		bad("limits.metadata-bytes", "%d must be at least 1 MiB", c.MetaBytes)
	}
	if c.RingBytes != 0 && c.RingBytes < 1<<20 {
		bad("limits.ring-bytes", "%d must be at least 1 MiB", c.RingBytes)
	}
	if c.MaxNamespaces < 1 || c.MaxNamespaces > 65535 {
		bad("limits.namespaces", "%d outside [1, 65535]", c.MaxNamespaces)
	}
	for flag, v := range map[string]float64{"limits.pin-share": c.PinShare, "limits.pending-share": c.PendingShare,
		"limits.uid-share": c.UIDShare, "limits.session-share": c.SessionShare} {
		if v < 0 || v > 1 {
			bad(flag, "%v must be in (0, 1] (0: default)", v)
		}
	}
	if c.CopyChunkBytes < 4096 {
		bad("copy.chunk-bytes", "%d must be at least 4 KiB", c.CopyChunkBytes)
	}
	if c.CopyStall <= 0 {
		bad("copy.stall", "%v must be positive", c.CopyStall)
	}
	if c.CopyCUDAChunkBytes < 4096 || c.CopyCUDAChunkBytes > 1<<30 {
		bad("copy.cuda-chunk-bytes", "%d outside [4 KiB, 1 GiB]", c.CopyCUDAChunkBytes)
	}
	if c.CopyCUDAInflight < 1 || c.CopyCUDAInflight > 64 {
		bad("copy.cuda-inflight", "%d outside [1, 64]", c.CopyCUDAInflight)
	} else if queued := c.CopyCUDAChunkBytes * uint64(c.CopyCUDAInflight); c.CopyStall > 0 && float64(queued) > minPCIeBytesPerSecond*c.CopyStall.Seconds() {
		// A GPU copies its chunks one after another (one stream per
		// direction), so the last one in flight ends after all the others.
		bad("copy.cuda-inflight", "%d chunks of --copy.cuda-chunk-bytes %d are %d bytes in flight per GPU, more than a PCIe link moves within --copy.stall (%v) at %g GB/s: the last ones would count as stuck", c.CopyCUDAInflight, c.CopyCUDAChunkBytes, queued, c.CopyStall, minPCIeBytesPerSecond/1e9)
	}
	if c.L2 != nil {
		if err := c.L2.validate(); err != nil {
			errs = append(errs, err)
		}
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
