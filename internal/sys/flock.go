package sys

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// FileLock is an exclusive flock(2) on a file, held until Unlock or the
// process's end (the kernel drops it with the last descriptor, so a
// SIGKILLed holder never leaves it taken).
type FileLock struct {
	f    *os.File
	path string
}

// LockedError reports that another open file description holds the lock;
// Holder is what its holder wrote into the file (empty if it had not yet).
type LockedError struct {
	Path   string
	Holder string
}

func (e *LockedError) Error() string {
	if e.Holder == "" {
		return fmt.Sprintf("%s is locked by another process", e.Path)
	}
	return fmt.Sprintf("%s is locked by another process (%q)", e.Path, e.Holder)
}

// TryLock takes an exclusive lock on the file at path without waiting,
// creating it (mode 0600, never through a symbolic link) if need be, and
// writes content into it. Another holder gives a *LockedError. A lock file
// that its holder removed while this process locked it is opened again, so
// that the lock held is always on the file now at path.
func TryLock(path string, content []byte) (*FileLock, error) {
	return tryLock(path, content, false)
}

// TryLockWriteOnly is TryLock for a lock file in a directory that others
// of the same uid see through a read-only mount: the file is mode 0200
// (made so once locked, if an earlier holder left it otherwise) and opened
// write-only. flock(2) takes a lock through any descriptor, a read-only
// one included, so a file they could open for reading they could hold
// locked, and no later holder could start; one they can open neither for
// reading (its mode) nor for writing (their mount) they cannot. Root
// bypasses the mode. Another holder's LockedError has no Holder (the file
// is not read).
func TryLockWriteOnly(path string, content []byte) (*FileLock, error) {
	return tryLock(path, content, true)
}

func tryLock(path string, content []byte, writeOnly bool) (*FileLock, error) {
	flags, mode := unix.O_RDWR, uint32(0o600)
	if writeOnly {
		flags, mode = unix.O_WRONLY, 0o200
	}
	for range 16 {
		fd, err := unix.Open(path, flags|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
		if err != nil {
			return nil, &os.PathError{Op: "lock open", Path: path, Err: err}
		}
		f := os.NewFile(uintptr(fd), path)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			f.Close()
			return nil, fmt.Errorf("lock %s: not a regular file", path)
		}
		if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
			b := make([]byte, 64)
			n := 0
			if !writeOnly {
				n, _ = unix.Pread(fd, b, 0)
			}
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, &LockedError{Path: path, Holder: string(b[:max(n, 0)])}
			}
			return nil, &os.PathError{Op: "flock", Path: path, Err: err}
		}
		var now unix.Stat_t
		if err := unix.Lstat(path, &now); err != nil || now.Ino != st.Ino || now.Dev != st.Dev {
			f.Close() // removed or replaced by its last holder: lock the new one
			continue
		}
		if writeOnly && st.Mode&0o7777 != mode {
			if err := unix.Fchmod(fd, mode); err != nil {
				f.Close()
				return nil, &os.PathError{Op: "lock chmod", Path: path, Err: err}
			}
		}
		if _, err := unix.Pwrite(fd, content, 0); err != nil {
			f.Close()
			return nil, &os.PathError{Op: "lock write", Path: path, Err: err}
		}
		unix.Ftruncate(fd, int64(len(content)))
		return &FileLock{f: f, path: path}, nil
	}
	return nil, fmt.Errorf("lock %s: the file keeps being replaced", path)
}

// Unlock removes the lock file and releases the lock (in that order, so
// that a process waiting for it locks a new file; see TryLock).
func (l *FileLock) Unlock() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := unix.Unlink(l.path)
	if errors.Is(err, unix.ENOENT) {
		err = nil
	}
	err = errors.Join(err, l.f.Close())
	l.f = nil
	return err
}
