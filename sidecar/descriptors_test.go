package sidecar_test

import (
	"encoding/binary"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/schema"
)

// FuzzDescriptors sends random and mutated RegionDescriptors messages to
// a real sidecar with descriptors of every kind attached (memfds,
// /dev/null, pipes, sockets), on a connection of their own to the attach
// socket, optionally addressed to a live session of this process: every
// one gets a RegionDescriptorsReply that refuses it (this sidecar runs the
// host backend: nothing registers GPU memory), every descriptor the
// sidecar received is closed (the process's descriptor count comes back),
// and the session serves on.
func FuzzDescriptors(f *testing.F) {
	x := schema.FDExtra{GPU: [16]byte{0xf0}, Allocations: []schema.FDAllocation{{Index: 0, Base: 1 << 40, Size: 2 << 20}, {Index: 1, Base: 2 << 40, Size: 2 << 20}}}
	good := schema.RegionDescriptors{Version: schema.Version, Region: schema.RegisterRegion{Region: 1, Kind: schema.RegionCUDAFD, Base: 1 << 40,
		Length: 1<<40 + 2<<20, PageSize: 8192, PageCount: 16, Segments: []schema.Segment{{Offset: 0, Stride: 4096, Length: 4096}, {Offset: 1 << 40, Stride: 4096, Length: 4096}},
		Extra: x.Append(nil)}}
	f.Add(good.Append(nil), uint8(2), uint8(0), true)
	f.Add(good.Append(nil), uint8(2), uint8(0xE4), true)
	f.Add(good.Append(nil), uint8(0), uint8(0), false)
	f.Add([]byte{}, uint8(5), uint8(0x1B), false)
	f.Add(make([]byte, 100), uint8(1), uint8(3), true)
	h := newHarness(f, nil)
	f.Fuzz(func(t *testing.T, msg []byte, nfds, kinds uint8, address bool) {
		if len(msg) > 60000 {
			return
		}
		h := &harness{t: t, srv: h.srv, cfg: h.cfg}
		c := h.dial(nil)
		msg = append([]byte(nil), msg...)
		for len(msg) < 4 {
			msg = append(msg, 0)
		}
		binary.LittleEndian.PutUint32(msg, schema.DescriptorsMagic)
		if address && len(msg) >= schema.RegionDescriptorsHeaderSize {
			binary.LittleEndian.PutUint64(msg[8:], c.Info().Session)
			binary.LittleEndian.PutUint64(msg[16:], c.Info().Epoch)
			if len(msg) >= schema.RegionDescriptorsHeaderSize+16 {
				binary.LittleEndian.PutUint64(msg[schema.RegionDescriptorsHeaderSize+8:], uint64(os.Getpid()))
			}
		}
		var fds []int
		sent := map[string]bool{} // what /proc/self/fd says each descriptor sent is
		for i := range int(nfds % 6) {
			fd := fuzzFD(t, (kinds>>(2*(i%4)))&3)
			fds = append(fds, fd)
			sent[fdLink(fd)] = true
		}
		before := fdsTo(t, sent)
		conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: h.cfg.Socket, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		var oob []byte
		if len(fds) > 0 {
			oob = syscall.UnixRights(fds...)
		}
		_, _, werr := conn.WriteMsgUnix(msg, oob, nil)
		for _, fd := range fds {
			syscall.Close(fd)
		}
		if werr != nil {
			conn.Close()
			t.Fatalf("sending %d bytes with %d descriptors: %v", len(msg), len(fds), werr)
		}
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		b := make([]byte, 65536)
		n, err := conn.Read(b)
		conn.Close()
		if err != nil {
			t.Fatalf("no answer: %v", err)
		}
		var rep schema.RegionDescriptorsReply
		if err := rep.Decode(b[:n]); err != nil {
			t.Fatalf("the answer is no RegionDescriptorsReply: %v (%x)", err, b[:n])
		}
		if rep.Status == schema.OK {
			t.Fatalf("a host-backend sidecar registered GPU memory: %+v", rep)
		}
		for deadline := time.Now().Add(5 * time.Second); fdsTo(t, sent) != before-len(fds); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d descriptors of what was sent are open, %d of them the sidecar's (status %v: %s)",
					fdsTo(t, sent), fdsTo(t, sent)-(before-len(fds)), rep.Status, rep.Message)
			}
		}
		if err := c.Ping(7); err != nil {
			t.Fatalf("the session died: %v", err)
		}
	})
}

// fuzzFD opens a descriptor of kind k: a memfd, /dev/null, a pipe's read
// end or one end of a socket pair.
func fuzzFD(t *testing.T, k uint8) int {
	t.Helper()
	var fd int
	var err error
	switch k {
	case 0:
		fdSeq++
		if fd, err = unix.MemfdCreate("fuzz-descriptors-"+strconv.Itoa(fdSeq), unix.MFD_CLOEXEC); err == nil {
			err = unix.Ftruncate(fd, 2<<20)
		}
	case 1:
		fd, err = unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	case 2:
		var p [2]int
		if err = unix.Pipe2(p[:], unix.O_CLOEXEC); err == nil {
			fd = p[0]
			unix.Close(p[1])
		}
	default:
		var p [2]int
		if p, err = unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err == nil {
			fd = p[0]
			unix.Close(p[1])
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

// fdSeq names each memfd apart.
var fdSeq int

func fdLink(fd int) string {
	l, _ := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	return l
}

// fdsTo counts this process's descriptors that are one of links (the
// sidecar's copies of what was sent included): the harness's other
// descriptors come and go as earlier sessions end.
func fdsTo(t *testing.T, links map[string]bool) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range es {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && links[l] {
			n++
		}
	}
	return n
}
