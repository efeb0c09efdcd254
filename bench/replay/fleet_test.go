package replay

import (
	"testing"
	"time"

	"github.com/ringside-kv/ringside/internal/invariants"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// fleetReplay drives real caches (one per node) with the calls the Machine
// makes for the replay engine's sequence (sidecar/machine/l2.go: Lookup,
// then AcquireOpen, BeginFetch, CommitStore and ExtendLease for the tier's
// part; BeginStore and CommitStore for the store; PinBlock and EndLoad for
// write-through, in commit order; Release), with a set standing for the
// tier, every cache under pol. It returns the counts OracleFleet (the
// fleet model, oracleFleet, of that policy) gives.
func fleetReplay(t *testing.T, w *Workload, nodeOf []int, nodes, capacity int, tier bool, pol cache.Policy) FleetResult {
	t.Helper()
	type node struct {
		c  *cache.Cache
		ns cache.NamespaceID
	}
	var ns []node
	for i := 0; i < nodes; i++ {
		c, err := cache.New(cache.Config{Capacity: capacity, Epoch: 1, Policy: pol})
		if err != nil {
			t.Fatal(err)
		}
		id, err := c.AddNamespace(cache.NamespaceKey{Model: "m", Layout: 1, DigestWidth: DigestWidth, WorldSize: 1})
		if err != nil {
			t.Fatal(err)
		}
		ns = append(ns, node{c, id})
	}
	inTier := map[string]bool{}
	res := FleetResult{OracleResult: OracleResult{CapacityPages: capacity, Requests: len(w.Requests)}, Nodes: nodes, Tier: tier}
	var now int64
	ch := cache.Charge{Key: 1, Limit: capacity}
	for k, r := range w.Requests {
		now++
		n := ns[nodeOf[k]]
		c := n.c
		d := w.AppendDigests(nil, r.Pages)
		dg := func(i int) []byte { return d[i*DigestWidth : (i+1)*DigestWidth] }
		h, err := c.Lookup(n.ns, d)
		if err != nil {
			t.Fatal(err)
		}
		hits := h
		if tier {
			for hits < len(r.Pages) && inTier[string(dg(hits))] {
				hits++
			}
		}
		res.TotalPages += int64(len(r.Pages))
		res.HitPages += int64(hits)
		res.TierHitPages += int64(hits - h)
		var lease cache.Lease
		leased := 0
		if hits > 0 {
			if lease, _, err = c.AcquireOpen(n.ns, 0, d[:hits*DigestWidth], 1, time.Minute, now, ch); err != nil {
				t.Fatal(err)
			}
			if lease.Blocks != h {
				t.Fatalf("acquire pinned %d of %d", lease.Blocks, h)
			}
			leased = h
			if hits > h {
				var fetch [][]cache.Ticket
				covered := 0
				pend := cache.Charge{Key: 2, Limit: FetchPendingLimit(capacity)}
				for i := h; i < min(hits, capacity); i++ {
					ts, st, err := c.BeginFetch(n.ns, dg(i), 1, now, pend)
					if err != nil {
						t.Fatal(err)
					}
					if st == cache.AlreadyPresent {
						covered = i + 1 - h
						continue
					}
					if st != cache.Allocated {
						break
					}
					fetch = append(fetch, ts)
					covered = i + 1 - h
				}
				for _, ts := range fetch {
					for _, tk := range ts {
						if err := c.CommitStore(tk); err != nil {
							t.Fatal(err)
						}
					}
					res.FetchedPages++
				}
				added, _, err := c.ExtendLease(lease.ID, n.ns, d[h*DigestWidth:(h+covered)*DigestWidth], capacity)
				if err != nil {
					t.Fatal(err)
				}
				leased += added
			}
			if leased == 0 {
				res.MissedLeases++
				c.Release(lease.ID)
				lease = cache.Lease{}
			}
		}
		res.LoadedPages += int64(leased)
		var tickets []cache.Ticket
		var stored []int
		for i := leased; i < len(r.Pages); i++ {
			tk, st, err := c.BeginStore(n.ns, 0, dg(i), 1, now)
			if err != nil {
				t.Fatal(err)
			}
			switch st {
			case cache.Allocated:
				tickets = append(tickets, tk)
				stored = append(stored, i)
			case cache.AlreadyPresent, cache.InFlight:
				res.PresentPages++
			case cache.NoSpace:
				res.SkippedPages++
			}
		}
		var pins []uint64
		for j, tk := range tickets {
			if err := c.CommitStore(tk); err != nil {
				t.Fatal(err)
			}
			res.StoredPages++
			if tier {
				id, _, ok := c.PinBlock(n.ns, dg(stored[j]), false, nil)
				if !ok {
					t.Fatal("a committed block could not be pinned for its write")
				}
				c.Mark(n.ns, dg(stored[j]))
				pins = append(pins, id)
				inTier[string(dg(stored[j]))] = true
			}
		}
		for _, id := range pins { // one writer: the pins end in commit order
			c.EndLoad(id)
		}
		if lease.ID != 0 {
			if err := c.Release(lease.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, n := range ns {
		st := n.c.Stats()
		res.Evictions += int64(st.Evictions)
		res.Resident += n.c.Len(n.ns)
		if err := n.c.CheckInvariants(); err != nil {
			t.Fatal(err)
		}
	}
	return res
}

func TestOracleFleetMatchesCaches(t *testing.T) {
	w, err := Load([]string{testTrace}, LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	reqs := make([][]uint32, len(w.Requests))
	for i := range w.Requests {
		reqs[i] = w.Requests[i].Pages
	}
	for _, nodes := range []int{1, 2, 3} {
		nodeOf := make([]int, len(reqs))
		for i := range nodeOf {
			nodeOf[i] = i % nodes
		}
		for _, capacity := range []int{16, 200, 2000, 65536} {
			for _, tier := range []bool{false, true} {
				got, want := OracleFleet(reqs, nodeOf, nodes, w.NumPageIDs(), capacity, tier), fleetReplay(t, w, nodeOf, nodes, capacity, tier, cache.PolicyLRU)
				if got != want {
					t.Errorf("%d nodes, capacity %d, tier %v:\noracle %+v\ncaches %+v", nodes, capacity, tier, got, want)
				}
				o := Oracle(w, capacity)
				o.BlockHitPages = 0 // the fleet model does not count them
				if nodes == 1 && !tier && got.OracleResult != o {
					t.Errorf("one node without a tier differs from Oracle at %d: %+v", capacity, got)
				}
				if tier && nodes > 1 && capacity == 2000 && got.TierHitPages == 0 {
					t.Errorf("%d nodes: the tier never hit; the test should exercise it", nodes)
				}
			}
		}
	}
}

// TestOracleFleetMQPMatchesCaches: the fleet model with MQP2 (and MQP)
// pools, as --node-tier models its pods, against caches under that
// policy driven call for call, with and without a tier beneath them: the
// agentic workload in 16-token pages over three nodes (requests longer
// than the smaller pools, fetches cut short by the pending share, write
// pins between commits), and the shipped trace in 32-token pages. With
// invariants (the race detector's builds) or -short: 300 requests, MQP2
// at the smaller capacity only (about 10 s under the race detector).
func TestOracleFleetMQPMatchesCaches(t *testing.T) {
	n := 600
	if invariants.Enabled || testing.Short() {
		n = 300
	}
	ag, err := Generate(AgenticConfig{}, LoadOptions{PageTokens: 16, Limit: n})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := Load([]string{testTrace}, LoadOptions{PageTokens: 32})
	if err != nil {
		t.Fatal(err)
	}
	const nodes = 3
	for _, tc := range []struct {
		name   string
		w      *Workload
		caps   []int
		differ bool // from LRU pools at the first capacity: the check can tell them apart
	}{{"agentic, 16-token pages", ag, []int{600, 3000}, true}, {"trace, 32-token pages", tr, []int{1000, 8000}, false}} {
		reqs := workloadPages(tc.w)
		nodeOf := make([]int, len(reqs))
		for i := range nodeOf {
			nodeOf[i] = i % nodes
		}
		pols, caps := []cache.Policy{cache.PolicyMQP2, cache.PolicyMQP}, tc.caps
		if invariants.Enabled || testing.Short() {
			pols, caps = pols[:1], caps[:1]
		}
		for _, pol := range pols {
			for _, capacity := range caps {
				for _, tier := range []bool{false, true} {
					got := oracleFleet(reqs, nodeOf, nodes, tc.w.NumPageIDs(), capacity, tier, 0, pol.String())
					want := fleetReplay(t, tc.w, nodeOf, nodes, capacity, tier, pol)
					if got != want {
						t.Errorf("%s, %v, capacity %d, tier %v:\nmodel  %+v\ncaches %+v", tc.name, pol, capacity, tier, got, want)
					}
					if pol != cache.PolicyMQP2 || capacity != tc.caps[0] || !tc.differ {
						continue
					}
					if lru := OracleFleet(reqs, nodeOf, nodes, tc.w.NumPageIDs(), capacity, tier); got.HitPages == lru.HitPages {
						t.Errorf("%s, capacity %d, tier %v: MQP2 pools hit what LRU pools hit; the check cannot tell them apart", tc.name, capacity, tier)
					}
					if tier && (got.FetchedPages == 0 || got.Evictions == 0) {
						t.Errorf("%s, capacity %d: nothing fetched or evicted; the test should exercise both: %+v", tc.name, capacity, got)
					}
				}
			}
		}
	}
}
