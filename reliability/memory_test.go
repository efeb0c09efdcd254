package reliability

import (
	"bufio"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

func init() {
	defect(Defect{Issue: 16, Point: 7,
		Title:  "per-client metadata (hash batches, leases, queries, namespaces, instances, sessions) is bounded per instance or session only: sessions sending each at its maximum get the sidecar OOM-killed inside the manifest's memory limit (pool + 256 MiB)",
		Tests:  "TestMetadataMemoryBound",
		Before: "1cc2144: the sidecar was OOM-killed 0.8 s into the attack (cgroup v1, oom_kill 1, peak 320 MiB of 320); the 4 instances' 4096-digest PutHashes alone get it killed in 0.55 s",
		Fix:    "metadata (batches, queries, regions, copies, sessions, instances, namespaces, change logs) is charged per session, per uid and in total against bounds derived from the memory limit (cgroup v1/v2), GOMEMLIMIT set from it; status 7 past any of them",
	})
	defect(Defect{Issue: 16, Point: 13,
		Title:  "namespaces are never freed: 65,535 attach/detach cycles with new model names refuse every new model (status 7) until a restart, and keep ~9 KB each",
		Tests:  "TestNamespaceChurn",
		Before: "1cc2144: 4,466 of 70,000 cycles with new model names refused with status 7 (too many namespaces), and so was a new model afterwards; +561 MiB of anonymous memory (bound 64 MiB), 65,535 namespaces kept",
		Fix:    "an instance is freed when its last session ends (with its batches)",
	})
	defect(Defect{Issue: 16, Point: 14,
		Title:  "instance records are never freed: every attach with a new instance name keeps one for good",
		Tests:  "TestInstanceChurn",
		Before: "1cc2144: 49,152 cycles with new instance names grew the sidecar's anonymous memory by 21.7 MiB (452 bytes a cycle; bound 8 MiB), 8,192 same-name cycles by 0.4 MiB",
	})
}

// --- a memory cgroup ---

// memCgroup is a memory cgroup (v2, or v1 where the memory controller is
// bound to v1) made for one test, a child of this process's own.
type memCgroup struct {
	dir   string
	v2    bool
	limit int64
}

// cgroupPaths reads this process's cgroup paths: the v2 path ("" if
// none) and the v1 memory controller's path ("" if none).
func cgroupPaths() (v2, v1mem string) {
	b, _ := os.ReadFile("/proc/self/cgroup")
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[0] == "0" && f[1] == "" {
			v2 = f[2]
		}
		for _, c := range strings.Split(f[1], ",") {
			if c == "memory" {
				v1mem = f[2]
			}
		}
	}
	return v2, v1mem
}

// cgroupMount finds where a cgroup hierarchy is mounted (fstype cgroup2,
// or cgroup with the memory controller) and the hierarchy path its root is.
func cgroupMount(v2 bool) (mountpoint, root string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.Fields(sc.Text())
		sep := -1
		for i, x := range l {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || len(l) < sep+3 || len(l) < 5 {
			continue
		}
		fstype, super := l[sep+1], l[sep+3:]
		switch {
		case v2 && fstype == "cgroup2":
			return l[4], l[3]
		case !v2 && fstype == "cgroup" && len(super) > 0 && strings.Contains(","+super[0]+",", ",memory,"):
			return l[4], l[3]
		}
	}
	return "", ""
}

func cgroupDir(mountpoint, root, path string) string {
	rel := strings.TrimPrefix(path, root)
	return filepath.Join(mountpoint, rel)
}

// newMemCgroup makes a memory cgroup limited to limit bytes (no swap),
// removed at cleanup. It skips the test where none can be made.
func newMemCgroup(t *testing.T, limit int64) *memCgroup {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to make a memory cgroup")
	}
	name := fmt.Sprintf("rs-rel-%d-%d", os.Getpid(), time.Now().UnixNano())
	v2path, v1path := cgroupPaths()
	var why []string
	if mp, root := cgroupMount(true); mp != "" && v2path != "" {
		// Under this process's own cgroup; where that cannot delegate the
		// memory controller (it holds processes), under the hierarchy's
		// root, if that delegates it already (this test changes no
		// setting of the root).
		for _, parent := range []string{cgroupDir(mp, root, v2path), mp} {
			if g, err := newV2(parent, name, limit, parent != mp); err != nil {
				why = append(why, "cgroup v2: "+err.Error())
			} else {
				t.Cleanup(g.remove)
				return g
			}
			if parent == mp {
				break
			}
		}
	}
	if mp, root := cgroupMount(false); mp != "" && v1path != "" {
		dir := filepath.Join(cgroupDir(mp, root, v1path), name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			why = append(why, fmt.Sprintf("cgroup v1: %v", err))
		} else if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte(strconv.FormatInt(limit, 10)), 0); err != nil {
			os.Remove(dir)
			why = append(why, fmt.Sprintf("cgroup v1: memory.limit_in_bytes: %v", err))
		} else {
			// Without swap accounting this file is absent: there is no
			// swap to escape to on such a host either way.
			os.WriteFile(filepath.Join(dir, "memory.memsw.limit_in_bytes"), []byte(strconv.FormatInt(limit, 10)), 0)
			g := &memCgroup{dir: dir, limit: limit}
			t.Cleanup(g.remove)
			return g
		}
	} else {
		why = append(why, "no cgroup v1 memory hierarchy")
	}
	t.Skipf("cannot make a memory cgroup: %s", strings.Join(why, "; "))
	return nil
}

func newV2(parent, name string, limit int64, enable bool) (*memCgroup, error) {
	ctl, _ := os.ReadFile(filepath.Join(parent, "cgroup.controllers"))
	if !strings.Contains(" "+strings.TrimSpace(string(ctl))+" ", " memory ") {
		return nil, fmt.Errorf("the memory controller is not available in %s", parent)
	}
	sub, _ := os.ReadFile(filepath.Join(parent, "cgroup.subtree_control"))
	if !strings.Contains(string(sub), "memory") && enable {
		os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte("+memory"), 0)
	}
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "memory.max"), []byte(strconv.FormatInt(limit, 10)), 0); err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("memory.max: %v (the memory controller is not enabled for the children of %s)", err, parent)
	}
	os.WriteFile(filepath.Join(dir, "memory.swap.max"), []byte("0"), 0)
	return &memCgroup{dir: dir, v2: true, limit: limit}, nil
}

func (g *memCgroup) remove() {
	// The sidecar has been stopped (its cleanup ran first); its exit may
	// take a moment to leave the cgroup.
	for i := 0; i < 100; i++ {
		if err := os.Remove(g.dir); err == nil || errors.Is(err, os.ErrNotExist) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (g *memCgroup) procs() string { return filepath.Join(g.dir, "cgroup.procs") }

// value reads one counter of a flat-keyed file (memory.events,
// memory.oom_control).
func (g *memCgroup) value(file, key string) int64 {
	b, _ := os.ReadFile(filepath.Join(g.dir, file))
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == key {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			return v
		}
	}
	return -1
}

func (g *memCgroup) number(file string) int64 {
	b, _ := os.ReadFile(filepath.Join(g.dir, file))
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return -1
	}
	return v
}

// oomKills counts processes of the cgroup the kernel's OOM killer killed.
func (g *memCgroup) oomKills() int64 {
	if g.v2 {
		return g.value("memory.events", "oom_kill")
	}
	return g.value("memory.oom_control", "oom_kill")
}

// peak is the cgroup's highest memory charge so far (bytes).
func (g *memCgroup) peak() int64 {
	if g.v2 {
		return g.number("memory.peak")
	}
	return g.number("memory.max_usage_in_bytes")
}

// startSidecarIn starts `ringside serve` as startSidecar does, but inside
// g from its first instruction (a shell joins the cgroup, then execs the
// sidecar), and without GOMEMLIMIT or GOGC from this environment: what
// counts is what the sidecar sets itself.
func startSidecarIn(t *testing.T, dir string, g *memCgroup, extra ...string) *sidecar {
	t.Helper()
	s := &sidecar{t: t, dir: dir, sock: filepath.Join(dir, "ringside.sock")}
	s.args = append(append([]string{}, defaultArgs...), extra...)
	s.logPath = filepath.Join(t.TempDir(), "sidecar.log")
	s.addr = freePort(t)
	args := append([]string{"-c", `echo $$ > "$0" && exec "$@"`, g.procs(), ringsideBin, "serve", "--dir", dir, "--metrics.addr", s.addr}, s.args...)
	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	s.cmd = exec.Command("/bin/sh", args...)
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "GOMEMLIMIT=") && !strings.HasPrefix(e, "GOGC=") {
			s.cmd.Env = append(s.cmd.Env, e)
		}
	}
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		t.Fatal(err)
	}
	logf.Close()
	s.exited = make(chan struct{})
	cmd, exited := s.cmd, s.exited
	go func() {
		s.waitErr = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(s.stop)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if resp, err := http.Get("http://" + s.addr + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s
			}
		}
		if !s.alive() {
			t.Fatalf("sidecar exited at start in the cgroup (%v): %s", s.waitErr, s.logTail())
		}
		if time.Now().After(deadline) {
			t.Fatalf("sidecar not ready: %s", s.logTail())
		}
	}
}

// --- 7. metadata against the memory limit ---

// hogResult is how one metadata hog ended.
type hogResult struct {
	name     string
	accepted int
	st       schema.Status
	msg      string
	err      error
}

func (h hogResult) String() string {
	switch {
	case h.err != nil:
		return fmt.Sprintf("%s: %d accepted, then %v", h.name, h.accepted, h.err)
	case h.st != 0:
		return fmt.Sprintf("%s: %d accepted, then status %d %q", h.name, h.accepted, h.st, short(h.msg, 50))
	}
	return fmt.Sprintf("%s: %d accepted, never refused", h.name, h.accepted)
}

// TestMetadataMemoryBound: the sidecar in a memory cgroup of its pool plus
// the manifest's headroom; sessions send every metadata-growing request at
// its maximum.
func TestMetadataMemoryBound(t *testing.T) {
	row := record(t, "Resource exhaustion", "the sidecar in a memory cgroup of pool (64 MiB, reserved) + 256 MiB (the manifest's headroom: deploy/base, 4352Mi for a 4 GiB pool); sessions of several instances and models, all of one uid, send at once: 4096-digest PutHashes without end (4 instances); 64 Acquires over a batch of 16 digests repeated to 1M, then leases without end (2 sessions); attaches held open with 64 MiB rings and new model and instance names; 8,192 attach/detach cycles with new names",
		"the sidecar is never OOM-killed (alive; the cgroup's oom_kill counter stays 0); every hog is refused with status 7 (attach/detach cycles: refused or not, never a crash); then a tenant of another uid attaches, stores 4 blocks and loads them byte-exact",
		"#16.7 metadata bounded globally")
	const pool, headroom = 64 << 20, 256 << 20
	dir := otherUIDDir(t)
	var fs syscall.Statfs_t
	if err := syscall.Statfs(filepath.Dir(dir), &fs); err != nil || int64(fs.Bavail)*fs.Bsize < 1<<30 {
		t.Skipf("needs 1 GiB free in /dev/shm for the pool and the rings (%d MiB free, %v)", int64(fs.Bavail)*fs.Bsize>>20, err)
	}
	g := newMemCgroup(t, pool+headroom)
	sc := startSidecarIn(t, dir, g, append([]string{"--pool.bytes", "64MiB", "--pool.slot-bytes", "256KiB", "--pool.reserve",
		"--ring.capacity", "1MiB", "--lease.max-ttl", "10m"}, otherUIDFlags...)...)
	const page = 256 << 10
	if by := otherTenant(t, sc.sock, "by", "by-1", 4, page); by.Loaded != 4 || by.Err != "" {
		t.Fatalf("bystander before the attack: %v", by)
	}
	sessOpts := func(name string) connector.Options {
		o := opts(sc.sock, name)
		o.Model = "model-" + name
		return o
	}
	// Lease hogs first register what they need (before the hash hogs take
	// the hash memory there is).
	type leaseHog struct {
		c *connector.Client
		n int
	}
	var lhogs []leaseHog
	for i := 0; i < 2; i++ {
		c := dial(t, sessOpts(fmt.Sprint("lease-", i)))
		reg := regionOver(1, make([]byte, 16*page))
		reg.reg.PageSize, reg.reg.PageCount = page, 16
		if err := c.RegisterRegion(reg.reg); err != nil {
			t.Fatal(err)
		}
		d := digests(fmt.Sprint("lease-hog-", i), 16)
		c.PutHashes(1, d, false)
		if r, err := c.Store(schema.View{Batch: 1, Count: 16}, 1, iota32(16)); err != nil || r.Stored != 16 {
			t.Fatalf("lease hog %d store: %+v %v", i, r, err)
		}
		chunk := make([]byte, 0, 4096*32)
		for len(chunk) < 4096*32 {
			chunk = append(chunk, d...)
		}
		n := 0
		for n < 1<<20 {
			if _, err := c.PutHashes(2, chunk, n > 0); err != nil {
				break
			}
			n += 4096
		}
		lhogs = append(lhogs, leaseHog{c, n})
	}
	var stop atomic.Bool
	var mu sync.Mutex
	var results []hogResult
	var wg sync.WaitGroup
	done := func(h hogResult) {
		mu.Lock()
		results = append(results, h)
		mu.Unlock()
	}
	// 1. Hash batches without end, 4 instances.
	big := digests("hog-hashes", 4096)
	for i := 0; i < 4; i++ {
		c := dial(t, sessOpts(fmt.Sprint("hash-", i)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, st, msg, err := hog(c, func(i int) (uint16, []byte) {
				return schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(i + 1), Digests: big}).Append(nil, 32)
			}, &stop)
			done(hogResult{fmt.Sprint("hash batches ", i), ok, st, msg, err})
		}()
	}
	// 2. Huge-view leases, then leases without end, 2 sessions.
	for i, lh := range lhogs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := hogResult{name: fmt.Sprintf("leases %d (views of %d digests)", i, lh.n)}
			for k := 0; k < 64 && !stop.Load(); k++ {
				_, err := lh.c.Acquire(schema.View{Batch: 2, Count: uint32(lh.n)}, 10*time.Minute)
				if err != nil {
					if h.st = status(err); h.st == 0xFFFF {
						h.st, h.err = 0, err
						done(h)
						return
					}
					h.msg = err.Error()
					break
				}
				h.accepted++
			}
			acq := (&schema.Acquire{View: schema.View{Batch: 1, Count: 16}, TTLms: 600000}).Append(nil)
			ok, st, msg, err := hog(lh.c, func(int) (uint16, []byte) { return schema.TypeAcquire, acq }, &stop)
			h.accepted += ok
			h.st, h.msg, h.err = st, msg, err
			done(h)
		}()
	}
	// 3. Attaches held open, new names, the largest rings a client may ask.
	var held []*connector.Client
	wg.Add(1)
	go func() {
		defer wg.Done()
		h := hogResult{name: "held attaches (64 MiB rings)"}
		for i := 0; !stop.Load() && i < 4096; i++ {
			o := sessOpts(fmt.Sprint("held-", i))
			o.RingCapacity = 64 << 20
			c, err := connector.Dial(o)
			if err != nil {
				if h.st = status(err); h.st == 0xFFFF {
					h.st, h.err = 0, err
				} else {
					h.msg = err.Error()
				}
				break
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
			h.accepted++
		}
		done(h)
	}()
	// 4. Attach/detach cycles with new names.
	var cycles, cycleRefused atomic.Int64
	var churnErr atomic.Value
	for k := 0; k < 4; k++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				i := cycles.Add(1)
				if i > 8192 {
					return
				}
				c, err := connector.Dial(sessOpts(fmt.Sprint("cycle-", i)))
				if err != nil {
					if st := status(err); st == 0xFFFF {
						churnErr.CompareAndSwap(nil, err)
						return
					}
					cycleRefused.Add(1)
					continue
				}
				c.Close()
			}
		}()
	}
	t0 := time.Now()
	allDone := make(chan struct{})
	go func() { wg.Wait(); close(allDone) }()
	select {
	case <-allDone:
	case <-time.After(40 * time.Second):
		stop.Store(true)
		<-allDone
	}
	took := time.Since(t0)
	time.Sleep(200 * time.Millisecond)
	kills, peak := g.oomKills(), g.peak()
	row.add("cgroup %s (v2 %v), limit %d MiB, peak %d MiB, oom_kill %d; attack %v", filepath.Base(g.dir), g.v2, g.limit>>20, peak>>20, kills, took.Round(time.Millisecond))
	var parts []string
	for _, h := range results {
		parts = append(parts, h.String())
	}
	parts = append(parts, fmt.Sprintf("attach/detach cycles: %d, %d refused", min(cycles.Load(), 8192), cycleRefused.Load()))
	summary := strings.Join(parts, "; ")
	row.add("%s", summary)
	if !sc.alive() || kills > 0 {
		t.Fatalf("the sidecar was killed (%v; the cgroup's oom_kill: %d, peak %d MiB of %d) after %v of attack: %s", sc.waitErr, kills, peak>>20, g.limit>>20, took.Round(time.Millisecond), summary)
	}
	for _, h := range results {
		// Held attaches may also find the mount full first (status 8).
		held := strings.HasPrefix(h.name, "held") && h.st == schema.ErrCodeNoSpace
		if h.err != nil || h.st != schema.ErrCodeTooLarge && !held {
			t.Errorf("not bounded with status 7: %v", h)
		}
	}
	if err, _ := churnErr.Load().(error); err != nil {
		t.Errorf("attach/detach cycles: %v", err)
	}
	// Another tenant, while every hog still holds what it got.
	by := otherTenant(t, sc.sock, "by", "by-2", 4, page)
	if by.Attach != "" || by.Err != "" || by.Stored != 4 || by.Loaded != 4 || by.Bad != 0 {
		t.Errorf("a tenant of another uid during the attack: %v", by)
	}
	row.add("a tenant of another uid then: stored %d, loaded %d byte-exact (%s%s)", by.Stored, by.Loaded, by.Attach, by.Err)
	mu.Lock()
	for _, c := range held {
		c.Close()
	}
	mu.Unlock()
}

// --- 13, 14. namespaces and instances freed ---

// attachChurn runs total attach/detach cycles from 8 goroutines; name gives the
// instance and model of cycle i. It returns the refusals by status.
func attachChurn(t *testing.T, sc *sidecar, total int64, name func(i int64) (string, string)) map[schema.Status]int {
	t.Helper()
	var n atomic.Int64
	var wg sync.WaitGroup
	var mu sync.Mutex
	refused := map[schema.Status]int{}
	var first error
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := n.Add(1)
				if i > total {
					return
				}
				inst, model := name(i)
				o := opts(sc.sock, inst)
				o.Model = model
				o.RingCapacity = 64 << 10
				c, err := connector.Dial(o)
				if err != nil {
					mu.Lock()
					refused[status(err)]++
					if first == nil {
						first = err
					}
					mu.Unlock()
					if status(err) == 0xFFFF {
						return
					}
					continue
				}
				c.Close()
			}
		}()
	}
	wg.Wait()
	if first != nil {
		t.Logf("first refusal: %v", first)
	}
	return refused
}

func refusals(m map[schema.Status]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestNamespaceChurn: more attach/detach cycles with new model names than
// there are namespace ids.
func TestNamespaceChurn(t *testing.T) {
	row := record(t, "Resource exhaustion", "70,000 attach/detach cycles (8 at a time), each with a new model name and instance name, nothing stored",
		"every cycle attaches (no namespace is kept by a model nobody uses); afterwards a new model attaches, stores and loads byte-exact; the sidecar's anonymous memory grows by < 64 MiB (it keeps nothing for an engine that left; 64 MiB is a quarter of the manifest's 256 MiB headroom and ample Go heap slack: cycles that create no records grow it by ~3 MiB)",
		"#16.13 namespaces freed")
	sc := startSidecar(t, newDir(t), "--ring.capacity", "64KiB")
	attachChurn(t, sc, 2000, func(i int64) (string, string) { return "warm", "warm" })
	time.Sleep(200 * time.Millisecond)
	before := anonKiB(sc.pid())
	t0 := time.Now()
	const cycles = 70000
	refused := attachChurn(t, sc, cycles, func(i int64) (string, string) { return fmt.Sprint("ns-i", i), fmt.Sprint("ns-m", i) })
	took := time.Since(t0)
	time.Sleep(200 * time.Millisecond)
	grew := anonKiB(sc.pid()) - before
	st := sc.state().Pool
	if n := refusals(refused); n > 0 {
		t.Errorf("%d of %d attach/detach cycles with new model names refused (by status: %v), with no session left attached", n, cycles, refused)
	}
	o := opts(sc.sock, "after")
	o.Model = "a-new-model"
	c, err := connector.Dial(o)
	if err != nil {
		t.Errorf("a new model after %d cycles: %v", cycles, err)
	} else {
		defer c.Close()
		reg := newRegion(1, 4)
		c.RegisterRegion(reg.reg)
		d := digests("after-churn", 2)
		fillPage(reg.page(0), d[:32], 0x13)
		fillPage(reg.page(1), d[32:], 0x13)
		c.PutHashes(1, d, false)
		if r, err := c.Store(schema.View{Batch: 1, Count: 2}, 1, []uint32{0, 1}); err != nil || r.Stored != 2 {
			t.Errorf("the new model's store: %+v %v", r, err)
		} else if l, err := c.Acquire(schema.View{Batch: 1, Count: 2}, 10*time.Second); err != nil || l.Blocks != 2 {
			t.Errorf("the new model's acquire: %+v %v", l, err)
		} else if _, err := c.Load(l.Lease, 1, 0, []uint32{2, 3}); err != nil || !pageOK(reg.page(2), d[:32], 0x13) || !pageOK(reg.page(3), d[32:], 0x13) {
			t.Errorf("the new model's load: %v", err)
		}
	}
	if grew > 64<<10 {
		t.Errorf("%d cycles grew the sidecar's anonymous memory by %d MiB (bound 64 MiB): %d namespaces kept", cycles, grew>>10, st.Namespaces)
	}
	row.add("%d cycles in %v: %d refused %v; %d namespaces in the pool's stats after; anonymous memory +%d MiB; a new model then: %v", cycles, took.Round(time.Millisecond), refusals(refused), refused, st.Namespaces, grew>>10, errString(err))
}

// TestInstanceChurn: attach/detach cycles of one model with a new
// instance name each time.
func TestInstanceChurn(t *testing.T) {
	row := record(t, "Resource exhaustion", "49,152 attach/detach cycles (8 at a time) of one model, each with a new instance name, after 8,192 that reuse one name (the baseline, same run)",
		"the sidecar keeps nothing for an instance that left: the new-name cycles grow its anonymous memory by < 8 MiB (an instance record is ~470 bytes: 49,152 kept ones are ~22 MiB; 8 MiB is Go heap slack, and the same-name cycles are reported beside it)",
		"#16.14 instances freed")
	sc := startSidecar(t, newDir(t), "--ring.capacity", "64KiB")
	const base, cycles = 8192, 49152
	attachChurn(t, sc, 2000, func(i int64) (string, string) { return "same", "llama-rel" })
	time.Sleep(200 * time.Millisecond)
	a0 := anonKiB(sc.pid())
	if r := attachChurn(t, sc, base, func(i int64) (string, string) { return "same", "llama-rel" }); refusals(r) > 0 {
		t.Fatalf("same-name cycles refused: %v", r)
	}
	time.Sleep(200 * time.Millisecond)
	a1 := anonKiB(sc.pid())
	refused := attachChurn(t, sc, cycles, func(i int64) (string, string) { return fmt.Sprint("inst-", i), "llama-rel" })
	time.Sleep(200 * time.Millisecond)
	a2 := anonKiB(sc.pid())
	same, fresh := a1-a0, a2-a1
	if n := refusals(refused); n > 0 {
		t.Errorf("%d of %d cycles with new instance names refused: %v", n, cycles, refused)
	}
	if fresh > 8<<10 {
		t.Errorf("%d cycles with new instance names grew the sidecar's anonymous memory by %d KiB (%d bytes a cycle; bound 8 MiB); %d same-name cycles before them, by %d KiB", cycles, fresh, fresh*1024/cycles, base, same)
	}
	row.add("anonymous memory: +%d KiB over %d same-name cycles, +%d KiB (%d bytes a cycle) over %d new-name cycles", same, base, fresh, fresh*1024/cycles, cycles)
}
