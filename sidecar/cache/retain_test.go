package cache

import (
	"math/rand/v2"
	"testing"
	"time"
)

// retain is Retain for key with owner 0.
func (x *tc) retain(ns NamespaceID, ds []byte, key uint32, limit int, ttl time.Duration, prio int, now int64) (int, bool) {
	x.t.Helper()
	return x.retainAs(ns, ds, key, 0, limit, ttl, prio, now)
}

func (x *tc) retainAs(ns NamespaceID, ds []byte, key uint32, owner uint64, limit int, ttl time.Duration, prio int, now int64) (int, bool) {
	x.t.Helper()
	n, short, err := x.c.Retain(ns, ds, Charge{Key: key, Limit: limit}, owner, ttl, prio, now)
	if err != nil {
		x.t.Fatal(err)
	}
	x.check()
	return n, short
}

// endRetain is EndRetain for key with owner 0.
func (x *tc) endRetain(ns NamespaceID, ds []byte, key uint32) int {
	x.t.Helper()
	return x.endRetainAs(ns, ds, key, 0)
}

func (x *tc) endRetainAs(ns NamespaceID, ds []byte, key uint32, owner uint64) int {
	x.t.Helper()
	n, err := x.c.EndRetain(ns, ds, key, owner)
	if err != nil {
		x.t.Fatal(err)
	}
	x.check()
	return n
}

// evictions stores new blocks from digest 1000 on, one at a time, each
// pinned (so that eviction has to take the blocks already there), and
// returns the order in which the blocks of ids left the pool (every store
// must succeed).
func (x *tc) evictions(ns NamespaceID, ids ...int) []int {
	x.t.Helper()
	var got []int
	for i := 1000; len(got) < len(ids); i++ {
		if i > 1000+len(ids)*2+x.c.Capacity() {
			x.t.Fatalf("evicted %v of %v", got, ids)
		}
		x.store(ns, dig(i, 8), 0)
		x.acquire(ns, 0, dig(i, 8), 99, time.Hour, 0)
		for _, j := range ids {
			if x.c.find(uint16(ns), dig(j, 8)) == NoSlot && !contains(got, j) {
				got = append(got, j)
			}
		}
	}
	return got
}

func sameInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestRetainEvictionOrder(t *testing.T) {
	x := newTC(t, 6)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 6; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	if n, short := x.retain(ns, digs(8, 1, 2), 1, 0, time.Second, 2, 0); n != 2 || short {
		t.Fatalf("retain [1 2] = %d %v", n, short)
	}
	if n, _ := x.retain(ns, digs(8, 3), 1, 0, time.Second, 0, 0); n != 1 {
		t.Fatalf("retain [3] = %d", n)
	}
	if n, _ := x.retain(ns, digs(8, 5), 1, 0, time.Second, 1, 0); n != 1 {
		t.Fatalf("retain [5] = %d", n)
	}
	// Unhinted 4 and 6 go first (oldest first), then by priority: 3 (0),
	// 5 (1), then the prefix [1 2] (2) from its tail.
	if got, want := x.evictions(ns, 1, 2, 3, 4, 5, 6), []int{4, 6, 3, 5, 2, 1}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
	if s := x.c.Stats(); s.RetainedBlocks != 0 || s.NoSpace != 0 || s.Blocks != 6 {
		t.Fatalf("stats %+v", s)
	}
}

func TestRetainLeadingRunAndTouch(t *testing.T) {
	x := newTC(t, 6)
	ns := x.ns(8, 1, 0)
	for _, i := range []int{1, 2, 4} {
		x.store(ns, dig(i, 8), 0)
	}
	// 3 is missing: only [1 2] are retained, 4 stays unhinted.
	if n, _ := x.retain(ns, digs(8, 1, 2, 3, 4), 1, 0, time.Second, 0, 0); n != 2 {
		t.Fatalf("retain = %d, want 2", n)
	}
	// A repeated digest does not count twice.
	if n, _ := x.retain(ns, digs(8, 1, 1), 1, 0, time.Second, 0, 0); n != 1 {
		t.Fatalf("retain of a repeat = %d, want 1", n)
	}
	// A hit moves 2 to the front of its own list: 1 goes first.
	x.lookup(ns, digs(8, 2))
	for _, i := range []int{5, 6, 7} {
		x.store(ns, dig(i, 8), 0)
	}
	if got, want := x.evictions(ns, 1, 2, 4), []int{4, 1, 2}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
}

func TestRetainExpiry(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 4; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	x.retain(ns, digs(8, 4), 9, 100, 10*time.Millisecond, 3, 0)
	if got := x.c.RetainedCharged(9); got != 1 || x.c.PinnedCharged(9) != 0 {
		t.Fatalf("charged %d, want 1", got)
	}
	if d, ok := x.c.NextDeadline(); !ok || d != 10*ms {
		t.Fatalf("next deadline %d %v", d, ok)
	}
	if r := x.c.Reap(9 * ms); r.Retained != 0 {
		t.Fatalf("reaped early: %+v", r)
	}
	if r := x.c.Reap(10 * ms); r.Retained != 1 {
		t.Fatalf("reap: %+v", r)
	}
	x.check()
	if got := x.c.RetainedCharged(9); got != 0 {
		t.Fatalf("charged %d after expiry", got)
	}
	// 4 was the most recent block; its retention ended, so it went to the
	// LRU's tail: first to go.
	if got, want := x.evictions(ns, 1, 2, 3, 4), []int{4, 1, 2, 3}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
	if s := x.c.Stats(); s.ExpiredRetains != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestEndRetain(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 4; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	x.retain(ns, digs(8, 3, 4), 1, 0, time.Hour, 0, 0)
	if n := x.endRetain(ns, digs(8, 3, 4), 2); n != 0 {
		t.Fatalf("another key ended %d", n)
	}
	if n := x.endRetain(ns, digs(8, 3, 4, 4, 9), 1); n != 2 {
		t.Fatalf("end = %d, want 2", n)
	}
	if d, ok := x.c.NextDeadline(); ok {
		t.Fatalf("deadline %d left", d)
	}
	// Ended blocks go to the LRU's tail, the prefix's tail last.
	if got, want := x.evictions(ns, 1, 2, 3, 4), []int{4, 3, 1, 2}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
}

func TestRetainOneKeyPerBlock(t *testing.T) {
	x := newTC(t, 4)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 3; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	x.retain(ns, digs(8, 1, 2), 1, 10, 10*time.Millisecond, 0, 0)
	// Another key changes nothing and is charged nothing, but the run goes
	// on past the blocks it cannot take.
	if n, short := x.retain(ns, digs(8, 1, 2, 3), 2, 10, time.Hour, 3, 0); n != 1 || short {
		t.Fatalf("retain by key 2 = %d %v, want 1", n, short)
	}
	if a, b := x.c.RetainedCharged(1), x.c.RetainedCharged(2); a != 2 || b != 1 {
		t.Fatalf("charges %d %d, want 2 1", a, b)
	}
	// The same key renews (and raises the priority).
	if n, _ := x.retain(ns, digs(8, 1), 1, 10, 50*time.Millisecond, 3, 5*ms); n != 1 {
		t.Fatalf("renew = %d", n)
	}
	if a := x.c.RetainedCharged(1); a != 2 {
		t.Fatalf("renewal charged again: %d", a)
	}
	if r := x.c.Reap(20 * ms); r.Retained != 1 {
		t.Fatalf("reap at 20ms: %+v, want block 2 only", r)
	}
	if a := x.c.RetainedCharged(1); a != 1 {
		t.Fatalf("charge after block 2 expired: %d", a)
	}
	if r := x.c.Reap(55 * ms); r.Retained != 1 {
		t.Fatalf("reap at 55ms: %+v, want block 1", r)
	}
	x.check()
}

func TestRetainShare(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 6; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	// A key with a share of 3 slots retains 3 blocks, no more.
	if n, short := x.retain(ns, digs(8, 1, 2, 3, 4, 5), 7, 3, time.Hour, 3, 0); n != 3 || !short {
		t.Fatalf("retain = %d %v, want 3 short", n, short)
	}
	if n, short := x.retain(ns, digs(8, 4), 7, 3, time.Hour, 3, 0); n != 0 || !short {
		t.Fatalf("retain at the share = %d %v", n, short)
	}
	// Renewing what it holds costs nothing.
	if n, short := x.retain(ns, digs(8, 1, 2, 3), 7, 3, time.Hour, 3, 0); n != 3 || short {
		t.Fatalf("renewal = %d %v", n, short)
	}
	// The pins have a bound of their own: retention takes none of it,
	// whether the lease pins the retained blocks or others.
	l, short, err := x.c.AcquireCharged(ns, 0, digs(8, 4, 5, 6), 1, time.Second, 0, Charge{Key: 7, Limit: 3})
	if err != nil || l.Blocks != 3 || short {
		t.Fatalf("acquire of unretained blocks %+v %v %v", l, short, err)
	}
	if got, ret := x.c.PinnedCharged(7), x.c.RetainedCharged(7); got != 3 || ret != 3 {
		t.Fatalf("pins %d retained %d, want 3 3", got, ret)
	}
	x.check()
	if err := x.c.Release(l.ID); err != nil {
		t.Fatal(err)
	}
	l, short, err = x.c.AcquireCharged(ns, 0, digs(8, 1, 2, 3, 4), 1, time.Second, 0, Charge{Key: 7, Limit: 3})
	if err != nil || l.Blocks != 3 || !short {
		t.Fatalf("acquire of retained blocks %+v %v %v", l, short, err)
	}
	if got, ret := x.c.PinnedCharged(7), x.c.RetainedCharged(7); got != 3 || ret != 3 {
		t.Fatalf("pins %d retained %d, want 3 3", got, ret)
	}
	x.check()
	// Other keys still store: retained blocks stay evictable.
	for i := 10; i < 20; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	if err := x.c.Release(l.ID); err != nil {
		t.Fatal(err)
	}
	x.check()
	x.evictions(ns, 1, 2, 3)
	if got := x.c.RetainedCharged(7); got != 0 {
		t.Fatalf("charged %d after the retained blocks were evicted", got)
	}
	if s := x.c.Stats(); s.RetainedBlocks != 0 || s.NoSpace != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// A retention belongs to its key and owner: another owner of the same key
// can neither renew it, change its priority nor end it, and its Retain
// goes on past such blocks; the owners of a key share its bound.
func TestRetainOwners(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 6; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	if n, _ := x.retainAs(ns, digs(8, 1, 2), 5, 100, 4, 10*time.Millisecond, 3, 0); n != 2 {
		t.Fatalf("retain by owner 100 = %d", n)
	}
	// Owner 200 of key 5 (and owner 0) find 1 and 2 taken: they go on past
	// them, retain 3, and change nothing of owner 100's.
	if n, short := x.retainAs(ns, digs(8, 1, 2, 3), 5, 200, 4, time.Hour, 0, 5*ms); n != 1 || short {
		t.Fatalf("retain by owner 200 = %d %v, want 1", n, short)
	}
	if n, _ := x.retain(ns, digs(8, 1, 2), 5, 4, time.Hour, 0, 5*ms); n != 0 {
		t.Fatalf("retain by owner 0 = %d", n)
	}
	if n := x.endRetainAs(ns, digs(8, 1, 2), 5, 200); n != 0 {
		t.Fatalf("owner 200 ended %d of owner 100's", n)
	}
	if n := x.endRetain(ns, digs(8, 1, 2), 5); n != 0 {
		t.Fatalf("owner 0 ended %d of owner 100's", n)
	}
	// Another key with owner 100 is someone else too.
	if n := x.endRetainAs(ns, digs(8, 1, 2), 6, 100); n != 0 {
		t.Fatalf("key 6 ended %d of key 5's", n)
	}
	// The owners of key 5 share its bound: 3 slots retained of 4.
	if got := x.c.RetainedCharged(5); got != 3 {
		t.Fatalf("key 5 retains %d slots, want 3", got)
	}
	if n, short := x.retainAs(ns, digs(8, 4, 5), 5, 300, 4, time.Hour, 0, 5*ms); n != 1 || !short {
		t.Fatalf("retain by owner 300 = %d %v, want 1 short", n, short)
	}
	// Owner 100's priority is still 3: evicted after owner 200's and 300's
	// blocks (priority 0), and its deadline is still 10 ms.
	r := x.c.Reap(10 * ms)
	if r.Retained != 2 {
		t.Fatalf("reap at 10 ms: %+v, want owner 100's 2 blocks", r)
	}
	x.check()
	if n, _ := x.retainAs(ns, digs(8, 1, 2), 5, 100, 4, time.Hour, 3, 10*ms); n != 2 {
		t.Fatalf("owner 100 retains again: %d", n)
	}
	if n, short := x.retainAs(ns, digs(8, 5), 5, 300, 4, time.Hour, 0, 10*ms); n != 0 || !short {
		t.Fatalf("retain past the bound = %d %v", n, short)
	}
	if n := x.endRetainAs(ns, digs(8, 3, 4), 5, 200); n != 1 {
		t.Fatalf("owner 200 ended %d of its own, want 1", n)
	}
	// 3 ended last: the LRU's tail, before the unretained 5 and 6; then
	// owner 300's 4 (priority 0), then owner 100's 1 and 2 (priority 3).
	if got, want := x.evictions(ns, 1, 2, 3, 4, 5, 6), []int{3, 5, 6, 4, 2, 1}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
}

func TestRetainPinnedBlock(t *testing.T) {
	x := newTC(t, 3)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 3; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	l := x.acquire(ns, 0, digs(8, 1), 1, time.Second, 0)
	x.retain(ns, digs(8, 1), 1, 0, time.Hour, 1, 0)
	x.store(ns, dig(4, 8), 0)
	x.store(ns, dig(5, 8), 0)
	if x.c.Release(l.ID) != nil {
		t.Fatal("release")
	}
	x.check()
	// Back in its retained list, not the LRU: 4 and 5 go first.
	if got, want := x.evictions(ns, 1, 4, 5), []int{4, 5, 1}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
	// A retention that expires while the block is pinned ends all the same.
	x2 := newTC(t, 3)
	ns2 := x2.ns(8, 1, 0)
	x2.store(ns2, dig(1, 8), 0)
	x2.retain(ns2, digs(8, 1), 3, 5, time.Millisecond, 0, 0)
	l2 := x2.acquire(ns2, 0, digs(8, 1), 1, time.Hour, 0)
	if r := x2.c.Reap(ms); r.Retained != 1 || r.Leases != 0 {
		t.Fatalf("reap %+v", r)
	}
	x2.check()
	if x2.c.Release(l2.ID) != nil {
		t.Fatal("release")
	}
	x2.check()
	if s := x2.c.Stats(); s.RetainedBlocks != 0 || s.Evictable != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestRetainTensorParallel(t *testing.T) {
	x := newTC(t, 8)
	ns := x.ns(8, 2, 0)
	for i := 1; i <= 4; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	if n, short := x.retain(ns, digs(8, 1, 2, 3), 4, 5, time.Hour, 2, 0); n != 2 || !short {
		t.Fatalf("retain = %d %v, want 2 blocks (4 slots of 5)", n, short)
	}
	if got := x.c.RetainedCharged(4); got != 4 {
		t.Fatalf("charged %d slots, want 4", got)
	}
	if got, want := x.evictions(ns, 1, 2, 3, 4), []int{3, 4, 2, 1}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
}

func TestRetainClearAndRemove(t *testing.T) {
	x := newTC(t, 6)
	a := x.ns(8, 1, 1)
	b := x.ns(8, 1, 2)
	for i := 1; i <= 2; i++ {
		x.store(a, dig(i, 8), 0)
		x.store(b, dig(i, 8), 0)
	}
	// Tenant a's retain never touches b's blocks of the same digests.
	x.retain(a, digs(8, 1, 2), 1, 0, time.Hour, 3, 0)
	if n := x.endRetain(b, digs(8, 1, 2), 1); n != 0 {
		t.Fatalf("end in b = %d", n)
	}
	if s := x.c.Stats(); s.RetainedBlocks != 2 {
		t.Fatalf("stats %+v", s)
	}
	if n, err := x.c.Clear(a); err != nil || n != 2 {
		t.Fatalf("clear = %d %v", n, err)
	}
	x.check()
	if err := x.c.RemoveNamespace(a); err != nil {
		t.Fatal(err)
	}
	x.check()
	if s := x.c.Stats(); s.RetainedBlocks != 0 || x.c.RetainedCharged(1) != 0 {
		t.Fatalf("stats %+v, charge %d", s, x.c.RetainedCharged(1))
	}
	if _, ok := x.c.NextDeadline(); ok {
		t.Fatal("a deadline left after clear")
	}
}

func TestRetainBadArguments(t *testing.T) {
	x := newTC(t, 2)
	ns := x.ns(8, 1, 0)
	x.store(ns, dig(1, 8), 0)
	if _, _, err := x.c.Retain(ns, dig(1, 8), Charge{Key: 1}, 0, 0, 0, 0); err == nil {
		t.Fatal("ttl 0 accepted")
	}
	_, _, err := x.c.Retain(ns, dig(1, 8), Charge{Key: 1}, 0, time.Second, RetainPriorities, 0)
	wantErr(t, err, ErrBadPriority)
	_, _, err = x.c.Retain(ns, dig(1, 8)[:5], Charge{Key: 1}, 0, time.Second, 0, 0)
	wantErr(t, err, ErrBadDigest)
	_, _, err = x.c.Retain(ns+5, dig(1, 8), Charge{Key: 1}, 0, time.Second, 0, 0)
	wantErr(t, err, ErrUnknownNamespace)
	_, err = x.c.EndRetain(ns+5, dig(1, 8), 1, 0)
	wantErr(t, err, ErrUnknownNamespace)
	_, err = x.c.EndRetain(ns, dig(1, 8)[:5], 1, 0)
	wantErr(t, err, ErrBadDigest)
	x.check()
}

// TestRetainRandomOps mixes retention with stores, leases, loads, expiry
// and Clear at random, checking every invariant (lists, side table,
// charges, timers) after each step.
func TestRetainRandomOps(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewPCG(seed, 3))
		x := newTC(t, 12)
		nss := []NamespaceID{x.ns(8, 1, 0), x.ns(8, 2, 1)}
		var leases []uint64
		now := int64(0)
		for step := 0; step < 400; step++ {
			noSpace := x.c.Stats().NoSpace
			ns := nss[rng.IntN(2)]
			ds := digs(8, rng.IntN(6), rng.IntN(6), rng.IntN(6))
			key := uint32(rng.IntN(3))
			switch op := rng.IntN(8); op {
			case 0, 1:
				w := int(ns) // world 1 or 2
				for r := 0; r < w; r++ {
					tk, st, err := x.c.BeginStore(ns, r, ds[:8], 1, now)
					if err != nil {
						t.Fatal(err)
					}
					if st == Allocated {
						x.commit(tk)
					}
				}
			case 2:
				x.lookup(ns, ds)
			case 3:
				l, _, err := x.c.AcquireCharged(ns, 0, ds, 1, time.Duration(1+rng.IntN(20))*time.Millisecond, now, Charge{Key: key, Limit: 6})
				if err != nil {
					t.Fatal(err)
				}
				if l.ID != 0 {
					leases = append(leases, l.ID)
				}
			case 4:
				if len(leases) > 0 {
					i := rng.IntN(len(leases))
					x.c.Release(leases[i])
					leases = append(leases[:i], leases[i+1:]...)
				}
			case 5:
				x.retainAs(ns, ds, key, uint64(rng.IntN(2)), 4, time.Duration(1+rng.IntN(20))*time.Millisecond, rng.IntN(RetainPriorities), now)
			case 6:
				x.endRetainAs(ns, ds, key, uint64(rng.IntN(2)))
			case 7:
				if rng.IntN(10) == 0 {
					x.c.Clear(ns)
				} else {
					now += int64(rng.IntN(5)) * ms
					x.c.Reap(now)
				}
			}
			x.check()
			for k := uint32(1); k < 3; k++ {
				if got := x.c.PinnedCharged(k); got > 6 {
					t.Fatalf("seed %d step %d: key %d charged %d pinned slots, limit 6", seed, step, k, got)
				}
				if got := x.c.RetainedCharged(k); got > 4 {
					t.Fatalf("seed %d step %d: key %d charged %d retained slots, limit 4", seed, step, k, got)
				}
			}
			// Retention never makes a store fail: only pins and
			// incomplete blocks do.
			if s := x.c.Stats(); s.NoSpace != noSpace && s.PinnedBlocks == 0 && s.PendingBlocks == 0 {
				t.Fatalf("seed %d step %d: NoSpace with nothing pinned: %+v", seed, step, s)
			}
		}
	}
}

// LRUTail visits blocks in the order eviction takes them: the LRU from its
// tail, then the retained lists from the lowest priority's tail.
func TestRetainLRUTailOrder(t *testing.T) {
	x := newTC(t, 6)
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 6; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	x.retain(ns, digs(8, 1, 2), 1, 0, time.Hour, 3, 0)
	x.retain(ns, digs(8, 5), 1, 0, time.Hour, 0, 0)
	var got []int
	x.c.LRUTail(10, func(_ NamespaceID, d []byte, _ bool) bool {
		got = append(got, int(d[7]))
		return true
	})
	if want := []int{3, 4, 6, 5, 2, 1}; !sameInts(got, want) {
		t.Fatalf("LRUTail %v, want %v", got, want)
	}
	got = got[:0]
	x.c.LRUTail(4, func(_ NamespaceID, d []byte, _ bool) bool {
		got = append(got, int(d[7]))
		return true
	})
	if want := []int{3, 4, 6, 5}; !sameInts(got, want) {
		t.Fatalf("LRUTail(4) %v, want %v", got, want)
	}
	if got, want := x.evictions(ns, 1, 2, 3, 4, 5, 6), []int{3, 4, 6, 5, 2, 1}; !sameInts(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
}

// TestRetainMQP2Evidence: under MQP2 a retention is evidence for the
// policy, not an order above it. A retained block stays in the policy's
// queues, a block read once lifted to count 2 (level 1), one read more
// kept where it is; the retained lists stay empty; expiry leaves the block where it
// is; a session's end (EndRetain) sends the blocks whose retention it
// ended that are read by at most 3 requests to the LRU end of queue 0,
// and leaves the others, and those of another owner, alone.
func TestRetainMQP2Evidence(t *testing.T) {
	c, err := New(Config{Capacity: 16, DeltaLogSize: 64, WriteTimeout: 100 * time.Millisecond, Epoch: 7, Policy: PolicyMQP2})
	if err != nil {
		t.Fatal(err)
	}
	x := &tc{t: t, c: c}
	ns := x.ns(8, 1, 0)
	for i := 1; i <= 6; i++ {
		x.store(ns, dig(i, 8), 0)
	}
	hot := c.find(uint16(ns), dig(6, 8))
	c.mqp.pol[hot] = 9   // read by many: level 3 (set by hand, listed at level 0)
	c.mqp.life = 1 << 40 // a measured lifetime, long: no block falls a level here
	level := func(i int) (uint8, uint8) {
		h := c.find(uint16(ns), dig(i, 8))
		return c.mqpLevelOf(h), c.mqpCount(h)
	}
	x.retainAs(ns, digs(8, 1), 5, 1, 100, 10*time.Millisecond, 1, 0)
	x.retainAs(ns, digs(8, 2), 5, 2, 100, 10*time.Millisecond, 1, 0)
	if lv, cnt := level(1); lv != 1 || cnt != 2 {
		t.Fatalf("retained block: level %d count %d, want 1 and 2", lv, cnt)
	}
	x.retainAs(ns, digs(8, 1), 5, 1, 100, 10*time.Millisecond, 1, 0) // renewed: no further
	if lv, cnt := level(1); lv != 1 || cnt != 2 {
		t.Fatalf("renewed block: level %d count %d, want 1 and 2", lv, cnt)
	}
	x.retainAs(ns, digs(8, 6), 5, 1, 100, 10*time.Millisecond, 1, 0)
	if lv, cnt := level(6); cnt != 9 || lv > 3 {
		t.Fatalf("a level-3 block: level %d count %d, want count 9 kept", lv, cnt)
	}
	for p := range c.retLen {
		if c.retLen[p] != 0 {
			t.Fatalf("retained list %d holds %d blocks under MQP2", p, c.retLen[p])
		}
	}
	// Expiry of 2's retention: nothing moves.
	lv2, cnt2 := level(2)
	if r := c.Reap(10 * ms); r.Retained != 3 {
		t.Fatalf("reap: %+v", r)
	}
	x.check()
	if lv, cnt := level(2); lv != lv2 || cnt != cnt2 {
		t.Fatalf("expiry moved block 2: level %d count %d, was %d %d", lv, cnt, lv2, cnt2)
	}
	// A session's end: block 3 (owner 1, level 1) goes first; block 4,
	// another owner's, stays.
	x.retainAs(ns, digs(8, 3), 5, 1, 100, time.Hour, 1, 20*ms)
	x.retainAs(ns, digs(8, 4), 5, 2, 100, time.Hour, 1, 20*ms)
	if n := x.endRetainAs(ns, digs(8, 1, 2, 3, 4, 5, 6), 5, 1); n != 1 {
		t.Fatalf("ended %d retentions, want 1 (block 3's)", n)
	}
	if h := c.find(uint16(ns), dig(3, 8)); c.prev[c.mqp.qSent[0]] != h {
		t.Fatalf("block 3 is not at the LRU end of queue 0 after its session's end")
	}
	if lv, _ := level(4); lv != 1 {
		t.Fatalf("another owner's retained block moved to level %d", lv)
	}
	x.check()
}
