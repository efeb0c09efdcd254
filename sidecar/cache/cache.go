package cache

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Limits and defaults.
const (
	// MaxDigestLen is the widest digest a namespace may use.
	MaxDigestLen = 32
	// MaxWorldSize is the largest tensor-parallel world size (ranks 0..63).
	MaxWorldSize = 64
	// MaxCapacity is the largest number of slots a Cache may manage.
	MaxCapacity = 1 << 31
	// NoSlot is the "no slot" value of a slot index.
	NoSlot uint32 = math.MaxUint32

	// DefaultDeltaLogSize is the default number of entries in each
	// namespace's delta ring.
	DefaultDeltaLogSize = 1 << 16
	// DefaultWriteTimeout is the default writer deadline of a pending block.
	DefaultWriteTimeout = 30 * time.Second
	// DefaultInitialLogSize is the number of entries a namespace's change
	// log starts with; it doubles, up to DeltaLogSize, when it would
	// otherwise overwrite entries (and MaxLogBytes allows).
	DefaultInitialLogSize = 256

	maxNamespaces = math.MaxUint16 // IDs 1..65535
)

// Errors. All are sentinels so callers can use errors.Is; most are wrapped
// with the offending value.
var (
	ErrUnknownNamespace = errors.New("cache: unknown namespace")
	ErrUnknownLease     = errors.New("cache: unknown lease")
	ErrStaleTicket      = errors.New("cache: stale or unknown write ticket")
	ErrBadRank          = errors.New("cache: rank out of range")
	ErrBadDigest        = errors.New("cache: digest length does not match namespace width")
	ErrBadTTL           = errors.New("cache: ttl must be positive")
	ErrResync           = errors.New("cache: delta cursor invalid, resync from snapshot")
	ErrTooManyNS        = errors.New("cache: too many namespaces")
	ErrBadNamespaceKey  = errors.New("cache: invalid namespace key")
	ErrTooManyPins      = errors.New("cache: pin count overflow")
	ErrBadConfig        = errors.New("cache: invalid config")
	ErrNamespaceInUse   = errors.New("cache: namespace still holds blocks")
	ErrDoomed           = errors.New("cache: the block's write deadline passed during the copy: the block was dropped")
	ErrUnknownLoad      = errors.New("cache: unknown load")
	ErrBadPriority      = errors.New("cache: retention priority out of range")
)

// NamespaceID identifies a namespace inside one Cache. IDs start at 1; the
// zero value is never a valid namespace.
type NamespaceID uint16

// SessionID identifies an owner (an engine connection / instance).
type SessionID uint64

// NamespaceKey is the identity of a namespace. Two keys that differ in any
// field never share blocks.
type NamespaceKey struct {
	Model       string // model id (including weight lineage)
	Layout      uint64 // KV layout fingerprint (dtype, block tokens, heads, ...)
	TenantSalt  uint64 // tenant isolation salt
	DigestWidth int    // 8, 16 or 32 bytes
	WorldSize   int    // tensor-parallel ranks, 1..64
}

// Config configures a Cache. The zero value of every field except Capacity
// and Epoch means "default".
type Config struct {
	// Capacity is the number of pool slots (0..Capacity-1). Required.
	Capacity int
	// DeltaLogSize is the number of entries of each namespace's delta ring;
	// a power of two. Default DefaultDeltaLogSize.
	DeltaLogSize int
	// WriteTimeout bounds how long a logical block may stay incomplete
	// (some rank reserved or writing). Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Epoch identifies this cache instance in delta cursors. It must be
	// non-zero and must differ between processes (e.g. random 64 bits or
	// the wall clock at boot); the package itself has no randomness.
	Epoch uint64
	// InitialLogSize is the number of entries a namespace's change log
	// starts with (a power of two, at most DeltaLogSize). Default
	// DefaultInitialLogSize.
	InitialLogSize int
	// MaxLogBytes bounds the bytes all namespaces' change logs hold
	// together: a log that would grow past it keeps its size and
	// overwrites its oldest entries (consumers then resync). Zero: no
	// bound beyond DeltaLogSize per namespace.
	MaxLogBytes int64
	// Policy is the eviction policy: PolicyLRU (the zero value),
	// PolicyMQP (mqp.go) or PolicyMQP2 (mqp2.go; `ringside serve`'s
	// default, DefaultPolicy).
	Policy Policy
}

// EnsureDefaults fills zero fields with defaults.
func (c *Config) EnsureDefaults() {
	if c.DeltaLogSize == 0 {
		c.DeltaLogSize = DefaultDeltaLogSize
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = DefaultWriteTimeout
	}
	if c.InitialLogSize == 0 {
		c.InitialLogSize = min(DefaultInitialLogSize, c.DeltaLogSize)
	}
}

// Validate reports every problem of the config.
func (c *Config) Validate() error {
	var errs []error
	if c.Capacity <= 0 || c.Capacity > MaxCapacity {
		errs = append(errs, fmt.Errorf("%w: capacity %d not in 1..%d", ErrBadConfig, c.Capacity, MaxCapacity))
	}
	if c.DeltaLogSize <= 0 || c.DeltaLogSize&(c.DeltaLogSize-1) != 0 {
		errs = append(errs, fmt.Errorf("%w: delta log size %d is not a positive power of two", ErrBadConfig, c.DeltaLogSize))
	}
	if c.WriteTimeout < 0 {
		errs = append(errs, fmt.Errorf("%w: negative write timeout", ErrBadConfig))
	}
	if c.Epoch == 0 {
		errs = append(errs, fmt.Errorf("%w: epoch must be non-zero", ErrBadConfig))
	}
	if !c.Policy.Valid() {
		errs = append(errs, fmt.Errorf("%w: unknown eviction policy %d", ErrBadConfig, uint8(c.Policy)))
	}
	if c.InitialLogSize <= 0 || c.InitialLogSize&(c.InitialLogSize-1) != 0 || c.InitialLogSize > c.DeltaLogSize {
		errs = append(errs, fmt.Errorf("%w: initial log size %d is not a positive power of two at most the delta log size %d", ErrBadConfig, c.InitialLogSize, c.DeltaLogSize))
	}
	if c.MaxLogBytes < 0 {
		errs = append(errs, fmt.Errorf("%w: negative log byte bound", ErrBadConfig))
	}
	return errors.Join(errs...)
}

// Slot states (low 2 bits of meta; the high 6 bits hold the rank).
const (
	stFree uint8 = iota
	stReserved
	stWriting
	stStored
)

type namespace struct {
	key     NamespaceKey
	width   int
	world   int
	blocks  int // present logical blocks
	pending int // incomplete logical blocks
	doomed  int // dropped blocks whose slots wait for a copy in flight (not indexed)
	log     deltaLog
	ev      *nsEvents // the event log (meta.go), from the first description on
	node    *nodeSet  // the node tier's described blocks (nodeset.go), from the first on
	guard   nsGuard   // MQP's scan guard (mqp.go)
}

// Cache is the in-memory state machine of the KV block pool. It is NOT
// safe for concurrent use: the sidecar serialises all calls with a mutex.
type Cache struct {
	cfg      Config
	capacity uint32
	sentinel uint32 // index of the LRU sentinel in prev/next (== capacity); the retained lists' follow it

	// Per-slot struct of arrays (see doc.go for the byte budget).
	digest [][MaxDigestLen]byte
	prev   []uint32 // len capacity+1+RetainPriorities (+mqpExtraNodes under MQP)
	next   []uint32 // len capacity+1+RetainPriorities (+mqpExtraNodes under MQP)
	ring   []uint32
	aux    []uint32
	nsOf   []uint16
	meta   []uint8
	done   []uint8 // committed ranks (head); doomedBit marks a dropped block

	// Open-addressing index of logical blocks: entries are head slot+1,
	// 0 means empty.
	table   []uint32
	tags    []uint8 // hash tag per table entry
	entries int

	freeHead  uint32
	nFree     int
	nReserved int
	nWriting  int
	nStored   int
	lruLen    int                   // present, unpinned, unretained logical blocks
	retLen    [RetainPriorities]int // present, unpinned, retained blocks per priority
	evictable int                   // slots of present, unpinned logical blocks
	pinned    int                   // present, pinned logical blocks

	nsList      []*namespace // nil for removed namespaces (their ids are reused)
	nsFree      []NamespaceID
	nsLive      int
	nsByKey     map[NamespaceKey]NamespaceID
	incarnation uint64 // namespaces ever added: each log's seq starts at incarnation<<logSeqShift
	logBytes    int64  // bytes held by all change logs
	nodeBytes   int64  // the node sets' descriptions (DescCost each; nodeset.go)
	doomed      int    // doomed blocks in all namespaces

	// Loads in flight (BeginLoad .. EndLoad): each holds a pin on its
	// blocks, so that a lease released or expired during the copy never
	// frees a slot the copy still reads.
	loads    map[uint64][]uint32
	nextLoad uint64
	// Pins of loads (PinBlock's) that put their block back at the LRU's
	// tail when they end.
	tailLoads map[uint64]struct{}
	// marks has one bit per head slot: the shared tier holds the block
	// (Mark); cleared when the slot is freed. Allocated on first use.
	marks []uint64

	// Charges of incomplete blocks (BeginStoreCharged): the key each
	// pending head was charged to, and the slots charged per key.
	pendingKey   map[uint32]uint32
	pendingByKey map[uint32]int
	// Pins charged per key (AcquireCharged): per key, the leases' pins of
	// each block, and the distinct slots they hold.
	pinKey   map[uint32]map[uint32]uint32
	pinByKey map[uint32]int
	// Retention (retain.go) of present heads: one record each, charged to
	// its key apart from the pins: retainByKey counts the slots of the
	// blocks each key retains.
	retains     map[uint32]*retainRec
	retainByKey map[uint32]int

	writers    []writerRec
	writerFree int32
	liveWriter int

	leases    []leaseRec
	leaseFree int32
	leaseByID map[uint64]int32

	owners    map[SessionID]*owner
	ownerPool []*owner
	timers    []timer
	timerSeq  uint64

	nextLeaseID  uint64
	nextWriterID uint64

	scratch []uint32
	st      counters
	sizing  sizing // what an unbounded pool would have hit (sizing.go)
	onFree  func(slot uint32)
	ev      eventsState // block descriptions for KV events (meta.go)
	mqp     *mqpState   // PolicyMQP's state (mqp.go); nil under LRU
}

// OnFree sets a function called with every slot the cache frees, as it
// frees it (nil: none). The sidecar's invariants builds poison freed
// slots this way.
func (c *Cache) OnFree(f func(slot uint32)) { c.onFree = f }

type counters struct {
	lookups, lookupBlocks, hitBlocks   uint64
	acquires, acquiredBlocks           uint64
	stores, aborts, noSpace, overQuota uint64
	evictions, cleared                 uint64
	reapedLeases, reapedWrites, expiry uint64
	evictedUnmarked                    uint64
	retains, retainEnds, expiredRetain uint64
}

// New returns an empty Cache.
func New(cfg Config) (*Cache, error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	n := uint32(cfg.Capacity)
	nodes := n + 1 + RetainPriorities
	if cfg.Policy.multiQueue() {
		nodes += mqpExtraNodes
	}
	c := &Cache{
		cfg:          cfg,
		capacity:     n,
		sentinel:     n,
		digest:       make([][MaxDigestLen]byte, n),
		prev:         make([]uint32, nodes),
		next:         make([]uint32, nodes),
		ring:         make([]uint32, n),
		aux:          make([]uint32, n),
		nsOf:         make([]uint16, n),
		meta:         make([]uint8, n),
		done:         make([]uint8, n),
		table:        make([]uint32, tableSize(cfg.Capacity)),
		tags:         make([]uint8, tableSize(cfg.Capacity)),
		nsByKey:      make(map[NamespaceKey]NamespaceID),
		leaseByID:    make(map[uint64]int32),
		owners:       make(map[SessionID]*owner),
		loads:        make(map[uint64][]uint32),
		pendingKey:   make(map[uint32]uint32),
		pendingByKey: make(map[uint32]int),
		pinKey:       make(map[uint32]map[uint32]uint32),
		pinByKey:     make(map[uint32]int),
		retains:      make(map[uint32]*retainRec),
		retainByKey:  make(map[uint32]int),
		writerFree:   -1,
		leaseFree:    -1,
		sizing:       newSizing(),
	}
	// Free list threaded through next, in ascending slot order.
	for i := uint32(0); i < n; i++ {
		c.next[i] = i + 1
		c.prev[i] = NoSlot
		c.ring[i] = NoSlot
	}
	c.next[n-1] = NoSlot
	c.freeHead = 0
	c.nFree = int(n)
	for s := n; s < n+1+RetainPriorities; s++ {
		c.prev[s], c.next[s] = s, s // empty LRU and retained lists
	}
	if cfg.Policy.multiQueue() {
		m := newMQP(n, cfg.Policy)
		m.qSent[0] = n
		for q := uint32(1); q < mqpQueues; q++ {
			s := n + RetainPriorities + q
			m.qSent[q] = s
			c.prev[s], c.next[s] = s, s
		}
		m.mkBase = n + RetainPriorities + mqpQueues
		for s := m.mkBase; s < nodes; s++ {
			c.prev[s], c.next[s] = NoSlot, NoSlot
		}
		c.mqp = m
	}
	return c, nil
}

// tableSize keeps the index load factor at or below 2/3 even when every
// slot is its own logical block (world size 1).
func tableSize(capacity int) int { return capacity + capacity/2 + 8 }

// Capacity returns the number of slots.
func (c *Cache) Capacity() int { return int(c.capacity) }

// AddNamespace returns the namespace for key, creating it on first use.
// It is idempotent: the same key always yields the same ID.
func (c *Cache) AddNamespace(key NamespaceKey) (NamespaceID, error) {
	if id, ok := c.nsByKey[key]; ok {
		return id, nil
	}
	switch key.DigestWidth {
	case 8, 16, 32:
	default:
		return 0, fmt.Errorf("%w: digest width %d not 8|16|32", ErrBadNamespaceKey, key.DigestWidth)
	}
	if key.WorldSize < 1 || key.WorldSize > MaxWorldSize {
		return 0, fmt.Errorf("%w: world size %d not in 1..%d", ErrBadNamespaceKey, key.WorldSize, MaxWorldSize)
	}
	if key.WorldSize > int(c.capacity) {
		return 0, fmt.Errorf("%w: world size %d exceeds capacity %d", ErrBadNamespaceKey, key.WorldSize, c.capacity)
	}
	if c.nsLive >= maxNamespaces {
		return 0, ErrTooManyNS
	}
	ns := &namespace{key: key, width: key.DigestWidth, world: key.WorldSize, guard: nsGuard{hr: -1}}
	c.incarnation++
	ns.log.init(c.cfg.InitialLogSize, c.cfg.Epoch, c.incarnation<<logSeqShift)
	c.logBytes += ns.log.bytes()
	var id NamespaceID
	if k := len(c.nsFree); k > 0 {
		id = c.nsFree[k-1]
		c.nsFree = c.nsFree[:k-1]
		c.nsList[id-1] = ns
	} else {
		c.nsList = append(c.nsList, ns)
		id = NamespaceID(len(c.nsList))
	}
	c.nsLive++
	c.nsByKey[key] = id
	return id, nil
}

// logSeqShift places each namespace incarnation's change-log sequence
// numbers in a range of its own (seq = incarnation<<40 + n), so that a
// cursor taken from a removed namespace never validates against a later
// one that reuses its id or its key.
const logSeqShift = 40

// RemoveNamespace forgets a namespace that holds nothing: no present,
// incomplete or doomed block (a block pinned by a lease or a load is
// present). Its id may be reused by a later AddNamespace; its change log
// is dropped, and cursors into it never validate again. A namespace that
// still holds blocks gives ErrNamespaceInUse (Clear drops its unpinned
// blocks first).
func (c *Cache) RemoveNamespace(id NamespaceID) error {
	n, err := c.ns(id)
	if err != nil {
		return err
	}
	if n.blocks != 0 || n.pending != 0 || n.doomed != 0 {
		return fmt.Errorf("%w: namespace %d: %d present, %d incomplete, %d doomed", ErrNamespaceInUse, id, n.blocks, n.pending, n.doomed)
	}
	c.logBytes -= n.log.bytes()
	c.dropNamespaceDescs(id, n)
	c.dropNodeSet(n)
	delete(c.nsByKey, n.key)
	c.nsList[id-1] = nil
	c.nsFree = append(c.nsFree, id)
	c.nsLive--
	return nil
}

// Namespaces returns the number of live namespaces.
func (c *Cache) Namespaces() int { return c.nsLive }

// NamespaceUsage reports what ns holds: present, incomplete and doomed
// blocks.
func (c *Cache) NamespaceUsage(id NamespaceID) (blocks, pending, doomed int, err error) {
	n, err := c.ns(id)
	if err != nil {
		return 0, 0, 0, err
	}
	return n.blocks, n.pending, n.doomed, nil
}

// Namespace returns the key of ns.
func (c *Cache) Namespace(ns NamespaceID) (NamespaceKey, error) {
	n, err := c.ns(ns)
	if err != nil {
		return NamespaceKey{}, err
	}
	return n.key, nil
}

func (c *Cache) ns(id NamespaceID) (*namespace, error) {
	if id == 0 || int(id) > len(c.nsList) || c.nsList[id-1] == nil {
		return nil, fmt.Errorf("%w: %d", ErrUnknownNamespace, id)
	}
	return c.nsList[id-1], nil
}

// Len returns the number of present (fully stored, all ranks) logical
// blocks of ns; 0 for an unknown namespace.
func (c *Cache) Len(ns NamespaceID) int {
	n, err := c.ns(ns)
	if err != nil {
		return 0
	}
	return n.blocks
}

// MemoryBytes returns the bytes of the per-slot arrays and the index: the
// memory that scales with capacity. Side tables (leases, writers, timers)
// scale with in-flight work and delta logs with namespaces; see LogBytes.
func (c *Cache) MemoryBytes() int64 {
	b := int64(len(c.digest)) * MaxDigestLen
	b += int64(len(c.prev)+len(c.next)+len(c.ring)+len(c.aux)) * 4
	b += int64(len(c.nsOf)) * 2
	b += int64(len(c.meta) + len(c.done))
	b += int64(len(c.table))*4 + int64(len(c.tags))
	if c.mqp != nil {
		b += c.mqp.bytes()
	}
	return b
}

// BytesPerBlock returns MemoryBytes divided by capacity.
func (c *Cache) BytesPerBlock() float64 { return float64(c.MemoryBytes()) / float64(c.capacity) }

// LogBytes returns the bytes held by all namespaces' delta rings.
func (c *Cache) LogBytes() int64 { return c.logBytes }

// Stats is a point-in-time accounting snapshot. Slot counts always satisfy
// Free+Used == Capacity and Used == Reserved+Writing+Stored.
type Stats struct {
	Capacity int
	Free     int // free slots
	Used     int // Reserved + Writing + Stored slots
	Reserved int // slots of incomplete blocks whose rank has not begun writing
	Writing  int // slots being written (invisible, not evictable)
	Stored   int // committed slots (of present or still-incomplete blocks)

	Blocks        int // present logical blocks
	PendingBlocks int // incomplete logical blocks
	DoomedBlocks  int // dropped blocks whose slots wait for a copy in flight
	Loads         int // loads in flight (BeginLoad without EndLoad)
	PinnedBlocks  int // present blocks with at least one lease
	Evictable     int // slots that eviction could free now
	Leases        int // live leases
	Writers       int // live write tickets
	Namespaces    int

	Lookups        uint64 // Lookup calls
	LookupBlocks   uint64 // digests asked by Lookup
	HitBlocks      uint64 // leading blocks found by Lookup
	Acquires       uint64 // Acquire calls that pinned something
	AcquiredBlocks uint64
	Stores         uint64 // logical blocks that became present
	Aborts         uint64 // AbortStore calls (explicit or via ReleaseOwner)
	NoSpace        uint64 // BeginStore answered NoSpace
	OverQuota      uint64 // BeginStoreCharged answered OverQuota
	Evictions      uint64 // logical blocks evicted for space
	// EvictedUnmarked counts the evicted blocks that were not marked as
	// held by the shared tier (Mark): with a tier, blocks it lost.
	EvictedUnmarked uint64
	Cleared         uint64 // logical blocks dropped by Clear
	ExpiredLeases   uint64 // leases reclaimed by Reap
	ExpiredWrites   uint64 // write tickets reclaimed by Reap
	ExpiredBlocks   uint64 // incomplete logical blocks reclaimed by Reap

	RetainedBlocks int    // present blocks with a retention (Retain)
	Retains        uint64 // retentions set or renewed
	RetainEnds     uint64 // retentions ended by EndRetain
	ExpiredRetains uint64 // retentions ended by Reap
}

// Stats returns the current accounting.
func (c *Cache) Stats() Stats {
	pending := 0
	for _, n := range c.nsList {
		if n != nil {
			pending += n.pending
		}
	}
	used := c.nReserved + c.nWriting + c.nStored
	return Stats{
		Capacity: int(c.capacity), Free: c.nFree, Used: used,
		Reserved: c.nReserved, Writing: c.nWriting, Stored: c.nStored,
		Blocks: c.lruLen + c.retListed() + c.pinned, PendingBlocks: pending, DoomedBlocks: c.doomed, Loads: len(c.loads),
		PinnedBlocks: c.pinned,
		Evictable:    c.evictable, Leases: len(c.leaseByID), Writers: c.liveWriter,
		Namespaces: c.nsLive,
		Lookups:    c.st.lookups, LookupBlocks: c.st.lookupBlocks, HitBlocks: c.st.hitBlocks,
		Acquires: c.st.acquires, AcquiredBlocks: c.st.acquiredBlocks,
		Stores: c.st.stores, Aborts: c.st.aborts, NoSpace: c.st.noSpace, OverQuota: c.st.overQuota,
		Evictions: c.st.evictions, EvictedUnmarked: c.st.evictedUnmarked, Cleared: c.st.cleared,
		ExpiredLeases: c.st.reapedLeases, ExpiredWrites: c.st.reapedWrites, ExpiredBlocks: c.st.expiry,
		RetainedBlocks: len(c.retains), Retains: c.st.retains, RetainEnds: c.st.retainEnds, ExpiredRetains: c.st.expiredRetain,
	}
}

// --- per-slot helpers ---

func (c *Cache) state(s uint32) uint8 { return c.meta[s] & 3 }
func (c *Cache) rank(s uint32) int    { return int(c.meta[s] >> 2) }
func (c *Cache) setState(s uint32, st uint8) {
	c.meta[s] = c.meta[s]&^3 | st
}

// headOf returns the head (rank 0) slot of the logical block owning s.
func (c *Cache) headOf(s uint32) uint32 {
	if c.rank(s) == 0 {
		return s
	}
	return c.prev[s]
}

// member returns the slot of rank r of the logical block headed by head.
func (c *Cache) member(head uint32, r int) uint32 {
	s := head
	for ; r > 0; r-- {
		s = c.ring[s]
	}
	return s
}

func (c *Cache) worldOf(head uint32) int { return c.nsList[c.nsOf[head]-1].world }

func (c *Cache) present(head uint32) bool {
	return c.state(head) == stStored && int(c.done[head]) == c.worldOf(head)
}

// doomedBit in done[head] marks a block dropped (reaped) while a rank's
// copy was still writing: it left the index and its deadline, its slots
// stay allocated until the last such copy ends, and it never becomes
// present. done counts at most MaxWorldSize (64) ranks, so the bit is free.
// leading() also sets it, for the length of one call, on the present heads
// it has collected (so that a repeated digest ends the scan), and clears
// it before returning.
const doomedBit = 0x80

func (c *Cache) isDoomed(head uint32) bool { return c.done[head]&doomedBit != 0 }

// --- LRU (doubly linked through prev/next, sentinel at index capacity;
// the retained lists' sentinels follow, retain.go) ---

func (c *Cache) retListed() int {
	k := 0
	for _, v := range c.retLen {
		k += v
	}
	return k
}

// relist puts an unpinned present head back in its list (the LRU, or its
// retention priority's): at the front, or with tail at the back.
func (c *Cache) relist(s uint32, tail bool) {
	if tail {
		c.coldest(s)
		c.listPushBack(c.listOf(s), s)
	} else {
		c.listPushFront(c.listOf(s), s)
	}
}

// coldest makes an unlisted, unretained head's next listing go to its
// policy's coldest list (under MQP, queue 0); the caller pushes it at
// the back.
func (c *Cache) coldest(s uint32) {
	if c.mqp != nil && (c.retains[s] == nil || c.mqp.r2 != nil) {
		c.mqp.pol[s] &= 15
	}
}

// unlist takes an unpinned present head out of its list.
func (c *Cache) unlist(s uint32) { c.listRemove(c.listOf(s), s) }

// touch marks a present block recently used in its list (no-op for pinned
// blocks, which are outside every list until their last lease is
// released).
func (c *Cache) touch(head uint32) {
	if c.aux[head] != 0 {
		return
	}
	sent := c.listOf(head)
	if c.next[sent] == head {
		return
	}
	c.listRemove(sent, head)
	c.listPushFront(sent, head)
}
