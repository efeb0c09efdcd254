package sidecar_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// A node tier in this process (a real socket, real memfds) and sidecars
// beside it stand for the engine pods of one node. Being in one network
// namespace, the pods are the names they declare (--pod-identity
// declared); pods in namespaces of their own: reliability's namespace tests.

func startNodeTier(t *testing.T, sock string) *node.Server {
	t.Helper()
	if sock == "" {
		dir, err := os.MkdirTemp("", "rs-nt-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		sock = filepath.Join(dir, "n", node.SocketName)
	}
	s, err := node.NewServer(node.ServerConfig{Dir: filepath.Dir(sock), Socket: sock, PoolBytes: 128 * (slot + node.SlotHeadroom), SlotBytes: slot, PodIdentity: node.IdentityDeclared}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Serve(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

func withNodeTier(sock, pod string) func(*sidecar.Config) {
	return func(c *sidecar.Config) {
		c.PoolBytes = 128 * slot
		c.L2 = &sidecar.L2Config{Node: &node.ClientConfig{Socket: sock, Pod: pod, LookupTimeout: 5 * time.Second, IOTimeout: 5 * time.Second},
			Tier: machine.L2Config{WriteSlots: 64}}
	}
}

func nodeHarness(t *testing.T, sock, pod string) *harness {
	t.Helper()
	h := newHarness(t, withNodeTier(sock, pod))
	waitNode(t, h, func(n *sidecar.NodeState) bool { return n.Connected }, "attached")
	return h
}

func waitNode(t *testing.T, h *harness, cond func(*sidecar.NodeState) bool, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := h.srv.State().L2
		if st != nil && st.Node != nil && cond(st.Node) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("node tier not %s: %+v", what, st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// storeBlocks stores n stamped blocks of prefix through an engine of h.
func storeBlocks(t *testing.T, h *harness, d []byte, n, first int) {
	t.Helper()
	storeBlocksAs(t, h, "", d, n, first)
}

// storeBlocksAs is storeBlocks through an engine of model (empty: the
// harness's).
func storeBlocksAs(t *testing.T, h *harness, model string, d []byte, n, first int) {
	t.Helper()
	c := h.dial(func(o *connector.Options) {
		o.Instance = "writer"
		if model != "" {
			o.Model = model
		}
	})
	src := newRegion(1, n)
	if err := c.RegisterRegion(src.reg); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		src.stamp(i, first+i)
	}
	c.PutHashes(1, d, false)
	if r, err := c.Store(schema.View{Batch: 1, Count: uint32(n)}, 1, pages(0, n)); err != nil || int(r.Stored) != n {
		t.Fatalf("store: %+v %v", r, err)
	}
	c.Close()
}

// loadAll looks the blocks up and loads them through an engine of h, and
// reports how many came with their bytes.
func loadAll(t *testing.T, h *harness, d []byte, n, first int) int {
	t.Helper()
	c := h.dial(func(o *connector.Options) { o.Instance = "reader" })
	defer c.Close()
	dst := newRegion(1, n)
	if err := c.RegisterRegion(dst.reg); err != nil {
		t.Fatal(err)
	}
	c.PutHashes(1, d, false)
	hits, err := c.Lookup(schema.View{Batch: 1, Count: uint32(n)})
	if err != nil {
		t.Fatal(err)
	}
	if hits == 0 {
		return 0
	}
	l, err := c.Acquire(schema.View{Batch: 1, Count: uint32(n)}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	l = waitReady(t, c, l)
	if l.State != schema.StateReady {
		return 0
	}
	got, err := c.Load(l.Lease, 1, 0, pages(0, int(l.Blocks)))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < got; i++ {
		if !dst.holds(i, first+i) {
			t.Fatalf("page %d: not block %d's bytes", i, i)
		}
	}
	c.Release(l.Lease)
	return got
}

// Two engine pods' sidecars share blocks through one node process: what one
// stores (write-through) the other looks up, fetches and loads byte for
// byte; and a sidecar that restarts finds its blocks there again.
func TestNodeTierSharedBetweenPods(t *testing.T) {
	nt := startNodeTier(t, "")
	a := nodeHarness(t, nt.Socket(), "pod-a")
	b := nodeHarness(t, nt.Socket(), "pod-b")
	const n = 10
	d := digests("a system prompt", n)
	storeBlocks(t, a, d, n, 100)
	waitNode(t, a, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == n }, "written")
	if got := loadAll(t, b, d, n, 100); got != n {
		t.Fatalf("pod B loaded %d of %d blocks from the node tier", got, n)
	}
	st := b.srv.State().L2
	if st.Machine.FetchedBlocks != n || st.Node.Counts["fetched_blocks"] != n {
		t.Fatalf("B's counts: %+v, node %v", st.Machine, st.Node.Counts)
	}
	if nt.OwnerUsed("pod-a") != n || nt.OwnerUsed("pod-b") != 0 {
		t.Fatalf("charges: a %d, b %d", nt.OwnerUsed("pod-a"), nt.OwnerUsed("pod-b"))
	}
	// A third sidecar of pod B, as after its restart (a new process, an
	// empty pool): the blocks are still in the node tier.
	b2 := nodeHarness(t, nt.Socket(), "pod-b")
	if got := loadAll(t, b2, d, n, 100); got != n {
		t.Fatalf("after a restart, %d of %d blocks", got, n)
	}
}

// The node tier's process ends: engines get misses from the tier, never an
// error or a wait past the deadlines; a new process is attached by itself
// and serves again (it starts empty).
func TestNodeTierRestarts(t *testing.T) {
	dir, err := os.MkdirTemp("", "rs-nt-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, node.SocketName)
	ctx, cancel := context.WithCancel(context.Background())
	nt, err := node.NewServer(node.ServerConfig{Dir: dir, PoolBytes: 64 * (slot + node.SlotHeadroom), SlotBytes: slot, PodIdentity: node.IdentityDeclared}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { nt.Serve(ctx); close(done) }()
	a := nodeHarness(t, sock, "pod-a")
	b := nodeHarness(t, sock, "pod-b")
	d := digests("turn one", 4)
	storeBlocks(t, a, d, 4, 1)
	waitNode(t, a, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == 4 }, "written")
	cancel()
	<-done
	waitNode(t, b, func(s *sidecar.NodeState) bool { return !s.Connected }, "detached")
	t0 := time.Now()
	if got := loadAll(t, b, d, 4, 1); got != 0 {
		t.Fatalf("%d blocks with the tier gone", got)
	}
	if el := time.Since(t0); el > 2*time.Second {
		t.Fatalf("a lookup with the tier gone took %v", el)
	}
	startNodeTier(t, sock)
	waitNode(t, b, func(s *sidecar.NodeState) bool { return s.Connected }, "re-attached")
	storeBlocks(t, b, d, 4, 1)
	waitNode(t, b, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == 4 }, "written again")
	waitNode(t, a, func(s *sidecar.NodeState) bool { return s.Connected }, "re-attached")
	a2 := nodeHarness(t, sock, "pod-a")
	if got := loadAll(t, a2, d, 4, 1); got != 4 {
		t.Fatalf("the new node process serves %d of 4", got)
	}
}

// The order of the tiers: pod pool, node tier, Redis. Two nodes, each with
// a node tier, share one Redis. On node 2, a pod finds the first half of a
// prompt in its node tier (stored by a neighbour) and the rest in Redis
// (stored on node 1): its lookup counts both, and its fetch takes each half
// from its tier; the half Redis gave goes into node 2's tier for the next.
func TestNodeTierAboveRedis(t *testing.T) {
	redis := redistest.Single(t, redistest.Options{})
	prefix := fmt.Sprintf("nt%d:", time.Now().UnixNano())
	both := func(sock, pod string) *harness {
		h := newHarness(t, func(c *sidecar.Config) {
			withNodeTier(sock, pod)(c)
			c.L2.Redis = l2.Config{Addrs: []string{redis.Addr}, Prefix: prefix, LookupTimeout: 10 * time.Second}
		})
		waitNode(t, h, func(n *sidecar.NodeState) bool { return n.Connected }, "attached")
		deadline := time.Now().Add(20 * time.Second)
		for !h.srv.State().L2.Connected {
			if time.Now().After(deadline) {
				t.Fatal("redis not connected")
			}
			time.Sleep(5 * time.Millisecond)
		}
		return h
	}
	n1, n2 := startNodeTier(t, ""), startNodeTier(t, "")
	a := both(n1.Socket(), "a") // node 1
	c := both(n2.Socket(), "c") // node 2
	const n = 8
	d := digests("a long conversation", n)
	storeBlocks(t, a, d, n, 500)
	waitNode(t, a, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == n }, "written to node 1")
	waitWrites(t, a, n)
	// Pod C on node 2 holds the first half itself, and so writes it to
	// node 2's tier (and Redis, which holds it already).
	storeBlocks(t, c, d[:n/2*32], n/2, 500)
	waitNode(t, c, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == n/2 }, "written to node 2")
	// Pod E, a new pod on node 2.
	e := both(n2.Socket(), "e")
	if got := loadAll(t, e, d, n, 500); got != n {
		t.Fatalf("pod E loaded %d of %d", got, n)
	}
	st := e.srv.State().L2
	if st.Node.Counts["lookup_hit_blocks"] != n/2 || st.Node.Counts["fetched_blocks"] != n/2 || st.Client.FetchBlocks["ok"] != n/2 || st.Machine.FetchedBlocks != n {
		t.Fatalf("E's tiers: node %v, redis fetches %v, machine %+v", st.Node.Counts, st.Client.FetchBlocks, st.Machine)
	}
	// What Redis gave E went into node 2's tier too: pod F, new on node 2,
	// finds the whole prompt there and asks Redis for nothing.
	waitNode(t, e, func(s *sidecar.NodeState) bool {
		return s.Counts["promotions"] == n/2 && s.Counts["writes_stored"] == n/2
	}, "promoted")
	f := both(n2.Socket(), "f")
	if got := loadAll(t, f, d, n, 500); got != n {
		t.Fatalf("pod F loaded %d of %d", got, n)
	}
	if st := f.srv.State().L2; st.Node.Counts["fetched_blocks"] != n || st.Client.FetchBlocks["ok"] != 0 {
		t.Fatalf("F's tiers: node %v, redis fetches %v", st.Node.Counts, st.Client.FetchBlocks)
	}
}

// With --l2.policy write-on-evict the node tier is given the blocks at the
// pod pool's LRU tail ahead of their eviction: once the pool evicts them,
// the pod (a new engine of it) loads them back from the node tier.
func TestNodeTierWriteOnEvict(t *testing.T) {
	nt := startNodeTier(t, "")
	a := newHarness(t, func(c *sidecar.Config) {
		withNodeTier(nt.Socket(), "pod-a")(c)
		c.PoolBytes = 32 * slot
		c.L2.Tier.Policy, c.L2.Tier.WriteSlots, c.L2.Tier.EvictAhead = machine.WriteOnEvict, 4, 4
	})
	waitNode(t, a, func(n *sidecar.NodeState) bool { return n.Connected }, "attached")
	slots := a.srv.State().Pool.Capacity
	d := digests("evicted", slots+4)
	ca := a.dial(nil)
	src := newRegion(1, slots+4)
	ca.RegisterRegion(src.reg)
	for i := 0; i < slots+4; i++ {
		src.stamp(i, 700+i)
	}
	ca.PutHashes(1, d, false)
	for i := 0; i < slots; i += 4 {
		if r, err := ca.Store(schema.View{Batch: 1, Start: uint32(i), Count: 4}, 1, pages(i, 4)); err != nil || r.Stored != 4 {
			t.Fatalf("store %d: %+v %v", i, r, err)
		}
	}
	waitNode(t, a, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] >= 4 }, "written ahead")
	if w := a.srv.State().L2.Machine.Writes; w > 8 {
		t.Fatalf("write-on-evict wrote %d blocks of a pool not yet full", w)
	}
	// Four more evict the four written ahead.
	if r, err := ca.Store(schema.View{Batch: 1, Start: uint32(slots), Count: 4}, 1, pages(slots, 4)); err != nil || r.Stored != 4 {
		t.Fatalf("store past the pool: %+v %v", r, err)
	}
	if st := a.srv.State(); st.Pool.Evictions != 4 || st.L2.EvictedUnwritten != 0 {
		t.Fatalf("evictions %d, unwritten %d", st.Pool.Evictions, st.L2.EvictedUnwritten)
	}
	ca.Close()
	if got := loadAll(t, a, d[:4*32], 4, 700); got != 4 {
		t.Fatalf("the evicted blocks: %d of 4 back from the node tier", got)
	}
	// Which four were evicted depends on which writes ahead had landed:
	// eviction takes blocks already written first (none unwritten, checked
	// above), so some of blocks 0-3 may still be in the pod's pool and the
	// rest come from the node tier. All 4 came back byte-exact.
	if n := a.srv.State().L2.Node.Counts["fetched_blocks"]; n < 1 || n > 4 {
		t.Fatalf("%d blocks fetched from the node tier, want 1 to 4 (the evicted of blocks 0-3)", n)
	}
}
