package node

import (
	"bytes"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// stall makes the node's next Fetch stop after pinning its value, before
// its copy into the pod's pool, until release is closed; entered is
// closed when it has stopped.
func stall(s *Server) (entered, release chan struct{}) {
	entered, release = make(chan struct{}), make(chan struct{})
	var once sync.Once
	f := func() {
		once.Do(func() {
			close(entered)
			<-release
		})
	}
	s.beforeCopy.Store(&f)
	return entered, release
}

// startFetch starts a fetch of block i into slots 8 and 9 and returns
// where its results come.
func (c *testClient) startFetch(i int) <-chan []machine.L2FetchResult {
	f := machine.L2Fetch{ID: 1, NS: testNS, Length: testSlot, MaxLength: testSlot,
		Blocks: []machine.L2FetchBlock{{Digest: digest(i), PoolOffsets: []uint64{8 * testSlot, 9 * testSlot}}}}
	ch := make(chan []machine.L2FetchResult, 1)
	c.Fetch(f, func(r []machine.L2FetchResult) { ch <- r })
	return ch
}

// landed reports whether slots 8 and 9 hold block i's bytes.
func (c *testClient) landed(i int) bool {
	want := &testClient{pool: make([]byte, 2*testSlot)}
	want.fill(i, 0)
	return bytes.Equal(c.pool[8*testSlot:10*testSlot], want.pool)
}

// A fetch whose reply is late is not over at its deadline: the node may
// still be copying into the slots, so the client reports it only once the
// node has answered (here: it let go after the deadline, and the block
// landed whole), and reconnects after.
func TestFetchWaitsForTheNodesCopy(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	b := newTestClientIO(t, s.Socket(), "pod-b", 50*time.Millisecond)
	entered, release := stall(s)
	res := b.startFetch(1)
	<-entered
	waitFor(t, "the fetch's deadline", func() bool { return b.Stats().Timeouts.Load() == 1 })
	if b.Connected() {
		t.Fatal("still attached after a fetch timed out")
	}
	select {
	case r := <-res:
		t.Fatalf("the fetch ended (%+v) while the node was about to copy into its slots", r)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	r := <-res
	if !r[0].OK || !b.landed(1) {
		t.Fatalf("the late fetch: %+v, bytes landed %v", r[0], b.landed(1))
	}
	if !b.WaitConnected(5 * time.Second) {
		t.Fatal("no reconnect after the late fetch")
	}
	clear(b.pool[8*testSlot : 10*testSlot])
	if r := <-b.startFetch(1); !r[0].OK || !b.landed(1) {
		t.Fatalf("a fetch after the reconnect: %+v", r[0])
	}
}

// The node process stopping (SIGTERM: Shutdown) mid-fetch does not end a
// connection before its copy is over: the sidecar takes the connection's
// end to mean the node no longer writes its pool.
func TestFetchShutdownMidCopy(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	entered, release := stall(s)
	res := a.startFetch(1)
	<-entered
	s.Shutdown()
	select {
	case r := <-res:
		t.Fatalf("the fetch ended (%+v) while the node was about to copy into its slots", r)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	r := <-res
	if r[0].OK && !a.landed(1) {
		t.Fatal("a fetch reported whole with other bytes")
	}
	waitFor(t, "detached", func() bool { return !a.Connected() })
}

// The node never allocates a page of a pod's pool (it would be charged to
// the node's memory): a fetch into pages not in memory is refused, and
// they stay out of memory; once the pod has populated them it lands.
func TestFetchNotResident(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	pool := testPool(t, 8*testSlot) // not populated
	r := rawDialPool(t, s.Socket(), "pod-raw", pool)
	r.register(testNS)
	if st, _ := r.get(testNS, digest(1), 0, 2); st != wire.NotResident {
		t.Fatalf("a fetch into pages not in memory: %v", st)
	}
	if res, _, err := shm.Resident(pool.Bytes()[2*testSlot:3*testSlot], nil); err != nil || res {
		t.Fatalf("the refused fetch's pages: resident %v (%v)", res, err)
	}
	if s.Stats().FetchNotResident.Load() != 1 {
		t.Fatalf("not-resident count %d", s.Stats().FetchNotResident.Load())
	}
	if err := shm.Populate(pool.Bytes()); err != nil {
		t.Fatal(err)
	}
	if st, v := r.get(testNS, digest(1), 0, 2); st != wire.OK || len(v) != l2.HeaderSize+testSlot {
		t.Fatalf("after populating: %v, %d bytes", st, len(v))
	}
}

// Hostile pools: a descriptor that is not a file in memory (a pipe, a file
// on a disk) is refused at the attach; two descriptors end the attach; a
// sidecar that passed none cannot fetch; a pool truncated under the node's
// copy faults that copy, which the node survives (Fault), releasing the
// value and serving everyone else.
func TestHostilePool(t *testing.T) {
	s := startServer(t, nil)
	good := newTestClient(t, s.Socket(), "pod-good")
	good.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return good.Stats().WritesOK.Load() == 1 })

	hello := func(fds ...int) (wire.HelloReply, bool) {
		t.Helper()
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var oob []byte
		if len(fds) > 0 {
			oob = syscall.UnixRights(fds...)
		}
		if _, _, err := c.WriteMsgUnix(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "pod-x"}.Append), oob, nil); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, wire.MaxMessage)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, got, _, err := sys.ReadFDs(c, buf, 1)
		sys.CloseFDs(got)
		if err != nil || n == 0 {
			return wire.HelloReply{}, false
		}
		_, body, err := wire.DecodeHeader(buf[:n])
		if err != nil {
			t.Fatal(err)
		}
		rep, err := wire.DecodeHelloReply(body)
		if err != nil {
			t.Fatal(err)
		}
		return rep, true
	}
	var p [2]int
	if err := unix.Pipe(p[:]); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	if rep, ok := hello(p[0]); !ok || rep.Status != wire.Malformed {
		t.Fatalf("a pipe as the pool: %+v (answered %v)", rep, ok)
	}
	disk, err := os.CreateTemp("", "rsnode-pool")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(disk.Name())
	defer disk.Close()
	disk.Truncate(8 * testSlot)
	if !shm.OnMemoryFS(int(disk.Fd())) {
		if rep, ok := hello(int(disk.Fd())); !ok || rep.Status != wire.Malformed {
			t.Fatalf("a file on a disk as the pool: %+v (answered %v)", rep, ok)
		}
	} else {
		t.Logf("%s is a memory file system here: the disk case is not checked", os.TempDir())
	}
	pool := testPool(t, 8*testSlot)
	if rep, ok := hello(pool.FD(), pool.FD()); ok && rep.Status != wire.Malformed {
		t.Fatalf("a hello with two descriptors: %+v", rep)
	}
	if rep, ok := hello(); !ok || rep.Status != wire.OK {
		t.Fatalf("a hello without a pool: %+v", rep)
	}
	// Without a pool a Fetch is malformed.
	nc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nr := &rawConn{t: t, sock: nc}
	nr.send(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "pod-nopool"}.Append))
	nr.recv()
	nr.register(testNS)
	if rep := nr.fetch(wire.Fetch{FP: testNS.FP, Items: []wire.FetchItem{{Digest: [32]byte(append(digest(1), make([]byte, 16)...)), Max: testSlot}}}); rep.Status != wire.Malformed {
		t.Fatalf("a fetch without a pool: %+v", rep)
	}

	// A pool in /dev/shm (unsealed), truncated once the node has checked
	// it and before it copies.
	f, err := os.CreateTemp("/dev/shm", "rstest-pool")
	if err != nil {
		t.Skip("no /dev/shm: ", err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	f.Truncate(8 * testSlot)
	m, err := shm.Open(f.Name(), 8*testSlot)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := shm.Populate(m.Bytes()); err != nil {
		t.Fatal(err)
	}
	r := rawDialPool(t, s.Socket(), "pod-trunc", m)
	r.register(testNS)
	trunc := func() { f.Truncate(0) }
	s.beforeCopy.Store(&trunc)
	if st, _ := r.get(testNS, digest(1), 0, 2); st != wire.Fault {
		t.Fatalf("a fetch into a pool truncated under the copy: %v", st)
	}
	s.beforeCopy.Store(nil)
	if s.Stats().FetchFaults.Load() != 1 {
		t.Fatalf("fault count %d", s.Stats().FetchFaults.Load())
	}
	if bad := s.checkIndex(); len(bad) > 0 {
		t.Fatalf("index after the fault: %v", bad)
	}
	if got := good.fetch(t, 1); !got[0] {
		t.Fatal("the good sidecar's block is gone after another pod's fault")
	}
}

// Close does not wait for ever on a node stopped in the middle of a fetch:
// past the fetch's deadline it gives up, and the fetch ends as a miss.
func TestCloseGivesUpOnAStalledNode(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	b := newTestClientIO(t, s.Socket(), "pod-b", 50*time.Millisecond)
	entered, release := stall(s)
	defer close(release)
	res := b.startFetch(1)
	<-entered
	closed := make(chan struct{})
	go func() { b.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close waited on the stalled node")
	}
	if r := <-res; r[0].OK {
		t.Fatal("a fetch the node never copied for reported whole")
	}
}

// A slot whose pages left memory after the client populated them (swapped
// out; here punched out) makes one fetch into it miss, not every later one:
// the client populates it again.
func TestFetchRepopulates(t *testing.T) {
	s := startServer(t, nil)
	a := newTestClient(t, s.Socket(), "pod-a")
	a.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return a.Stats().WritesOK.Load() == 1 })
	b := newTestClientIO(t, s.Socket(), "pod-b", 2*time.Second)
	if r := <-b.startFetch(1); !r[0].OK || !b.landed(1) {
		t.Fatalf("first fetch: %+v", r[0])
	}
	if err := unix.Madvise(b.pool[8*testSlot:10*testSlot], unix.MADV_REMOVE); err != nil {
		t.Fatal(err)
	}
	if r := <-b.startFetch(1); r[0].OK {
		t.Fatal("a fetch into pages out of memory reported whole")
	}
	if s.Stats().FetchNotResident.Load() == 0 {
		t.Fatal("the node did not refuse the pages out of memory")
	}
	if r := <-b.startFetch(1); !r[0].OK || !b.landed(1) {
		t.Fatalf("the fetch after: %+v", r[0])
	}
}
