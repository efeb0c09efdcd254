package machine

import (
	"testing"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
)

// lookupHits asks, from session s, how many leading blocks of digests d
// are present.
func (r *rv) lookupHits(s SessionID, batch uint64, d []byte) uint64 {
	r.t.Helper()
	r.send(s, schema.TypePutHashes, (&schema.PutHashes{Batch: batch, Digests: d}).Append(nil, 32))
	o := r.send(s, schema.TypeLookup, (&schema.Lookup{View: schema.View{Batch: batch, Count: uint32(len(d) / 32)}}).Append(nil))
	var rep schema.Reply
	if len(o.Replies) != 1 || rep.Decode(o.Replies[0].Payload) != nil || rep.Status != schema.OK {
		r.t.Fatalf("lookup: %+v", o.Replies)
	}
	return rep.Value
}

// A store's copies commit only while its session lives: a copy that ends
// after the session ended (its Detach was handled, or the session is gone:
// socket closed, process dead) discards its blocks, since the engine may
// have handed those pages to another request once the session ended. A
// later lookup misses.
func TestStoreCopyEndingAfterItsSessionDiscards(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(r *rv, s SessionID)
		want uint64 // blocks a later lookup finds
	}{
		{"live", func(*rv, SessionID) {}, 2},
		{"detach-handled", func(r *rv, s SessionID) {
			o := r.send(s, schema.TypeDetach, nil)
			if !o.End || len(o.Replies) != 1 {
				r.t.Fatalf("detach: end %v replies %+v", o.End, o.Replies)
			}
		}, 0},
		{"session-gone", func(r *rv, s SessionID) { r.m.Detach(r.now, s, &r.out) }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRV(t, 64)
			r.m.l2 = nil // no shared tier: only this pool's blocks answer
			s := r.attach(1, 0)
			r.region(s, gpu.Handle(1))
			d := rvDigs(2)
			r.send(s, schema.TypePutHashes, (&schema.PutHashes{Batch: 1, Digests: d}).Append(nil, 32))
			o := r.send(s, schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: 2}, Region: 1, Pages: []uint32{0, 1}}).Append(nil))
			if len(o.Copies) != 1 {
				t.Fatalf("%d copies", len(o.Copies))
			}
			c := o.Copies[0].ID
			tc.end(r, s)
			r.m.CopyDone(r.now, c, CopyResult{Bytes: 2 * 4096}, &r.out)
			if tc.name != "live" && len(r.out.Replies) != 0 {
				t.Fatalf("a reply to a session that ended: %+v", r.out.Replies)
			}
			if _, ok := r.m.sessions[s]; ok {
				r.m.Detach(r.now, s, &r.out)
			}
			reader := r.attach(1, 0)
			if got := r.lookupHits(reader, 2, d); got != tc.want {
				t.Fatalf("a later lookup finds %d blocks, want %d", got, tc.want)
			}
			if st := r.m.Counters(); tc.want == 0 && st.DiscardedEndedStores != 2 {
				t.Fatalf("discarded stores counted %d, want 2", st.DiscardedEndedStores)
			}
		})
	}
}
