package reliability

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
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

// Process identity (issue #16, point 5): a session belongs to the process
// that attached. When that process exits, the session ends, whoever still
// holds its socket and rings; no copy runs on a process that is gone (or
// on whatever process has its pid now), and a store whose process died
// during its copy is never served.

func init() {
	childRoles["stalledstore"] = stalledStoreChild
	defect(Defect{Issue: 16, Point: 5, Title: "RegisterRegion trusts a bare pid: the session of an engine that forked and exited lives on in its child, and once the pid is reused the sidecar reads and writes the new process's memory; a store whose engine died mid-copy is served",
		Tests:  "TestForkedChildOutlivesAttacher, TestStalledStoreEngineExits",
		Before: "at d6f9fd5: TestForkedChildOutlivesAttacher: session not gone 5 s after the engine exited; \"ping ok\", Load \"ok 1\", \"the sidecar wrote into the memory of the new process that has pid P (the exited engine's): its page holds the stored block\"; TestStalledStoreEngineExits: \"the store of an engine killed during its copy is served: lookup 4 of 4\" (block 0 loads as zeros)",
		Fix:    "the session is bound to a pidfd of the attached process (SO_PEERPIDFD, else pidfd_open with a start-time check) and ends when it exits; copies run only while it is alive, checked before and after (pidfd and a one-byte read), a store whose process died is discarded"})
}

// lineReader reads one JSON object per line from a pipe, with a deadline.
type lineReader struct {
	f *os.File
	r *bufio.Reader
}

func (lr *lineReader) next(d time.Duration, v any) error {
	lr.f.SetReadDeadline(time.Now().Add(d))
	b, err := lr.r.ReadBytes('\n')
	if err != nil {
		return fmt.Errorf("reading the child: %w (got %q)", err, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%w: %q", err, b)
	}
	return nil
}

// waitSessionGone waits until /debug/state no longer lists session id, at
// most within; it reports whether it went.
func waitSessionGone(sc *sidecar, id uint64, within time.Duration) bool {
	deadline := time.Now().Add(within)
	for {
		st, err := sc.tryState()
		if err == nil {
			found := false
			for _, s := range st.Sessions {
				found = found || s.ID == id
			}
			if !found {
				return true
			}
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestForkedChildOutlivesAttacher: an engine attaches, registers memory,
// takes a lease, forks and exits; its child keeps the socket and the rings
// and, before the parent exits, takes over both ring roles (so the ring
// header names a live process, as after a fork-aware client's re-init).
// The child is a Python process (testdata/forkchild.py) because a Go test
// binary cannot fork without exec, and only a real fork keeps the fds, the
// ring mappings and the registered memory at the same addresses. The pid of
// the exited engine is then given to a new process (the child's own fork,
// through clone3 set_tid: deterministic pid reuse, where the wild would
// take its chances), and the child asks for a Load into the region that
// names that pid.
func TestForkedChildOutlivesAttacher(t *testing.T) {
	row := record(t, "Isolation", "an engine attaches, registers memory, takes a lease, forks and exits; its child keeps the socket fd and ring mappings, pings, and asks for a Load into the region of the exited pid, which a new process (with a copy of that memory) now holds",
		"the session ends when the attached process exits: the child's requests fail, and no copy touches the new process's memory or the child's", "")
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("needs python3 for the forking engine: ", err)
	}
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	sc := startSidecar(t, newDir(t))
	d := digests("forked-engine", 1)
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer inW.Close()
	defer outR.Close()
	stderr, err := os.Create(filepath.Join(t.TempDir(), "forkchild.stderr"))
	if err != nil {
		t.Fatal(err)
	}
	defer stderr.Close()
	cmd := exec.Command(py, filepath.Join(root, "reliability", "testdata", "forkchild.py"))
	cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(root, "connector", "python"),
		"RS_SOCK="+sc.sock, "RS_DIGEST="+hex.EncodeToString(d))
	// Files, not pipes that exec copies through goroutines: Wait must
	// return when the parent exits, although its child keeps them open.
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	outW.Close()
	errOut := func() string { b, _ := os.ReadFile(stderr.Name()); return short(string(b), 1500) }
	lr := &lineReader{f: outR, r: bufio.NewReader(outR)}
	var parent struct {
		Parent  int    `json:"parent"`
		Session uint64 `json:"session"`
		Lease   uint64 `json:"lease"`
		Error   string `json:"error"`
	}
	if err := lr.next(20*time.Second, &parent); err != nil || parent.Parent == 0 {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("the engine did not attach: %v %+v: %s", err, parent, errOut())
	}
	var child struct {
		Child int `json:"child"`
	}
	if err := lr.next(10*time.Second, &child); err != nil || child.Child == 0 {
		t.Fatalf("the forked child did not start: %v: %s", err, errOut())
	}
	gotResult := false
	t.Cleanup(func() {
		if !gotResult { // the child we started hangs: end it
			syscall.Kill(child.Child, syscall.SIGKILL)
		}
	})
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the engine (pid %d) exited with %v: %s", parent.Parent, err, errOut())
	}
	// pid P is reaped and free. A sidecar that binds the session to the
	// process ends it now; give it a bounded while before the child tries.
	gone := waitSessionGone(sc, parent.Session, 5*time.Second)
	if _, err := inW.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	var res struct {
		Ping       string `json:"ping"`
		Reuse      string `json:"reuse"`
		Load       string `json:"load"`
		VictimPage string `json:"victim_page"`
		OwnPage    string `json:"own_page"`
	}
	if err := lr.next(30*time.Second, &res); err != nil {
		t.Fatalf("the child's report: %v: %s", err, errOut())
	}
	gotResult = true
	row.add("engine pid %d exited and was reaped; its session %d gone within 5 s: %v; the child (pid %d): ping %q; pid reuse: %s; load %q; new pid-%d process's page: %s; child's page: %s",
		parent.Parent, parent.Session, gone, child.Child, short(res.Ping, 60), res.Reuse, short(res.Load, 60), parent.Parent, res.VictimPage, res.OwnPage)
	if !strings.HasPrefix(res.Ping, "error") {
		t.Errorf("the session of pid %d, which exited, still serves its forked child (pid %d): ping %s", parent.Parent, child.Child, res.Ping)
	}
	if !strings.HasPrefix(res.Load, "error") {
		t.Errorf("the forked child's Load over the exited engine's session was served: %s", res.Load)
	}
	if strings.HasPrefix(res.Reuse, "pid ") {
		if res.VictimPage != "untouched" {
			t.Errorf("the sidecar wrote into the memory of the new process that has pid %d (the exited engine's): its page holds %s", parent.Parent, res.VictimPage)
		}
	} else {
		t.Logf("pid reuse not tried (%s): the load went to a pid no process has", res.Reuse)
	}
	if res.OwnPage != "untouched" {
		t.Errorf("a copy touched the forked child's memory: its page holds %s", res.OwnPage)
	}
	checkAlive(t, sc)
}

// stalledStoreChild is an engine whose Store copy stalls (userfaultfd on
// its first page): it prints "stalled" once the sidecar's copy is blocked
// there, then waits to be killed. With no userfaultfd it prints the reason
// ("skip: ...").
func stalledStoreChild() int {
	n := envInt("RS_PAGES", 4)
	o := opts(os.Getenv("RS_SOCK"), "dying-engine")
	o.Timeout = 5 * time.Second
	c, err := connector.Dial(o)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	d := digests("stalled-store", n)
	s, err := newStalled(n, func(i int, p []byte) { fillPage(p, d[i*32:(i+1)*32], 0x5) }, 0)
	if err != nil {
		fmt.Println("skip:", err)
		return 0
	}
	if s.page != slot {
		fmt.Printf("skip: the OS page is %d bytes, the test needs %d\n", s.page, slot)
		return 0
	}
	if err := c.RegisterRegion(regionOver(1, s.mem).reg); err != nil {
		fmt.Println("error:", err)
		return 1
	}
	if _, err := c.PutHashes(1, d, false); err != nil {
		fmt.Println("error:", err)
		return 1
	}
	if _, err := c.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: uint32(n)}, Region: 1, Pages: iota32(n)}).Append(nil)); err != nil {
		fmt.Println("error:", err)
		return 1
	}
	if err := s.waitFault(10 * time.Second); err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("stalled")
	time.Sleep(time.Hour) // until killed
	return 0
}

// TestStalledStoreEngineExits: an engine's Store is stalled inside the
// sidecar's copy (userfaultfd on the engine's first page) and the engine is
// killed. The kernel then releases the userfaultfd and the copy goes on
// over memory that is no longer anybody's (the missing page reads as
// zeros): the store must be discarded, never served.
func TestStalledStoreEngineExits(t *testing.T) {
	row := record(t, "Isolation", "an engine's Store copy is held at its first page (userfaultfd); the engine is SIGKILLed while the copy waits, which lets the copy go on over the dying process's memory",
		"a store whose process died during its copy is discarded: another session of the namespace looks the blocks up and finds none", "")
	const n = 4
	sc := startSidecar(t, newDir(t), "--copy.workers", "4")
	cmd := child("stalledstore", "RS_SOCK="+sc.sock, fmt.Sprintf("RS_PAGES=%d", n))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(out).ReadString('\n')
		lines <- strings.TrimSpace(l)
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(20 * time.Second):
		line = "error: no word from the engine within 20 s"
	}
	if !strings.HasPrefix(line, "stalled") {
		cmd.Process.Kill()
		cmd.Wait()
		if strings.HasPrefix(line, "skip:") {
			t.Skip(strings.TrimSpace(strings.TrimPrefix(line, "skip:")))
		}
		t.Fatalf("the engine: %s", line)
	}
	var sess uint64
	for _, s := range sc.state().Sessions {
		if s.Instance == "dying-engine" {
			sess = s.ID
		}
	}
	cmd.Process.Kill()
	cmd.Wait()
	gone := waitSessionGone(sc, sess, 10*time.Second)
	obs := dial(t, opts(sc.sock, "observer"))
	d := digests("stalled-store", n)
	if _, err := obs.PutHashes(1, d, false); err != nil {
		t.Fatal(err)
	}
	v := schema.View{Batch: 1, Count: n}
	hits, err := obs.Lookup(v)
	if err != nil {
		t.Fatal(err)
	}
	row.add("engine killed with its store's copy stalled; its session gone within 10 s: %v; lookup from another session: %d of %d blocks", gone, hits, n)
	if hits > 0 {
		what := "not loaded"
		if l, err := obs.Acquire(schema.View{Batch: 1, Count: uint32(hits)}, time.Minute); err == nil && l.Blocks > 0 {
			dst := newRegion(1, 1)
			obs.RegisterRegion(dst.reg)
			if _, err := obs.Load(l.Lease, 1, 0, []uint32{0}); err == nil {
				zero := true
				for _, b := range dst.page(0) {
					zero = zero && b == 0
				}
				what = fmt.Sprintf("block 0 (the page that was missing when the engine died) loads as its stored bytes: %v, all zeros: %v", pageOK(dst.page(0), d[:32], 0x5), zero)
			}
			obs.Release(l.Lease)
		}
		t.Errorf("the store of an engine killed during its copy is served: lookup %d of %d; %s", hits, n, what)
	}
	checkAlive(t, sc)
}
