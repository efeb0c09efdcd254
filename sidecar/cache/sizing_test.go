package cache

import (
	"math"
	"testing"
)

// An unbounded pool would hit every block stored since the start, whatever
// the pool evicted since: the sizing estimate counts them (every key is
// sampled while the sample is small), while the pool of 4 slots hits less.
func TestSizingCountsWhatAnUnboundedPoolWouldHit(t *testing.T) {
	for _, width := range []int{8, 16, 32} {
		x := newTC(t, 4)
		ns := x.ns(width, 1, 0)
		for i := range 10 {
			x.commit(x.begin(ns, 0, dig(i, width), 1, 0, Allocated))
		}
		if ev := x.c.Stats().Evictions; ev != 6 {
			t.Fatalf("width %d: evictions %d, want 6", width, ev)
		}
		// Blocks 0..9 were all stored once; 10..14 never were.
		if _, err := x.c.Lookup(ns, digs(width, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)); err != nil {
			t.Fatal(err)
		}
		st, z := x.c.Stats(), x.c.Sizing()
		if st.HitBlocks != 0 { // block 0 was evicted: the prefix stops there
			t.Fatalf("width %d: pool hits %d, want 0", width, st.HitBlocks)
		}
		want := SizingStats{SampledLookupBlocks: 15, SampledSeenBlocks: 10, Rate: 1, DistinctBlocks: 10, Samples: 10}
		if z != want {
			t.Fatalf("width %d: sizing %+v, want %+v", width, z, want)
		}
	}
}

// A digest stored in one namespace is a different block in another.
func TestSizingKeepsNamespacesApart(t *testing.T) {
	x := newTC(t, 8)
	a, b := x.ns(32, 1, 1), x.ns(32, 1, 2)
	x.commit(x.begin(a, 0, dig(1, 32), 1, 0, Allocated))
	if _, err := x.c.Lookup(b, dig(1, 32)); err != nil {
		t.Fatal(err)
	}
	if z := x.c.Sizing(); z.SampledLookupBlocks != 1 || z.SampledSeenBlocks != 0 {
		t.Fatalf("sizing %+v: a digest of namespace %d was seen in namespace %d", z, a, b)
	}
	if _, err := x.c.Lookup(a, dig(1, 32)); err != nil {
		t.Fatal(err)
	}
	if z := x.c.Sizing(); z.SampledLookupBlocks != 2 || z.SampledSeenBlocks != 1 {
		t.Fatalf("sizing %+v, want 2 looked up, 1 seen", z)
	}
}

// Past SizingSamples keys the sample halves its rate: it stays bounded,
// every key it keeps is under the threshold, and the distinct blocks and
// the unbounded hit ratio are still estimated (within a few percent for
// 4x the sample's size).
func TestSizingStaysBoundedAndEstimates(t *testing.T) {
	z := newSizing()
	const distinct = 4 * SizingSamples
	d := make([]byte, 32)
	for i := range distinct {
		copy(d, dig(i, 32))
		z.stored(3, d)
		if len(z.keys) > SizingSamples {
			t.Fatalf("after %d stores the sample holds %d keys", i+1, len(z.keys))
		}
	}
	for k := range z.keys {
		if k >= z.threshold {
			t.Fatalf("key %x at or above the threshold %x", k, z.threshold)
		}
	}
	// Look up every stored block once and as many never stored: an
	// unbounded pool hits half.
	for i := range 2 * distinct {
		copy(d, dig(i, 32))
		z.lookedUp(3, d, 32)
	}
	c := &Cache{sizing: z}
	st := c.Sizing()
	if st.Rate >= 1 || st.Samples != len(z.keys) {
		t.Fatalf("sizing %+v: the rate never fell", st)
	}
	if e := math.Abs(st.DistinctBlocks-distinct) / distinct; e > 0.05 {
		t.Fatalf("distinct blocks estimated %.0f, true %d (error %.3f)", st.DistinctBlocks, distinct, e)
	}
	r := float64(st.SampledSeenBlocks) / float64(st.SampledLookupBlocks)
	if math.Abs(r-0.5) > 0.02 {
		t.Fatalf("unbounded hit ratio estimated %.3f, true 0.5 (%d of %d)", r, st.SampledSeenBlocks, st.SampledLookupBlocks)
	}
}
