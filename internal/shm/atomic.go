package shm

import (
	"fmt"
	"sync/atomic"
	"unsafe"
)

// U64 returns an atomic view of the naturally aligned 8-byte word at off in b.
// It panics on a misaligned or out-of-range offset: offsets come from
// constants of a fixed layout, never from peer input.
func U64(b []byte, off int) *atomic.Uint64 {
	if off < 0 || off+8 > len(b) {
		panic(fmt.Sprintf("shm: U64 offset %d outside %d bytes", off, len(b)))
	}
	p := unsafe.Pointer(&b[off])
	if uintptr(p)%8 != 0 {
		panic(fmt.Sprintf("shm: U64 offset %d is not 8-byte aligned", off))
	}
	return (*atomic.Uint64)(p)
}

// U32 returns an atomic view of the naturally aligned 4-byte word at off in b.
func U32(b []byte, off int) *atomic.Uint32 {
	if off < 0 || off+4 > len(b) {
		panic(fmt.Sprintf("shm: U32 offset %d outside %d bytes", off, len(b)))
	}
	p := unsafe.Pointer(&b[off])
	if uintptr(p)%4 != 0 {
		panic(fmt.Sprintf("shm: U32 offset %d is not 4-byte aligned", off))
	}
	return (*atomic.Uint32)(p)
}

// Aligned returns n zeroed bytes of Go heap memory whose start is 64-byte
// aligned, for tests and in-process rings that use the same layout code as
// shared mappings.
func Aligned(n int) []byte {
	words := make([]uint64, (n+64+7)/8)
	b := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), len(words)*8)
	skip := (64 - int(uintptr(unsafe.Pointer(&b[0]))%64)) % 64
	return b[skip : skip+n : skip+n]
}

// Addr returns the virtual address of b's first byte, for registering this
// process's own memory with the sidecar (which copies to and from it by
// address). b must stay alive and unmoved while registered: use memory
// that the garbage collector does not move (all Go heap memory today) and
// keep a reference.
func Addr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}
