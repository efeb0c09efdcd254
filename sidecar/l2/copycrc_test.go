package l2

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"testing"
	"time"
)

// TestCopyCRC: both copies leave dst equal to src, touch nothing past it,
// and return src's CRC32C, at lengths around their 16 KiB pieces and at
// unaligned destinations.
func TestCopyCRC(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 4095, 4096, 16<<10 - 1, 16 << 10, 16<<10 + 1, 192 << 10, 640<<10 + 123} {
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(rng.Uint32())
		}
		want := crc32.Checksum(src, castagnoli)
		for _, off := range []int{0, 1, 33} {
			for name, f := range map[string]func(dst, src []byte) uint32{"CopyCRC": CopyCRC, "CopyOutCRC": CopyOutCRC} {
				buf := bytes.Repeat([]byte{0x5A}, n+off+64)
				if got := f(buf[off:off+n], src); got != want {
					t.Fatalf("%s, %d bytes at +%d: crc %#x, want %#x", name, n, off, got, want)
				}
				if !bytes.Equal(buf[off:off+n], src) {
					t.Fatalf("%s, %d bytes at +%d: the copy differs", name, n, off)
				}
				if bytes.Count(buf[:off], []byte{0x5A}) != off || bytes.Count(buf[off+n:], []byte{0x5A}) != 64 {
					t.Fatalf("%s, %d bytes at +%d: wrote outside dst", name, n, off)
				}
			}
		}
	}
}

// BenchmarkCopyThenLoad: a fetch's copy into a pool and, right after, the
// load of the same bytes out of it (as the sidecar then copies a fetched
// block into the engine), for 64 blocks at a time cycling through 128 MiB:
// CopyCRC (plain stores, the checksum from the destination) against
// CopyOutCRC (streaming stores, which leave the destination out of the
// cache, the checksum from the source). ns/op covers both steps; the
// "fetch-ns" and "load-ns" metrics split them. `make bench` does not run
// it; docs/benchmarks.md has its figures.
func BenchmarkCopyThenLoad(b *testing.B) {
	const ws, per = 128 << 20, 64
	src, pool, engine := make([]byte, ws), make([]byte, ws), make([]byte, ws)
	for i := range src {
		src[i] = byte(i * 7)
	}
	copy(pool, src)
	copy(engine, src)
	for _, bs := range []int{192 << 10, 2 << 20} {
		group := per * bs
		groups := ws / group
		for _, c := range []struct {
			name string
			f    func(dst, src []byte) uint32
		}{{"CopyCRC", CopyCRC}, {"CopyOutCRC", CopyOutCRC}} {
			b.Run(fmt.Sprintf("%dKiB/%s", bs>>10, c.name), func(b *testing.B) {
				b.SetBytes(int64(group))
				var fetch, load time.Duration
				for i := 0; i < b.N; i++ {
					o := (i * 7 % groups) * group
					t0 := time.Now()
					for k := 0; k < per; k++ {
						c.f(pool[o+k*bs:o+(k+1)*bs], src[o+k*bs:o+(k+1)*bs])
					}
					t1 := time.Now()
					copy(engine[o:o+group], pool[o:o+group])
					fetch, load = fetch+t1.Sub(t0), load+time.Since(t1)
				}
				b.ReportMetric(float64(fetch.Nanoseconds())/float64(b.N), "fetch-ns/op")
				b.ReportMetric(float64(load.Nanoseconds())/float64(b.N), "load-ns/op")
			})
		}
	}
}
