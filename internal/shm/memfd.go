package shm

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// CreateMemfd creates an anonymous shared-memory file of size bytes
// (memfd_create: no path, so only processes handed its descriptor can map
// it), maps it read-write, and seals it against shrinking and growing and
// against further seals: whoever it is passed to can neither truncate it
// under this process's mapping (which would make its accesses fault) nor
// seal it against this process's writes. With alloc, every page is
// allocated first (fallocate): a memory limit too small for it fails here.
// The descriptor (FD) is close-on-exec.
func CreateMemfd(name string, size int, alloc bool) (*Mapping, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shm: memfd %s: size %d must be positive", name, size)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, &os.PathError{Op: "memfd_create", Path: name, Err: err}
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "memfd truncate", Path: name, Err: err}
	}
	if alloc {
		if err := allocate(fd, int64(size)); err != nil {
			unix.Close(fd)
			return nil, &os.PathError{Op: "memfd allocate", Path: name, Err: err}
		}
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "memfd seal", Path: name, Err: err}
	}
	return mapFD(fd, "memfd:"+name, size)
}

// SealedAgainstResize reports whether the file fd can neither shrink nor
// grow (a memfd sealed so): a mapping of it cannot fault for its size.
func SealedAgainstResize(fd int) bool {
	s, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	return err == nil && s&unix.F_SEAL_SHRINK != 0 && s&unix.F_SEAL_GROW != 0
}
