package shm

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// FD is the mapped file's descriptor, e.g. to pass to another process
// over a Unix socket (SCM_RIGHTS). It stays valid until Close.
func (m *Mapping) FD() int { return int(m.f.Fd()) }

// OpenFD maps the file behind fd, which the caller hands over (it is
// closed with the Mapping, or at once on error). The file must be a
// regular file of at least minSize bytes; name is used in errors and as
// the Mapping's path. It is how a client maps a ring the sidecar passed it
// as a descriptor: no path is needed, so no other process can open it.
func OpenFD(fd int, name string, minSize int) (*Mapping, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "shm stat", Path: name, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: open %s: not a regular file", name)
	}
	if st.Size < int64(minSize) || st.Size > 1<<40 {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: open %s: size %d outside [%d, 1 TiB]", name, st.Size, minSize)
	}
	unix.CloseOnExec(fd)
	return mapFD(fd, name, int(st.Size))
}
