package reliability

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

func init() {
	defect(Defect{Issue: 16, Point: 6,
		Title:  "a full /dev/shm mount (any engine can fill it by touching its own large ring) makes the next attach crash the whole sidecar with SIGBUS in ring.Format; ring files are sparse, so a reply into a completion-ring page not yet allocated faults too (the session is dropped)",
		Tests:  "TestFullShmMount",
		Before: "1cc2144: the attach on the full mount got no status (attach reply: EOF): the sidecar died, SIGBUS in ring.Format ← ring.Create ← Server.newSession. Found with the attach step left out: the earlier session's reply faulted on a completion-ring page the mount could not allocate, the session was dropped, and closing it published the half-written record, which crashed the client reading it",
		Fix:    "rings are allocated (fallocate) before they are mapped and an attach that finds no room is refused with status 8; the pool is reserved by default; the rings and pool have no name",
	})
}

// smallTmpfs mounts a tmpfs of size bytes on a new directory, unmounted
// (lazily, so that a mapping left by a crashed sidecar cannot keep it) at
// cleanup. It skips the test where no tmpfs can be mounted.
func smallTmpfs(t *testing.T, size int64) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	mp, err := os.MkdirTemp("", "rs-rel-tmpfs-")
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, fmt.Sprintf("size=%d,mode=0700", size)); err != nil {
		os.Remove(mp)
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", mp, err)
		}
		os.Remove(mp)
	})
	return mp
}

// fillMount allocates every free byte of the file system at dir to one
// file, as an engine touching a large ring of its own would, and returns a
// function that frees it again.
func fillMount(t *testing.T, dir string) (freed func()) {
	t.Helper()
	p := filepath.Join(dir, "filler")
	fd, err := unix.Open(p, unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	off := int64(st.Bavail) * st.Bsize
	if off > 0 {
		if err := unix.Fallocate(fd, 0, 0, off); err != nil {
			t.Fatalf("filling %s: %v", dir, err)
		}
	}
	// Whatever the first call could not take, page by page.
	for {
		if err := unix.Fallocate(fd, 0, off, 4096); err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Fatalf("filling %s: %v", dir, err)
			}
			break
		}
		off += 4096
	}
	if err := unix.Statfs(dir, &st); err != nil || st.Bavail != 0 {
		t.Fatalf("%s not full: %d blocks free (%v)", dir, st.Bavail, err)
	}
	return func() { os.Remove(p) }
}

// touchSubmission writes more than twice the capacity of c's submission
// ring through it (large PutHashes, small replies), so that every page of
// that file is allocated while its completion ring stays mostly untouched.
// A page this process first touches on a full mount would fault here, in
// the test binary, whatever the sidecar does; the completion ring is the
// sidecar's to write.
func touchSubmission(t *testing.T, c *connector.Client, capacity int) {
	t.Helper()
	n := (c.MaxPayload() - 64) / 32
	for sent, b := 0, uint64(1000); sent < 2*capacity+c.MaxPayload(); b++ {
		if _, err := c.PutHashes(b, digests(fmt.Sprint("touch", b), n), false); err != nil {
			t.Fatal(err)
		}
		if err := c.DropHashes(b); err != nil {
			t.Fatal(err)
		}
		sent += n*32 + 64
	}
}

// TestFullShmMount: a full shared-memory mount at the next attach, under
// the replies of a session attached before, and under a store into a
// sparse pool.
func TestFullShmMount(t *testing.T) {
	row := record(t, "Resource exhaustion", "the sidecar's --dir on a small tmpfs (16 MiB) with a sparse pool (no --pool.reserve) and a session attached before; the mount is then filled to its last page (as an engine touching a large ring of its own fills /dev/shm); a new session attaches; the earlier session asks for replies that run through its whole completion ring, and stores into never-touched pool slots; then the space is freed",
		"the attach on the full mount is refused with a non-zero status, and the sidecar stays alive (no SIGBUS); the earlier session keeps working: 300 snapshot replies through its completion ring, lookup and a byte-exact load of its blocks; its store into the sparse pool fails that store (non-zero status, or blocks counted as skipped) and the sidecar stays alive, and any block it reports stored loads byte-exact; once space is freed a new session attaches, stores and loads byte-exact",
		"#16.6 SIGBUS on a full mount")
	mp := smallTmpfs(t, 16<<20)
	dir := filepath.Join(mp, "rs")
	sc := startSidecar(t, dir, "--pool.bytes", "1MiB") // 256 slots, sparse
	o := opts(sc.sock, "early")
	o.RingCapacity = 64 << 10
	early := dial(t, o)
	reg := newRegion(1, 32)
	if err := early.RegisterRegion(reg.reg); err != nil {
		t.Fatal(err)
	}
	d := digests("full-mount", 16)
	for j := 0; j < 16; j++ {
		fillPage(reg.page(j), d[j*32:(j+1)*32], 0x6)
	}
	if _, err := early.PutHashes(1, d, false); err != nil {
		t.Fatal(err)
	}
	if r, err := early.Store(schema.View{Batch: 1, Count: 4}, 1, iota32(4)); err != nil || r.Stored != 4 {
		t.Fatalf("store before the fill: %+v %v", r, err)
	}
	touchSubmission(t, early, 64<<10)
	// From here on, a page of a ring that this process reads and that the
	// sidecar could not allocate faults in this goroutine: a failure of
	// the test, not a crash of the test binary.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("this process (the engine's side) faulted reading a ring of the sidecar's on the full mount: %v", r)
		}
	}()
	freeSpace := fillMount(t, mp)
	alive := func(what string) {
		t.Helper()
		time.Sleep(100 * time.Millisecond) // a crash needs no longer to show
		if !sc.alive() {
			t.Fatalf("the sidecar died at %s (%v): %s", what, sc.waitErr, sc.crashLines())
		}
	}

	// 1. A new attach on the full mount.
	no := opts(sc.sock, "late")
	no.Salt = "late"
	c, attachErr := connector.Dial(no)
	if attachErr == nil {
		c.Close()
		t.Errorf("attach on a full mount succeeded: its rings cannot be allocated")
	} else if st := status(attachErr); st == 0xFFFF || st == schema.OK {
		t.Errorf("attach on a full mount: no status from the sidecar: %v", attachErr)
	}
	alive("an attach on a full mount")

	// 2. The earlier session: replies through its whole completion ring.
	var snaps int
	for ; snaps < 300; snaps++ {
		r, err := early.Snapshot(0, 0)
		if err != nil || !r.Done || len(r.Entries) != 4*32 {
			t.Fatalf("the earlier session's snapshot %d on a full mount: %d bytes of digests, %v", snaps, len(r.Entries), err)
		}
	}
	alive("replies to a session attached before the mount filled")
	if n, err := early.Lookup(schema.View{Batch: 1, Count: 4}); err != nil || n != 4 {
		t.Fatalf("the earlier session's blocks: %d present (%v)", n, err)
	}
	checkLoad := func(c *connector.Client, r *region, v schema.View, tag uint64) {
		t.Helper()
		l, err := c.Acquire(v, 10*time.Second)
		if err != nil || int(l.Blocks) != int(v.Count) {
			t.Fatalf("acquire %+v: %+v %v", v, l, err)
		}
		defer c.Release(l.Lease)
		pages := make([]uint32, v.Count)
		for i := range pages {
			pages[i] = 16 + uint32(i)
			clear(r.page(int(pages[i])))
		}
		if _, err := c.Load(l.Lease, 1, 0, pages); err != nil {
			t.Fatalf("load %+v: %v", v, err)
		}
		for i := range pages {
			j := int(v.Start) + i
			if !pageOK(r.page(int(pages[i])), d[j*32:(j+1)*32], tag) {
				t.Fatalf("block %d loaded wrong bytes", j)
			}
		}
	}
	checkLoad(early, reg, schema.View{Batch: 1, Count: 4}, 0x6)

	// 3. A store into never-touched slots of the sparse pool.
	sr, serr := early.Store(schema.View{Batch: 1, Start: 4, Count: 8}, 1, []uint32{4, 5, 6, 7, 8, 9, 10, 11})
	alive("a store into its sparse pool on a full mount")
	// It fails (a status, or blocks skipped), or, where the pool's pages
	// were allocated after all (reserved by default), what it stored loads
	// byte-exact below.
	if n, err := early.Lookup(schema.View{Batch: 1, Start: 4, Count: 8}); err != nil {
		t.Fatalf("the earlier session after its store on a full mount: %v", err)
	} else if n > 0 {
		checkLoad(early, reg, schema.View{Batch: 1, Start: 4, Count: uint32(n)}, 0x6)
	}

	// 4. Space freed: attaching, storing and loading work again.
	freeSpace()
	again := dial(t, no)
	r2 := newRegion(1, 32)
	if err := again.RegisterRegion(r2.reg); err != nil {
		t.Fatal(err)
	}
	for j := 0; j < 16; j++ {
		fillPage(r2.page(j), d[j*32:(j+1)*32], 0x7)
	}
	again.PutHashes(1, d, false)
	if r, err := again.Store(schema.View{Batch: 1, Count: 8}, 1, iota32(8)); err != nil || r.Stored != 8 {
		t.Fatalf("store after the space was freed: %+v %v", r, err)
	}
	checkLoad(again, r2, schema.View{Batch: 1, Count: 8}, 0x7)
	checkLoad(early, reg, schema.View{Batch: 1, Count: 4}, 0x6)
	row.add("attach on the full mount: %s", short(fmt.Sprint(attachErr), 100))
	row.add("earlier session: %d snapshot replies through its completion ring on the full mount", snaps)
	row.add("its store of 8 blocks into never-touched pool slots: stored %d, skipped %d, status %v", sr.Stored, sr.Skipped, status(serr))
	row.add("after freeing: a new session attached, stored 8 blocks and loaded them byte-exact; the earlier session's blocks still load byte-exact")
}

// crashLines picks the lines of a Go crash out of the sidecar's log: the fault,
// the signal, and the first frames of the goroutine that was running.
func (s *sidecar) crashLines() string {
	b, _ := os.ReadFile(s.logPath)
	var out []string
	lines := strings.Split(string(b), "\n")
	for i, l := range lines {
		switch {
		case strings.HasPrefix(l, "unexpected fault address"), strings.HasPrefix(l, "fatal error:"),
			strings.HasPrefix(l, "panic:"), strings.HasPrefix(l, "[signal "), strings.HasPrefix(l, "runtime: out of memory"):
			out = append(out, l)
		case strings.HasPrefix(l, "goroutine ") && strings.HasSuffix(l, "[running]:"):
			for _, f := range lines[i+1 : min(i+16, len(lines))] {
				if strings.HasPrefix(f, "github.com/ringside-kv/") {
					if k := strings.LastIndexByte(f, '('); k > 0 {
						f = f[:k]
					}
					out = append(out, "in "+f)
				}
			}
		}
		if len(out) >= 8 {
			break
		}
	}
	if len(out) == 0 {
		return s.logTail()
	}
	return strings.Join(out, " | ")
}
