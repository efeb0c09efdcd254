package reliability

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

func init() {
	childRoles["tenant"] = tenantChild
	defect(Defect{Issue: 16, Point: 11,
		Title:  "a lease is not bounded by the pool (an Acquire over one digest repeated 1M times gives a 1M-block lease on a 64-slot pool, 4 MiB kept per lease) and a session may hold 65,536 leases",
		Tests:  "TestLeaseBoundedByPool",
		Before: "1cc2144: an Acquire over 1,048,576 digests (64 distinct) gave a 1,048,576-block lease on a 64-slot pool; 64 such leases: +259 MiB of anonymous memory (bound 32 MiB); one session's 65,536 leases of 64 blocks: +74 MiB (bound 16 MiB)",
		Fix:    "a lease pins distinct blocks (at most the pool); leases are charged as metadata per session and uid",
	})
	defect(Defect{Issue: 16, Point: 12,
		Title:  "one Store from a session attached with world size 64 reserves 64 slots a block: it evicts every other tenant and leaves the pool unusable until the write timeout",
		Tests:  "TestWideWorldReservation",
		Before: "1cc2144: one Store of 64 blocks at world size 64 left 0 of the tenant's 32 blocks (1,008 slots reserved, 16 pending blocks, 32 evictions); the tenant's store of 16 new blocks right after: 0 stored, 16 skipped",
		Fix:    "the distinct blocks a uid's leases pin are bounded by --limits.pin-share (half the pool): a shorter lease, or status 7, past it",
	})
	defect(Defect{Issue: 16, Point: 15,
		Title:  "one tenant can pin the whole pool with renewable long leases: no other tenant can store",
		Tests:  "TestPinQuota",
		Before: "1cc2144: tenant A pinned 64 of 64 blocks; tenant B (uid 65534) then stored 0 of 8 blocks (8 skipped), and another namespace of A's uid 0 of 8",
	})
}

// anonKiB reads RssAnon of a process: its heap and stacks, without the
// shared memory (pool, rings) it maps, which the traffic of a test touches.
func anonKiB(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "RssAnon:") {
			v, _ := strconv.ParseInt(strings.Fields(line)[1], 10, 64)
			return v
		}
	}
	return -1
}

// --- another tenant, under another uid ---

// otherUIDDir returns a --dir for a sidecar that a process of uid 65534
// in the sidecar's group (gid 0) can reach: the sidecar creates it, and
// needs --group-access and --allow-uid 65534.
func otherUIDDir(t *testing.T) string {
	t.Helper()
	if os.Getuid() != 0 || os.Getgid() != 0 {
		t.Skip("needs root to run a tenant under another uid")
	}
	base := newDir(t)
	if err := os.Chmod(base, 0o750); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(base, "d")
}

// otherUIDFlags are the serve flags that let otherTenant attach.
var otherUIDFlags = []string{"--group-access", "--allow-uid", "65534"}

// tenantResult is what tenantChild did.
type tenantResult struct {
	UID           int
	Attach        string // empty if the attach succeeded, else the error
	AttachStatus  uint32
	PresentBefore int
	Stored        int
	Present       int // leading blocks present after its store
	Skipped       int
	StoreErr      string
	Acquired      int
	Loaded        int
	Bad           int // blocks loaded with bytes other than those stored
	Err           string
}

func (r tenantResult) String() string {
	b, _ := json.Marshal(r)
	return string(b)
}

// tenantChild is a tenant of its own (RS_SALT) in another process, of
// another uid: it attaches, stores RS_BLOCKS blocks of RS_PAGE bytes from
// its own memory, acquires and loads them back, checks every byte, and
// prints a tenantResult.
func tenantChild() int {
	res := tenantResult{UID: os.Getuid()}
	defer func() { json.NewEncoder(os.Stdout).Encode(res) }()
	n, page := envInt("RS_BLOCKS", 8), envInt("RS_PAGE", slot)
	salt := os.Getenv("RS_SALT")
	c, err := connector.Dial(connector.Options{Socket: os.Getenv("RS_SOCK"), Instance: "tenant-" + salt, Model: "llama-rel",
		Layout: "bf16/16/HND", Salt: salt, Timeout: 5 * time.Second})
	if err != nil {
		res.Attach, res.AttachStatus = err.Error(), uint32(status(err))
		return 0
	}
	defer c.Close()
	buf := make([]byte, 2*n*page)
	pg := func(i int) []byte { return buf[i*page : (i+1)*page] }
	err = c.RegisterRegion(schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint64(len(buf)), PageSize: uint64(page), PageCount: uint32(2 * n)})
	if err != nil {
		res.Err = "register: " + err.Error()
		return 0
	}
	d := digests(os.Getenv("RS_SEED"), n)
	tag := uint64(envInt("RS_TAG", 0xB))
	for j := 0; j < n; j++ {
		fillPage(pg(j), d[j*32:(j+1)*32], tag)
	}
	if _, err := c.PutHashes(1, d, false); err != nil {
		res.Err = "put hashes: " + err.Error()
		return 0
	}
	v := schema.View{Batch: 1, Count: uint32(n)}
	res.PresentBefore, _ = c.Lookup(v)
	sr, err := c.Store(v, 1, iota32(n))
	res.Stored, res.Skipped = int(sr.Stored), int(sr.Skipped)
	if err != nil {
		res.StoreErr = err.Error()
	}
	if res.Present, err = c.Lookup(v); err != nil {
		res.Err = "lookup: " + err.Error()
		return 0
	}
	if res.Present == 0 {
		return 0
	}
	l, err := c.Acquire(schema.View{Batch: 1, Count: uint32(res.Present)}, 30*time.Second)
	if err != nil {
		res.Err = "acquire: " + err.Error()
		return 0
	}
	defer c.Release(l.Lease)
	res.Acquired = int(l.Blocks)
	pages := make([]uint32, l.Blocks)
	for i := range pages {
		pages[i] = uint32(n + i)
	}
	if _, err := c.Load(l.Lease, 1, 0, pages); err != nil {
		res.Err = "load: " + err.Error()
		return 0
	}
	for i := range pages {
		if pageOK(pg(n+i), d[i*32:(i+1)*32], tag) {
			res.Loaded++
		} else {
			res.Bad++
		}
	}
	return 0
}

// otherTenant runs tenantChild as uid 65534 (gid 0, the sidecar's group)
// from a world-executable copy of the test binary.
func otherTenant(t *testing.T, sock, salt, seed string, blocks, page int) tenantResult {
	t.Helper()
	exe := filepath.Join(binDir, "reliability.test")
	if _, err := os.Stat(exe); err != nil {
		b, err := os.ReadFile(os.Args[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(exe, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := child("tenant", "RS_SOCK="+sock, "RS_SALT="+salt, "RS_SEED="+seed,
		fmt.Sprint("RS_BLOCKS=", blocks), fmt.Sprint("RS_PAGE=", page))
	cmd.Path, cmd.Args[0] = exe, exe
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 0}}
	out, err := cmd.Output()
	var res tenantResult
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		t.Fatalf("tenant as uid 65534: %v %v: %s", err, jerr, out)
	}
	if res.UID != 65534 {
		t.Fatalf("tenant ran as uid %d", res.UID)
	}
	return res
}

// --- 11. lease size ---

// TestLeaseBoundedByPool: Acquires over a view of one pool's worth of
// digests repeated to a million, and a session holding all the leases it
// may.
func TestLeaseBoundedByPool(t *testing.T) {
	row := record(t, "Resource exhaustion", "on a 64-slot pool, a session stores 64 blocks, registers a batch of those 64 digests repeated up to 1M times (appending until refused) and acquires 64 leases over the whole batch; then it acquires leases over its 64 blocks until refused",
		"no lease has more blocks than the pool has slots (or the Acquire is refused with a status); the 64 huge-view leases grow the sidecar's anonymous memory by < 32 MiB (64 leases of ≤ 64 blocks need < 64 KiB; 32 MiB is the Go heap's slack over the 32 MiB batch the session legitimately holds); the leases one session may hold are refused with status 7 before they grow it by 16 MiB (the manifest budgets 64 MiB of sidecar memory for 16 sessions, 4 MiB each: deploy/README.md, Sizing; the rest is heap slack)",
		"#16.11 lease size and count")
	sc := startSidecar(t, newDir(t), "--pool.bytes", "256KiB", "--lease.max-ttl", "10m")
	c := dial(t, opts(sc.sock, "leases"))
	slots := int(c.Info().PoolSlots)
	reg := newRegion(1, slots)
	if err := c.RegisterRegion(reg.reg); err != nil {
		t.Fatal(err)
	}
	d := digests("lease-bound", slots)
	for j := 0; j < slots; j++ {
		fillPage(reg.page(j), d[j*32:(j+1)*32], 0x11)
	}
	c.PutHashes(1, d, false)
	if r, err := c.Store(schema.View{Batch: 1, Count: uint32(slots)}, 1, iota32(slots)); err != nil || int(r.Stored) != slots {
		t.Fatalf("store: %+v %v", r, err)
	}
	// Batch 2: the pool's digests over and over, up to 1M digests.
	per := (c.MaxPayload() - 64) / 32 / slots * slots
	chunk := make([]byte, 0, per*32)
	for len(chunk) < per*32 {
		chunk = append(chunk, d...)
	}
	n, batchErr := 0, error(nil)
	for n < 1<<20 {
		m := min(per, 1<<20-n)
		if _, err := c.PutHashes(2, chunk[:m*32], n > 0); err != nil {
			if status(err) == 0xFFFF {
				t.Fatalf("registering the repeated batch at %d digests: %v", n, err)
			}
			batchErr = err
			break
		}
		n += m
	}
	if n == 0 {
		t.Fatalf("no repeated batch registered: %v", batchErr)
	}
	time.Sleep(200 * time.Millisecond)
	before := anonKiB(sc.pid())
	var maxBlocks uint32
	var refused int
	var leases []uint64
	for i := 0; i < 64; i++ {
		l, err := c.Acquire(schema.View{Batch: 2, Count: uint32(n)}, 10*time.Minute)
		if err != nil {
			if st := status(err); st == 0xFFFF {
				t.Fatalf("acquire over %d digests: %v", n, err)
			}
			refused++
			continue
		}
		maxBlocks = max(maxBlocks, l.Blocks)
		leases = append(leases, l.Lease)
	}
	time.Sleep(200 * time.Millisecond)
	huge := anonKiB(sc.pid()) - before
	if int(maxBlocks) > slots {
		t.Errorf("an Acquire over %d digests (%d distinct) gave a lease of %d blocks on a pool of %d slots", n, slots, maxBlocks, slots)
	}
	if huge > 32<<10 {
		t.Errorf("64 leases over a view of %d digests grew the sidecar's anonymous memory by %d MiB (bound 32 MiB)", n, huge>>10)
	}
	for _, l := range leases {
		if err := c.Release(l); err != nil {
			t.Fatal(err)
		}
	}
	// Then every lease the session may hold, over its 64 blocks.
	time.Sleep(200 * time.Millisecond)
	before2 := anonKiB(sc.pid())
	acq := (&schema.Acquire{View: schema.View{Batch: 1, Count: uint32(slots)}, TTLms: 600000}).Append(nil)
	var stop atomic.Bool
	ok, st, msg, err := hog(c, func(int) (uint16, []byte) { return schema.TypeAcquire, acq }, &stop)
	if err != nil {
		t.Fatalf("after %d leases: %v", ok, err)
	}
	time.Sleep(200 * time.Millisecond)
	many := anonKiB(sc.pid()) - before2
	if st != schema.ErrCodeTooLarge {
		t.Errorf("leases without end: %d accepted, then status %v %q (want status 7)", ok, st, msg)
	}
	if many > 16<<10 {
		t.Errorf("one session's %d leases of %d blocks grew the sidecar's anonymous memory by %d MiB (bound 16 MiB)", ok, slots, many>>10)
	}
	// The session and the sidecar still work.
	if err := c.Ping(1); err != nil {
		t.Fatal(err)
	}
	row.add("repeated batch: %d digests registered (%v); 64 Acquires over it: largest lease %d blocks on %d slots, %d refused; anonymous memory +%d KiB", n, batchErr, maxBlocks, slots, refused, huge)
	row.add("leases without end: %d accepted, then status %d %q; anonymous memory +%d KiB", ok, st, short(msg, 60), many)
}

// --- 12. world size against the pool ---

// TestWideWorldReservation: one Store from a session attached with world
// size 64 next to a tenant's stored blocks.
func TestWideWorldReservation(t *testing.T) {
	row := record(t, "Isolation", "a tenant stores 32 blocks in a 1024-slot pool; another session attaches as rank 0 of world size 64 (no other rank ever comes) and sends one Store of 64 blocks (64 slots reserved a block until --write-timeout, 30 s)",
		"the wide session's attach may be refused (non-zero status); if it stores, at least half of the tenant's 32 blocks survive and load byte-exact, and the tenant can at once store 16 new blocks (all stored) and load them byte-exact",
		"#16.12 world size and reservation")
	sc := startSidecar(t, newDir(t), "--write-timeout", "30s") // 4 MiB: 1024 slots
	ob := opts(sc.sock, "tenant")
	ob.Salt = "tenant"
	b := dial(t, ob)
	rb := newRegion(1, 96)
	if err := b.RegisterRegion(rb.reg); err != nil {
		t.Fatal(err)
	}
	d := digests("wide-tenant", 48)
	for j := 0; j < 48; j++ {
		fillPage(rb.page(j), d[j*32:(j+1)*32], 0x12)
	}
	b.PutHashes(1, d, false)
	if r, err := b.Store(schema.View{Batch: 1, Count: 32}, 1, iota32(32)); err != nil || r.Stored != 32 {
		t.Fatalf("tenant's store: %+v %v", r, err)
	}
	ow := opts(sc.sock, "wide")
	ow.Salt = "wide"
	ow.WorldSize = 64
	w, werr := connector.Dial(ow)
	var wr schema.StoreReply
	var wsErr error
	if werr != nil {
		if st := status(werr); st == 0xFFFF || st == schema.OK {
			t.Fatalf("wide attach: no status: %v", werr)
		}
	} else {
		defer w.Close()
		rw := newRegion(1, 64)
		for j := 0; j < 64; j++ {
			clear(rw.page(j))
		}
		if err := w.RegisterRegion(rw.reg); err != nil {
			t.Fatal(err)
		}
		w.PutHashes(1, digests("wide", 64), false)
		wr, wsErr = w.Store(schema.View{Batch: 1, Count: 64}, 1, iota32(64))
		if status(wsErr) == 0xFFFF && wsErr != nil {
			t.Fatalf("wide store: %v", wsErr)
		}
	}
	st := sc.state().Pool
	// At once: which of the tenant's blocks survive?
	var survivors []int
	for j := 0; j < 32; j++ {
		if n, err := b.Lookup(schema.View{Batch: 1, Start: uint32(j), Count: 1}); err != nil {
			t.Fatal(err)
		} else if n == 1 {
			survivors = append(survivors, j)
		}
	}
	if len(survivors) < 16 {
		t.Errorf("one Store of a world-size-64 session left %d of the tenant's 32 blocks (pool: %d reserved, %d pending blocks, %d evictions)", len(survivors), st.Reserved, st.PendingBlocks, st.Evictions)
	}
	loadOK := func(start, count int) int {
		t.Helper()
		l, err := b.Acquire(schema.View{Batch: 1, Start: uint32(start), Count: uint32(count)}, 10*time.Second)
		if err != nil || int(l.Blocks) != count {
			t.Errorf("acquire [%d, %d): %+v %v", start, start+count, l, err)
			return 0
		}
		defer b.Release(l.Lease)
		pages := make([]uint32, count)
		for i := range pages {
			pages[i] = uint32(48 + i)
			clear(rb.page(48 + i))
		}
		if _, err := b.Load(l.Lease, 1, 0, pages); err != nil {
			t.Errorf("load: %v", err)
			return 0
		}
		good := 0
		for i := range pages {
			j := start + i
			if pageOK(rb.page(48+i), d[j*32:(j+1)*32], 0x12) {
				good++
			} else {
				t.Errorf("tenant's block %d loaded wrong bytes", j)
			}
		}
		return good
	}
	for _, j := range survivors {
		loadOK(j, 1)
	}
	nr, err := b.Store(schema.View{Batch: 1, Start: 32, Count: 16}, 1, []uint32{32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47})
	if err != nil || nr.Stored != 16 {
		t.Errorf("the tenant's store of 16 new blocks right after: %+v %v", nr, err)
	}
	loaded := 0
	if nr.Stored == 16 {
		loaded = loadOK(32, 16)
	}
	if werr != nil {
		row.add("wide attach refused: %s", short(werr.Error(), 90))
	} else {
		row.add("wide Store of 64 blocks: stored %d, skipped %d (%v); pool then: %d slots reserved, %d pending blocks, %d evictions", wr.Stored, wr.Skipped, wsErr, st.Reserved, st.PendingBlocks, st.Evictions)
	}
	row.add("tenant: %d of 32 blocks survived (loaded byte-exact); its store of 16 new blocks right after: stored %d, skipped %d; %d loaded byte-exact", len(survivors), nr.Stored, nr.Skipped, loaded)
}

// --- 15. pins ---

// TestPinQuota: one tenant pins everything it can with long leases from
// two sessions; then a tenant of another uid, and a session of another
// namespace of the same uid, store.
func TestPinQuota(t *testing.T) {
	row := record(t, "Isolation", "tenant A (two sessions of one namespace) fills a 64-slot pool and pins everything it can: four 10-minute leases per session over each round of 64 new blocks it stores, until a round stores nothing or 8 rounds; then tenant B, a process of another uid, and a session of another namespace of A's uid store 8 blocks each",
		"B stores (Stored > 0) and loads every block it stored byte-exact; the other session of A's uid stores (Stored > 0): no tenant can pin the whole pool",
		"#16.15 pin quota")
	dir := otherUIDDir(t)
	sc := startSidecar(t, dir, append([]string{"--pool.bytes", "256KiB", "--lease.max-ttl", "10m"}, otherUIDFlags...)...)
	oa1, oa2 := opts(sc.sock, "pin-a1"), opts(sc.sock, "pin-a2")
	oa1.Salt, oa2.Salt = "a", "a"
	a1, a2 := dial(t, oa1), dial(t, oa2)
	slots := int(a1.Info().PoolSlots)
	reg := newRegion(1, slots)
	if err := a1.RegisterRegion(reg.reg); err != nil {
		t.Fatal(err)
	}
	var stored, leases, refused, rounds int
	for r := 0; r < 8; r++ {
		rounds++
		d := digests(fmt.Sprint("pin-a-", r), slots)
		for j := 0; j < slots; j++ {
			fillPage(reg.page(j), d[j*32:(j+1)*32], 0xA)
		}
		v := schema.View{Batch: uint64(10 + r), Count: uint32(slots)}
		a1.PutHashes(v.Batch, d, false)
		a2.PutHashes(v.Batch, d, false)
		sr, err := a1.Store(v, 1, iota32(slots))
		if err != nil {
			t.Fatalf("A's store: %v", err)
		}
		stored += int(sr.Stored)
		for _, c := range []*connector.Client{a1, a2} {
			for k := 0; k < 4; k++ {
				l, err := c.Acquire(v, 10*time.Minute)
				switch {
				case err != nil && status(err) == 0xFFFF:
					t.Fatalf("A's acquire: %v", err)
				case err != nil:
					refused++
				case l.Lease != 0:
					leases++
				}
			}
		}
		if sr.Stored == 0 {
			break
		}
	}
	st := sc.state().Pool
	res := otherTenant(t, sc.sock, "b", "pin-b", 8, slot)
	if res.Attach != "" || res.Err != "" {
		t.Errorf("tenant B (uid 65534): %v", res)
	}
	if res.Stored == 0 {
		t.Errorf("tenant B (uid 65534) stored none of 8 blocks: tenant A pins %d of %d blocks (%d evictable): %v", st.PinnedBlocks, slots, st.Evictable, res)
	} else if res.Bad != 0 || res.Present == 0 || res.Loaded != res.Present {
		t.Errorf("tenant B stored %d blocks, %d present, but loaded %d byte-exact, %d wrong: %v", res.Stored, res.Present, res.Loaded, res.Bad, res)
	}
	oc := opts(sc.sock, "pin-c")
	oc.Salt = "c"
	c := dial(t, oc)
	rc := newRegion(1, 8)
	c.RegisterRegion(rc.reg)
	dc := digests("pin-c", 8)
	for j := 0; j < 8; j++ {
		fillPage(rc.page(j), dc[j*32:(j+1)*32], 0xC)
	}
	c.PutHashes(1, dc, false)
	cr, err := c.Store(schema.View{Batch: 1, Count: 8}, 1, iota32(8))
	if err != nil || cr.Stored == 0 {
		t.Errorf("another namespace of A's uid stored none of 8 blocks (%+v %v): tenant A pins %d of %d blocks", cr, err, st.PinnedBlocks, slots)
	}
	row.add("A: %d rounds, %d blocks stored, %d leases held, %d acquires refused; pool then %d of %d blocks pinned, %d evictable", rounds, stored, leases, refused, st.PinnedBlocks, slots, st.Evictable)
	row.add("B (uid 65534): stored %d, skipped %d, loaded %d byte-exact (%s); the other namespace of A's uid: stored %d, skipped %d", res.Stored, res.Skipped, res.Loaded, short(res.StoreErr, 60), cr.Stored, cr.Skipped)
}
