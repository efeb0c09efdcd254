// Package shm is the one place in ringside that touches unsafe, mmap and raw
// system calls for shared memory: it maps files under /dev/shm, hands out
// typed atomics that point into a mapping, waits and wakes on futex words,
// and tells whether a process is still the one that created a ring.
//
// Everything above this package (ring, sidecar, connector) works on plain
// []byte and *atomic.Uint64 values and stays free of unsafe. Do not widen
// this package's API casually: every exported function here is a place where
// a mistake becomes memory corruption instead of an error.
package shm
