package host

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/gpu/internal/procmem"
	"github.com/ringside-kv/ringside/internal/shm"
)

// BenchmarkHostCopy stores 1 MiB as 64 pages of 16 KiB from this process,
// with adjacent pages merged into one range vs one iovec per page.
func BenchmarkHostCopy(b *testing.B) {
	const total, page = 1 << 20, 16 << 10
	const n = total / page
	for _, bc := range []struct {
		name    string
		noMerge bool
	}{{"merged", false}, {"unmerged", true}} {
		b.Run(bc.name, func(b *testing.B) {
			engine := mmapAnon(b, total)
			fill(engine, 1, 0)
			h := newHost(b, mmapAnon(b, total))
			h.noMerge = bc.noMerge
			hd, err := h.Register(gpu.Region{Kind: gpu.HostProcess, PID: os.Getpid(), Base: procmem.Addr(engine),
				Length: total, PageSize: page, PageCount: n})
			if err != nil {
				b.Fatal(err)
			}
			op := gpu.Op{Dir: gpu.EngineToPool, Region: hd, Pages: make([]uint32, n), PoolOffsets: make([]uint64, n)}
			for i := range n {
				op.Pages[i], op.PoolOffsets[i] = uint32(i), uint64(i*page)
			}
			b.SetBytes(total)
			b.ReportAllocs()
			var ranges int
			for b.Loop() {
				res, err := gpu.Do(h, op)
				if err != nil {
					b.Fatal(err)
				}
				ranges = res.Ranges
			}
			b.ReportMetric(float64(ranges), "iovecs/op")
		})
	}
}

// BenchmarkHostCopyFirstTouch stores 1 MiB (64 pages of 16 KiB, merged)
// from this process into pool memory that has never been written: a sparse
// shared-memory file, as the sidecar's pool is by default, against the same
// file reserved ahead (shm.Mapping.Reserve, `ringside serve --pool.reserve`).
// Every iteration writes the next untouched MiB; the pool is recreated,
// outside the timer, when it has all been written.
func BenchmarkHostCopyFirstTouch(b *testing.B) {
	const total, page, poolBytes = 1 << 20, 16 << 10, 256 << 20
	const n = total / page
	dir := "/dev/shm"
	if _, err := os.Stat(dir); err != nil {
		dir = b.TempDir()
	}
	for _, reserve := range []bool{false, true} {
		name := "sparse"
		if reserve {
			name = "reserved"
		}
		b.Run(name, func(b *testing.B) {
			engine := mmapAnon(b, total)
			fill(engine, 1, 0)
			path := filepath.Join(dir, fmt.Sprintf("ringside-bench-pool-%d", os.Getpid()))
			var pool *shm.Mapping
			var h *Engine
			var hd gpu.Handle
			fresh := func() {
				if pool != nil {
					h.Close()
					pool.Close()
				}
				shm.Unlink(path)
				var err error
				if pool, err = shm.Create(path, poolBytes, 0o600); err != nil {
					b.Fatal(err)
				}
				if reserve {
					if err := pool.Reserve(); err != nil {
						b.Fatal(err)
					}
				}
				if h, err = New(pool.Bytes(), Options{}); err != nil {
					b.Fatal(err)
				}
				if hd, err = h.Register(gpu.Region{Kind: gpu.HostProcess, PID: os.Getpid(), Base: procmem.Addr(engine),
					Length: total, PageSize: page, PageCount: n}); err != nil {
					b.Fatal(err)
				}
			}
			fresh()
			defer func() { h.Close(); pool.Close(); shm.Unlink(path) }()
			op := gpu.Op{Dir: gpu.EngineToPool, Pages: make([]uint32, n), PoolOffsets: make([]uint64, n)}
			b.SetBytes(total)
			at := 0
			for b.Loop() {
				if at+total > poolBytes {
					b.StopTimer()
					fresh()
					at = 0
					b.StartTimer()
				}
				op.Region = hd
				for i := range n {
					op.Pages[i], op.PoolOffsets[i] = uint32(i), uint64(at+i*page)
				}
				if _, err := gpu.Do(h, op); err != nil {
					b.Fatal(err)
				}
				at += total
			}
		})
	}
}
