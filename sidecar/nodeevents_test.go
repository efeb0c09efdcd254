package sidecar_test

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// The node tier's blocks in each pod's KV events (docs/kv-events.md, "The
// node tier"): a pod's event log, as its connector reads it, holds the
// union of its pool's described blocks and the node tier's.

// eventView follows a sidecar's event log as the connector's EventFeed
// does: a snapshot, then Events from its cursor, again after a resync.
type eventView struct {
	t          *testing.T
	c          *connector.Client
	epoch, seq uint64
	set        map[string][]uint32 // digest (hex) -> token ids
	removed    int                 // removals read
}

func followEvents(t *testing.T, h *harness) *eventView {
	t.Helper()
	v := &eventView{t: t, c: h.dial(func(o *connector.Options) { o.Instance = "router" })}
	v.snapshot()
	return v
}

func (v *eventView) snapshot() {
	v.t.Helper()
	v.set = map[string][]uint32{}
	var from uint64
	for first := true; ; first = false {
		r, err := v.c.EventSnapshot(from, 0)
		if err != nil {
			v.t.Fatal(err)
		}
		if first {
			v.epoch, v.seq = r.Epoch, r.Seq
		}
		r.Events(func(e *schema.Event) bool { v.apply(e); return true })
		if r.Done {
			return
		}
		from = r.Next
	}
}

func (v *eventView) apply(e *schema.Event) {
	k := hex.EncodeToString(e.Digest)
	if e.Op == schema.EventRemoved {
		if _, ok := v.set[k]; !ok {
			v.t.Errorf("removed %s, never announced", k[:8])
		}
		delete(v.set, k)
		v.removed++
		return
	}
	if _, ok := v.set[k]; ok {
		v.t.Errorf("stored %s twice", k[:8])
	}
	tk := make([]uint32, len(e.Tokens)/4)
	for i := range tk {
		tk[i] = binary.LittleEndian.Uint32(e.Tokens[4*i:])
	}
	v.set[k] = tk
}

func (v *eventView) poll() {
	v.t.Helper()
	for {
		r, err := v.c.Events(v.epoch, v.seq, 0)
		if err != nil {
			v.t.Fatal(err)
		}
		if r.Resync {
			v.snapshot()
			return
		}
		r.Events(func(e *schema.Event) bool { v.apply(e); return true })
		caughtUp := r.Seq == v.seq
		v.epoch, v.seq = r.Epoch, r.Seq
		if caughtUp || r.Count == 0 {
			return
		}
	}
}

// has reports whether block i of d is announced.
func (v *eventView) has(d []byte, i int) bool {
	_, ok := v.set[hex.EncodeToString(d[i*32:(i+1)*32])]
	return ok
}

// waitFor polls until cond holds.
func (v *eventView) waitFor(what string, cond func() bool) {
	v.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		v.poll()
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			v.t.Fatalf("pod's events: not %s; announced %d blocks", what, len(v.set))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// holdsFor checks that cond holds throughout d.
func (v *eventView) holdsFor(what string, d time.Duration, cond func() bool) {
	v.t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		v.poll()
		if !cond() {
			v.t.Fatalf("pod's events: not %s", what)
		}
	}
}

// tokensOf are block i's token ids as describeBlocks gives them.
func tokensOf(i int) []uint32 { return tokensOfN(i, 2) }

func tokensOfN(i, per int) []uint32 {
	tk := make([]uint32, per)
	for j := range tk {
		tk[j] = uint32(1000*(j+1) + i)
	}
	return tk
}

// describeBlocks describes blocks [0, n) of d (one chain) through an engine
// of h, as its scheduler does after their store.
func describeBlocks(t *testing.T, h *harness, d []byte, n int) {
	t.Helper()
	describeBlocksAs(t, h, "", d, n)
}

func describeBlocksAs(t *testing.T, h *harness, model string, d []byte, n int) {
	t.Helper()
	describeBlocksN(t, h, model, d, n, 2)
}

// describeBlocksN describes blocks of per token ids each.
func describeBlocksN(t *testing.T, h *harness, model string, d []byte, n, per int) {
	t.Helper()
	c := h.dial(func(o *connector.Options) {
		o.Instance, o.Role = "sched", schema.RoleScheduler
		if model != "" {
			o.Model = model
		}
	})
	chunk := 12000 / (4*per + 32) // runs that fit a record
	for first := 0; first < n; first += chunk {
		k := min(chunk, n-first)
		tokens := make([]byte, 0, 4*per*k)
		for i := first; i < first+k; i++ {
			for _, tk := range tokensOfN(i, per) {
				tokens = binary.LittleEndian.AppendUint32(tokens, tk)
			}
		}
		run := schema.DescribeRun{Digests: d[first*32 : (first+k)*32], TokensPerBlock: uint16(per), Tokens: tokens}
		if first > 0 {
			run.Parent = d[(first-1)*32 : first*32]
		}
		if _, err := c.Describe([]schema.DescribeRun{run}); err != nil {
			t.Fatal(err)
		}
	}
}

func allOf(v *eventView, d []byte, n int, want bool) func() bool {
	return func() bool {
		for i := 0; i < n; i++ {
			if v.has(d, i) != want {
				return false
			}
		}
		return true
	}
}

// A block pod A writes into the node tier and describes is announced in
// pod B's event log (B never held it), with A's description; when it
// leaves the node tier, B's log removes it. B follows only the namespaces
// its engines attached with.
func TestNodeEventsBetweenPods(t *testing.T) {
	nt := startNodeTier(t, "")
	a := nodeHarness(t, nt.Socket(), "pod-a")
	b := nodeHarness(t, nt.Socket(), "pod-b")
	vb := followEvents(t, b) // B's engine registered the namespace
	const n = 4
	other := digests("another model's prompt", 2)
	storeBlocksAs(t, a, "other-model", other, 2, 1)
	describeBlocksAs(t, a, "other-model", other, 2)
	d := digests("pod A's prompt", n)
	storeBlocks(t, a, d, n, 10)
	describeBlocks(t, a, d, n)
	waitNode(t, a, func(s *sidecar.NodeState) bool { return s.Counts["described"] == n+2 }, "described")
	vb.waitFor("announcing A's blocks", allOf(vb, d, n, true))
	vb.holdsFor("announcing no other model's block", 200*time.Millisecond, func() bool { return len(vb.set) == n })
	if st := b.srv.State().L2.Node.Counts; st["events_stored"] != n {
		t.Fatalf("B read %d blocks of the node's logs, want %d (its own namespace's)", st["events_stored"], n)
	}
	for i := 0; i < n; i++ {
		if got := vb.set[hex.EncodeToString(d[i*32:(i+1)*32])]; len(got) != 2 || got[0] != tokensOf(i)[0] || got[1] != tokensOf(i)[1] {
			t.Fatalf("block %d announced with tokens %v, want %v", i, got, tokensOf(i))
		}
	}
	if len(vb.set) != n {
		t.Fatalf("B announces %d blocks, want %d", len(vb.set), n)
	}
	// A writes past its share of the node tier (16 of its 128 slots): the
	// first blocks leave the node tier, and B's log removes them.
	more := digests("pod A's other prompts", 24)
	storeBlocks(t, a, more, 24, 100)
	vb.waitFor("removing A's evicted blocks", allOf(vb, d, n, false))
	if st := b.srv.State().L2.Node.Counts; st["events_stored"] < n || st["events_removed"] < n {
		t.Fatalf("B's counts: %v", st)
	}
}

// A block in B's own pool and in the node tier is removed from B's log
// only once it has left both.
func TestNodeEventsUnion(t *testing.T) {
	nt := startNodeTier(t, "")
	b := newHarness(t, func(c *sidecar.Config) {
		withNodeTier(nt.Socket(), "pod-b")(c)
		c.PoolBytes = 40 * slot
	})
	waitNode(t, b, func(n *sidecar.NodeState) bool { return n.Connected }, "attached")
	a := nodeHarness(t, nt.Socket(), "pod-a")
	va, vb := followEvents(t, a), followEvents(t, b)
	x := digests("block X", 1)
	storeBlocks(t, b, x, 1, 1) // B's pool, and the node tier (write-through)
	waitNode(t, b, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == 1 }, "written")
	describeBlocks(t, b, x, 1) // B describes it: in B's pool and, sent by B, the node's
	vb.waitFor("announcing X", func() bool { return vb.has(x, 0) })
	va.waitFor("announcing X through the node tier", func() bool { return va.has(x, 0) })
	// B writes past its node share (16 blocks): X leaves the node tier
	// (A's log removes it), not B's pool of 40 slots.
	fill := digests("B's other prompts", 24)
	storeBlocks(t, b, fill[:20*32], 20, 100)
	va.waitFor("removing X", func() bool { return !va.has(x, 0) })
	vb.holdsFor("announcing X while its pool holds it", 200*time.Millisecond, func() bool { return vb.has(x, 0) })
	// X leaves B's pool too: removed.
	storeBlocks(t, b, digests("B's later prompts", 40), 40, 200)
	vb.waitFor("removing X", func() bool { return !vb.has(x, 0) })
}

// A new node process (a new epoch): B rebuilds the node tier's set from
// its log, withdrawing the blocks the old process held, and announces what
// the new one is given.
func TestNodeEventsNodeRestart(t *testing.T) {
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
	vb := followEvents(t, b)
	d := digests("before the restart", 3)
	storeBlocks(t, a, d, 3, 1)
	describeBlocks(t, a, d, 3)
	vb.waitFor("announcing A's blocks", allOf(vb, d, 3, true))
	old := b.srv.State().L2.Node.Epoch
	cancel()
	<-done
	startNodeTier(t, sock)
	reattached := func(s *sidecar.NodeState) bool { return s.Connected && s.Epoch != old }
	waitNode(t, b, reattached, "re-attached")
	waitNode(t, a, reattached, "re-attached")
	e := digests("after the restart", 2)
	storeBlocks(t, a, e, 2, 50)
	describeBlocks(t, a, e, 2)
	vb.waitFor("rebuilt from the new node process", func() bool {
		return allOf(vb, d, 3, false)() && allOf(vb, e, 2, true)()
	})
	if len(vb.set) != 2 {
		t.Fatalf("B announces %d blocks, want 2", len(vb.set))
	}
	if n := b.srv.State().L2.Node.Counts["events_rebuilds"]; n < 1 {
		t.Fatalf("B rebuilt %d times", n)
	}
}

// A rebuild that reads the new node process's log in several replies (one
// datagram each) withdraws nothing that the new process holds too: pod B
// announced A's blocks from the old process; a new one, holding the same
// blocks (pod C wrote and described them), takes its socket.
func TestNodeEventsRebuildKeepsWhatStays(t *testing.T) {
	const n, per = 600, 64 // some 350 bytes an entry: 4 replies
	cfg := func(dir string) node.ServerConfig {
		return node.ServerConfig{Dir: dir, PoolBytes: 2 * n * (slot + node.SlotHeadroom), SlotBytes: slot, PodShare: 1, PodIdentity: node.IdentityDeclared}
	}
	serve := func(dir string) (*node.Server, func()) {
		nt, err := node.NewServer(cfg(dir), zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { nt.Serve(ctx); close(done) }()
		stop := func() { cancel(); <-done }
		t.Cleanup(stop)
		return nt, stop
	}
	base, err := os.MkdirTemp("", "rs-nt-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(base)
	dir1, dir2 := filepath.Join(base, "1"), filepath.Join(base, "2")
	nt1, stop1 := serve(dir1)
	nt2, _ := serve(dir2)
	big := func(sock, pod string) *harness {
		h := newHarness(t, func(c *sidecar.Config) {
			withNodeTier(sock, pod)(c)
			c.PoolBytes = 2 * n * slot
			c.L2.Tier.WriteSlots = 2 * n
		})
		waitNode(t, h, func(s *sidecar.NodeState) bool { return s.Connected }, "attached")
		return h
	}
	a, b, c := big(nt1.Socket(), "pod-a"), big(nt1.Socket(), "pod-b"), big(nt2.Socket(), "pod-c")
	vb := followEvents(t, b)
	d := digests("a long shared prompt", n)
	for _, h := range []*harness{a, c} {
		for i := 0; i < n; i += 50 { // within the node window's 64 slots
			storeBlocks(t, h, d[i*32:(i+50)*32], 50, 1+i)
			waitNode(t, h, func(s *sidecar.NodeState) bool { return s.Counts["writes_stored"] == uint64(i+50) }, "written")
		}
		describeBlocksN(t, h, "", d, n, per)
		waitNode(t, h, func(s *sidecar.NodeState) bool { return s.Counts["described"] == n }, "described")
	}
	vb.waitFor("announcing A's blocks", allOf(vb, d, n, true))
	old := b.srv.State().L2.Node.Epoch
	stop1()
	if err := os.Rename(nt2.Socket(), nt1.Socket()); err != nil {
		t.Fatal(err)
	}
	waitNode(t, b, func(s *sidecar.NodeState) bool { return s.Connected && s.Epoch != old }, "attached to the new process")
	waitNode(t, b, func(s *sidecar.NodeState) bool { return s.Counts["events_rebuilds"] >= 1 }, "rebuilt")
	vb.holdsFor("announcing every block", 300*time.Millisecond, allOf(vb, d, n, true))
	if vb.removed != 0 {
		t.Fatalf("the rebuild withdrew %d blocks the new process holds", vb.removed)
	}
	if got := vb.set[hex.EncodeToString(d[:32])]; len(got) != per {
		t.Fatalf("block 0 announced with %d tokens, want %d", len(got), per)
	}
}
