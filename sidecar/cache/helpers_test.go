package cache

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"
)

const ms = int64(time.Millisecond)

type tc struct {
	t *testing.T
	c *Cache
}

func newTC(t *testing.T, capacity int) *tc {
	t.Helper()
	c, err := New(Config{Capacity: capacity, DeltaLogSize: 64, WriteTimeout: 100 * time.Millisecond, Epoch: 7})
	if err != nil {
		t.Fatal(err)
	}
	return &tc{t: t, c: c}
}

func (x *tc) check() {
	x.t.Helper()
	if err := x.c.CheckInvariants(); err != nil {
		x.t.Fatalf("invariants: %v", err)
	}
	s := x.c.Stats()
	if s.Free+s.Used != s.Capacity {
		x.t.Fatalf("free %d + used %d != capacity %d", s.Free, s.Used, s.Capacity)
	}
}

func (x *tc) ns(width, world int, tenant uint64) NamespaceID {
	x.t.Helper()
	id, err := x.c.AddNamespace(NamespaceKey{Model: "m", Layout: 1, TenantSalt: tenant, DigestWidth: width, WorldSize: world})
	if err != nil {
		x.t.Fatal(err)
	}
	return id
}

// dig returns a width-byte digest for i (big-endian in the last 8 bytes,
// so consecutive digests differ only in the last byte).
func dig(i, width int) []byte {
	d := make([]byte, width)
	binary.BigEndian.PutUint64(d[width-8:], uint64(i))
	return d
}

func digs(width int, ids ...int) []byte {
	var out []byte
	for _, i := range ids {
		out = append(out, dig(i, width)...)
	}
	return out
}

func (x *tc) begin(ns NamespaceID, rank int, d []byte, owner SessionID, now int64, want Status) Ticket {
	x.t.Helper()
	tk, st, err := x.c.BeginStore(ns, rank, d, owner, now)
	if err != nil {
		x.t.Fatal(err)
	}
	if st != want {
		x.t.Fatalf("BeginStore(ns %d rank %d %x) = %v, want %v", ns, rank, d, st, want)
	}
	x.check()
	return tk
}

func (x *tc) commit(tk Ticket) {
	x.t.Helper()
	if err := x.c.CommitStore(tk); err != nil {
		x.t.Fatal(err)
	}
	x.check()
}

// store stores all ranks of d.
func (x *tc) store(ns NamespaceID, d []byte, now int64) {
	x.t.Helper()
	n, _ := x.c.ns(ns)
	for r := 0; r < n.world; r++ {
		x.commit(x.begin(ns, r, d, 1, now, Allocated))
	}
}

func (x *tc) lookup(ns NamespaceID, ds []byte) int {
	x.t.Helper()
	k, err := x.c.Lookup(ns, ds)
	if err != nil {
		x.t.Fatal(err)
	}
	x.check()
	return k
}

func (x *tc) acquire(ns NamespaceID, rank int, ds []byte, owner SessionID, ttl time.Duration, now int64) Lease {
	x.t.Helper()
	l, err := x.c.Acquire(ns, rank, ds, owner, ttl, now)
	if err != nil {
		x.t.Fatal(err)
	}
	x.check()
	return l
}

func wantErr(t *testing.T, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("err = %v, want %v", err, target)
	}
}
