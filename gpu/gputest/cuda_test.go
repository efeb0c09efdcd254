package gputest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/cuda"
)

// underFake reports whether this process runs against testdata/fakecuda.c.
func underFake() bool { return os.Getenv("RINGSIDE_GPUTEST_FAKE") != "" }

// The fake driver's per-call counters (enum counter in fakecuda.c).
const (
	cMagic = iota
	cBatch
	cRange
	cIPCOpen
	cIPCClose
	cEventOpen
	cEventClose
	cWaitEvent
	cDeferred
	nCounters
)

// counters reads this process's fake driver counters; nil without them
// (a real driver), and then get returns 0.
type counters struct{ path string }

func fakeCounters(t testing.TB) *counters {
	d := os.Getenv("FAKECUDA_COUNTERS")
	if d == "" || !underFake() {
		return nil
	}
	return &counters{path: filepath.Join(d, itoa(os.Getpid()))}
}

func itoa(n int) string {
	b := []byte{}
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

func (c *counters) get(i int) uint64 {
	if c == nil {
		return 0
	}
	b, err := os.ReadFile(c.path)
	if err != nil || len(b) < 8*nCounters || binary.LittleEndian.Uint64(b) != 0x544e434b41464b46 {
		return 0
	}
	return binary.LittleEndian.Uint64(b[8*i:])
}

func newCUDA(t *testing.T, poolSize int, mode cuda.CopyMode) (*cuda.Engine, []byte) {
	t.Helper()
	pool := mapPool(t, poolSize)
	c, err := cuda.New(pool, cuda.Options{Copy: mode})
	if err != nil {
		if errors.Is(err, cuda.ErrUnavailable) && !requireGPU() {
			t.Skipf("no GPU: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, pool
}

func startPeerEnv(t testing.TB, kind string, env ...string) *peerSide {
	t.Helper()
	p, err := StartPeer(kind, []string{os.Args[0], "-test.run=^$"}, env...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("%s peer: %v", kind, err)
		}
	})
	return &peerSide{p: p, dir: t.TempDir()}
}

// TestCUDALayers: a region over 32 allocations, one per layer, each
// holding the K pages of every block and then the V pages (vLLM's
// FlashAttention layout: two segments per layer), stores and loads
// byte-exact through the peer, and a batched op is one cuMemcpyBatchAsync.
func TestCUDALayers(t *testing.T) {
	c, pool := newCUDA(t, 16<<20, cuda.CopyAuto)
	peer := startPeer(t, "cuda")
	const layers, pages, pageLen = 32, 64, 2048 // a block is 32*2*2 KiB = 128 KiB
	exps, err := peer.p.AllocN(layers, 2*pages*pageLen)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range exps {
		t.Cleanup(func() { peer.p.Free(e.ID) })
	}
	base, end := exps[0].Base, uint64(0)
	for _, e := range exps {
		base = min(base, e.Base)
		end = max(end, e.Base+e.Length)
	}
	r := gpu.Region{Kind: gpu.CUDAIPC, PID: exps[0].PID, Base: base, Length: end - base, PageSize: 2 * layers * pageLen, PageCount: pages}
	r.IPC.GPU = exps[0].IPC.GPU
	for _, e := range exps {
		r.IPC.Allocations = append(r.IPC.Allocations, e.Alloc())
		off := e.Base - base
		r.Segments = append(r.Segments,
			gpu.Segment{Offset: off, Stride: pageLen, Length: pageLen},
			gpu.Segment{Offset: off + pages*pageLen, Stride: pageLen, Length: pageLen})
	}
	fc := fakeCounters(t)
	opened, closed := fc.get(cIPCOpen), fc.get(cIPCClose)
	h, err := c.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	if n := fc.get(cIPCOpen) - opened; fc != nil && n != layers {
		t.Errorf("Register opened %d handles, want %d (one per allocation)", n, layers)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	engine := make([][]byte, layers)
	for l, e := range exps {
		engine[l] = randBytes(rng, e.Length)
		peer.write(t, e, engine[l])
	}
	// Store 16 random pages into consecutive blocks.
	const k = 16
	pg := rng.Perm(pages)[:k]
	op := gpu.Op{Dir: gpu.EngineToPool, Region: h, Pages: make([]uint32, k), PoolOffsets: make([]uint64, k)}
	for i := range k {
		op.Pages[i], op.PoolOffsets[i] = uint32(pg[i]), uint64(i)*r.PageSize
	}
	fillByte(pool, poisonPool)
	batches := fc.get(cBatch)
	res, err := gpu.Do(c, op)
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Repeat([]byte{poisonPool}, len(pool))
	for i, p := range op.Pages {
		at := op.PoolOffsets[i]
		for l := range layers {
			for _, kv := range []uint64{0, pages * pageLen} {
				at += uint64(copy(want[at:], engine[l][kv+uint64(p)*pageLen:][:pageLen]))
			}
		}
	}
	if i, bad := firstDiff(pool, want); bad {
		t.Fatalf("store differs at pool byte %d (block %d)", i, uint64(i)/r.PageSize)
	}
	if res.Ranges != k*2*layers {
		t.Errorf("store: %d ranges, want %d (one per segment and page: nothing is contiguous on both sides)", res.Ranges, k*2*layers)
	}
	if c.Info().Batch && fc != nil {
		if n := fc.get(cBatch) - batches; n != 1 || res.Calls != 1 {
			t.Errorf("a batched store of %d ranges made %d cuMemcpyBatchAsync calls and reported %d, want 1", res.Ranges, n, res.Calls)
		}
	}
	// Load random blocks into other pages of poisoned engine memory.
	src := randBytes(rng, uint64(len(pool)))
	copy(pool, src)
	for l, e := range exps {
		engine[l] = bytes.Repeat([]byte{poisonEngine}, int(e.Length))
		peer.write(t, e, engine[l])
	}
	pg = rng.Perm(pages)[:k]
	op = gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: make([]uint32, k), PoolOffsets: make([]uint64, k)}
	for i := range k {
		op.Pages[i], op.PoolOffsets[i] = uint32(pg[i]), uint64(k-1-i)*r.PageSize
	}
	if _, err := gpu.Do(c, op); err != nil {
		t.Fatal(err)
	}
	for i, p := range op.Pages {
		at := op.PoolOffsets[i]
		for l := range layers {
			for _, kv := range []uint64{0, pages * pageLen} {
				at += uint64(copy(engine[l][kv+uint64(p)*pageLen:][:pageLen], src[at:at+pageLen]))
			}
		}
	}
	for l, e := range exps {
		if i, bad := firstDiff(peer.read(t, e), engine[l]); bad {
			t.Fatalf("load: layer %d differs at byte %d", l, i)
		}
	}
	if err := c.Unregister(h); err != nil {
		t.Fatal(err)
	}
	if n := fc.get(cIPCClose) - closed; fc != nil && n != layers {
		t.Errorf("Unregister closed %d handles, want %d", n, layers)
	}
}

// TestCUDAAdjacentAllocations: two allocations adjacent in the engine's
// address space are two mappings here; a range that ends one and a range
// that starts the next, contiguous in the engine and in the pool, are two
// copies, and each lands from its own allocation.
func TestCUDAAdjacentAllocations(t *testing.T) {
	c, pool := newCUDA(t, 4<<20, cuda.CopyAuto)
	peer := startPeer(t, "cuda")
	const pageLen, size = 4096, 32 << 10
	exps, err := peer.p.AllocN(2, size)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range exps {
		t.Cleanup(func() { peer.p.Free(e.ID) })
	}
	// The engine declares B right after A (the region is a description:
	// the sidecar reaches each allocation through its own handle).
	a, b := exps[0].Alloc(), exps[1].Alloc()
	b.Base = a.Base + size
	// One page: its first segment is A's last 4 KiB, its second B's first.
	r := gpu.Region{Kind: gpu.CUDAIPC, PID: exps[0].PID, Base: a.Base, Length: 2 * size, PageSize: 2 * pageLen, PageCount: 1,
		Segments: []gpu.Segment{{Offset: size - pageLen, Length: pageLen}, {Offset: size, Length: pageLen}}}
	r.IPC.GPU, r.IPC.Allocations = exps[0].IPC.GPU, []gpu.IPCAllocation{a, b}
	h, err := c.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Unregister(h)
	rng := rand.New(rand.NewPCG(5, 6))
	da, db := randBytes(rng, size), randBytes(rng, size)
	peer.write(t, exps[0], da)
	peer.write(t, exps[1], db)
	fillByte(pool, poisonPool)
	res, err := gpu.Do(c, gpu.Op{Dir: gpu.EngineToPool, Region: h, Pages: []uint32{0}, PoolOffsets: []uint64{0}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Ranges != 2 {
		t.Errorf("%d ranges, want 2: ranges of two allocations were merged", res.Ranges)
	}
	want := append(append([]byte(nil), da[size-pageLen:]...), db[:pageLen]...)
	if i, bad := firstDiff(pool[:2*pageLen], want); bad {
		t.Fatalf("store differs at byte %d (%s)", i, map[bool]string{true: "allocation A", false: "allocation B"}[i < pageLen])
	}
}

// TestCUDAStoreEvent: a region with the engine's store event makes a
// store's copies wait until the event's latest record completes; a load
// is not delayed by it. The fake holds the exporter's record incomplete
// while a file exists (FAKECUDA_EVENT_HOLD); a real engine would be a
// kernel still writing the pages.
func TestCUDAStoreEvent(t *testing.T) {
	if !underFake() {
		t.Skip("holding an event incomplete on purpose needs the fake driver (probe ipc-event checks a real one)")
	}
	c, pool := newCUDA(t, 4<<20, cuda.CopyAuto)
	hold := filepath.Join(t.TempDir(), "hold")
	peer := startPeerEnv(t, "cuda", "FAKECUDA_EVENT_HOLD="+hold)
	ev, err := peer.p.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	const pageLen, pages = 64 << 10, 8
	exp := peer.alloc(t, pageLen*pages, 0)
	r := exp.Region(pageLen, pages, nil)
	r.IPC.Event, r.IPC.HasEvent = ev.Handle, true
	fc := fakeCounters(t)
	events := fc.get(cEventOpen) - fc.get(cEventClose)
	// An event handle that cannot be opened refuses the region, and the
	// allocation opened before it is closed again.
	mapped := fc.get(cIPCOpen) - fc.get(cIPCClose)
	bad := r
	bad.IPC.Event[10] ^= 0x20
	if _, err := c.Register(bad); !errors.Is(err, gpu.ErrUnsupported) || !strings.Contains(err.Error(), "cuIpcOpenEventHandle") {
		t.Fatalf("Register with a corrupted event handle = %v, want ErrUnsupported naming cuIpcOpenEventHandle", err)
	}
	if n := fc.get(cIPCOpen) - fc.get(cIPCClose); n != mapped {
		t.Fatalf("a refused event left %d mappings open", n-mapped)
	}
	h, err := c.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	data := randBytes(rand.New(rand.NewPCG(7, 8)), pageLen*pages)
	peer.write(t, exp, data)
	fillByte(pool, poisonPool)
	// The engine is "still writing": its record does not complete.
	if err := os.WriteFile(hold, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := peer.p.Record(ev.ID); err != nil {
		t.Fatal(err)
	}
	waits := fc.get(cWaitEvent)
	stored := make(chan gpu.Result, 1)
	if err := c.Submit(gpu.Op{Dir: gpu.EngineToPool, Region: h, Pages: []uint32{0, 1}, PoolOffsets: []uint64{0, pageLen}}, func(r gpu.Result) { stored <- r }); err != nil {
		t.Fatal(err)
	}
	// A load on the same region, issued after the store, is not held.
	copy(pool[4*pageLen:5*pageLen], bytes.Repeat([]byte{0x77}, pageLen))
	t0 := time.Now()
	if _, err := gpu.Do(c, gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: []uint32{5}, PoolOffsets: []uint64{4 * pageLen}}); err != nil {
		t.Fatal(err)
	}
	t.Logf("load behind a held store event took %v", time.Since(t0))
	select {
	case res := <-stored:
		t.Fatalf("the store completed while the engine's event was incomplete: %+v", res)
	case <-time.After(100 * time.Millisecond):
	}
	for i, v := range pool[:2*pageLen] {
		if v != poisonPool {
			t.Fatalf("pool byte %d was written before the engine's event completed", i)
		}
	}
	if fc.get(cWaitEvent)-waits != 1 {
		t.Errorf("%d cuStreamWaitEvent calls for one store, want 1", fc.get(cWaitEvent)-waits)
	}
	// The engine's work finishes: the store's copies run.
	if err := os.Remove(hold); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-stored:
		if res.Err != nil {
			t.Fatal(res.Err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the store did not complete after the event did")
	}
	if !bytes.Equal(pool[:2*pageLen], data[:2*pageLen]) {
		t.Fatal("the store's bytes are wrong")
	}
	if got := peer.read(t, exp); !bytes.Equal(got[5*pageLen:6*pageLen], pool[4*pageLen:5*pageLen]) {
		t.Fatal("the load's bytes are wrong")
	}
	if err := c.Unregister(h); err != nil {
		t.Fatal(err)
	}
	if n := fc.get(cEventOpen) - fc.get(cEventClose); n != events {
		t.Errorf("Unregister left %d opened events", n-events)
	}
}

// TestCUDAExport: memory legacy IPC cannot share (VMM memory: cuMemCreate,
// PyTorch's expandable segments) fails at export, in the engine: the
// sidecar never sees a handle of it.
func TestCUDAExport(t *testing.T) {
	if !underFake() {
		t.Skip("needs the fake driver's VMM allocations (probe vmm-export checks a real one)")
	}
	newCUDA(t, 1<<20, cuda.CopyAuto) // the same skip rules as the other CUDA tests
	peer := startPeerEnv(t, "cuda", "FAKECUDA_VMM=1")
	_, err := peer.p.Alloc(1<<20, 0)
	if err == nil || !strings.Contains(err.Error(), "cuIpcGetMemHandle") || !strings.Contains(err.Error(), "CUDA_ERROR_INVALID_VALUE") ||
		!strings.Contains(err.Error(), "CAPABLE false") {
		t.Fatalf("exporting VMM memory: %v, want cuIpcGetMemHandle failing with CUDA_ERROR_INVALID_VALUE", err)
	}
	t.Log(err)
}
