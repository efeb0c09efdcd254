package memcopy

import (
	"bytes"
	"math/rand/v2"
	"testing"
)

// check copies n bytes from src+so into dst+do with Stream and compares
// the whole destination with what copy() makes of it: the copied bytes
// equal, and the guard bytes around them untouched.
func check(t testing.TB, n, do, so int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(n), uint64(do*64+so)))
	src := make([]byte, n+so+64)
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	dst := bytes.Repeat([]byte{0xA5}, n+do+64)
	want := bytes.Clone(dst)
	copy(want[do:do+n], src[so:so+n])
	if got := Stream(dst[do:do+n], src[so:]); got != n {
		t.Fatalf("n %d, dst+%d, src+%d: Stream copied %d", n, do, so, got)
	}
	if !bytes.Equal(dst, want) {
		i := 0
		for dst[i] == want[i] {
			i++
		}
		t.Fatalf("n %d, dst+%d, src+%d: byte %d is %#x, want %#x", n, do, so, i-do, dst[i], want[i])
	}
}

// TestStream: every length around the thresholds and the 128-byte steps,
// at every alignment of dst and some of src.
func TestStream(t *testing.T) {
	if !useStream {
		t.Log("this CPU has no AVX: Stream is copy()")
	}
	lengths := []int{0, 1, 31, 32, 127, 128, 129, 255, 4095, minStream, minStream + 1, minStream + 31, minStream + 127, minStream + 128,
		16 << 10, 16<<10 + 17, 192 << 10, 1<<20 + 33}
	for _, n := range lengths {
		for do := 0; do < 64; do++ {
			for _, so := range []int{0, 1, 8, 31, 32, 63} {
				check(t, n, do, so)
			}
		}
	}
}

// TestStreamShort: the shorter of the two slices bounds the copy.
func TestStreamShort(t *testing.T) {
	src := bytes.Repeat([]byte{7}, 3*minStream)
	dst := make([]byte, 2*minStream+5)
	if n := Stream(dst, src); n != len(dst) || !bytes.Equal(dst, src[:len(dst)]) {
		t.Fatalf("dst shorter: copied %d", n)
	}
	dst = make([]byte, 3*minStream)
	if n := Stream(dst, src[:minStream+3]); n != minStream+3 || !bytes.Equal(dst[:n], src[:n]) || dst[n] != 0 {
		t.Fatalf("src shorter: copied %d", n)
	}
}

// FuzzStream: any length up to 64 KiB, at any alignment of either side
// (seeds in testdata/fuzz/FuzzStream).
func FuzzStream(f *testing.F) {
	f.Fuzz(func(t *testing.T, n uint16, do, so uint8) {
		check(t, int(n), int(do%64), int(so%64))
	})
}
