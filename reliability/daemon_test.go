package reliability

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/connector"
)

// The daemon's own resources and its directory: file descriptors, the
// metrics server's connections, the --dir it is given, and a second sidecar
// on the same --dir (issue #16, points 16 to 19).

func init() {
	defect(Defect{Issue: 16, Point: 16, Title: "EMFILE on accept makes the sidecar exit",
		Tests:  "TestAcceptFdExhaustion",
		Before: "628f441: the sidecar stopped serving when accept ran out of descriptors (exit: exit status 1): ringside: accept unixpacket …/ringside.sock: accept4: too many open files",
		Fix:    "accept errors back off (5 ms doubling to 1 s) and accepting goes on; only a closed listener ends Serve; ringside_accept_errors_total"})
	defect(Defect{Issue: 16, Point: 17, Title: "idle keep-alive connections to the metrics server are never closed and exhaust the descriptors",
		Tests:  "TestMetricsIdleConnections",
		Before: "b1c14d8: the sidecar holds 312 descriptors with 300 idle metrics connections open, 13 at start: the connections are not bounded",
		Fix:    "the metrics server has read, write and idle timeouts (--metrics.read-timeout, --metrics.write-timeout, --metrics.idle-timeout) and at most --metrics.max-conns (64) connections, a new one closing the one idle longest"})
	defect(Defect{Issue: 16, Point: 18, Title: "a pre-existing --dir owned by another uid, or writable by others or by another group, is accepted: that uid can replace the socket and receive a root engine's attach request",
		Tests:  "TestDirOwnership",
		Before: "127baa5: started on a directory owned by another uid / writable by others / writable by others, sticky / writable by another group: another uid could replace its socket, pool or rings",
		Fix:    "a --dir owned by another uid, writable by others, or by another group without --group-access is refused at start, naming its owner and mode"})
	defect(Defect{Issue: 16, Point: 19, Title: "two sidecars on one --dir: the second replaces the first's socket and pool, and one's shutdown deletes the other's",
		Tests:  "TestDirLock",
		Before: "a0b7546: a second sidecar (pid 19394) started on the --dir of a running one (pid 19380); the first sidecar's socket or pool was replaced or removed; attach to the first sidecar after the second tried to start: connect: no such file or directory",
		Fix:    "an exclusive flock on --dir/ringside.lock (holding the pid), taken before anything in the directory is touched; a second sidecar refuses, naming the holder's pid"})
}

// tryStart runs `ringside serve` on dir like startSidecar, but a start that
// fails is a result, not a test failure: it returns the sidecar once ready
// (stopped at cleanup), or nil with the log and the exit error of a sidecar
// that exited at start.
func tryStart(t *testing.T, dir string, extra ...string) (*sidecar, string, error) {
	t.Helper()
	s := &sidecar{t: t, dir: dir, sock: filepath.Join(dir, "ringside.sock")}
	s.args = append(append([]string{}, defaultArgs...), extra...)
	s.logPath = filepath.Join(t.TempDir(), "sidecar.log")
	s.addr = freePort(t)
	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	s.cmd = exec.Command(ringsideBin, append([]string{"serve", "--dir", dir, "--metrics.addr", s.addr}, s.args...)...)
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	err = s.cmd.Start()
	logf.Close()
	if err != nil {
		t.Fatal(err)
	}
	s.exited = make(chan struct{})
	go func() { s.waitErr = s.cmd.Wait(); close(s.exited) }()
	c := http.Client{Timeout: time.Second}
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		select {
		case <-s.exited:
			return nil, s.logTail(), s.waitErr
		default:
		}
		if resp, err := c.Get("http://" + s.addr + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				t.Cleanup(s.stop)
				return s, s.logTail(), nil
			}
		}
	}
	s.kill9()
	t.Fatalf("sidecar neither ready nor exited within 20 s: %s", s.logTail())
	return nil, "", nil
}

// TestAcceptFdExhaustion: with the sidecar's RLIMIT_NOFILE lowered to just
// above what it holds, connections to the attach socket exhaust its file
// descriptors; accept then fails with EMFILE.
func TestAcceptFdExhaustion(t *testing.T) {
	row := record(t, "Resource exhaustion", "the sidecar's RLIMIT_NOFILE lowered (prlimit) to the descriptors it holds + 8, then 64 connections to the attach socket that send nothing: accept fails with EMFILE",
		"the sidecar stays alive through 2 s of EMFILE (accept errors back off, 5 ms to 1 s, and go on); ringside_accept_errors_total counts them; once the connections close, an engine attaches and pings, and /readyz answers ready", "")
	sc := startSidecar(t, newDir(t))
	pid := sc.pid()
	base := fdCount(pid)
	var old unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &old); err != nil {
		t.Skipf("prlimit on the sidecar: %v", err)
	}
	limit := unix.Rlimit{Cur: uint64(base + 8), Max: old.Max}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &limit, nil); err != nil {
		t.Skipf("prlimit on the sidecar: %v", err)
	}
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < 64; i++ {
		c, err := net.Dial("unixpacket", sc.sock)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	// The sidecar takes connections until its descriptors run out.
	for deadline := time.Now().Add(5 * time.Second); fdCount(pid) < int(limit.Cur) && sc.alive(); {
		if time.Now().After(deadline) {
			t.Fatalf("the sidecar holds %d descriptors, limit %d: the connections did not exhaust them", fdCount(pid), limit.Cur)
		}
		time.Sleep(5 * time.Millisecond)
	}
	held := fdCount(pid)
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if !sc.alive() {
			t.Fatalf("the sidecar exited when accept ran out of descriptors (%v): %s", sc.waitErr, short(lastLine(sc.logTail()), 300))
		}
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	// The closed connections still wait in the backlog: the sidecar accepts
	// each (after its accept backoff, up to 1 s), reads its end and closes
	// it, so its descriptors come back over a few hundred milliseconds. An
	// attach that lands while some are still open can fail to create its
	// rings (EMFILE, a clear error); the engine's attach is retried. What
	// this test asks is that the descriptors do come back (no leak) and that
	// an attach then succeeds.
	settled := time.Now().Add(10 * time.Second)
	for fdCount(pid) > base && time.Now().Before(settled) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := fdCount(pid); n > base {
		t.Fatalf("the sidecar holds %d descriptors 10 s after the connections closed, %d before they opened: descriptors leaked", n, base)
	}
	var c *connector.Client
	var err error
	tries := 0
	for {
		tries++
		c, err = connector.Dial(opts(sc.sock, "after-emfile"))
		if err == nil || !strings.Contains(err.Error(), "too many open files") || time.Now().After(settled) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		// A sidecar that gave up accepting drains its sessions and exits.
		select {
		case <-sc.exited:
			t.Fatalf("the sidecar stopped serving when accept ran out of descriptors (exit: %v): %s", sc.waitErr, short(lastLine(sc.logTail()), 300))
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("attach after the descriptors came back: %v", err)
	}
	defer c.Close()
	if err := c.Ping(1); err != nil {
		t.Fatalf("ping after the descriptors came back: %v", err)
	}
	if !sc.state().Ready {
		t.Error("not ready after the descriptors came back")
	}
	errs := sc.metric("ringside_accept_errors_total")
	if errs < 1 {
		t.Errorf("ringside_accept_errors_total = %v after EMFILE, want at least 1", errs)
	}
	row.add("sidecar held %d descriptors at start, limit %d, %d at EMFILE; alive after 2 s of EMFILE, %v accept errors counted (backoff); attach and ping after the connections closed: ok (attach tries: %d)", base, limit.Cur, held, errs, tries)
}

// keepAlive opens an HTTP/1.1 connection to addr, makes one request on it
// and leaves it open and idle (keep-alive).
func keepAlive(addr, path string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: ringside\r\n\r\n", path)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	c.SetDeadline(time.Time{})
	return c, nil
}

// closedByPeer reports whether the server has closed c (a read ends with
// EOF or a reset within wait).
func closedByPeer(c net.Conn, wait time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(wait))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	return err != nil && (!errors.As(err, &ne) || !ne.Timeout())
}

// metricsConns is the default --metrics.max-conns.
const metricsConns = 64

// TestMetricsIdleConnections: clients of the metrics port that make one
// request each and then keep their connections open and idle.
func TestMetricsIdleConnections(t *testing.T) {
	row := record(t, "Resource exhaustion", "300 HTTP keep-alive connections to the metrics port, one request each, then left open and idle; then, with --metrics.idle-timeout 300ms and --metrics.read-timeout 300ms, 20 idle connections and one that sends half a request header",
		fmt.Sprintf("the sidecar holds at most --metrics.max-conns (%d by default) connections, closing the longest idle to make room: its descriptor count stays within %d + 8 of its start, and /metrics, /readyz and an attach still answer while the 300 are open; idle connections are closed after the idle timeout and a half-sent request after the read timeout, and the descriptors come back", metricsConns, metricsConns), "")
	sc := startSidecar(t, newDir(t))
	pid := sc.pid()
	base := fdCount(pid)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < 300; i++ {
		c, err := keepAlive(sc.addr, "/healthz")
		if err != nil {
			t.Fatalf("keep-alive connection %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	held := fdCount(pid)
	if held > base+metricsConns+8 {
		t.Errorf("the sidecar holds %d descriptors with 300 idle metrics connections open, %d at start: the connections are not bounded", held, base)
	}
	c := http.Client{Timeout: 2 * time.Second}
	for _, path := range []string{"/metrics", "/readyz"} {
		resp, err := c.Get("http://" + sc.addr + path)
		if err != nil {
			t.Errorf("%s with 300 idle connections open: %v", path, err)
			continue
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s with 300 idle connections open: %s", path, resp.Status)
		}
	}
	e := dial(t, opts(sc.sock, "metrics-idle"))
	if err := e.Ping(1); err != nil {
		t.Errorf("ping with 300 idle connections open: %v", err)
	}
	closed := 0
	for _, c := range conns {
		if closedByPeer(c, 10*time.Millisecond) {
			closed++
		}
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	if t.Failed() {
		return
	}
	row.add("300 idle connections: sidecar descriptors %d → %d, %d of the connections closed by the sidecar to make room; /metrics, /readyz and an attach answered", base, held, closed)

	// Short timeouts: idle connections and a stalled request are closed.
	sc2 := startSidecar(t, newDir(t), "--metrics.idle-timeout", "300ms", "--metrics.read-timeout", "300ms")
	pid2 := sc2.pid()
	base2 := fdCount(pid2)
	for i := 0; i < 20; i++ {
		c, err := keepAlive(sc2.addr, "/metrics")
		if err != nil {
			t.Fatalf("keep-alive connection %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	half, err := net.Dial("tcp", sc2.addr)
	if err != nil {
		t.Fatal(err)
	}
	conns = append(conns, half)
	fmt.Fprintf(half, "GET /metrics HTTP/1.1\r\nHost: ringside\r\n")
	t0 := time.Now()
	for i, c := range conns {
		if !closedByPeer(c, 5*time.Second) {
			t.Fatalf("connection %d (of 20 idle and one half-sent request) still open %v after it went quiet, with 300 ms timeouts", i, time.Since(t0).Round(time.Millisecond))
		}
	}
	took := time.Since(t0)
	deadline := time.Now().Add(5 * time.Second)
	for fdCount(pid2) > base2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := fdCount(pid2); n > base2 {
		t.Errorf("the sidecar holds %d descriptors after its metrics connections were closed, %d before", n, base2)
	}
	row.add("300 ms timeouts: 20 idle connections and a half-sent request all closed by the sidecar within %v; descriptors back to %d", took.Round(time.Millisecond), base2)
}

// TestDirOwnership: `ringside serve` on a --dir that another uid owns or
// may write to (it could replace the socket, the pool or a ring), and on
// directories it may use.
func TestDirOwnership(t *testing.T) {
	row := record(t, "Isolation", "a pre-existing --dir owned by another uid (65534), or mode 0777, 1777, or 0770 with another group (65534), given to a root sidecar; and directories it may use: new, 0700, 0755, 0770 of its own group, 0770 of another group with --group-access, 0750 of another group",
		"each unsafe directory is refused at start (exit status 1) with a message naming its owner and mode, before anything is created in it; each safe one starts and serves", "")
	if os.Getuid() != 0 {
		t.Skip("needs root to give a directory to another uid")
	}
	type dirCase struct {
		name      string
		mode      os.FileMode // applied with chmod (sticky included)
		uid, gid  int         // -1: unchanged
		extra     []string
		refuse    []string // words the refusal must contain; nil: must start
		nonexists bool     // --dir does not exist yet
	}
	cases := []dirCase{
		{name: "owned by another uid", mode: 0o700, uid: 65534, gid: -1, refuse: []string{"uid 65534", "0700"}},
		{name: "writable by others", mode: 0o777, uid: -1, gid: -1, refuse: []string{"uid 0", "0777"}},
		{name: "writable by others, sticky", mode: 0o1777, uid: -1, gid: -1, refuse: []string{"uid 0", "1777"}},
		{name: "writable by another group", mode: 0o770, uid: -1, gid: 65534, refuse: []string{"gid 65534", "0770"}},
		{name: "new", nonexists: true},
		{name: "0700", mode: 0o700, uid: -1, gid: -1},
		{name: "0755", mode: 0o755, uid: -1, gid: -1},
		{name: "0770 own group", mode: 0o770, uid: -1, gid: -1},
		{name: "0770 another group, --group-access", mode: 0o770, uid: -1, gid: 65534, extra: []string{"--group-access"}},
		{name: "0750 another group", mode: 0o750, uid: -1, gid: 65534},
	}
	var refused, started []string
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(newDir(t), "rs")
			if !tc.nonexists {
				if err := os.Mkdir(dir, 0o700); err != nil {
					t.Fatal(err)
				}
				if err := os.Chown(dir, tc.uid, tc.gid); err != nil {
					t.Fatal(err)
				}
				m := tc.mode.Perm()
				if tc.mode&0o1000 != 0 {
					m |= os.ModeSticky
				}
				if err := os.Chmod(dir, m); err != nil {
					t.Fatal(err)
				}
			}
			sc, log, err := tryStart(t, dir, tc.extra...)
			if tc.refuse == nil {
				if sc == nil {
					t.Fatalf("refused a safe directory (%v): %s", err, short(lastLine(log), 300))
				}
				c := dial(t, opts(sc.sock, "dir-"+tc.name))
				if err := c.Ping(1); err != nil {
					t.Fatal(err)
				}
				started = append(started, tc.name)
				return
			}
			if sc != nil {
				t.Fatalf("started on a directory %s: another uid could replace its socket, pool or rings", tc.name)
			}
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 1 {
				t.Errorf("exit %v, want status 1", err)
			}
			msg := lastLine(log)
			for _, w := range tc.refuse {
				if !strings.Contains(msg, w) {
					t.Errorf("refusal %q does not name %q", msg, w)
				}
			}
			if left, _ := os.ReadDir(dir); len(left) != 0 {
				t.Errorf("refused, yet created %v in the directory", left)
			}
			refused = append(refused, fmt.Sprintf("%s: %q", tc.name, short(msg, 160)))
		})
	}
	row.add("refused: %s; started and served: %s", strings.Join(refused, "; "), strings.Join(started, ", "))
}

// TestDirLock: a second `ringside serve` on the --dir of a running one.
func TestDirLock(t *testing.T) {
	row := record(t, "Faults", "a second `ringside serve` started on the --dir of a running sidecar that has a session; then the first stopped and the second started again",
		"the second refuses to start (exit status 1), naming the first's pid, and touches nothing: the first's session still pings, a new engine attaches to the first (same epoch), its socket and pool are the same files; once the first has stopped, the second starts and serves", "")
	dir := newDir(t)
	first := startSidecar(t, dir)
	c := dial(t, opts(first.sock, "first"))
	epoch := first.epoch()
	inode := func(p string) uint64 {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return 0
		}
		return st.Ino
	}
	sockIno, poolIno := inode(first.sock), inode(filepath.Join(dir, "pool"))
	second, log, err := tryStart(t, dir)
	var refusal string
	if second != nil {
		t.Errorf("a second sidecar (pid %d) started on the --dir of a running one (pid %d)", second.pid(), first.pid())
		second.stop()
	} else {
		refusal = lastLine(log)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("second sidecar: exit %v, want status 1", err)
		}
		if !strings.Contains(refusal, fmt.Sprintf("pid %d", first.pid())) {
			t.Errorf("the refusal does not name the running sidecar (pid %d): %q", first.pid(), refusal)
		}
	}
	if err := c.Ping(1); err != nil {
		t.Errorf("the first sidecar's session: %v", err)
	}
	if inode(first.sock) != sockIno || inode(filepath.Join(dir, "pool")) != poolIno {
		t.Errorf("the first sidecar's socket or pool was replaced or removed")
	}
	if c2, err := connector.Dial(opts(first.sock, "after-second")); err != nil {
		t.Errorf("attach to the first sidecar after the second tried to start: %v", err)
	} else {
		if c2.Info().Epoch != epoch {
			t.Errorf("attached to epoch %x, the first sidecar's is %x", c2.Info().Epoch, epoch)
		}
		c2.Close()
	}
	if t.Failed() {
		return
	}
	c.Close()
	first.stop()
	again := startSidecar(t, dir)
	c3 := dial(t, opts(again.sock, "again"))
	if err := c3.Ping(1); err != nil {
		t.Fatal(err)
	}
	row.add("second refused: %q; the first kept its socket, pool and session; after it stopped, a sidecar started on the directory and served", short(refusal, 200))
}
