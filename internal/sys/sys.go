// Package sys fences the few socket and file-system system calls the
// sidecar needs beyond the standard library: peer credentials of a Unix
// socket connection and free space of a tmpfs.
package sys

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// Cred is a Unix socket peer's credentials, as the kernel recorded them at
// connect time (SO_PEERCRED).
type Cred struct {
	PID int
	UID uint32
	GID uint32
}

// PeerCred returns the credentials of the process at the other end of c.
func PeerCred(c *net.UnixConn) (Cred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return Cred{}, err
	}
	var cred *unix.Ucred
	var serr error
	err = raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return Cred{}, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	return Cred{PID: int(cred.Pid), UID: cred.Uid, GID: cred.Gid}, nil
}

// FreeBytes reports the bytes available to an unprivileged writer in the
// file system holding path (for /dev/shm: what is left of the tmpfs size
// limit, which a memory-backed emptyDir sets in Kubernetes).
func FreeBytes(path string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", path, err)
	}
	return st.Bavail * uint64(st.Bsize), nil
}
