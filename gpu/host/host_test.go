package host

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/internal/procmem"
	"golang.org/x/sys/unix"
)

const helperEnv = "RINGSIDE_GPU_TEST_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "":
		os.Exit(m.Run())
	case "exit":
		os.Exit(0)
	case "child":
		os.Exit(helperChild())
	default:
		os.Exit(3)
	}
}

// pattern is the test fill byte at offset off of a buffer under seed.
func pattern(seed byte, off uint64) byte { return byte(off*31+off>>9) ^ seed }

func fill(b []byte, seed byte, base uint64) {
	for i := range b {
		b[i] = pattern(seed, base+uint64(i))
	}
}

// mmapAnon returns page-aligned memory outside the Go heap.
func mmapAnon(t testing.TB, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func newHost(t testing.TB, pool []byte) *Engine {
	t.Helper()
	h, err := New(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// validShared is a gpu.HostShared region of 4 pages of 1 KiB.
func validShared() gpu.Region {
	return gpu.Region{Kind: gpu.HostShared, Base: 0, Length: 4096, PageSize: 1024, PageCount: 4, Mapped: make([]byte, 4096)}
}

// validCUDA is a flat CUDA IPC region of 4 pages of 1 KiB in one
// allocation of 8 KiB.
func validCUDA() gpu.Region {
	r := gpu.Region{Kind: gpu.CUDAIPC, PID: 1, Base: 1 << 40, Length: 4096, PageSize: 1024, PageCount: 4}
	r.IPC.Allocations = []gpu.IPCAllocation{{Handle: [64]byte{1}, Base: 1 << 40, Size: 8192}}
	return r
}

// layered is a 2-segment layout over a buffer of 2*pages*seg bytes: segment
// 0 ("K") of page p at p*seg, segment 1 ("V") at pages*seg + p*seg.
func layered(base uint64, pages uint32, seg uint64) gpu.Region {
	return gpu.Region{Base: base, Length: 2 * uint64(pages) * seg, PageSize: 2 * seg, PageCount: pages,
		Segments: []gpu.Segment{{Offset: 0, Stride: seg, Length: seg}, {Offset: uint64(pages) * seg, Stride: seg, Length: seg}}}
}

// wantBlock is what the pool block of page p holds after a store from a
// layered buffer filled with pattern(seed, off).
func wantBlock(seed byte, pages uint32, seg uint64, p uint32) []byte {
	b := make([]byte, 2*seg)
	fill(b[:seg], seed, uint64(p)*seg)
	fill(b[seg:], seed, uint64(pages)*seg+uint64(p)*seg)
	return b
}

func TestHostSharedBothDirections(t *testing.T) {
	for _, layout := range []string{"flat", "layered"} {
		t.Run(layout, func(t *testing.T) {
			const pages, seg = 8, 256
			engine := make([]byte, 2*pages*seg+100)
			fill(engine[100:], 1, 0)
			r := layered(100, pages, seg)
			if layout == "flat" {
				r.Segments = nil
			}
			r.Kind, r.Mapped = gpu.HostShared, engine
			pool := make([]byte, 4*2*seg)
			h := newHost(t, pool)
			hd, err := h.Register(r)
			if err != nil {
				t.Fatal(err)
			}
			// Store pages 5, 2, 3 into pool blocks 0, 2, 3.
			res, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{5, 2, 3}, PoolOffsets: []uint64{0, 1024, 1536}})
			if err != nil {
				t.Fatal(err)
			}
			if res.Bytes != 3*2*seg {
				t.Errorf("Bytes = %d, want %d", res.Bytes, 3*2*seg)
			}
			for i, p := range []uint32{5, 2, 3} {
				off := []int{0, 1024, 1536}[i]
				var want []byte
				if layout == "flat" {
					want = engine[100+int(p)*2*seg : 100+int(p+1)*2*seg]
				} else {
					want = wantBlock(1, pages, seg, p)
				}
				if !bytes.Equal(pool[off:off+2*seg], want) {
					t.Errorf("pool block for page %d differs", p)
				}
			}
			// Load a new pattern from the pool into pages 0 and 7.
			fill(pool, 9, 0)
			before := append([]byte(nil), engine...)
			if _, err := gpu.Do(h, gpu.Op{Dir: gpu.PoolToEngine, Region: hd, Pages: []uint32{0, 7}, PoolOffsets: []uint64{512, 0}}); err != nil {
				t.Fatal(err)
			}
			// Apply the same load to "before" by hand and compare everything.
			for i, p := range []uint32{0, 7} {
				blk := pool[[]int{512, 0}[i]:][:2*seg]
				if layout == "flat" {
					copy(before[100+int(p)*2*seg:], blk)
				} else {
					copy(before[100+int(p)*seg:], blk[:seg])
					copy(before[100+pages*seg+int(p)*seg:], blk[seg:])
				}
			}
			if !bytes.Equal(engine, before) {
				t.Errorf("engine memory after load differs from expectation")
			}
		})
	}
}

func TestHostBoundsErrors(t *testing.T) {
	pool := make([]byte, 4096)
	h := newHost(t, pool)
	r := validShared()
	hd, err := h.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	sentinel := []byte("untouched")
	copy(pool, sentinel)
	copy(r.Mapped, sentinel)
	tests := []struct {
		name string
		op   gpu.Op
		want error
		idx  int
	}{
		{"unknown region", gpu.Op{Dir: gpu.EngineToPool, Region: hd + 1, Pages: []uint32{0}, PoolOffsets: []uint64{0}}, gpu.ErrUnknownRegion, -1},
		{"bad direction", gpu.Op{Dir: 7, Region: hd, Pages: []uint32{0}, PoolOffsets: []uint64{0}}, gpu.ErrInvalidOp, -1},
		{"mismatched slices", gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{0, 1}, PoolOffsets: []uint64{0}}, gpu.ErrInvalidOp, -1},
		{"page out of range", gpu.Op{Dir: gpu.PoolToEngine, Region: hd, Pages: []uint32{0, 4}, PoolOffsets: []uint64{0, 1024}}, gpu.ErrOutOfBounds, 1},
		{"pool offset past end", gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{0, 1}, PoolOffsets: []uint64{0, 3500}}, gpu.ErrOutOfBounds, 1},
		{"pool offset overflow", gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{0}, PoolOffsets: []uint64{1<<64 - 1}}, gpu.ErrOutOfBounds, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			called := false
			err := h.Submit(tt.op, func(gpu.Result) { called = true })
			var ce *gpu.CopyError
			if !errors.As(err, &ce) || !errors.Is(err, tt.want) || ce.Index != tt.idx {
				t.Fatalf("Submit = %v, want *CopyError index %d wrapping %v", err, tt.idx, tt.want)
			}
			if called {
				t.Fatal("done called for a rejected op")
			}
		})
	}
	// Nothing may have been copied, not even the valid first page.
	if !bytes.Equal(pool[:len(sentinel)], sentinel) || !bytes.Equal(r.Mapped[:len(sentinel)], sentinel) {
		t.Fatal("a rejected op copied bytes")
	}
}

func TestHostLifecycle(t *testing.T) {
	h, err := New(make([]byte, 4096), Options{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Register(validCUDA()); !errors.Is(err, gpu.ErrUnsupported) {
		t.Errorf("Register(CUDAIPC) = %v, want ErrUnsupported", err)
	}
	if _, err := h.Register(gpu.Region{Kind: gpu.HostShared}); !errors.Is(err, gpu.ErrInvalidRegion) {
		t.Errorf("Register(invalid) = %v, want ErrInvalidRegion", err)
	}
	hd, err := h.Register(validShared())
	if err != nil {
		t.Fatal(err)
	}
	// Many concurrent ops, then Unregister must wait for all of them.
	var wg sync.WaitGroup
	var mu sync.Mutex
	done := 0
	for range 100 {
		wg.Add(1)
		if err := h.Submit(gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{1}, PoolOffsets: []uint64{0}}, func(r gpu.Result) {
			mu.Lock()
			done++
			mu.Unlock()
			wg.Done()
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Unregister(hd); err != nil {
		t.Fatal(err)
	}
	if err := h.Unregister(hd); !errors.Is(err, gpu.ErrUnknownRegion) {
		t.Errorf("second Unregister = %v, want ErrUnknownRegion", err)
	}
	wg.Wait()
	if _, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd}); !errors.Is(err, gpu.ErrUnknownRegion) {
		t.Errorf("Submit after Unregister = %v", err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: 1}); !errors.Is(err, os.ErrClosed) {
		t.Errorf("Submit after Close = %v, want os.ErrClosed", err)
	}
	if done != 100 {
		t.Errorf("done called %d times, want 100", done)
	}
}

// TestHostProcessSelf copies to and from this process with process_vm_*.
func TestHostProcessSelf(t *testing.T) {
	const pages, seg = 16, 1024
	engine := mmapAnon(t, 2*pages*seg)
	fill(engine, 3, 0)
	pool := mmapAnon(t, 8*2*seg)
	h := newHost(t, pool)
	r := layered(procmem.Addr(engine), pages, seg)
	r.Kind, r.PID = gpu.HostProcess, os.Getpid()
	hd, err := h.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	pg := []uint32{15, 0, 1, 2, 7}
	offs := []uint64{0, 2048, 4096, 6144, 14336}
	res, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: pg, PoolOffsets: offs})
	if err != nil {
		t.Fatal(err)
	}
	if res.Bytes != int64(len(pg))*2*seg || res.Calls != 1 {
		t.Errorf("Result = %+v, want %d bytes in 1 call", res, len(pg)*2*seg)
	}
	for i, p := range pg {
		if !bytes.Equal(pool[offs[i]:offs[i]+2*seg], wantBlock(3, pages, seg, p)) {
			t.Errorf("page %d: pool block differs", p)
		}
	}
	fill(pool, 4, 0)
	if _, err := gpu.Do(h, gpu.Op{Dir: gpu.PoolToEngine, Region: hd, Pages: []uint32{3}, PoolOffsets: []uint64{2048}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(engine[3*seg:4*seg], pool[2048:2048+seg]) || !bytes.Equal(engine[(pages+3)*seg:(pages+4)*seg], pool[2048+seg:4096]) {
		t.Error("load into own process did not land")
	}
}

// TestHostProcessChunking needs more than IOV_MAX unmergeable ranges.
func TestHostProcessChunking(t *testing.T) {
	const n, sz = 2500, 64
	engine := mmapAnon(t, n*2*sz)
	fill(engine, 5, 0)
	pool := mmapAnon(t, n*sz)
	h := newHost(t, pool)
	// Every other 64-byte slot: engine side is never contiguous.
	r := gpu.Region{Kind: gpu.HostProcess, PID: os.Getpid(), Base: procmem.Addr(engine), Length: n * 2 * sz,
		PageSize: sz, PageCount: n, Segments: []gpu.Segment{{Offset: 0, Stride: 2 * sz, Length: sz}}}
	hd, err := h.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	pg := make([]uint32, n)
	offs := make([]uint64, n)
	for i := range pg {
		pg[i], offs[i] = uint32(i), uint64(i)*sz
	}
	res, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: pg, PoolOffsets: offs})
	if err != nil {
		t.Fatal(err)
	}
	if want := (n + procmem.IOVMax - 1) / procmem.IOVMax; res.Calls != want || res.Ranges != n || res.Bytes != n*sz {
		t.Errorf("Result = %+v, want %d calls, %d ranges, %d bytes", res, want, n, n*sz)
	}
	for i := range n {
		if !bytes.Equal(pool[i*sz:(i+1)*sz], engine[2*i*sz:(2*i+1)*sz]) {
			t.Fatalf("page %d differs", i)
		}
	}
	// Merged case: contiguous engine and pool collapse to one range.
	r2 := gpu.Region{Kind: gpu.HostProcess, PID: os.Getpid(), Base: procmem.Addr(engine), Length: n * sz, PageSize: sz, PageCount: n}
	hd2, err := h.Register(r2)
	if err != nil {
		t.Fatal(err)
	}
	res, err = gpu.Do(h, gpu.Op{Dir: gpu.PoolToEngine, Region: hd2, Pages: pg, PoolOffsets: offs})
	if err != nil || res.Ranges != 1 || res.Calls != 1 {
		t.Errorf("merged: %+v, %v; want 1 range, 1 call", res, err)
	}
}

// TestHostProcessFault: a region whose tail is inaccessible must fail with
// an error naming pid and address, never report success.
func TestHostProcessFault(t *testing.T) {
	ps := os.Getpagesize()
	engine := mmapAnon(t, 4*ps)
	fill(engine, 6, 0)
	if err := unix.Mprotect(engine[3*ps:], unix.PROT_NONE); err != nil {
		t.Fatal(err)
	}
	defer unix.Mprotect(engine[3*ps:], unix.PROT_READ|unix.PROT_WRITE)
	pool := mmapAnon(t, 4*ps)
	h := newHost(t, pool)
	base := procmem.Addr(engine)
	// Pages of two OS pages: page 1 = OS pages 2 (ok) and 3 (PROT_NONE).
	hd, err := h.Register(gpu.Region{Kind: gpu.HostProcess, PID: os.Getpid(), Base: base, Length: uint64(4 * ps), PageSize: uint64(2 * ps), PageCount: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range []gpu.Direction{gpu.EngineToPool, gpu.PoolToEngine} {
		res, err := gpu.Do(h, gpu.Op{Dir: dir, Region: hd, Pages: []uint32{1}, PoolOffsets: []uint64{0}})
		if !errors.Is(err, gpu.ErrTransfer) || !errors.Is(err, unix.EFAULT) {
			t.Fatalf("%v: err = %v, want ErrTransfer wrapping EFAULT", dir, err)
		}
		if res.Bytes >= int64(2*ps) {
			t.Fatalf("%v: reported %d bytes of %d", dir, res.Bytes, 2*ps)
		}
		var pe *procmem.Error
		if !errors.As(err, &pe) || pe.Addr != base+uint64(3*ps) || pe.PID != os.Getpid() {
			t.Errorf("%v: err = %v; want procmem.Error at %#x", dir, err, base+uint64(3*ps))
		}
		if !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
			t.Errorf("error does not name the pid: %v", err)
		}
		t.Logf("%v: %v (bytes %d, calls %d)", dir, err, res.Bytes, res.Calls)
	}
	// Page 0 is fine.
	if _, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{0}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatal(err)
	}
}

func TestHostProcessDeadPID(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=exit")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid // reaped: no longer exists
	h := newHost(t, make([]byte, 4096))
	hd, err := h.Register(gpu.Region{Kind: gpu.HostProcess, PID: pid, Base: 0x10000, Length: 4096, PageSize: 4096, PageCount: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: []uint32{0}, PoolOffsets: []uint64{0}})
	if !errors.Is(err, gpu.ErrTransfer) || !errors.Is(err, unix.ESRCH) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", pid)) {
		t.Fatalf("err = %v, want ErrTransfer/ESRCH naming pid %d", err, pid)
	}
}

// Cross-process: the child owns a layered buffer; the parent stores pages
// from it, loads a new pattern back, and the child verifies.
const childPages, childSeg = 32, 4096

func helperChild() int {
	buf, err := unix.Mmap(-1, 0, 2*childPages*childSeg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		fmt.Println("FAIL mmap", err)
		return 1
	}
	fill(buf, 1, 0)
	fmt.Printf("%d %d\n", os.Getpid(), procmem.Addr(buf))
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 || f[0] != "verify" {
			continue
		}
		// verify <seed> <pool-pattern base per page...>: pages listed were
		// loaded with pattern(seed) from pool offsets; the rest keep seed 1.
		seed, _ := strconv.Atoi(f[1])
		want := make([]byte, len(buf))
		fill(want, 1, 0)
		for _, kv := range f[2:] {
			var p, off uint64
			fmt.Sscanf(kv, "%d:%d", &p, &off)
			fill(want[p*childSeg:(p+1)*childSeg], byte(seed), off)
			fill(want[(childPages+p)*childSeg:(childPages+p+1)*childSeg], byte(seed), off+childSeg)
		}
		if bytes.Equal(buf, want) {
			fmt.Println("OK")
		} else {
			fmt.Println("FAIL content mismatch")
		}
	}
	return 0
}

func TestHostProcessCrossProcess(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=child")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("child: %v", err)
		}
	}()
	out := bufio.NewReader(stdout)
	readLine := func() string {
		t.Helper()
		type line struct {
			s   string
			err error
		}
		ch := make(chan line, 1)
		go func() { s, err := out.ReadString('\n'); ch <- line{s, err} }()
		select {
		case l := <-ch:
			if l.err != nil && l.err != io.EOF {
				t.Fatalf("reading child: %v", l.err)
			}
			return strings.TrimSpace(l.s)
		case <-time.After(30 * time.Second):
			t.Fatal("child did not answer")
		}
		return ""
	}
	var pid int
	var addr uint64
	if _, err := fmt.Sscanf(readLine(), "%d %d", &pid, &addr); err != nil {
		t.Fatal(err)
	}
	pool := mmapAnon(t, 8*2*childSeg)
	h := newHost(t, pool)
	r := layered(addr, childPages, childSeg)
	r.Kind, r.PID = gpu.HostProcess, pid
	hd, err := h.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	pg := []uint32{0, 1, 2, 17, 31}
	offs := []uint64{0, 2 * childSeg, 4 * childSeg, 6 * childSeg, 10 * childSeg}
	res, err := gpu.Do(h, gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: pg, PoolOffsets: offs})
	if errors.Is(err, unix.EPERM) {
		scope, _ := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
		t.Skipf("process_vm_readv on child denied (need ptrace permission; yama ptrace_scope=%q): %v", strings.TrimSpace(string(scope)), err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("store: %d bytes, %d ranges, %d calls, %v", res.Bytes, res.Ranges, res.Calls, res.Elapsed)
	for i, p := range pg {
		if !bytes.Equal(pool[offs[i]:offs[i]+2*childSeg], wantBlock(1, childPages, childSeg, p)) {
			t.Errorf("page %d: pool block differs from child memory", p)
		}
	}
	// Load seed-2 blocks into pages 5 and 30.
	var verify strings.Builder
	verify.WriteString("verify 2")
	for _, pp := range []struct {
		page uint32
		off  uint64
	}{{5, 2 * childSeg}, {30, 8 * childSeg}} {
		fill(pool[pp.off:pp.off+2*childSeg], 2, pp.off)
		if _, err := gpu.Do(h, gpu.Op{Dir: gpu.PoolToEngine, Region: hd, Pages: []uint32{pp.page}, PoolOffsets: []uint64{pp.off}}); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&verify, " %d:%d", pp.page, pp.off)
	}
	fmt.Fprintln(stdin, verify.String())
	if got := readLine(); got != "OK" {
		t.Fatalf("child verification: %q", got)
	}
}
