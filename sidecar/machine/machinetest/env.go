// Package machinetest runs a sidecar/machine.Machine with everything the
// sidecar does around it emulated in memory, as raft's rafttest runs raft
// nodes: the pool, the engine memory regions are registered over, the copy
// engine (a copy moves the bytes, and every copy is checked against its
// region and the pool), registrations, and the shared tier (Tier: a map of
// values keyed as sidecar/l2 keys them, which several Envs may share, as
// the nodes of a fleet share a Redis).
//
// Each call's work is carried out at once, or held for the test to end in
// the order and with the outcome it chooses: copies (HoldCopies),
// registrations (HoldRegisters), and the tier's lookups, fetches and
// writes (HoldTier). The scenario driver of sidecar/machine
// (testdata/scenarios) and its fuzzers drive an Env; nothing in the
// product imports this package.
//
// A copy or a registration that no correct Machine asks for (a page
// outside its region, a pool offset outside the pool or off a slot, a
// reply to a session that ended, an invariant broken after a call) fails
// the test.
package machinetest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/invariants"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// Config is an Env's Machine: its configuration, its cache's, and the
// shared tier's.
type Config struct {
	// Machine configures the Machine; PoisonSlot is the Env's (a freed
	// slot is filled with invariants.Poison, whatever the build).
	Machine machine.Config
	Cache   cache.Config
	// L2, when Enabled, turns the shared tier on.
	L2 machine.L2Config
	// Tier holds the tier's values; nil: a Tier of the Env's own. Envs
	// given one Tier share it.
	Tier *Tier
	// Host is the engines' memory; nil: a Host of the Env's own. Envs
	// given one Host share it.
	Host *Host
}

// Env is one Machine and what surrounds it. Its fields are the test's to
// read; the Hold switches are the test's to set at any time.
type Env struct {
	T    testing.TB
	M    *machine.Machine
	Tier *Tier
	// Now is the Machine's clock (nanoseconds); every call moves it on by
	// Step (default a microsecond, so that nothing expires unless the
	// test ticks).
	Now  int64
	Step time.Duration

	// Work the Machine asked for that the Env holds, oldest first.
	Copies    []machine.Copy
	Registers []machine.Register
	Lookups   []machine.L2Lookup
	Fetches   []machine.L2Fetch
	Writes    []machine.L2Write

	// HoldCopies, HoldRegisters and HoldTier keep the work the Machine
	// asks for from now on in Copies, Registers and Lookups, Fetches,
	// Writes, for the test to end (EndCopy, ...); off, it is carried out
	// before the call returns.
	HoldCopies, HoldRegisters, HoldTier bool

	// Reply, when set, receives every reply, in order (its payload is
	// the Env's copy).
	Reply func(machine.Reply)

	pool      []byte
	slotBytes uint64
	chunk     uint64 // the most one copy of a host region may move
	cudaChunk uint64
	regionKnd func(gpu.Handle) gpu.Kind

	host     *Host
	regions  map[gpu.Handle]gpu.Region
	dying    map[gpu.Handle]int // unregistered handles: held copies still on them
	nextH    gpu.Handle
	pids     map[int]bool // processes that attached
	live     map[machine.SessionID]bool
	depth    int  // calls of the Machine in progress (completions inside completions)
	settling bool // deliverTier is running
}

// New returns an Env whose Machine is configured by cfg (zero fields take
// the Machine's and the cache's defaults). The pool starts poisoned.
func New(t testing.TB, cfg Config) *Env {
	t.Helper()
	mc := cfg.Machine
	mc.EnsureDefaults()
	cc := cfg.Cache
	if cc.Capacity == 0 {
		t.Fatal("machinetest: Cache.Capacity (the pool's slots) is required")
	}
	e := &Env{T: t, Step: time.Microsecond, Tier: cfg.Tier, slotBytes: mc.SlotBytes, chunk: mc.ChunkBytes,
		cudaChunk: mc.CUDAChunkBytes, regionKnd: mc.RegionKind, host: cfg.Host,
		regions: map[gpu.Handle]gpu.Region{}, dying: map[gpu.Handle]int{}, pids: map[int]bool{}, live: map[machine.SessionID]bool{}}
	if e.Tier == nil {
		e.Tier = NewTier()
	}
	if e.host == nil {
		e.host = NewHost()
	}
	e.pool = make([]byte, uint64(cc.Capacity)*mc.SlotBytes)
	poison(e.pool)
	mc.PoisonSlot = func(slot uint32) {
		poison(e.pool[uint64(slot)*e.slotBytes : uint64(slot+1)*e.slotBytes])
	}
	c, err := cache.New(cc)
	if err != nil {
		t.Fatalf("machinetest: cache: %v", err)
	}
	if e.M, err = machine.New(mc, c); err != nil {
		t.Fatalf("machinetest: machine: %v", err)
	}
	if cfg.L2.Enabled {
		e.M.EnableL2(cfg.L2)
	}
	return e
}

func poison(b []byte) {
	for i := range b {
		b[i] = invariants.Poison
	}
}

// Pool is the pool's bytes.
func (e *Env) Pool() []byte { return e.pool }

// Memory allocates n zeroed bytes of engine memory in the Env's Host.
func (e *Env) Memory(n int) (b []byte, base uint64) { return e.host.Alloc(n) }

// Host is the engines' memory, emulated: buffers at addresses regions are
// registered over. A copy reaches only memory its Host allocated.
type Host struct {
	mem  map[uint64][]byte // by base address
	next uint64
}

// NewHost returns an empty Host.
func NewHost() *Host { return &Host{mem: map[uint64][]byte{}, next: 1 << 32} }

// Alloc allocates n zeroed bytes at an emulated address (base), a gap
// after them.
func (h *Host) Alloc(n int) (b []byte, base uint64) {
	b, base = make([]byte, n), h.next
	h.mem[base] = b
	h.next += (uint64(n) + 1<<20) &^ (1<<20 - 1)
	return b, base
}

// Region is the region a handle names (zero if none).
func (e *Env) Region(h gpu.Handle) gpu.Region { return e.regions[h] }

func (e *Env) tick() int64 {
	e.Now += int64(e.Step)
	return e.Now
}

// Attach attaches a session (a.PID is the process regions must belong to).
func (e *Env) Attach(a machine.AttachArgs) (machine.Attached, *schema.Error) {
	att, err := e.M.Attach(e.tick(), a)
	if err == nil {
		e.pids[a.PID] = true
		e.live[att.Session] = true
	}
	e.check()
	return att, err
}

// Live reports whether a session is attached and has not ended.
func (e *Env) Live(id machine.SessionID) bool { return e.live[id] }

// Handle hands the Machine one request record and carries out what it
// asks for. end reports that the session asked to end (a Detach): the Env
// has then detached it, as the sidecar's session loop does.
func (e *Env) Handle(id machine.SessionID, typ uint16, seq uint64, payload []byte) (end bool) {
	end = e.call(func(now int64, out *machine.Output) { e.M.Handle(now, id, typ, seq, payload, out) })
	if end {
		e.Detach(id)
	}
	return end
}

// Detach ends a session (its socket closed, or its Detach was answered).
func (e *Env) Detach(id machine.SessionID) {
	delete(e.live, id)
	e.call(func(now int64, out *machine.Output) { e.M.Detach(now, id, out) })
}

// Tick moves the clock on by d and lets the Machine's deadlines pass.
func (e *Env) Tick(d time.Duration) {
	e.Now += int64(d)
	e.call(func(now int64, out *machine.Output) { e.M.Tick(now, out) })
}

// call makes one call of the Machine and carries out its Output.
func (e *Env) call(f func(now int64, out *machine.Output)) (end bool) {
	out := new(machine.Output)
	e.depth++
	f(e.tick(), out)
	end = e.apply(out)
	e.depth--
	if e.depth == 0 && !e.settling {
		e.deliverTier()
	}
	return end
}

// apply carries out an Output in the order the sidecar does: replies,
// copies, unregistrations, registrations; the tier's work is queued (and
// delivered by the outermost call unless held).
func (e *Env) apply(out *machine.Output) (end bool) {
	e.check()
	for _, r := range out.Replies {
		if !e.live[r.Session] {
			e.T.Fatalf("machinetest: a reply (type %#x, seq %d) to session %d, which is not attached", r.Type, r.Seq, r.Session)
		}
		if len(r.Payload) < 4 {
			e.T.Fatalf("machinetest: a reply of %d bytes has no status", len(r.Payload))
		}
		if st := schema.Status(binary.LittleEndian.Uint32(r.Payload)); st > schema.ErrCodeMismatch {
			e.T.Fatalf("machinetest: a reply with unknown status %d", st)
		}
		r.Payload = append([]byte(nil), r.Payload...)
		if e.Reply != nil {
			e.Reply(r)
		}
	}
	end = out.End
	// The Output is reused by nothing, but completions below append to
	// the Env's lists: take everything out first.
	copies := append([]machine.Copy(nil), out.Copies...)
	unreg := append([]gpu.Handle(nil), out.Unregister...)
	regs := append([]machine.Register(nil), out.Registers...)
	for _, f := range out.L2Fetches {
		for _, b := range f.Blocks {
			if len(b.PoolOffsets) != f.NS.World {
				e.T.Fatalf("machinetest: fetch %d has a block of %d slots, world %d", f.ID, len(b.PoolOffsets), f.NS.World)
			}
		}
	}
	e.Lookups = append(e.Lookups, out.L2Lookups...)
	e.Fetches = append(e.Fetches, out.L2Fetches...)
	e.Writes = append(e.Writes, out.L2Writes...)
	for _, c := range copies {
		if _, ok := e.dying[c.Region]; ok {
			e.T.Fatalf("machinetest: copy %d on handle %d, which the machine unregistered", c.ID, c.Region)
		}
		if e.HoldCopies {
			e.Copies = append(e.Copies, c)
			continue
		}
		e.endCopy(c, nil, false)
	}
	for _, h := range unreg {
		_, ok := e.regions[h]
		if _, dying := e.dying[h]; !ok || dying {
			e.T.Fatalf("machinetest: the machine unregistered handle %d, which is not registered", h)
		}
		// The engine's Unregister waits for the copies on the handle.
		n := 0
		for _, c := range e.Copies {
			if c.Region == h {
				n++
			}
		}
		if n == 0 {
			delete(e.regions, h)
		} else {
			e.dying[h] = n
		}
	}
	for _, rg := range regs {
		if e.HoldRegisters {
			e.Registers = append(e.Registers, rg)
			continue
		}
		e.endRegister(rg, nil)
	}
	return end
}

func (e *Env) check() {
	e.T.Helper()
	if err := e.M.CheckInvariants(); err != nil {
		e.T.Fatalf("machinetest: %v", err)
	}
}

// --- copies ---

// EndCopy ends held copy i: with fail nil the bytes are copied and the
// copy succeeds (exited: its process was found dead after it); otherwise
// it fails with that error, having copied nothing.
func (e *Env) EndCopy(i int, fail error, exited bool) {
	c := e.Copies[i]
	e.Copies = append(e.Copies[:i:i], e.Copies[i+1:]...)
	e.endCopy(c, fail, exited)
}

func (e *Env) endCopy(c machine.Copy, fail error, exited bool) {
	res := machine.CopyResult{Err: fail, Exited: exited}
	if fail == nil {
		res.Bytes, res.Err = e.copyBytes(c)
	}
	if n, ok := e.dying[c.Region]; ok {
		if n == 1 {
			delete(e.dying, c.Region)
			delete(e.regions, c.Region)
		} else {
			e.dying[c.Region] = n - 1
		}
	}
	e.call(func(now int64, out *machine.Output) { e.M.CopyDone(now, c.ID, res, out) })
}

// copyBytes is the copy engine: every byte of every page, between the
// region's memory and the pool. Memory the Env did not allocate fails the
// copy (the engine's process_vm_readv would); a copy outside its region,
// the pool or a slot is a bug of the Machine and fails the test.
func (e *Env) copyBytes(c machine.Copy) (int64, error) {
	r, ok := e.regions[c.Region]
	if !ok {
		e.T.Fatalf("machinetest: copy %d on handle %d, which is not registered", c.ID, c.Region)
	}
	if c.PageBytes != r.PageSize || c.PageBytes > e.slotBytes || len(c.Pages) != len(c.PoolOffsets) || len(c.Pages) == 0 {
		e.T.Fatalf("machinetest: copy %d: %d pages of %d bytes, %d pool offsets, region pages of %d bytes, slots of %d",
			c.ID, len(c.Pages), c.PageBytes, len(c.PoolOffsets), r.PageSize, e.slotBytes)
	}
	bound := e.chunk
	if e.regionKnd != nil && e.regionKnd(c.Region) == gpu.CUDAIPC {
		bound = e.cudaChunk
	}
	if uint64(len(c.Pages))*c.PageBytes > max(bound, c.PageBytes) {
		e.T.Fatalf("machinetest: copy %d of %d pages of %d bytes: more than a chunk (%d bytes)", c.ID, len(c.Pages), c.PageBytes, bound)
	}
	if c.Dir != gpu.PoolToEngine && c.Dir != gpu.EngineToPool {
		e.T.Fatalf("machinetest: copy %d: direction %v", c.ID, c.Dir)
	}
	slots := map[uint64]bool{}
	for i, p := range c.Pages {
		off := c.PoolOffsets[i]
		if p >= r.PageCount || off%e.slotBytes != 0 || off+c.PageBytes > uint64(len(e.pool)) {
			e.T.Fatalf("machinetest: copy %d: page %d of %d, pool offset %d of %d", c.ID, p, r.PageCount, off, len(e.pool))
		}
		if c.Dir == gpu.EngineToPool && slots[off] {
			e.T.Fatalf("machinetest: store copy %d writes slot %d twice", c.ID, off/e.slotBytes)
		}
		slots[off] = true
	}
	buf, ok := e.host.mem[r.Base]
	if !ok || uint64(len(buf)) < r.Length {
		return 0, fmt.Errorf("machinetest: region at %#x (%d bytes) is no memory the test allocated", r.Base, r.Length)
	}
	var n int64
	for i, p := range c.Pages {
		page := buf[uint64(p)*r.PageSize : uint64(p+1)*r.PageSize]
		slot := e.pool[c.PoolOffsets[i] : c.PoolOffsets[i]+c.PageBytes]
		if c.Dir == gpu.PoolToEngine {
			copy(page, slot)
		} else {
			copy(slot, page)
		}
		n += int64(c.PageBytes)
	}
	return n, nil
}

// --- registrations ---

// EndRegister ends held registration i: with fail nil the copy engine
// registers the region (it refuses what the host backend cannot reach);
// otherwise registration fails with that error.
func (e *Env) EndRegister(i int, fail error) {
	rg := e.Registers[i]
	e.Registers = append(e.Registers[:i:i], e.Registers[i+1:]...)
	e.endRegister(rg, fail)
}

func (e *Env) endRegister(rg machine.Register, fail error) {
	var h gpu.Handle
	err := fail
	if err == nil {
		h, err = e.register(rg.Region)
	}
	e.call(func(now int64, out *machine.Output) { e.M.RegisterDone(now, rg.Session, rg.ID, h, err, out) })
}

// register is the host copy engine's Register: it validates the region.
func (e *Env) register(r gpu.Region) (gpu.Handle, error) {
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if r.Kind != gpu.HostProcess {
		return 0, fmt.Errorf("%w: the host backend cannot reach %v regions", gpu.ErrUnsupported, r.Kind)
	}
	if len(r.Segments) > 0 {
		return 0, fmt.Errorf("%w: machinetest registers no segmented regions", gpu.ErrUnsupported)
	}
	if !e.pids[r.PID] {
		e.T.Fatalf("machinetest: the machine registered a region of pid %d, which no session attached with", r.PID)
	}
	e.nextH++
	e.regions[e.nextH] = r
	return e.nextH, nil
}

// --- the shared tier ---

// EndLookup ends held lookup i: the tier holds found leading blocks.
func (e *Env) EndLookup(i int, found int) {
	lk := e.Lookups[i]
	e.Lookups = append(e.Lookups[:i:i], e.Lookups[i+1:]...)
	e.call(func(now int64, out *machine.Output) { e.M.L2LookupDone(now, lk.ID, found, out) })
}

// EndFetch ends held fetch i with these results (the slots' bytes are
// whatever the test put there).
func (e *Env) EndFetch(i int, res []machine.L2FetchResult) {
	f := e.Fetches[i]
	e.Fetches = append(e.Fetches[:i:i], e.Fetches[i+1:]...)
	e.call(func(now int64, out *machine.Output) { e.M.L2FetchDone(now, f.ID, res, out) })
}

// EndWrite ends held write i: it has read its slots, or (refused) was not
// taken; the Env's Tier is not written.
func (e *Env) EndWrite(i int, refused bool) {
	w := e.Writes[i]
	e.Writes = append(e.Writes[:i:i], e.Writes[i+1:]...)
	e.call(func(now int64, out *machine.Output) { e.M.L2WriteDone(now, w.ID, refused, out) })
}

// DeliverLookup answers held lookup i from the Tier (fail: the tier failed
// and answers that it holds nothing) and returns the blocks it found.
func (e *Env) DeliverLookup(i int, fail bool) int {
	found := 0
	if !fail {
		found = e.Tier.Found(e.Lookups[i])
	}
	e.EndLookup(i, found)
	return found
}

// DeliverFetch fills the slots of held fetch i from the Tier and ends it;
// spoil(b) makes block b's value invalid (nil: none). It returns each
// block's outcome.
func (e *Env) DeliverFetch(i int, spoil func(block int) bool) []FetchOutcome {
	f := e.Fetches[i]
	res, how := e.Tier.Fill(f, e.pool, spoil)
	e.EndFetch(i, res)
	return how
}

// DeliverWrite carries out held write i: its every rank's value goes to
// the Tier (refused: nothing, the tier did not take it).
func (e *Env) DeliverWrite(i int, refused bool) {
	if !refused {
		e.Tier.Put(e.Writes[i], e.pool)
	}
	e.EndWrite(i, refused)
}

// deliverTier carries out all the tier's work, and the work that brings,
// until none is left (unless the tier is held).
func (e *Env) deliverTier() {
	e.settling = true
	defer func() { e.settling = false }()
	for len(e.Lookups)+len(e.Fetches)+len(e.Writes) > 0 && !e.HoldTier {
		switch {
		case len(e.Lookups) > 0:
			e.DeliverLookup(0, false)
		case len(e.Fetches) > 0:
			e.DeliverFetch(0, nil)
		default:
			e.DeliverWrite(0, false)
		}
	}
}

// --- the tier's values ---

// Tier is the shared tier in memory: every rank's value of a block, keyed
// as sidecar/l2 keys them (the namespace's fingerprint, which tells
// tenants apart, the digest and the rank).
type Tier struct {
	vals map[string][]byte
}

// NewTier returns an empty tier.
func NewTier() *Tier { return &Tier{vals: map[string][]byte{}} }

func tierKey(ns machine.L2Namespace, d []byte, rank int) string {
	return fmt.Sprintf("%x/%x/%d", ns.FP, d, rank)
}

// Len is the number of values the tier holds.
func (t *Tier) Len() int { return len(t.vals) }

// Keys lists the tier's keys, sorted.
func (t *Tier) Keys() []string {
	ks := make([]string, 0, len(t.vals))
	for k := range t.vals {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// Found is how many leading blocks of a lookup the tier holds, every rank
// of each.
func (t *Tier) Found(lk machine.L2Lookup) int {
	w := lk.NS.Width
	found := 0
	for off := 0; off+w <= len(lk.Digests); off += w {
		for r := 0; r < lk.NS.World; r++ {
			if _, ok := t.vals[tierKey(lk.NS, lk.Digests[off:off+w], r)]; !ok {
				return found
			}
		}
		found++
	}
	return found
}

// FetchOutcome is how one block of a fetch ended.
type FetchOutcome uint8

// Outcomes of a fetched block.
const (
	Fetched FetchOutcome = iota // every rank's value copied into its slot
	Missing                     // the tier lacks a rank's value (or its size is wrong)
	Spoiled                     // the test made it invalid
)

// Fill copies every rank's value of each block of f into its pool slot,
// as the Redis tier's fetch does, and returns the results the Machine is
// told and each block's outcome.
func (t *Tier) Fill(f machine.L2Fetch, pool []byte, spoil func(block int) bool) ([]machine.L2FetchResult, []FetchOutcome) {
	res := make([]machine.L2FetchResult, len(f.Blocks))
	how := make([]FetchOutcome, len(f.Blocks))
	for i, b := range f.Blocks {
		res[i].OK = true
		for r, off := range b.PoolOffsets {
			v, ok := t.vals[tierKey(f.NS, b.Digest, r)]
			if !ok || (f.Length != 0 && uint64(len(v)) != f.Length) || uint64(len(v)) > f.MaxLength {
				res[i].OK, how[i] = false, Missing
				continue
			}
			copy(pool[off:], v)
			res[i].Length = uint64(len(v))
		}
		if res[i].OK && spoil != nil && spoil(i) {
			res[i].OK, how[i] = false, Spoiled
		}
	}
	return res, how
}

// Put stores a write's every rank's value, read from the pool.
func (t *Tier) Put(w machine.L2Write, pool []byte) {
	for r, off := range w.PoolOffsets {
		t.vals[tierKey(w.NS, w.Digest, r)] = append([]byte(nil), pool[off:off+w.Length]...)
	}
}

// ErrCopy is a copy's failure, for tests that end copies failed.
var ErrCopy = errors.New("machinetest: the copy failed")
