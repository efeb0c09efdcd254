package node

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

const testSlot = 4096

func testLog(t testing.TB) zerolog.Logger {
	if testing.Verbose() {
		return zerolog.New(zerolog.NewTestWriter(t))
	}
	return zerolog.Nop()
}

// startServer runs a node tier in a directory of its own. Its pods are
// the names their clients declare: the tests' clients share one network
// namespace (this process's), which --pod-identity netns, the default,
// counts as one pod (TestPodIdentityNetNS tests that).
func startServer(t testing.TB, mod func(*ServerConfig)) *Server {
	t.Helper()
	dir, err := os.MkdirTemp("", "rsnode")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := ServerConfig{Dir: filepath.Join(dir, "n"), PoolBytes: 128 * (testSlot + SlotHeadroom), SlotBytes: testSlot, IOTimeout: 500 * time.Millisecond,
		PodIdentity: IdentityDeclared}
	if mod != nil {
		mod(&cfg)
	}
	s, err := NewServer(cfg, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Serve(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		if bad := s.checkIndex(); len(bad) > 0 {
			t.Errorf("index: %v", bad)
		}
	})
	return s
}

// testClient is a client over a pool of 32 slots (a memfd, not yet
// populated: the client makes each slot resident as a fetch first lands
// there).
type testClient struct {
	*Client
	pool []byte
}

func newTestClient(t testing.TB, sock, pod string) *testClient {
	t.Helper()
	return newTestClientIO(t, sock, pod, 2*time.Second)
}

// newTestClientIO is newTestClient with fetches' and writes' deadline io.
func newTestClientIO(t testing.TB, sock, pod string, io time.Duration) *testClient {
	t.Helper()
	pool := testPool(t, 32*testSlot)
	c, err := NewClient(ClientConfig{Socket: sock, Pod: pod, LookupTimeout: time.Second, IOTimeout: io}, pool, testSlot, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	if !c.WaitConnected(5 * time.Second) {
		t.Fatal("not attached")
	}
	return &testClient{c, pool.Bytes()}
}

// testPool is a pod pool of size bytes: a memfd, its pages not allocated.
func testPool(t testing.TB, size int) *shm.Mapping {
	t.Helper()
	m, err := shm.CreateMemfd("test-pod-pool", size, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

var testNS = machine.L2NamespaceFor("llama", "bf16/16/HND", "", 16, 2)

func digest(i int) []byte {
	d := make([]byte, 16)
	copy(d, fmt.Sprintf("block-%09d", i))
	return d
}

// fill writes block i's bytes (both ranks) into pool slots 2·k and 2·k+1.
func (c *testClient) fill(i, k int) []uint64 {
	offs := []uint64{uint64(2*k) * testSlot, uint64(2*k+1) * testSlot}
	for r, off := range offs {
		rng := rand.New(rand.NewPCG(uint64(i), uint64(r)))
		for j := range testSlot {
			c.pool[off+uint64(j)] = byte(rng.Uint32())
		}
	}
	return offs
}

func (c *testClient) write(t testing.TB, i, k int) {
	t.Helper()
	offs := c.fill(i, k)
	done := make(chan bool, 1)
	c.Write(machine.L2Write{ID: 1, NS: testNS, Digest: digest(i), Length: testSlot, PoolOffsets: offs}, func(refused bool) { done <- refused })
	if <-done {
		t.Fatal("write refused")
	}
}

func (c *testClient) lookup(ds ...int) int {
	var b []byte
	for _, i := range ds {
		b = append(b, digest(i)...)
	}
	ch := make(chan int, 1)
	c.Lookup(machine.L2Lookup{ID: 1, NS: testNS, Digests: b}, func(n int) { ch <- n })
	return <-ch
}

// fetch fetches blocks into slots from 40 on, and reports which came with
// the right bytes.
func (c *testClient) fetch(t *testing.T, ds ...int) []bool {
	t.Helper()
	f := machine.L2Fetch{ID: 1, NS: testNS, Length: testSlot, MaxLength: testSlot}
	for k, i := range ds {
		f.Blocks = append(f.Blocks, machine.L2FetchBlock{Digest: digest(i), PoolOffsets: []uint64{uint64(2*k+8) * testSlot, uint64(2*k+9) * testSlot}})
	}
	ch := make(chan []machine.L2FetchResult, 1)
	c.Fetch(f, func(r []machine.L2FetchResult) { ch <- r })
	res := <-ch
	ok := make([]bool, len(ds))
	want := &testClient{pool: make([]byte, 2*testSlot)}
	for k, i := range ds {
		if !res[k].OK {
			continue
		}
		want.fill(i, 0)
		got := c.pool[uint64(2*k+8)*testSlot : uint64(2*k+10)*testSlot]
		if !bytes.Equal(got, want.pool) {
			t.Fatalf("block %d: fetched bytes differ", i)
		}
		ok[k] = true
	}
	return ok
}

// waitFor polls cond for up to 5 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Two sidecars of two pods share blocks through one node process: what one
// writes, the other finds and fetches byte for byte; a lookup stops at the
// first block any rank of which is missing.
func TestShareBetweenPods(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	b := newTestClient(t, s.Socket(), "pod-b")
	for i := range 3 {
		a.write(t, i, i)
	}
	waitFor(t, "3 blocks stored", func() bool { return a.Stats().WritesOK.Load() == 3 })
	if n := b.lookup(0, 1, 2, 3); n != 3 {
		t.Fatalf("lookup found %d, want 3", n)
	}
	if n := b.lookup(3, 0); n != 0 {
		t.Fatalf("lookup past a miss found %d", n)
	}
	if got := b.fetch(t, 0, 1, 2, 5); fmt.Sprint(got) != "[true true true false]" {
		t.Fatalf("fetch: %v", got)
	}
	// A second write of a block held already copies nothing.
	b.write(t, 1, 0)
	waitFor(t, "exists", func() bool { return b.Stats().WritesExist.Load() == 1 })
	if s.OwnerUsed("pod-a") != 6 || s.OwnerUsed("pod-b") != 0 {
		t.Fatalf("charges: a %d, b %d", s.OwnerUsed("pod-a"), s.OwnerUsed("pod-b"))
	}
}

// A sidecar that restarts (a new client, the same pod) finds what it wrote;
// a node process that restarts loses its blocks and the client re-attaches
// to the new one by itself.
func TestRestarts(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 7, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	a.Close()
	a2 := newTestClient(t, s.Socket(), "pod-a")
	if got := a2.fetch(t, 7); !got[0] {
		t.Fatal("a block did not outlive its sidecar")
	}
	// The node restarts on the same directory.
	sock := s.Socket()
	s.Shutdown()
	<-s.Done()
	waitFor(t, "detached", func() bool { return !a2.Connected() })
	if n := a2.lookup(7); n != 0 {
		t.Fatalf("lookup with the tier down: %d", n)
	}
	s2 := startServer(t, func(c *ServerConfig) { c.Dir = filepath.Dir(sock); c.Socket = sock })
	waitFor(t, "re-attached", func() bool { return a2.Connected() && a2.Epoch() == s2.Epoch() })
	if n := a2.lookup(7); n != 0 {
		t.Fatalf("a new node process holds %d old blocks", n)
	}
	a2.write(t, 8, 1)
	waitFor(t, "stored again", func() bool { return a2.Stats().WritesOK.Load() == 1 })
	if n := a2.lookup(8); n != 1 {
		t.Fatal("not served after the node's restart")
	}
}

// A pod's writes past its share evict its own blocks, never another pod's.
func TestPodShare(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.PodShare = 0.125 }) // 16 of 128 slots: 8 blocks of 2 ranks
	a := newTestClient(t, s.Socket(), "pod-a")
	b := newTestClient(t, s.Socket(), "pod-b")
	for i := range 4 {
		b.write(t, 1000+i, i)
	}
	for i := range 30 {
		a.write(t, i, i%8)
	}
	waitFor(t, "writes", func() bool { return a.Stats().WritesOK.Load() == 30 && b.Stats().WritesOK.Load() == 4 })
	if u := s.OwnerUsed("pod-a"); u != s.ShareSlots() {
		t.Fatalf("pod-a holds %d slots, its share is %d", u, s.ShareSlots())
	}
	if n := a.lookup(1000, 1001, 1002, 1003); n != 4 {
		t.Fatalf("pod-a's writes evicted pod-b's blocks: %d of 4 left", n)
	}
	if n := a.lookup(29, 28, 27); n != 3 {
		t.Fatalf("pod-a's newest blocks: %d of 3", n)
	}
	if n := a.lookup(0); n != 0 {
		t.Fatal("pod-a's oldest block outlived its share")
	}
	if st := s.Index(); st.EvictedShare == 0 {
		t.Fatalf("no eviction counted: %+v", st)
	}
}

// Concurrent writers, readers and lookups of several pods (run with -race):
// every fetched block has its own bytes, and the index stays consistent.
func TestConcurrent(t *testing.T) {
	s := startServer(t, nil)
	var wg sync.WaitGroup
	for p := range 3 {
		c := newTestClient(t, s.Socket(), fmt.Sprintf("pod-%d", p))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				d := (i*7 + p) % 50
				c.write(t, d, i%4)
				if i%3 == 0 {
					c.fetch(t, d, (d+1)%50)
				}
			}
		}()
	}
	wg.Wait()
}

// The node process's metrics name its traffic.
func TestServerMetrics(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{"ringside_node_server_put_stored_values_total 2", "ringside_node_server_connections 1", "ringside_node_server_present_slots 2"} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	rec = httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
	if rec.Code != 200 {
		t.Fatalf("healthz: %d", rec.Code)
	}
}

// A sidecar whose slots are larger than the node's does not attach (its
// blocks might not fit): its lookups miss and its writes are refused.
func TestSlotsTooLarge(t *testing.T) {
	s := startServer(t, nil)
	c, err := NewClient(ClientConfig{Socket: s.Socket(), Pod: "big"}, testPool(t, 4*2*testSlot), 2*testSlot, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.WaitConnected(300 * time.Millisecond) {
		t.Fatal("a sidecar with larger slots attached")
	}
	ch := make(chan int, 1)
	c.Lookup(machine.L2Lookup{NS: testNS, Digests: digest(1)}, func(n int) { ch <- n })
	if <-ch != 0 {
		t.Fatal("a lookup of a tier not attached found blocks")
	}
	refused := make(chan bool, 1)
	c.Write(machine.L2Write{NS: testNS, Digest: digest(1), Length: testSlot, PoolOffsets: []uint64{0}}, func(r bool) { refused <- r })
	if !<-refused {
		t.Fatal("a write to a tier not attached was taken")
	}
}

// One node process per directory: a second one refuses to start, naming
// the lock, and leaves the first serving.
func TestOneNodePerDir(t *testing.T) {
	s := startServer(t, nil)
	_, err := NewServer(ServerConfig{Dir: filepath.Dir(s.Socket()), PoolBytes: 8 * (testSlot + SlotHeadroom), SlotBytes: testSlot}, testLog(t))
	if err == nil || !strings.Contains(err.Error(), "node.lock") {
		t.Fatalf("a second node process on the directory: %v", err)
	}
	a := newTestClient(t, s.Socket(), "pod-a")
	if n := a.lookup(1); n != 0 {
		t.Fatal("lookup")
	}
}
