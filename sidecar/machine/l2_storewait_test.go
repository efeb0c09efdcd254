package machine_test

import (
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/machine/machinetest"
)

// A block kept pending by a store whose copy never ends (a stalled chunk,
// or with world >= 2 a rank that never stores) must not collect, in the
// Machine's waits for stores, the acquires that waited for it once they
// resolved at their deadline and their metadata charge was given back
// (memory without a bound, outside the metadata limit). These loops run
// too long for a scenario; they drive the same Env as the scenarios.

// storeWaitEnv is a node whose copies and tier work are held: the store's
// copy never ends unless the test ends it, and the tier never answers.
func storeWaitEnv(t *testing.T) (*pure, *pureNode) {
	d := newPure(t)
	env := machinetest.New(t, machinetest.Config{
		Cache:   cache.Config{Capacity: 64, DeltaLogSize: 64, Epoch: 11},
		Machine: machine.Config{SlotBytes: 4096, MetaBytes: 64 << 20, RingBytes: 4 << 20, PinShare: 1, PendingShare: 1},
		L2:      machine.L2Config{Enabled: true, FetchTimeout: 50 * time.Millisecond},
		Host:    d.host,
	})
	env.HoldCopies, env.HoldTier = true, true
	return d, d.node(env)
}

func storeWaitSession(t *testing.T, d *pure, n *pureNode, role uint16, world, rank int) (*connector.Client, machine.SessionID) {
	t.Helper()
	s, err := n.Attach(scenario.AttachOptions{Instance: "i", Model: "m", Layout: "l", Role: role, Rank: rank, WorldSize: world, DigestWidth: 32})
	if err != nil {
		t.Fatal(err)
	}
	c := s.Client()
	m := d.Memory(8 * 4096)
	if err := c.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: purePID, Base: m.Base(),
		Length: 8 * 4096, PageSize: 4096, PageCount: 8}); err != nil {
		t.Fatal(err)
	}
	return c, s.(*pureSession).t.id
}

// store puts the digest and sends a store of it, whose copy the Env holds.
func storeHeld(t *testing.T, c *connector.Client, d []byte) {
	t.Helper()
	if _, err := c.PutHashesFlags(1, d, schema.FlagReplace); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: 1}, Region: 1, Pages: []uint32{0}}).Append(nil)); err != nil {
		t.Fatal(err)
	}
}

// acquireRelease acquires the block (the lease waits for the store) and
// releases the lease.
func acquireRelease(t *testing.T, c *connector.Client) {
	t.Helper()
	l, err := c.Acquire(schema.View{Batch: 1, Count: 1}, 0)
	if err != nil || l.State != schema.StateWaiting {
		t.Fatalf("acquire: %+v %v", l, err)
	}
	if err := c.Release(l.Lease); err != nil {
		t.Fatal(err)
	}
}

func storeWaitDigest() []byte {
	d := make([]byte, 32)
	copy(d, "l2 store wait")
	return d
}

func TestL2StoreWaitKeepsNoResolvedFetch(t *testing.T) {
	d, n := storeWaitEnv(t)
	c, id := storeWaitSession(t, d, n, schema.RoleClient, 1, 0)
	dg := storeWaitDigest()
	storeHeld(t, c, dg)
	if len(n.env.Copies) != 1 {
		t.Fatalf("%d copies in flight, want the store's", len(n.env.Copies))
	}
	base := n.env.M.Usage().MetaBytes
	for range 200 {
		acquireRelease(t, c)
		n.env.Tick(60 * time.Millisecond)
	}
	held := n.env.M.StoreWaiters(id, dg)
	t.Logf("metadata charged: %d before, %d after; resolved fetches kept waiting for the store: %d", base, n.env.M.Usage().MetaBytes, held)
	if held > 1 {
		t.Fatalf("the Machine keeps %d resolved, uncharged fetches (with their views, queries and sessions) waiting for a store", held)
	}
}

// With world 2, rank 0 stores and rank 1's store fails (and is retried)
// every 18 s: the block stays pending for ever (each store moves its
// deadline); the waits for it must not grow with every acquire.
func TestL2StoreWaitOnABlockPendingForEver(t *testing.T) {
	d, n := storeWaitEnv(t)
	c0, id0 := storeWaitSession(t, d, n, schema.RoleWorker, 2, 0)
	c1, id1 := storeWaitSession(t, d, n, schema.RoleWorker, 2, 1)
	dg := storeWaitDigest()
	storeHeld(t, c0, dg)
	n.env.EndCopy(0, nil, false)
	storeHeld(t, c1, dg)
	base := n.env.M.Usage().MetaBytes
	const N = 5000 // 300 s at one acquire per 60 ms
	for i := range N {
		if i%300 == 299 { // every 18 s: rank 1's copy fails, and it tries again
			if len(n.env.Copies) != 1 || n.env.Copies[0].Session != id1 {
				t.Fatalf("step %d: copies in flight %+v, want rank 1's store", i, n.env.Copies)
			}
			n.env.EndCopy(0, machinetest.ErrCopy, false)
			if _, err := c1.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: 1}, Region: 1, Pages: []uint32{0}}).Append(nil)); err != nil {
				t.Fatal(err)
			}
			if len(n.env.Copies) != 1 {
				t.Fatalf("retry %d: %d copies", i, len(n.env.Copies))
			}
		}
		acquireRelease(t, c0)
		n.env.Tick(60 * time.Millisecond)
	}
	held := n.env.M.StoreWaiters(id0, dg)
	t.Logf("after %v: metadata charged %d before, %d after; fetches pending %d; resolved fetches waiting for the store: %d",
		time.Duration(N)*60*time.Millisecond, base, n.env.M.Usage().MetaBytes, n.env.M.L2Counters().PendingFetches, held)
	if held > 1 {
		t.Fatalf("the Machine keeps %d resolved, uncharged fetches waiting for a store", held)
	}
}
