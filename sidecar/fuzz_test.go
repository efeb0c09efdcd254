package sidecar_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/schema"
)

// FuzzSession drives random and mutated records through a live session of
// a real sidecar: every record gets a reply, the session keeps serving, and
// the pool's accounting stays exact.
func FuzzSession(f *testing.F) {
	seeds := [][]byte{
		(&schema.Lookup{View: schema.View{Batch: 1, Count: 4}}).Append(nil),
		(&schema.Acquire{View: schema.View{Batch: 1, Count: 4}, TTLms: 10}).Append(nil),
		(&schema.Store{View: schema.View{Batch: 1, Count: 2}, Region: 1, Pages: []uint32{0, 1}}).Append(nil),
		(&schema.Load{Lease: 1, Region: 1, Pages: []uint32{0}}).Append(nil),
		(&schema.PutHashes{Batch: 3, Digests: make([]byte, 64)}).Append(nil, 32),
		(&schema.Changes{Epoch: 1, Seq: 2}).Append(nil),
		schema.IDRequest{ID: 1}.Append(nil),
	}
	for i, s := range seeds {
		f.Add(uint8(i+1), s)
	}
	f.Add(uint8(schema.TypeSnapshot), (&schema.Snapshot{From: 1, Max: 2}).Append(nil))
	f.Add(uint8(0x7F), []byte{})
	// One live sidecar serves every input; each input gets a new session.
	h := newHarness(f, nil)
	f.Fuzz(func(t *testing.T, typ uint8, payload []byte) {
		h := &harness{t: t, srv: h.srv, cfg: h.cfg}
		c := h.dial(nil)
		src := newRegion(1, 4)
		if err := c.RegisterRegion(src.reg); err != nil {
			t.Fatal(err)
		}
		c.PutHashes(1, digests("fz", 4), false) // batches are per instance: may exist already
		c.PutHashes(3, nil, false)
		c.Store(schema.View{Batch: 1, Count: 2}, 1, []uint32{0, 1})
		rt := uint16(typ)
		if rt == schema.TypeDetach || rt == 0 {
			rt = schema.TypePing
		}
		for round := 0; round < 2; round++ {
			seq, err := c.Submit(rt, payload)
			if err != nil {
				if len(payload) > c.MaxPayload() {
					return
				}
				t.Fatal(err)
			}
			b, err := c.Await(seq)
			if err != nil {
				t.Fatalf("no reply to type %#x: %v", rt, err)
			}
			if len(b) < 4 {
				t.Fatalf("reply without status: %x", b)
			}
			_ = binary.LittleEndian.Uint32(b)
			// Mutate and send again.
			if len(payload) > 0 {
				payload = append([]byte(nil), payload...)
				payload[len(payload)/2] ^= 0x5A
			}
		}
		if err := c.Ping(42); err != nil {
			t.Fatalf("session died: %v", err)
		}
		// Releasing everything leaves exact accounting.
		c.Abandon()
		deadline := time.Now().Add(5 * time.Second)
		for {
			st := h.srv.State()
			if len(st.Sessions) == 0 && st.Pool.Leases == 0 && st.Pool.Writing == 0 && st.Pool.Free+st.Pool.Used == st.Pool.Capacity {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("state after abandon: %+v", st)
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
}
