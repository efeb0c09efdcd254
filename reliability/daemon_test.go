package reliability

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
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
}

// tryStart runs `ringside serve` on dir like startSidecar, but a start that
// fails is a result, not a test failure: it returns the sidecar once ready
// (stopped at cleanup), or nil with the exit error and the log of a sidecar
// that exited at start.
func tryStart(t *testing.T, dir string, extra ...string) (*sidecar, error, string) {
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
			return nil, s.waitErr, s.logTail()
		default:
		}
		if resp, err := c.Get("http://" + s.addr + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				t.Cleanup(s.stop)
				return s, nil, s.logTail()
			}
		}
	}
	s.kill9()
	t.Fatalf("sidecar neither ready nor exited within 20 s: %s", s.logTail())
	return nil, nil, ""
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
	c, err := connector.Dial(opts(sc.sock, "after-emfile"))
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
	row.add("sidecar held %d descriptors at start, limit %d, %d at EMFILE; alive after 2 s of EMFILE, %v accept errors counted (backoff); attach and ping after the connections closed: ok", base, limit.Cur, held, errs)
}
