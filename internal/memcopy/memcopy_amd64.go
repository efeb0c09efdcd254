package memcopy

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// useStream: VMOVNTDQ on 256-bit registers needs AVX (and the OS's saving
// of them, which cpu.X86.HasAVX includes).
var useStream = cpu.X86.HasAVX

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// streamAVX copies n bytes (a multiple of 128) from src to dst (32-byte
// aligned) with non-temporal stores, then fences them (SFENCE).
//
//go:noescape
func streamAVX(dst, src *byte, n int)

func stream(dst, src []byte) {
	if len(dst) > 0 {
		streamAVX(unsafe.SliceData(dst), unsafe.SliceData(src), len(dst))
	}
}
