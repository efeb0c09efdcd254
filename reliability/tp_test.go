package reliability

import (
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// TestTPRanksAgree: a tensor-parallel engine (world size 2) whose rank 1
// dies after storing half the blocks; every rank and the scheduler must see
// the same blocks, and each rank must load its own shard.
func TestTPRanksAgree(t *testing.T) {
	row := record(t, "Faults", "tensor parallelism (world size 2): rank 1 dies after storing 4 of the 8 blocks rank 0 stored; a new rank 1 attaches; a rank attaches with another world size",
		"scheduler, rank 0 and the new rank 1 report the same hit count (only blocks both ranks committed); the half-stored blocks are invisible and reclaimed after --write-timeout; each rank loads its own shard byte-exact under the scheduler's lease; a mismatched world size is refused (status 12)",
		"4. TP > 1 consistency")
	sc := startSidecar(t, newDir(t), "--write-timeout", "1s")
	tp := func(role uint16, rank int) connector.Options {
		o := opts(sc.sock, "tp")
		o.WorldSize, o.Rank, o.Role = 2, rank, role
		return o
	}
	sched := dial(t, tp(schema.RoleScheduler, 0))
	w0 := dial(t, tp(schema.RoleWorker, 0))
	w1, err := connector.Dial(tp(schema.RoleWorker, 1))
	if err != nil {
		t.Fatal(err)
	}
	r0, r1 := newRegion(1, 16), newRegion(1, 16)
	d := digests("tp-prompt", 8)
	for j := 0; j < 8; j++ {
		fillPage(r0.page(j), d[j*32:(j+1)*32], 100)
		fillPage(r1.page(j), d[j*32:(j+1)*32], 101)
	}
	w0.RegisterRegion(r0.reg)
	w1.RegisterRegion(r1.reg)
	if _, err := sched.PutHashes(1, d, false); err != nil {
		t.Fatal(err)
	}
	v := schema.View{Batch: 1, Count: 8}
	if r, err := w0.Store(v, 1, iota32(8)); err != nil || r.Stored != 8 {
		t.Fatalf("rank 0: %+v %v", r, err)
	}
	if r, err := w1.Store(schema.View{Batch: 1, Count: 4}, 1, iota32(4)); err != nil || r.Stored != 4 {
		t.Fatalf("rank 1: %+v %v", r, err)
	}
	w1.Abandon() // rank 1 dies
	w1n := dial(t, tp(schema.RoleWorker, 1))
	r1n := newRegion(1, 16)
	w1n.RegisterRegion(r1n.reg)
	counts := []int{}
	for _, c := range []*connector.Client{sched, w0, w1n} {
		n, err := c.Lookup(v)
		if err != nil {
			t.Fatal(err)
		}
		counts = append(counts, n)
	}
	if counts[0] != 4 || counts[1] != 4 || counts[2] != 4 {
		t.Fatalf("ranks disagree: scheduler, rank 0, rank 1 see %v blocks, want 4 each", counts)
	}
	l, err := sched.Acquire(v, time.Minute)
	if err != nil || l.Blocks != 4 {
		t.Fatalf("acquire %+v %v", l, err)
	}
	p0, _ := w0.Poll(l.Lease)
	p1, _ := w1n.Poll(l.Lease)
	if p0.State != p1.State || p0.Blocks != p1.Blocks {
		t.Fatalf("ranks see the lease differently: %+v %+v", p0, p1)
	}
	if _, err := w0.Load(l.Lease, 1, 0, []uint32{8, 9, 10, 11}); err != nil {
		t.Fatal(err)
	}
	if _, err := w1n.Load(l.Lease, 1, 0, []uint32{8, 9, 10, 11}); err != nil {
		t.Fatal(err)
	}
	for j := 0; j < 4; j++ {
		if !pageOK(r0.page(8+j), d[j*32:(j+1)*32], 100) || !pageOK(r1n.page(8+j), d[j*32:(j+1)*32], 101) {
			t.Fatalf("block %d: a rank loaded the wrong shard", j)
		}
	}
	sched.Release(l.Lease)
	pending := sc.state().Pool.PendingBlocks
	// The half-stored blocks go after the write timeout.
	t0 := time.Now()
	for {
		p := sc.state().Pool
		if p.PendingBlocks == 0 && p.Used == 2*p.Blocks {
			break
		}
		if time.Since(t0) > 5*time.Second {
			t.Fatalf("half-stored blocks not reclaimed: %+v", p)
		}
		time.Sleep(20 * time.Millisecond)
	}
	reclaimed := time.Since(t0)
	o := tp(schema.RoleWorker, 0)
	o.WorldSize = 4
	if _, err := connector.Dial(o); status(err) != schema.ErrCodeNotPermitted {
		t.Fatalf("another world size: %v", err)
	}
	row.add("scheduler, rank 0, new rank 1 all see %v blocks; %d half-stored blocks invisible, reclaimed %v after the lease ended (write timeout 1 s); both ranks loaded their own shard; world size 4 refused with status 12", counts[0], pending, reclaimed.Round(time.Millisecond))
}
