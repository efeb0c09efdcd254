package gpu

import (
	"errors"
	"strings"
	"testing"
)

// perLayerCUDA is a CUDA IPC region laid out as vLLM's FlashAttention backend
// allocates the KV cache: one allocation per layer, each holding the K
// pages of every block and then the V pages (two segments per layer).
// Allocation l lies at base + l*(allocSize+gap).
func perLayerCUDA(layers int, pages uint32, pageLen, allocSize, gap uint64) Region {
	const base = 1 << 40
	r := Region{Kind: CUDAIPC, PID: 1, Base: base, PageCount: pages}
	for l := range layers {
		at := uint64(l) * (allocSize + gap)
		var h [64]byte
		h[0], h[1] = byte(l), byte(l>>8)+1
		r.IPC.Allocations = append(r.IPC.Allocations, IPCAllocation{Handle: h, Base: base + at, Size: allocSize})
		r.Segments = append(r.Segments,
			Segment{Offset: at, Stride: pageLen, Length: pageLen},
			Segment{Offset: at + uint64(pages)*pageLen, Stride: pageLen, Length: pageLen})
		r.Length = at + allocSize
	}
	r.PageSize = 2 * uint64(layers) * pageLen
	return r
}

func TestRegionCUDAAllocations(t *testing.T) {
	const pages, pageLen = 16, 4096
	alloc := uint64(2 * pages * pageLen)
	ok := perLayerCUDA(32, pages, pageLen, alloc, 1<<20)
	if err := ok.Validate(); err != nil {
		t.Fatalf("32 layers, K and V each: %v", err)
	}
	of, err := ok.SegmentAllocations()
	if err != nil {
		t.Fatal(err)
	}
	for i, a := range of {
		if a != i/2 {
			t.Fatalf("segment %d in allocation %d, want %d", i, a, i/2)
		}
	}
	// Adjacent allocations (no gap) are valid too.
	if r := perLayerCUDA(4, pages, pageLen, alloc, 0); r.Validate() != nil {
		t.Fatalf("adjacent allocations: %v", r.Validate())
	}
	for _, tc := range []struct {
		name string
		mod  func(r *Region)
		text string
	}{
		{"no allocation", func(r *Region) { r.IPC.Allocations = nil }, "without an allocation"},
		{"no handle", func(r *Region) { r.IPC.Allocations[3].Handle = [64]byte{} }, "allocation 3 without an IPC handle"},
		{"empty allocation", func(r *Region) { r.IPC.Allocations[0].Size = 0 }, "empty or overflows"},
		{"overflowing allocation", func(r *Region) { r.IPC.Allocations[0].Size = ^uint64(0) }, "empty or overflows"},
		{"overlapping", func(r *Region) { r.IPC.Allocations[5].Size += 1<<20 + 1 }, "allocations 5 "},
		{"duplicate base", func(r *Region) { r.IPC.Allocations[7].Base = r.IPC.Allocations[6].Base }, "overlap"},
		{"segment outside every allocation", func(r *Region) { r.Segments[9].Offset = 4*(alloc+1<<20) + alloc + 4096 }, "segment 9 [0x100004a1000,0x100004b1000) lies in no allocation"},
		{"segment before the first allocation", func(r *Region) {
			r.Base -= 4096
			for i := range r.Segments {
				r.Segments[i].Offset += 4096
			}
			r.Segments[0].Offset = 0
			r.Length += 4096
		}, "segment 0 [0xfffffff000,0x1000000f000) lies in no allocation"},
		{"segment straddling two", func(r *Region) {
			r.IPC.Allocations[1].Base = r.IPC.Allocations[0].Base + alloc
			r.IPC.Allocations[0].Size = alloc - 4096
			r.IPC.Allocations[1].Size = alloc + 4096
			r.Segments[2].Offset -= 1 << 20
		}, "runs past the end of allocation 0"},
		{"allocation with no segment", func(r *Region) {
			r.Segments[4].Offset, r.Segments[5].Offset = r.Segments[2].Offset, r.Segments[3].Offset
		}, "allocation 2 [0x"},
		{"event without the flag", func(r *Region) { r.IPC.Event[0] = 1 }, "without HasEvent"},
		{"flag without an event", func(r *Region) { r.IPC.HasEvent = true }, "without an event handle"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := perLayerCUDA(32, pages, pageLen, alloc, 1<<20)
			r.IPC.Allocations = append([]IPCAllocation(nil), r.IPC.Allocations...)
			tc.mod(&r)
			err := r.Validate()
			if !errors.Is(err, ErrInvalidRegion) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("Validate = %v, want ErrInvalidRegion mentioning %q", err, tc.text)
			}
			t.Log(err)
		})
	}
	// A flat region is one span: it must lie in one allocation too.
	flat := validCUDA()
	flat.IPC.Allocations[0].Size = 2048
	if err := flat.Validate(); !errors.Is(err, ErrInvalidRegion) || !strings.Contains(err.Error(), "runs past the end of allocation 0") {
		t.Errorf("flat region past its allocation: %v", err)
	}
}
