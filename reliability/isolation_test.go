package reliability

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// TestTenantIsolation: tenants (salts) and models with the same digests.
func TestTenantIsolation(t *testing.T) {
	row := record(t, "Isolation", "another tenant salt and another model with the very same block digests; its stores fill the pool; it uses the first tenant's lease ids",
		"it never sees the blocks (lookup 0, acquire miss, change log without them), never loads them (status 4 on the lease ids), never overwrites them (same digest stored with other bytes: the owner still loads its own), and never evicts pinned blocks (eviction of unpinned blocks under pressure is global LRU, by design)",
		"11. key identity")
	sc := startSidecar(t, newDir(t), "--pool.bytes", "256KiB") // 64 slots
	oa := opts(sc.sock, "a")
	oa.Salt = "tenant-a"
	ob := opts(sc.sock, "b")
	ob.Salt = "tenant-b"
	om := opts(sc.sock, "m")
	om.Model = "other-model"
	a, b, m := dial(t, oa), dial(t, ob), dial(t, om)
	ra, rb := newRegion(1, 16), newRegion(1, 16)
	a.RegisterRegion(ra.reg)
	b.RegisterRegion(rb.reg)
	d := digests("shared-prefix", 8)
	for j := 0; j < 8; j++ {
		fillPage(ra.page(j), d[j*32:(j+1)*32], 0xA)
		fillPage(rb.page(j), d[j*32:(j+1)*32], 0xB)
	}
	cb, _ := b.Changes(0, 0, 0)
	for _, c := range []*connector.Client{a, b, m} {
		c.PutHashes(1, d, false)
	}
	v := schema.View{Batch: 1, Count: 8}
	if r, err := a.Store(v, 1, iota32(8)); err != nil || r.Stored != 8 {
		t.Fatalf("store: %+v %v", r, err)
	}
	for name, c := range map[string]*connector.Client{"tenant b": b, "other model": m} {
		if n, err := c.Lookup(v); err != nil || n != 0 {
			t.Fatalf("%s sees %d blocks (%v)", name, n, err)
		}
		if l, err := c.Acquire(v, time.Minute); err != nil || l.Lease != 0 || l.State != schema.StateMiss {
			t.Fatalf("%s acquired %+v (%v)", name, l, err)
		}
	}
	if ch, err := b.Changes(cb.Epoch, cb.Next, 0); err != nil || ch.Len() != 0 {
		t.Fatalf("tenant b's change log shows %d entries of tenant a (%v)", ch.Len(), err)
	}
	la, err := a.Acquire(v, time.Minute)
	if err != nil || la.Blocks != 8 {
		t.Fatal(la, err)
	}
	for _, try := range []func() error{
		func() error { _, err := b.Poll(la.Lease); return err },
		func() error { _, err := b.Load(la.Lease, 1, 0, []uint32{8}); return err },
		func() error { return b.Release(la.Lease) },
	} {
		if err := try(); status(err) != schema.ErrCodeUnknownLease {
			t.Fatalf("tenant b used tenant a's lease: %v", err)
		}
	}
	// b stores the same digests with its own bytes, then floods the pool.
	if r, err := b.Store(v, 1, iota32(8)); err != nil || r.Stored != 8 {
		t.Fatalf("b's own copy: %+v %v", r, err)
	}
	var flood, skipped int
	for i := 0; i < 20; i++ {
		fd := digests(fmt.Sprintf("flood-%d", i), 8)
		b.PutHashes(uint64(10+i), fd, false)
		r, err := b.Store(schema.View{Batch: uint64(10 + i), Count: 8}, 1, iota32(8))
		if err != nil {
			t.Fatal(err)
		}
		flood += int(r.Stored)
		skipped += int(r.Skipped)
	}
	if n, err := a.Lookup(v); err != nil || n != 8 {
		t.Fatalf("tenant a's pinned blocks evicted: %d left (%v)", n, err)
	}
	if _, err := a.Load(la.Lease, 1, 0, []uint32{8, 9, 10, 11, 12, 13, 14, 15}); err != nil {
		t.Fatal(err)
	}
	for j := 0; j < 8; j++ {
		if !pageOK(ra.page(8+j), d[j*32:(j+1)*32], 0xA) {
			t.Fatalf("tenant a loaded foreign bytes in block %d", j)
		}
	}
	a.Release(la.Lease)
	st := sc.state().Pool
	row.add("b and another model: lookup 0, acquire miss, 0 change-log entries, status 4 on a's lease (poll, load, release)")
	row.add("b stored the same 8 digests with its own bytes and flooded %d more blocks into a 64-slot pool (%d skipped, %d evictions): a's 8 pinned blocks stayed present and loaded byte-exact", flood, skipped, st.Evictions)
}

// nobodyChild runs as uid 65534: it tries to attach and to open the
// sidecar's files, and prints what happened as JSON.
func nobodyChild() int {
	res := map[string]string{"uid": fmt.Sprint(os.Getuid())}
	sock := os.Getenv("RS_SOCK")
	_, err := connector.Dial(connector.Options{Socket: sock, Instance: "intruder", Model: "llama-rel", Layout: "bf16/16/HND", Timeout: 2 * time.Second})
	res["attach"] = errString(err)
	var se *schema.Error
	if errors.As(err, &se) {
		res["attach_status"] = fmt.Sprint(uint32(se.Status))
	}
	for _, p := range strings.Split(os.Getenv("RS_FILES"), ",") {
		f, err := os.OpenFile(p, os.O_RDONLY, 0)
		if err == nil {
			f.Close()
		}
		res[p] = errString(err)
	}
	json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

func errString(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

// runAsNobody runs nobodyChild as uid/gid 65534 from a world-executable
// copy of the test binary.
func runAsNobody(t *testing.T, sock string, files []string) map[string]string {
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
	cmd := child("nobody", "RS_SOCK="+sock, "RS_FILES="+strings.Join(files, ","))
	cmd.Path, cmd.Args[0] = exe, exe
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child as uid 65534: %v %s", err, out)
	}
	res := map[string]string{}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return res
}

// TestOtherUIDRefused: a process of another uid cannot attach or open the
// sidecar's files, even when the directory and socket are opened up.
func TestOtherUIDRefused(t *testing.T) {
	row := record(t, "Isolation", "a process of another uid (65534) attaching and opening the pool and a live session's rings (by their former names, and through /proc/PID/fd of the sidecar and of the client); then again with the directory opened to 0711 and the socket to 0666 (a misconfiguration)",
		"directory 0700 and socket 0600, owned by the sidecar's uid; the pool and the rings have no name at all (the rings reach their client as descriptors); the other uid cannot connect (EACCES), and once it can, SO_PEERCRED refuses the attach with status 12; it can open none of the files, by any path", "")
	if os.Getuid() != 0 {
		t.Skip("needs root to start a child of another uid")
	}
	dir := newDir(t)
	sc := startSidecar(t, dir)
	c := dial(t, opts(sc.sock, "owner"))
	for p, mode := range map[string]os.FileMode{dir: 0o700 | os.ModeDir, sc.sock: 0o600 | os.ModeSocket} {
		fi, err := os.Lstat(p)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode() != mode || st.Uid != uint32(os.Getuid()) {
			t.Errorf("%s: mode %v uid %d, want %v uid %d", p, fi.Mode(), st.Uid, mode, os.Getuid())
		}
	}
	names := dirNames(t, dir)
	// The former names, and the descriptors in /proc of both processes.
	files := []string{filepath.Join(dir, "pool"), c.Info().SubmissionRing, c.Info().CompletionRing}
	files = append(files, procFDs(t, sc.pid(), dir)...)
	sub, cmp := c.RingFDs()
	files = append(files, fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), sub), fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), cmp))
	closed := runAsNobody(t, sc.sock, files)
	if closed["uid"] != "65534" || !strings.Contains(closed["attach"], "permission denied") {
		t.Fatalf("as uid 65534 with the directory closed: %v", closed)
	}
	os.Chmod(dir, 0o711)
	os.Chmod(sc.sock, 0o666)
	open := runAsNobody(t, sc.sock, files)
	os.Chmod(dir, 0o700)
	os.Chmod(sc.sock, 0o600)
	if open["attach_status"] != fmt.Sprint(uint32(schema.ErrCodeNotPermitted)) {
		t.Fatalf("as uid 65534 with the socket reachable: %v", open)
	}
	for _, p := range files {
		if r := open[p]; r == "ok" {
			t.Errorf("uid 65534 opened %s", p)
		}
	}
	if err := c.Ping(1); err != nil {
		t.Fatal(err)
	}
	row.add("modes checked (dir 0700, socket 0600, owner uid %d); in the directory only %v; directory closed: %q", os.Getuid(), names, short(closed["attach"], 70))
	row.add("socket reachable: attach refused with status %s (%s); none of %d paths opened (former names: %q; /proc fd: %q)", open["attach_status"], short(open["attach"], 60), len(files), short(open[files[0]], 40), short(open[files[len(files)-1]], 40))
}

// dirNames lists the names in dir, and fails the test if the sidecar left
// anything there besides its socket and lock file.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
		if e.Name() != "ringside.sock" && e.Name() != "ringside.lock" {
			t.Errorf("%s has a name in the sidecar's directory", e.Name())
		}
	}
	return names
}

// procFDs returns /proc/PID/fd paths of pid's descriptors of files that
// were in dir (the unlinked pool and rings).
func procFDs(t *testing.T, pid int, dir string) []string {
	t.Helper()
	base := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(base)
	var out []string
	for _, e := range ents {
		p := filepath.Join(base, e.Name())
		if target, err := os.Readlink(p); err == nil && strings.HasPrefix(target, dir+"/") && strings.HasSuffix(target, " (deleted)") {
			out = append(out, p)
		}
	}
	if len(out) < 3 {
		t.Fatalf("the sidecar holds %d unlinked files of %s (want the pool and two rings)", len(out), dir)
	}
	return out
}

// TestSymlinkPlanted: symbolic links at the pool, a ring and the socket
// path, and as the directory itself.
func TestSymlinkPlanted(t *testing.T) {
	row := record(t, "Isolation", "symbolic links planted in the sidecar's directory: at the pool path before start, at the socket path, at the next session's two ring paths (epoch read from /debug/state) before attach; and the --dir itself a symlink",
		"no write ever goes through a link: every victim file keeps its bytes; the links are removed, the pool and rings are new files of their own that then lose their names, the socket a new socket; a symlinked --dir is refused at start", "")
	dir := newDir(t)
	victims := map[string]string{}
	victim := func(name string) string {
		p := filepath.Join(t.TempDir(), name)
		os.WriteFile(p, []byte("precious "+name), 0o600)
		victims[p] = "precious " + name
		return p
	}
	os.Symlink(victim("pool-target"), filepath.Join(dir, "pool"))
	os.Symlink(victim("sock-target"), filepath.Join(dir, "ringside.sock"))
	sc := startSidecar(t, dir)
	epoch := sc.epoch()
	for _, ext := range []string{".sub", ".cmp"} {
		os.Symlink(victim("ring"+ext), filepath.Join(dir, fmt.Sprintf("s1-%016x%s", epoch, ext)))
	}
	c := dial(t, opts(sc.sock, "links"))
	if err := c.Ping(1); err != nil {
		t.Fatal(err)
	}
	sub, cmp := c.RingFDs()
	for _, fd := range []int{sub, cmp} {
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Nlink != 0 {
			t.Errorf("ring descriptor %d: mode %o links %d (%v), want a regular file with no name", fd, st.Mode, st.Nlink, err)
		}
	}
	if fi, err := os.Lstat(sc.sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("socket: %v", err)
	}
	if !strings.HasSuffix(c.Info().SubmissionRing, fmt.Sprintf("s1-%016x.sub", epoch)) {
		t.Errorf("the session did not take the planted path: %s", c.Info().SubmissionRing)
	}
	names := dirNames(t, dir)
	for p, want := range victims {
		if b, err := os.ReadFile(p); err != nil || string(b) != want {
			t.Errorf("victim %s changed: %q %v", p, b, err)
		}
	}
	// --dir itself a symlink.
	real := newDir(t)
	link := filepath.Join(t.TempDir(), "dirlink")
	os.Symlink(real, link)
	out, err := execOut(ringsideBin, "serve", "--dir", link, "--metrics.addr", "", "--pool.bytes", "1MiB", "--pool.slot-bytes", "4KiB")
	if err == nil || !strings.Contains(out, "symbolic link") {
		t.Errorf("a symlinked --dir: %v %s", err, out)
	}
	row.add("%d victims (pool, socket, 2 rings) unchanged; afterwards the directory holds only %v, the rings are nameless regular files; symlinked --dir refused: %q", len(victims), names, short(lastLine(out), 90))
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

func execOut(name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
	}
	return string(out), err
}
