package sidecar_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// Two sidecars in this process stand for two nodes (separate --dir,
// separate pools) sharing a real Redis: a block one stores serves the
// other, through the real rings and copies.

func withTier(addrs []string, mod func(*sidecar.L2Config)) func(*sidecar.Config) {
	return func(c *sidecar.Config) {
		c.PoolBytes = 128 * slot
		// Lookup and I/O timeouts far above the product's defaults (100 ms,
		// 2 s): under the race detector, beside other packages' tests, a
		// first lookup on a cluster (its connections to every node made
		// then) took longer and came back with the local hits only, and a
		// write or fetch on a loaded machine can outlast 2 s; both are the
		// product's behaviour (skip, never block), not what these tests
		// check. The tests of a slow tier set their own (the mods of
		// TestL2PausedAndUnreachable and others).
		c.L2 = &sidecar.L2Config{Redis: l2.Config{Addrs: addrs, Prefix: fmt.Sprintf("t%d:", time.Now().UnixNano()),
			LookupTimeout: 10 * time.Second, IOTimeout: 10 * time.Second}, Tier: machine.L2Config{WriteSlots: 64}}
		if mod != nil {
			mod(c.L2)
		}
	}
}

// stamp fills page i of r with bytes that name block id.
func (r *region) stamp(i, id int) {
	p := r.buf[i*slot : (i+1)*slot]
	for k := 0; k < len(p); k += 8 {
		binary.LittleEndian.PutUint64(p[k:], uint64(id)<<32|uint64(k))
	}
}

func (r *region) holds(i, id int) bool {
	want := make([]byte, slot)
	for k := 0; k < len(want); k += 8 {
		binary.LittleEndian.PutUint64(want[k:], uint64(id)<<32|uint64(k))
	}
	return bytes.Equal(r.buf[i*slot:(i+1)*slot], want)
}

func pages(first, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(first + i)
	}
	return p
}

// tierHarness is a harness with the tier on, connected.
func tierHarness(t *testing.T, addrs []string, mod func(*sidecar.L2Config)) *harness {
	t.Helper()
	h := newHarness(t, withTier(addrs, mod))
	deadline := time.Now().Add(20 * time.Second)
	for !h.srv.State().L2.Connected {
		if time.Now().After(deadline) {
			t.Fatal("the tier did not connect")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return h
}

// waitWrites waits until the sidecar's tier has written n blocks.
func waitWrites(t *testing.T, h *harness, n float64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := h.srv.State().L2
		if st != nil && st.Client.Writes["ok"] >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the tier wrote %+v, want %v", st, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func waitReady(t *testing.T, c *connector.Client, l schema.LeaseReply) schema.LeaseReply {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for l.State == schema.StateWaiting {
		if time.Now().After(deadline) {
			t.Fatalf("lease still waiting: %+v", l)
		}
		time.Sleep(time.Millisecond)
		var err error
		if l, err = c.Poll(l.Lease); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

func TestL2TwoNodesShareATier(t *testing.T) {
	for _, topo := range []string{"single", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			var addrs []string
			if topo == "single" {
				addrs = []string{redistest.Single(t, redistest.Options{}).Addr}
			} else {
				addrs = redistest.NewCluster(t, 3, 1, redistest.Options{}).Addrs()
			}
			a := tierHarness(t, addrs, nil)
			prefix := a.cfg.L2.Redis.Prefix
			b := tierHarness(t, addrs, func(c *sidecar.L2Config) { c.Redis.Prefix = prefix })
			const n = 12
			d := digests("shared prefix", n)

			ca := a.dial(func(o *connector.Options) { o.Instance = "engine-on-a" })
			src := newRegion(1, n)
			if err := ca.RegisterRegion(src.reg); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < n; i++ {
				src.stamp(i, 100+i)
			}
			ca.PutHashes(1, d, false)
			if r, err := ca.Store(schema.View{Batch: 1, Count: n}, 1, pages(0, n)); err != nil || r.Stored != n {
				t.Fatalf("store on A: %+v %v", r, err)
			}
			waitWrites(t, a, n)

			cb := b.dial(func(o *connector.Options) { o.Instance = "engine-on-b" })
			dst := newRegion(1, n)
			if err := cb.RegisterRegion(dst.reg); err != nil {
				t.Fatal(err)
			}
			// B holds the first four itself (stored by its own engine).
			for i := 0; i < 4; i++ {
				dst.stamp(i, 100+i)
			}
			cb.PutHashes(1, d, false)
			if r, err := cb.Store(schema.View{Batch: 1, Count: 4}, 1, pages(0, 4)); err != nil || r.Stored != 4 {
				t.Fatalf("store on B: %+v %v", r, err)
			}
			// Lookup: B's four, then the tier's eight.
			if hits, err := cb.Lookup(schema.View{Batch: 1, Count: n}); err != nil || hits != n {
				t.Fatalf("lookup on B: %d %v", hits, err)
			}
			if hits, err := cb.PutHashesLookup(2, d); err != nil || hits != n {
				t.Fatalf("put hashes with lookup on B: %d %v", hits, err)
			}
			l, err := cb.Acquire(schema.View{Batch: 1, Count: n}, time.Minute)
			if err != nil || l.State != schema.StateWaiting || l.Blocks != n {
				t.Fatalf("acquire on B: %+v %v", l, err)
			}
			l = waitReady(t, cb, l)
			if l.State != schema.StateReady || l.Blocks != n {
				t.Fatalf("after the fetch: %+v", l)
			}
			clear(dst.buf)
			if got, err := cb.Load(l.Lease, 1, 0, pages(0, n)); err != nil || got != n {
				t.Fatalf("load on B: %d %v", got, err)
			}
			for i := 0; i < n; i++ {
				if !dst.holds(i, 100+i) {
					t.Fatalf("page %d: not block %d's bytes", i, i)
				}
			}
			cb.Release(l.Lease)
			st := b.srv.State()
			if st.L2 == nil || st.L2.Mode != topo || st.L2.Machine.FetchedBlocks != n-4 || st.Pool.Blocks != n {
				t.Fatalf("B's state: %+v, pool %+v", st.L2, st.Pool)
			}
			// B wrote its own four (write-through) and none it fetched.
			if w := st.L2.Machine.Writes; w != 4 {
				t.Fatalf("B handed %d writes to the tier, want its own 4", w)
			}
			// The fetched blocks are B's now: a second acquire is served at once.
			if l2b, err := cb.Acquire(schema.View{Batch: 1, Count: n}, time.Minute); err != nil || l2b.State != schema.StateReady || l2b.Blocks != n {
				t.Fatalf("second acquire: %+v %v", l2b, err)
			} else {
				cb.Release(l2b.Lease)
			}
		})
	}
}

func TestL2CorruptValueNeverServed(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	a := tierHarness(t, []string{srv.Addr}, nil)
	prefix := a.cfg.L2.Redis.Prefix
	b := tierHarness(t, []string{srv.Addr}, func(c *sidecar.L2Config) { c.Redis.Prefix = prefix })
	d := digests("corrupt", 4)
	ca := a.dial(nil)
	src := newRegion(1, 4)
	ca.RegisterRegion(src.reg)
	for i := 0; i < 4; i++ {
		src.stamp(i, i)
	}
	ca.PutHashes(1, d, false)
	ca.Store(schema.View{Batch: 1, Count: 4}, 1, pages(0, 4))
	waitWrites(t, a, 4)
	// Block 2's value changed in place, in the server.
	keys, err := srv.CLI("--scan", "--pattern", prefix+"*")
	if err != nil {
		t.Fatal(err)
	}
	ns := b.nsOf(t)
	key := l2.Key(prefix, ns, d[2*32:3*32], 0)
	if !bytes.Contains([]byte(keys), []byte(key)) {
		t.Fatalf("key %s not among %s", key, keys)
	}
	if _, err := srv.CLI("SETRANGE", key, "1000", "garbage"); err != nil {
		t.Fatal(err)
	}
	cb := b.dial(nil)
	dst := newRegion(1, 4)
	cb.RegisterRegion(dst.reg)
	cb.PutHashes(1, d, false)
	// The lookup sees four keys; the fetch rejects block 2: the lease holds
	// two, and the engine recomputes the rest.
	l, err := cb.Acquire(schema.View{Batch: 1, Count: 4}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	l = waitReady(t, cb, l)
	if l.Blocks != 2 {
		t.Fatalf("lease of %d blocks over a corrupt third: %+v", l.Blocks, l)
	}
	if got, err := cb.Load(l.Lease, 1, 0, pages(0, 2)); err != nil || got != 2 || !dst.holds(0, 0) || !dst.holds(1, 1) {
		t.Fatalf("load: %d %v", got, err)
	}
	// Loading what the lease does not hold is refused: never a wrong byte.
	if _, err := cb.Load(l.Lease, 1, 0, pages(0, 3)); status(err) != schema.ErrCodeOutOfRange {
		t.Fatalf("load past the lease: %v", err)
	}
	st := b.srv.State().L2
	if st.Client.Rejected[l2.RejectChecksum] != 1 || st.Machine.FetchMisses != 1 {
		t.Fatalf("state %+v", st)
	}
}

// nsOf is the tier's name of the harness's default namespace (model
// llama, layout bf16/16/HND, no salt, width 32, world 1), as the Machine
// computes it.
func (h *harness) nsOf(t *testing.T) machine.L2Namespace {
	t.Helper()
	return machine.L2NamespaceFor("llama", "bf16/16/HND", "", 32, 1)
}

func TestL2PausedAndUnreachable(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	h := tierHarness(t, []string{srv.Addr}, func(c *sidecar.L2Config) {
		c.Redis.LookupTimeout, c.Redis.IOTimeout, c.Redis.Writers, c.Redis.Queue = 50*time.Millisecond, 300*time.Millisecond, 1, 2
		c.Tier.WriteSlots = 4
	})
	c := h.dial(nil)
	other := h.dial(func(o *connector.Options) { o.Instance = "other" })
	src := newRegion(1, 32)
	c.RegisterRegion(src.reg)
	other.RegisterRegion(src.reg)
	local := digests("local", 3)
	other.PutHashes(1, local, false)
	other.Store(schema.View{Batch: 1, Count: 3}, 1, pages(0, 3)) // one writer, two queued
	waitWrites(t, h, 3)

	for _, fault := range []string{"paused", "unreachable"} {
		t.Run(fault, func(t *testing.T) {
			if fault == "paused" {
				if _, err := srv.CLI("CLIENT", "PAUSE", "5000", "ALL"); err != nil {
					t.Fatal(err)
				}
				defer srv.CLI("CLIENT", "UNPAUSE")
			} else {
				srv.Kill()
			}
			b := uint64(10)
			if fault == "unreachable" {
				b = 20
			}
			c.PutHashes(b, digests(fault, 8), false)
			var wg sync.WaitGroup
			var lookupTook time.Duration
			wg.Add(1)
			go func() {
				defer wg.Done()
				t0 := time.Now()
				if hits, err := c.Lookup(schema.View{Batch: b, Count: 8}); err != nil || hits != 0 {
					t.Errorf("lookup: %d %v", hits, err)
				}
				lookupTook = time.Since(t0)
			}()
			// Another session is not held up: its local hits answer at once.
			t0 := time.Now()
			for i := 0; i < 20; i++ {
				if hits, err := other.Lookup(schema.View{Batch: 1, Count: 3}); err != nil || hits != 3 {
					t.Fatalf("other session's lookup: %d %v", hits, err)
				}
			}
			otherTook := time.Since(t0)
			wg.Wait()
			// The lookup that asked the tier took its deadline (50 ms plus
			// the machine's margin) at most; a vLLM step waits no longer than
			// its max_wait_us in any case (it asks again next step).
			if lookupTook > 2*time.Second {
				t.Fatalf("a lookup of a %s tier took %v", fault, lookupTook)
			}
			_ = otherTook
			// Stores go on, and the writes they ask for stay bounded: queued
			// or pinned no more than the bounds, the rest refused or
			// skipped, counted.
			c.PutHashes(b+1, digests(fault+"-stores", 24), false)
			if r, err := c.Store(schema.View{Batch: b + 1, Count: 24}, 1, pages(4, 24)); err != nil || r.Stored != 24 {
				t.Fatalf("store with the tier %s: %+v %v", fault, r, err)
			}
			st := h.srv.State().L2
			if st.Machine.WritingSlots > 4 || st.Client.Queue > 2 {
				t.Fatalf("writes past the bounds: %+v", st)
			}
			if st.Machine.WritesSkipped+uint64(st.Client.Writes["queue_full"]+st.Client.Writes["unavailable"]) == 0 {
				t.Fatalf("no write was skipped or refused: %+v", st)
			}
			// An acquire of blocks the tier would hold waits no longer than
			// its fetch deadline, then is a miss.
			l, err := c.Acquire(schema.View{Batch: b, Count: 8}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if l.State == schema.StateWaiting {
				if l = waitReady(t, c, l); l.State != schema.StateMiss {
					t.Fatalf("fetch from a %s tier: %+v", fault, l)
				}
			}
		})
	}
	// The server comes back: the tier is used again (its values are gone
	// with the killed process).
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		before := h.srv.State().L2.Client.Writes["ok"]
		other.PutHashes(99, digests(time.Now().String(), 1), false)
		other.Store(schema.View{Batch: 99, Count: 1}, 1, pages(0, 1))
		other.DropHashes(99)
		time.Sleep(50 * time.Millisecond)
		if h.srv.State().L2.Client.Writes["ok"] > before {
			return
		}
	}
	t.Fatal("writes did not resume after the server came back")
}

// TestL2MasterKilledMidReplay replays conversations on two nodes sharing
// a cluster, each turn on the other node than the last, and SIGKILLs the
// master holding the first conversation's blocks halfway: every request
// completes, every loaded byte is the block's own, blocks of the dead
// master miss (counted) until its replica takes over, and then hits from
// the tier resume.
func TestL2MasterKilledMidReplay(t *testing.T) {
	cl := redistest.NewCluster(t, 3, 1, redistest.Options{})
	addrs := cl.Addrs()
	// Lookups to the killed master wait up to the lookup timeout, which
	// must stay under the client's call timeout (5 s): the harness's 10 s
	// made a lookup during the failover fail the test's call, not miss.
	a := tierHarness(t, addrs, func(c *sidecar.L2Config) {
		c.Redis.IOTimeout, c.Redis.LookupTimeout = 300*time.Millisecond, 2*time.Second
	})
	prefix := a.cfg.L2.Redis.Prefix
	b := tierHarness(t, addrs, func(c *sidecar.L2Config) {
		c.Redis.Prefix, c.Redis.IOTimeout, c.Redis.LookupTimeout = prefix, 300*time.Millisecond, 2*time.Second
	})
	type node struct {
		h   *harness
		c   *connector.Client
		mem *region
	}
	var nodes []*node
	for i, h := range []*harness{a, b} {
		c := h.dial(func(o *connector.Options) { o.Instance = fmt.Sprintf("engine-%d", i) })
		r := newRegion(1, 64)
		if err := c.RegisterRegion(r.reg); err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, &node{h: h, c: c, mem: r})
	}
	const convs, blocksPerTurn, turns = 4, 3, 8
	chains := make([][]byte, convs)
	for c := range chains {
		chains[c] = digests(fmt.Sprintf("conversation %d", c), blocksPerTurn*turns)
	}
	id := func(c, i int) int { return c*1000 + i }
	batch := uint64(0)
	// step runs turn `turn` of conversation c on node n and returns the
	// blocks it loaded that came from the tier (fetched).
	step := func(n *node, c, turn int) (hits int) {
		batch++
		k := blocksPerTurn * (turn + 1)
		d := chains[c][:k*32]
		if _, err := n.c.PutHashes(batch, d, false); err != nil {
			t.Fatal(err)
		}
		h, err := n.c.Lookup(schema.View{Batch: batch, Count: uint32(k)})
		if err != nil {
			t.Fatal(err)
		}
		loaded := 0
		if h > 0 {
			l, err := n.c.Acquire(schema.View{Batch: batch, Count: uint32(h)}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			l = waitReady(t, n.c, l)
			if l.State == schema.StateReady && l.Blocks > 0 {
				loaded = int(l.Blocks)
				clear(n.mem.buf)
				if _, err := n.c.Load(l.Lease, 1, 0, pages(0, loaded)); err != nil {
					t.Fatal(err)
				}
				for i := 0; i < loaded; i++ {
					if !n.mem.holds(i, id(c, i)) {
						t.Fatalf("conversation %d turn %d: page %d is not block %d's", c, turn, i, i)
					}
				}
			}
			if l.Lease != 0 {
				n.c.Release(l.Lease)
			}
		}
		// The engine recomputes the rest and stores it.
		for i := loaded; i < k; i++ {
			n.mem.stamp(i, id(c, i))
		}
		if loaded < k {
			if _, err := n.c.Store(schema.View{Batch: batch, Start: uint32(loaded), Count: uint32(k - loaded)}, 1, pages(loaded, k-loaded)); err != nil {
				t.Fatal(err)
			}
		}
		n.c.DropHashes(batch)
		return loaded
	}
	fetched := func() uint64 {
		return a.srv.State().L2.Machine.FetchedBlocks + b.srv.State().L2.Machine.FetchedBlocks
	}
	settle := func() { // write-through is asynchronous: let it land
		time.Sleep(50 * time.Millisecond)
	}
	for turn := 0; turn < turns/2; turn++ {
		for c := 0; c < convs; c++ {
			step(nodes[(turn+c)%2], c, turn)
			settle()
		}
	}
	before := fetched()
	if before == 0 {
		t.Fatal("no block came from the tier before the kill")
	}
	victim, err := cl.MasterOf(l2.Key(prefix, b.nsOf(t), chains[0][:32], 0))
	if err != nil {
		t.Fatal(err)
	}
	victim.Kill()
	// Right after the kill: requests complete; the dead master's blocks
	// miss.
	for c := 0; c < convs; c++ {
		step(nodes[(turns/2+c)%2], c, turns/2)
	}
	if err := cl.WaitHealthy(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	mid := fetched()
	for turn := turns/2 + 1; turn < turns; turn++ {
		for c := 0; c < convs; c++ {
			step(nodes[(turn+c)%2], c, turn)
			settle()
		}
	}
	if after := fetched(); after <= mid {
		t.Fatalf("no hits from the tier after the failover: fetched %d before the kill, %d by the failover, %d after", before, mid, after)
	}
	misses := a.srv.State().L2.Client.FetchBlocks["error"] + b.srv.State().L2.Client.FetchBlocks["error"] +
		a.srv.State().L2.Client.Errors["fetch"] + b.srv.State().L2.Client.Errors["fetch"] +
		a.srv.State().L2.Client.Errors["lookup"] + b.srv.State().L2.Client.Errors["lookup"]
	if misses == 0 {
		t.Fatalf("the kill cost nothing counted: %+v %+v", a.srv.State().L2, b.srv.State().L2)
	}
}

// TestL2WriteOnEvict: with --l2.policy write-on-evict nothing is written
// when stored; the blocks at the LRU's tail are written ahead of their
// eviction, so that once evicted they still serve another node, and the
// ones evicted before they could be written are counted.
func TestL2WriteOnEvict(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	a := tierHarness(t, []string{srv.Addr}, func(c *sidecar.L2Config) {
		c.Tier.Policy, c.Tier.WriteSlots, c.Tier.EvictAhead = machine.WriteOnEvict, 4, 4
	})
	prefix := a.cfg.L2.Redis.Prefix
	b := tierHarness(t, []string{srv.Addr}, func(c *sidecar.L2Config) { c.Redis.Prefix = prefix })
	slots := a.srv.State().Pool.Capacity
	d := digests("evicted", slots+8)
	ca := a.dial(nil)
	src := newRegion(1, slots+8)
	ca.RegisterRegion(src.reg)
	for i := 0; i < slots+8; i++ {
		src.stamp(i, 500+i)
	}
	ca.PutHashes(1, d, false)
	// Fill the pool in steps of four: each step's end writes the four least
	// recently used ahead (the reaper's tick writes them too).
	for i := 0; i < slots; i += 4 {
		if r, err := ca.Store(schema.View{Batch: 1, Start: uint32(i), Count: 4}, 1, pages(i, 4)); err != nil || r.Stored != 4 {
			t.Fatalf("store %d: %+v %v", i, r, err)
		}
	}
	waitWrites(t, a, 4)
	if st := a.srv.State().L2; st.Machine.Writes > 8 {
		t.Fatalf("write-on-evict wrote %d blocks of a pool not yet full", st.Machine.Writes)
	}
	// Four more evict the four written ones.
	if r, err := ca.Store(schema.View{Batch: 1, Start: uint32(slots), Count: 4}, 1, pages(slots, 4)); err != nil || r.Stored != 4 {
		t.Fatalf("store past the pool: %+v %v", r, err)
	}
	st := a.srv.State()
	if st.Pool.Evictions != 4 || st.L2.EvictedUnwritten != 0 {
		t.Fatalf("evictions %d, unwritten %d: %+v", st.Pool.Evictions, st.L2.EvictedUnwritten, st.L2)
	}
	// Node B fetches the evicted blocks 0-3 from the tier.
	cb := b.dial(nil)
	dst := newRegion(1, 4)
	cb.RegisterRegion(dst.reg)
	cb.PutHashes(1, d[:4*32], false)
	l, err := cb.Acquire(schema.View{Batch: 1, Count: 4}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if l = waitReady(t, cb, l); l.Blocks != 4 {
		t.Fatalf("B's lease of the evicted blocks: %+v", l)
	}
	if _, err := cb.Load(l.Lease, 1, 0, pages(0, 4)); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 4; i++ {
		if !dst.holds(i, 500+i) {
			t.Fatalf("block %d: wrong bytes", i)
		}
	}
	// A burst larger than the blocks written ahead evicts unwritten ones:
	// counted.
	ca.PutHashes(2, digests("burst", slots), false)
	burst := newRegion(2, slots)
	ca.RegisterRegion(burst.reg)
	if _, err := ca.Store(schema.View{Batch: 2, Count: uint32(slots)}, 2, pages(0, slots)); err != nil {
		t.Fatal(err)
	}
	if st := a.srv.State().L2; st.EvictedUnwritten == 0 {
		t.Fatalf("a burst evicted nothing unwritten: %+v", st)
	}
}
