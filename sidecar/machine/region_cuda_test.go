package machine_test

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/machine/machinetest"
)

// cudaNode is a Machine whose copy engine serves CUDA IPC regions; its
// registrations are held, for the test to look at and end.
func cudaNode(t *testing.T) (*machinetest.Env, *connector.Client) {
	d := newPure(t)
	env := machinetest.New(t, machinetest.Config{
		Cache:   cache.Config{Capacity: 64, DeltaLogSize: 64, Epoch: 11},
		Machine: machine.Config{SlotBytes: 1 << 20, MetaBytes: 64 << 20, RingBytes: 4 << 20, CUDAIPC: true},
		Host:    d.host,
	})
	env.HoldRegisters = true
	s, err := d.node(env).Attach(scenario.AttachOptions{Instance: "i", Model: "m", Layout: "l", Role: schema.RoleClient, WorldSize: 1, DigestWidth: 32})
	if err != nil {
		t.Fatal(err)
	}
	return env, s.Client()
}

// perLayer is a CUDA region of 32 layers, one allocation each holding the
// K pages of every block then the V pages (two segments per layer).
func perLayer() (schema.RegisterRegion, schema.CUDAExtra) {
	const layers, pages, pageLen, gap = 32, 16, 2048, 1 << 20
	const alloc = 2 * pages * pageLen
	const base = 1 << 40
	rr := schema.RegisterRegion{Region: 1, Kind: schema.RegionCUDAIPC, PID: purePID, Base: base, PageSize: 2 * layers * pageLen, PageCount: pages}
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
			env, c := cudaNode(t)
			rr, x := perLayer()
			if tc.mod != nil {
				tc.mod(&rr, &x)
			}
			rr.Extra = x.Append(nil)
			if tc.extra != nil {
				rr.Extra = tc.extra
			}
			seq, err := c.Submit(schema.TypeRegisterRegion, rr.Append(nil))
			if err != nil {
				t.Fatal(err)
			}
			if tc.status == schema.OK {
				if len(env.Registers) != 1 {
					t.Fatalf("registers %d", len(env.Registers))
				}
				if b, err := c.Await(seq); err == nil {
					t.Fatalf("a reply before the copy engine registered the region: %x", b)
				}
				g := env.Registers[0].Region
				if g.Kind != gpu.CUDAIPC || len(g.IPC.Allocations) != 32 || g.IPC.Allocations[31].Base != x.Allocations[31].Base ||
					g.IPC.Allocations[31].Handle != x.Allocations[31].Handle || g.IPC.GPU != x.GPU ||
					g.IPC.HasEvent != (x.Flags != 0) || g.IPC.Event != x.Event {
					t.Fatalf("the copy engine gets %+v", g.IPC)
				}
				return
			}
			b, err := c.Await(seq)
			var rep schema.Reply
			if err != nil || rep.Decode(b) != nil {
				t.Fatalf("reply %x %v", b, err)
			}
			if rep.Status != tc.status || !strings.Contains(rep.Message, tc.text) || len(env.Registers) != 0 {
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
		env, c := cudaNode(t)
		rr, x := perLayer()
		rr.Extra = x.Append(nil)
		seq, err := c.Submit(schema.TypeRegisterRegion, rr.Append(nil))
		if err != nil || len(env.Registers) != 1 {
			t.Fatalf("register: %v, %d registrations", err, len(env.Registers))
		}
		env.EndRegister(0, tc.err)
		b, err := c.Await(seq)
		var rep schema.Reply
		if err != nil || rep.Decode(b) != nil || rep.Status != tc.status {
			t.Errorf("RegisterDone(%v): reply %x %v, want status %d", tc.err, b, err, tc.status)
		}
	}
}
