package reliability

import (
	"encoding/json"
	"fmt"
	"net"
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

// nodeProc is a real `ringside node` process.
type nodeProc struct {
	t       *testing.T
	dir     string
	sock    string
	cmd     *exec.Cmd
	logPath string
	exited  chan struct{}
	extra   []string // more flags of `ringside node`
	ns      bool     // run it in mount and PID namespaces of its own (nodens_test.go)
	env     []string // with ns: nsCommand's env
}

func startNode(t *testing.T, dir string) *nodeProc {
	t.Helper()
	n := &nodeProc{t: t, dir: dir, sock: filepath.Join(dir, "node.sock"), logPath: filepath.Join(t.TempDir(), "node.log")}
	n.start()
	t.Cleanup(n.stop)
	return n
}

func (n *nodeProc) start() {
	t := n.t
	t.Helper()
	logf, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	args := append([]string{"node", "--dir", n.dir, "--pool.bytes", "2MiB", "--pool.slot-bytes", "4KiB", "--pool.reserve=false", "--io-timeout", "1s"}, n.extra...)
	if n.ns {
		n.cmd = nsCommand("node", "node", n.logPath, args, n.env...)
	} else {
		// The sidecars share this process's network namespace: each is
		// the pod its --node.pod names.
		n.cmd = exec.Command(ringsideBin, append(args, "--pod-identity", "declared")...)
	}
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	n.exited = make(chan struct{})
	cmd, exited := n.cmd, n.exited
	go func() { cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if c, err := net.Dial("unixpacket", n.sock); err == nil {
			c.Close()
			return
		}
		select {
		case <-n.exited:
			b, _ := os.ReadFile(n.logPath)
			t.Fatalf("ringside node exited at start (%v): %s", n.cmd.ProcessState, b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("ringside node did not listen")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (n *nodeProc) kill9() {
	n.cmd.Process.Signal(syscall.SIGKILL)
	<-n.exited
}

func (n *nodeProc) stop() {
	select {
	case <-n.exited:
		return
	default:
	}
	n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.exited:
	case <-time.After(10 * time.Second):
		n.t.Errorf("ringside node did not stop within 10 s of SIGTERM")
		n.kill9()
	}
}

// nodeState is the node tier's part of a sidecar's /debug/state.
type nodeState struct {
	Connected bool              `json:"connected"`
	Epoch     uint64            `json:"epoch"`
	Counts    map[string]uint64 `json:"counts"`
}

func (s *sidecar) nodeState() nodeState {
	var st struct {
		L2 *struct {
			Node *nodeState `json:"node"`
		} `json:"l2"`
	}
	resp, err := s.http().Get("http://" + s.addr + "/debug/state")
	if err == nil {
		json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
	}
	if st.L2 == nil || st.L2.Node == nil {
		return nodeState{}
	}
	return *st.L2.Node
}

func (s *sidecar) waitNode(what string, cond func(nodeState) bool) {
	s.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond(s.nodeState()) {
		if time.Now().After(deadline) {
			s.t.Fatalf("node tier not %s: %+v", what, s.nodeState())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// storePrompt stores a prompt's n blocks through an engine of sc.
func storePrompt(t *testing.T, sc *sidecar, instance, seed string, n int, tag uint64) {
	t.Helper()
	if err := engineStore(opts(sc.sock, instance), seed, n, tag); err != nil {
		t.Fatal(err)
	}
}

// loadPrompt looks a prompt up and loads what it finds through an engine
// of sc, checking every byte; it returns the blocks found and how long the
// lookup took. Any error is the test's failure: the tier never fails an
// engine's request.
func loadPrompt(t *testing.T, sc *sidecar, instance, seed string, n int, tag uint64) (int, time.Duration) {
	t.Helper()
	got, took, err := engineLoad(opts(sc.sock, instance), seed, n, tag, nil)
	if err != nil {
		t.Fatal(err)
	}
	return got, took
}

// engineStore stores a prompt's n blocks as an engine attached with o:
// storePrompt's steps, for a test or a child process.
func engineStore(o connector.Options, seed string, n int, tag uint64) error {
	c, err := connector.Dial(o)
	if err != nil {
		return err
	}
	defer c.Close()
	r := newRegion(1, n)
	if err := c.RegisterRegion(r.reg); err != nil {
		return err
	}
	d := digests(seed, n)
	for j := 0; j < n; j++ {
		fillPage(r.page(j), d[j*32:(j+1)*32], tag)
	}
	if _, err := c.PutHashes(1, d, false); err != nil {
		return err
	}
	if st, err := c.Store(schema.View{Batch: 1, Count: uint32(n)}, 1, iota32(n)); err != nil || int(st.Stored) != n {
		return fmt.Errorf("store: %+v %v", st, err)
	}
	return nil
}

// engineLoad is loadPrompt's steps as an engine attached with o; pause,
// when not nil, runs between the lookup and the acquire with the blocks
// the lookup found. A block that loads with other bytes than its prompt's
// is an error.
func engineLoad(o connector.Options, seed string, n int, tag uint64, pause func(hits int) error) (int, time.Duration, error) {
	c, err := connector.Dial(o)
	if err != nil {
		return 0, 0, err
	}
	defer c.Close()
	r := newRegion(1, n)
	if err := c.RegisterRegion(r.reg); err != nil {
		return 0, 0, err
	}
	d := digests(seed, n)
	if _, err := c.PutHashes(1, d, false); err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	hits, err := c.Lookup(schema.View{Batch: 1, Count: uint32(n)})
	took := time.Since(t0)
	if err != nil {
		return 0, took, fmt.Errorf("lookup: %w", err)
	}
	if pause != nil {
		if err := pause(hits); err != nil {
			return 0, took, err
		}
	}
	if hits == 0 {
		return 0, took, nil
	}
	l, err := c.Acquire(schema.View{Batch: 1, Count: uint32(n)}, 10*time.Second)
	if err != nil {
		return 0, took, fmt.Errorf("acquire: %w", err)
	}
	for i := 0; l.State == schema.StateWaiting; i++ {
		if i > 5000 {
			return 0, took, fmt.Errorf("lease still waiting: %+v", l)
		}
		time.Sleep(time.Millisecond)
		if l, err = c.Poll(l.Lease); err != nil {
			return 0, took, fmt.Errorf("poll: %w", err)
		}
	}
	if l.State != schema.StateReady {
		return 0, took, nil
	}
	got, err := c.Load(l.Lease, 1, 0, iota32(int(l.Blocks)))
	if err != nil {
		return 0, took, fmt.Errorf("load: %w", err)
	}
	for j := 0; j < got; j++ {
		if !pageOK(r.page(j), d[j*32:(j+1)*32], tag) {
			return got, took, fmt.Errorf("STALE OR CORRUPT: %s block %d", seed, j)
		}
	}
	c.Release(l.Lease)
	return got, took, nil
}

// TestNodeTierAcrossProcesses runs a real `ringside node` and two real
// `ringside serve` processes beside it, as two engine pods of one node.
func TestNodeTierAcrossProcesses(t *testing.T) {
	row := record(t, "Faults", "the node tier across processes: a `ringside node` process and two `ringside serve` processes (pods A and B) attached to it; A's sidecar restarted; the node process SIGKILLed mid-run and started again",
		"what A's engine stores, B's engine loads byte-exact through the node tier; after A's sidecar restarts (empty pool) its engine loads its blocks from the node tier; with the node process dead every engine request succeeds (misses from the tier), each lookup answered without it; both sidecars re-attach to the new node process by themselves, which starts empty and serves again", "")
	ndir, err := os.MkdirTemp("", "rs-rel-node-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(ndir) })
	nd := filepath.Join(ndir, "n")
	np := startNode(t, nd)
	tier := []string{"--node.socket", np.sock, "--node.lookup-timeout", "500ms", "--node.io-timeout", "2s"}
	a := startSidecar(t, newDir(t), append(tier, "--node.pod", "pod-a")...)
	b := startSidecar(t, newDir(t), append(tier, "--node.pod", "pod-b")...)
	for _, sc := range []*sidecar{a, b} {
		sc.waitNode("attached", func(s nodeState) bool { return s.Connected })
	}
	const n = 16
	storePrompt(t, a, "engine-a", "system prompt", n, 7)
	a.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == n })
	if got, _ := loadPrompt(t, b, "engine-b", "system prompt", n, 7); got != n {
		t.Fatalf("pod B loaded %d of %d blocks A stored", got, n)
	}
	row.add("B loaded %d/%d blocks A stored, byte-exact (%d fetched from the node tier)", n, n, b.nodeState().Counts["fetched_blocks"])

	a.stop()
	a.start()
	a.waitNode("re-attached", func(s nodeState) bool { return s.Connected })
	if got, _ := loadPrompt(t, a, "engine-a2", "system prompt", n, 7); got != n {
		t.Fatalf("after its sidecar restarted, A loaded %d of %d blocks", got, n)
	}
	row.add("after A's sidecar restarted, A loaded %d/%d from the node tier", n, n)

	np.kill9()
	for _, sc := range []*sidecar{a, b} {
		sc.waitNode("detached", func(s nodeState) bool { return !s.Connected })
	}
	// With the tier dead every lookup is answered without it, at once
	// (counted as unanswered by the tier, never waited for); a hang would
	// fail at the engine client's own deadline. The times are figures.
	var worst time.Duration
	unanswered := b.nodeState().Counts["lookups_unanswered"]
	for i := 0; i < 5; i++ {
		seed := fmt.Sprintf("while the tier is down %d", i)
		storePrompt(t, a, "engine-a3", seed, 4, 9)
		got, took := loadPrompt(t, b, "engine-b2", seed, 4, 9)
		if got != 0 {
			t.Fatalf("B found %d blocks only A holds, with the node tier dead", got)
		}
		worst = max(worst, took)
	}
	if n := b.nodeState().Counts["lookups_unanswered"] - unanswered; n < 5 {
		t.Fatalf("%d of 5 lookups with the node tier dead were answered without it", n)
	}
	row.add("node process SIGKILLed: 10 stores and lookups succeeded, slowest lookup %v", worst.Round(time.Microsecond))

	np.start()
	for _, sc := range []*sidecar{a, b} {
		sc.waitNode("re-attached to the new node process", func(s nodeState) bool { return s.Connected && s.Counts["attaches"] >= 2 })
	}
	storePrompt(t, a, "engine-a4", "after the node's restart", 8, 11)
	a.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] >= 8 })
	if got, _ := loadPrompt(t, b, "engine-b3", "after the node's restart", 8, 11); got != 8 {
		t.Fatalf("the new node process served %d of 8", got)
	}
	row.add("both re-attached to the new node process; B loaded 8/8 blocks A stored after it")
}

// TestNodeTierHung stops the node process (SIGSTOP) under traffic: engine
// requests neither fail nor wait past the tier's deadlines, stores go on,
// and once it runs again (SIGCONT) the tier serves again.
func TestNodeTierHung(t *testing.T) {
	row := record(t, "Faults", "the node tier's process stopped (SIGSTOP) while two sidecars use it, then continued (SIGCONT)",
		"while it is stopped, every engine request succeeds: a lookup that asks the node tier is answered at the tier's lookup deadline (500 ms; counted as a timeout), with the pod's own blocks; stores succeed; once it continues, the blocks stored before are served byte-exact through it again", "")
	ndir, err := os.MkdirTemp("", "rs-rel-node-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(ndir) })
	np := startNode(t, filepath.Join(ndir, "n"))
	tier := []string{"--node.socket", np.sock, "--node.lookup-timeout", "500ms", "--node.io-timeout", "1s"}
	a := startSidecar(t, newDir(t), append(tier, "--node.pod", "pod-a")...)
	b := startSidecar(t, newDir(t), append(tier, "--node.pod", "pod-b")...)
	for _, sc := range []*sidecar{a, b} {
		sc.waitNode("attached", func(s nodeState) bool { return s.Connected })
	}
	storePrompt(t, a, "engine-a", "before the stop", 8, 3)
	a.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == 8 })

	np.cmd.Process.Signal(syscall.SIGSTOP)
	stopped := true
	waitStopped(t, np.cmd.Process.Pid)
	defer func() {
		if stopped {
			np.cmd.Process.Signal(syscall.SIGCONT)
		}
	}()
	var worstLookup, worstStore time.Duration
	timeouts := b.nodeState().Counts["timeouts"]
	for i := 0; i < 4; i++ {
		got, took := loadPrompt(t, b, fmt.Sprintf("engine-b%d", i), "before the stop", 8, 3)
		if got != 0 {
			t.Fatalf("B loaded %d blocks from a stopped node tier", got)
		}
		worstLookup = max(worstLookup, took)
		t0 := time.Now()
		// Two blocks each: with the 8 before, within A's share of the node
		// pool (32 slots), so that its writes queued meanwhile, taken once
		// the node continues, evict none of A's blocks.
		storePrompt(t, a, fmt.Sprintf("engine-a%d", i), fmt.Sprintf("while stopped %d", i), 2, 4)
		worstStore = max(worstStore, time.Since(t0))
	}
	// Each lookup was answered at the tier's deadline (a timeout counted
	// by B's client), not by the stopped node; a lookup that waited for
	// ever would fail at the engine client's own deadline. The times are
	// figures.
	if n := b.nodeState().Counts["timeouts"] - timeouts; n < 4 {
		t.Fatalf("%d of 4 lookups timed out on the stopped node tier", n)
	}
	row.add("node process stopped: 4 lookups answered without it, slowest %v; 4 stores of 2 blocks, slowest %v (attach, register, store)", worstLookup.Round(time.Millisecond), worstStore.Round(time.Millisecond))

	np.cmd.Process.Signal(syscall.SIGCONT)
	stopped = false
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, _ := loadPrompt(t, b, "engine-b-after", "before the stop", 8, 3)
		if got == 8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the node tier did not serve again after SIGCONT: %+v", b.nodeState())
		}
		time.Sleep(100 * time.Millisecond)
	}
	row.add("continued: B loaded 8/8 blocks stored before the stop, byte-exact; B's client timed out %d requests and attached %d times", b.nodeState().Counts["timeouts"], b.nodeState().Counts["attaches"])
}

// waitStopped waits until every thread of process pid is stopped (state T
// in /proc): kill(SIGSTOP) returns before the process's threads stop, and
// on a loaded machine one of them may still answer a request meanwhile.
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			t.Fatal(err)
		}
		all := len(tasks) > 0
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
			// The state follows the command name's closing parenthesis.
			if i := strings.LastIndexByte(string(b), ')'); err != nil || i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
				all = false
				break
			}
		}
		if all {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d did not stop", pid)
		}
		time.Sleep(time.Millisecond)
	}
}
