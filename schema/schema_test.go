package schema_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/schema"
)

// digests returns n digests of the given width with distinct, non-zero bytes.
func digests(n, width int, seed byte) []byte {
	b := make([]byte, n*width)
	for i := range b {
		b[i] = seed + byte(i*7+1)
		if b[i] == 0 {
			b[i] = 0xA5
		}
	}
	return b
}

func seq(n int, from byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = from + byte(i)
	}
	return b
}

func pages(n int, from uint32) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = from + uint32(i)*3
	}
	return p
}

func changes(width int, ops ...uint8) []byte {
	var b []byte
	for i, op := range ops {
		d := digests(1, width, byte(0x10*(i+1)))
		if op == schema.OpCleared {
			d = make([]byte, width)
		}
		b = schema.AppendChange(b, op, d)
	}
	return b
}

// sample is one message value with its codec. dec decodes into a fresh
// value and returns it (a struct value, not a pointer).
type sample struct {
	name  string
	rtype uint16 // ring record type; 0 for the socket handshake
	value any
	enc   func() []byte
	dec   func([]byte) (any, error)
	// fixed is the length of the part of the encoding that must be present
	// (0: all of it); when tail is set, anything after it is a trailing
	// field (message, kind-specific bytes) and a longer or shorter tail
	// still decodes.
	fixed int
	tail  bool
}

var (
	sAttachRequest = schema.AttachRequest{
		Version: schema.Version, Role: schema.RoleWorker, Rank: 3, WorldSize: 8, DigestWidth: 32,
		RingCapacity: 1 << 20, Instance: "engine-7f3a", Model: "meta-llama/Llama-3.1-8B-Instruct",
		Layout: "bf16/b16/nhd/sha256", Salt: "tenant-ä42",
	}
	sAttachReply = schema.AttachReply{
		Version: schema.Version, Status: schema.OK, Namespace: 0x0A0B0C0D, Session: 0x8877665544332211,
		Epoch: 0xF0E1D2C3B4A59687, PoolSlots: 1 << 33, SlotBytes: 2 << 20, MaxPayload: 65520,
		SubmissionRing: "/dev/shm/ringside-0a0b0c0d-sub", CompletionRing: "/dev/shm/ringside-0a0b0c0d-cpl",
		PoolPath: "/dev/hugepages/ringside-pool", Message: "welcome",
	}
	sPutHashes32 = schema.PutHashes{Batch: 0x1122334455667788, Flags: schema.FlagAppend, Digests: digests(3, 32, 1)}
	sPutHashes8  = schema.PutHashes{Batch: 0x0102030405060708, Flags: schema.FlagLookup, Digests: digests(5, 8, 9)}
	sPutHashes16 = schema.PutHashes{Batch: 0x0a0b0c0d0e0f1011, Flags: schema.FlagReplace | schema.FlagLookup, Digests: digests(2, 16, 3)}
	sDropHashes  = schema.IDRequest{ID: 0x1122334455667788}
	sPoll        = schema.IDRequest{ID: 0x99AABBCCDDEEFF01}
	sRelease     = schema.IDRequest{ID: 0x99AABBCCDDEEFF02}
	sLookup      = schema.Lookup{View: schema.View{Batch: 0x1122334455667788, Start: 16, Count: 240}}
	sAcquire     = schema.Acquire{View: schema.View{Batch: 0x1122334455667788, Start: 32, Count: 96}, TTLms: 2500}
	sRetain      = schema.Retain{View: schema.View{Batch: 0x1122334455667788, Start: 8, Count: 40}, TTLms: 600000, Priority: 2}
	sRetainEnd   = schema.Retain{View: schema.View{Batch: 0x0102030405060708, Start: 0, Count: 12}, Flags: schema.RetainFlagEnd}
	// With an owner: the 32-byte form (appended within version 3).
	sRetainOwner    = schema.Retain{View: schema.View{Batch: 0x1122334455667788, Start: 8, Count: 40}, TTLms: 600000, Priority: 1, Owner: 0xA1B2C3D4E5F60718}
	sRetainEndOwner = schema.Retain{View: schema.View{Batch: 0x0102030405060708, Start: 0, Count: 12}, Flags: schema.RetainFlagEnd, Owner: 7}
	sRegister       = schema.RegisterRegion{
		Region: 0x01020304, Kind: schema.RegionCUDAIPC, PID: 48213, Base: 0x7F3A00000000,
		Length: 64 << 30, PageSize: 2 << 20, PageCount: 32768,
		Segments: []schema.Segment{
			{Offset: 0x100, Stride: 0x10000, Length: 0x8000},
			{Offset: 0x8100, Stride: 0x10000, Length: 0x8000},
		},
		Extra: sCUDAExtra.Append(nil),
	}
	sCUDAExtra = schema.CUDAExtra{
		GPU: [16]byte(seq(16, 0xC0)), Flags: schema.CUDAExtraFlagEvent, Event: [64]byte(seq(64, 0x80)),
		Allocations: []schema.CUDAAllocation{
			{Handle: [64]byte(seq(64, 0x40)), Base: 0x7F3A00000000, Size: 32 << 30},
			{Handle: [64]byte(seq(64, 0x10)), Base: 0x7F4200000000, Size: 32 << 30},
		},
	}
	sLoad         = schema.Load{Lease: 0x99AABBCCDDEEFF01, Region: 0x01020304, First: 5, Pages: pages(4, 1000)}
	sStore        = schema.Store{View: schema.View{Batch: 0x1122334455667788, Start: 7, Count: 3}, Region: 0x01020304, Pages: pages(3, 77)}
	sChanges      = schema.Changes{Epoch: 0xCAFEBABE12345678, Seq: 4242, Max: 512}
	sReply        = schema.Reply{Status: schema.ErrCodeUnknownBatch, Value: 0x0102030405060708, Message: "batch 7 not registered"}
	sLeaseReply   = schema.LeaseReply{Status: schema.OK, State: schema.StateWaiting, Lease: 0x99AABBCCDDEEFF01, Blocks: 96, Message: "over load budget"}
	sStoreReply   = schema.StoreReply{Status: schema.ErrCodeNoSpace, Stored: 5, Present: 2, Skipped: 1, Message: "pool full"}
	sChangesReply = schema.ChangesReply{
		Status: schema.OK, Resync: true, Epoch: 0xCAFEBABE12345678, Next: 4245, Width: 8,
		Entries: changes(8, schema.OpStored, schema.OpEvicted, schema.OpCleared),
	}
	sChangesReply32 = schema.ChangesReply{
		Status: schema.OK, Epoch: 0xCAFEBABE12345678, Next: 4247, Width: 32,
		Entries: changes(32, schema.OpStored, schema.OpEvicted),
	}
	sSnapshot        = schema.Snapshot{From: 0x0000000100002000, Max: 1024}
	sSnapshotReply16 = schema.SnapshotReply{
		Status: schema.OK, Epoch: 0xCAFEBABE12345678, Seq: 4242, Next: 8192, Width: 16,
		Entries: digests(3, 16, 0x21),
	}
	sSnapshotReply32 = schema.SnapshotReply{
		Status: schema.OK, Done: true, Epoch: 0xCAFEBABE12345678, Seq: 4250, Next: 1 << 20, Width: 32,
		Entries: digests(2, 32, 0x61),
	}
)

func decAttachRequest(b []byte) (any, error) {
	var m schema.AttachRequest
	err := m.Decode(b)
	return m, err
}
func decAttachReply(b []byte) (any, error) {
	var m schema.AttachReply
	err := m.Decode(b)
	return m, err
}
func decPutHashes(width int) func([]byte) (any, error) {
	return func(b []byte) (any, error) { var m schema.PutHashes; err := m.Decode(b, width); return m, err }
}
func decID(b []byte) (any, error)      { var m schema.IDRequest; err := m.Decode(b); return m, err }
func decLookup(b []byte) (any, error)  { var m schema.Lookup; err := m.Decode(b); return m, err }
func decAcquire(b []byte) (any, error) { var m schema.Acquire; err := m.Decode(b); return m, err }
func decRetain(b []byte) (any, error)  { var m schema.Retain; err := m.Decode(b); return m, err }
func decRegisterRegion(b []byte) (any, error) {
	var m schema.RegisterRegion
	err := m.Decode(b)
	return m, err
}
func decCUDAExtra(b []byte) (any, error) {
	var m schema.CUDAExtra
	err := m.Decode(b)
	return m, err
}
func decLoad(b []byte) (any, error)       { var m schema.Load; err := m.Decode(b); return m, err }
func decStore(b []byte) (any, error)      { var m schema.Store; err := m.Decode(b); return m, err }
func decChanges(b []byte) (any, error)    { var m schema.Changes; err := m.Decode(b); return m, err }
func decReply(b []byte) (any, error)      { var m schema.Reply; err := m.Decode(b); return m, err }
func decLeaseReply(b []byte) (any, error) { var m schema.LeaseReply; err := m.Decode(b); return m, err }
func decStoreReply(b []byte) (any, error) { var m schema.StoreReply; err := m.Decode(b); return m, err }
func decChangesReply(b []byte) (any, error) {
	var m schema.ChangesReply
	err := m.Decode(b)
	return m, err
}
func decSnapshot(b []byte) (any, error) { var m schema.Snapshot; err := m.Decode(b); return m, err }
func decSnapshotReply(b []byte) (any, error) {
	var m schema.SnapshotReply
	err := m.Decode(b)
	return m, err
}

// samples lists one or more values of every message type.
func samples() []sample {
	r := schema.ReplyBit
	return []sample{
		{"AttachRequest", 0, sAttachRequest, func() []byte { return sAttachRequest.Append(nil) }, decAttachRequest, 0, false},
		{"AttachReply", 0, sAttachReply, func() []byte { return sAttachReply.Append(nil) }, decAttachReply, 0, false},
		{"PutHashes/w32", schema.TypePutHashes, sPutHashes32, func() []byte { return sPutHashes32.Append(nil, 32) }, decPutHashes(32), 0, false},
		{"PutHashes/w8", schema.TypePutHashes, sPutHashes8, func() []byte { return sPutHashes8.Append(nil, 8) }, decPutHashes(8), 0, false},
		{"PutHashes/w16", schema.TypePutHashes, sPutHashes16, func() []byte { return sPutHashes16.Append(nil, 16) }, decPutHashes(16), 0, false},
		{"DropHashes", schema.TypeDropHashes, sDropHashes, func() []byte { return sDropHashes.Append(nil) }, decID, 8, false},
		{"Lookup", schema.TypeLookup, sLookup, func() []byte { return sLookup.Append(nil) }, decLookup, 16, false},
		{"Acquire", schema.TypeAcquire, sAcquire, func() []byte { return sAcquire.Append(nil) }, decAcquire, 24, false},
		{"Poll", schema.TypePoll, sPoll, func() []byte { return sPoll.Append(nil) }, decID, 8, false},
		{"Release", schema.TypeRelease, sRelease, func() []byte { return sRelease.Append(nil) }, decID, 8, false},
		{"RegisterRegion", schema.TypeRegisterRegion, sRegister, func() []byte { return sRegister.Append(nil) }, decRegisterRegion, 48 + 2*24, true},
		{"CUDAExtra", 0, sCUDAExtra, func() []byte { return sCUDAExtra.Append(nil) }, decCUDAExtra, 88 + 2*80, false},
		{"Load", schema.TypeLoad, sLoad, func() []byte { return sLoad.Append(nil) }, decLoad, 24 + 4*4, false},
		{"Store", schema.TypeStore, sStore, func() []byte { return sStore.Append(nil) }, decStore, 24 + 3*4, false},
		{"Changes", schema.TypeChanges, sChanges, func() []byte { return sChanges.Append(nil) }, decChanges, 24, false},
		{"Reply", schema.TypeLookup | r, sReply, func() []byte { return sReply.Append(nil) }, decReply, 16, true},
		{"LeaseReply", schema.TypeAcquire | r, sLeaseReply, func() []byte { return sLeaseReply.Append(nil) }, decLeaseReply, 24, true},
		{"StoreReply", schema.TypeStore | r, sStoreReply, func() []byte { return sStoreReply.Append(nil) }, decStoreReply, 16, true},
		{"ChangesReply/w8", schema.TypeChanges | r, sChangesReply, func() []byte { return sChangesReply.Append(nil) }, decChangesReply, 32 + 3*16, false},
		{"ChangesReply/w32", schema.TypeChanges | r, sChangesReply32, func() []byte { return sChangesReply32.Append(nil) }, decChangesReply, 32 + 2*40, false},
		{"Snapshot", schema.TypeSnapshot, sSnapshot, func() []byte { return sSnapshot.Append(nil) }, decSnapshot, 16, false},
		{"SnapshotReply/w16", schema.TypeSnapshot | r, sSnapshotReply16, func() []byte { return sSnapshotReply16.Append(nil) }, decSnapshotReply, 40 + 3*16, false},
		{"SnapshotReply/w32", schema.TypeSnapshot | r, sSnapshotReply32, func() []byte { return sSnapshotReply32.Append(nil) }, decSnapshotReply, 40 + 2*32, false},
		// KV events (events_test.go)
		{"Describe/w16", schema.TypeDescribe, sDescribe, func() []byte { return sDescribe.Append(nil, 16) }, decDescribe(16), 8 + 16 + 2*16 + 32 + 16 + 16 + 16 + 8 + 6, false},
		{"Events", schema.TypeEvents, sEvents, func() []byte { return sEvents.Append(nil) }, decChanges, 24, false},
		{"EventSnapshot", schema.TypeEventSnapshot, sEventSnapshot, func() []byte { return sEventSnapshot.Append(nil) }, decSnapshot, 16, false},
		{"EventsReply/w8", schema.TypeEvents | r, sEventsReply8, func() []byte { return sEventsReply8.Append(nil) }, decEventsReply, 40 + (16 + 8) + (24 + 8 + 1) + 16, false},
		{"EventsReply/w32", schema.TypeEventSnapshot | r, sEventsReply32, func() []byte { return sEventsReply32.Append(nil) }, decEventsReply, 40 + 8 + 64 + 16, false},
		{"EventsReply/resync", schema.TypeEvents | r, sEventsResync, func() []byte { return sEventsResync.Append(nil) }, decEventsReply, 40, false},
		// Retention hints, added within version 3
		{"Retain", schema.TypeRetain, sRetain, func() []byte { return sRetain.Append(nil) }, decRetain, 24, false},
		{"Retain/end", schema.TypeRetain, sRetainEnd, func() []byte { return sRetainEnd.Append(nil) }, decRetain, 24, false},
		{"Retain/owner", schema.TypeRetain, sRetainOwner, func() []byte { return sRetainOwner.Append(nil) }, decRetain, 32, false},
		{"Retain/end/owner", schema.TypeRetain, sRetainEndOwner, func() []byte { return sRetainEndOwner.Append(nil) }, decRetain, 32, false},
		// GPU memory shared by file descriptors, added within version 3 (descriptors_test.go)
		descriptorSamples()[0], descriptorSamples()[1], descriptorSamples()[2],
	}
}

// norm returns a copy of struct value v in which empty slices are nil, so
// that values compare equal whether a decoder produced nil or empty.
func norm(v any) any {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Struct {
		return v
	}
	cp := reflect.New(rv.Type()).Elem()
	cp.Set(rv)
	for i := 0; i < cp.NumField(); i++ {
		f := cp.Field(i)
		switch f.Kind() {
		case reflect.Slice:
			if f.Len() == 0 {
				f.Set(reflect.Zero(f.Type()))
			}
		case reflect.Struct:
			f.Set(reflect.ValueOf(norm(f.Interface())))
		}
	}
	return cp.Interface()
}

func same(a, b any) bool { return reflect.DeepEqual(norm(a), norm(b)) }

func wantMalformed(t *testing.T, err error, format string, args ...any) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: decoded without error", fmt.Sprintf(format, args...))
		return
	}
	if !errors.Is(err, schema.ErrMalformed) {
		t.Errorf("%s: error %v does not wrap ErrMalformed", fmt.Sprintf(format, args...), err)
	}
}

func TestRoundTrip(t *testing.T) {
	for _, s := range samples() {
		t.Run(s.name, func(t *testing.T) {
			b := s.enc()
			got, err := s.dec(b)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if !same(got, s.value) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, s.value)
			}
			if s.fixed > len(b) || (!s.tail && s.fixed != 0 && s.fixed != len(b)) {
				t.Fatalf("encoding is %d bytes, fixed part %d", len(b), s.fixed)
			}
		})
	}
}

// TestAppendKeepsPrefix checks that every Append appends to dst.
func TestAppendKeepsPrefix(t *testing.T) {
	pre := []byte{0xde, 0xad}
	cases := map[string][2][]byte{
		"AttachRequest":  {sAttachRequest.Append(bytes.Clone(pre)), sAttachRequest.Append(nil)},
		"AttachReply":    {sAttachReply.Append(bytes.Clone(pre)), sAttachReply.Append(nil)},
		"PutHashes":      {sPutHashes32.Append(bytes.Clone(pre), 32), sPutHashes32.Append(nil, 32)},
		"IDRequest":      {sPoll.Append(bytes.Clone(pre)), sPoll.Append(nil)},
		"Lookup":         {sLookup.Append(bytes.Clone(pre)), sLookup.Append(nil)},
		"Acquire":        {sAcquire.Append(bytes.Clone(pre)), sAcquire.Append(nil)},
		"Retain":         {sRetain.Append(bytes.Clone(pre)), sRetain.Append(nil)},
		"Retain/owner":   {sRetainOwner.Append(bytes.Clone(pre)), sRetainOwner.Append(nil)},
		"RegisterRegion": {sRegister.Append(bytes.Clone(pre)), sRegister.Append(nil)},
		"Load":           {sLoad.Append(bytes.Clone(pre)), sLoad.Append(nil)},
		"Store":          {sStore.Append(bytes.Clone(pre)), sStore.Append(nil)},
		"Changes":        {sChanges.Append(bytes.Clone(pre)), sChanges.Append(nil)},
		"Reply":          {sReply.Append(bytes.Clone(pre)), sReply.Append(nil)},
		"LeaseReply":     {sLeaseReply.Append(bytes.Clone(pre)), sLeaseReply.Append(nil)},
		"StoreReply":     {sStoreReply.Append(bytes.Clone(pre)), sStoreReply.Append(nil)},
		"ChangesReply":   {sChangesReply.Append(bytes.Clone(pre)), sChangesReply.Append(nil)},
		"Snapshot":       {sSnapshot.Append(bytes.Clone(pre)), sSnapshot.Append(nil)},
		"SnapshotReply":  {sSnapshotReply16.Append(bytes.Clone(pre)), sSnapshotReply16.Append(nil)},
		"Describe":       {sDescribe.Append(bytes.Clone(pre), 16), sDescribe.Append(nil, 16)},
		"EventsReply":    {sEventsReply8.Append(bytes.Clone(pre)), sEventsReply8.Append(nil)},
	}
	for name, c := range cases {
		if !bytes.Equal(c[0], append(bytes.Clone(pre), c[1]...)) {
			t.Errorf("%s: Append(prefix) = %x, want prefix + %x", name, c[0], c[1])
		}
	}
}

func TestRoundTripEmpty(t *testing.T) {
	// Zero-length variable parts: no digests, segments, extra bytes, pages,
	// entries or messages.
	cases := []struct {
		name string
		v    any
		b    []byte
		dec  func([]byte) (any, error)
	}{
		{"PutHashes", schema.PutHashes{Batch: 1}, (&schema.PutHashes{Batch: 1}).Append(nil, 16), decPutHashes(16)},
		{"RegisterRegion", schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: 2},
			(&schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: 2}).Append(nil), decRegisterRegion},
		{"Load", schema.Load{Lease: 1}, (&schema.Load{Lease: 1}).Append(nil), decLoad},
		{"Store", schema.Store{Region: 1}, (&schema.Store{Region: 1}).Append(nil), decStore},
		{"Reply", schema.Reply{}, (&schema.Reply{}).Append(nil), decReply},
		{"LeaseReply", schema.LeaseReply{State: schema.StateMiss}, (&schema.LeaseReply{State: schema.StateMiss}).Append(nil), decLeaseReply},
		{"StoreReply", schema.StoreReply{Stored: 1}, (&schema.StoreReply{Stored: 1}).Append(nil), decStoreReply},
		{"ChangesReply", schema.ChangesReply{Width: 16}, (&schema.ChangesReply{Width: 16}).Append(nil), decChangesReply},
		{"SnapshotReply", schema.SnapshotReply{Width: 8, Done: true}, (&schema.SnapshotReply{Width: 8, Done: true}).Append(nil), decSnapshotReply},
	}
	for _, c := range cases {
		got, err := c.dec(c.b)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if !same(got, c.v) {
			t.Errorf("%s: got %+v, want %+v", c.name, got, c.v)
		}
	}
}

func TestTruncation(t *testing.T) {
	for _, s := range samples() {
		t.Run(s.name, func(t *testing.T) {
			b := s.enc()
			fixed := s.fixed
			if !s.tail {
				fixed = len(b)
			}
			for i := 0; i < len(b); i++ {
				// A fresh copy of exactly i bytes, so that reading past the
				// prefix would fault under the race detector's bounds checks.
				p := bytes.Clone(b[:i])
				got, err := s.dec(p)
				if i == schema.RetainNoOwnerSize && isRetain(s.value) {
					continue // a Retain without its owner (TestRetainOwner)
				}
				if i < fixed {
					wantMalformed(t, err, "prefix of %d/%d bytes", i, len(b))
					continue
				}
				// Longer than the fixed part: only a trailing field is cut.
				if err != nil {
					t.Errorf("prefix of %d/%d bytes (tail cut): %v", i, len(b), err)
					continue
				}
				if again, err := s.dec(b[:i]); err != nil || !same(got, again) {
					t.Errorf("prefix of %d bytes decodes inconsistently", i)
				}
			}
		})
	}
}

// isRetain reports whether v is a Retain, whose owner may be cut or added
// (the 24- and 32-byte forms).
func isRetain(v any) bool {
	_, ok := v.(schema.Retain)
	return ok
}

func TestTrailingBytes(t *testing.T) {
	for _, s := range samples() {
		if s.tail {
			continue
		}
		t.Run(s.name, func(t *testing.T) {
			for _, extra := range [][]byte{{0}, {1, 2, 3}, make([]byte, 8)} {
				b := append(s.enc(), extra...)
				if len(b) == schema.RetainSize && isRetain(s.value) {
					continue // the owner of a Retain (TestRetainOwner)
				}
				_, err := s.dec(b)
				wantMalformed(t, err, "%d trailing bytes", len(extra))
				if err != nil && !strings.Contains(err.Error(), "trailing") {
					t.Errorf("error %q does not mention trailing bytes", err)
				}
			}
		})
	}
	// Messages that end in a to-the-end field take trailing bytes into it.
	b := append(sReply.Append(nil), '!')
	var r schema.Reply
	if err := r.Decode(b); err != nil || r.Message != sReply.Message+"!" {
		t.Errorf("reply with extra byte: %+v, %v", r, err)
	}
	b = append(sRegister.Append(nil), 0xEE)
	var rr schema.RegisterRegion
	if err := rr.Decode(b); err != nil || !bytes.Equal(rr.Extra, append(bytes.Clone(sRegister.Extra), 0xEE)) {
		t.Errorf("region with extra byte: %v", err)
	}
}

func TestNilAndGarbageInputs(t *testing.T) {
	for _, s := range samples() {
		_, err := s.dec(nil)
		wantMalformed(t, err, "%s: nil input", s.name)
		if !s.tail {
			_, err = s.dec(bytes.Repeat([]byte{0xff}, 4096))
			wantMalformed(t, err, "%s: 4096 bytes of 0xff", s.name)
		}
	}
}

func TestPutHashesLimits(t *testing.T) {
	for _, width := range []int{8, 16, 32} {
		m := schema.PutHashes{Batch: 9, Digests: digests(schema.MaxHashesPerRecord, width, 3)}
		b := m.Append(nil, width)
		var got schema.PutHashes
		if err := got.Decode(b, width); err != nil || !same(got, m) {
			t.Errorf("width %d: %d hashes: %v", width, schema.MaxHashesPerRecord, err)
		}
		m.Digests = digests(schema.MaxHashesPerRecord+1, width, 3)
		b = m.Append(nil, width)
		err := got.Decode(b, width)
		wantMalformed(t, err, "width %d: %d hashes", width, schema.MaxHashesPerRecord+1)
		// The count alone is enough: the limit is checked before the digests.
		err = got.Decode(b[:16], width)
		wantMalformed(t, err, "width %d: count over the limit, no digests", width)

		// A digest count that does not match the bytes present.
		b = (&schema.PutHashes{Batch: 9, Digests: digests(2, width, 1)}).Append(nil, width)
		err = got.Decode(b[:len(b)-1], width)
		wantMalformed(t, err, "width %d: short digest", width)
		// Decoding with a different width than the encoding.
		if width != 16 {
			err = got.Decode(b, 16)
			wantMalformed(t, err, "encoded width %d decoded as 16", width)
		}
	}
	for _, flags := range []uint32{8, 0x80000000, 7, 0xffffffff, schema.FlagAppend | schema.FlagReplace} {
		b := (&schema.PutHashes{Batch: 1, Flags: flags, Digests: digests(1, 8, 0)}).Append(nil, 8)
		var got schema.PutHashes
		err := got.Decode(b, 8)
		wantMalformed(t, err, "flags %#x", flags)
	}
	for _, flags := range []uint32{0, schema.FlagAppend, schema.FlagLookup, schema.FlagAppend | schema.FlagLookup,
		schema.FlagReplace, schema.FlagReplace | schema.FlagLookup} {
		b := (&schema.PutHashes{Batch: 1, Flags: flags, Digests: digests(1, 8, 0)}).Append(nil, 8)
		var got schema.PutHashes
		if err := got.Decode(b, 8); err != nil || got.Flags != flags {
			t.Errorf("flags %#x: %v", flags, err)
		}
	}
}

func TestPagesLimits(t *testing.T) {
	load := schema.Load{Lease: 1, Region: 2, Pages: pages(schema.MaxPagesPerRecord, 0)}
	var l schema.Load
	if err := l.Decode(load.Append(nil)); err != nil || !same(l, load) {
		t.Errorf("load of %d pages: %v", schema.MaxPagesPerRecord, err)
	}
	load.Pages = pages(schema.MaxPagesPerRecord+1, 0)
	wantMalformed(t, l.Decode(load.Append(nil)), "load of %d pages", schema.MaxPagesPerRecord+1)
	wantMalformed(t, l.Decode(load.Append(nil)[:24]), "load count over the limit, no pages")

	st := schema.Store{View: schema.View{Batch: 1, Count: schema.MaxPagesPerRecord}, Region: 2, Pages: pages(schema.MaxPagesPerRecord, 0)}
	var s schema.Store
	if err := s.Decode(st.Append(nil)); err != nil || !same(s, st) {
		t.Errorf("store of %d pages: %v", schema.MaxPagesPerRecord, err)
	}
	st.View.Count++
	st.Pages = pages(schema.MaxPagesPerRecord+1, 0)
	wantMalformed(t, s.Decode(st.Append(nil)), "store of %d pages", schema.MaxPagesPerRecord+1)

	// Store: the page count must equal the view's count.
	for _, vc := range []uint32{0, 2, 4, 1 << 31} {
		st := schema.Store{View: schema.View{Batch: 1, Count: vc}, Region: 2, Pages: pages(3, 0)}
		wantMalformed(t, s.Decode(st.Append(nil)), "store of 3 pages for a view of %d", vc)
	}

	// Decode reuses the destination's storage and resets it.
	l = schema.Load{Pages: make([]uint32, 100)}
	if err := l.Decode(sLoad.Append(nil)); err != nil || !same(l, sLoad) {
		t.Errorf("load into a used value: %+v, %v", l, err)
	}
}

func TestRegisterRegionLimits(t *testing.T) {
	m := sRegister
	m.Segments = make([]schema.Segment, schema.MaxSegments)
	var got schema.RegisterRegion
	if err := got.Decode(m.Append(nil)); err != nil || !same(got, m) {
		t.Errorf("%d segments: %v", schema.MaxSegments, err)
	}
	m.Segments = make([]schema.Segment, schema.MaxSegments+1)
	wantMalformed(t, got.Decode(m.Append(nil)), "%d segments", schema.MaxSegments+1)
	wantMalformed(t, got.Decode(m.Append(nil)[:48]), "segment count over the limit, no segments")

	for _, kind := range []uint8{0, 4, 0x80, 0xff} {
		m := sRegister
		m.Kind = kind
		wantMalformed(t, got.Decode(m.Append(nil)), "region kind %d", kind)
	}
	// RegionCUDAFD decodes (a RegionDescriptors carries it); the sidecar
	// refuses it on the ring.
	for _, kind := range []uint8{schema.RegionHostProcess, schema.RegionCUDAIPC, schema.RegionCUDAFD} {
		m := sRegister
		m.Kind = kind
		if err := got.Decode(m.Append(nil)); err != nil || got.Kind != kind {
			t.Errorf("region kind %d: %v", kind, err)
		}
	}
}

func TestAcquireFlags(t *testing.T) {
	b := sAcquire.Append(nil)
	for _, f := range []uint32{1, 2, 0x80000000} {
		c := bytes.Clone(b)
		c[20], c[21], c[22], c[23] = byte(f), byte(f>>8), byte(f>>16), byte(f>>24)
		var a schema.Acquire
		wantMalformed(t, a.Decode(c), "acquire flags %#x", f)
	}
}

func TestRetainRejects(t *testing.T) {
	for _, b := range [][]byte{sRetain.Append(nil), sRetainOwner.Append(nil)} {
		set := func(off int, v byte) []byte { c := bytes.Clone(b); c[off] = v; return c }
		var m schema.Retain
		for _, f := range []byte{2, 4, 0x80, 0xFF} {
			wantMalformed(t, m.Decode(set(21, f)), "retain flags %#x", f)
		}
		for _, off := range []int{22, 23} {
			wantMalformed(t, m.Decode(set(off, 1)), "retain reserved byte %d", off)
		}
		for _, p := range []byte{schema.MaxRetainPriority + 1, 0xFF} {
			wantMalformed(t, m.Decode(set(20, p)), "retain priority %d", p)
		}
		// A ttl of 0 only ends retention.
		noTTL := bytes.Clone(b)
		noTTL[16], noTTL[17], noTTL[18], noTTL[19] = 0, 0, 0, 0
		wantMalformed(t, m.Decode(noTTL), "retain ttl 0 without END")
		if err := m.Decode(set(21, schema.RetainFlagEnd)); err != nil || m.Flags != schema.RetainFlagEnd {
			t.Fatalf("END: %+v %v", m, err)
		}
		wantMalformed(t, m.Decode(b[:23]), "short retain")
		wantMalformed(t, m.Decode(append(bytes.Clone(b), 0)), "long retain")
	}
}

// TestRetainOwner: the owner is the u64 at offset 24; a Retain of 24
// bytes (what a client that predates the owner sends) decodes with owner
// 0, and owner 0 is encoded in those 24 bytes. Any length but 24 and 32
// is malformed.
func TestRetainOwner(t *testing.T) {
	b := sRetainOwner.Append(nil)
	if len(b) != schema.RetainSize || schema.RetainSize != 32 {
		t.Fatalf("Retain with an owner is %d bytes, want %d", len(b), schema.RetainSize)
	}
	if got := binary.LittleEndian.Uint64(b[24:]); got != sRetainOwner.Owner {
		t.Fatalf("owner at offset 24 is %#x", got)
	}
	short := sRetain.Append(nil)
	if len(short) != schema.RetainNoOwnerSize || schema.RetainNoOwnerSize != 24 {
		t.Fatalf("Retain without an owner is %d bytes, want %d", len(short), schema.RetainNoOwnerSize)
	}
	// The 24 bytes a client that predates the owner sends: owner 0.
	m := schema.Retain{Owner: 99}
	if err := m.Decode(short); err != nil || m.Owner != 0 || m.TTLms != sRetain.TTLms || m.Priority != sRetain.Priority {
		t.Fatalf("24-byte Retain: %+v %v", m, err)
	}
	// A 32-byte Retain of owner 0 means what the 24-byte one means.
	long := append(bytes.Clone(short), make([]byte, 8)...)
	var z schema.Retain
	if err := z.Decode(long); err != nil || !same(z, sRetain) {
		t.Fatalf("32-byte Retain of owner 0: %+v %v", z, err)
	}
	// The owner's 24 leading bytes are the Retain without it.
	if !bytes.Equal(b[:24], (&schema.Retain{View: sRetainOwner.View, TTLms: sRetainOwner.TTLms, Priority: sRetainOwner.Priority}).Append(nil)) {
		t.Fatal("the owner changed the first 24 bytes")
	}
	for n := 0; n <= 40; n++ {
		if n == 24 || n == 32 {
			continue
		}
		c := make([]byte, n)
		copy(c, b)
		wantMalformed(t, m.Decode(c), "retain of %d bytes", n)
	}
}

func TestChangesReplyLimits(t *testing.T) {
	var got schema.ChangesReply
	for _, w := range []uint8{0, 1, 7, 9, 15, 24, 33, 64, 255} {
		m := schema.ChangesReply{Width: w}
		wantMalformed(t, got.Decode(m.Append(nil)), "digest width %d", w)
	}
	for _, w := range []int{8, 16, 32} {
		var e []byte
		for i := 0; i < schema.MaxChangesPerReply; i++ {
			e = schema.AppendChange(e, schema.OpStored, digests(1, w, byte(i)))
		}
		m := schema.ChangesReply{Next: 1, Width: uint8(w), Entries: e}
		if err := got.Decode(m.Append(nil)); err != nil || !same(got, m) || got.Len() != schema.MaxChangesPerReply {
			t.Errorf("width %d: %d entries: %v", w, schema.MaxChangesPerReply, err)
		}
		m.Entries = schema.AppendChange(e, schema.OpEvicted, digests(1, w, 0))
		wantMalformed(t, got.Decode(m.Append(nil)), "width %d: %d entries", w, schema.MaxChangesPerReply+1)
	}
}

func TestChangesReplyEntries(t *testing.T) {
	var got schema.ChangesReply
	if err := got.Decode(sChangesReply.Append(nil)); err != nil {
		t.Fatal(err)
	}
	if got.Len() != 3 {
		t.Fatalf("Len = %d, want 3", got.Len())
	}
	wantOps := []uint8{schema.OpStored, schema.OpEvicted, schema.OpCleared}
	for i, want := range wantOps {
		op, d := got.ChangeAt(i)
		if op != want || len(d) != 8 {
			t.Errorf("entry %d: op %d, digest %x", i, op, d)
		}
		if want == schema.OpCleared && !bytes.Equal(d, make([]byte, 8)) {
			t.Errorf("cleared entry has digest %x", d)
		}
	}
	if (&schema.ChangesReply{}).Len() != 0 {
		t.Error("Len of a zero reply is not 0")
	}
	e := schema.AppendChange([]byte{9}, schema.OpEvicted, []byte{1, 2})
	if !bytes.Equal(e, []byte{9, 2, 0, 0, 0, 0, 0, 0, 0, 1, 2}) {
		t.Errorf("AppendChange = %x", e)
	}
	// Flag bits other than resync are ignored; resync is bit 0.
	b := sChangesReply32.Append(nil)
	b[4] = 0xfe
	if err := got.Decode(b); err != nil || got.Resync {
		t.Errorf("flags 0xfe: resync %v, %v", got.Resync, err)
	}
	b[4] = 0x01
	if err := got.Decode(b); err != nil || !got.Resync {
		t.Errorf("flags 0x01: resync %v, %v", got.Resync, err)
	}
}

func TestSnapshotLength(t *testing.T) {
	// Exactly 16 bytes; the reserved word is not checked.
	var m schema.Snapshot
	b := sSnapshot.Append(nil)
	if len(b) != 16 {
		t.Fatalf("Snapshot is %d bytes", len(b))
	}
	c := bytes.Clone(b)
	c[12], c[15] = 0xAA, 0x55
	if err := m.Decode(c); err != nil || m != sSnapshot {
		t.Errorf("reserved bytes set: %+v, %v", m, err)
	}
	for _, n := range []int{0, 8, 12, 15, 17, 24} {
		wantMalformed(t, m.Decode(make([]byte, n)), "Snapshot of %d bytes", n)
	}
}

func TestSnapshotReplyLimits(t *testing.T) {
	var got schema.SnapshotReply
	for _, w := range []uint8{0, 1, 7, 9, 15, 24, 33, 64, 255} {
		m := schema.SnapshotReply{Width: w}
		wantMalformed(t, got.Decode(m.Append(nil)), "digest width %d", w)
	}
	for _, w := range []int{8, 16, 32} {
		m := schema.SnapshotReply{Next: 1, Width: uint8(w), Entries: digests(schema.MaxSnapshotPerReply, w, 5)}
		if err := got.Decode(m.Append(nil)); err != nil || !same(got, m) || got.Len() != schema.MaxSnapshotPerReply {
			t.Errorf("width %d: %d entries: %v", w, schema.MaxSnapshotPerReply, err)
		}
		m.Entries = digests(schema.MaxSnapshotPerReply+1, w, 5)
		b := m.Append(nil)
		wantMalformed(t, got.Decode(b), "width %d: %d entries", w, schema.MaxSnapshotPerReply+1)
		// The count alone is enough: the limit is checked before the digests.
		wantMalformed(t, got.Decode(b[:40]), "width %d: count over the limit, no digests", w)
		// A count that does not match the bytes present.
		b = (&schema.SnapshotReply{Width: uint8(w), Entries: digests(2, w, 1)}).Append(nil)
		wantMalformed(t, got.Decode(b[:len(b)-1]), "width %d: short digest", w)
	}
}

func TestSnapshotReplyDigests(t *testing.T) {
	var got schema.SnapshotReply
	if err := got.Decode(sSnapshotReply16.Append(nil)); err != nil {
		t.Fatal(err)
	}
	if got.Len() != 3 || got.Done {
		t.Fatalf("Len = %d, done %v", got.Len(), got.Done)
	}
	for i := 0; i < 3; i++ {
		if d := got.DigestAt(i); !bytes.Equal(d, sSnapshotReply16.Entries[i*16:(i+1)*16]) || cap(d) != 16 {
			t.Errorf("digest %d = %x (cap %d)", i, d, cap(d))
		}
	}
	if (&schema.SnapshotReply{}).Len() != 0 {
		t.Error("Len of a zero reply is not 0")
	}
	// Flag bits other than done are ignored; done is bit 0.
	b := sSnapshotReply32.Append(nil)
	if b[4] != 1 {
		t.Fatalf("done is not flags bit 0: %x", b[:8])
	}
	b[4] = 0xfe
	b[37], b[39] = 0xAA, 0x55 // reserved bytes are not checked
	if err := got.Decode(b); err != nil || got.Done {
		t.Errorf("flags 0xfe: done %v, %v", got.Done, err)
	}
	b[4], b[7] = 0x01, 0x80
	if err := got.Decode(b); err != nil || !got.Done {
		t.Errorf("flags 0x80000001: done %v, %v", got.Done, err)
	}
	// Offsets of the header fields.
	b = sSnapshotReply16.Append(nil)
	le := binary.LittleEndian
	if le.Uint64(b[8:]) != sSnapshotReply16.Epoch || le.Uint64(b[16:]) != sSnapshotReply16.Seq ||
		le.Uint64(b[24:]) != sSnapshotReply16.Next || le.Uint32(b[32:]) != 3 || b[36] != 16 || len(b) != 40+3*16 {
		t.Errorf("layout: %x", b[:40])
	}
}

func TestAttachRequestValidate(t *testing.T) {
	ok := sAttachRequest
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid request: %v", err)
	}
	long := strings.Repeat("x", schema.MaxStringLen+1)
	cases := []struct {
		name string
		mod  func(m *schema.AttachRequest)
	}{
		{"role 0", func(m *schema.AttachRequest) { m.Role = 0 }},
		{"role 4", func(m *schema.AttachRequest) { m.Role = 4 }},
		{"role 0xffff", func(m *schema.AttachRequest) { m.Role = 0xffff }},
		{"world 0", func(m *schema.AttachRequest) { m.WorldSize = 0; m.Rank = 0 }},
		{"world 65", func(m *schema.AttachRequest) { m.WorldSize = 65; m.Rank = 0 }},
		{"rank = world", func(m *schema.AttachRequest) { m.Rank = m.WorldSize }},
		{"rank > world", func(m *schema.AttachRequest) { m.Rank = 1 << 31 }},
		{"width 0", func(m *schema.AttachRequest) { m.DigestWidth = 0 }},
		{"width 7", func(m *schema.AttachRequest) { m.DigestWidth = 7 }},
		{"width 64", func(m *schema.AttachRequest) { m.DigestWidth = 64 }},
		{"empty instance", func(m *schema.AttachRequest) { m.Instance = "" }},
		{"empty model", func(m *schema.AttachRequest) { m.Model = "" }},
		{"empty layout", func(m *schema.AttachRequest) { m.Layout = "" }},
		{"long instance", func(m *schema.AttachRequest) { m.Instance = long }},
		{"long model", func(m *schema.AttachRequest) { m.Model = long }},
		{"long layout", func(m *schema.AttachRequest) { m.Layout = long }},
		{"long salt", func(m *schema.AttachRequest) { m.Salt = long }},
		{"bad utf8 instance", func(m *schema.AttachRequest) { m.Instance = "a\xffb" }},
		{"bad utf8 salt", func(m *schema.AttachRequest) { m.Salt = "\xc3" }},
		{"surrogate model", func(m *schema.AttachRequest) { m.Model = "\xed\xa0\x80" }},
	}
	for _, c := range cases {
		m := ok
		c.mod(&m)
		wantMalformed(t, m.Validate(), "Validate %s", c.name)
		var got schema.AttachRequest
		wantMalformed(t, got.Decode(m.Append(nil)), "Decode %s", c.name)
	}
	good := []struct {
		name string
		mod  func(m *schema.AttachRequest)
	}{
		{"scheduler", func(m *schema.AttachRequest) { m.Role = schema.RoleScheduler; m.Rank = 0; m.WorldSize = 1 }},
		{"client", func(m *schema.AttachRequest) { m.Role = schema.RoleClient }},
		{"world 64 rank 63", func(m *schema.AttachRequest) { m.WorldSize = 64; m.Rank = 63 }},
		{"width 8", func(m *schema.AttachRequest) { m.DigestWidth = 8 }},
		{"width 16", func(m *schema.AttachRequest) { m.DigestWidth = 16 }},
		{"no salt", func(m *schema.AttachRequest) { m.Salt = "" }},
		{"max strings", func(m *schema.AttachRequest) {
			s := strings.Repeat("y", schema.MaxStringLen)
			m.Instance, m.Model, m.Layout, m.Salt = s, s, s, s
		}},
		{"any version", func(m *schema.AttachRequest) { m.Version = 99 }}, // version is the sidecar's call (ErrCodeBadVersion)
	}
	for _, c := range good {
		m := ok
		c.mod(&m)
		var got schema.AttachRequest
		if err := got.Decode(m.Append(nil)); err != nil || !same(got, m) {
			t.Errorf("%s: %+v, %v", c.name, got, err)
		}
	}
}

func TestAttachMagic(t *testing.T) {
	b := sAttachRequest.Append(nil)
	b[0] ^= 1
	var req schema.AttachRequest
	wantMalformed(t, req.Decode(b), "attach request with bad magic")
	if !bytes.Equal(sAttachRequest.Append(nil)[:4], []byte("RSAT")) {
		t.Error(`attach request does not start with "RSAT"`)
	}
	b = sAttachReply.Append(nil)
	b[3] ^= 0x80
	var rep schema.AttachReply
	wantMalformed(t, rep.Decode(b), "attach reply with bad magic")
	if !bytes.Equal(sAttachReply.Append(nil)[:4], []byte("RSAK")) {
		t.Error(`attach reply does not start with "RSAK"`)
	}
	// An attach reply sent where a request is expected, and vice versa.
	wantMalformed(t, req.Decode(sAttachReply.Append(nil)), "reply decoded as request")
	wantMalformed(t, rep.Decode(sAttachRequest.Append(nil)), "request decoded as reply")
}

func TestReplyErr(t *testing.T) {
	if err := (&schema.Reply{Status: schema.OK, Message: "ignored"}).Err(); err != nil {
		t.Errorf("OK reply: Err = %v", err)
	}
	err := (&schema.Reply{Status: schema.ErrCodeUnknownLease, Message: "lease 7"}).Err()
	var e *schema.Error
	if !errors.As(err, &e) || e.Status != schema.ErrCodeUnknownLease || e.Message != "lease 7" {
		t.Fatalf("Err = %#v", err)
	}
	if got, want := err.Error(), "ringside: unknown lease: lease 7"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if got, want := (&schema.Reply{Status: schema.ErrCodeNoSpace}).Err().Error(), "ringside: no space"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if got, want := (&schema.Error{Status: 200}).Error(), "ringside: status(200)"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	e = schema.Errorf(schema.ErrCodeTooLarge, "%d hashes", 5000)
	if e.Status != schema.ErrCodeTooLarge || e.Message != "5000 hashes" || e.Error() != "ringside: too large: 5000 hashes" {
		t.Errorf("Errorf = %#v (%q)", e, e.Error())
	}
	// ErrMalformed is not a status error.
	if errors.As(fmt.Errorf("x: %w", schema.ErrMalformed), &e) {
		t.Error("ErrMalformed reads as *Error")
	}
}

func TestStatusString(t *testing.T) {
	want := map[schema.Status]string{
		schema.OK: "ok", schema.ErrCodeMalformed: "malformed record", schema.ErrCodeUnknownType: "unknown record type",
		schema.ErrCodeUnknownBatch: "unknown hash batch", schema.ErrCodeUnknownLease: "unknown lease",
		schema.ErrCodeUnknownRegion: "unknown region", schema.ErrCodeOutOfRange: "out of range",
		schema.ErrCodeTooLarge: "too large", schema.ErrCodeNoSpace: "no space", schema.ErrCodeExpired: "expired",
		schema.ErrCodeDuplicate: "duplicate id", schema.ErrCodeCopyFailed: "copy failed",
		schema.ErrCodeNotPermitted: "not permitted", schema.ErrCodeInternal: "internal error",
		schema.ErrCodeShuttingDown: "shutting down", schema.ErrCodeBadVersion: "unsupported protocol version",
		schema.ErrCodeBadState: "bad state", schema.ErrCodeMismatch: "mismatch",
		18: "status(18)", 0xffffffff: "status(4294967295)",
	}
	for s, w := range want {
		if got := s.String(); got != w {
			t.Errorf("Status(%d).String() = %q, want %q", uint32(s), got, w)
		}
	}
	// Codes are dense from 0 to 17.
	for s := schema.OK; s <= schema.ErrCodeMismatch; s++ {
		if strings.HasPrefix(s.String(), "status(") {
			t.Errorf("status %d has no name", s)
		}
	}
}

func TestStateString(t *testing.T) {
	want := map[schema.State]string{
		schema.StateWaiting: "waiting", schema.StateReady: "ready", schema.StateLoading: "loading",
		schema.StateLoaded: "loaded", schema.StateMiss: "miss", schema.StateReleased: "released",
		0: "state(0)", 7: "state(7)",
	}
	for s, w := range want {
		if got := s.String(); got != w {
			t.Errorf("State(%d).String() = %q, want %q", uint32(s), got, w)
		}
	}
}

func TestTypeName(t *testing.T) {
	names := []string{"", "PutHashes", "DropHashes", "Lookup", "Acquire", "Poll", "Release",
		"RegisterRegion", "Load", "Store", "Changes", "Detach", "Ping", "Snapshot", "Describe", "Events", "EventSnapshot", "Retain"}
	for ty := schema.TypePutHashes; ty <= schema.TypeRetain; ty++ {
		if got := schema.TypeName(ty); got != names[ty] {
			t.Errorf("TypeName(%#x) = %q, want %q", ty, got, names[ty])
		}
		if got := schema.TypeName(ty | schema.ReplyBit); got != names[ty]+"Reply" {
			t.Errorf("TypeName(%#x) = %q, want %q", ty|schema.ReplyBit, got, names[ty]+"Reply")
		}
	}
	for ty, want := range map[uint16]string{0: "type(0x0)", 0x12: "type(0x12)", 0xFFFF: "type(0xffff)", 0x8000: "type(0x8000)", 0x8012: "type(0x8012)"} {
		if got := schema.TypeName(ty); got != want {
			t.Errorf("TypeName(%#x) = %q, want %q", ty, got, want)
		}
	}
}

func TestConstants(t *testing.T) {
	// Frozen for protocol version 3 (version 1 named the rings by path; 2
	// passes them as file descriptors; 3 carries one CUDA IPC handle per
	// device allocation): a change here is a wire-format change.
	if schema.Version != 3 || schema.MinVersion != 2 || schema.ReplyBit != 0x8000 || schema.ViewSize != 16 {
		t.Error("version, reply bit or view size changed")
	}
	if schema.CUDAExtraHeaderSize != 88 || schema.CUDAAllocationSize != 80 || schema.CUDAExtraFlagEvent != 1 ||
		schema.MaxAllocations != 1024 {
		t.Error("CUDA IPC extra layout changed")
	}
	if schema.AttachMagic != 0x54415352 || schema.AttachReplyMagic != 0x4b415352 {
		t.Error("attach magics changed")
	}
	if schema.MaxHashesPerRecord != 4096 || schema.MaxPagesPerRecord != 8192 || schema.MaxSegments != 1024 ||
		schema.MaxStringLen != 1024 || schema.MaxChangesPerReply != 4096 || schema.MaxSnapshotPerReply != 4096 {
		t.Error("limits changed")
	}
	if schema.TypePutHashes != 1 || schema.TypePing != 0x0C || schema.TypeSnapshot != 0x0D || schema.FlagAppend != 1 ||
		schema.SnapshotFlagDone != 1 || schema.ReservedType != 0x7FFF || schema.ReservedReplyType != 0x8000 {
		t.Error("type codes or flags changed")
	}
	if schema.ReplyType(schema.TypeLoad) != 0x8008 || schema.ReplyType(schema.ReservedType) != 0x8000 || schema.ReplyType(0x7FFE) != 0xFFFE {
		t.Error("reply types changed")
	}
	if schema.ErrCodeMismatch != 17 || schema.ErrCodeMismatch.String() != "mismatch" {
		t.Error("status codes changed")
	}
	// Added within version 2 (section 13): the records of KV events.
	if schema.TypeDescribe != 0x0E || schema.TypeEvents != 0x0F || schema.TypeEventSnapshot != 0x10 ||
		schema.EventsFlagResync != 1 || schema.EventsFlagDone != 2 || schema.EventStored != 1 || schema.EventRemoved != 2 ||
		schema.MaxDescribeBlocks != 4096 || schema.MaxDescribeTokens != 4096 || schema.MaxDescribeExtra != 1024 ||
		schema.MaxEventsPerReply != 4096 || schema.DescribeRunHeaderSize != 16 || schema.EventHeaderSize != 8 ||
		schema.EventsReplyHeaderSize != 40 || schema.DescribeFlagParent != 1 {
		t.Error("the event records' constants changed")
	}
	// Added within version 3 (section 13): retention hints.
	if schema.TypeRetain != 0x11 || schema.RetainSize != 32 || schema.RetainNoOwnerSize != 24 || schema.RetainFlagEnd != 1 || schema.MaxRetainPriority != 3 {
		t.Error("the Retain record's constants changed")
	}
}
