package l2

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/ringside-kv/ringside/sidecar/machine"
)

var ns = machine.L2Namespace{FP: [16]byte{9, 8, 7}, Layout: 42, Width: 16, World: 4}

func TestValueRoundTripAndRejections(t *testing.T) {
	d := bytes.Repeat([]byte{0xab}, 16)
	payload := bytes.Repeat([]byte("kv"), 2048)
	v := AppendValue(nil, ns, d, 3, payload)
	if len(v) != HeaderSize+len(payload) {
		t.Fatalf("value of %d bytes", len(v))
	}
	if p, why := CheckValue(v, ns, d, 3, uint64(len(payload)), 1<<20); why != "" || !bytes.Equal(p, payload) {
		t.Fatalf("round trip: %q", why)
	}
	if _, why := CheckValue(v, ns, d, 3, 0, 1<<20); why != "" {
		t.Fatalf("any length: %q", why)
	}
	other := ns
	other.FP[15] = 1
	layout := ns
	layout.Layout++
	world := ns
	world.World = 2
	d2 := bytes.Repeat([]byte{0xac}, 16)
	mut := func(off int, b byte) []byte {
		w := append([]byte(nil), v...)
		w[off] ^= b
		return w
	}
	for _, tc := range []struct {
		name string
		v    []byte
		ns   machine.L2Namespace
		d    []byte
		rank int
		want uint64
		max  uint64
		why  string
	}{
		{"short", v[:50], ns, d, 3, 0, 1 << 20, RejectShort},
		{"truncated payload", v[:len(v)-1], ns, d, 3, 0, 1 << 20, RejectShort},
		{"trailing", append(append([]byte(nil), v...), 0), ns, d, 3, 0, 1 << 20, RejectTrailing},
		{"magic", mut(0, 1), ns, d, 3, 0, 1 << 20, RejectHeader},
		{"header bit", mut(20, 1), ns, d, 3, 0, 1 << 20, RejectHeader},
		{"header checksum", mut(84, 1), ns, d, 3, 0, 1 << 20, RejectHeader},
		{"payload byte", mut(HeaderSize+100, 0x10), ns, d, 3, 0, 1 << 20, RejectChecksum},
		{"payload checksum", mut(80, 1), ns, d, 3, 0, 1 << 20, RejectHeader},
		{"namespace", v, other, d, 3, 0, 1 << 20, RejectIdentity},
		{"layout", v, layout, d, 3, 0, 1 << 20, RejectIdentity},
		{"world", v, world, d, 3, 0, 1 << 20, RejectIdentity},
		{"digest", v, ns, d2, 3, 0, 1 << 20, RejectIdentity},
		{"rank", v, ns, d, 2, 0, 1 << 20, RejectIdentity},
		{"block size", v, ns, d, 3, 4095, 1 << 20, RejectLength},
		{"larger than a slot", v, ns, d, 3, 0, 4095, RejectLength},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if p, why := CheckValue(tc.v, tc.ns, tc.d, tc.rank, tc.want, tc.max); why != tc.why || (why != "" && p != nil) {
				t.Fatalf("got %q (payload %v), want %q", why, p != nil, tc.why)
			}
		})
	}
	// A zero length is never valid.
	z := AppendValue(nil, ns, d, 0, nil)
	if _, why := CheckValue(z, ns, d, 0, 0, 1<<20); why != RejectLength {
		t.Fatalf("empty payload: %q", why)
	}
	if binary.LittleEndian.Uint32(v) != valueMagic {
		t.Fatal("magic")
	}
}

// FuzzCheckValue feeds CheckValue any bytes: it never panics, and what it
// accepts is exactly a value AppendValue makes of its payload.
func FuzzCheckValue(f *testing.F) {
	d := bytes.Repeat([]byte{1}, 16)
	f.Add(AppendValue(nil, ns, d, 1, []byte("payload")))
	f.Add([]byte("RSL2"))
	f.Add(make([]byte, HeaderSize+3))
	f.Fuzz(func(t *testing.T, v []byte) {
		p, why := CheckValue(v, ns, d, 1, 0, 1<<20)
		if why != "" {
			if p != nil {
				t.Fatal("a rejected value returned a payload")
			}
			return
		}
		if !bytes.Equal(AppendValue(nil, ns, d, 1, p), v) {
			t.Fatal("an accepted value is not AppendValue of its payload")
		}
	})
}
