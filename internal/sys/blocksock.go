package sys

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Blocking stream sockets, used by the Unix-socket baselines of the
// benchmarks: plain read(2) and write(2) on a blocking descriptor, the way a
// C or Rust socket server works, without Go's netpoller. Timeouts come from
// SO_RCVTIMEO and SO_SNDTIMEO; a timed-out call returns
// os.ErrDeadlineExceeded.

// ListenStream binds and listens on a SOCK_STREAM Unix socket at path,
// replacing a file left there.
func ListenStream(path string) (int, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	os.Remove(path)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind %s: %w", path, err)
	}
	if err := unix.Listen(fd, 1); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// AcceptStream accepts one connection on lfd, waiting at most timeout.
func AcceptStream(lfd int, timeout time.Duration) (int, error) {
	if err := SetTimeouts(lfd, timeout); err != nil {
		return -1, err
	}
	for {
		fd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return -1, ioErr("accept", err)
		}
		return fd, nil
	}
}

// DialStream connects to a SOCK_STREAM Unix socket.
func DialStream(path string) (int, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("connect %s: %w", path, err)
	}
	return fd, nil
}

// SetTimeouts makes fd blocking with receive and send timeouts.
func SetTimeouts(fd int, timeout time.Duration) error {
	if err := unix.SetNonblock(fd, false); err != nil {
		return err
	}
	tv := unix.NsecToTimeval(int64(timeout))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return err
	}
	return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
}

// Read is read(2), retried on EINTR.
func Read(fd int, b []byte) (int, error) {
	for {
		n, err := unix.Read(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, ioErr("read", err)
		}
		return n, nil
	}
}

// WriteAll writes all of b with write(2), retried on EINTR.
func WriteAll(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return ioErr("write", err)
		}
		b = b[n:]
	}
	return nil
}

// Close closes a descriptor.
func Close(fd int) error { return unix.Close(fd) }

// AllowPtracer lets process pid read this process's memory with
// process_vm_readv under Yama ptrace_scope 1 (PR_SET_PTRACER); a no-op where
// Yama is absent.
func AllowPtracer(pid int) error {
	return unix.Prctl(unix.PR_SET_PTRACER, uintptr(pid), 0, 0, 0)
}

func ioErr(op string, err error) error {
	if errors.Is(err, unix.EAGAIN) {
		err = os.ErrDeadlineExceeded
	}
	return fmt.Errorf("%s: %w", op, err)
}
