package schema_test

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/schema"
)

// GPU memory shared by POSIX file descriptors (descriptors.go), added
// within version 3.

var (
	sFDExtra = schema.FDExtra{
		GPU: [16]byte(seq(16, 0xD0)), Flags: schema.CUDAExtraFlagEvent, Event: [64]byte(seq(64, 0x30)),
		Allocations: []schema.FDAllocation{
			{Index: 1, Base: 0x7F5000000000, Size: 64 << 20},
			{Index: 0, Base: 0x7F5004000000, Size: 64 << 20},
		},
	}
	sRegisterFD = schema.RegisterRegion{
		Region: 1, Kind: schema.RegionCUDAFD, PID: 48213, Base: 0x7F5000000000,
		Length: 128 << 20, PageSize: 64 << 10, PageCount: 1024,
		Segments: []schema.Segment{
			{Offset: 0, Stride: 32 << 10, Length: 32 << 10},
			{Offset: 64 << 20, Stride: 32 << 10, Length: 32 << 10},
		},
		Extra: sFDExtra.Append(nil),
	}
	sRegionDescriptors      = schema.RegionDescriptors{Version: 3, Session: 0x0102030405060708, Epoch: 0xCAFEBABE12345678, Region: sRegisterFD}
	sRegionDescriptorsReply = schema.RegionDescriptorsReply{Version: 3, Status: schema.ErrCodeNotPermitted, Region: 1,
		Message: "allocation 0 (descriptor 1): not a CUDA allocation"}
)

func decFDExtra(b []byte) (any, error) { var m schema.FDExtra; err := m.Decode(b); return m, err }
func decRegionDescriptors(b []byte) (any, error) {
	var m schema.RegionDescriptors
	err := m.Decode(b)
	return m, err
}
func decRegionDescriptorsReply(b []byte) (any, error) {
	var m schema.RegionDescriptorsReply
	err := m.Decode(b)
	return m, err
}

// descriptorSamples join samples(): their golden vectors are socket
// messages (record type 0), and FDExtra the extra of a RegisterRegion.
func descriptorSamples() []sample {
	return []sample{
		{"FDExtra", 0, sFDExtra, func() []byte { return sFDExtra.Append(nil) }, decFDExtra, 88 + 2*24, false},
		{"RegionDescriptors", 0, sRegionDescriptors, func() []byte { return sRegionDescriptors.Append(nil) }, decRegionDescriptors, 24 + 48 + 2*24, true},
		{"RegionDescriptorsReply", 0, sRegionDescriptorsReply, func() []byte { return sRegionDescriptorsReply.Append(nil) }, decRegionDescriptorsReply, 16, true},
	}
}

func TestDescriptorConstants(t *testing.T) {
	// Added within version 3 (section 13): frozen from then on.
	if schema.RegionCUDAFD != 3 || schema.DescriptorsMagic != 0x44465352 || schema.DescriptorsReplyMagic != 0x4b465352 ||
		schema.MaxDescriptors != 253 || schema.FDExtraHeaderSize != 88 || schema.FDAllocationSize != 24 ||
		schema.RegionDescriptorsHeaderSize != 24 {
		t.Error("the descriptor messages' constants changed")
	}
	if string(le32(schema.DescriptorsMagic)) != "RSFD" || string(le32(schema.DescriptorsReplyMagic)) != "RSFK" {
		t.Error("magics do not spell RSFD and RSFK")
	}
}

func le32(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }

func TestFDExtraRejects(t *testing.T) {
	base := func() schema.FDExtra {
		return schema.FDExtra{Allocations: []schema.FDAllocation{{Index: 0, Base: 1 << 40, Size: 2 << 20}, {Index: 1, Base: 2 << 40, Size: 2 << 20}}}
	}
	ok := base()
	if _, err := decFDExtra(ok.Append(nil)); err != nil {
		t.Fatalf("a good extra: %v", err)
	}
	cases := map[string]func(b []byte) []byte{
		"unknown flag":        func(b []byte) []byte { b[16] |= 2; return b },
		"event without flag":  func(b []byte) []byte { b[30] = 1; return b },
		"no allocation":       func(b []byte) []byte { return append(b[:20:20], append([]byte{0, 0, 0, 0}, b[24:88]...)...) },
		"index past count":    func(b []byte) []byte { b[88+24] = 2; return b },
		"index named twice":   func(b []byte) []byte { b[88+24] = 0; return b },
		"reserved word":       func(b []byte) []byte { b[88+4] = 1; return b },
		"zero size":           func(b []byte) []byte { clear(b[88+16 : 88+24]); return b },
		"overflow":            func(b []byte) []byte { copy(b[88+8:], bytes.Repeat([]byte{0xff}, 8)); return b },
		"trailing byte":       func(b []byte) []byte { return append(b, 0) },
		"short allocation":    func(b []byte) []byte { return b[:len(b)-1] },
		"more than the limit": func(b []byte) []byte { binary.LittleEndian.PutUint32(b[20:], schema.MaxDescriptors+1); return b },
	}
	for name, mut := range cases {
		wantMalformed(t, func() error { _, err := decFDExtra(mut(ok.Append(nil))); return err }(), "%s", name)
	}
	// The most descriptors one message carries.
	var most schema.FDExtra
	for i := range schema.MaxDescriptors {
		most.Allocations = append(most.Allocations, schema.FDAllocation{Index: uint32(schema.MaxDescriptors - 1 - i), Base: uint64(i+1) << 30, Size: 2 << 20})
	}
	if _, err := decFDExtra(most.Append(nil)); err != nil {
		t.Errorf("%d allocations: %v", schema.MaxDescriptors, err)
	}
}

func TestRegionDescriptorsRejects(t *testing.T) {
	good := sRegionDescriptors.Append(nil)
	cases := map[string][]byte{
		"an attach request":  sAttachRequest.Append(nil),
		"header only":        good[:24],
		"short header":       good[:20],
		"host region inside": (&schema.RegionDescriptors{Version: 3, Region: schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: 1}}).Append(nil),
		"cuda ipc inside":    (&schema.RegionDescriptors{Version: 3, Region: sRegister}).Append(nil),
		"unknown kind": func() []byte {
			b := bytes.Clone(good)
			b[24+4] = 4
			return b
		}(),
	}
	for name, b := range cases {
		_, err := decRegionDescriptors(b)
		wantMalformed(t, err, "%s", name)
	}
	// Its extra is left to FDExtra.Decode: a RegionDescriptors with any
	// extra decodes.
	m := sRegionDescriptors
	m.Region.Extra = []byte("not an extra")
	if _, err := decRegionDescriptors(m.Append(nil)); err != nil {
		t.Errorf("extra bytes: %v", err)
	}
	// An old sidecar reads the message as an AttachRequest: a bad magic,
	// which it answers with status 1.
	var ar schema.AttachRequest
	if err := ar.Decode(good); err == nil || !strings.Contains(err.Error(), "magic") {
		t.Errorf("an AttachRequest decoder took a RegionDescriptors: %v", err)
	}
	var rep schema.RegionDescriptorsReply
	wantMalformed(t, rep.Decode(sAttachReply.Append(nil)), "an AttachReply read as a RegionDescriptorsReply")
	wantMalformed(t, rep.Decode(good[:15]), "a short reply")
}

func FuzzFDExtra(f *testing.F) {
	one := schema.FDExtra{Allocations: []schema.FDAllocation{{Base: 1 << 40, Size: 2 << 20}}}
	seeds(f, sFDExtra.Append(nil), one.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decFDExtra, func(v any) []byte { m := v.(schema.FDExtra); return m.Append(nil) })
	})
}

func FuzzRegionDescriptors(f *testing.F) {
	seeds(f, sRegionDescriptors.Append(nil), sRegionDescriptorsReply.Append(nil), sAttachRequest.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decRegionDescriptors, func(v any) []byte { m := v.(schema.RegionDescriptors); return m.Append(nil) })
		fuzzCodec(t, b, decRegionDescriptorsReply, func(v any) []byte { m := v.(schema.RegionDescriptorsReply); return m.Append(nil) })
	})
}
