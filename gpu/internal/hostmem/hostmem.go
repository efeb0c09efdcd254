// Package hostmem maps anonymous memory outside the Go heap: pools and
// buffers for tests and benchmarks of the copy engines (the CUDA backend
// pins its pool, which must not be Go heap memory).
package hostmem

import "golang.org/x/sys/unix"

// Map returns n bytes of zeroed, page-aligned anonymous shared memory.
func Map(n int) ([]byte, error) {
	return unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
}

// Unmap releases memory returned by Map.
func Unmap(b []byte) error { return unix.Munmap(b) }
