package shm

import (
	"errors"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// OnMemoryFS reports whether the file fd lives on a memory file system
// (tmpfs, which memfds and /dev/shm use, or hugetlbfs): touching a mapping
// of it never waits for a device or a remote server.
func OnMemoryFS(fd int) bool {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return false
	}
	return st.Type == unix.TMPFS_MAGIC || st.Type == unix.HUGETLBFS_MAGIC
}

// pages widens b to the whole pages it touches.
func pages(b []byte) (uintptr, uintptr) {
	page := uintptr(os.Getpagesize())
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	end := start + uintptr(len(b))
	start &^= page - 1
	end = (end + page - 1) &^ (page - 1)
	return start, end
}

// Resident reports whether every page b touches (b in a shared mapping)
// is in memory (mincore): writing there then allocates nothing, so no
// memory is charged to the writer, and cannot fault for a full mount.
// vec is scratch space for the answer (grown as needed, returned).
func Resident(b []byte, vec []byte) (bool, []byte, error) {
	if len(b) == 0 {
		return true, vec, nil
	}
	start, end := pages(b)
	n := int((end - start) / uintptr(os.Getpagesize()))
	if cap(vec) < n {
		vec = make([]byte, n)
	}
	vec = vec[:n]
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, start, end-start, uintptr(unsafe.Pointer(unsafe.SliceData(vec)))); e != 0 {
		return false, vec, e
	}
	for _, v := range vec {
		if v&1 == 0 {
			return false, vec, nil
		}
	}
	return true, vec, nil
}

// Populate allocates and maps every page b touches (b in a shared
// mapping), charged to this process (MADV_POPULATE_WRITE): afterwards
// Resident reports them in memory. A full mount or memory limit fails
// here, with an error, instead of faulting a later write.
func Populate(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	start, end := pages(b)
	if _, _, e := unix.Syscall(unix.SYS_MADVISE, start, end-start, unix.MADV_POPULATE_WRITE); e != 0 {
		if errors.Is(e, unix.EINVAL) {
			return ErrReserveUnsupported
		}
		return e
	}
	return nil
}
