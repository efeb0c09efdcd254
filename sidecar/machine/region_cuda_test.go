package machine

import (
	"encoding/binary"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// cudaRV is a Machine whose copy engine serves CUDA IPC regions.
func cudaRV(t *testing.T) (*rv, SessionID) {
	c, err := cache.New(cache.Config{Capacity: 64, DeltaLogSize: 64, Epoch: 11})
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{SlotBytes: 1 << 20, MetaBytes: 64 << 20, RingBytes: 4 << 20, CUDAIPC: true}, c)
	if err != nil {
		t.Fatal(err)
	}
	r := &rv{t: t, m: m}
	return r, r.attach(1, 0)
}

// perLayer is a CUDA region of 32 layers, one allocation each holding the
// K pages of every block then the V pages (two segments per layer).
func perLayer() (schema.RegisterRegion, schema.CUDAExtra) {
	const layers, pages, pageLen, gap = 32, 16, 2048, 1 << 20
	const alloc = 2 * pages * pageLen
	const base = 1 << 40
	rr := schema.RegisterRegion{Region: 1, Kind: schema.RegionCUDAIPC, PID: 77, Base: base, PageSize: 2 * layers * pageLen, PageCount: pages}
	x := schema.CUDAExtra{GPU: [16]byte{0xf0, 1}}
	for l := range uint64(layers) {
		at := l * (alloc + gap)
		a := schema.CUDAAllocation{Base: base + at, Size: alloc}
		binary.LittleEndian.PutUint64(a.Handle[:], l+1)
		x.Allocations = append(x.Allocations, a)
		rr.Segments = append(rr.Segments, schema.Segment{Offset: at, Stride: pageLen, Length: pageLen},
			schema.Segment{Offset: at + pages*pageLen, Stride: pageLen, Length: pageLen})
		rr.Length = at + alloc
	}
	return rr, x
}

// RegisterRegion of a CUDA region: the extra is decoded (malformed:
// status 1), a version 2 extra is refused (12), the allocations are
// checked against the segments (6), and a good region reaches the copy
// engine with every allocation and the event.
func TestRegisterRegionCUDA(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mod    func(rr *schema.RegisterRegion, x *schema.CUDAExtra)
		extra  []byte // instead of x's encoding
		status schema.Status
		text   string
	}{
		{"good", func(*schema.RegisterRegion, *schema.CUDAExtra) {}, nil, schema.OK, ""},
		{"version 2 extra", nil, make([]byte, 88), schema.ErrCodeNotPermitted, "upgrade the engine plugin"},
		{"malformed extra", nil, make([]byte, 100), schema.ErrCodeMalformed, ""},
		{"overlapping allocations", func(_ *schema.RegisterRegion, x *schema.CUDAExtra) { x.Allocations[3].Size += 1<<20 + 1 }, nil,
			schema.ErrCodeOutOfRange, "overlap"},
		{"segment outside every allocation", func(rr *schema.RegisterRegion, _ *schema.CUDAExtra) { rr.Segments[7].Offset += 64 << 10 }, nil,
			schema.ErrCodeOutOfRange, "lies in no allocation"},
		{"segment straddling two", func(_ *schema.RegisterRegion, x *schema.CUDAExtra) {
			// Allocation 0 loses its last 4 KiB to allocation 1, which now
			// starts there: layer 0's V segment spans both.
			end := x.Allocations[1].Base + x.Allocations[1].Size
			x.Allocations[0].Size -= 4096
			x.Allocations[1].Base = x.Allocations[0].Base + x.Allocations[0].Size
			x.Allocations[1].Size = end - x.Allocations[1].Base
		}, nil, schema.ErrCodeOutOfRange, "segment 1 [0x10000008000,0x10000010000) runs past the end of allocation 0"},
		{"allocation with no segment", func(rr *schema.RegisterRegion, _ *schema.CUDAExtra) {
			rr.Segments[10], rr.Segments[11] = rr.Segments[8], rr.Segments[9]
		}, nil, schema.ErrCodeOutOfRange, "allocation 5 [0x"},
		{"with an event", func(_ *schema.RegisterRegion, x *schema.CUDAExtra) {
			x.Flags, x.Event[0] = schema.CUDAExtraFlagEvent, 9
		}, nil, schema.OK, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, s := cudaRV(t)
			rr, x := perLayer()
			if tc.mod != nil {
				tc.mod(&rr, &x)
			}
			rr.Extra = x.Append(nil)
			if tc.extra != nil {
				rr.Extra = tc.extra
			}
			o := r.send(s, schema.TypeRegisterRegion, rr.Append(nil))
			if tc.status == schema.OK {
				if len(o.Replies) != 0 || len(o.Registers) != 1 {
					t.Fatalf("replies %+v, registers %d", o.Replies, len(o.Registers))
				}
				g := o.Registers[0].Region
				if g.Kind != gpu.CUDAIPC || len(g.IPC.Allocations) != 32 || g.IPC.Allocations[31].Base != x.Allocations[31].Base ||
					g.IPC.Allocations[31].Handle != x.Allocations[31].Handle || g.IPC.GPU != x.GPU ||
					g.IPC.HasEvent != (x.Flags != 0) || g.IPC.Event != x.Event {
					t.Fatalf("the copy engine gets %+v", g.IPC)
				}
				return
			}
			var rep schema.Reply
			if len(o.Replies) != 1 || rep.Decode(o.Replies[0].Payload) != nil {
				t.Fatalf("replies %+v", o.Replies)
			}
			if rep.Status != tc.status || !strings.Contains(rep.Message, tc.text) || len(o.Registers) != 0 {
				t.Fatalf("status %d %q, want %d mentioning %q", rep.Status, rep.Message, tc.status, tc.text)
			}
			t.Logf("status %d: %s", rep.Status, rep.Message)
		})
	}
	// The copy engine's own refusal (a declared size past the mapping)
	// is status 6; memory it cannot open is 12.
	for _, tc := range []struct {
		err    error
		status schema.Status
	}{{gpu.ErrInvalidRegion, schema.ErrCodeOutOfRange}, {gpu.ErrUnsupported, schema.ErrCodeNotPermitted}} {
		r, s := cudaRV(t)
		rr, x := perLayer()
		rr.Extra = x.Append(nil)
		o := r.send(s, schema.TypeRegisterRegion, rr.Append(nil))
		r.now += int64(time.Millisecond)
		r.m.RegisterDone(r.now, s, o.Registers[0].ID, 0, tc.err, &r.out)
		var rep schema.Reply
		if len(r.out.Replies) != 1 || rep.Decode(r.out.Replies[0].Payload) != nil || rep.Status != tc.status {
			t.Errorf("RegisterDone(%v): replies %+v, want status %d", tc.err, r.out.Replies, tc.status)
		}
	}
}
