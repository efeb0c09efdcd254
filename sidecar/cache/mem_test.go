package cache

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

// fill stores n distinct W=1 blocks with 32-byte digests into ns.
func fill(tb testing.TB, c *Cache, ns NamespaceID, from, n int) {
	tb.Helper()
	d := make([]byte, 32)
	for i := from; i < from+n; i++ {
		putDigest(d, i)
		tk, st, err := c.BeginStore(ns, 0, d, 1, 0)
		if err != nil || st != Allocated {
			tb.Fatalf("fill %d: %v %v", i, st, err)
		}
		if err := c.CommitStore(tk); err != nil {
			tb.Fatal(err)
		}
	}
}

// putDigest writes a pseudo-random 32-byte digest for i (like real hashes).
func putDigest(d []byte, i int) {
	x := uint64(i)*0x9E3779B97F4A7C15 + 1
	for j := 0; j < 32; j += 8 {
		x ^= x >> 29
		x *= 0xbf58476d1ce4e5b9
		x ^= x >> 32
		for k := 0; k < 8; k++ {
			d[j+k] = byte(x >> (8 * k))
		}
	}
}

func TestMemoryPerBlock(t *testing.T) {
	if raceEnabled {
		t.Skip("10M-slot allocation is slow under -race")
	}
	for _, pol := range []Policy{PolicyLRU, PolicyMQP, PolicyMQP2} {
		t.Run(pol.String(), func(t *testing.T) { memoryPerBlock(t, pol) })
	}
}

func memoryPerBlock(t *testing.T, pol Policy) {
	const capacity = 10_000_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	c, err := New(Config{Capacity: capacity, Epoch: 1, Policy: pol})
	if err != nil {
		t.Fatal(err)
	}
	ns, _ := c.AddNamespace(NamespaceKey{DigestWidth: 32, WorldSize: 1})
	filled := 0
	if !testing.Short() {
		fill(t, c, ns, 0, capacity)
		filled = capacity
	}
	elapsed := time.Since(start)
	runtime.GC()
	runtime.ReadMemStats(&after)
	heap := float64(after.HeapAlloc-before.HeapAlloc-uint64(c.LogBytes())) / capacity
	t.Logf("capacity %d, filled %d in %v: computed %.2f B/block (%d B), heap growth %.2f B/block excluding %d B delta log",
		capacity, filled, elapsed, c.BytesPerBlock(), c.MemoryBytes(), heap, c.LogBytes())
	if c.BytesPerBlock() > 64 {
		t.Fatalf("%.2f bytes per block > 64", c.BytesPerBlock())
	}
	if heap > 64 {
		t.Fatalf("heap grew %.2f bytes per block > 64", heap)
	}
	if filled > 0 {
		if c.Len(ns) != capacity {
			t.Fatalf("Len = %d", c.Len(ns))
		}
		d := make([]byte, 32)
		putDigest(d, capacity/2)
		if k, _ := c.Lookup(ns, d); k != 1 {
			t.Fatal("lookup at 10M")
		}
	}
	runtime.KeepAlive(c)
}

// TestDeltaCostShape asserts that ChangesSince costs O(changes), not
// O(cache size): reading the same number of changes from a cache with 10k
// blocks and one with 100x more must take about the same time.
func TestDeltaCostShape(t *testing.T) {
	small, large := 10_000, 1_000_000
	if raceEnabled || testing.Short() {
		large = 200_000
	}
	const changes = 2048
	measure := func(size int) time.Duration {
		c, err := New(Config{Capacity: size, Epoch: 1, DeltaLogSize: 4096})
		if err != nil {
			t.Fatal(err)
		}
		ns, _ := c.AddNamespace(NamespaceKey{DigestWidth: 32, WorldSize: 1})
		fill(t, c, ns, 0, size)
		cur, _ := c.Head(ns)
		fill(t, c, ns, size, changes/2) // each store evicts: 2 changes
		buf := make([]Change, 0, changes)
		best := time.Duration(1 << 62)
		for r := 0; r < 30; r++ {
			st := time.Now()
			for k := 0; k < 10; k++ {
				var err error
				buf, _, err = c.ChangesSince(ns, cur, changes, buf)
				if err != nil || len(buf) != changes {
					t.Fatalf("%d changes, %v", len(buf), err)
				}
			}
			if d := time.Since(st); d < best {
				best = d
			}
		}
		return best
	}
	ts, tl := measure(small), measure(large)
	ratio := float64(tl) / float64(ts)
	t.Logf("ChangesSince(%d changes): %d blocks %v, %d blocks %v, ratio %.2f", changes, small, ts/10, large, tl/10, ratio)
	if ratio >= 3 {
		t.Fatalf("delta cost grows with cache size: ratio %.2f", ratio)
	}
}

func BenchmarkLookup(b *testing.B) {
	const size = 1 << 20
	c, _ := New(Config{Capacity: size, Epoch: 1})
	ns, _ := c.AddNamespace(NamespaceKey{DigestWidth: 32, WorldSize: 1})
	fill(b, c, ns, 0, size)
	for _, n := range []int{64, 1024} {
		flat := make([]byte, 32*n)
		for i := 0; i < n; i++ {
			putDigest(flat[32*i:], 1000+i)
		}
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if k, _ := c.Lookup(ns, flat); k != n {
					b.Fatal(k)
				}
			}
		})
	}
}

func BenchmarkStoreCommit(b *testing.B) {
	const size = 1 << 20
	c, _ := New(Config{Capacity: size, Epoch: 1})
	ns, _ := c.AddNamespace(NamespaceKey{DigestWidth: 32, WorldSize: 1})
	fill(b, c, ns, 0, size) // full: every store also evicts
	d := make([]byte, 32)
	i := size
	b.ReportAllocs()
	for b.Loop() {
		putDigest(d, i)
		i++
		tk, st, _ := c.BeginStore(ns, 0, d, 1, 0)
		if st != Allocated {
			b.Fatal(st)
		}
		c.CommitStore(tk)
	}
}

func BenchmarkDelta(b *testing.B) {
	for _, size := range []int{10_000, 1_000_000} {
		c, _ := New(Config{Capacity: size, Epoch: 1})
		ns, _ := c.AddNamespace(NamespaceKey{DigestWidth: 32, WorldSize: 1})
		fill(b, c, ns, 0, size)
		cur, _ := c.Head(ns)
		fill(b, c, ns, size, 512) // 1024 changes
		buf := make([]Change, 0, 1024)
		b.Run(fmt.Sprintf("ChangesSince1024/%d", size), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				buf, _, _ = c.ChangesSince(ns, cur, 1024, buf)
			}
		})
		b.Run(fmt.Sprintf("Snapshot/%d", size), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				n := 0
				c.Snapshot(ns, func([]byte) bool { n++; return true })
				if n != size {
					b.Fatal(n)
				}
			}
		})
	}
}
