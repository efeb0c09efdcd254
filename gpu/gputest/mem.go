package gputest

import "github.com/ringside-kv/ringside/gpu/internal/hostmem"

// MapAnon returns n bytes of zeroed, page-aligned anonymous shared memory
// outside the Go heap: a pool for tests and benchmarks of the copy engines
// (the CUDA backend pins its pool, which must not be Go heap memory).
func MapAnon(n int) ([]byte, error) { return hostmem.Map(n) }

// UnmapAnon releases memory returned by MapAnon.
func UnmapAnon(b []byte) error { return hostmem.Unmap(b) }
