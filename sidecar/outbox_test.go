package sidecar

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/ring"
)

// heapRing is a completion ring over heap memory: the outbox produces, the
// test consumes.
func heapRing(t *testing.T, capacity uint64) (*ring.Producer, *ring.Consumer) {
	t.Helper()
	mem := shm.Aligned(ring.HeaderSize + int(capacity))
	r, err := ring.Format(mem, capacity, 0, 1, ring.FlagCreatorProducer)
	if err != nil {
		t.Fatal(err)
	}
	w := ring.WaitConfig{Park: time.Millisecond}
	p, err := ring.NewProducer(r, w)
	if err != nil {
		t.Fatal(err)
	}
	c, err := ring.NewConsumer(r, w)
	if err != nil {
		t.Fatal(err)
	}
	return p, c
}

// drain reads every published record and returns their seqs.
func drain(c *ring.Consumer) []uint64 {
	var seqs []uint64
	for {
		rec, err := c.Next()
		if errors.Is(err, ring.ErrEmpty) {
			c.Commit()
			return seqs
		}
		if err != nil {
			return seqs
		}
		seqs = append(seqs, rec.Seq)
	}
}

// TestOutboxNeverWaits: replies to a full ring queue instead of waiting,
// reach the ring in order as the client frees room, and a full queue makes
// the outbox congested (the session loop then stops reading requests).
func TestOutboxNeverWaits(t *testing.T) {
	p, c := heapRing(t, 4096)
	var stuck atomic.Value
	ob := newOutbox(p, 1000, 4096, time.Hour, func(err error) { stuck.Store(err) })
	defer ob.close()
	payload := make([]byte, 200)
	const n = 60 // ~13 KiB: three times the ring; nobody reads it yet, so a send that waited would never return
	for i := 1; i <= n; i++ {
		ob.send(0x8001, uint64(i), payload)
	}
	if ob.pending() == 0 || !ob.congested() {
		t.Fatalf("pending %d congested %v: nothing queued behind the full ring", ob.pending(), ob.congested())
	}
	var got []uint64
	for deadline := time.Now().Add(5 * time.Second); len(got) < n && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		got = append(got, drain(c)...)
	}
	if len(got) != n {
		t.Fatalf("the client got %d replies, want %d", len(got), n)
	}
	for i, s := range got {
		if s != uint64(i+1) {
			t.Fatalf("reply %d has seq %d: order changed (%v)", i, s, got)
		}
	}
	if err := ob.waitDrained(time.Now().Add(time.Second)); err != nil || ob.pending() != 0 {
		t.Fatalf("not drained: %v, %d pending", err, ob.pending())
	}
	if err, _ := stuck.Load().(error); err != nil {
		t.Fatalf("dropped: %v", err)
	}
	ob.send(0x8001, 99, tooLarge[:0:0])
	if s := drain(c); len(s) != 1 || s[0] != 99 {
		t.Fatalf("a reply into an empty ring is written at once: %v", s)
	}
}

// TestOutboxStuck: a client that frees no room for the reply timeout gets
// its session dropped (once), and the outbox drops everything after.
func TestOutboxStuck(t *testing.T) {
	p, _ := heapRing(t, 4096)
	var calls atomic.Int32
	ob := newOutbox(p, 1000, 1<<20, 100*time.Millisecond, func(error) { calls.Add(1) })
	defer ob.close()
	for i := 1; i <= 40; i++ {
		ob.send(0x8001, uint64(i), make([]byte, 200))
	}
	deadline := time.Now().Add(5 * time.Second)
	for calls.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if calls.Load() != 1 {
		t.Fatalf("stuck called %d times", calls.Load())
	}
	ob.send(0x8001, 41, nil)
	if ob.pending() != 0 {
		t.Fatal("a dead outbox queued a reply")
	}
	if err := ob.waitDrained(time.Now().Add(time.Second)); err != nil {
		t.Fatalf("waiting on a dead outbox: %v", err)
	}
}

// TestOutboxCloseInterruptsFlusher: closing does not wait out the reply
// timeout (an hour here: a close that waited would hang the test) of a
// flusher parked for room.
func TestOutboxCloseInterruptsFlusher(t *testing.T) {
	p, _ := heapRing(t, 4096)
	ob := newOutbox(p, 1000, 1<<20, time.Hour, func(error) {})
	for i := 1; i <= 40; i++ {
		ob.send(0x8001, uint64(i), make([]byte, 200))
	}
	time.Sleep(20 * time.Millisecond) // the flusher parks
	ob.close()
}

// TestOutboxTooLarge: a reply past the ring's payload is replaced by a
// status 13 reply, never dropped silently.
func TestOutboxTooLarge(t *testing.T) {
	p, c := heapRing(t, 4096)
	ob := newOutbox(p, 100, 4096, time.Hour, func(error) {})
	defer ob.close()
	ob.send(0x8001, 7, make([]byte, 500))
	rec, err := c.Next()
	if err != nil || rec.Seq != 7 || len(rec.Payload) != len(tooLarge) {
		t.Fatalf("got %+v %v", rec, err)
	}
}
