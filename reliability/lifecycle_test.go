package reliability

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// Slot lifecycle (issue #16, points 1 to 4): a slot must never be handed on
// while a copy that touches it is still running, and a load copies exactly
// what was stored. The races are made deterministic with a userfaultfd
// (uffd_test.go): the copy blocks on a missing page of the engine memory
// until the test has done the racing thing.

func init() {
	defect(Defect{Issue: 16, Point: 1, Title: "Release during a Load of the same lease unpins the slots while the copy runs: another tenant's next store lands there and the loader's pages receive it; an Acquire over one digest repeated 8192 times gives an 8192-block lease (duplicates not collapsed, a lease larger than the pool)",
		Tests:  "TestReleaseDuringLoad, TestAcquireDuplicateDigests",
		Before: "at d6f9fd5: TestReleaseDuringLoad: \"tenant A's load (err <nil>) delivered tenant B's bytes into 24 of 24 pages\"; TestAcquireDuplicateDigests: \"a view of 1 distinct present digests repeated to 8192 gave a lease of 8192 blocks (pool: 1024 slots)\" (2 alternating digests: 8192 blocks too)",
		Fix:    "a Load pins its blocks for its own copy (cache.BeginLoad) until it ends, whatever happens to the lease; a repeated digest ends the prefix, so a lease pins distinct blocks and never more than the pool"})
	defect(Defect{Issue: 16, Point: 2, Title: "Lease expiry (TTL) during a Load in flight unpins the slots mid-copy: same cross-tenant leak as a Release",
		Tests:  "TestLeaseExpiryDuringLoad",
		Before: "at d6f9fd5: lease expired (state miss) 1.1 s into the stalled load; \"tenant A's load (err <nil>) delivered tenant B's bytes into 24 of 24 pages\"",
		Fix:    "a block whose write deadline passes during its copy is doomed: it leaves the index, keeps its slots until the copy ends, and the late commit is discarded (ErrDoomed)"})
	defect(Defect{Issue: 16, Point: 3, Title: "The --write-timeout reaper frees slots whose Store copy is still running; the late copy overwrites the block another tenant stored there next, which Lookup keeps reporting as a hit",
		Tests:  "TestWriteTimeoutDuringStore",
		Before: "at d6f9fd5: the reaper freed all 16 slots of the stalled store, B stored 16 there, then A's late copy overwrote them: \"writer-b: 16 of its 16 Lookup hits load bytes that are not its own\"",
		Fix:    "a namespace's first store fixes its block size; a Load or Store through pages of another size is refused with status 17, so a copy moves exactly one stored block"})
	defect(Defect{Issue: 16, Point: 4, Title: "A Load through pages of another size than the stored block's is served: a 4 KiB block loaded through 256 KiB pages returns 252 KiB of the slot's previous occupant (stored length not recorded, slot tail never cleared)",
		Tests:  "TestPageGeometryMismatch",
		Before: "at d6f9fd5: 4 KiB -> 256 KiB: \"served (status 0); the page now holds 128 own, 8064 another tenant's chunks\" (252 KiB of the evicted block of tenant B); 256 KiB -> 4 KiB: served (status 0), page changed"})
}

// chunk is the unit pages are judged in: fillPage's content is a hash chain
// of 32-byte links, so every chunk of every tenant's page is distinct.
const chunk = 32

// chunkSet holds the chunks of pages written by other tenants.
type chunkSet map[[chunk]byte]bool

func (cs chunkSet) add(p []byte) {
	for i := 0; i+chunk <= len(p); i += chunk {
		cs[[chunk]byte(p[i:i+chunk])] = true
	}
}

// verdict counts the chunks of a destination page by origin.
type verdict struct{ own, pattern, zero, foreign, other int }

func (v verdict) String() string {
	return fmt.Sprintf("%d own, %d pattern, %d zero, %d another tenant's, %d unknown (chunks of %d bytes)", v.own, v.pattern, v.zero, v.foreign, v.other, chunk)
}

// judge classifies each chunk of got: the loader's own stored bytes at that
// position, the pattern the page held before the load, zeros, another
// tenant's bytes, or something else.
func judge(got, own, pattern []byte, foreign chunkSet) verdict {
	var v verdict
	var zero [chunk]byte
	for i := 0; i+chunk <= len(got); i += chunk {
		c := got[i : i+chunk]
		switch {
		case bytes.Equal(c, own[i:i+chunk]):
			v.own++
		case bytes.Equal(c, pattern[i:i+chunk]):
			v.pattern++
		case foreign[[chunk]byte(c)]:
			v.foreign++
		case bytes.Equal(c, zero[:]):
			v.zero++
		default:
			v.other++
		}
	}
	return v
}

// pageRegion is engine memory of this process with pages of any size.
type pageRegion struct {
	buf []byte
	ps  int
	reg schema.RegisterRegion
}

func newPageRegion(id uint32, pageSize, pages int) *pageRegion {
	buf := make([]byte, pageSize*pages)
	return &pageRegion{buf: buf, ps: pageSize, reg: schema.RegisterRegion{
		Region: id, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint64(len(buf)), PageSize: uint64(pageSize), PageCount: uint32(pages),
	}}
}

func (r *pageRegion) page(i int) []byte { return r.buf[i*r.ps : (i+1)*r.ps] }

func submitLoad(t *testing.T, c *connector.Client, lease uint64, region, first uint32, pages []uint32) uint64 {
	t.Helper()
	seq, err := c.Submit(schema.TypeLoad, (&schema.Load{Lease: lease, Region: region, First: first, Pages: pages}).Append(nil))
	if err != nil {
		t.Fatal(err)
	}
	return seq
}

func submitStore(t *testing.T, c *connector.Client, v schema.View, region uint32, pages []uint32) uint64 {
	t.Helper()
	seq, err := c.Submit(schema.TypeStore, (&schema.Store{View: v, Region: region, Pages: pages}).Append(nil))
	if err != nil {
		t.Fatal(err)
	}
	return seq
}

// awaitReply collects a common Reply; a non-zero status is an error.
func awaitReply(c *connector.Client, seq uint64) (schema.Reply, error) {
	var r schema.Reply
	b, err := c.Await(seq)
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	return r, r.Err()
}

func awaitStore(c *connector.Client, seq uint64) (schema.StoreReply, error) {
	var r schema.StoreReply
	b, err := c.Await(seq)
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}

// tenant is one attached engine with its blocks: digests d (batch 1), its
// content tag, and a source region (id 1) holding its pages.
type tenant struct {
	name string
	c    *connector.Client
	d    []byte
	n    int
	tag  uint64
	src  *region
	next uint32 // next free region id
}

func newTenant(t *testing.T, sock, name, model, salt string, n int, tag uint64) *tenant {
	t.Helper()
	o := opts(sock, name)
	o.Salt, o.Timeout = salt, 5*time.Second
	if model != "" {
		o.Model = model
	}
	tn := &tenant{name: name, c: dial(t, o), d: digests("lifecycle-"+name, n), n: n, tag: tag, src: newRegion(1, n), next: 2}
	for i := 0; i < n; i++ {
		fillPage(tn.src.page(i), tn.digest(i), tag)
	}
	if err := tn.c.RegisterRegion(tn.src.reg); err != nil {
		t.Fatal(err)
	}
	if _, err := tn.c.PutHashes(1, tn.d, false); err != nil {
		t.Fatal(err)
	}
	return tn
}

func (tn *tenant) digest(i int) []byte { return tn.d[i*32 : (i+1)*32] }
func (tn *tenant) view() schema.View   { return schema.View{Batch: 1, Count: uint32(tn.n)} }

// store stores all its blocks from its source region.
func (tn *tenant) store(t *testing.T) schema.StoreReply {
	t.Helper()
	r, err := tn.c.Store(tn.view(), 1, iota32(tn.n))
	if err != nil {
		t.Fatalf("%s: store: %v", tn.name, err)
	}
	return r
}

// own is the content the tenant stored for block i.
func (tn *tenant) own(i, size int) []byte {
	p := make([]byte, size)
	fillPage(p, tn.digest(i), tn.tag)
	return p
}

// checkHits looks up the tenant's blocks and loads every hit into fresh
// memory: each must be byte-exact (a hit is a promise of the tenant's own
// bytes). It returns the number of hits and describes the bad pages.
func (tn *tenant) checkHits(t *testing.T, foreign chunkSet) (hits int, bad []string) {
	t.Helper()
	hits, err := tn.c.Lookup(tn.view())
	if err != nil {
		t.Fatalf("%s: lookup: %v", tn.name, err)
	}
	if hits == 0 {
		return 0, nil
	}
	l, err := tn.c.Acquire(schema.View{Batch: 1, Count: uint32(hits)}, time.Minute)
	if err != nil {
		t.Fatalf("%s: acquire of %d hits: %v", tn.name, hits, err)
	}
	defer tn.c.Release(l.Lease)
	dst := newRegion(tn.next, int(l.Blocks))
	tn.next++
	if err := tn.c.RegisterRegion(dst.reg); err != nil {
		t.Fatal(err)
	}
	if _, err := tn.c.Load(l.Lease, dst.reg.Region, 0, iota32(int(l.Blocks))); err != nil {
		return hits, []string{fmt.Sprintf("%s: loading its %d hits failed: %v", tn.name, l.Blocks, err)}
	}
	for i := 0; i < int(l.Blocks); i++ {
		if !pageOK(dst.page(i), tn.digest(i), tn.tag) {
			v := judge(dst.page(i), tn.own(i, slot), make([]byte, slot), foreign)
			bad = append(bad, fmt.Sprintf("%s block %d: %v", tn.name, i, v))
		}
	}
	return hits, bad
}

// checkAlive fails the test if the sidecar died or no longer serves a new
// session (the panic check is in sidecar.stop).
func checkAlive(t *testing.T, sc *sidecar) {
	t.Helper()
	if !sc.alive() {
		t.Fatalf("the sidecar died (%v): %s", sc.waitErr, sc.logTail())
	}
	c, err := connector.Dial(opts(sc.sock, "alive-check"))
	if err != nil {
		t.Fatalf("the sidecar refuses a new session: %v", err)
	}
	defer c.Close()
	if err := c.Ping(42); err != nil {
		t.Fatalf("a new session's ping: %v", err)
	}
}

// loadRace is the scenario of points 1 and 2: tenant A loads all its
// leased blocks into engine memory whose first page is missing, so the copy
// stalls before it copied a byte; meanwhile race makes the lease go (release
// or expiry) and tenant B stores as many blocks as A holds into a full pool
// (only A's blocks are evictable: a bystander C pins the rest). Then the
// page is placed and the copy goes on.
//
// race returns what it saw, and a function that waits for whatever it left
// in flight on A's client (called after the page is placed, before A's
// client is used again: a Client is not safe for concurrent use).
func loadRace(t *testing.T, row *Row, extra []string, race func(a *tenant, lease uint64) (string, func())) {
	const slots, nC = 32, 8
	const nA = slots - nC
	// The test pins the whole pool on purpose (a bystander holds what A does
	// not): the pin quota of point 15 is TestPinQuota's.
	args := append([]string{"--pool.bytes", fmt.Sprint(slots * slot), "--copy.workers", "4", "--limits.pin-share", "1"}, extra...)
	sc := startSidecar(t, newDir(t), args...)
	a := newTenant(t, sc.sock, "loader-a", "", "tenant-a", nA, 0xA)
	b := newTenant(t, sc.sock, "attacker-b", "", "tenant-b", nA, 0xB)
	c := newTenant(t, sc.sock, "bystander-c", "other-model", "tenant-c", nC, 0xC)
	if r := c.store(t); r.Stored != nC {
		t.Fatalf("bystander store: %+v", r)
	}
	lc, err := c.c.Acquire(c.view(), time.Minute)
	if err != nil || lc.Blocks != nC {
		t.Fatalf("bystander acquire: %+v %v", lc, err)
	}
	if r := a.store(t); r.Stored != nA {
		t.Fatalf("loader store: %+v (pool %+v)", r, sc.state().Pool)
	}
	la, err := a.c.Acquire(a.view(), time.Minute)
	if err != nil || la.Blocks != nA {
		t.Fatalf("loader acquire: %+v %v", la, err)
	}
	pattern := func(i int) []byte {
		p := make([]byte, slot)
		fillPage(p, a.digest(i), 0xEE)
		return p
	}
	dst := stalledOrSkip(t, nA, func(i int, p []byte) { copy(p, pattern(i)) }, 0)
	if dst.page != slot {
		t.Skipf("the OS page is %d bytes; the test needs %d-byte pages (one engine page per OS page)", dst.page, slot)
	}
	if err := a.c.RegisterRegion(regionOver(9, dst.mem).reg); err != nil {
		t.Fatal(err)
	}
	loadSeq := submitLoad(t, a.c, la.Lease, 9, 0, iota32(nA))
	if err := dst.waitFault(10 * time.Second); err != nil {
		t.Fatalf("the load's copy never reached the engine memory: %v", err)
	}
	raced, settle := race(a, la.Lease)
	// The attacker stores into the full pool while A's copy is stalled.
	rb, err := b.c.Store(b.view(), 1, iota32(nA))
	if err != nil {
		t.Logf("attacker's store: %v", err)
	}
	if err := dst.resolve(); err != nil {
		t.Fatal(err)
	}
	settle()
	rep, lerr := awaitReply(a.c, loadSeq)
	foreign := chunkSet{}
	for i := 0; i < nA; i++ {
		foreign.add(b.src.page(i))
	}
	for i := 0; i < nC; i++ {
		foreign.add(c.src.page(i))
	}
	var leaked, wrong []string
	for i := 0; i < nA; i++ {
		got := dst.mem[i*slot : (i+1)*slot]
		v := judge(got, a.own(i, slot), pattern(i), foreign)
		if v.foreign > 0 {
			leaked = append(leaked, fmt.Sprintf("page %d: %v", i, v))
		}
		switch {
		case v.foreign > 0: // reported above
		case lerr == nil && v.own != slot/chunk, lerr != nil && v.other > 0:
			wrong = append(wrong, fmt.Sprintf("page %d: %v", i, v))
		}
	}
	row.add("%s while A's load of %d blocks was stalled at its first page; B's store into the full %d-slot pool: stored %d, skipped %d (%v); A's load: value %d, err %v", raced, nA, slots, rb.Stored, rb.Skipped, err, rep.Value, lerr)
	if len(leaked) > 0 {
		t.Errorf("tenant A's load (err %v) delivered tenant B's bytes into %d of %d pages; first: %s", lerr, len(leaked), nA, leaked[0])
	}
	if len(wrong) > 0 {
		t.Errorf("tenant A's load (err %v) left %d of %d pages neither byte-exact (on success) nor pattern/own/zeros (on failure); first: %s", lerr, len(wrong), nA, wrong[0])
	}
	// The bystander's pinned blocks load byte-exact.
	if _, err := c.c.Load(lc.Lease, 1, 0, iota32(nC)); err != nil {
		t.Errorf("bystander's load: %v", err)
	} else {
		for i := 0; i < nC; i++ {
			if !pageOK(c.src.page(i), c.digest(i), c.tag) {
				t.Errorf("bystander's block %d is not its own", i)
			}
		}
	}
	c.c.Release(lc.Lease)
	// Every hit left in any namespace loads byte-exact.
	all := chunkSet{}
	for _, tn := range []*tenant{a, b, c} {
		for i := 0; i < tn.n; i++ {
			all.add(tn.own(i, slot))
		}
	}
	for _, tn := range []*tenant{a, b, c} {
		hits, bad := tn.checkHits(t, all)
		row.add("%s: %d hits afterwards, %d bad", tn.name, hits, len(bad))
		for _, s := range bad {
			t.Errorf("a Lookup hit loads wrong bytes: %s", s)
		}
	}
	checkAlive(t, sc)
}

// TestReleaseDuringLoad: issue #16 point 1 (first half).
func TestReleaseDuringLoad(t *testing.T) {
	row := record(t, "Isolation", "tenant A releases its lease while its Load of the leased blocks is still copying (copy held at the first page by a userfaultfd); tenant B then stores into the full pool",
		"a slot is not reused while a copy on it runs: A's load delivers its own bytes or fails leaving pattern/own/zeros, never B's; the bystander's and every remaining hit's loads are byte-exact", "")
	loadRace(t, row, []string{"--lease.ttl", "30s"}, func(a *tenant, lease uint64) (string, func()) {
		seq, err := a.c.Submit(schema.TypeRelease, schema.IDRequest{ID: lease}.Append(nil))
		if err != nil {
			t.Fatal(err)
		}
		// A fixed sidecar may hold the reply until the copy ends: wait a
		// bounded time, then let the attacker go on regardless.
		done := make(chan error, 1)
		go func() { _, err := awaitReply(a.c, seq); done <- err }()
		select {
		case err := <-done:
			return fmt.Sprintf("release answered (%v)", err), func() {}
		case <-time.After(time.Second):
			return "release not answered within 1 s", func() {
				if err := <-done; err != nil {
					t.Logf("release, answered after the copy: %v", err)
				}
			}
		}
	})
}

// TestLeaseExpiryDuringLoad: issue #16 point 2.
func TestLeaseExpiryDuringLoad(t *testing.T) {
	row := record(t, "Isolation", "tenant A's lease reaches its TTL (--lease.ttl 1s) while its Load is still copying (held at the first page by a userfaultfd); tenant B then stores into the full pool",
		"expiry obeys the same rule as release: A's load delivers its own bytes or fails leaving pattern/own/zeros, never B's; the bystander's and every remaining hit's loads are byte-exact", "")
	const ttl = time.Second
	loadRace(t, row, []string{"--lease.ttl", ttl.String()}, func(a *tenant, lease uint64) (string, func()) {
		// The load renewed the lease for --lease.ttl; wait it out, with
		// a margin for the reaper (every 100 ms), or until Poll says it
		// is gone.
		t0 := time.Now()
		for time.Since(t0) < ttl+2*time.Second {
			time.Sleep(50 * time.Millisecond)
			if r, err := a.c.Poll(lease); err == nil && r.State == schema.StateMiss {
				return fmt.Sprintf("lease expired (state miss after %v)", time.Since(t0).Round(10*time.Millisecond)), func() {}
			}
		}
		return fmt.Sprintf("lease still alive %v after the load began", time.Since(t0).Round(10*time.Millisecond)), func() {}
	})
}

// TestAcquireDuplicateDigests: issue #16 point 1 (second half). A view
// that names the same present block many times must not pin it as many
// blocks: a lease never has more blocks than distinct digests, nor than the
// pool has slots.
func TestAcquireDuplicateDigests(t *testing.T) {
	row := record(t, "Isolation", "Acquire over a view of one present digest repeated 8192 times, and of two digests alternating 4096 times each, on a 1024-slot pool",
		"the lease has at most as many blocks as distinct digests (duplicates collapsed) and never more than the pool's slots; a refusal (non-zero status) is also acceptable", "")
	sc := startSidecar(t, newDir(t), "--lease.ttl", "30s")
	c := dial(t, opts(sc.sock, "dup"))
	slots := int(c.Info().PoolSlots)
	src := newRegion(1, 2)
	d := digests("dup-digest", 2)
	for i := 0; i < 2; i++ {
		fillPage(src.page(i), d[i*32:(i+1)*32], 0xD)
	}
	c.RegisterRegion(src.reg)
	if _, err := c.PutHashes(1, d, false); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Store(schema.View{Batch: 1, Count: 2}, 1, []uint32{0, 1}); err != nil || r.Stored != 2 {
		t.Fatalf("store: %+v %v", r, err)
	}
	for _, tc := range []struct {
		name     string
		distinct int
		n        int
	}{{"one digest x8192", 1, 8192}, {"two digests alternating x4096", 2, 8192}} {
		t.Run(tc.name, func(t *testing.T) {
			batch := uint64(10 + tc.distinct)
			for off := 0; off < tc.n; off += 1024 {
				view := make([]byte, 0, 1024*32)
				for i := off; i < off+1024; i++ {
					k := i % tc.distinct
					view = append(view, d[k*32:(k+1)*32]...)
				}
				if _, err := c.PutHashes(batch, view, off > 0); err != nil {
					t.Fatal(err)
				}
			}
			l, err := c.Acquire(schema.View{Batch: batch, Count: uint32(tc.n)}, time.Minute)
			if err != nil {
				row.add("%s: refused (%v)", tc.name, err)
				return
			}
			defer c.Release(l.Lease)
			row.add("%s: lease of %d blocks (%d distinct, pool %d slots)", tc.name, l.Blocks, tc.distinct, slots)
			if int(l.Blocks) > tc.distinct || int(l.Blocks) > slots {
				t.Errorf("a view of %d distinct present digests repeated to %d gave a lease of %d blocks (pool: %d slots): duplicates are not collapsed", tc.distinct, tc.n, l.Blocks, slots)
			}
		})
	}
	checkAlive(t, sc)
}

// TestWriteTimeoutDuringStore: issue #16 point 3. Tenant A's store is held
// at the first page of its engine memory (userfaultfd) past --write-timeout;
// tenant B then stores into the 16-slot pool; then A's copy goes on.
func TestWriteTimeoutDuringStore(t *testing.T) {
	row := record(t, "Isolation", "tenant A's Store copy is held (userfaultfd on its first engine page) past --write-timeout 1s; tenant B stores 16 blocks into the 16-slot pool; then A's copy completes",
		"the reaper does not hand on a slot whose copy runs: afterwards every Lookup hit in either namespace loads byte-exact (B's blocks hold B's bytes; A's reaped store is never a hit with wrong bytes)", "")
	const n = 16
	const wt = time.Second
	sc := startSidecar(t, newDir(t), "--pool.bytes", fmt.Sprint(n*slot), "--copy.workers", "4", "--write-timeout", wt.String())
	o := opts(sc.sock, "writer-a")
	o.Salt, o.Timeout = "tenant-a", 5*time.Second
	ac := dial(t, o)
	a := &tenant{name: "writer-a", c: ac, d: digests("lifecycle-writer-a", n), n: n, tag: 0xA, next: 2}
	src := stalledOrSkip(t, n, func(i int, p []byte) { fillPage(p, a.digest(i), a.tag) }, 0)
	if src.page != slot {
		t.Skipf("the OS page is %d bytes; the test needs %d-byte pages", src.page, slot)
	}
	if err := ac.RegisterRegion(regionOver(1, src.mem).reg); err != nil {
		t.Fatal(err)
	}
	if _, err := ac.PutHashes(1, a.d, false); err != nil {
		t.Fatal(err)
	}
	storeSeq := submitStore(t, ac, a.view(), 1, iota32(n))
	if err := src.waitFault(10 * time.Second); err != nil {
		t.Fatalf("A's store copy never reached its engine memory: %v", err)
	}
	// Wait out the write timeout (the reaper runs every 100 ms), or until
	// no write is in flight any more.
	t0 := time.Now()
	var p poolStats
	for time.Since(t0) < wt+2*time.Second {
		time.Sleep(50 * time.Millisecond)
		if p = sc.state().Pool; p.Writing == 0 {
			break
		}
	}
	reaped := fmt.Sprintf("after %v: %d writing, %d free of %d", time.Since(t0).Round(10*time.Millisecond), p.Writing, p.Free, p.Capacity)
	b := newTenant(t, sc.sock, "writer-b", "", "tenant-b", n, 0xB)
	rb, berr := b.c.Store(b.view(), 1, iota32(n))
	if err := src.resolve(); err != nil {
		t.Fatal(err)
	}
	ra, aerr := awaitStore(ac, storeSeq)
	row.add("A's store stalled; %s; B's store: stored %d, skipped %d (%v); A's store completed: stored %d, skipped %d (%v)", reaped, rb.Stored, rb.Skipped, berr, ra.Stored, ra.Skipped, aerr)
	all := chunkSet{}
	for _, tn := range []*tenant{a, b} {
		for i := 0; i < n; i++ {
			all.add(tn.own(i, slot))
		}
	}
	for _, tn := range []*tenant{b, a} {
		hits, bad := tn.checkHits(t, all)
		row.add("%s: %d hits, %d load wrong bytes", tn.name, hits, len(bad))
		if len(bad) > 0 {
			t.Errorf("%s: %d of its %d Lookup hits load bytes that are not its own; first: %s", tn.name, len(bad), hits, bad[0])
		}
	}
	checkAlive(t, sc)
}

// TestPageGeometryMismatch: issue #16 point 4. The pool has 256 KiB slots,
// all filled by tenant B; tenant A stores one block through pages of one
// size (evicting one of B's) and loads it through pages of the other size.
func TestPageGeometryMismatch(t *testing.T) {
	row := record(t, "Isolation", "on a pool of 256 KiB slots full of tenant B's blocks, tenant A stores a block from 4 KiB pages and loads it through 256 KiB pages, and the reverse",
		"a load through pages whose size differs from the stored block's length is refused (non-zero status) and no byte of the destination page changes", "")
	const big, small, slots = 256 << 10, 4 << 10, 16
	for _, tc := range []struct {
		name            string
		storePS, loadPS int
	}{
		{"store 4KiB load 256KiB", small, big},
		{"store 256KiB load 4KiB", big, small},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := startSidecar(t, newDir(t), "--pool.slot-bytes", "256KiB", "--pool.bytes", fmt.Sprint(slots*big))
			ob := opts(sc.sock, "geo-b")
			ob.Salt = "tenant-b"
			bc := dial(t, ob)
			bsrc := newPageRegion(1, big, slots)
			bd := digests("geometry-b", slots)
			foreign := chunkSet{}
			for i := 0; i < slots; i++ {
				fillPage(bsrc.page(i), bd[i*32:(i+1)*32], 0xB)
				foreign.add(bsrc.page(i))
			}
			if err := bc.RegisterRegion(bsrc.reg); err != nil {
				t.Fatal(err)
			}
			bc.PutHashes(1, bd, false)
			if r, err := bc.Store(schema.View{Batch: 1, Count: slots}, 1, iota32(slots)); err != nil || r.Stored != slots {
				t.Fatalf("B fills the pool: %+v %v", r, err)
			}
			oa := opts(sc.sock, "geo-a")
			oa.Salt = "tenant-a"
			ac := dial(t, oa)
			ad := digests("geometry-a", 1)
			asrc := newPageRegion(1, tc.storePS, 1)
			fillPage(asrc.page(0), ad, 0xA)
			adst := newPageRegion(2, tc.loadPS, 1)
			fillPage(adst.page(0), ad, 0xEE)
			before := append([]byte(nil), adst.page(0)...)
			for _, r := range []*pageRegion{asrc, adst} {
				if err := ac.RegisterRegion(r.reg); err != nil {
					t.Fatal(err)
				}
			}
			ac.PutHashes(1, ad, false)
			if r, err := ac.Store(schema.View{Batch: 1, Count: 1}, 1, []uint32{0}); err != nil || r.Stored != 1 {
				t.Fatalf("A's store: %+v %v", r, err)
			}
			l, err := ac.Acquire(schema.View{Batch: 1, Count: 1}, time.Minute)
			if err != nil || l.Blocks != 1 {
				t.Fatalf("A's acquire: %+v %v", l, err)
			}
			_, lerr := ac.Load(l.Lease, 2, 0, []uint32{0})
			got := adst.page(0)
			changed := !bytes.Equal(got, before)
			own := make([]byte, tc.loadPS)
			copy(own, asrc.page(0)) // what the stored block holds at each offset
			if tc.storePS < tc.loadPS {
				own = own[:tc.storePS]
			}
			var v verdict
			if len(own) == len(got) {
				v = judge(got, own, before, foreign)
			} else {
				v = judge(got[:len(own)], own, before[:len(own)], foreign)
				tail := judge(got[len(own):], make([]byte, len(got)-len(own)), before[len(own):], foreign)
				v.pattern += tail.pattern
				v.foreign += tail.foreign
				v.zero += tail.own // the zero "own" of the tail
				v.other += tail.other
			}
			row.add("%s: load err %v; destination page changed: %v (%v)", tc.name, lerr, changed, v)
			if lerr == nil {
				t.Errorf("a load through %d-byte pages of a block stored from %d-byte pages was served (status 0); the page now holds %v", tc.loadPS, tc.storePS, v)
			}
			if changed {
				t.Errorf("the refused or mismatched load changed the destination page: %v", v)
			}
			checkAlive(t, sc)
		})
	}
}
