package gputest

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/cuda"
	driver "github.com/ringside-kv/ringside/gpu/internal/cuda"
)

// Virtual memory management (VMM) memory shared by file descriptor, the
// path for vLLM 0.34's KV cache (cuMemCreate + cuMemMap, which legacy IPC
// cannot export): the peer (the engine's worker) allocates, maps and
// exports a POSIX descriptor, sends it with SCM_RIGHTS over a Unix socket,
// and this process (the sidecar's side) imports, maps and copies. Against
// the stand-in driver (TestCUDAFakeVMM) or a GPU; what the stand-in models
// and the device probe that checks each behaviour are in fakecuda.c.

// More fake driver counters (enum counter in fakecuda.c, after cSticky).
const (
	cVMMAlloc = cSticky + 1 + iota
	cVMMFree
	cVMMMap
	cVMMUnmap
	cVMMReserve
	cVMMAddrFree
	_ // C_VMM_EXPORT: counted in the exporting process
	cVMMImport
)

// TestCUDAFakeVMM runs the VMM tests below against the fake driver, in a
// process of their own with counters.
func TestCUDAFakeVMM(t *testing.T) {
	if underFake() {
		t.Skip("already running under the fake driver")
	}
	lib := buildFake(t)
	args := []string{"-test.run=^TestVMM", "-test.count=1"}
	if testing.Verbose() {
		args = append(args, "-test.v")
	}
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+lib, "RINGSIDE_GPUTEST_FAKE=1", "RINGSIDE_REQUIRE_GPU=1",
		"FAKECUDA_COUNTERS="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "PASS") || strings.Contains(string(out), "SKIP") {
		t.Fatalf("under the fake driver: %v\n%s", err, out)
	}
	if testing.Verbose() {
		t.Logf("%s", out)
	}
}

// vmmSide is this process as the importer: device 0's primary context,
// current on the test's goroutine, which stays on its OS thread.
func vmmSide(t *testing.T) {
	t.Helper()
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	err := driver.Init()
	if errors.Is(err, driver.ErrUnavailable) && !requireGPU() {
		t.Skipf("no GPU: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	ctx, err := driver.Device(0).Retain()
	if err == nil {
		err = ctx.SetCurrent()
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { driver.Device(0).Release() })
	if !driver.HasVMM() {
		t.Fatal("the driver lacks the virtual memory management entry points")
	}
}

// fdListener is the sidecar's end of the attach socket, for descriptors.
type fdListener struct {
	path string
	l    *net.UnixListener
}

func listenFD(t *testing.T) *fdListener {
	t.Helper()
	// A short path: sun_path holds 108 bytes, t.TempDir() may exceed it.
	dir, err := os.MkdirTemp("", "vmm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return &fdListener{path: path, l: l}
}

// recv accepts one connection and returns the descriptor it carries
// (received close-on-exec: Go's ReadMsgUnix sets MSG_CMSG_CLOEXEC).
func (f *fdListener) recv() (int, error) {
	f.l.SetDeadline(time.Now().Add(30 * time.Second))
	c, err := f.l.AcceptUnix()
	if err != nil {
		return -1, err
	}
	defer c.Close()
	buf, oob := make([]byte, 1), make([]byte, syscall.CmsgSpace(4*4))
	_, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return -1, err
	}
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return -1, fmt.Errorf("control messages %d: %v", len(msgs), err)
	}
	fds, err := syscall.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		for _, fd := range fds {
			syscall.Close(fd)
		}
		return -1, fmt.Errorf("%d descriptors: %v", len(fds), err)
	}
	return fds[0], nil
}

// sendFD has the peer send buffer id's descriptor and receives it.
func (f *fdListener) sendFD(p *Peer, id int) (int, error) {
	type res struct {
		fd  int
		err error
	}
	ch := make(chan res, 1)
	go func() { fd, err := f.recv(); ch <- res{fd, err} }()
	perr := p.VMMSendFD(id, f.path)
	if perr != nil {
		f.l.SetDeadline(time.Now()) // nothing will come: end the Accept
	}
	r := <-ch
	if perr != nil {
		if r.err == nil {
			syscall.Close(r.fd)
		}
		return -1, perr
	}
	return r.fd, r.err
}

// vmmMapping is an imported allocation mapped here.
type vmmMapping struct {
	h    driver.MemHandle
	base driver.DevicePtr
	n    uint64
}

// importMap imports the allocation behind fd and maps n bytes of it, read
// and write. The descriptor is closed (the import holds the memory). On
// every error path what was made is undone, in reverse order.
func importMap(fd int, n uint64) (m vmmMapping, err error) {
	defer syscall.Close(fd)
	if m.h, err = driver.MemImportFD(fd); err != nil {
		return m, fmt.Errorf("cuMemImportFromShareableHandle: %w", err)
	}
	if m.base, err = driver.MemAddressReserve(n); err != nil {
		m.h.Release()
		return m, fmt.Errorf("cuMemAddressReserve: %w", err)
	}
	if err = driver.MemMap(m.base, n, m.h); err != nil {
		err = fmt.Errorf("cuMemMap: %w", err)
	} else if err = driver.MemSetAccess(m.base, n, 0); err != nil {
		err = fmt.Errorf("cuMemSetAccess: %w", err)
		driver.MemUnmap(m.base, n)
	}
	if err != nil {
		driver.MemAddressFree(m.base, n)
		m.h.Release()
		return m, err
	}
	m.n = n
	return m, nil
}

// close unmaps, frees the reservation and releases the handle (unless
// released already: released).
func (m vmmMapping) close(released bool) error {
	err := errors.Join(driver.MemUnmap(m.base, m.n), driver.MemAddressFree(m.base, m.n))
	if !released {
		err = errors.Join(err, m.h.Release())
	}
	return err
}

// openFDsHere counts this process's descriptors.
func openFDsHere(t *testing.T) int {
	t.Helper()
	n, err := openFDs()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// vmmLive checks that this process holds no VMM allocation, mapping or
// reservation (fake driver counters; nothing to check on a GPU).
func vmmLive(t *testing.T, fc *counters, what string) {
	t.Helper()
	if fc == nil {
		return
	}
	if a, f := fc.get(cVMMAlloc), fc.get(cVMMFree); a != f {
		t.Errorf("%s: %d VMM allocations made, %d freed", what, a, f)
	}
	if m, u := fc.get(cVMMMap), fc.get(cVMMUnmap); m != u {
		t.Errorf("%s: %d mappings, %d unmapped", what, m, u)
	}
	if r, f := fc.get(cVMMReserve), fc.get(cVMMAddrFree); r != f {
		t.Errorf("%s: %d reservations, %d freed", what, r, f)
	}
}

// TestVMMImport: an allocation exported by the peer as a descriptor is
// imported and mapped here; the bytes the peer wrote are read here, the
// bytes written here are read by the peer, by synchronous copies and by
// the copy engine's asynchronous batch from pinned memory.
func TestVMMImport(t *testing.T) {
	vmmSide(t)
	fc := fakeCounters(t)
	peer := startPeer(t, "cuda")
	l := listenFD(t)
	exp, err := peer.p.VMM(3<<20, driver.HandleTypePOSIXFD)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.p.Free(exp.ID) })
	if exp.Length%exp.Granularity != 0 || exp.Length < 3<<20 {
		t.Fatalf("peer allocation of %d bytes, granularity %d", exp.Length, exp.Granularity)
	}
	rng := rand.New(rand.NewPCG(11, 12))
	data := randBytes(rng, exp.Length)
	e := Export{ID: exp.ID, Kind: "cuda", Length: exp.Length}
	peer.write(t, e, data)

	fd, err := l.sendFD(peer.p, exp.ID)
	if err != nil {
		t.Fatal(err)
	}
	m, err := importMap(fd, exp.Length)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.close(false); err != nil {
			t.Error(err)
		}
		vmmLive(t, fc, "after the import's close")
	}()

	// What the sidecar's registration checks can rely on.
	if ok, err := driver.IPCCapable(m.base); err != nil || ok {
		t.Errorf("IS_LEGACY_CUDA_IPC_CAPABLE of the imported mapping = %v, %v; want false", ok, err)
	}
	if v, err := driver.PointerAttribute(m.base, driver.AttrAllowedHandleTypes); err != nil || v != driver.HandleTypePOSIXFD {
		t.Errorf("ALLOWED_HANDLE_TYPES = %d, %v; want POSIX_FILE_DESCRIPTOR", v, err)
	}
	if b, n, err := driver.AddressRange(m.base + 12345); err != nil || b != m.base || n != exp.Length {
		t.Errorf("cuMemGetAddressRange = %#x+%d, %v; want the mapping %#x+%d", b, n, err, m.base, exp.Length)
	}
	if _, err := driver.IPCGetHandle(m.base); driver.Code(err) != driver.ErrorInvalidValue && underFake() {
		t.Errorf("cuIpcGetMemHandle of VMM memory = %v, want CUDA_ERROR_INVALID_VALUE", err)
	}

	got := make([]byte, exp.Length)
	if err := driver.MemcpyDtoH(got, m.base); err != nil {
		t.Fatal(err)
	}
	if i, bad := firstDiff(got, data); bad {
		t.Fatalf("imported memory differs from the peer's at byte %d", i)
	}
	// This side writes the second half; the peer reads it.
	half := exp.Length / 2
	mine := randBytes(rng, exp.Length-half)
	if err := driver.MemcpyHtoD(m.base+driver.DevicePtr(half), mine); err != nil {
		t.Fatal(err)
	}
	copy(data[half:], mine)
	if i, bad := firstDiff(peer.read(t, e), data); bad {
		t.Fatalf("the peer's memory differs from what was written here at byte %d", i)
	}

	// The copy engine's primitive: a batch from pinned memory into the
	// mapping and back.
	pool := mapPool(t, 1<<20)
	if err := driver.HostRegister(pool, driver.HostRegisterPortable); err != nil {
		t.Fatal(err)
	}
	defer driver.HostUnregister(pool)
	s, err := driver.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	copy(pool, randBytes(rng, 1<<20))
	const page = 64 << 10
	var dst, src, lens []uint64
	for i := range uint64(8) { // every other page of the pool to pages 16.. of the mapping
		dst = append(dst, uint64(m.base)+(16+i)*page)
		src = append(src, driver.Addr(pool)+2*i*page)
		lens = append(lens, page)
	}
	if _, _, err := driver.CopyAsync(driver.HtoD, driver.HasBatch(), dst, src, lens, s); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	after := peer.read(t, e)
	for i := range uint64(8) {
		if !bytes.Equal(after[(16+i)*page:][:page], pool[2*i*page:][:page]) {
			t.Fatalf("batched host-to-device copy %d did not reach the peer", i)
		}
	}
}

// TestVMMExportRefused: an allocation made without
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR cannot be exported as one; the
// refusal comes in the exporter, before any descriptor is sent.
func TestVMMExportRefused(t *testing.T) {
	vmmSide(t)
	peer := startPeer(t, "cuda")
	l := listenFD(t)
	exp, err := peer.p.VMM(2<<20, driver.HandleTypeNone)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.p.Free(exp.ID) })
	_, err = l.sendFD(peer.p, exp.ID)
	if err == nil || !strings.Contains(err.Error(), "cuMemExportToShareableHandle") {
		t.Fatalf("exporting an allocation that requested no handle type: %v, want a cuMemExportToShareableHandle error", err)
	}
	// The stand-in's code (probe vmm-export-unrequested reports a GPU's).
	if underFake() && !strings.Contains(err.Error(), "CUDA_ERROR_INVALID_VALUE") {
		t.Errorf("the stand-in refuses with CUDA_ERROR_INVALID_VALUE: %v", err)
	}
	t.Log(err)
}

// TestVMMReleaseWhileMapped: the memory lives while any process maps it.
// The peer releases its handle (its mapping stays), this side releases
// the imported handle right after mapping; the bytes still move both
// ways; then the peer exits, and this side still reads what it wrote.
func TestVMMReleaseWhileMapped(t *testing.T) {
	vmmSide(t)
	fc := fakeCounters(t)
	peer := startPeer(t, "cuda")
	l := listenFD(t)
	exp, err := peer.p.VMM(2<<20, driver.HandleTypePOSIXFD)
	if err != nil {
		t.Fatal(err)
	}
	e := Export{ID: exp.ID, Kind: "cuda", Length: exp.Length}
	rng := rand.New(rand.NewPCG(13, 14))
	data := randBytes(rng, exp.Length)
	peer.write(t, e, data)
	fd, err := l.sendFD(peer.p, exp.ID)
	if err != nil {
		t.Fatal(err)
	}
	m, err := importMap(fd, exp.Length)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.h.Release(); err != nil { // released while mapped, here
		t.Fatal(err)
	}
	if err := peer.p.VMMRelease(exp.ID); err != nil { // and in the peer
		t.Fatal(err)
	}
	if err := m.h.Release(); err == nil && underFake() {
		t.Error("a second release of the imported handle succeeded (the stand-in refuses a handle with no reference left)")
	}
	got := make([]byte, exp.Length)
	if err := driver.MemcpyDtoH(got, m.base); err != nil {
		t.Fatal(err)
	}
	if i, bad := firstDiff(got, data); bad {
		t.Fatalf("after both releases, the memory differs at byte %d", i)
	}
	mine := randBytes(rng, exp.Length)
	if err := driver.MemcpyHtoD(m.base, mine); err != nil {
		t.Fatal(err)
	}
	if i, bad := firstDiff(peer.read(t, e), mine); bad {
		t.Fatalf("the peer's mapping differs at byte %d after this side wrote", i)
	}
	// The exporter goes (its mapping is unmapped at exit): this mapping
	// still holds the memory.
	if err := peer.p.Free(exp.ID); err != nil {
		t.Fatal(err)
	}
	if err := peer.p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := driver.MemcpyDtoH(got, m.base); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, mine) {
		t.Fatal("the exporter's exit lost the memory this side maps")
	}
	if err := m.close(true); err != nil {
		t.Fatal(err)
	}
	vmmLive(t, fc, "after the last unmap")
}

// TestVMMFailedImportLeavesNothing: every failure of the import path
// (a descriptor that is not a driver allocation's, a mapping larger than
// the allocation) leaves no handle, reservation, mapping or descriptor.
func TestVMMFailedImportLeavesNothing(t *testing.T) {
	vmmSide(t)
	fc := fakeCounters(t)
	peer := startPeer(t, "cuda")
	l := listenFD(t)
	exp, err := peer.p.VMM(2<<20, driver.HandleTypePOSIXFD)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.p.Free(exp.ID) })
	before := openFDsHere(t)

	f, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Dup(int(f.Fd()))
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := importMap(fd, exp.Length); err == nil || !strings.Contains(err.Error(), "cuMemImportFromShareableHandle") {
		t.Errorf("importing /dev/null: %v, want a cuMemImportFromShareableHandle error", err)
	}
	if fd, err = l.sendFD(peer.p, exp.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := importMap(fd, 2*exp.Length); err == nil || !strings.Contains(err.Error(), "cuMemMap") {
		t.Errorf("mapping twice the allocation: %v, want a cuMemMap error", err)
	}
	if n := openFDsHere(t); n != before {
		t.Errorf("%d descriptors open after the failed imports, %d before", n, before)
	}
	vmmLive(t, fc, "after the failed imports")
}

// TestVMMDescriptorHygiene: many cycles of allocate, export, send,
// import, map, copy, unmap, release and free leave the descriptor counts
// of both processes where they were, and (fake driver) nothing allocated.
func TestVMMDescriptorHygiene(t *testing.T) {
	vmmSide(t)
	fc := fakeCounters(t)
	peer := startPeer(t, "cuda")
	l := listenFD(t)
	cycle := func(i int) {
		t.Helper()
		exp, err := peer.p.VMM(2<<20, driver.HandleTypePOSIXFD)
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := peer.p.Free(exp.ID); err != nil {
				t.Fatal(err)
			}
		}()
		fd, err := l.sendFD(peer.p, exp.ID)
		if err != nil {
			t.Fatal(err)
		}
		m, err := importMap(fd, exp.Length)
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := m.close(false); err != nil {
				t.Fatal(err)
			}
		}()
		want := bytes.Repeat([]byte{byte(i)}, 4096)
		if err := driver.MemcpyHtoD(m.base, want); err != nil {
			t.Fatal(err)
		}
		e := Export{ID: exp.ID, Kind: "cuda", Length: exp.Length}
		if got := peer.read(t, e); !bytes.Equal(got[:4096], want) {
			t.Fatalf("cycle %d: the peer does not see this side's bytes", i)
		}
	}
	for i := range 3 { // warm up: what the first cycles open for good
		cycle(i)
	}
	here := openFDsHere(t)
	there, err := peer.p.FDs()
	if err != nil {
		t.Fatal(err)
	}
	const cycles = 50
	for i := range cycles {
		cycle(i)
	}
	if n := openFDsHere(t); n != here {
		t.Errorf("importer: %d descriptors open after %d cycles, %d before", n, cycles, here)
	}
	if n, err := peer.p.FDs(); err != nil || n != there {
		t.Errorf("exporter: %d descriptors open after %d cycles, %d before (%v)", n, cycles, there, err)
	}
	vmmLive(t, fc, fmt.Sprintf("after %d cycles", cycles))
	if fc != nil && fc.get(cVMMImport) < cycles {
		t.Errorf("%d imports counted, want at least %d", fc.get(cVMMImport), cycles)
	}
}

// TestVMMEngine: the copy engine's CUDAFD regions (what the sidecar
// registers from a RegionDescriptors message). The peer allocates one VMM
// allocation per layer, as vLLM 0.34's extensible KV cache does with one
// physical allocation per segment, and sends their descriptors; the
// engine imports, maps and bounds them, stores and loads byte-exact, and
// an Unregister (and the engine's Close, for a region still registered)
// unmaps, frees and releases everything it made. Refused registrations
// (a descriptor that is no allocation's, a declared size past the
// allocation or off the granularity) leave nothing either.
func TestVMMEngine(t *testing.T) {
	fc := fakeCounters(t)
	c, pool := newCUDA(t, 8<<20, cuda.CopyAuto)
	peer := startPeer(t, "cuda")
	l := listenFD(t)
	const layers, page = 3, 64 << 10 // a page: 64 KiB of each layer
	var exps []VMMExport
	for range layers {
		exp, err := peer.p.VMM(2<<20, driver.HandleTypePOSIXFD)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { peer.p.Free(exp.ID) })
		exps = append(exps, exp)
	}
	rng := rand.New(rand.NewPCG(21, 22))
	datas := make([][]byte, layers)
	for i, exp := range exps {
		datas[i] = randBytes(rng, exp.Length)
		peer.write(t, Export{ID: exp.ID, Kind: "cuda", Length: exp.Length}, datas[i])
	}
	before := openFDsHere(t)
	// region builds the region over the allocations with freshly sent
	// descriptors; size overrides allocation 0's declared size.
	region := func(size uint64, fd0 int) (gpu.Region, []int) {
		t.Helper()
		base := exps[0].Base
		for _, e := range exps {
			base = min(base, e.Base)
		}
		r := gpu.Region{Kind: gpu.CUDAFD, PID: exps[0].PID, Base: base, PageSize: layers * page, PageCount: 16}
		r.IPC.GPU = exps[0].GPU
		var fds []int
		for i, e := range exps {
			fd, err := l.sendFD(peer.p, e.ID)
			if err != nil {
				t.Fatal(err)
			}
			fds = append(fds, fd)
			a := gpu.IPCAllocation{FD: fd, Base: e.Base, Size: e.Length}
			if i == 0 {
				a.Size = size
				if fd0 >= 0 {
					a.FD = fd0
				}
			}
			r.IPC.Allocations = append(r.IPC.Allocations, a)
			r.Segments = append(r.Segments, gpu.Segment{Offset: e.Base - base, Stride: page, Length: page})
			r.Length = max(r.Length, e.Base-base+e.Length)
		}
		return r, fds
	}
	closeAll := func(fds []int) {
		for _, fd := range fds {
			syscall.Close(fd)
		}
	}

	// Refusals first: each leaves nothing made.
	null, err := syscall.Open("/dev/null", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, c2 := range []struct {
		what string
		size uint64
		fd0  int
		want error
	}{
		{"a descriptor of /dev/null", exps[0].Length, null, gpu.ErrUnsupported},
		{"a size past the allocation", 2 * exps[0].Length, -1, gpu.ErrInvalidRegion},
		{"a size off the granularity", exps[0].Length - 4096, -1, gpu.ErrInvalidRegion},
	} {
		r, fds := region(c2.size, c2.fd0)
		_, err := c.Register(r)
		closeAll(fds)
		if !errors.Is(err, c2.want) {
			t.Errorf("%s: Register = %v, want %v", c2.what, err, c2.want)
		} else {
			t.Logf("%s: %v", c2.what, err)
		}
		vmmLive(t, fc, c2.what)
	}
	syscall.Close(null)

	r, fds := region(exps[0].Length, -1)
	h, err := c.Register(r)
	closeAll(fds) // at once: the imports hold the memory
	if err != nil {
		t.Fatal(err)
	}
	// Store 8 pages into pool blocks 7..0 and compare with the peer's bytes.
	pages := []uint32{0, 3, 5, 8, 10, 12, 14, 15}
	offs := make([]uint64, len(pages))
	for i := range pages {
		offs[i] = uint64(len(pages)-1-i) * layers * page
	}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.EngineToPool, Region: h, Pages: pages, PoolOffsets: offs}); err != nil {
		t.Fatal(err)
	}
	for i, p := range pages {
		for k := range layers {
			got := pool[offs[i]+uint64(k)*page:][:page]
			if !bytes.Equal(got, datas[k][uint64(p)*page:][:page]) {
				t.Fatalf("stored page %d, layer %d differs", p, k)
			}
		}
	}
	// Load them back into other pages and read them through the peer.
	into := []uint32{1, 2, 4, 6, 7, 9, 11, 13}
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: into, PoolOffsets: offs}); err != nil {
		t.Fatal(err)
	}
	for k, e := range exps {
		got := peer.read(t, Export{ID: e.ID, Kind: "cuda", Length: e.Length})
		for i, p := range into {
			if !bytes.Equal(got[uint64(p)*page:][:page], datas[k][uint64(pages[i])*page:][:page]) {
				t.Fatalf("loaded page %d, layer %d differs", p, k)
			}
		}
	}
	// Every copy is bounded by the region: page 16 is past it.
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{16}, PoolOffsets: []uint64{0}}); !errors.Is(err, gpu.ErrOutOfBounds) {
		t.Errorf("a page past the region: %v, want ErrOutOfBounds", err)
	}
	if err := c.Unregister(h); err != nil {
		t.Fatal(err)
	}
	vmmLive(t, fc, "after Unregister")
	// (The stand-in keeps a descriptor of each imported memfd while it is
	// imported: its "physical memory". Counted once everything is gone.)
	if n := openFDsHere(t); n != before {
		t.Errorf("%d descriptors open after Unregister, %d before", n, before)
	}

	// A region still registered when the engine closes is released too.
	r, fds = region(exps[0].Length, -1)
	_, err = c.Register(r)
	closeAll(fds)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	vmmLive(t, fc, "after the engine's Close")
	if n := openFDsHere(t); n != before {
		t.Errorf("%d descriptors open at the end, %d before", n, before)
	}
}
