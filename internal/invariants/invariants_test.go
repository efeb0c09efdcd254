package invariants_test

import (
	"bytes"
	"testing"

	"github.com/ringside-kv/ringside/internal/invariants"
)

func TestMangle(t *testing.T) {
	for _, n := range []int{0, 1, 2, 3, 7, 64, 100, 4096, 5000} {
		orig := bytes.Repeat([]byte{0x5a}, n+2)
		b := append([]byte(nil), orig...)
		invariants.Mangle(b[1 : 1+n])
		if b[0] != 0x5a || b[n+1] != 0x5a {
			t.Fatalf("n=%d: Mangle wrote outside its slice", n)
		}
		if invariants.Enabled {
			if n > 0 && !invariants.Mangled(b[1:1+n]) {
				t.Fatalf("n=%d: Mangle left %x", n, b[1:1+n])
			}
		} else if !bytes.Equal(b, orig) {
			t.Fatalf("n=%d: Mangle wrote with invariants off", n)
		}
	}
	if invariants.Mangled(nil) || invariants.Mangled([]byte{invariants.Poison, 0}) {
		t.Fatal("Mangled reports memory that is not all poison")
	}
}
