package gpu

import (
	"errors"
	"math"
	"reflect"
	"testing"
)

func TestMergeRanges(t *testing.T) {
	tests := []struct {
		name string
		in   []Range
		want []Range
	}{
		{"empty", nil, []Range{}},
		{"single", []Range{{0, 100, 10}}, []Range{{0, 100, 10}}},
		{"both contiguous", []Range{{0, 100, 10}, {10, 110, 10}, {20, 120, 5}}, []Range{{0, 100, 25}}},
		{"pool gap", []Range{{0, 100, 10}, {11, 110, 10}}, []Range{{0, 100, 10}, {11, 110, 10}}},
		{"engine gap", []Range{{0, 100, 10}, {10, 111, 10}}, []Range{{0, 100, 10}, {10, 111, 10}}},
		{"reversed order not merged", []Range{{10, 110, 10}, {0, 100, 10}}, []Range{{10, 110, 10}, {0, 100, 10}}},
		{"runs", []Range{{0, 0, 4}, {4, 4, 4}, {100, 8, 4}, {104, 12, 4}, {0, 200, 1}},
			[]Range{{0, 0, 8}, {100, 8, 8}, {0, 200, 1}}},
		{"zero length dropped", []Range{{0, 0, 0}, {0, 0, 4}, {4, 4, 0}, {4, 4, 4}}, []Range{{0, 0, 8}}},
		{"engine wraps", []Range{{0, math.MaxUint64 - 3, 4}, {4, 0, 4}}, []Range{{0, math.MaxUint64 - 3, 4}, {4, 0, 4}}},
		{"pool wraps", []Range{{math.MaxUint64 - 3, 0, 4}, {0, 4, 4}}, []Range{{math.MaxUint64 - 3, 0, 4}, {0, 4, 4}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := append([]Range(nil), tt.in...)
			got := MergeRanges(in)
			if got == nil {
				got = []Range{}
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("MergeRanges(%v)\n got %v\nwant %v", tt.in, got, tt.want)
			}
		})
	}
}

func validShared() Region {
	return Region{Kind: HostShared, Base: 0, Length: 4096, PageSize: 1024, PageCount: 4, Mapped: make([]byte, 4096)}
}

// validCUDA is a flat CUDA IPC region of 4 pages of 1 KiB in one
// allocation of 8 KiB.
func validCUDA() Region {
	r := Region{Kind: CUDAIPC, PID: 1, Base: 1 << 40, Length: 4096, PageSize: 1024, PageCount: 4}
	r.IPC.Allocations = []IPCAllocation{{Handle: [64]byte{1}, Base: 1 << 40, Size: 8192}}
	return r
}

func TestRegionValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(r *Region)
		ok   bool
	}{
		{"valid shared", func(r *Region) {}, true},
		{"valid process", func(r *Region) { r.Kind, r.PID, r.Mapped, r.Base = HostProcess, 1, nil, 1<<40 }, true},
		{"valid cuda", func(r *Region) { *r = validCUDA() }, true},
		{"host region with allocations", func(r *Region) { r.IPC = validCUDA().IPC }, false},
		{"valid segments", func(r *Region) {
			r.Segments = []Segment{{0, 512, 512}, {2048, 512, 512}}
		}, true},
		{"bad kind", func(r *Region) { r.Kind = 0 }, false},
		{"kind 9", func(r *Region) { r.Kind = 9 }, false},
		{"process no pid", func(r *Region) { r.Kind, r.Mapped = HostProcess, nil }, false},
		{"process with mapped", func(r *Region) { r.Kind, r.PID = HostProcess, 1 }, false},
		{"shared no mapping", func(r *Region) { r.Mapped = nil }, false},
		{"shared beyond mapping", func(r *Region) { r.Base = 1 }, false},
		{"shared base overflow", func(r *Region) { r.Base = math.MaxUint64 }, false},
		{"zero length", func(r *Region) { r.Length = 0 }, false},
		{"zero page size", func(r *Region) { r.PageSize = 0 }, false},
		{"zero page count", func(r *Region) { r.PageCount = 0 }, false},
		{"pages exceed length", func(r *Region) { r.PageCount = 5 }, false},
		{"pagesize*count overflows", func(r *Region) { r.PageSize = 1 << 40; r.PageCount = 1 << 30 }, false},
		{"base+length overflows", func(r *Region) {
			r.Kind, r.PID, r.Mapped, r.Base = HostProcess, 1, nil, math.MaxUint64-100
		}, false},
		{"segment zero length", func(r *Region) { r.Segments = []Segment{{0, 512, 0}, {0, 1024, 1024}} }, false},
		{"segment sum != page size", func(r *Region) { r.Segments = []Segment{{0, 512, 512}} }, false},
		{"segment past end", func(r *Region) { r.Segments = []Segment{{0, 512, 512}, {2049, 512, 512}} }, false},
		{"segment stride < length", func(r *Region) { r.Segments = []Segment{{0, 256, 512}, {2048, 512, 512}} }, false},
		{"segment stride overflow", func(r *Region) {
			r.Segments = []Segment{{0, math.MaxUint64 / 2, 512}, {2048, 512, 512}}
		}, false},
		{"segment offset overflow", func(r *Region) {
			r.Segments = []Segment{{math.MaxUint64 - 10, 512, 512}, {2048, 512, 512}}
		}, false},
		{"segment lengths overflow", func(r *Region) {
			r.Segments = []Segment{{0, 512, math.MaxUint64}, {0, 512, 2}}
		}, false},
		{"single page stride zero ok", func(r *Region) {
			r.PageCount = 1
			r.Segments = []Segment{{0, 0, 512}, {1024, 0, 512}}
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := validShared()
			tt.mod(&r)
			err := r.Validate()
			if tt.ok && err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
			if !tt.ok {
				if err == nil {
					t.Fatalf("Validate() = nil, want error")
				}
				if !errors.Is(err, ErrInvalidRegion) {
					t.Fatalf("Validate() = %v, want ErrInvalidRegion", err)
				}
			}
		})
	}
}

func TestPlanRanges(t *testing.T) {
	seg := Region{Kind: HostProcess, PID: 1, Base: 1000, Length: 4096, PageSize: 96, PageCount: 4,
		Segments: []Segment{{0, 64, 64}, {2048, 32, 32}}}
	flat := Region{Kind: HostProcess, PID: 1, Base: 1000, Length: 4096, PageSize: 1024, PageCount: 4}
	tests := []struct {
		name    string
		r       *Region
		pool    uint64
		pages   []uint32
		offs    []uint64
		want    []Range
		wantErr error
		index   int
	}{
		{"flat", &flat, 4096, []uint32{2, 0}, []uint64{0, 1024},
			[]Range{{0, 3048, 1024}, {1024, 1000, 1024}}, nil, 0},
		{"segments", &seg, 4096, []uint32{1, 3}, []uint64{0, 96},
			[]Range{{0, 1064, 64}, {64, 3080, 32}, {96, 1192, 64}, {160, 3144, 32}}, nil, 0},
		{"empty", &flat, 4096, nil, nil, nil, nil, 0},
		{"mismatch", &flat, 4096, []uint32{0}, nil, nil, ErrInvalidOp, -1},
		{"page out of range", &flat, 4096, []uint32{0, 4}, []uint64{0, 1024}, nil, ErrOutOfBounds, 1},
		{"pool past end", &flat, 4096, []uint32{0, 1}, []uint64{0, 3073}, nil, ErrOutOfBounds, 1},
		{"pool exactly at end", &flat, 4096, []uint32{0}, []uint64{3072}, []Range{{3072, 1000, 1024}}, nil, 0},
		{"pool offset overflow", &flat, 4096, []uint32{0}, []uint64{math.MaxUint64 - 10}, nil, ErrOutOfBounds, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.r.Validate(); err != nil {
				t.Fatal(err)
			}
			got, err := PlanRanges(nil, tt.r, tt.pool, tt.pages, tt.offs)
			if tt.wantErr != nil {
				var ce *CopyError
				if !errors.As(err, &ce) || !errors.Is(err, tt.wantErr) || ce.Index != tt.index {
					t.Fatalf("err = %v, want *CopyError index %d wrapping %v", err, tt.index, tt.wantErr)
				}
				if len(got) != 0 {
					t.Fatalf("ranges appended on error: %v", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) == 0 && len(tt.want) == 0 {
				return
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %v\nwant %v", got, tt.want)
			}
		})
	}
}
