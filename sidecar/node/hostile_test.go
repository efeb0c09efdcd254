package node

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// rawConn is a hand-driven sidecar: it speaks the wire byte by byte, as a
// broken or hostile one could.
type rawConn struct {
	t    *testing.T
	sock *net.UnixConn
	win  *shm.Mapping
	pool *shm.Mapping // the pod's pool, passed with the Hello: 8 slots, resident
	rep  wire.HelloReply
	id   uint64
}

func rawDial(t *testing.T, sock, pod string) *rawConn {
	t.Helper()
	pool := testPool(t, 8*testSlot)
	if err := shm.Populate(pool.Bytes()); err != nil {
		t.Fatal(err)
	}
	return rawDialPool(t, sock, pod, pool)
}

// rawDialPool attaches with pool's descriptor as the pod's pool.
func rawDialPool(t *testing.T, sock, pod string, pool *shm.Mapping) *rawConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	r := &rawConn{t: t, sock: c, pool: pool}
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := c.WriteMsgUnix(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: pod}.Append), syscall.UnixRights(pool.FD()), nil); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, wire.MaxMessage)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, fds, _, err := sys.ReadFDs(c, buf, 4)
	if err != nil {
		t.Fatal(err)
	}
	_, body, err := wire.DecodeHeader(buf[:n])
	if err != nil {
		t.Fatal(err)
	}
	if r.rep, err = wire.DecodeHelloReply(body); err != nil || r.rep.Status != wire.OK {
		t.Fatalf("hello: %+v %v", r.rep, err)
	}
	// One descriptor: the window, sealed, the size of its slots, never
	// the pool.
	if len(fds) != 1 {
		t.Fatalf("%d descriptors in the hello reply", len(fds))
	}
	if !shm.SealedAgainstResize(fds[0]) {
		t.Fatal("the window can be resized by the sidecar")
	}
	if r.win, err = shm.OpenFD(fds[0], "window", 1); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.win.Close() })
	if uint64(r.win.Len()) != uint64(r.rep.WindowSlots)*r.rep.SlotStride || uint64(r.win.Len()) >= r.rep.PoolBytes {
		t.Fatalf("window of %d bytes for %d slots (pool %d)", r.win.Len(), r.rep.WindowSlots, r.rep.PoolBytes)
	}
	return r
}

func (r *rawConn) send(b []byte) error {
	r.sock.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, err := r.sock.Write(b)
	return err
}

// recv reads one reply's body (nil: the connection ended).
func (r *rawConn) recv() (wire.Header, []byte) {
	buf := make([]byte, wire.MaxMessage)
	r.sock.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := r.sock.Read(buf)
	if err != nil || n == 0 {
		return wire.Header{}, nil
	}
	h, body, err := wire.DecodeHeader(buf[:n])
	if err != nil {
		r.t.Fatal(err)
	}
	return h, body
}

func (r *rawConn) req(t wire.Type, body func([]byte) []byte) (wire.Header, []byte) {
	r.id++
	if err := r.send(wire.Message(t, r.id, body)); err != nil {
		return wire.Header{}, nil
	}
	return r.recv()
}

func (r *rawConn) status(t wire.Type, body func([]byte) []byte) wire.StatusReply {
	h, b := r.req(t, body)
	if b == nil {
		r.t.Fatal("connection ended")
	}
	if h.ID != r.id || h.Type != t|wire.ReplyBit {
		r.t.Fatalf("reply %+v to request %d of type %v", h, r.id, t)
	}
	s, err := wire.DecodeStatusReply(b)
	if err != nil {
		r.t.Fatal(err)
	}
	return s
}

func (r *rawConn) items(t wire.Type, m wire.Items) wire.ItemsReply {
	_, b := r.req(t, m.Append)
	if b == nil {
		r.t.Fatal("connection ended")
	}
	s, err := wire.DecodeItemsReply(b)
	if err != nil {
		r.t.Fatal(err)
	}
	return s
}

func (r *rawConn) register(ns machine.L2Namespace) {
	if s := r.status(wire.TypeRegister, wireNS(ns).Append); s.Status != wire.OK {
		r.t.Fatalf("register: %v", s.Status)
	}
}

// putValue writes a value into window slot s and asks the node to take it.
func (r *rawConn) putValue(ns machine.L2Namespace, d []byte, rank int, s uint32, payload []byte, mangle func([]byte)) wire.Status {
	w := r.win.Bytes()[uint64(s)*r.rep.SlotStride:]
	n := l2.PutValue(w, ns, d, rank, payload)
	if mangle != nil {
		mangle(w[:n])
	}
	it := wire.Item{Rank: uint16(rank), Slot: s, Length: uint64(n)}
	copy(it.Digest[:], d)
	rep := r.items(wire.TypePut, wire.Items{FP: ns.FP, Items: []wire.Item{it}})
	if rep.Status != wire.OK {
		return rep.Status
	}
	return rep.Items[0].Status
}

func (r *rawConn) fetch(m wire.Fetch) wire.FetchReply {
	_, b := r.req(wire.TypeFetch, m.Append)
	if b == nil {
		r.t.Fatal("connection ended")
	}
	s, err := wire.DecodeFetchReply(b)
	if err != nil {
		r.t.Fatal(err)
	}
	return s
}

// get fetches a value into pod-pool slot s and returns it as the value the
// node holds: the header the reply carries, the payload the node wrote,
// with the checksum it computed checked against the header's.
func (r *rawConn) get(ns machine.L2Namespace, d []byte, rank int, s uint32) (wire.Status, []byte) {
	off := uint64(s) * testSlot
	it := wire.FetchItem{Rank: uint16(rank), Offset: off, Max: testSlot}
	copy(it.Digest[:], d)
	rep := r.fetch(wire.Fetch{FP: ns.FP, Items: []wire.FetchItem{it}})
	if rep.Status != wire.OK {
		return rep.Status, nil
	}
	ir := rep.Items[0]
	if ir.Status != wire.OK {
		return ir.Status, nil
	}
	v := append(ir.Header[:], r.pool.Bytes()[off:off+ir.Length]...)
	if _, crc, why := l2.CheckHeader(v, ns, d, rank, 0, testSlot); why != "" || crc != ir.CRC {
		r.t.Fatalf("a fetch's reply: %q, checksum %#x against the header's %#x", why, ir.CRC, crc)
	}
	return ir.Status, v
}

var otherNS = machine.L2NamespaceFor("llama", "bf16/16/HND", "tenant-b-salt", 16, 2)

// Reading or writing a namespace not registered on the connection is
// refused, even one another connection registered; registering one
// fingerprint with other fields is a mismatch.
func TestHostileUnregisteredNamespace(t *testing.T) {
	s := startServer(t, nil)
	owner := rawDial(t, s.Socket(), "tenant-b")
	owner.register(otherNS)
	payload := make([]byte, testSlot)
	payload[7] = 42
	if st := owner.putValue(otherNS, digest(1), 0, 0, payload, nil); st != wire.OK {
		t.Fatalf("put: %v", st)
	}
	thief := rawDial(t, s.Socket(), "tenant-a")
	if st, _ := thief.get(otherNS, digest(1), 0, 0); st != wire.NotRegistered {
		t.Fatalf("a get of another connection's namespace: %v", st)
	}
	lk := wire.Lookup{FP: otherNS.FP, Width: 16, Digests: digest(1)}
	if st := thief.status(wire.TypeLookup, lk.Append); st.Status != wire.NotRegistered || st.Value != 0 {
		t.Fatalf("a lookup of another connection's namespace: %+v", st)
	}
	if st := thief.putValue(otherNS, digest(2), 0, 0, payload, nil); st != wire.NotRegistered {
		t.Fatalf("a put into another connection's namespace: %v", st)
	}
	bad := wireNS(otherNS)
	bad.World = 4
	owner.status(wire.TypeRegister, wireNS(testNS).Append)
	if st := owner.status(wire.TypeRegister, bad.Append); st.Status != wire.Mismatch {
		t.Fatalf("a second registration with another world: %v", st.Status)
	}
	// The owner still reads its block.
	if st, v := owner.get(otherNS, digest(1), 0, 1); st != wire.OK {
		t.Fatalf("owner's get: %v", st)
	} else if p, why := l2.CheckValue(v, otherNS, digest(1), 0, testSlot, testSlot); why != "" || p[7] != 42 {
		t.Fatalf("owner's value: %q", why)
	}
	if s.Stats().NotRegistered.Load() != 3 {
		t.Fatalf("refusals counted: %d", s.Stats().NotRegistered.Load())
	}
}

// Values that are not what their Put says are rejected, counted and never
// served: a wrong checksum, a header naming another namespace, digest or
// rank, a length past the slot; and a value changed in the window while the
// node copies it is stored only as the node checked it.
func TestHostileBadValues(t *testing.T) {
	s := startServer(t, nil)
	r := rawDial(t, s.Socket(), "pod-x")
	r.register(testNS)
	r.register(otherNS)
	p := make([]byte, testSlot)
	for name, tc := range map[string]struct {
		ns     machine.L2Namespace
		d      []byte
		rank   int
		mangle func([]byte)
		want   wire.Status
	}{
		"checksum":        {testNS, digest(10), 0, func(v []byte) { v[l2.HeaderSize+5] ^= 1 }, wire.Rejected},
		"header checksum": {testNS, digest(11), 0, func(v []byte) { v[20] ^= 1 }, wire.Rejected},
		"other namespace": {otherNS, digest(12), 0, nil, wire.Rejected}, // a value of otherNS put under testNS below
		"other rank":      {testNS, digest(13), 1, nil, wire.Rejected},  // a rank 1 value put as rank 0 below
	} {
		t.Run(name, func(t *testing.T) {
			w := r.win.Bytes()
			n := l2.PutValue(w, tc.ns, tc.d, tc.rank, p)
			if tc.mangle != nil {
				tc.mangle(w[:n])
			}
			it := wire.Item{Rank: 0, Slot: 0, Length: uint64(n)}
			copy(it.Digest[:], tc.d)
			rep := r.items(wire.TypePut, wire.Items{FP: testNS.FP, Items: []wire.Item{it}})
			if rep.Status != wire.OK || rep.Items[0].Status != tc.want {
				t.Fatalf("put: %+v", rep)
			}
			if st, _ := r.get(testNS, tc.d, 0, 1); st != wire.NotFound {
				t.Fatalf("a rejected value is served: %v", st)
			}
		})
	}
	// Lengths past the slot, or short of a header: malformed, whole request.
	for _, n := range []uint64{0, l2.HeaderSize, l2.HeaderSize + testSlot + 1, 1 << 40} {
		it := wire.Item{Slot: 0, Length: n}
		copy(it.Digest[:], digest(20))
		if rep := r.items(wire.TypePut, wire.Items{FP: testNS.FP, Items: []wire.Item{it}}); rep.Status != wire.Malformed {
			t.Fatalf("length %d: %+v", n, rep)
		}
	}
	// A window slot past the window, a rank past the world, digest padding.
	for name, it := range map[string]wire.Item{"slot": {Slot: r.rep.WindowSlots, Length: l2.HeaderSize + 1}, "rank": {Rank: 2, Length: l2.HeaderSize + 1},
		"padding": {Digest: [32]byte{31: 1}, Length: l2.HeaderSize + 1}} {
		if rep := r.items(wire.TypePut, wire.Items{FP: testNS.FP, Items: []wire.Item{it}}); rep.Status != wire.Malformed {
			t.Fatalf("put, %s: %+v", name, rep)
		}
	}
	// A fetch past the pod's pool (or wrapping around), a rank past the
	// world, digest padding: the whole request is malformed.
	size := uint64(r.pool.Len())
	for name, it := range map[string]wire.FetchItem{"past the pool": {Offset: size - testSlot + 1, Max: testSlot}, "larger than the pool": {Max: size + 1},
		"wrapping": {Offset: 1<<64 - testSlot, Max: 2 * testSlot}, "rank": {Rank: 2, Max: testSlot}, "padding": {Digest: [32]byte{31: 1}, Max: testSlot}} {
		if rep := r.fetch(wire.Fetch{FP: testNS.FP, Items: []wire.FetchItem{it}}); rep.Status != wire.Malformed {
			t.Fatalf("fetch, %s: %+v", name, rep)
		}
	}
	// A sidecar scribbling on its window while the node copies it: whatever
	// the node stores is a value whose checksum it verified on its copy.
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		w := r.win.Bytes()[l2.HeaderSize : l2.HeaderSize+testSlot]
		for i := 0; !stop.Load(); i++ {
			w[i%testSlot]++
		}
	}()
	stored := 0
	for i := 0; i < 200; i++ {
		if st := r.putValue(testNS, digest(100+i), 0, 0, p, nil); st == wire.OK {
			stored++
		}
	}
	stop.Store(true)
	<-done
	for i := 0; i < 200; i++ {
		st, v := r.get(testNS, digest(100+i), 0, 1)
		if st != wire.OK {
			continue
		}
		if _, why := l2.CheckValue(v, testNS, digest(100+i), 0, testSlot, testSlot); why != "" {
			t.Fatalf("block %d: the node holds a value that fails its check: %s", i, why)
		}
	}
	t.Logf("%d of 200 puts raced by the scribbler were stored (each verified), %d rejected", stored, s.Stats().Rejected.Load())
}

// Malformed requests are answered and the connection goes on; a bad header
// (or a datagram over 64 KiB) ends it; neither disturbs another sidecar.
func TestHostileMalformed(t *testing.T) {
	s := startServer(t, nil)
	good := newTestClient(t, s.Socket(), "pod-good")
	good.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return good.Stats().WritesOK.Load() == 1 })
	r := rawDial(t, s.Socket(), "pod-bad")
	for _, body := range [][]byte{nil, {1, 2, 3}, make([]byte, 31), make([]byte, 33)} {
		if st := r.status(wire.TypeRegister, func(b []byte) []byte { return append(b, body...) }); st.Status != wire.Malformed {
			t.Fatalf("register %x: %v", body, st.Status)
		}
	}
	if st := r.status(wire.Type(0x42), nil); st.Status != wire.Malformed {
		t.Fatalf("unknown type: %v", st.Status)
	}
	if st := r.status(wire.TypeHello, wire.Hello{Pod: "again"}.Append); st.Status != wire.Malformed {
		t.Fatalf("a second hello: %v", st.Status)
	}
	r.register(testNS) // still served
	// A lookup of more values than the bound (digests × world) is refused
	// whole, not worked through.
	wide := machine.L2NamespaceFor("llama", "bf16/16/HND", "", 16, 64)
	r.register(wide)
	lk := wire.Lookup{FP: wide.FP, Width: 16, Digests: make([]byte, 16*(wire.MaxLookupKeys/64+1))}
	if st := r.status(wire.TypeLookup, lk.Append); st.Status != wire.Malformed {
		t.Fatalf("a lookup of %d values: %v", wire.MaxLookupKeys+64, st.Status)
	}
	// A bad magic ends the connection.
	msg := wire.Message(wire.TypeLookup, 9, nil)
	binary.LittleEndian.PutUint32(msg, 0xdeadbeef)
	r.send(msg)
	if _, b := r.recv(); b != nil {
		t.Fatal("a message with a bad magic was answered")
	}
	// A datagram over the bound ends another.
	r2 := rawDial(t, s.Socket(), "pod-bad")
	r2.send(append(wire.Message(wire.TypeLookup, 1, nil), make([]byte, wire.MaxMessage)...))
	if _, b := r2.recv(); b != nil {
		t.Fatal("an oversized message was answered")
	}
	if n := good.lookup(1); n != 1 {
		t.Fatal("the good sidecar lost its block")
	}
	waitFor(t, "dropped", func() bool { return s.Stats().Dropped.Load() == 2 })
}

// A sidecar that floods requests and never reads a reply is dropped within
// the node's I/O timeout; another sidecar's requests are answered
// meanwhile, promptly.
func TestHostileStopsReading(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.IOTimeout = 300 * time.Millisecond })
	good := newTestClient(t, s.Socket(), "pod-good")
	good.write(t, 1, 0)
	waitFor(t, "stored", func() bool { return good.Stats().WritesOK.Load() == 1 })
	r := rawDial(t, s.Socket(), "pod-flood")
	r.register(testNS)
	lk := wire.Message(wire.TypeLookup, 5, wire.Lookup{FP: testNS.FP, Width: 16, Digests: make([]byte, 16*wire.MaxLookup)}.Append)
	flooded := make(chan int)
	go func() {
		n := 0
		r.sock.SetWriteDeadline(time.Now().Add(10 * time.Second))
		for {
			if _, err := r.sock.Write(lk); err != nil {
				break
			}
			n++
		}
		flooded <- n
	}()
	var worst time.Duration
	for i := 0; i < 50; i++ {
		t0 := time.Now()
		if n := good.lookup(1); n != 1 {
			t.Fatalf("lookup %d of the good sidecar: %d", i, n)
		}
		worst = max(worst, time.Since(t0))
		time.Sleep(5 * time.Millisecond)
	}
	n := <-flooded
	waitFor(t, "the flooder dropped", func() bool { return s.Stats().Dropped.Load() == 1 })
	// Every lookup of the good sidecar found its block, so each was
	// answered within its 1 s deadline; the time is a figure.
	t.Logf("the flooder sent %d requests before it was dropped; the good sidecar's slowest lookup took %v", n, worst)
}

// A connection that never says Hello is closed after the I/O timeout; the
// connections past --max-pods are refused with status Limit.
func TestHostileAttach(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.IOTimeout = 200 * time.Millisecond; c.MaxPods = 2 })
	mute, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	mute.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, _ := mute.Read(make([]byte, 64)); n != 0 {
		t.Fatal("a connection without a hello was answered")
	}
	rawDial(t, s.Socket(), "a")
	rawDial(t, s.Socket(), "b")
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "c"}.Append))
	buf := make([]byte, 256)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, fds, _, err := sys.ReadFDs(c, buf, 1)
	if err != nil || len(fds) != 0 {
		t.Fatalf("third attach: %v, %d descriptors", err, len(fds))
	}
	_, body, _ := wire.DecodeHeader(buf[:n])
	if rep, _ := wire.DecodeHelloReply(body); rep.Status != wire.Limit {
		t.Fatalf("third attach: %v", rep.Status)
	}
	// Another version is refused with status BadVersion.
	v, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	m := wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "v"}.Append)
	m[4] = 9
	v.Write(m)
	v.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, _ = v.Read(buf)
	_, body, _ = wire.DecodeHeader(buf[:n])
	if rep, _ := wire.DecodeHelloReply(body); rep.Status != wire.BadVersion {
		t.Fatalf("version 9: %v", rep.Status)
	}
}

// dialHello connects and says Hello as pod, returning the reply's status.
func dialHello(t *testing.T, sock, pod string) (*net.UnixConn, wire.Status) {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: pod}.Append)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256)
	n, fds, _, err := sys.ReadFDs(c, buf, 1)
	sys.CloseFDs(fds)
	if err != nil {
		t.Fatal(err)
	}
	_, body, err := wire.DecodeHeader(buf[:n])
	if err != nil {
		t.Fatal(err)
	}
	rep, err := wire.DecodeHelloReply(body)
	if err != nil {
		t.Fatal(err)
	}
	return c, rep.Status
}

// TestPodIdentityNetNS: under --pod-identity netns (the default), a pod is
// its network namespace, whatever names its connections declare: this
// process's connections are one pod. Past --conns-per-pod its attaches
// are refused, a connection whose peer closed does not hold a place, and
// every block its connections write is charged to the one share, so that
// renaming buys a sidecar nothing. Pods in separate namespaces: the
// reliability suite's TestNodeTierNamespacesPodIdentity.
func TestPodIdentityNetNS(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.PodIdentity = IdentityNetNS; c.ConnsPerPod = 2; c.MaxPods = 8 })
	a := rawDial(t, s.Socket(), "pod-a")
	b := rawDial(t, s.Socket(), "pod-b")
	cookie, err := sys.NetNSCookie(a.sock)
	if err != nil {
		t.Fatal(err)
	}
	id := NetNSIdentity(cookie)
	if st := s.Stats().AttachRenamed.Load(); st != 1 {
		t.Fatalf("attaches under another name than the pod's first: %d, want 1", st)
	}
	for _, name := range []string{"pod-c", "pod-a"} {
		if _, st := dialHello(t, s.Socket(), name); st != wire.Limit {
			t.Fatalf("a third connection of the pod, declaring %s: %v, want limit", name, st)
		}
	}
	if got := s.Stats().AttachPodLimit.Load(); got != 2 {
		t.Fatalf("attaches refused for the pod's limit: %d, want 2", got)
	}
	// Blocks written under both names are the pod's.
	a.register(testNS)
	b.register(testNS)
	for i, r := range []*rawConn{a, b} {
		for k := 0; k < 3; k++ {
			if st := r.putValue(testNS, digest(10*i+k), 0, uint32(k), make([]byte, testSlot), nil); st != wire.OK {
				t.Fatalf("put: %v", st)
			}
		}
	}
	if u, ua, ub := s.OwnerUsed(id), s.OwnerUsed("pod-a"), s.OwnerUsed("pod-b"); u != 6 || ua != 0 || ub != 0 {
		t.Fatalf("charges: the pod %d (want 6), by name a %d, b %d (want 0)", u, ua, ub)
	}
	// A connection closed (a sidecar restarted) frees its place at once,
	// before the node's reader has seen the end.
	b.sock.Close()
	c, st := dialHello(t, s.Socket(), "pod-a")
	if st != wire.OK {
		t.Fatalf("an attach after one of the pod's connections closed: %v", st)
	}
	c.Close()
	waitFor(t, "the closed connections detached", func() bool { return s.Conns() == 1 })
}

// TestPodLimitTold: a sidecar refused for its pod's --conns-per-pod says
// why in its state (what /debug/state shows an operator), and attaches
// once its pod's other connection has gone.
func TestPodLimitTold(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.PodIdentity = IdentityNetNS; c.ConnsPerPod = 1 })
	first := newTestClient(t, s.Socket(), "pod-a")
	c, err := NewClient(ClientConfig{Socket: s.Socket(), Pod: "pod-b", LookupTimeout: time.Second, IOTimeout: time.Second}, testPool(t, 32*testSlot), testSlot, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitFor(t, "the refusal told", func() bool { return strings.Contains(c.LastError(), "--conns-per-pod") })
	if c.Connected() || !strings.Contains(c.LastError(), "hostNetwork") {
		t.Fatalf("connected %v, last error %q", c.Connected(), c.LastError())
	}
	first.Close()
	if !c.WaitConnected(10 * time.Second) {
		t.Fatalf("not attached after the pod's other connection closed: %q", c.LastError())
	}
	if c.LastError() != "" {
		t.Fatalf("attached, last error %q", c.LastError())
	}
}

// lineCount counts the lines written to it, safely from many goroutines.
type lineCount struct {
	mu    sync.Mutex
	lines int
}

func (w *lineCount) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.lines += strings.Count(string(p), "\n")
	w.mu.Unlock()
	return len(p), nil
}

// TestConnLogSampled: a sidecar that attaches again and again, refused,
// cannot flood the node's log: past a burst of 50 lines a second the
// node logs one refusal in 1,000, and counts every one.
func TestConnLogSampled(t *testing.T) {
	w := &lineCount{}
	log := zerolog.New(w)
	srv, err := NewServer(ServerConfig{Dir: t.TempDir(), PoolBytes: 16 * (testSlot + SlotHeadroom), SlotBytes: testSlot}, log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	const n = 2000
	t0 := time.Now()
	for i := 0; i < n; i++ {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: srv.Socket(), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		m := wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "flood"}.Append)
		m[4] = 9 // another version: refused
		c.Write(m)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		c.Read(make([]byte, 256))
		c.Close()
	}
	seconds := int(time.Since(t0)/time.Second) + 1
	waitFor(t, "every refusal counted", func() bool { return srv.Stats().AttachRefused.Load() == n })
	w.mu.Lock()
	lines := w.lines
	w.mu.Unlock()
	t.Logf("%d refusals over at most %d s: %d log lines", n, seconds, lines)
	// The burst in each second the flood lasted, one in 1,000 past it, and
	// the server's own start line.
	if most := 50*seconds + n/1000 + 2; lines > most || lines < 50 {
		t.Fatalf("%d refusals over %d s wrote %d log lines, want 50 to %d", n, seconds, lines, most)
	}
}

// TestPendingBounded: connections that say nothing hold a goroutine and a
// buffer each until --io-timeout, so one pod may have only --conns-per-pod
// of them at once: the rest are closed as they arrive, and once the silent
// ones are gone the pod attaches.
func TestPendingBounded(t *testing.T) {
	s := startServer(t, func(c *ServerConfig) { c.PodIdentity = IdentityNetNS; c.ConnsPerPod = 2; c.IOTimeout = time.Minute })
	var mute []*net.UnixConn
	for i := 0; i < 40; i++ {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		mute = append(mute, c)
	}
	waitFor(t, "38 of 40 silent connections closed at once", func() bool { return s.Stats().PendingRefused.Load() == 38 })
	open := 0
	for _, c := range mute {
		if !sys.PeerClosed(c) {
			open++
		}
	}
	if open != 2 {
		t.Fatalf("%d silent connections kept open, want 2 (--conns-per-pod)", open)
	}
	// A sidecar of the same pod meanwhile: closed unanswered.
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "pod-a"}.Append))
	if n, err := c.Read(make([]byte, 256)); n != 0 || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("an attach past the pod's silent connections: %d bytes, %v", n, err)
	}
	c.Close()
	for _, c := range mute {
		c.Close()
	}
	waitFor(t, "the silent connections gone", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.pendingAll == 0
	})
	if _, st := dialHello(t, s.Socket(), "pod-a"); st != wire.OK {
		t.Fatalf("attach once the silent connections closed: %v", st)
	}
}

// emfileChild, set, makes TestAcceptOutOfDescriptors the child that runs
// out of descriptors.
const emfileChild = "RS_NODE_TEST_EMFILE"

// TestAcceptOutOfDescriptors: a node out of descriptors (a flood of
// connections; here a child process whose limit is its open descriptors
// plus a few) fails accept(2) with EMFILE; it retries and serves on, and
// a sidecar attaches once descriptors are free again. It used to shut the
// tier down.
func TestAcceptOutOfDescriptors(t *testing.T) {
	if os.Getenv(emfileChild) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestAcceptOutOfDescriptors$", "-test.v")
		cmd.Env = append(os.Environ(), emfileChild+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "accept errors:") {
			t.Fatalf("the child: %v\n%s", err, out)
		}
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, "accept errors:") {
				t.Log(strings.TrimSpace(l))
			}
		}
		return
	}
	s := startServer(t, func(c *ServerConfig) { c.MaxPods = 1024; c.IOTimeout = time.Minute })
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = uint64(len(fds) + 16)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	var conns []*net.UnixConn
	for s.Stats().AcceptErrors.Load() == 0 && len(conns) < 64 {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Socket(), Net: "unixpacket"})
		if err != nil {
			time.Sleep(time.Millisecond) // our own socket(2) out of descriptors: let the node try
			continue
		}
		conns = append(conns, c)
	}
	if s.Stats().AcceptErrors.Load() == 0 {
		t.Fatal("the node never ran out of descriptors")
	}
	for _, c := range conns {
		c.Close()
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
		t.Fatal("the node stopped")
	default:
	}
	c := newTestClient(t, s.Socket(), "pod-a")
	if !c.Connected() {
		t.Fatal("not attached")
	}
	fmt.Printf("accept errors: %d, the node serves on\n", s.Stats().AcceptErrors.Load())
}
