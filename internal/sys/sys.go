// Package sys fences the few socket and file-system system calls the
// sidecar needs beyond the standard library: peer credentials and network
// namespace of a Unix socket connection and free space of a tmpfs.
package sys

import (
	"fmt"
	"net"
	"syscall"

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

// NetNSCookie returns the cookie of the network namespace a socket lives
// in (SO_NETNS_COOKIE, Linux 5.14): a number the kernel gives each network
// namespace, never reused while the system runs. A Unix socket connection
// accepted from a listener lives in the namespace of the socket that
// connected, so on an accepted connection it names the peer's network
// namespace, which in Kubernetes is its pod's (all containers of a pod
// share one; hostNetwork pods share the node's).
func NetNSCookie(c syscall.Conn) (uint64, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var v uint64
	var serr error
	err = raw.Control(func(fd uintptr) {
		v, serr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return 0, fmt.Errorf("SO_NETNS_COOKIE: %w", err)
	}
	return v, nil
}

// PeerClosed reports whether the other end of c has closed (POLLHUP: both
// directions shut, as the kernel does when the peer's last descriptor of
// it closes or its process dies), without reading: a connection whose
// reader has not yet seen the end.
func PeerClosed(c syscall.Conn) bool {
	raw, err := c.SyscallConn()
	if err != nil {
		return true
	}
	var hup bool
	if raw.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if n, err := unix.Poll(p, 0); err == nil && n == 1 {
			hup = p[0].Revents&(unix.POLLHUP|unix.POLLNVAL) != 0
		}
	}) != nil {
		return true
	}
	return hup
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
