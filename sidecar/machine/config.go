package machine

import (
	"errors"
	"fmt"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// Config configures a Machine. Zero fields take their defaults
// (EnsureDefaults); Validate reports every bad field at once.
type Config struct {
	// SlotBytes is the size of one pool slot: a region's page size must
	// not exceed it.
	SlotBytes uint64
	// Budget is the bytes an engine instance may have admitted for loading
	// at once (DefaultBudgetBytes).
	Budget int64
	// LeaseTTL is the default lease time-to-live; MaxLeaseTTL bounds what
	// an Acquire may ask for.
	LeaseTTL    time.Duration
	MaxLeaseTTL time.Duration
	// CUDAIPC reports whether the copy engine serves CUDA IPC regions.
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
	// not call the Machine.
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
	DefaultLeaseTTL       = 30 * time.Second
	DefaultMaxLeaseTTL    = 5 * time.Minute
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
	DefaultPendingShare   = 0.25
	DefaultWorldDivisor   = 16
	DefaultUIDShare       = 0.5
	DefaultSessionShare   = 0.25
)

// EnsureDefaults fills zero fields with their defaults.
func (c *Config) EnsureDefaults() {
	set := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	setf := func(p *float64, v float64) {
		if *p == 0 {
			*p = v
		}
	}
	if c.SlotBytes == 0 {
		c.SlotBytes = 256 << 10
	}
	if c.Budget == 0 {
		c.Budget = DefaultBudgetBytes
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.MaxLeaseTTL == 0 {
		c.MaxLeaseTTL = DefaultMaxLeaseTTL
	}
	set(&c.SnapshotScan, DefaultSnapshotScan)
	if c.ChunkBytes == 0 {
		c.ChunkBytes = DefaultChunkBytes
	}
	if c.CUDAChunkBytes == 0 {
		c.CUDAChunkBytes = DefaultCUDAChunkBytes
	}
	set(&c.MaxBatches, DefaultMaxBatches)
	set(&c.MaxBatchHashes, DefaultMaxBatchHashes)
	set(&c.MaxHashBytes, DefaultMaxHashBytes)
	set(&c.MaxLeases, DefaultMaxLeases)
	set(&c.MaxRegions, DefaultMaxRegions)
	if c.MetaBytes == 0 {
		c.MetaBytes = DefaultMetaBytes
	}
	if c.RingBytes == 0 {
		c.RingBytes = DefaultRingBytes
	}
	set(&c.MaxSessions, DefaultMaxSessions)
	set(&c.MaxNamespaces, DefaultMaxNamespaces)
	setf(&c.PinShare, DefaultPinShare)
	setf(&c.PendingShare, DefaultPendingShare)
	set(&c.WorldDivisor, DefaultWorldDivisor)
	setf(&c.UIDShare, DefaultUIDShare)
	setf(&c.SessionShare, DefaultSessionShare)
}

// Validate reports every bad field.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("machine: "+format, args...)) }
	if c.SlotBytes == 0 {
		bad("slot bytes must be positive")
	}
	if c.Budget <= 0 {
		bad("budget %d must be positive", c.Budget)
	}
	if c.LeaseTTL <= 0 || c.LeaseTTL > c.MaxLeaseTTL {
		bad("lease ttl %v must be positive and at most the max ttl %v", c.LeaseTTL, c.MaxLeaseTTL)
	}
	for name, v := range map[string]int{"snapshot scan": c.SnapshotScan, "max batches": c.MaxBatches,
		"max batch hashes": c.MaxBatchHashes, "max hash bytes": c.MaxHashBytes, "max leases": c.MaxLeases,
		"max regions": c.MaxRegions, "max sessions": c.MaxSessions, "max namespaces": c.MaxNamespaces,
		"world divisor": c.WorldDivisor} {
		if v < 1 {
			bad("%s %d must be positive", name, v)
		}
	}
	if c.MaxNamespaces > 65535 {
		bad("max namespaces %d over 65535", c.MaxNamespaces)
	}
	if c.MetaBytes < 1<<20 || c.RingBytes < 1<<20 {
		bad("metadata bytes %d and ring bytes %d must be at least 1 MiB", c.MetaBytes, c.RingBytes)
	}
	for name, v := range map[string]float64{"pin share": c.PinShare, "pending share": c.PendingShare,
		"uid share": c.UIDShare, "session share": c.SessionShare} {
		if !(v > 0 && v <= 1) {
			bad("%s %v must be in (0, 1]", name, v)
		}
	}
	return errors.Join(errs...)
}
