package l2

import (
	"bytes"
	"hash/crc32"
	"math/rand/v2"
	"testing"
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
