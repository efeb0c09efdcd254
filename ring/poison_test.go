package ring

import (
	"bytes"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/internal/invariants"
)

// With invariants on, Commit poisons exactly the bytes it releases, wrapped
// records, pads and the tail gap included, and nothing the producer has
// written past them; without, it leaves them alone. A payload aliased past
// Commit therefore reads poison in `make test`.
func TestCommitPoisonsReleasedRecords(t *testing.T) {
	const capacity = 4096
	r, p, c := newHeapRing(t, capacity, 0)
	payload := func(seq, n int) []byte { return bytes.Repeat([]byte{byte(seq)}, n) }
	// Move the ring's positions close to the end of the data area so that
	// the records below wrap: a pad record, then a record at offset 0.
	for i := 1; i <= 3; i++ {
		if err := p.Append(1, 0, uint64(i), payload(i, 1000)); err != nil {
			t.Fatal(err)
		}
	}
	p.Publish()
	for range 3 {
		if _, err := c.Next(); err != nil {
			t.Fatal(err)
		}
	}
	c.Commit()
	// 3 × 1016 bytes used, 1048 left before the end. Record 4 (616 bytes)
	// fits, record 5 wraps behind a 432-byte pad, record 6 stays unread.
	for i := 4; i <= 6; i++ {
		if err := p.Append(2, 0, uint64(i), payload(i, 600)); err != nil {
			t.Fatal(err)
		}
	}
	p.Publish()
	var held [][]byte
	for range 2 {
		rec, err := c.Next()
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, rec.Payload) // aliases kept past Commit: a bug
	}
	from := c.committed
	to := c.head
	c.Commit()
	released := 0
	for pos := from; pos < to; pos++ {
		released++
		b := r.data[pos&r.mask]
		if invariants.Enabled && b != invariants.Poison {
			t.Fatalf("released byte at position %d is %#x, want poison", pos, b)
		}
	}
	if released != 616+432+616 {
		t.Fatalf("released %d bytes, want the pad, one record and the wrapped one", released)
	}
	for i, h := range held {
		want := payload(4+i, 600)
		if invariants.Enabled {
			want = bytes.Repeat([]byte{invariants.Poison}, 600)
		}
		if !bytes.Equal(h, want) {
			t.Fatalf("alias of record %d after Commit reads %x..., want %x...", 4+i, h[:8], want[:8])
		}
	}
	// The unread record is intact and still readable.
	rec, err := c.Next()
	if err != nil || rec.Seq != 6 || !bytes.Equal(rec.Payload, payload(6, 600)) {
		t.Fatalf("unread record after a poisoning Commit: %+v, %v", rec.Seq, err)
	}
	c.Commit()
	// The producer reuses poisoned space and the consumer reads it back.
	for i := 7; i <= 9; i++ {
		if err := p.Write(3, 0, uint64(i), payload(i, 900), time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		rec, err := c.Read(nil)
		if err != nil || rec.Seq != uint64(i) || !bytes.Equal(rec.Payload, payload(i, 900)) {
			t.Fatalf("record %d over poisoned space: seq %d, %v", i, rec.Seq, err)
		}
	}
}

// KeepReleased turns the poisoning off for one consumer.
func TestKeepReleased(t *testing.T) {
	r, p, c := newHeapRing(t, 4096, 0)
	KeepReleased(c)
	if err := p.Append(1, 0, 1, []byte("still here")); err != nil {
		t.Fatal(err)
	}
	p.Publish()
	if _, err := c.Next(); err != nil {
		t.Fatal(err)
	}
	c.Commit()
	if !bytes.Equal(r.data[RecordHeaderSize:RecordHeaderSize+10], []byte("still here")) {
		t.Fatalf("KeepReleased consumer changed released bytes: %q", r.data[RecordHeaderSize:RecordHeaderSize+10])
	}
}
