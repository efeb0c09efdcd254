package cache

import (
	"errors"
	"testing"
	"time"
)

func TestLeaseSlotsAndReapedIDs(t *testing.T) {
	c, err := New(Config{Capacity: 64, Epoch: 1})
	if err != nil {
		t.Fatal(err)
	}
	ns, err := c.AddNamespace(NamespaceKey{Model: "m", Layout: 1, DigestWidth: 8, WorldSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	d := []byte("abcdefgh")
	for rank := 0; rank < 2; rank++ {
		tk, st, err := c.BeginStore(ns, rank, d, 1, 0)
		if err != nil || st != Allocated {
			t.Fatalf("rank %d: %v %v", rank, st, err)
		}
		if err := c.CommitStore(tk); err != nil {
			t.Fatal(err)
		}
	}
	l, err := c.Acquire(ns, 0, d, 7, time.Second, 0)
	if err != nil || l.Blocks != 1 {
		t.Fatalf("acquire: %+v %v", l, err)
	}
	s0, err := c.LeaseSlots(l.ID, 0, nil)
	if err != nil || len(s0) != 1 || s0[0] != l.Slots[0] {
		t.Fatalf("rank 0 slots %v, lease %v, %v", s0, l.Slots, err)
	}
	s1, err := c.LeaseSlots(l.ID, 1, nil)
	if err != nil || len(s1) != 1 || s1[0] == s0[0] {
		t.Fatalf("rank 1 slots %v (rank 0 %v), %v", s1, s0, err)
	}
	if _, err := c.LeaseSlots(l.ID, 2, nil); !errors.Is(err, ErrBadRank) {
		t.Fatalf("rank 2: %v", err)
	}
	if o, ok := c.LeaseOwner(l.ID); !ok || o != 7 {
		t.Fatalf("owner %v %v", o, ok)
	}
	r, ids := c.ReapLeases(int64(2*time.Second), nil)
	if r.Leases != 1 || len(ids) != 1 || ids[0] != l.ID {
		t.Fatalf("reaped %+v %v", r, ids)
	}
	if _, err := c.LeaseSlots(l.ID, 0, nil); !errors.Is(err, ErrUnknownLease) {
		t.Fatalf("after reap: %v", err)
	}
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
