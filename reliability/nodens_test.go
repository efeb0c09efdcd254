package reliability

// The node tier with its processes in separate mount and PID namespaces,
// as on a node: `ringside node` in its own, and each engine pod (its
// `ringside serve` and an engine client beside it, sharing the pod's own
// /dev/shm, a fresh tmpfs) in its own, and in a network namespace of its
// own, as Kubernetes gives each pod (the node tells pods apart by it). They share only the host directory
// of the node's socket, which the pods mount read-only, as deployed; the
// node process runs as nodeUID, the pods' as root. Each namespace's first
// process is a copy of this test binary in the role "ns": it makes its
// mounts private, mounts its tmpfs on /dev/shm and a /proc of its PID
// namespace, and then either becomes `ringside node` (exec, as nodeUID)
// or runs a pod: it starts the pod's
// sidecar and carries out the parent's steps (one JSON object a line on
// its stdin), answering one JSON object a line on its stdout. It is the
// PID namespace's init: when it dies, the kernel kills the rest of its
// namespace, and its mounts go with the namespace.

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// nsSkipEnv, set to 1, skips the namespace tests where namespaces cannot
// be made (not root, or unshare refused). Without it they fail there.
const nsSkipEnv = "RINGSIDE_SKIP_NAMESPACE_TESTS"

// nsMountTag names the tmpfs mounts the namespaces make (the mount's
// source), so that the parent can check none of them reached its own
// mount table.
const nsMountTag = "rs-ns-"

func init() {
	childRoles["ns"] = nsChild
	defect(Defect{
		Title:  "a process that sees the node tier's directory through a read-only mount, as the node's uid (any sidecar container as deployed), could hold the node process's lock file once that process had died (flock takes a lock through a read-only descriptor): no node process could start again, and the tier stayed down",
		Tests:  "TestNodeTierNamespacesAttacks",
		Before: "at 1de4c06: the hostile pod (uid 1000, the directory mounted read-only) opened node.lock read-only: ok, flock: ok; the next `ringside node` exited at start (exit status 1): another node process holds it",
		Fix:    "the node's lock file is mode 0200 and opened write-only (sys.TryLockWriteOnly): through a read-only mount it can be opened neither to read nor to write",
	})
	defect(Defect{
		Title:  "the node tier took a pod to be the name its sidecar declared: a hostile sidecar could hold every connection the node allows (each under another name), so that no other pod's sidecar could attach, and by writing under name after name it had a fresh pod share each time and could evict every other pod's blocks",
		Tests:  "TestNodeTierNamespacesPodIdentity",
		Before: "measured with --pod-identity declared, which takes a pod to be its declared name as every release before did: the hostile pod attached 14 of 20 connections (all that --max-pods 16 left), none refused for its pod; after its 384 blocks under 6 names, B loaded 0 of 4 blocks of each of A's 8 prompts, and the node counted 6 pods",
		Fix:    "a pod is its network namespace, which the kernel reports for each connection (SO_NETNS_COOKIE) and a sidecar cannot choose (--pod-identity netns, the default): its connections are bounded by --conns-per-pod (2) and all its writes charged to one share",
	})
}

// nsCommand returns the command that runs role ("node" or "pod") as the
// first process of new mount and PID namespaces (and, for a pod, a new
// network namespace); args are `ringside`'s
// (node) or the sidecar's serve flags (pod; none: a pod without one); env
// adds RS_NS_RO=DIR: DIR is bind-mounted read-only in the namespace, as a
// pod mounts the node's directory.
func nsCommand(role, name, logPath string, args []string, env ...string) *exec.Cmd {
	a, _ := json.Marshal(args)
	cmd := child("ns", append([]string{"RS_NS_ROLE=" + role, "RS_NS_NAME=" + name, "RS_NS_BIN=" + ringsideBin, "RS_NS_ARGS=" + string(a), "RS_NS_LOG=" + logPath}, env...)...)
	flags := uintptr(syscall.CLONE_NEWNS | syscall.CLONE_NEWPID)
	if role != "node" {
		flags |= syscall.CLONE_NEWNET
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: flags, Pdeathsig: syscall.SIGKILL}
	return cmd
}

var nsProbe struct {
	once sync.Once
	err  error
}

// needNamespaces fails the test (skips it with RINGSIDE_SKIP_NAMESPACE_TESTS=1)
// where this process cannot make mount and PID namespaces with a tmpfs
// on /dev/shm.
func needNamespaces(t *testing.T) {
	t.Helper()
	nsProbe.once.Do(func() {
		if os.Getuid() != 0 {
			nsProbe.err = fmt.Errorf("not root (uid %d)", os.Getuid())
			return
		}
		cmd := nsCommand("probe", "probe", os.DevNull, nil)
		out, err := cmd.CombinedOutput()
		if err != nil {
			nsProbe.err = fmt.Errorf("%v: %s", err, strings.TrimSpace(string(out)))
		}
	})
	if nsProbe.err == nil {
		return
	}
	msg := fmt.Sprintf("the node tier's namespace tests need root and mount, PID and network namespaces (unshare with CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWNET, a tmpfs on /dev/shm, the loopback up): %v; set %s=1 to skip them", nsProbe.err, nsSkipEnv)
	if os.Getenv(nsSkipEnv) == "1" {
		t.Skip(msg)
	}
	t.Fatal(msg)
}

// nodeUID is the uid `ringside node` runs as in the namespace tests, as
// deployed (deploy/README.md): not root. The pods' processes run as root;
// the node admits them with --allow-uid 0.
const nodeUID = 1000

// startNodeNS starts `ringside node` on dir (whose parent is nodeUID's)
// in namespaces of its own, as nodeUID, with its metrics on a free port of
// the loopback.
func startNodeNS(t *testing.T, dir string, extra ...string) (*nodeProc, *sidecar) {
	t.Helper()
	addr := freePort(t)
	n := &nodeProc{t: t, dir: dir, sock: filepath.Join(dir, "node.sock"), logPath: filepath.Join(t.TempDir(), "node.log"), ns: true,
		extra: append([]string{"--metrics.addr", addr, "--allow-uid", "0"}, extra...), env: []string{fmt.Sprintf("RS_NS_UID=%d", nodeUID)}}
	n.start()
	t.Cleanup(n.stop)
	return n, &sidecar{t: t, addr: addr}
}

// nodeMetric reads one of the node process's counters.
func nodeMetric(m *sidecar, name string) float64 { return m.metric("ringside_node_server_" + name) }

// podCmd is one step the parent asks a pod to carry out.
type podCmd struct {
	Op       string   `json:"op"`
	Instance string   `json:"instance,omitempty"`
	Model    string   `json:"model,omitempty"`
	Salt     string   `json:"salt,omitempty"`
	Seed     string   `json:"seed,omitempty"`
	N        int      `json:"n,omitempty"`
	Tag      uint64   `json:"tag,omitempty"`
	KillMS   int      `json:"kill_ms,omitempty"` // storeloop: SIGKILL the sidecar after this long
	Paths    []string `json:"paths,omitempty"`   // peek: paths to stat
	Sock     string   `json:"sock,omitempty"`    // thief, stall, hold, renames: the node's socket
	Names    int      `json:"names,omitempty"`   // hold: connections to try; renames: pod names to write under
	Blocks   int      `json:"blocks,omitempty"`  // renames: blocks written under each name
}

// podReply is a pod's answer.
type podReply struct {
	Err       string            `json:"err,omitempty"`
	Hits      int               `json:"hits,omitempty"`
	Got       int               `json:"got,omitempty"`
	Stored    int               `json:"stored,omitempty"`
	TookUS    int64             `json:"took_us,omitempty"`
	LoadUS    int64             `json:"load_us,omitempty"`
	Addr      string            `json:"addr,omitempty"`
	Dir       string            `json:"dir,omitempty"`
	Procs     []string          `json:"procs,omitempty"`
	Shm       []string          `json:"shm,omitempty"`
	ShmMount  string            `json:"shm_mount,omitempty"`
	Seen      map[string]string `json:"seen,omitempty"`
	Statuses  map[string]string `json:"statuses,omitempty"`
	FloodSent int               `json:"flood_sent,omitempty"`
	MuteMS    int64             `json:"mute_ms,omitempty"`
	FloodMS   int64             `json:"flood_ms,omitempty"`
}

// nsPod is an engine pod in namespaces of its own, driven by the parent.
type nsPod struct {
	t       *testing.T
	name    string
	cmd     *exec.Cmd
	in      io.WriteCloser
	out     *lineReader
	exited  chan struct{}
	logPath string
	sc      *sidecar // its sidecar's metrics address, through the pod (nodeState, waitNode)
	dir     string   // its sidecar's --dir, inside the pod's /dev/shm
}

// startPod starts pod name in namespaces of its own, with the directory
// of the node's socket nodeSock mounted read-only, as the sidecars mount it
// (deploy/README.md); withSidecar, its sidecar attaches to the node tier
// under the pod's name (extra flags after the defaults).
func startPod(t *testing.T, name, nodeSock string, withSidecar bool, extra ...string) *nsPod {
	t.Helper()
	p := &nsPod{t: t, name: name, logPath: filepath.Join(t.TempDir(), name+".log"), exited: make(chan struct{})}
	var args []string
	if withSidecar {
		addr := freePort(t)
		args = append(append([]string{}, defaultArgs...), "--metrics.addr", addr, "--node.socket", nodeSock, "--node.pod", name,
			"--node.lookup-timeout", "500ms", "--node.io-timeout", "2s")
		args = append(args, extra...)
		// The sidecar's metrics address is in the pod's network
		// namespace; the pod forwards a Unix socket here to it.
		p.sc = &sidecar{t: t, addr: addr, via: filepath.Join(t.TempDir(), "metrics.sock")}
	}
	env := []string{"RS_NS_RO=" + filepath.Dir(nodeSock)}
	if p.sc != nil {
		env = append(env, "RS_NS_VIA="+p.sc.via)
	}
	p.cmd = nsCommand("pod", name, p.logPath, args, env...)
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	p.cmd.Stderr = logf
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout = w
	if p.in, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		r.Close()
		w.Close()
		t.Fatalf("starting pod %s in new mount and PID namespaces: %v", name, err)
	}
	w.Close()
	p.out = &lineReader{f: r, r: bufio.NewReader(r)}
	go func() { p.cmd.Wait(); r.Close(); close(p.exited) }()
	t.Cleanup(p.close)
	rep := p.recv(30 * time.Second)
	if rep.Err != "" {
		t.Fatalf("pod %s did not start: %s; log: %s", name, rep.Err, p.logTail())
	}
	p.dir = rep.Dir
	return p
}

func (p *nsPod) logTail() string {
	b, _ := os.ReadFile(p.logPath)
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}

func (p *nsPod) send(c podCmd) {
	p.t.Helper()
	b, _ := json.Marshal(c)
	if _, err := p.in.Write(append(b, '\n')); err != nil {
		p.t.Fatalf("pod %s: %v; log: %s", p.name, err, p.logTail())
	}
}

func (p *nsPod) recv(within time.Duration) podReply {
	p.t.Helper()
	var rep podReply
	if err := p.out.next(within, &rep); err != nil {
		p.t.Fatalf("pod %s: no answer within %v: %v; log: %s", p.name, within, err, p.logTail())
	}
	return rep
}

// do sends one step and returns its answer, which must come within.
func (p *nsPod) do(c podCmd, within time.Duration) podReply {
	p.t.Helper()
	p.send(c)
	return p.recv(within)
}

// store and load are an engine's steps in the pod; any error fails the
// test (the tier never fails an engine's request, nor loads wrong bytes).
func (p *nsPod) store(instance, seed string, n int, tag uint64) {
	p.t.Helper()
	if rep := p.do(podCmd{Op: "store", Instance: instance, Seed: seed, N: n, Tag: tag}, 15*time.Second); rep.Err != "" {
		p.t.Fatalf("pod %s: store %q: %s", p.name, seed, rep.Err)
	}
}

func (p *nsPod) load(c podCmd) (int, time.Duration) {
	p.t.Helper()
	c.Op = "load"
	rep := p.do(c, 15*time.Second)
	if rep.Err != "" {
		p.t.Fatalf("pod %s: load %q: %s", p.name, c.Seed, rep.Err)
	}
	return rep.Got, time.Duration(rep.TookUS) * time.Microsecond
}

// close stops the pod (its sidecar with SIGTERM), at most 15 s, and then
// kills its namespace's init, which takes the rest with it; a sidecar that
// logged a panic fails the test.
func (p *nsPod) close() {
	select {
	case <-p.exited:
	default:
		p.in.Close()
		select {
		case <-p.exited:
		case <-time.After(15 * time.Second):
			p.t.Errorf("pod %s did not stop within 15 s", p.name)
			p.cmd.Process.Signal(syscall.SIGKILL)
			<-p.exited
		}
	}
	b, _ := os.ReadFile(p.logPath)
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "panic:") || strings.HasPrefix(line, "fatal error:") {
			p.t.Errorf("pod %s: %s; log: %s", p.name, line, p.logTail())
			break
		}
	}
}

// checkHostMounts fails the test if a mount made in a namespace shows in
// this process's mount table: a tmpfs of a pod, or a mount on the node's
// directory dir.
func checkHostMounts(t *testing.T, dir string) {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); strings.Contains(line, nsMountTag) || len(f) > 4 && strings.HasPrefix(f[4], dir) {
			t.Fatalf("a namespace's mount reached the host: %s", line)
		}
	}
}

// nsTier starts the node process and pods A and B, each in namespaces of
// its own, both sidecars attached.
func nsTier(t *testing.T, nodeFlags ...string) (np *nodeProc, nm *sidecar, a, b *nsPod) {
	t.Helper()
	needNamespaces(t)
	ndir, err := os.MkdirTemp("", "rs-rel-nsnode-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(ndir) })
	t.Cleanup(func() { checkHostMounts(t, ndir) })
	if err := os.Chown(ndir, nodeUID, nodeUID); err != nil {
		t.Fatal(err)
	}
	np, nm = startNodeNS(t, filepath.Join(ndir, "n"), nodeFlags...)
	a = startPod(t, "pod-a", np.sock, true)
	b = startPod(t, "pod-b", np.sock, true)
	for _, p := range []*nsPod{a, b} {
		p.sc.waitNode("attached", func(s nodeState) bool { return s.Connected })
	}
	return np, nm, a, b
}

// TestNodeTierNamespaces: a block pod A's engine stores is loaded
// byte-exact by pod B's, through the node process, with no memory shared
// but what the node hands each sidecar over the socket.
func TestNodeTierNamespaces(t *testing.T) {
	row := record(t, "Isolation", "the node tier with `ringside node` and two pods (each a `ringside serve` and an engine client beside it) in separate mount and PID namespaces, each pod with a fresh tmpfs on its /dev/shm; they share only the host directory of the node's socket, which the pods mount read-only, as deployed",
		"what A's engine stores, B's engine loads byte-exact, fetched from the node tier; from inside B, /proc shows only B's processes and /dev/shm only B's files (A's sidecar directory is absent), and no namespace's mount shows in the host's mount table; a second node process on the same directory in namespaces of its own exits, refused by the first one's lock, and the first serves on", "")
	np, _, a, b := nsTier(t)
	const n = 16
	a.store("engine-a", "system prompt", n, 7)
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == n })
	if got, _ := b.load(podCmd{Instance: "engine-b", Seed: "system prompt", N: n, Tag: 7}); got != n {
		t.Fatalf("pod B loaded %d of %d blocks A stored", got, n)
	}
	if f := b.sc.nodeState().Counts["fetched_blocks"]; f != n {
		t.Fatalf("pod B fetched %d blocks from the node tier, want %d", f, n)
	}
	row.add("B loaded %d/%d blocks A stored, byte-exact, all fetched from the node tier", n, n)

	// What B can see of the others from inside its namespaces.
	pk := b.do(podCmd{Op: "peek", Paths: []string{a.dir, filepath.Join(a.dir, "ringside.sock"), np.sock}}, 10*time.Second)
	if pk.Err != "" {
		t.Fatal(pk.Err)
	}
	if len(pk.Procs) != 2 {
		t.Fatalf("pod B sees processes %v: want its init and its sidecar", pk.Procs)
	}
	for _, pr := range pk.Procs {
		if !strings.HasPrefix(pr, "1:") && !strings.HasSuffix(pr, ":ringside") {
			t.Fatalf("pod B sees process %s", pr)
		}
	}
	for _, f := range pk.Shm {
		if f != filepath.Base(b.dir) {
			t.Fatalf("pod B's /dev/shm holds %q (want only its sidecar's directory %s)", f, b.dir)
		}
	}
	if !strings.Contains(pk.ShmMount, nsMountTag+"pod-b") {
		t.Fatalf("pod B's /dev/shm is not its own tmpfs: %q", pk.ShmMount)
	}
	for _, p := range []string{a.dir, filepath.Join(a.dir, "ringside.sock")} {
		if !strings.Contains(pk.Seen[p], "no such file") {
			t.Fatalf("pod B stats A's %s: %s", p, pk.Seen[p])
		}
	}
	if pk.Seen[np.sock] != "ok" {
		t.Fatalf("pod B cannot see the node's socket %s: %s", np.sock, pk.Seen[np.sock])
	}
	if _, err := os.Stat(a.dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the host sees pod A's %s: %v", a.dir, err)
	}
	checkHostMounts(t, filepath.Dir(np.dir))

	// A second node process on the directory, in namespaces of its own
	// (a DaemonSet's old and new pod overlapping in a rollout), is refused
	// by the first one's lock, and leaves its socket alone.
	logp := filepath.Join(t.TempDir(), "node2.log")
	logf, err := os.Create(logp)
	if err != nil {
		t.Fatal(err)
	}
	second := nsCommand("node", "node-2", logp, []string{"node", "--dir", np.dir, "--pool.bytes", "2MiB", "--pool.slot-bytes", "4KiB", "--pool.reserve=false", "--metrics.addr", ""})
	second.Stdout, second.Stderr = logf, logf
	if err := second.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	done := make(chan error, 1)
	go func() { done <- second.Wait() }()
	select {
	case err = <-done:
	case <-time.After(15 * time.Second):
		second.Process.Kill()
		<-done
		t.Fatal("a second node process on the directory did not exit within 15 s")
	}
	msg, _ := os.ReadFile(logp)
	if err == nil || !strings.Contains(string(msg), "another node process holds it") {
		t.Fatalf("a second node process on the directory: %v: %s", err, msg)
	}
	a.store("engine-a", "after the second node", n, 8)
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == 2*n })
	if got, _ := b.load(podCmd{Instance: "engine-b2", Seed: "after the second node", N: n, Tag: 8}); got != n {
		t.Fatalf("after a second node process was refused, B loaded %d of %d", got, n)
	}
	row.add("a second node process on the directory, in namespaces of its own: refused (%v), and the first served on (B loaded A's next %d blocks)", err, n)
	row.add("inside B: processes %v, /dev/shm %v (%s); A's %s: %s", pk.Procs, pk.Shm, strings.Fields(pk.ShmMount)[0], a.dir, pk.Seen[a.dir])
}

// TestNodeTierNamespacesSidecarKilledMidWrite SIGKILLs pod A's sidecar
// while its engine stores prompt after prompt (its writes to the node tier
// in flight): every block pod B then finds in the node tier loads whole
// and byte-exact; none is partial.
func TestNodeTierNamespacesSidecarKilledMidWrite(t *testing.T) {
	row := record(t, "Faults", "pod A's sidecar SIGKILLed while its engine stores prompt after prompt and its writes to the node tier are in flight; node and pods in separate mount and PID namespaces; 3 rounds at 30, 80 and 150 ms",
		"no partial block is visible in the node tier: every block pod B loads is whole and byte-exact, B's sidecar rejects no value fetched from the node (header and CRC32C) and the node rejects none offered; A's restarted sidecar re-attaches and its engine loads its own blocks back from the node tier", "")
	// A pool that holds every block A's engine stores (1,024 slots).
	np, nm, a, b := nsTier(t, "--pool.bytes", "8MiB", "--pod-share", "0.9")
	const n = 4
	var stored, offered, loaded, partial int
	var whole string // the last prompt B loaded whole
	for round, ms := range []int{30, 80, 150} {
		seed := fmt.Sprintf("round %d", round)
		rep := a.do(podCmd{Op: "storeloop", Instance: "engine-a", Seed: seed, N: n, Tag: 5, KillMS: ms}, 20*time.Second)
		if rep.Err != "" {
			t.Fatalf("round %d: %s", round, rep.Err)
		}
		stored += rep.Stored
		// Every prompt A's engine stored, and the one in flight at the kill.
		for i := 0; i <= rep.Stored; i++ {
			got, _ := b.load(podCmd{Instance: "engine-b", Seed: fmt.Sprintf("%s-%d", seed, i), N: n, Tag: 5})
			loaded += got
			if got == n {
				whole = fmt.Sprintf("%s-%d", seed, i)
			}
			if got > 0 && got < n {
				partial++
			}
		}
		if rep := a.do(podCmd{Op: "restart"}, 30*time.Second); rep.Err != "" {
			t.Fatalf("restarting A's sidecar: %s", rep.Err)
		}
		a.sc.waitNode("re-attached", func(s nodeState) bool { return s.Connected })
	}
	row.add("A's engine stored %d prompts of %d blocks over 3 kills; B loaded %d blocks, each byte-exact (%d prompts with a leading part only: blocks written after the kill point were never offered)", stored, n, loaded, partial)

	// With the node stopped, A's writes are sent and wait for their
	// replies (window slots held) when A's sidecar is killed; the node
	// then continues and finds them on the dead sidecar's connection.
	// A write registers its namespace on the connection first: done
	// before the stop, so that the writes during it are Puts.
	a.store("engine-a", "registered", n, 5)
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == n })
	put0, stored0 := nodeMetric(nm, "put_values_total"), nodeMetric(nm, "put_stored_values_total")
	np.cmd.Process.Signal(syscall.SIGSTOP)
	stopped := true
	defer func() {
		if stopped {
			np.cmd.Process.Signal(syscall.SIGCONT)
		}
	}()
	waitStopped(t, np.cmd.Process.Pid)
	const held = 3
	for i := 0; i < held; i++ {
		a.store("engine-a", fmt.Sprintf("node stopped-%d", i), n, 5)
	}
	if rep := a.do(podCmd{Op: "kill"}, 15*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	np.cmd.Process.Signal(syscall.SIGCONT)
	stopped = false
	heldLoaded, heldWhole := 0, 0
	for i := 0; i < held; i++ {
		got, _ := b.load(podCmd{Instance: "engine-b", Seed: fmt.Sprintf("node stopped-%d", i), N: n, Tag: 5})
		heldLoaded += got
		if got == n {
			heldWhole++
		}
	}
	row.add("node stopped while A's engine stored %d prompts (writes sent, unanswered), A's sidecar killed, the node continued and found %v values offered on the dead sidecar's connection (%v stored): B loaded %d blocks, each byte-exact (%d prompts whole)", held, nodeMetric(nm, "put_values_total")-put0, nodeMetric(nm, "put_stored_values_total")-stored0, heldLoaded, heldWhole)
	if rep := a.do(podCmd{Op: "restart"}, 30*time.Second); rep.Err != "" {
		t.Fatalf("restarting A's sidecar: %s", rep.Err)
	}
	a.sc.waitNode("re-attached", func(s nodeState) bool { return s.Connected })

	offered = int(nodeMetric(nm, "put_values_total"))
	if r := b.sc.nodeState().Counts["fetch_rejected_values"]; r != 0 {
		t.Fatalf("B's sidecar rejected %d values fetched from the node tier", r)
	}
	if r := nodeMetric(nm, "rejected_values_total"); r != 0 {
		t.Fatalf("the node rejected %v values", r)
	}
	if whole == "" {
		t.Fatal("B loaded no prompt A stored before the kills whole")
	}
	row.add("%d values offered to the node in all; rejected: 0 by B, 0 by the node", offered)

	// A's new sidecar (an empty pool) loads from the node tier what its
	// engine stored before a kill.
	got, _ := a.load(podCmd{Instance: "engine-a2", Seed: whole, N: n, Tag: 5})
	if got != n {
		t.Fatalf("after its restart, A loaded %d of %d blocks of its prompt %q", got, n, whole)
	}
	row.add("A's restarted sidecar loaded %d/%d of its prompt %q from the node tier", got, n, whole)
}

// TestNodeTierNamespacesNodeKilledMidFetch SIGKILLs the node process while
// pod B's fetch from it is in flight: the engine's load misses (recompute)
// within the tier's deadline, never hangs and never returns wrong bytes,
// and the sidecar goes on serving and re-attaches to a new node process.
func TestNodeTierNamespacesNodeKilledMidFetch(t *testing.T) {
	row := record(t, "Faults", "the node process SIGKILLed while pod B's fetch from it is in flight (the node stopped with SIGSTOP after B's lookup found the blocks, B's acquire sent, then the kill); node and pods in separate mount and PID namespaces; a new node process started after",
		"B's engine gets a clean miss (0 blocks, no error) within the tier's I/O deadline (2 s) plus 1 s, no wrong byte; B's sidecar goes on serving its own pool (store and byte-exact load) with lookups answered within 1 s; both sidecars re-attach to the new node process, through which B loads A's next prompt byte-exact", "")
	np, _, a, b := nsTier(t)
	const n = 8
	a.store("engine-a", "before the kill", n, 3)
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == n })

	b.send(podCmd{Op: "loadpaused", Instance: "engine-b", Seed: "before the kill", N: n, Tag: 3})
	if rep := b.recv(10 * time.Second); rep.Err != "" || rep.Hits != n {
		t.Fatalf("B's lookup before the kill: %+v", rep)
	}
	np.cmd.Process.Signal(syscall.SIGSTOP)
	waitStopped(t, np.cmd.Process.Pid)
	t0 := time.Now()
	b.send(podCmd{Op: "go"})
	time.Sleep(300 * time.Millisecond) // the fetch sent and waiting on the stopped node
	np.kill9()
	rep := b.recv(10 * time.Second)
	took := time.Since(t0)
	if rep.Err != "" {
		t.Fatalf("B's load with the node killed mid-fetch: %s", rep.Err)
	}
	if rep.Got != 0 {
		t.Fatalf("B loaded %d blocks from a node process killed before it answered", rep.Got)
	}
	// No bound on took here: a hang is b.recv's deadline, and the time is
	// a recorded figure, not a verdict (it moves with the machine's load).
	st := b.sc.nodeState()
	if st.Counts["fetched_blocks"] != 0 {
		t.Fatalf("B fetched %d blocks", st.Counts["fetched_blocks"])
	}
	row.add("B's acquire answered %v after it was sent (the kill at 300 ms): 0 blocks, no error; B's client counted %d fetch misses", took.Round(time.Millisecond), st.Counts["fetch_missed_blocks"])

	b.sc.waitNode("detached", func(s nodeState) bool { return !s.Connected })
	b.store("engine-b2", "own prompt", n, 4)
	var worst time.Duration
	for i := 0; i < 3; i++ {
		got, took := b.load(podCmd{Instance: "engine-b3", Seed: "own prompt", N: n, Tag: 4})
		if got != n {
			t.Fatalf("B loaded %d of %d blocks of its own pool with the node dead", got, n)
		}
		_, took2 := b.load(podCmd{Instance: "engine-b3", Seed: "before the kill", N: n, Tag: 3})
		worst = max(worst, took, took2)
	}
	row.add("with the node dead, B stored and loaded its own prompt byte-exact 3 times, slowest lookup %v", worst.Round(time.Microsecond))

	np.start()
	for _, p := range []*nsPod{a, b} {
		p.sc.waitNode("re-attached", func(s nodeState) bool { return s.Connected && s.Counts["attaches"] >= 2 })
	}
	a.store("engine-a2", "after the kill", n, 6)
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] >= 2*n })
	if got, _ := b.load(podCmd{Instance: "engine-b4", Seed: "after the kill", N: n, Tag: 6}); got != n {
		t.Fatalf("B loaded %d of %d through the new node process", got, n)
	}
	row.add("a new node process (new namespaces): both re-attached, B loaded %d/%d of A's next prompt through it", n, n)

	// The node killed at a moment of B's stream of fetches.
	const prompts = 12
	for i := 0; i < prompts; i++ {
		a.store("engine-a3", fmt.Sprintf("stream-%d", i), n, 8)
	}
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] >= (2+prompts)*n })
	b.send(podCmd{Op: "loadloop", Instance: "engine-b5", Seed: "stream", N: n, Tag: prompts<<32 | 8})
	time.Sleep(20 * time.Millisecond)
	np.kill9()
	rep = b.recv(30 * time.Second)
	if rep.Err != "" {
		t.Fatalf("B's loads with the node killed among them: %s", rep.Err)
	}
	row.add("the node killed 20 ms into B's loads of %d prompts: %d loaded whole, %d blocks in all, each byte-exact, no error, slowest lookup %v", prompts, rep.Stored, rep.Got, (time.Duration(rep.TookUS) * time.Microsecond).Round(time.Microsecond))
}

// TestNodeTierNamespacesAttacks: attacks on the node tier from pods in
// namespaces of their own. A pod whose engines registered another
// namespace (another model, another tenant salt) cannot read or overwrite
// pod A's blocks; a hostile client on the node socket cannot name A's
// namespace without registering it, and cannot stall the node for B.
func TestNodeTierNamespacesAttacks(t *testing.T) {
	row := record(t, "Isolation", "from pods in mount and PID namespaces of their own: pod C's sidecar, whose engines use another tenant salt or another model, asks for and stores pod A's digests with its own bytes; a hostile client (no sidecar) on the node socket, its pod mounting the socket's directory read-only as sidecars do, asks for A's namespace unregistered, tries to put a socket of its own in the node's place, holds a silent connection and floods lookups it never reads while pod B loads A's prompts, then, the node process killed, tries to hold the node's lock file so that none can start again",
		"C finds 0 of A's blocks and its stores do not replace them (B then loads A's bytes exactly); the hostile client's Lookup, Get and Put of A's namespace are refused (status 4), its own namespace finds 0 of A's digests, and it sees no process of another pod; removing, renaming or binding a socket in the directory fails (read-only); during the flood B loads every one of A's prompts whole and byte-exact, each lookup within 1 s, and the node drops the silent and the flooding connection within its I/O timeout (1 s) plus 1.5 s; a new node process starts and B re-attaches", "")
	np, nm, a, b := nsTier(t, "--pod-share", "0.5")
	const n, prompts = 4, 8
	for i := 0; i < prompts; i++ {
		a.store("engine-a", fmt.Sprintf("a's prompt %d", i), n, 0xA)
	}
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == n*prompts })

	// Pod C: another tenant and another model, with A's very digests.
	c := startPod(t, "pod-c", np.sock, true)
	c.sc.waitNode("attached", func(s nodeState) bool { return s.Connected })
	for _, who := range []podCmd{{Instance: "tenant-c", Salt: "tenant-c"}, {Instance: "model-c", Model: "other-model"}} {
		for i := 0; i < 2; i++ {
			ld := who
			ld.Seed, ld.N, ld.Tag = fmt.Sprintf("a's prompt %d", i), n, 0xA
			if got, _ := c.load(ld); got != 0 {
				t.Fatalf("%s in pod C loaded %d of A's blocks", who.Instance, got)
			}
			st := ld
			st.Op, st.Tag = "store", 0xC
			if rep := c.do(st, 15*time.Second); rep.Err != "" {
				t.Fatalf("%s in pod C: store: %s", who.Instance, rep.Err)
			}
		}
	}
	c.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == 4*n })
	for i := 0; i < 2; i++ {
		if got, _ := b.load(podCmd{Instance: "engine-b", Seed: fmt.Sprintf("a's prompt %d", i), N: n, Tag: 0xA}); got != n {
			t.Fatalf("B loaded %d of %d of A's prompt %d after C stored its digests", got, n, i)
		}
	}
	row.add("pod C (another salt, another model): 0 of A's blocks found, %d blocks of its own stored under A's digests; B then loaded A's 2 prompts byte-exact", 4*n)

	// The hostile client, in a pod of its own without a sidecar.
	h := startPod(t, "pod-hostile", np.sock, false)
	th := h.do(podCmd{Op: "thief", Sock: np.sock, Seed: "a's prompt 0", N: n}, 20*time.Second)
	if th.Err != "" {
		t.Fatal(th.Err)
	}
	for _, op := range []string{"lookup", "fetch", "put"} {
		if th.Statuses[op] != wire.NotRegistered.String() {
			t.Fatalf("the hostile client's %s of A's namespace: %s", op, th.Statuses[op])
		}
	}
	if th.Statuses["own_lookup"] != "ok 0" {
		t.Fatalf("the hostile client's lookup of A's digests in its own namespace: %s", th.Statuses["own_lookup"])
	}
	if want := fmt.Sprintf("ok %d", n); th.Statuses["registered_lookup"] != want {
		t.Fatalf("the control: registered, A's namespace looks up as %s, want %s (A's fingerprint?)", th.Statuses["registered_lookup"], want)
	}
	if len(th.Procs) != 1 {
		t.Fatalf("the hostile pod sees processes %v", th.Procs)
	}
	row.add("hostile client: A's namespace unregistered: lookup %s, fetch %s, put %s; its own namespace: lookup %s; processes it sees: %v", th.Statuses["lookup"], th.Statuses["fetch"], th.Statuses["put"], th.Statuses["own_lookup"], th.Procs)

	// Its pod mounts the node's directory read-only, as sidecars do: it
	// cannot put a socket of its own in the node's place.
	sq := h.do(podCmd{Op: "squat", Sock: np.sock}, 10*time.Second)
	for op, res := range sq.Statuses {
		if !strings.Contains(res, "read-only file system") {
			t.Fatalf("the hostile client's %s in the node's directory: %s", op, res)
		}
	}
	if _, err := os.Stat(np.sock); err != nil {
		t.Fatalf("the node's socket: %v", err)
	}
	row.add("its remove, rename and bind of a socket, and create, in the node's directory (mounted read-only): %s", sq.Statuses["remove"])

	dropped0, refused0 := nodeMetric(nm, "dropped_connections_total"), nodeMetric(nm, "attaches_refused_total")
	if rep := h.do(podCmd{Op: "stall", Sock: np.sock}, 10*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	unanswered0 := b.sc.nodeState().Counts["lookups_unanswered"]
	var worst time.Duration
	for i := 2; i < prompts; i++ {
		got, took := b.load(podCmd{Instance: "engine-b2", Seed: fmt.Sprintf("a's prompt %d", i), N: n, Tag: 0xA})
		if got != n {
			t.Fatalf("during the flood, B loaded %d of %d of A's prompt %d", got, n, i)
		}
		worst = max(worst, took)
	}
	// Not stalled, by shape rather than by time: every lookup of B was
	// answered by the node (none ran out its --node.lookup-timeout), and
	// every load above was whole.
	if u := b.sc.nodeState().Counts["lookups_unanswered"] - unanswered0; u != 0 {
		t.Fatalf("during the flood, %v of B's lookups went unanswered by the node", u)
	}
	end := h.do(podCmd{Op: "stallend"}, 15*time.Second)
	if end.Err != "" {
		t.Fatal(end.Err)
	}
	if end.MuteMS > 2500 || end.FloodMS > 2500 {
		t.Fatalf("the node held the silent connection %d ms and the flooder %d ms", end.MuteMS, end.FloodMS)
	}
	waitFor := func(what string, cond func() bool) {
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("node: %s", what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitFor("the flooder not counted dropped", func() bool { return nodeMetric(nm, "dropped_connections_total") >= dropped0+1 })
	waitFor("the silent connection not counted refused", func() bool { return nodeMetric(nm, "attaches_refused_total") >= refused0+1 })
	row.add("flood of %d lookups never read and a silent connection: closed by the node after %d ms and %d ms; B loaded %d prompts of A whole meanwhile, slowest lookup %v",
		end.FloodSent, end.FloodMS, end.MuteMS, prompts-2, worst.Round(time.Microsecond))

	// The node process killed (its lock file stays): the hostile client,
	// as the node's uid, tries to take the node's lock through its
	// read-only mount, so that no node process can start again.
	np.kill9()
	hl := h.do(podCmd{Op: "holdlock", Sock: filepath.Join(np.dir, "node.lock")}, 10*time.Second)
	if hl.Err != "" {
		t.Fatal(hl.Err)
	}
	np.start()
	b.sc.waitNode("re-attached", func(s nodeState) bool { return s.Connected && s.Counts["attaches"] >= 2 })
	row.add("the node process killed, the hostile client (the node's uid) opened its lock file: %s, flock: %s; a new node process started and B re-attached", hl.Statuses["open"], hl.Statuses["flock"])
}

// TestNodeTierNamespacesPodIdentity: a pod is its network namespace, not
// the name its sidecar declares. A hostile client, in a pod of its own,
// tries to hold every connection the node allows and then writes the
// pool full under name after name; pod A's blocks, stored first, stay,
// and pod B's sidecar restarts and attaches meanwhile.
func TestNodeTierNamespacesPodIdentity(t *testing.T) {
	row := record(t, "Isolation", "from pods in network, mount and PID namespaces of their own: a hostile client (no sidecar) opens 20 connections to the node, each declaring another pod name, and holds them while pod B's sidecar restarts; then 200 connections that never say Hello, held while B's sidecar restarts again; then, under 6 new names one after the other, it writes 384 well-formed blocks (1.5 times the pool) of a namespace of its own, after pod A stored 32",
		"the node attaches 2 of the 20 (--conns-per-pod) and refuses 18 (status 7); B's restarted sidecar attaches while they are held; the node closes 198 of the 200 silent connections as they arrive and B attaches again meanwhile; every hostile block is charged to the hostile pod's one share (a quarter of the pool), so B then loads each of A's 8 prompts whole and byte-exact, and the node counts 3 pods", "")
	np, nm, a, b := nsTier(t, "--pod-share", "0.25")
	const n, prompts = 4, 8
	for i := 0; i < prompts; i++ {
		a.store("engine-a", fmt.Sprintf("a's prompt %d", i), n, 0xA)
	}
	a.sc.waitNode("written", func(s nodeState) bool { return s.Counts["writes_stored"] == n*prompts })

	h := startPod(t, "pod-hostile", np.sock, false)
	hold := h.do(podCmd{Op: "hold", Sock: np.sock, Names: 20}, 20*time.Second)
	if hold.Got != 2 {
		t.Fatalf("the hostile pod attached %d of 20 connections (want 2, --conns-per-pod); refusals %v", hold.Got, hold.Statuses)
	}
	if got := nodeMetric(nm, "attaches_refused_pod_limit_total"); got != 18 {
		t.Fatalf("attaches refused for the hostile pod's limit: %v, want 18", got)
	}
	attaches := b.sc.nodeState().Counts["attaches"]
	if rep := b.do(podCmd{Op: "kill"}, 15*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	if rep := b.do(podCmd{Op: "restart"}, 30*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	b.sc.waitNode("re-attached with the hostile connections held", func(s nodeState) bool { return s.Connected && s.Counts["attaches"] >= 1 })
	row.add("20 connections under 20 names: %d attached, refused: %v; B's sidecar restarted and attached (attaches before: %d)", hold.Got, hold.Statuses, attaches)
	h.do(podCmd{Op: "unhold"}, 10*time.Second)

	// 200 connections that never say Hello: each would hold a goroutine
	// and a buffer until --io-timeout.
	refused0 := nodeMetric(nm, "connections_refused_pending_total")
	if rep := h.do(podCmd{Op: "mutes", Sock: np.sock, Names: 200}, 20*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for nodeMetric(nm, "connections_refused_pending_total")-refused0 < 198 {
		if time.Now().After(deadline) {
			t.Fatalf("the node closed %v of 200 silent connections at once, want 198", nodeMetric(nm, "connections_refused_pending_total")-refused0)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if rep := h.do(podCmd{Op: "mutecount"}, 10*time.Second); rep.Got != 2 {
		t.Fatalf("%d silent connections of the hostile pod open, want 2", rep.Got)
	}
	attached := b.sc.nodeState().Counts["attaches"]
	if rep := b.do(podCmd{Op: "kill"}, 15*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	if rep := b.do(podCmd{Op: "restart"}, 30*time.Second); rep.Err != "" {
		t.Fatal(rep.Err)
	}
	b.sc.waitNode("re-attached with the silent connections held", func(s nodeState) bool { return s.Connected && s.Counts["attaches"] >= 1 })
	h.do(podCmd{Op: "unmute"}, 10*time.Second)
	row.add("200 silent connections: %v closed as they arrived, 2 held; B's sidecar restarted and attached meanwhile (attaches before: %d)", nodeMetric(nm, "connections_refused_pending_total")-refused0, attached)

	ren := h.do(podCmd{Op: "renames", Sock: np.sock, Names: 6, Blocks: 64}, 60*time.Second)
	if ren.Err != "" || ren.Stored != 6*64 {
		t.Fatalf("the hostile pod's writes under new names: %d of %d taken: %s", ren.Stored, 6*64, ren.Err)
	}
	for i := 0; i < prompts; i++ {
		if got, _ := b.load(podCmd{Instance: "engine-b", Seed: fmt.Sprintf("a's prompt %d", i), N: n, Tag: 0xA}); got != n {
			t.Fatalf("after the hostile pod's writes under 6 names, B loaded %d of %d blocks of A's prompt %d", got, n, i)
		}
	}
	if pods := nodeMetric(nm, "pods"); pods != 3 {
		t.Fatalf("the node counts %v pods, want 3 (A, B, the hostile one)", pods)
	}
	row.add("%d hostile blocks taken under 6 names, all charged to its one share; B then loaded A's %d prompts whole; the node counts %v pods, %v attaches under another name than the pod's first",
		ren.Stored, prompts, nodeMetric(nm, "pods"), nodeMetric(nm, "attaches_renamed_total"))
}

// --- the namespaces' first process ---

// nsSetup makes this process's mounts private (nothing it mounts reaches
// the host's mount table), bind-mounts RS_NS_RO read-only, and mounts a
// tmpfs of its own on /dev/shm and the /proc of its PID namespace; in a
// network namespace of its own, it brings the loopback up (the sidecar's
// metrics listen there).
func nsSetup(name string, ownNet bool) error {
	if os.Getpid() != 1 {
		return fmt.Errorf("pid %d: not the first process of a new PID namespace", os.Getpid())
	}
	if ownNet {
		if err := loopbackUp(); err != nil {
			return fmt.Errorf("bringing the loopback up: %w", err)
		}
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making / private: %w", err)
	}
	if ro := os.Getenv("RS_NS_RO"); ro != "" {
		if err := unix.Mount(ro, ro, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind-mounting %s: %w", ro, err)
		}
		if err := unix.Mount("", ro, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			return fmt.Errorf("making %s read-only: %w", ro, err)
		}
	}
	if err := unix.Mount(nsMountTag+name, "/dev/shm", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=64m,mode=1777"); err != nil {
		return fmt.Errorf("mounting a tmpfs on /dev/shm: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mounting /proc: %w", err)
	}
	return nil
}

func nsChild() int {
	name, role := os.Getenv("RS_NS_NAME"), os.Getenv("RS_NS_ROLE")
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "ns %s: %v\n", name, err)
		json.NewEncoder(os.Stdout).Encode(podReply{Err: err.Error()})
		return 3
	}
	if err := nsSetup(name, role != "node"); err != nil {
		return fail(err)
	}
	var args []string
	json.Unmarshal([]byte(os.Getenv("RS_NS_ARGS")), &args)
	switch role {
	case "probe":
		return 0
	case "node":
		if uid := os.Getenv("RS_NS_UID"); uid != "" {
			if err := dropTo(uid); err != nil {
				return fail(err)
			}
		}
		bin := os.Getenv("RS_NS_BIN")
		return fail(syscall.Exec(bin, append([]string{"ringside"}, args...), os.Environ()))
	case "pod":
		return podMain(name, args)
	}
	return fail(fmt.Errorf("unknown role %q", role))
}

// loopbackUp sets IFF_UP on lo, as a pod's runtime does.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// forward serves a Unix socket at via that forwards each connection to the
// TCP address addr of this network namespace: the parent's way to the
// sidecar's metrics. It runs until the pod exits.
func forward(via, addr string) error {
	ln, err := net.Listen("unix", via)
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				d, err := net.DialTimeout("tcp", addr, 5*time.Second)
				if err != nil {
					return
				}
				defer d.Close()
				go func() { io.Copy(d, c); d.(*net.TCPConn).CloseWrite() }()
				io.Copy(c, d)
			}()
		}
	}()
	return nil
}

// dropTo makes this process uid (and gid) uid, without supplementary
// groups, and sets its parent-death signal again (a change of credentials
// clears it).
func dropTo(uid string) error {
	id, err := strconv.Atoi(uid)
	if err != nil {
		return err
	}
	if err := syscall.Setgroups(nil); err != nil {
		return err
	}
	if err := syscall.Setresgid(id, id, id); err != nil {
		return err
	}
	if err := syscall.Setresuid(id, id, id); err != nil {
		return err
	}
	return unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(syscall.SIGKILL), 0, 0, 0)
}

// podSidecar is the pod's `ringside serve`, a child of its init.
type podSidecar struct {
	cmd    *exec.Cmd
	exited chan struct{}
	addr   string
}

func startPodSidecar(dir string, args []string) (*podSidecar, error) {
	s := &podSidecar{exited: make(chan struct{})}
	for i, a := range args {
		if a == "--metrics.addr" && i+1 < len(args) {
			s.addr = args[i+1]
		}
	}
	logf, err := os.OpenFile(os.Getenv("RS_NS_LOG"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	s.cmd = exec.Command(os.Getenv("RS_NS_BIN"), append([]string{"serve", "--dir", dir}, args...)...)
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { s.cmd.Wait(); close(s.exited) }()
	deadline := time.Now().Add(20 * time.Second)
	hc := http.Client{Timeout: 2 * time.Second}
	for {
		if resp, err := hc.Get("http://" + s.addr + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s, nil
			}
		}
		select {
		case <-s.exited:
			return nil, fmt.Errorf("the sidecar exited at start")
		default:
		}
		if time.Now().After(deadline) {
			s.kill()
			return nil, fmt.Errorf("the sidecar was not ready within 20 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *podSidecar) kill() {
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.exited
}

// stop ends it with SIGTERM, SIGKILL after 10 s.
func (s *podSidecar) stop() {
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		fmt.Fprintln(os.Stderr, "pod: the sidecar did not stop within 10 s of SIGTERM")
		s.kill()
	}
}

// podMain is a pod's init and engine: it starts the pod's sidecar (when
// it has args) and carries out the parent's steps.
func podMain(name string, args []string) int {
	out := json.NewEncoder(os.Stdout)
	dir := "/dev/shm/rs-" + name
	var side *podSidecar
	if len(args) > 0 {
		if err := os.Mkdir(dir, 0o700); err != nil {
			out.Encode(podReply{Err: err.Error()})
			return 3
		}
		var err error
		if side, err = startPodSidecar(dir, args); err != nil {
			out.Encode(podReply{Err: err.Error()})
			return 3
		}
		if via := os.Getenv("RS_NS_VIA"); via != "" {
			if err := forward(via, side.addr); err != nil {
				out.Encode(podReply{Err: err.Error()})
				return 3
			}
		}
	}
	out.Encode(podReply{Dir: dir})
	in := bufio.NewScanner(os.Stdin)
	var st *stall
	var held []*rawNode
	var mutes []*net.UnixConn
	for in.Scan() {
		var c podCmd
		if err := json.Unmarshal(in.Bytes(), &c); err != nil {
			out.Encode(podReply{Err: err.Error()})
			continue
		}
		o := connector.Options{Socket: filepath.Join(dir, "ringside.sock"), Instance: c.Instance, Model: "llama-rel", Layout: "bf16/16/HND", Salt: c.Salt, Timeout: 3 * time.Second}
		if c.Model != "" {
			o.Model = c.Model
		}
		var rep podReply
		switch c.Op {
		case "store":
			rep.Err = errText(engineStore(o, c.Seed, c.N, c.Tag))
		case "load", "loadpaused":
			var pause func(int) error
			var t1 time.Time
			if c.Op == "loadpaused" {
				pause = func(hits int) error {
					out.Encode(podReply{Hits: hits})
					if !in.Scan() {
						return errors.New("no go")
					}
					t1 = time.Now()
					return nil
				}
			}
			got, took, err := engineLoad(o, c.Seed, c.N, c.Tag, pause)
			rep = podReply{Got: got, TookUS: took.Microseconds(), Err: errText(err)}
			if !t1.IsZero() {
				rep.LoadUS = time.Since(t1).Microseconds()
			}
		case "storeloop":
			// Prompts seed-0, seed-1, ... until the sidecar, SIGKILLed
			// after KillMS, stops answering; Stored counts those stored.
			timer := time.AfterFunc(time.Duration(c.KillMS)*time.Millisecond, func() { side.cmd.Process.Signal(syscall.SIGKILL) })
			deadline := time.Now().Add(15 * time.Second)
			for time.Now().Before(deadline) {
				if engineStore(o, fmt.Sprintf("%s-%d", c.Seed, rep.Stored), c.N, c.Tag) != nil {
					break
				}
				rep.Stored++
			}
			timer.Stop()
			select {
			case <-side.exited:
			case <-time.After(5 * time.Second):
				rep.Err = "the sidecar was not killed"
			}
		case "kill":
			side.kill()
		case "loadloop":
			// Prompts seed-0 .. seed-(Tag>>32 - 1), loaded one after the
			// other (the parent kills the node meanwhile): Got counts the
			// blocks loaded (each byte-exact), Stored the prompts loaded
			// whole, TookUS the slowest lookup; the first error ends it.
			prompts := int(c.Tag >> 32)
			for i := 0; i < prompts && rep.Err == ""; i++ {
				got, took, err := engineLoad(o, fmt.Sprintf("%s-%d", c.Seed, i), c.N, c.Tag&0xffffffff, nil)
				rep.Got += got
				if got == c.N {
					rep.Stored++
				}
				rep.TookUS = max(rep.TookUS, took.Microseconds())
				rep.Err = errText(err)
			}
		case "restart":
			var err error
			if side, err = startPodSidecar(dir, args); err != nil {
				rep.Err = err.Error()
			}
		case "peek":
			rep = peek(c.Paths)
		case "thief":
			rep = thief(c)
		case "holdlock":
			// As the node's uid, through the read-only mount: take the
			// node's lock, and hold it.
			rep.Statuses = map[string]string{}
			if err := dropTo(strconv.Itoa(nodeUID)); err != nil {
				rep.Err = err.Error()
				break
			}
			fd, err := unix.Open(c.Sock, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			rep.Statuses["open"] = errString(err)
			if err == nil {
				rep.Statuses["flock"] = errString(unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB))
			}
		case "squat":
			rep = squat(c.Sock)
		case "hold":
			// Names connections, each declaring a pod name of its own,
			// held open: Got counts those attached, Statuses the refusals.
			refused := map[string]int{}
			for i := 0; i < c.Names; i++ {
				r, err := rawNodeDial(c.Sock, fmt.Sprintf("pod-hold-%d", i))
				if err != nil {
					refused[err.Error()]++
					continue
				}
				held = append(held, r)
			}
			rep.Got, rep.Statuses = len(held), map[string]string{}
			for why, k := range refused {
				rep.Statuses[why] = fmt.Sprintf("%d times", k)
			}
		case "unhold":
			for _, r := range held {
				r.close()
			}
			held = nil
		case "mutes":
			// Names connections that never say Hello, held open; Got
			// counts those the node has not closed.
			for i := 0; i < c.Names; i++ {
				m, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: c.Sock, Net: "unixpacket"})
				if err != nil {
					rep.Err = err.Error()
					break
				}
				mutes = append(mutes, m)
			}
		case "mutecount":
			for _, m := range mutes {
				if !sys.PeerClosed(m) {
					rep.Got++
				}
			}
		case "unmute":
			for _, m := range mutes {
				m.Close()
			}
			mutes = nil
		case "renames":
			rep = renames(c)
		case "stall":
			st, rep.Err = startStall(c.Sock)
		case "stallend":
			if st == nil {
				rep.Err = "no stall"
			} else {
				rep = st.end()
			}
		default:
			rep.Err = "unknown op " + c.Op
		}
		out.Encode(rep)
	}
	if side != nil {
		select {
		case <-side.exited:
		default:
			side.stop()
		}
	}
	return 0
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// peek lists what this pod sees of the node: the processes of its /proc
// (pid:command), the entries of its /dev/shm and that mount's mountinfo
// line, and whether each of paths exists.
func peek(paths []string) podReply {
	var rep podReply
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return podReply{Err: err.Error()}
	}
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		comm, _ := os.ReadFile("/proc/" + e.Name() + "/comm")
		rep.Procs = append(rep.Procs, e.Name()+":"+strings.TrimSpace(string(comm)))
	}
	shm, _ := os.ReadDir("/dev/shm")
	for _, e := range shm {
		rep.Shm = append(rep.Shm, e.Name())
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == "/dev/shm" {
			// The last mount on a mount point is the visible one.
			if i := strings.Index(line, " - "); i >= 0 {
				rep.ShmMount = line[i+3:]
			}
		}
	}
	rep.Seen = map[string]string{}
	for _, p := range paths {
		_, err := os.Stat(p)
		rep.Seen[p] = errString(err)
	}
	return rep
}

// rawNode is a hand-driven client of the node's wire, as a hostile one.
type rawNode struct {
	c      *net.UnixConn
	win    int
	stride int          // of the window's slots
	pool   *shm.Mapping // its pool, passed with the Hello (a memfd of 64 KiB)
	id     uint64
}

func rawNodeDial(sock, pod string) (*rawNode, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	pool, err := shm.CreateMemfd("thief-pool", 64<<10, true)
	if err != nil {
		c.Close()
		return nil, err
	}
	r := &rawNode{c: c, win: -1, pool: pool}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := c.WriteMsgUnix(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: pod}.Append), syscall.UnixRights(pool.FD()), nil); err != nil {
		r.close()
		return nil, err
	}
	buf := make([]byte, wire.MaxMessage)
	n, fds, _, err := sys.ReadFDs(c, buf, 4)
	if err != nil {
		c.Close()
		return nil, err
	}
	for i, fd := range fds {
		if i == 0 {
			r.win = fd
		} else {
			unix.Close(fd)
		}
	}
	_, body, err := wire.DecodeHeader(buf[:n])
	if err == nil {
		var rep wire.HelloReply
		if rep, err = wire.DecodeHelloReply(body); err == nil && rep.Status != wire.OK {
			err = fmt.Errorf("hello: %v", rep.Status)
		}
		r.stride = int(rep.SlotStride)
	}
	if err != nil {
		r.close()
		return nil, err
	}
	c.SetDeadline(time.Time{})
	return r, nil
}

func (r *rawNode) close() {
	if r.win >= 0 {
		unix.Close(r.win)
	}
	r.c.Close()
	r.pool.Close()
}

// req sends one request and returns its reply's body.
func (r *rawNode) req(t wire.Type, body func([]byte) []byte) ([]byte, error) {
	r.id++
	r.c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.c.Write(wire.Message(t, r.id, body)); err != nil {
		return nil, err
	}
	buf := make([]byte, wire.MaxMessage)
	n, err := r.c.Read(buf)
	if err != nil {
		return nil, err
	}
	h, b, err := wire.DecodeHeader(buf[:n])
	if err == nil && (h.ID != r.id || h.Type != t|wire.ReplyBit) {
		err = fmt.Errorf("reply %+v to request %d of type %v", h, r.id, t)
	}
	return b, err
}

func (r *rawNode) status(t wire.Type, body func([]byte) []byte) string {
	b, err := r.req(t, body)
	if err != nil {
		return err.Error()
	}
	s, err := wire.DecodeStatusReply(b)
	if err != nil {
		return err.Error()
	}
	if s.Status == wire.OK {
		return fmt.Sprintf("ok %d", s.Value)
	}
	return s.Status.String()
}

func (r *rawNode) items(t wire.Type, m wire.Items) string {
	b, err := r.req(t, m.Append)
	if err != nil {
		return err.Error()
	}
	s, err := wire.DecodeItemsReply(b)
	if err != nil {
		return err.Error()
	}
	if s.Status != wire.OK {
		return s.Status.String()
	}
	return "ok " + s.Items[0].Status.String()
}

func (r *rawNode) fetch(m wire.Fetch) string {
	b, err := r.req(wire.TypeFetch, m.Append)
	if err != nil {
		return err.Error()
	}
	s, err := wire.DecodeFetchReply(b)
	if err != nil {
		return err.Error()
	}
	if s.Status != wire.OK {
		return s.Status.String()
	}
	return "ok " + s.Items[0].Status.String()
}

// thief attaches to the node as a sidecar would and names pod A's
// namespace (the engines' defaults: it knows the fingerprint, not having
// registered it) in a Lookup, a Fetch and a Put; then it registers a
// namespace of its own and looks A's digests up in it. It also lists the
// processes it can see.
func thief(c podCmd) podReply {
	r, err := rawNodeDial(c.Sock, "pod-thief")
	if err != nil {
		return podReply{Err: err.Error()}
	}
	defer r.close()
	a := machine.L2NamespaceFor("llama-rel", "bf16/16/HND", "", 32, 1)
	d := digests(c.Seed, c.N)
	st := map[string]string{}
	st["lookup"] = r.status(wire.TypeLookup, wire.Lookup{FP: a.FP, Width: 32, Digests: d}.Append)
	fi := wire.FetchItem{Max: 4096}
	copy(fi.Digest[:], d[:32])
	st["fetch"] = r.fetch(wire.Fetch{FP: a.FP, Items: []wire.FetchItem{fi}})
	it := wire.Item{Slot: 0, Length: 4096 + 96}
	copy(it.Digest[:], d[:32])
	st["put"] = r.items(wire.TypePut, wire.Items{FP: a.FP, Items: []wire.Item{it}})
	own := machine.L2NamespaceFor("llama-rel", "bf16/16/HND", "thief", 32, 1)
	st["register"] = r.status(wire.TypeRegister, wire.NS{FP: own.FP, Layout: own.Layout, Width: uint8(own.Width), World: uint16(own.World)}.Append)
	st["own_lookup"] = r.status(wire.TypeLookup, wire.Lookup{FP: own.FP, Width: 32, Digests: d}.Append)
	// The control: registered, the fingerprint is A's namespace (a
	// namespace is a capability: whoever knows it reads it).
	st["register_a"] = r.status(wire.TypeRegister, wire.NS{FP: a.FP, Layout: a.Layout, Width: uint8(a.Width), World: uint16(a.World)}.Append)
	st["registered_lookup"] = r.status(wire.TypeLookup, wire.Lookup{FP: a.FP, Width: 32, Digests: d}.Append)
	st["a_fp"] = hex.EncodeToString(a.FP[:])
	rep := peek(nil)
	rep.Seen = nil
	rep.Statuses = st
	return rep
}

// renames writes, under Names pod names one after the other (a connection
// each, closed before the next), Blocks well-formed blocks of a namespace
// of its own: what a sidecar that re-attaches under new names can store.
// Stored counts the blocks the node took.
func renames(c podCmd) podReply {
	ns := machine.L2NamespaceFor("llama-rel", "bf16/16/HND", "renamer", 32, 1)
	var rep podReply
	payload := make([]byte, 4096)
	for i := 0; i < c.Names; i++ {
		r, err := rawNodeDial(c.Sock, fmt.Sprintf("pod-rename-%d", i))
		if err != nil {
			return podReply{Err: err.Error(), Stored: rep.Stored}
		}
		if st := r.status(wire.TypeRegister, wire.NS{FP: ns.FP, Layout: ns.Layout, Width: uint8(ns.Width), World: uint16(ns.World)}.Append); st != "ok 0" {
			r.close()
			return podReply{Err: "register: " + st, Stored: rep.Stored}
		}
		win, err := shm.OpenFD(r.win, "window", 4096)
		r.win = -1 // the mapping owns it now
		if err != nil {
			r.close()
			return podReply{Err: err.Error(), Stored: rep.Stored}
		}
		slots := win.Len() / r.stride
		for k := 0; k < c.Blocks; k++ {
			d := digests(fmt.Sprintf("rename %d block %d", i, k), 1)
			rand.Read(payload)
			n := l2.PutValue(win.Bytes()[(k%slots)*r.stride:], ns, d, 0, payload)
			it := wire.Item{Slot: uint32(k % slots), Length: uint64(n)}
			copy(it.Digest[:], d)
			if st := r.items(wire.TypePut, wire.Items{FP: ns.FP, Items: []wire.Item{it}}); st == "ok ok" {
				rep.Stored++
			}
		}
		win.Close()
		r.close()
	}
	return rep
}

// squat tries to put a socket of its own in the node's place, through the
// pod's read-only mount of its directory: remove or rename the node's
// socket, bind another, create a file.
func squat(sock string) podReply {
	dir := filepath.Dir(sock)
	st := map[string]string{}
	st["remove"] = errString(os.Remove(sock))
	st["rename"] = errString(os.Rename(sock, sock+".old"))
	ln, err := net.Listen("unixpacket", filepath.Join(dir, "squat.sock"))
	if err == nil {
		ln.Close()
	}
	st["bind"] = errString(err)
	f, err := os.Create(filepath.Join(dir, "squat"))
	if err == nil {
		f.Close()
	}
	st["create"] = errString(err)
	return podReply{Statuses: st}
}

// stall holds a silent connection (no Hello) and a flooding one (lookups
// it never reads the replies of) to the node, and times until the node
// closes each.
type stall struct {
	t0          time.Time
	mute, flood *net.UnixConn
	muteDone    chan time.Duration
	floodDone   chan time.Duration
	sent        int
}

func startStall(sock string) (*stall, string) {
	s := &stall{t0: time.Now(), muteDone: make(chan time.Duration, 1), floodDone: make(chan time.Duration, 1)}
	var err error
	if s.mute, err = net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"}); err != nil {
		return nil, err.Error()
	}
	go func(t0 time.Time) {
		s.mute.SetReadDeadline(time.Now().Add(10 * time.Second))
		s.mute.Read(make([]byte, 64)) // ends when the node closes it
		s.muteDone <- time.Since(t0)
	}(time.Now())
	r, err := rawNodeDial(sock, "pod-flood")
	if err != nil {
		return nil, err.Error()
	}
	own := machine.L2NamespaceFor("llama-rel", "bf16/16/HND", "flood", 32, 1)
	if st := r.status(wire.TypeRegister, wire.NS{FP: own.FP, Layout: own.Layout, Width: uint8(own.Width), World: uint16(own.World)}.Append); st != "ok 0" {
		return nil, "register: " + st
	}
	s.flood = r.c
	s.t0 = time.Now()
	lk := wire.Message(wire.TypeLookup, 5, wire.Lookup{FP: own.FP, Width: 32, Digests: make([]byte, 32*wire.MaxLookup)}.Append)
	go func() {
		defer r.close()
		r.c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		for {
			if _, err := r.c.Write(lk); err != nil {
				break
			}
			s.sent++
		}
		s.floodDone <- time.Since(s.t0)
	}()
	return s, ""
}

func (s *stall) end() podReply {
	var rep podReply
	for _, ch := range []chan time.Duration{s.muteDone, s.floodDone} {
		select {
		case d := <-ch:
			if ch == s.muteDone {
				rep.MuteMS = d.Milliseconds()
			} else {
				rep.FloodMS = d.Milliseconds()
			}
		case <-time.After(12 * time.Second):
			rep.Err = "the node did not close a hostile connection within 12 s"
			return rep
		}
	}
	s.mute.Close()
	rep.FloodSent = s.sent
	return rep
}
