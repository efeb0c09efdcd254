package machine

import (
	"errors"
	"fmt"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// Config configures a Machine. Zero fields take their defaults
// (EnsureDefaults, the Default* constants); Validate reports every bad
// field at once. The sidecar's configuration holds one (sidecar.Config's
// Machine): each of these settings is defined here only.
type Config struct {
	// SlotBytes is the size of one pool slot: a region's page size must
	// not exceed it (DefaultSlotBytes).
	SlotBytes uint64
	// Budget is the bytes an engine instance may have admitted for loading
	// at once (DefaultBudgetBytes).
	Budget int64
	// LeaseTTL is the default lease time-to-live; MaxLeaseTTL bounds what
	// an Acquire may ask for.
	LeaseTTL    time.Duration
	MaxLeaseTTL time.Duration
	// MaxRetainTTL bounds the time a Retain may keep blocks for
	// (DefaultMaxRetainTTL): a longer one is refused (status 7).
	MaxRetainTTL time.Duration
	// CUDAIPC reports whether the copy engine serves GPU memory: CUDA IPC
	// regions and regions shared by file descriptor (the sidecar sets it
	// from its copy engine).
	CUDAIPC bool
	// SnapshotScan bounds the pool slots one Snapshot page scans.
	SnapshotScan int
	// ChunkBytes is the most one copy moves: a Load or Store is split into
	// chunks of this many bytes (at least one page each), which run,
	// complete and can be cancelled on their own.
	ChunkBytes uint64
	// CUDAChunkBytes is ChunkBytes for the regions the CUDA backend
	// serves (those RegionKind reports as gpu.CUDAIPC): its copies are
	// asynchronous DMA, which costs no CPU while it runs and needs large
	// pieces to fill the PCIe link (DefaultCUDAChunkBytes).
	CUDAChunkBytes uint64
	// RegionKind reports the kind of the region a registered handle names
	// (the copy engine's handle, as RegisterDone received it); nil: every
	// region is host memory. It is called under the caller's lock and must
	// not call the Machine. The sidecar sets it.
	RegionKind func(gpu.Handle) gpu.Kind

	// Per engine instance.
	MaxBatches     int // hash batches
	MaxBatchHashes int // digests in one batch
	MaxHashBytes   int // digest bytes of all batches together
	// Per session.
	MaxLeases  int // live queries
	MaxRegions int // registered regions

	// Limits keyed by what a client cannot forge. Each "share" is the part
	// of a total one uid (UIDShare) or one session (SessionShare) may hold.
	//
	// MetaBytes bounds the metadata memory of all clients together (hash
	// batches, queries, regions, copies in flight, sessions, instances,
	// namespaces and change logs).
	MetaBytes int64
	// RingBytes bounds the shared memory of all sessions' rings together
	// (and the replies waiting for room in them).
	RingBytes int64
	// MaxSessions bounds sessions in total; one uid may hold
	// UIDShare of them.
	MaxSessions int
	// MaxNamespaces bounds namespaces (model, layout, salt, width, world).
	MaxNamespaces int
	// PinShare is the part of the pool's slots the leases of one uid may
	// pin (distinct blocks); the rest stays evictable for others.
	PinShare float64
	// RetainShare is the part of the pool's slots the blocks one uid
	// retains (Retain) may take, counted apart from its leases' pins: a
	// retention never takes room a lease needs. At most PinShare.
	RetainShare float64
	// PendingShare is the part of the pool's slots one uid may hold in
	// incomplete blocks (written by some ranks, not yet by all).
	PendingShare float64
	// WorldDivisor bounds a namespace's world size to pool slots /
	// WorldDivisor: one block may never take more than that share.
	WorldDivisor int
	UIDShare     float64
	SessionShare float64

	// PoisonSlot, when set, is called with every slot the pool frees,
	// under the caller's lock (invariants builds fill it with a poison
	// pattern, so a copy that touched a freed slot would be caught).
	PoisonSlot func(slot uint32)
}

// Defaults.
const (
	DefaultSlotBytes      = 256 << 10
	DefaultLeaseTTL       = 30 * time.Second
	DefaultMaxLeaseTTL    = 5 * time.Minute
	DefaultMaxRetainTTL   = time.Hour
	DefaultSnapshotScan   = 1 << 14
	DefaultChunkBytes     = 4 << 20
	DefaultCUDAChunkBytes = 64 << 20
	DefaultMaxBatches     = 1 << 16
	DefaultMaxBatchHashes = 1 << 20
	DefaultMaxHashBytes   = 256 << 20
	DefaultMaxLeases      = 1 << 16
	DefaultMaxRegions     = 64
	DefaultMetaBytes      = 512 << 20
	DefaultRingBytes      = 1 << 30
	DefaultMaxSessions    = 256
	DefaultMaxNamespaces  = 1024
	DefaultPinShare       = 0.5
	DefaultRetainShare    = 0.25
	DefaultPendingShare   = 0.25
	DefaultWorldDivisor   = 16
	DefaultUIDShare       = 0.5
	DefaultSessionShare   = 0.25
)

// EnsureDefaults fills zero fields with their defaults.
func (c *Config) EnsureDefaults() {
	orDefault(&c.SlotBytes, DefaultSlotBytes)
	orDefault(&c.Budget, DefaultBudgetBytes)
	orDefault(&c.LeaseTTL, DefaultLeaseTTL)
	orDefault(&c.MaxLeaseTTL, DefaultMaxLeaseTTL)
	orDefault(&c.MaxRetainTTL, DefaultMaxRetainTTL)
	orDefault(&c.SnapshotScan, DefaultSnapshotScan)
	orDefault(&c.ChunkBytes, DefaultChunkBytes)
	orDefault(&c.CUDAChunkBytes, DefaultCUDAChunkBytes)
	orDefault(&c.MaxBatches, DefaultMaxBatches)
	orDefault(&c.MaxBatchHashes, DefaultMaxBatchHashes)
	orDefault(&c.MaxHashBytes, DefaultMaxHashBytes)
	orDefault(&c.MaxLeases, DefaultMaxLeases)
	orDefault(&c.MaxRegions, DefaultMaxRegions)
	orDefault(&c.MetaBytes, DefaultMetaBytes)
	orDefault(&c.RingBytes, DefaultRingBytes)
	orDefault(&c.MaxSessions, DefaultMaxSessions)
	orDefault(&c.MaxNamespaces, DefaultMaxNamespaces)
	orDefault(&c.PinShare, DefaultPinShare)
	orDefault(&c.RetainShare, DefaultRetainShare)
	orDefault(&c.PendingShare, DefaultPendingShare)
	orDefault(&c.WorldDivisor, DefaultWorldDivisor)
	orDefault(&c.UIDShare, DefaultUIDShare)
	orDefault(&c.SessionShare, DefaultSessionShare)
}

// orDefault sets *p to def when it is zero.
func orDefault[T comparable](p *T, def T) {
	var zero T
	if *p == zero {
		*p = def
	}
}

// A FieldError is one bad field of a Config or an L2Config; Validate joins
// one for each problem.
type FieldError struct {
	Field   string // the field's name in Config or L2Config, e.g. "MaxSessions"
	Problem string // what is wrong with its value, e.g. "0 must be positive"
}

func (e *FieldError) Error() string { return "machine: " + e.Field + ": " + e.Problem }

// problems collects FieldErrors.
type problems []error

func (p *problems) add(field, format string, args ...any) {
	*p = append(*p, &FieldError{Field: field, Problem: fmt.Sprintf(format, args...)})
}

// Validate reports every bad field, each as a *FieldError.
func (c *Config) Validate() error {
	var p problems
	if c.SlotBytes == 0 {
		p.add("SlotBytes", "must be positive")
	}
	if c.Budget <= 0 {
		p.add("Budget", "%d must be positive", c.Budget)
	}
	if c.LeaseTTL <= 0 || c.LeaseTTL > c.MaxLeaseTTL {
		p.add("LeaseTTL", "%v must be positive and at most the longest lease, %v", c.LeaseTTL, c.MaxLeaseTTL)
	}
	if c.MaxRetainTTL < time.Millisecond {
		p.add("MaxRetainTTL", "%v must be at least 1ms", c.MaxRetainTTL)
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"SnapshotScan", c.SnapshotScan}, {"MaxBatches", c.MaxBatches}, {"MaxBatchHashes", c.MaxBatchHashes},
		{"MaxHashBytes", c.MaxHashBytes}, {"MaxLeases", c.MaxLeases}, {"MaxRegions", c.MaxRegions},
		{"MaxSessions", c.MaxSessions}, {"WorldDivisor", c.WorldDivisor}} {
		if f.v < 1 {
			p.add(f.name, "%d must be positive", f.v)
		}
	}
	if c.MaxNamespaces < 1 || c.MaxNamespaces > 65535 {
		p.add("MaxNamespaces", "%d outside [1, 65535]", c.MaxNamespaces)
	}
	if c.MetaBytes < 1<<20 {
		p.add("MetaBytes", "%d must be at least 1 MiB", c.MetaBytes)
	}
	if c.RingBytes < 1<<20 {
		p.add("RingBytes", "%d must be at least 1 MiB", c.RingBytes)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{{"PinShare", c.PinShare}, {"RetainShare", c.RetainShare}, {"PendingShare", c.PendingShare}, {"UIDShare", c.UIDShare},
		{"SessionShare", c.SessionShare}} {
		if !(f.v > 0 && f.v <= 1) {
			p.add(f.name, "%v must be in (0, 1] (0: default)", f.v)
		}
	}
	if c.RetainShare > c.PinShare && c.RetainShare <= 1 && c.PinShare > 0 {
		p.add("RetainShare", "%v is above the pin share, %v (--limits.pin-share): the blocks a uid retains may take "+
			"at most what its leases may pin; lower --limits.retain-share with --limits.pin-share", c.RetainShare, c.PinShare)
	}
	return errors.Join(p...)
}
