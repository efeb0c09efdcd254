// Package gputest runs the engine side of copy-engine tests and benchmarks
// in a second process, so that what is measured and checked is the
// sidecar's cross-process path: a peer allocates memory (host memory for
// the host backend, device memory exported with cudaIpcGetMemHandle for the
// CUDA backend, or virtual-memory-management memory whose POSIX file
// descriptor it sends over a Unix socket), reports how to reach it, and
// fills or dumps it on request.
// A peer is the test binary or the ringside-bench executable re-executed with
// PeerEnv set; its entry point is PeerMain. MapAnon gives benchmarks the
// anonymous memory of gpu/internal/hostmem. The conformance suite that runs
// against every backend lives in this package's tests.
package gputest

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/internal/cuda"
	"github.com/ringside-kv/ringside/gpu/internal/procmem"
)

// PeerEnv names the peer kind ("host" or "cuda") in a re-executed process.
const PeerEnv = "RINGSIDE_GPUTEST_PEER"

// Export is a peer buffer as the sidecar side registers it.
type Export struct {
	ID     int
	Kind   string
	PID    int
	Base   uint64 // address of the buffer in the peer (device address for cuda)
	Length uint64
	IPC    gpu.IPCMem // cuda: the GPU and the one allocation holding the buffer
	Info   string     // e.g. the GPU's name
}

// Alloc returns the buffer's device allocation (cuda only).
func (e Export) Alloc() gpu.IPCAllocation { return e.IPC.Allocations[0] }

// EventExport is an interprocess CUDA event of the peer.
type EventExport struct {
	ID     int
	Handle [64]byte
}

// VMMExport is a peer buffer in virtual-memory-management memory
// (cuMemCreate + cuMemMap), shared by file descriptor (VMMSendFD).
type VMMExport struct {
	ID          int
	PID         int
	Base        uint64 // the mapping's address in the peer
	Length      uint64 // its size: the allocation's, a multiple of Granularity
	Granularity uint64
	GPU         [16]byte
}

// Region returns a region of e with the given geometry.
func (e Export) Region(pageSize uint64, pages uint32, segs []gpu.Segment) gpu.Region {
	r := gpu.Region{PID: e.PID, Base: e.Base, Length: e.Length, PageSize: pageSize, PageCount: pages, Segments: segs}
	if e.Kind == "cuda" {
		r.Kind, r.IPC = gpu.CUDAIPC, e.IPC
	} else {
		r.Kind = gpu.HostProcess
	}
	return r
}

// Peer is a running peer process.
type Peer struct {
	Kind    string
	cmd     *exec.Cmd
	in      io.WriteCloser
	out     *bufio.Reader
	Timeout time.Duration
	killed  bool
	closed  bool
}

// StartPeer starts argv (the test binary, or `ringside-bench copy-peer`)
// with PeerEnv=kind and waits for it to report ready.
func StartPeer(kind string, argv []string, env ...string) (*Peer, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), env...), PeerEnv+"="+kind)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Peer{Kind: kind, cmd: cmd, in: in, out: bufio.NewReader(out), Timeout: 2 * time.Minute}
	if _, err := p.reply(); err != nil {
		p.Close()
		return nil, fmt.Errorf("gputest: %s peer: %w", kind, err)
	}
	return p, nil
}

func (p *Peer) reply() (string, error) {
	type line struct {
		s   string
		err error
	}
	ch := make(chan line, 1)
	go func() { s, err := p.out.ReadString('\n'); ch <- line{s, err} }()
	select {
	case l := <-ch:
		if l.err != nil {
			return "", fmt.Errorf("reading the peer: %w", l.err)
		}
		s := strings.TrimSpace(l.s)
		if rest, ok := strings.CutPrefix(s, "ok"); ok {
			return strings.TrimSpace(rest), nil
		}
		return "", errors.New(strings.TrimPrefix(s, "err "))
	case <-time.After(p.Timeout):
		return "", fmt.Errorf("the peer did not answer within %v", p.Timeout)
	}
}

func (p *Peer) do(format string, args ...any) (string, error) {
	if _, err := fmt.Fprintf(p.in, format+"\n", args...); err != nil {
		return "", err
	}
	return p.reply()
}

// Alloc allocates n bytes at offset off into a fresh allocation of off+n.
func (p *Peer) Alloc(n, off uint64) (Export, error) {
	var e Export
	s, err := p.do("alloc %d %d", n, off)
	if err == nil {
		err = json.Unmarshal([]byte(s), &e)
	}
	return e, err
}

// AllocN makes k allocations of n bytes each, one buffer each (as vLLM
// allocates one KV cache tensor per layer).
func (p *Peer) AllocN(k int, n uint64) ([]Export, error) {
	var es []Export
	s, err := p.do("allocn %d %d", k, n)
	if err == nil {
		err = json.Unmarshal([]byte(s), &es)
	}
	return es, err
}

// NewEvent creates an interprocess event (cuda peer) and exports it.
func (p *Peer) NewEvent() (EventExport, error) {
	var e EventExport
	s, err := p.do("event")
	if err == nil {
		err = json.Unmarshal([]byte(s), &e)
	}
	return e, err
}

// Record records event id on the peer's stream.
func (p *Peer) Record(id int) error { _, err := p.do("record %d", id); return err }

// VMM allocates n bytes (rounded up to the granularity) with cuMemCreate,
// requesting handleTypes (cuda.HandleType* bits), maps them into a
// reservation and makes them readable and writable: the way vLLM's
// extensible KV cache allocates.
func (p *Peer) VMM(n uint64, handleTypes int) (VMMExport, error) {
	var e VMMExport
	s, err := p.do("vmm %d %d", n, handleTypes)
	if err == nil {
		err = json.Unmarshal([]byte(s), &e)
	}
	return e, err
}

// VMMSendFD exports VMM buffer id as the planned worker does (the handle
// retained from a mapped address, cuMemExportToShareableHandle with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), connects to the Unix socket
// at path, sends the descriptor with SCM_RIGHTS and closes its copy.
func (p *Peer) VMMSendFD(id int, path string) error {
	_, err := p.do("vmmsend %d %s", id, path)
	return err
}

// VMMRelease releases the handle of VMM buffer id that cuMemCreate gave,
// leaving it mapped (and in use) in the peer.
func (p *Peer) VMMRelease(id int) error { _, err := p.do("vmmrelease %d", id); return err }

// FDs returns how many file descriptors the peer has open.
func (p *Peer) FDs() (int, error) {
	s, err := p.do("fds")
	n := 0
	if err == nil {
		_, err = fmt.Sscan(s, &n)
	}
	return n, err
}

// Write fills buffer id from the start with the contents of file path.
func (p *Peer) Write(id int, path string) error { _, err := p.do("write %d %s", id, path); return err }

// Read writes the whole buffer id to file path.
func (p *Peer) Read(id int, path string) error { _, err := p.do("read %d %s", id, path); return err }

// Free releases buffer id.
func (p *Peer) Free(id int) error { _, err := p.do("free %d", id); return err }

// Kill SIGKILLs the peer (an engine that dies without a word) and waits
// until it is reaped; Close then returns nil.
func (p *Peer) Kill() error {
	if err := p.cmd.Process.Kill(); err != nil {
		return err
	}
	p.killed = true
	p.cmd.Wait()
	return nil
}

// Close stops the peer and waits for it; a second Close returns nil.
func (p *Peer) Close() error {
	if p.killed || p.closed {
		return nil
	}
	p.closed = true
	p.in.Close()
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		p.cmd.Process.Kill()
		return <-done
	}
}

// peerBuf is one allocation in the peer.
type peerBuf struct {
	host []byte         // host peer: Go heap (process_vm_* reaches it; it never moves)
	dev  cuda.DevicePtr // cuda peer: allocation base
	off  uint64
	n    uint64
	vmm  *vmmBuf // cuda peer, VMM memory: mapped at dev, n bytes
}

// vmmBuf is the VMM state of a peer buffer.
type vmmBuf struct {
	h        cuda.MemHandle
	released bool // h was released (the mapping stays)
}

// free releases a peer buffer's device memory.
func (b *peerBuf) free() error {
	if b.vmm == nil {
		return cuda.MemFree(b.dev)
	}
	err := errors.Join(cuda.MemUnmap(b.dev, b.n), cuda.MemAddressFree(b.dev, b.n))
	if !b.vmm.released {
		err = errors.Join(err, b.vmm.h.Release())
	}
	return err
}

// vmmAlloc makes a VMM buffer of n bytes rounded up to the granularity
// (see Peer.VMM); on error nothing is left allocated.
func vmmAlloc(n uint64, types int) (b *peerBuf, gran uint64, err error) {
	d := cuda.Device(0)
	if gran, err = cuda.MemGranularity(d); err != nil {
		return nil, 0, fmt.Errorf("cuMemGetAllocationGranularity: %w", err)
	}
	n = (n + gran - 1) / gran * gran
	h, err := cuda.MemCreate(d, n, types)
	if err != nil {
		return nil, 0, fmt.Errorf("cuMemCreate: %w", err)
	}
	p, err := cuda.MemAddressReserve(n)
	if err != nil {
		h.Release()
		return nil, 0, fmt.Errorf("cuMemAddressReserve: %w", err)
	}
	if err = cuda.MemMap(p, n, h); err != nil {
		err = fmt.Errorf("cuMemMap: %w", err)
	} else if err = cuda.MemSetAccess(p, n, d); err != nil {
		err = fmt.Errorf("cuMemSetAccess: %w", err)
		cuda.MemUnmap(p, n)
	}
	if err != nil {
		cuda.MemAddressFree(p, n)
		h.Release()
		return nil, 0, err
	}
	return &peerBuf{dev: p, n: n, vmm: &vmmBuf{h: h}}, gran, nil
}

// vmmSend exports b's allocation as a file descriptor and sends it with
// SCM_RIGHTS to the Unix socket at path.
func vmmSend(b *peerBuf, path string) error {
	// The worker's path: the handle from a mapped address (not the base),
	// then the descriptor; the retained reference is released at once.
	h, err := cuda.MemRetainHandle(b.dev + cuda.DevicePtr(b.n/2))
	if err != nil {
		return fmt.Errorf("cuMemRetainAllocationHandle: %w", err)
	}
	fd, err := cuda.MemExportFD(h)
	if rerr := h.Release(); err == nil && rerr != nil {
		err = rerr
	}
	if err != nil {
		if fd >= 0 {
			syscall.Close(fd)
		}
		return fmt.Errorf("cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR): %w", err)
	}
	defer syscall.Close(fd)
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return err
	}
	defer c.Close()
	_, _, err = c.WriteMsgUnix([]byte{'f'}, syscall.UnixRights(fd), nil)
	return err
}

// openFDs counts this process's open file descriptors.
func openFDs() (int, error) {
	es, err := os.ReadDir("/proc/self/fd")
	return len(es) - 1, err // less the one ReadDir held
}

// PeerMain serves a peer's requests on stdin/stdout until stdin closes
// and returns the exit code.
func PeerMain(kind string) int {
	out := bufio.NewWriter(os.Stdout)
	say := func(format string, args ...any) {
		fmt.Fprintf(out, format+"\n", args...)
		out.Flush()
	}
	// A CUDA context is per thread: the whole loop runs on this one.
	runtime.LockOSThread()
	var uuid [16]byte
	info := ""
	switch kind {
	case "host":
	case "cuda":
		if err := cuda.Init(); err != nil {
			say("err %v", err)
			return 1
		}
		d, err := cuda.DeviceGet(0)
		var ctx cuda.Context
		if err == nil {
			ctx, err = d.Retain()
		}
		if err == nil {
			err = ctx.SetCurrent()
		}
		if err == nil {
			uuid, err = d.UUID()
		}
		if err != nil {
			say("err cuda device 0: %v", err)
			return 1
		}
		info, _ = d.Name()
	default:
		say("err unknown peer kind %q", kind)
		return 2
	}
	bufs := map[int]*peerBuf{}
	events := map[int]cuda.Event{}
	var stream cuda.Stream
	next := 0
	// alloc makes one buffer of n bytes at offset off of a fresh
	// allocation of off+n bytes and exports it.
	alloc := func(n, off uint64) (Export, error) {
		next++
		e := Export{ID: next, Kind: kind, PID: os.Getpid(), Length: n, Info: info}
		b := &peerBuf{off: off, n: n}
		if kind == "host" {
			b.host = make([]byte, off+n)
			e.Base = procmem.Addr(b.host) + off
			bufs[next] = b
			return e, nil
		}
		var err error
		if b.dev, err = cuda.MemAlloc(off + n); err != nil {
			return e, err
		}
		e.Base = uint64(b.dev) + off
		a := gpu.IPCAllocation{Base: uint64(b.dev), Size: off + n}
		if a.Handle, err = cuda.IPCGetHandle(b.dev); err != nil {
			// Memory legacy IPC cannot share fails here, at export.
			capable, aerr := cuda.IPCCapable(b.dev)
			cuda.MemFree(b.dev)
			return e, fmt.Errorf("cuIpcGetMemHandle: %w (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE %v, %v)", err, capable, aerr)
		}
		e.IPC = gpu.IPCMem{GPU: uuid, Allocations: []gpu.IPCAllocation{a}}
		bufs[next] = b
		return e, nil
	}
	say("ok ready %d", os.Getpid())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		var err error
		var reply string
		var id int
		var b *peerBuf
		if len(f) >= 2 && f[0] != "alloc" && f[0] != "allocn" && f[0] != "record" && f[0] != "vmm" {
			fmt.Sscan(f[1], &id)
			if b = bufs[id]; b == nil {
				say("err no buffer %d", id)
				continue
			}
		}
		switch {
		case f[0] == "alloc" && len(f) == 3:
			var n, off uint64
			fmt.Sscan(f[1], &n)
			fmt.Sscan(f[2], &off)
			var e Export
			if e, err = alloc(n, off); err == nil {
				var j []byte
				j, err = json.Marshal(e)
				reply = string(j)
			}
		case f[0] == "allocn" && len(f) == 3:
			var k int
			var n uint64
			fmt.Sscan(f[1], &k)
			fmt.Sscan(f[2], &n)
			var es []Export
			for range k {
				var e Export
				if e, err = alloc(n, 0); err != nil {
					break
				}
				es = append(es, e)
			}
			if err == nil {
				var j []byte
				j, err = json.Marshal(es)
				reply = string(j)
			}
		case f[0] == "vmm" && len(f) == 3 && kind == "cuda":
			var n uint64
			var types int
			fmt.Sscan(f[1], &n)
			fmt.Sscan(f[2], &types)
			var g uint64
			if b, g, err = vmmAlloc(n, types); err == nil {
				next++
				bufs[next] = b
				var j []byte
				j, err = json.Marshal(VMMExport{ID: next, PID: os.Getpid(), Base: uint64(b.dev), Length: b.n, Granularity: g, GPU: uuid})
				reply = string(j)
			}
		case f[0] == "vmmsend" && len(f) == 3 && b.vmm != nil:
			err = vmmSend(b, f[2])
		case f[0] == "vmmrelease" && len(f) == 2 && b.vmm != nil && !b.vmm.released:
			if err = b.vmm.h.Release(); err == nil {
				b.vmm.released = true
			}
		case f[0] == "fds" && len(f) == 1:
			var n int
			n, err = openFDs()
			reply = fmt.Sprint(n)
		case f[0] == "event" && len(f) == 1 && kind == "cuda":
			if stream == 0 {
				stream, err = cuda.NewStream(0)
			}
			var ev cuda.Event
			if err == nil {
				ev, err = cuda.NewIPCEvent()
			}
			if err == nil {
				var h cuda.IPCEventHandle
				if h, err = cuda.IPCGetEventHandle(ev); err != nil {
					ev.Destroy()
				} else {
					next++
					events[next] = ev
					var j []byte
					j, err = json.Marshal(EventExport{ID: next, Handle: h})
					reply = string(j)
				}
			}
		case f[0] == "record" && len(f) == 2 && kind == "cuda":
			var id int
			fmt.Sscan(f[1], &id)
			if ev := events[id]; ev == 0 {
				err = fmt.Errorf("no event %d", id)
			} else {
				err = ev.Record(stream)
			}
		case f[0] == "write" && len(f) == 3:
			var data []byte
			if data, err = os.ReadFile(f[2]); err == nil && uint64(len(data)) > b.n {
				err = fmt.Errorf("%d bytes do not fit in %d", len(data), b.n)
			}
			if err == nil {
				if kind == "host" {
					copy(b.host[b.off:], data)
				} else {
					err = cuda.MemcpyHtoD(b.dev+cuda.DevicePtr(b.off), data)
				}
			}
		case f[0] == "read" && len(f) == 3:
			data := make([]byte, b.n)
			if kind == "host" {
				copy(data, b.host[b.off:])
			} else {
				err = cuda.MemcpyDtoH(data, b.dev+cuda.DevicePtr(b.off))
			}
			if err == nil {
				err = os.WriteFile(f[2], data, 0o600)
			}
		case f[0] == "free" && len(f) == 2:
			if kind == "cuda" {
				err = b.free()
			}
			delete(bufs, id)
		default:
			err = fmt.Errorf("bad request %q", in.Text())
		}
		if err != nil {
			say("err %v", err)
		} else {
			say("ok %s", reply)
		}
	}
	for _, b := range bufs {
		if kind == "cuda" {
			b.free()
		}
	}
	for _, ev := range events {
		ev.Destroy()
	}
	if stream != 0 {
		stream.Destroy()
	}
	return 0
}

// ExportCUDA allocates n bytes of device memory on device 0 in this
// process and exports it with cuIpcGetMemHandle, as an engine exports its
// KV cache (for tests whose engine is this process); free releases it.
func ExportCUDA(n uint64) (e Export, free func(), err error) {
	runtime.LockOSThread() // the context is current on this thread only
	defer runtime.UnlockOSThread()
	if err := cuda.Init(); err != nil {
		return e, nil, err
	}
	d, err := cuda.DeviceGet(0)
	var ctx cuda.Context
	if err == nil {
		ctx, err = d.Retain()
	}
	if err == nil {
		err = ctx.SetCurrent()
	}
	var uuid cuda.UUID
	if err == nil {
		uuid, err = d.UUID()
	}
	if err != nil {
		return e, nil, fmt.Errorf("cuda device 0: %w", err)
	}
	p, err := cuda.MemAlloc(n)
	if err != nil {
		return e, nil, err
	}
	a := gpu.IPCAllocation{Base: uint64(p), Size: n}
	if a.Handle, err = cuda.IPCGetHandle(p); err != nil {
		cuda.MemFree(p)
		return e, nil, fmt.Errorf("cuIpcGetMemHandle: %w", err)
	}
	e = Export{Kind: "cuda", PID: os.Getpid(), Base: uint64(p), Length: n, IPC: gpu.IPCMem{GPU: uuid, Allocations: []gpu.IPCAllocation{a}}}
	return e, func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		ctx.SetCurrent()
		cuda.MemFree(p)
		d.Release()
	}, nil
}
