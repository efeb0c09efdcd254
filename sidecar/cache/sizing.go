package cache

import "encoding/binary"

// Sizing: what a pool of unbounded size would have hit.
//
// A pool that never evicted would find, at a lookup, every block stored
// since the cache started. The sizing estimate keeps a spatial sample of
// the blocks that became present (SHARDS, Waldspurger et al., FAST 2015:
// a block is in the sample when a hash of its key falls under a
// threshold), and counts, among the looked-up blocks that fall in the
// sample, how many the sample holds. Their ratio estimates the block hit
// ratio of an unbounded pool, against the actual one (HitBlocks /
// LookupBlocks). With chained block digests a block seen before implies
// its whole prefix was seen before, so per-block hits of an unbounded
// pool are prefix hits too.
//
// The sample holds at most SizingSamples keys: when it would hold more,
// the threshold halves and the keys above it leave (one pass over the
// sample, at most once per SizingSamples/2 insertions: O(1) amortized).
// The rate (threshold / 2^64) then applies to what is counted after it;
// the counters are monotonic, so a ratio of their rates over a window
// (Prometheus rate()) weighs the window's lookups by the rate in force
// when each was counted. Memory: at most SizingSamples map entries,
// independent of the pool's capacity. Deterministic: no randomness (the
// hash is a fixed mix of the digest and its namespace).

// SizingSamples bounds the sample of block keys the sizing estimate keeps.
const SizingSamples = 1 << 15

type sizing struct {
	threshold uint64              // a key is sampled when key < threshold; ^0: every key
	keys      map[uint64]struct{} // sampled keys of blocks that became present
	refs      uint64              // sampled looked-up blocks
	seen      uint64              // of them, those in keys
	halvings  uint64
}

func newSizing() sizing {
	return sizing{threshold: ^uint64(0), keys: make(map[uint64]struct{})}
}

// sizingKey mixes a digest's 8-byte words (a shorter tail zero padded)
// with its namespace (splitmix64's finalizer after each word), so that the
// keys are uniform in [0, 2^64) whatever part of the digest varies, and a
// digest in two namespaces gives two keys.
func sizingKey(ns uint16, digest []byte) uint64 {
	x := (uint64(ns) + 1) * 0x9e3779b97f4a7c15
	for off := 0; off < len(digest); off += 8 {
		var b [8]byte
		copy(b[:], digest[off:])
		x ^= binary.LittleEndian.Uint64(b[:])
		x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
		x = (x ^ (x >> 27)) * 0x94d049bb133111eb
		x ^= x >> 31
	}
	return x
}

// lookedUp counts the sampled blocks of one lookup's digests.
func (z *sizing) lookedUp(ns uint16, digests []byte, width int) {
	for off := 0; off+width <= len(digests); off += width {
		k := sizingKey(ns, digests[off:off+width])
		if k >= z.threshold {
			continue
		}
		z.refs++
		if _, ok := z.keys[k]; ok {
			z.seen++
		}
	}
}

// stored notes a block that became present.
func (z *sizing) stored(ns uint16, digest []byte) {
	k := sizingKey(ns, digest)
	if k >= z.threshold {
		return
	}
	z.keys[k] = struct{}{}
	if len(z.keys) <= SizingSamples {
		return
	}
	z.threshold /= 2
	z.halvings++
	for k := range z.keys {
		if k >= z.threshold {
			delete(z.keys, k)
		}
	}
}

// SizingStats is the sizing estimate's state (see Cache.Sizing).
type SizingStats struct {
	// SampledLookupBlocks counts the looked-up blocks in the sample, and
	// SampledSeenBlocks those of them stored at some time since the cache
	// started: SampledSeenBlocks / SampledLookupBlocks estimates the hit
	// ratio of a pool of unbounded size.
	SampledLookupBlocks, SampledSeenBlocks uint64
	// Rate is the fraction of keys sampled now (1, 1/2, 1/4, ...).
	Rate float64
	// DistinctBlocks estimates the distinct blocks stored since the cache
	// started (sampled keys / Rate): the capacity, in blocks, of a pool
	// that would never have evicted.
	DistinctBlocks float64
	// Samples is the number of keys the sample holds (at most SizingSamples).
	Samples int
}

// Sizing returns the sizing estimate: what a pool of unbounded size would
// have hit (see sizing.go).
func (c *Cache) Sizing() SizingStats {
	z := &c.sizing
	rate := 1.0
	for range z.halvings {
		rate /= 2
	}
	return SizingStats{
		SampledLookupBlocks: z.refs, SampledSeenBlocks: z.seen,
		Rate: rate, DistinctBlocks: float64(len(z.keys)) / rate, Samples: len(z.keys),
	}
}
