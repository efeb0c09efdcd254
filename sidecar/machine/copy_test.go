package machine_test

import (
	"bytes"
	"testing"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/machine/machinetest"
)

// TestChunksByRegionKind: a region whose handle RegionKind reports as CUDA
// IPC is copied in chunks of CUDAChunkBytes, a host region in chunks of
// ChunkBytes; either way every page gets its own block's bytes (the Env
// fails the test on a copy larger than its region kind's chunk).
func TestChunksByRegionKind(t *testing.T) {
	const (
		page  = 4096
		pages = 16
		host  = 2 * page // 8 host chunks of 16 pages
		cuda  = 8 * page // 2 CUDA chunks
	)
	// A Machine with a CUDA chunk size and a RegionKind that says which
	// of the test's regions are "device memory" (the Env copies them like
	// any other).
	cudaBase := map[uint64]bool{}
	d := newPure(t)
	var env *machinetest.Env
	env = machinetest.New(t, machinetest.Config{
		Cache: cache.Config{Capacity: 64, DeltaLogSize: 1 << 10, WriteTimeout: machine.DefaultLeaseTTL, Epoch: 1, MaxLogBytes: 1 << 20},
		Machine: machine.Config{SlotBytes: page, ChunkBytes: host, CUDAChunkBytes: cuda, RegionKind: func(h gpu.Handle) gpu.Kind {
			if cudaBase[env.Region(h).Base] {
				return gpu.CUDAIPC
			}
			return gpu.HostProcess
		}},
		Host: d.host,
	})
	n := d.node(env)
	ss, err := n.Attach(scenario.AttachOptions{Instance: "e", Model: "m", Layout: "l", Role: schema.RoleClient, WorldSize: 1, DigestWidth: 16})
	if err != nil {
		t.Fatal(err)
	}
	s := ss.Client()
	mem := map[uint32]scenario.Memory{}
	for id := uint32(1); id <= 4; id++ {
		m := d.Memory(pages * page)
		if id%2 == 0 {
			cudaBase[m.Base()] = true
		}
		mem[id] = m
		if err := s.RegisterRegion(schema.RegisterRegion{Region: id, Kind: schema.RegionHostProcess, PID: purePID, Base: m.Base(),
			Length: pages * page, PageSize: page, PageCount: pages}); err != nil {
			t.Fatal(err)
		}
	}
	all := make([]uint32, pages)
	reversed := make([]uint32, pages)
	for i := range all {
		all[i] = uint32(i)
		reversed[i] = uint32(pages - 1 - i)
	}
	copies := func(t *testing.T, what string, want uint64, f func() error) {
		t.Helper()
		before := env.M.Counters().CopiesStarted
		if err := f(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := env.M.Counters().CopiesStarted - before; got != want {
			t.Fatalf("%s: %d chunks, want %d", what, got, want)
		}
	}
	for _, tt := range []struct {
		name          string
		from, to      uint32 // regions: stored from, loaded into
		store, load   uint64 // chunks
		batch, digest int
	}{
		{"host to host", 1, 3, pages * page / host, pages * page / host, 1, 0},
		{"cuda to cuda", 2, 4, pages * page / cuda, pages * page / cuda, 2, 100},
		{"host to cuda", 1, 4, pages * page / host, pages * page / cuda, 3, 200},
		{"cuda to host", 2, 3, pages * page / cuda, pages * page / host, 4, 300},
	} {
		t.Run(tt.name, func(t *testing.T) {
			src := mem[tt.from].Bytes()
			for i := range src {
				src[i] = byte(tt.digest + i/page*7 + i%251)
			}
			var digests []byte
			for i := range pages {
				dg := make([]byte, 16)
				dg[0], dg[1] = byte(tt.batch), byte(i)
				digests = append(digests, dg...)
			}
			if _, err := s.PutHashesFlags(uint64(tt.batch), digests, schema.FlagReplace); err != nil {
				t.Fatal(err)
			}
			v := schema.View{Batch: uint64(tt.batch), Count: pages}
			copies(t, "store", tt.store, func() error {
				r, err := s.Store(v, tt.from, all)
				if err == nil && r.Stored != pages {
					t.Fatalf("stored %d of %d", r.Stored, pages)
				}
				return err
			})
			l, err := s.Acquire(v, 0)
			if err != nil || l.State != schema.StateReady {
				t.Fatalf("acquire: %+v %v", l, err)
			}
			copies(t, "load", tt.load, func() error {
				n, err := s.Load(l.Lease, tt.to, 0, reversed)
				if err == nil && n != pages {
					t.Fatalf("loaded %d of %d", n, pages)
				}
				return err
			})
			dst := mem[tt.to].Bytes()
			for i, p := range reversed {
				if !bytes.Equal(dst[int(p)*page:int(p+1)*page], src[i*page:(i+1)*page]) {
					t.Fatalf("page %d does not hold block %d", p, i)
				}
			}
			// A page named twice, in two chunks: it gets one of the two
			// blocks, whole.
			twice := append([]uint32(nil), all...)
			twice[pages-1] = 0
			copies(t, "load naming a page twice", tt.load, func() error {
				_, err := s.Load(l.Lease, tt.to, 0, twice)
				return err
			})
			got := dst[:page]
			if !bytes.Equal(got, src[:page]) && !bytes.Equal(got, src[(pages-1)*page:]) {
				t.Fatal("a page named twice holds neither of its blocks")
			}
			if err := s.Release(l.Lease); err != nil {
				t.Fatal(err)
			}
		})
	}
}
