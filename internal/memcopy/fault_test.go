package memcopy

import (
	"runtime/debug"
	"testing"

	"golang.org/x/sys/unix"
)

// TestStreamFault: a destination whose pages went away under the copy (a
// file truncated by another process) faults inside the streaming stores;
// with debug.SetPanicOnFault, as the node tier's copies run, the fault is
// a panic the caller recovers, not the process's end.
func TestStreamFault(t *testing.T) {
	const size = 64 << 10
	fd, err := unix.MemfdCreate("memcopy-fault", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skip("memfd_create:", err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	dst, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(dst)
	if err := unix.Ftruncate(fd, 0); err != nil {
		t.Fatal(err)
	}
	src := make([]byte, size)
	faulted := func() (addr uintptr, ok bool) {
		defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
		defer func() {
			if r := recover(); r != nil {
				f, is := r.(interface{ Addr() uintptr })
				if !is {
					panic(r)
				}
				addr, ok = f.Addr(), true
			}
		}()
		Stream(dst, src)
		return 0, false
	}
	addr, ok := faulted()
	if !ok {
		t.Fatal("a copy into truncated pages did not fault")
	}
	if base := uintptrOf(dst); useStream && (addr < base || addr >= base+size) {
		t.Fatalf("fault at %#x, outside the destination %#x+%d", addr, base, size)
	}
}
