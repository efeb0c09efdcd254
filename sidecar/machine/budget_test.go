package machine

import (
	"errors"
	"testing"
)

func TestBudget(t *testing.T) {
	b := NewBudget(100)
	for _, tt := range []struct {
		name  string
		owner OwnerID
		op    string
		n     int64
		ok    bool
		after int64
	}{
		{"fits", 1, "admit", 60, true, 60},
		{"exact fill", 1, "admit", 40, true, 100},
		{"over", 1, "admit", 1, false, 100},
		{"other owner independent", 2, "admit", 100, true, 100},
		{"done part", 1, "done", 60, true, 40},
		{"fits again", 1, "admit", 60, true, 100},
		{"done too much", 1, "done", 101, false, 100},
		{"done all", 1, "done", 100, true, 0},
		{"oversized alone", 1, "admit", 500, true, 500},
		{"nothing while oversized", 1, "admit", 1, false, 500},
		{"done oversized", 1, "done", 500, true, 0},
		{"negative", 1, "admit", -1, false, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var ok bool
			if tt.op == "admit" {
				ok = b.Admit(tt.owner, tt.n)
			} else {
				err := b.Done(tt.owner, tt.n)
				ok = err == nil
				if err != nil && !errors.Is(err, ErrBudget) {
					t.Fatal(err)
				}
			}
			if ok != tt.ok || b.InFlight(tt.owner) != tt.after {
				t.Fatalf("ok %v in flight %d", ok, b.InFlight(tt.owner))
			}
		})
	}
	b.Forget(2)
	if b.InFlight(2) != 0 || len(b.inflight) != 0 {
		t.Fatal("Forget")
	}
	if NewBudget(0).Limit() != DefaultBudgetBytes {
		t.Fatal("default")
	}
}
