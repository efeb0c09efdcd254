package sidecar_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

const slot = 4096

// harness runs a real sidecar (in this process, on real shared memory and
// a real socket) and dials real clients to it.
type harness struct {
	t   testing.TB
	srv *sidecar.Server
	cfg sidecar.Config
}

func newHarness(t testing.TB, mod func(*sidecar.Config)) *harness {
	t.Helper()
	base := "/dev/shm"
	if _, err := os.Stat(base); err != nil {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "rs-sc-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := sidecar.Config{Dir: dir, PoolBytes: 64 * slot, Machine: machine.Config{SlotBytes: slot}, RingCapacity: 64 << 10, ReapInterval: 5 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := sidecar.New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
		// Shutdown removes every ring, the pool and the socket.
		if left, _ := os.ReadDir(dir); len(left) != 0 {
			t.Errorf("files left behind: %v", left)
		}
	})
	return &harness{t: t, srv: srv, cfg: srv.Config()}
}

func (h *harness) dial(mod func(*connector.Options)) *connector.Client {
	h.t.Helper()
	o := connector.Options{Socket: h.cfg.Socket, Instance: "engine-a", Model: "llama", Layout: "bf16/16/HND", Timeout: 5 * time.Second}
	if mod != nil {
		mod(&o)
	}
	c, err := connector.Dial(o)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { c.Close() })
	return c
}

// The sidecar attaches the versions from schema.MinVersion to
// schema.Version and refuses others with status 15.
func TestAttachVersions(t *testing.T) {
	h := newHarness(t, nil)
	for _, v := range []uint16{1, schema.MinVersion, schema.Version, schema.Version + 1} {
		o := connector.Options{Socket: h.cfg.Socket, Instance: "engine-a", Model: "llama", Layout: "l", Timeout: 5 * time.Second, Version: v}
		c, err := connector.Dial(o)
		ok := v >= schema.MinVersion && v <= schema.Version
		switch {
		case ok && err != nil:
			t.Errorf("version %d: %v", v, err)
		case !ok && status(err) != schema.ErrCodeBadVersion:
			t.Errorf("version %d: got %v, want status %v", v, err, schema.ErrCodeBadVersion)
		}
		if c != nil {
			c.Close()
		}
	}
}

// digests returns n chained 32-byte digests (as vLLM's sha256 block hashes).
func digests(seed string, n int) []byte {
	out := make([]byte, 0, n*32)
	prev := sha256.Sum256([]byte(seed))
	for i := 0; i < n; i++ {
		prev = sha256.Sum256(append(prev[:], byte(i)))
		out = append(out, prev[:]...)
	}
	return out
}

// region is engine memory of this process: pages of slot bytes.
type region struct {
	buf []byte
	reg schema.RegisterRegion
}

func newRegion(id uint32, pages int) *region {
	buf := make([]byte, pages*slot)
	return &region{buf: buf, reg: schema.RegisterRegion{
		Region: id, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint64(len(buf)), PageSize: slot, PageCount: uint32(pages),
	}}
}

func status(err error) schema.Status {
	var se *schema.Error
	if errors.As(err, &se) {
		return se.Status
	}
	return 0xFFFF
}

func TestBudgetWaitingAndExpiry(t *testing.T) {
	// Budget of 4 slots: a lease of 4 blocks fills it; the next waits.
	h := newHarness(t, func(c *sidecar.Config) { c.Machine.Budget = 4 * slot })
	c := h.dial(nil)
	src := newRegion(1, 8)
	c.RegisterRegion(src.reg)
	c.PutHashes(1, digests("b", 8), false)
	if r, err := c.Store(schema.View{Batch: 1, Count: 8}, 1, []uint32{0, 1, 2, 3, 4, 5, 6, 7}); err != nil || r.Stored != 8 {
		t.Fatalf("store: %+v %v", r, err)
	}
	l1, err := c.Acquire(schema.View{Batch: 1, Count: 4}, time.Minute)
	if err != nil || l1.State != schema.StateReady {
		t.Fatalf("first: %+v %v", l1, err)
	}
	l2, err := c.Acquire(schema.View{Batch: 1, Start: 4, Count: 2}, time.Minute)
	if err != nil || l2.State != schema.StateWaiting {
		t.Fatalf("second should wait: %+v %v", l2, err)
	}
	if _, err := c.Load(l2.Lease, 1, 0, []uint32{0}); status(err) != schema.ErrCodeBadState {
		t.Fatalf("load while waiting: %v", err)
	}
	// A short-lived third query: it waits, then resolves as a miss.
	l3, err := c.Acquire(schema.View{Batch: 1, Start: 6, Count: 2}, 30*time.Millisecond)
	if err != nil || l3.State != schema.StateWaiting {
		t.Fatalf("third: %+v %v", l3, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := c.Poll(l3.Lease)
		if err != nil {
			t.Fatal(err)
		}
		if p.State == schema.StateMiss {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting query never resolved: %+v", p)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := c.Release(l1.Lease); err != nil {
		t.Fatal(err)
	}
	if p, err := c.Poll(l2.Lease); err != nil || p.State != schema.StateReady {
		t.Fatalf("after release, second: %+v %v", p, err)
	}
	c.Release(l2.Lease)
	c.Release(l3.Lease)
	st := h.srv.State().Pool
	if st.Leases != 0 || st.PinnedBlocks != 0 || st.Free+st.Used != st.Capacity {
		t.Fatalf("accounting: %+v", st)
	}
}

// TestSnapshot pages through a live session's namespace: every present
// block once, bounded pages, and pages plus the log from the first page's
// cursor equal to what Lookup answers when blocks are stored and evicted
// between pages.
func TestSnapshot(t *testing.T) {
	h := newHarness(t, func(c *sidecar.Config) { c.Machine.SnapshotScan = 8 }) // 64 slots: 8 slots a page
	c := h.dial(nil)
	src := newRegion(1, 64)
	if err := c.RegisterRegion(src.reg); err != nil {
		t.Fatal(err)
	}
	slots := h.srv.State().Pool.Capacity
	// pages reads a whole snapshot, with between() run after every page
	// but the last, and returns the digests and the first page's cursor.
	pages := func(max uint32, between func()) (map[string]int, uint64, uint64, int) {
		t.Helper()
		got := map[string]int{}
		var epoch, seq, from uint64
		n := 0
		for {
			r, err := c.Snapshot(from, max)
			if err != nil {
				t.Fatal(err)
			}
			n++
			if n == 1 {
				epoch, seq = r.Epoch, r.Seq
			}
			if r.Width != 32 || (max != 0 && r.Len() > int(max)) {
				t.Fatalf("page %d: width %d, %d digests (max %d)", n, r.Width, r.Len(), max)
			}
			for i := 0; i < r.Len(); i++ {
				got[string(r.DigestAt(i))]++
			}
			if r.Done {
				if r.Next != uint64(slots) {
					t.Fatalf("done with next %d, %d slots", r.Next, slots)
				}
				return got, epoch, seq, n
			}
			if r.Next <= from || r.Next-from > 8 {
				t.Fatalf("page %d: from %d, next %d (scan bound 8)", n, from, r.Next)
			}
			from = r.Next
			if between != nil {
				between()
			}
		}
	}
	// Empty: one page, done, at the log's head.
	head, err := c.Changes(0, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	got, epoch, seq, n := pages(0, nil)
	if len(got) != 0 || n != 1 || epoch != head.Epoch || seq != head.Next || epoch != c.Info().Epoch {
		t.Fatalf("empty namespace: %d digests in %d pages, cursor (%d, %d), head (%d, %d)", len(got), n, epoch, seq, head.Epoch, head.Next)
	}
	// Ten blocks: each once, in pages of at most 3 digests and 8 slots
	// (some pages of the sparse rest hold none).
	d := digests("snap", 40)
	if _, err := c.PutHashes(1, d, false); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Store(schema.View{Batch: 1, Count: 10}, 1, pagesN(0, 10)); err != nil || r.Stored != 10 {
		t.Fatalf("store: %+v %v", r, err)
	}
	got, _, seq, n = pages(3, nil)
	if len(got) != 10 || n < slots/8 {
		t.Fatalf("%d digests in %d pages", len(got), n)
	}
	for i := 0; i < 10; i++ {
		if got[string(d[i*32:(i+1)*32])] != 1 {
			t.Fatalf("block %d seen %d times", i, got[string(d[i*32:(i+1)*32])])
		}
	}
	if seq != head.Next+10 {
		t.Fatalf("cursor seq %d, want %d", seq, head.Next+10)
	}
	// Past the end, and max 1.
	for _, from := range []uint64{uint64(slots), 1 << 40, ^uint64(0)} {
		if r, err := c.Snapshot(from, 0); err != nil || !r.Done || r.Len() != 0 || r.Next != from {
			t.Fatalf("from %d: %+v %v", from, r, err)
		}
	}
	if r, err := c.Snapshot(0, 1); err != nil || r.Len() != 1 || r.Done {
		t.Fatalf("max 1: %+v %v", r, err)
	}
	// Blocks stored (and, the pool being full, evicted) between pages:
	// the pages, then the log from the first page's cursor, equal Lookup.
	more := digests("more", 200)
	if _, err := c.PutHashes(2, more[:100*32], false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutHashes(2, more[100*32:], true); err != nil {
		t.Fatal(err)
	}
	next := 0
	between := func() {
		k := 1 + next%7
		if next+k > 200 {
			return
		}
		if _, err := c.Store(schema.View{Batch: 2, Start: uint32(next), Count: uint32(k)}, 1, pagesN(next%50, k)); err != nil {
			t.Fatal(err)
		}
		next += k
	}
	for round := 0; round < 4; round++ {
		got, epoch, seq, _ := pages(uint32(1+round), between)
		between() // and after the last page
		mirror := map[string]bool{}
		for dg := range got {
			mirror[dg] = true
		}
		for {
			r, err := c.Changes(epoch, seq, 5)
			if err != nil || r.Resync {
				t.Fatalf("changes from the first page's cursor: %+v %v", r, err)
			}
			if r.Len() == 0 {
				break
			}
			for i := 0; i < r.Len(); i++ {
				op, dg := r.ChangeAt(i)
				switch op {
				case schema.OpStored:
					mirror[string(dg)] = true
				case schema.OpEvicted:
					delete(mirror, string(dg))
				default:
					t.Fatalf("op %d", op)
				}
			}
			epoch, seq = r.Epoch, r.Next
		}
		want := 0
		for b, all := range map[uint64][]byte{1: d, 2: more} {
			for i := 0; i < len(all)/32; i++ {
				hit, err := c.Lookup(schema.View{Batch: b, Start: uint32(i), Count: 1})
				if err != nil {
					t.Fatal(err)
				}
				want += hit
				if (hit == 1) != mirror[string(all[i*32:(i+1)*32])] {
					t.Fatalf("round %d: batch %d block %d: Lookup %d, mirror %v", round, b, i, hit, mirror[string(all[i*32:(i+1)*32])])
				}
			}
		}
		if len(mirror) != want || want == 0 {
			t.Fatalf("round %d: mirror of %d blocks, Lookup finds %d", round, len(mirror), want)
		}
	}
	if next < 64+10 {
		t.Fatalf("only %d blocks stored between pages: nothing was evicted", next)
	}
	// Roles: a scheduler may read it, a worker may not (status 12 in a
	// SnapshotReply); malformed requests get status 1 in the same layout.
	sched := h.dial(func(o *connector.Options) { o.Role = schema.RoleScheduler })
	if r, err := sched.Snapshot(0, 0); err != nil || r.Len() == 0 {
		t.Fatalf("scheduler: %d digests, %v", r.Len(), err)
	}
	worker := h.dial(func(o *connector.Options) { o.Role = schema.RoleWorker })
	if _, err := worker.Snapshot(0, 0); status(err) != schema.ErrCodeNotPermitted {
		t.Fatalf("worker: %v", err)
	}
	for _, tc := range []struct {
		cl   *connector.Client
		pay  []byte
		want schema.Status
	}{
		{worker, (&schema.Snapshot{}).Append(nil), schema.ErrCodeNotPermitted},
		{c, nil, schema.ErrCodeMalformed},
		{c, make([]byte, 15), schema.ErrCodeMalformed},
		{c, make([]byte, 17), schema.ErrCodeMalformed},
	} {
		seq, err := tc.cl.Submit(schema.TypeSnapshot, tc.pay)
		if err != nil {
			t.Fatal(err)
		}
		b, err := tc.cl.Await(seq)
		if err != nil {
			t.Fatal(err)
		}
		var r schema.SnapshotReply
		if err := r.Decode(b); err != nil || r.Status != tc.want || r.Width != 32 || r.Len() != 0 || r.Done || r.Next != 0 || r.Epoch != 0 {
			t.Fatalf("payload of %d bytes: %+v %v, want status %v", len(tc.pay), r, err, tc.want)
		}
	}
	// Another namespace (another model) sees none of these blocks; a
	// narrower digest width gets narrower entries.
	other := h.dial(func(o *connector.Options) { o.Model = "other"; o.DigestWidth = 8 })
	if r, err := other.Snapshot(0, 0); err != nil || !r.Done || r.Len() != 0 || r.Width != 8 {
		t.Fatalf("other namespace: %+v %v", r, err)
	}
	if err := c.Ping(1); err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotPageBound: a page holds at most what the completion ring
// carries, (max payload - 40) / width digests (and at most 4096).
func TestSnapshotPageBound(t *testing.T) {
	h := newHarness(t, func(c *sidecar.Config) { c.PoolBytes = 1024 * slot })
	c := h.dial(nil)
	bound := (c.MaxPayload() - 40) / 32
	if bound >= 1000 || bound > schema.MaxSnapshotPerReply {
		t.Fatalf("max payload %d: bound %d", c.MaxPayload(), bound)
	}
	n := bound + 50
	src := newRegion(1, n)
	if err := c.RegisterRegion(src.reg); err != nil {
		t.Fatal(err)
	}
	d := digests("bound", n)
	for off := 0; off < n; off += 256 {
		if _, err := c.PutHashes(1, d[off*32:min(off+256, n)*32], off > 0); err != nil {
			t.Fatal(err)
		}
	}
	// In steps of 128 blocks: a uid may hold at most a quarter of the pool
	// in blocks being written (--limits.pending-share).
	for off := 0; off < n; off += 128 {
		k := min(128, n-off)
		if r, err := c.Store(schema.View{Batch: 1, Start: uint32(off), Count: uint32(k)}, 1, pagesN(off, k)); err != nil || int(r.Stored) != k {
			t.Fatalf("store: %+v %v", r, err)
		}
	}
	r, err := c.Snapshot(0, 0)
	if err != nil || r.Len() != bound || r.Done {
		t.Fatalf("first page: %d digests (bound %d), done %v, %v", r.Len(), bound, r.Done, err)
	}
	r, err = c.Snapshot(r.Next, 0)
	if err != nil || r.Len() != 50 || !r.Done {
		t.Fatalf("second page: %d digests, done %v, %v", r.Len(), r.Done, err)
	}
	if r, err := c.Snapshot(0, 7); err != nil || r.Len() != 7 {
		t.Fatalf("max 7: %d digests, %v", r.Len(), err)
	}
}

// pagesN returns the page indices first, first+1, ... (n of them).
func pagesN(first, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(first + i)
	}
	return p
}

func TestStaleRingsRemovedAtStart(t *testing.T) {
	base := "/dev/shm"
	if _, err := os.Stat(base); err != nil {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "rs-stale-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	// A ring whose recorded owner is a process that no longer exists, and
	// a garbage file with a ring's name.
	stale := dir + "/s1-00000000000000aa.sub"
	os.WriteFile(stale, bytes.Repeat([]byte{0xEE}, 8192), 0o600)
	other := dir + "/notes.txt"
	os.WriteFile(other, []byte("keep"), 0o600)
	srv, err := sidecar.New(sidecar.Config{Dir: dir, PoolBytes: 64 * slot, Machine: machine.Config{SlotBytes: slot}}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	cancel()
	<-done
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("stale ring still there: %v", err)
	}
	if b, _ := os.ReadFile(other); string(b) != "keep" {
		t.Fatal("an unrelated file was touched")
	}
}

func TestPrefillIsInvisibleToEngines(t *testing.T) {
	h := newHarness(t, func(c *sidecar.Config) { c.PrefillBlocks = 40 })
	if got := h.srv.State().Pool.Blocks; got != 40 {
		t.Fatalf("%d blocks after prefill, want 40", got)
	}
	c := h.dial(nil)
	c.PutHashes(1, digests("p", 4), false)
	if n, err := c.Lookup(schema.View{Batch: 1, Count: 4}); err != nil || n != 0 {
		t.Fatalf("lookup %d %v", n, err)
	}
}

func TestQuotas(t *testing.T) {
	h := newHarness(t, func(c *sidecar.Config) { c.Machine.MaxLeases = 3; c.Machine.MaxHashBytes = 10 * 32 })
	c := h.dial(nil)
	other := h.dial(func(o *connector.Options) { o.Instance = "bystander" })
	src := newRegion(1, 4)
	c.RegisterRegion(src.reg)
	if _, err := c.PutHashes(1, digests("q", 4), false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutHashes(2, digests("r", 7), false); status(err) != schema.ErrCodeTooLarge {
		t.Fatalf("hash quota: %v", err)
	}
	if _, err := c.PutHashes(2, digests("r", 6), false); err != nil {
		t.Fatalf("within the hash quota: %v", err)
	}
	c.DropHashes(2)
	if _, err := c.PutHashes(3, digests("s", 6), false); err != nil {
		t.Fatalf("after a drop the quota is free again: %v", err)
	}
	// A replace gives the old digests back before counting the new ones:
	// batch 3 (6 of the 10) can be replaced by 6 as often as wanted, not by 7.
	for i := 0; i < 5; i++ {
		if _, err := c.PutHashesFlags(3, digests("t", 6), schema.FlagReplace); err != nil {
			t.Fatalf("replace %d within the quota: %v", i, err)
		}
	}
	if _, err := c.PutHashesFlags(3, digests("t", 7), schema.FlagReplace); status(err) != schema.ErrCodeTooLarge {
		t.Fatalf("replace past the quota: %v", err)
	}
	// That failed replace left batch 3 empty: its 6 are free again.
	if _, err := c.PutHashesFlags(3, digests("t", 6), schema.FlagReplace); err != nil {
		t.Fatalf("after a failed replace: %v", err)
	}
	c.Store(schema.View{Batch: 1, Count: 4}, 1, []uint32{0, 1, 2, 3})
	var leases []uint64
	for i := 0; i < 3; i++ {
		l, err := c.Acquire(schema.View{Batch: 1, Count: 1}, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, l.Lease)
	}
	if _, err := c.Acquire(schema.View{Batch: 1, Count: 1}, time.Minute); status(err) != schema.ErrCodeTooLarge {
		t.Fatalf("lease quota: %v", err)
	}
	if err := other.Ping(1); err != nil {
		t.Fatalf("another session suffers: %v", err)
	}
	c.Release(leases[0])
	if _, err := c.Acquire(schema.View{Batch: 1, Count: 1}, time.Minute); err != nil {
		t.Fatalf("after a release: %v", err)
	}
}

// poolFD returns the /proc/self/fd path of the (unlinked) pool file of the
// sidecar on dir.
func poolFD(t *testing.T, dir string) string {
	t.Helper()
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		p := filepath.Join("/proc/self/fd", e.Name())
		if target, err := os.Readlink(p); err == nil && target == filepath.Join(dir, "pool")+" (deleted)" {
			return p
		}
	}
	t.Fatalf("no descriptor of %s/pool", dir)
	return ""
}

// TestPoolUnlinked: the pool and the rings have no name in the directory:
// no other process can open them.
func TestPoolUnlinked(t *testing.T) {
	h := newHarness(t, nil)
	c := h.dial(nil)
	ents, err := os.ReadDir(h.cfg.Dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() != "ringside.sock" && e.Name() != "ringside.lock" {
			t.Errorf("%s is in the sidecar's directory", e.Name())
		}
	}
	if err := c.Ping(1); err != nil {
		t.Fatal(err)
	}
	poolFD(t, h.cfg.Dir)
}

// TestPoolReserve: with PoolReserve every byte of the pool file is allocated
// at start (charged now, so a mount or limit too small fails at start);
// without it the file is sparse.
func TestPoolReserve(t *testing.T) {
	for _, reserve := range []bool{false, true} {
		t.Run(fmt.Sprintf("reserve=%v", reserve), func(t *testing.T) {
			h := newHarness(t, func(c *sidecar.Config) { c.PoolBytes = 256 * slot; c.PoolReserve = reserve })
			// The pool has no name once mapped (nobody may open it): find
			// it among this process's descriptors.
			var st unix.Stat_t
			if err := unix.Stat(poolFD(t, h.cfg.Dir), &st); err != nil {
				t.Fatal(err)
			}
			allocated := st.Blocks * 512
			if full := allocated >= int64(h.cfg.PoolBytes); full != reserve {
				t.Fatalf("pool of %d bytes has %d allocated; reserve=%v", h.cfg.PoolBytes, allocated, reserve)
			}
			h.dial(nil).Close() // and it serves
		})
	}
}
