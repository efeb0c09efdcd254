package connector

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/schema"
)

// fake is a transport that answers every request with the next canned
// reply and records what it was sent.
type fake struct {
	replies [][]byte
	sent    []uint16
	sentP   [][]byte // the payloads, in order
	seq     uint64
	closed  bool
}

func (f *fake) Submit(typ uint16, p []byte) (uint64, error) {
	f.sent = append(f.sent, typ)
	f.sentP = append(f.sentP, append([]byte(nil), p...))
	f.seq++
	return f.seq, nil
}

func (f *fake) Await(uint64) ([]byte, error) {
	if len(f.replies) == 0 {
		return nil, errors.New("no reply")
	}
	b := f.replies[0]
	f.replies = f.replies[1:]
	return b, nil
}

func (f *fake) Send(uint16, []byte) error           { return nil }
func (f *fake) QuietFailures() (int, schema.Status) { return 0, 0 }
func (f *fake) Close() error                        { f.closed = true; return nil }
func (f *fake) Abandon()                            {}

// A typed request decodes its reply and turns a status into an
// *schema.Error that carries the reply's message, with the decoded reply.
func TestTypedRequestsOverATransport(t *testing.T) {
	f := &fake{replies: [][]byte{
		(&schema.Reply{Value: 5}).Append(nil),
		(&schema.Reply{Status: schema.ErrCodeTooLarge, Message: "over the quota"}).Append(nil),
		(&schema.LeaseReply{Status: schema.ErrCodeBadState, State: schema.StateMiss, Message: "gone"}).Append(nil),
		(&schema.StoreReply{Stored: 2, Present: 1}).Append(nil),
		(&schema.Reply{Status: schema.ErrCodeUnknownType, Message: "no snapshot here"}).Append(nil),
		(&schema.Reply{}).Append(nil),
	}}
	c := New(f, 16)
	if n, err := c.Lookup(schema.View{Batch: 1, Count: 5}); n != 5 || err != nil {
		t.Fatalf("lookup: %d %v", n, err)
	}
	var se *schema.Error
	if _, err := c.PutHashesLookup(1, make([]byte, 16)); !errors.As(err, &se) || se.Status != schema.ErrCodeTooLarge || se.Message != "over the quota" {
		t.Fatalf("put hashes: %v", err)
	}
	if l, err := c.Poll(3); !errors.As(err, &se) || se.Status != schema.ErrCodeBadState || se.Message != "gone" || l.State != schema.StateMiss {
		t.Fatalf("poll: %+v %v", l, err)
	}
	if r, err := c.Store(schema.View{Batch: 1, Count: 3}, 1, []uint32{0, 1, 2}); err != nil || r.Stored != 2 || r.Present != 1 {
		t.Fatalf("store: %+v %v", r, err)
	}
	// A Snapshot refused with a common Reply (a sidecar without Snapshot)
	// keeps the message.
	if _, err := c.Snapshot(0, 0); !errors.As(err, &se) || se.Status != schema.ErrCodeUnknownType || se.Message != "no snapshot here" {
		t.Fatalf("snapshot: %v", err)
	}
	if err := c.Close(); err != nil || !f.closed {
		t.Fatalf("close: %v, transport closed %v", err, f.closed)
	}
	want := []uint16{schema.TypeLookup, schema.TypePutHashes, schema.TypePoll, schema.TypeStore, schema.TypeSnapshot, schema.TypeDetach}
	if len(f.sent) != len(want) {
		t.Fatalf("sent %v, want %v", f.sent, want)
	}
	for i := range want {
		if f.sent[i] != want[i] {
			t.Fatalf("sent %v, want %v", f.sent, want)
		}
	}
	if c.Info() != (schema.AttachReply{}) || c.SocketFD() != -1 || c.MaxPayload() != 0 {
		t.Fatal("ring accessors of a client without the ring transport")
	}
}

// Retain encodes its ttl in whole milliseconds, rounded up and capped,
// END without ttl or priority, and refuses, sending nothing, a priority
// outside 0..3 or a ttl that is not positive.
func TestRetainRequest(t *testing.T) {
	f := &fake{}
	for range 4 {
		f.replies = append(f.replies, (&schema.Reply{Value: 3}).Append(nil))
	}
	c := New(f, 16)
	v := schema.View{Batch: 7, Start: 1, Count: 3}
	for _, tc := range []struct {
		ttl  time.Duration
		prio int
		end  bool
		want schema.Retain
	}{
		{1500 * time.Microsecond, 2, false, schema.Retain{View: v, TTLms: 2, Priority: 2}},
		{time.Hour, 3, false, schema.Retain{View: v, TTLms: 3600000, Priority: 3}},
		{1 << 62, 0, false, schema.Retain{View: v, TTLms: math.MaxUint32}},
		{time.Second, 9, true, schema.Retain{View: v, Flags: schema.RetainFlagEnd}},
	} {
		if n, err := c.Retain(v, tc.ttl, tc.prio, tc.end); n != 3 || err != nil {
			t.Fatalf("retain %+v: %d %v", tc, n, err)
		}
		var got schema.Retain
		if err := got.Decode(f.sentP[len(f.sentP)-1]); err != nil || got != tc.want || f.sent[len(f.sent)-1] != schema.TypeRetain {
			t.Fatalf("retain %+v sent %+v (%v), want %+v", tc, got, err, tc.want)
		}
	}
	for _, tc := range []struct {
		ttl  time.Duration
		prio int
	}{{time.Second, 4}, {time.Second, -1}, {0, 0}, {-time.Second, 1}} {
		if _, err := c.Retain(v, tc.ttl, tc.prio, false); err == nil {
			t.Fatalf("retain ttl %v prio %d: no error", tc.ttl, tc.prio)
		}
	}
	if len(f.sent) != 4 {
		t.Fatalf("%d requests sent, want 4", len(f.sent))
	}
	// An owner travels in the 32-byte form; owner 0 in the 24-byte one.
	for _, tc := range []struct {
		owner uint64
		end   bool
		want  schema.Retain
		size  int
	}{
		{0xABCDEF, false, schema.Retain{View: v, TTLms: 1000, Priority: 1, Owner: 0xABCDEF}, schema.RetainSize},
		{0xABCDEF, true, schema.Retain{View: v, Flags: schema.RetainFlagEnd, Owner: 0xABCDEF}, schema.RetainSize},
		{0, false, schema.Retain{View: v, TTLms: 1000, Priority: 1}, schema.RetainNoOwnerSize},
	} {
		f.replies = append(f.replies, (&schema.Reply{Value: 3}).Append(nil))
		if n, err := c.RetainOwned(v, tc.owner, time.Second, 1, tc.end); n != 3 || err != nil {
			t.Fatalf("retain owned %+v: %d %v", tc, n, err)
		}
		p := f.sentP[len(f.sentP)-1]
		var got schema.Retain
		if err := got.Decode(p); err != nil || got != tc.want || len(p) != tc.size {
			t.Fatalf("retain owned %+v sent %+v in %d bytes (%v)", tc, got, len(p), err)
		}
	}
}
