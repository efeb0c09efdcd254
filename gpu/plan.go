package gpu

import (
	"fmt"
	"math/bits"
)

// Range is one contiguous transfer: Len bytes at pool offset Pool and at
// engine address Engine (in the region's address space, Base included).
type Range struct {
	Pool   uint64
	Engine uint64
	Len    uint64
}

// PlanRanges bounds-checks pages and poolOffsets against r and a pool of
// poolLen bytes and appends the resulting ranges (unmerged, page-major,
// segments in order) to dst. r must already have passed Validate. Nothing
// is appended on error; the error is a *CopyError with Dir and Region
// unset, for the caller to fill in.
func PlanRanges(dst []Range, r *Region, poolLen uint64, pages []uint32, poolOffsets []uint64) ([]Range, error) {
	if len(pages) != len(poolOffsets) {
		return dst, &CopyError{Index: -1, Err: fmt.Errorf("%w: %d pages but %d pool offsets", ErrInvalidOp, len(pages), len(poolOffsets))}
	}
	for i, p := range pages {
		if p >= r.PageCount {
			return dst, &CopyError{Index: i, Page: p, Err: fmt.Errorf("%w: page %d >= page count %d", ErrOutOfBounds, p, r.PageCount)}
		}
		off := poolOffsets[i]
		if end, c := bits.Add64(off, r.PageSize, 0); c != 0 || end > poolLen {
			return dst, &CopyError{Index: i, Page: p, Err: fmt.Errorf("%w: pool offset %d + page size %d > pool size %d", ErrOutOfBounds, off, r.PageSize, poolLen)}
		}
	}
	// Validate guarantees every page/segment address below fits in
	// [Base, Base+Length) without overflow, so no further checks.
	n := len(pages)
	if len(r.Segments) > 0 {
		n *= len(r.Segments)
	}
	dst = growRanges(dst, n)
	for i, p := range pages {
		pool := poolOffsets[i]
		if len(r.Segments) == 0 {
			dst = append(dst, Range{Pool: pool, Engine: r.Base + uint64(p)*r.PageSize, Len: r.PageSize})
			continue
		}
		for _, s := range r.Segments {
			dst = append(dst, Range{Pool: pool, Engine: r.Base + s.Offset + uint64(p)*s.Stride, Len: s.Length})
			pool += s.Length
		}
	}
	return dst, nil
}

func growRanges(s []Range, n int) []Range {
	if cap(s)-len(s) >= n {
		return s
	}
	t := make([]Range, len(s), len(s)+n)
	copy(t, s)
	return t
}

// MergeRanges coalesces consecutive ranges that are contiguous on both
// sides (a.Pool+a.Len == b.Pool and a.Engine+a.Len == b.Engine) into one,
// in place, and returns the shortened slice. It does not reorder ranges,
// drops zero-length ones, and never merges across a uint64 overflow.
func MergeRanges(rs []Range) []Range {
	out := rs[:0]
	for _, r := range rs {
		if r.Len == 0 {
			continue
		}
		if k := len(out) - 1; k >= 0 {
			last := &out[k]
			pe, c1 := bits.Add64(last.Pool, last.Len, 0)
			ee, c2 := bits.Add64(last.Engine, last.Len, 0)
			sum, c3 := bits.Add64(last.Len, r.Len, 0)
			if c1 == 0 && c2 == 0 && c3 == 0 && pe == r.Pool && ee == r.Engine {
				last.Len = sum
				continue
			}
		}
		out = append(out, r)
	}
	return out
}
