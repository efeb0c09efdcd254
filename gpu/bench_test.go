package gpu

import (
	"os"
	"testing"

	"github.com/ringside-kv/ringside/gpu/internal/procmem"
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
			hd, err := h.Register(Region{Kind: HostProcess, PID: os.Getpid(), Base: procmem.Addr(engine),
				Length: total, PageSize: page, PageCount: n})
			if err != nil {
				b.Fatal(err)
			}
			op := Op{Dir: EngineToPool, Region: hd, Pages: make([]uint32, n), PoolOffsets: make([]uint64, n)}
			for i := range n {
				op.Pages[i], op.PoolOffsets[i] = uint32(i), uint64(i*page)
			}
			b.SetBytes(total)
			b.ReportAllocs()
			var ranges int
			for b.Loop() {
				res, err := Do(h, op)
				if err != nil {
					b.Fatal(err)
				}
				ranges = res.Ranges
			}
			b.ReportMetric(float64(ranges), "iovecs/op")
		})
	}
}
