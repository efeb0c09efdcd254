package reliability

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/testport"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// slot is the pool slot (and engine page) size every test uses: the
// smallest the sidecar accepts, so that copies are cheap.
const slot = 4096

// sidecar is a real `ringside serve` process.
type sidecar struct {
	t    testing.TB
	dir  string
	sock string
	addr string
	// via, when set, is a Unix socket that reaches addr: the sidecar is in
	// a network namespace of its own (a pod's), and its pod forwards.
	via     string
	args    []string
	cmd     *exec.Cmd
	logPath string
	exited  chan struct{}
	waitErr error
}

// newDir makes a unique directory under /dev/shm for one sidecar.
func newDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "rs-rel-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func freePort(t testing.TB) string { return testport.Addr() }

// defaultArgs are the serve flags of a small, fast test sidecar.
var defaultArgs = []string{"--pool.bytes", "4MiB", "--pool.slot-bytes", "4KiB", "--ring.capacity", "256KiB", "--lease.ttl", "3s", "--write-timeout", "3s"}

// startSidecar starts `ringside serve` on dir with defaultArgs plus extra
// (later flags win) and waits until it is ready.
func startSidecar(t testing.TB, dir string, extra ...string) *sidecar {
	t.Helper()
	s := &sidecar{t: t, dir: dir, sock: filepath.Join(dir, "ringside.sock")}
	s.args = append(append([]string{}, defaultArgs...), extra...)
	s.logPath = filepath.Join(t.TempDir(), "sidecar.log")
	s.start()
	t.Cleanup(s.stop)
	return s
}

func (s *sidecar) start() {
	t := s.t
	t.Helper()
	s.addr = freePort(t)
	args := append([]string{"serve", "--dir", s.dir, "--metrics.addr", s.addr}, s.args...)
	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	s.cmd = exec.Command(ringsideBin, args...)
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		t.Fatal(err)
	}
	logf.Close()
	s.exited = make(chan struct{})
	cmd, exited := s.cmd, s.exited
	go func() {
		err := cmd.Wait()
		s.waitErr = err
		close(exited)
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + s.addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-s.exited:
			t.Fatalf("sidecar exited at start (%v): %s", s.waitErr, s.logTail())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("sidecar not ready: %s", s.logTail())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *sidecar) pid() int { return s.cmd.Process.Pid }

// alive reports whether the process is still running.
func (s *sidecar) alive() bool {
	select {
	case <-s.exited:
		return false
	default:
		return true
	}
}

// kill9 kills the sidecar with SIGKILL and reaps it.
func (s *sidecar) kill9() {
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.exited
}

// stop ends the sidecar with SIGTERM (SIGKILL after 10 s) and fails the
// test if it had crashed or logged a panic.
func (s *sidecar) stop() {
	if s.alive() {
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
			if s.waitErr != nil {
				s.t.Errorf("sidecar exit on SIGTERM: %v: %s", s.waitErr, s.logTail())
			}
		case <-time.After(10 * time.Second):
			s.t.Errorf("sidecar did not stop within 10 s of SIGTERM")
			s.kill9()
		}
	}
	if n := s.panics(); n > 0 {
		keep := filepath.Join(os.TempDir(), fmt.Sprintf("rs-rel-sidecar-%d.log", s.pid()))
		b, _ := os.ReadFile(s.logPath)
		os.WriteFile(keep, b, 0o600)
		s.t.Errorf("sidecar logged %d panics (log kept in %s): %s", n, keep, s.logTail())
	}
}

// panics counts crashes (runtime panics and fatal errors) in the log;
// faults a session recovered from are logged as "session aborted".
func (s *sidecar) panics() int {
	b, _ := os.ReadFile(s.logPath)
	n := 0
	for _, line := range bytes.Split(b, []byte("\n")) {
		if bytes.HasPrefix(line, []byte("panic:")) || bytes.HasPrefix(line, []byte("fatal error:")) {
			n++
		}
	}
	return n
}

func (s *sidecar) logTail() string {
	b, _ := os.ReadFile(s.logPath)
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}

// logCount counts log lines containing substr.
func (s *sidecar) logCount(substr string) int {
	b, _ := os.ReadFile(s.logPath)
	return bytes.Count(b, []byte(substr))
}

// poolStats mirrors cache.Stats as /debug/state encodes it.
type poolStats struct {
	Capacity, Free, Used, Reserved, Writing, Stored int
	Blocks, PendingBlocks, PinnedBlocks, Evictable  int
	Leases, Writers, Namespaces                     int
	Lookups, LookupBlocks, HitBlocks, Stores        uint64
	Evictions, NoSpace, Aborts                      uint64
}

type sessionState struct {
	ID             uint64 `json:"id"`
	Instance       string `json:"instance"`
	PID            int    `json:"pid"`
	SubmissionRing string `json:"submission_ring"`
	CompletionRing string `json:"completion_ring"`
	SubmissionUsed uint64 `json:"submission_used_bytes"`
	CompletionUsed uint64 `json:"completion_used_bytes"`
}

type state struct {
	Epoch    string         `json:"epoch"`
	Ready    bool           `json:"ready"`
	Pool     poolStats      `json:"pool"`
	Sessions []sessionState `json:"sessions"`
}

func (s *sidecar) state() state {
	s.t.Helper()
	st, err := s.tryState()
	if err != nil {
		s.t.Fatal(err)
	}
	return st
}

func (s *sidecar) tryState() (state, error) {
	var st state
	resp, err := s.http().Get("http://" + s.addr + "/debug/state")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	err = json.NewDecoder(resp.Body).Decode(&st)
	return st, err
}

func (s *sidecar) epoch() uint64 {
	v, err := strconv.ParseUint(s.state().Epoch, 16, 64)
	if err != nil {
		s.t.Fatal(err)
	}
	return v
}

// http is a client of the sidecar's metrics address.
func (s *sidecar) http() *http.Client {
	c := &http.Client{Timeout: 5 * time.Second}
	if s.via != "" {
		c.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", s.via)
		}}
	}
	return c
}

// metric reads one unlabelled series from /metrics.
func (s *sidecar) metric(name string) float64 {
	resp, err := s.http().Get("http://" + s.addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+" ") || strings.HasPrefix(line, name+"{") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			return v
		}
	}
	return -1
}

// metricSum adds every series of a metric family (all label values).
func (s *sidecar) metricSum(name string) float64 {
	resp, err := s.http().Get("http://" + s.addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, name+" ") || strings.HasPrefix(line, name+"{") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
}

// rssKiB reads VmRSS of the sidecar process.
func rssKiB(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			v, _ := strconv.ParseInt(strings.Fields(line)[1], 10, 64)
			return v
		}
	}
	return -1
}

func fdCount(pid int) int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return -1
	}
	return len(ents)
}

// waitQuiet waits until the sidecar holds no sessions (besides keep), no
// leases, no writes in flight and no pins, and pool accounting is exact;
// it returns how long that took.
func (s *sidecar) waitQuiet(t testing.TB, keep int, within time.Duration) (time.Duration, state) {
	t.Helper()
	t0 := time.Now()
	deadline := t0.Add(within)
	for {
		st := s.state()
		p := st.Pool
		if len(st.Sessions) <= keep && p.Leases == 0 && p.Writing == 0 && p.Writers == 0 && p.PinnedBlocks == 0 && p.Free+p.Used == p.Capacity {
			return time.Since(t0), st
		}
		if time.Now().After(deadline) {
			t.Fatalf("not reclaimed within %v: %d sessions, pool %+v", within, len(st.Sessions), p)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ringFiles lists ring files in dir.
func ringFiles(dir string) []string {
	var out []string
	for _, pat := range []string{"*.sub", "*.cmp"} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		out = append(out, m...)
	}
	return out
}

// --- engine-side helpers ---

func opts(sock, instance string) connector.Options {
	return connector.Options{Socket: sock, Instance: instance, Model: "llama-rel", Layout: "bf16/16/HND", Timeout: 3 * time.Second}
}

func dial(t testing.TB, o connector.Options) *connector.Client {
	t.Helper()
	c, err := connector.Dial(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// digests returns n chained 32-byte digests of a prompt.
func digests(seed string, n int) []byte {
	out := make([]byte, 0, n*32)
	prev := sha256.Sum256([]byte(seed))
	for i := 0; i < n; i++ {
		prev = sha256.Sum256(append(prev[:], byte(i)))
		out = append(out, prev[:]...)
	}
	return out
}

// fillPage writes the deterministic content of a block (its digest, a
// rank and a tenant tag) into p, so that any reader can verify a load.
func fillPage(p, digest []byte, tag uint64) {
	var seed [8]byte
	binary.LittleEndian.PutUint64(seed[:], tag)
	h := sha256.Sum256(append(append([]byte{}, digest...), seed[:]...))
	for i := 0; i < len(p); i += 32 {
		copy(p[i:], h[:])
		h = sha256.Sum256(h[:])
	}
}

// pageOK reports whether p holds the content fillPage writes.
func pageOK(p, digest []byte, tag uint64) bool {
	want := make([]byte, len(p))
	fillPage(want, digest, tag)
	return bytes.Equal(p, want)
}

// region is engine memory of this process registered with the sidecar.
type region struct {
	buf []byte
	reg schema.RegisterRegion
}

func newRegion(id uint32, pages int) *region {
	buf := make([]byte, pages*slot)
	return regionOver(id, buf)
}

func regionOver(id uint32, buf []byte) *region {
	return &region{buf: buf, reg: schema.RegisterRegion{
		Region: id, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint64(len(buf)), PageSize: slot, PageCount: uint32(len(buf) / slot),
	}}
}

func (r *region) page(i int) []byte { return r.buf[i*slot : (i+1)*slot] }

func status(err error) schema.Status {
	var se *schema.Error
	if errors.As(err, &se) {
		return se.Status
	}
	return 0xFFFF
}

func iota32(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i)
	}
	return out
}

func percentile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(q * float64(len(s)-1))
	return s[i]
}

// ringPath is a path that reaches one of c's rings, which have no name
// (protocol version 2 passes them as descriptors): its descriptor in
// /proc/self/fd. Opening or truncating it reaches the ring file itself.
func ringPath(c *connector.Client, sub bool) string {
	s, m := c.RingFDs()
	if !sub {
		s = m
	}
	return fmt.Sprintf("/proc/self/fd/%d", s)
}

// openRing maps one of c's rings a second time, from a duplicate of its
// descriptor, checking the epoch like ring.Open.
func openRing(c *connector.Client, sub bool, epoch uint64) (*ring.File, error) {
	s, m := c.RingFDs()
	if !sub {
		s = m
	}
	fd, err := syscall.Dup(s)
	if err != nil {
		return nil, err
	}
	return ring.OpenFD(fd, ringPath(c, sub), epoch)
}

// holdsRing reports whether process pid still holds a descriptor of the
// ring behind c's descriptor (same inode).
func holdsRing(pid int, c *connector.Client, sub bool) bool {
	var want syscall.Stat_t
	if syscall.Stat(ringPath(c, sub), &want) != nil {
		return false
	}
	base := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(base, e.Name()), &st) == nil && st.Ino == want.Ino && st.Dev == want.Dev {
			return true
		}
	}
	return false
}

// poolPath is /proc/PID/fd/N of the sidecar's pool (nameless once mapped).
func (s *sidecar) poolPath() string {
	base := fmt.Sprintf("/proc/%d/fd", s.pid())
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		p := filepath.Join(base, e.Name())
		if target, err := os.Readlink(p); err == nil && target == filepath.Join(s.dir, "pool")+" (deleted)" {
			return p
		}
	}
	s.t.Fatalf("the sidecar holds no descriptor of %s/pool", s.dir)
	return ""
}
