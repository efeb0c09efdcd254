package shm

import (
	"errors"
	"fmt"
	"os"

	mmap "github.com/edsrzf/mmap-go"
	"golang.org/x/sys/unix"
)

// Mapping is a shared-memory file mapped read-write into this process.
type Mapping struct {
	path string
	f    *os.File
	m    mmap.MMap
}

// ErrExists reports that Create found a file already at the path.
var ErrExists = errors.New("shm: file exists")

// Create makes a new file of exactly size bytes at path and maps it. It never
// follows a symbolic link planted at the path and never reuses an existing
// file: O_CREAT|O_EXCL|O_NOFOLLOW. The file is zero-filled by the kernel.
//
// The file is sparse: its pages are allocated as they are first written,
// and on a full tmpfs that write raises SIGBUS. Mappings this process
// writes directly are made with CreateAllocated (or reserved, see Reserve).
func Create(path string, size int, mode os.FileMode) (*Mapping, error) {
	return create(path, size, mode, false)
}

// CreateAllocated is Create, and allocates every page of the file before
// mapping it, so that no access to the mapping can fault for want of space:
// a mount without room for size bytes fails here with an error wrapping
// unix.ENOSPC (errors.Is(err, syscall.ENOSPC)), and the file is removed.
// On tmpfs the pages are charged now, to the mount and to this process's
// memory limit. Where the file system lacks fallocate, the file is written
// with zeros instead.
func CreateAllocated(path string, size int, mode os.FileMode) (*Mapping, error) {
	return create(path, size, mode, true)
}

func create(path string, size int, mode os.FileMode, alloc bool) (*Mapping, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shm: create %s: size %d must be positive", path, size)
	}
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, uint32(mode.Perm()))
	if err != nil {
		if errors.Is(err, unix.EEXIST) {
			return nil, fmt.Errorf("%w: %s", ErrExists, path)
		}
		return nil, &os.PathError{Op: "shm create", Path: path, Err: err}
	}
	// The umask may have narrowed the mode; set exactly what was asked.
	if err := unix.Fchmod(fd, uint32(mode.Perm())); err != nil {
		unix.Close(fd)
		unix.Unlink(path)
		return nil, &os.PathError{Op: "shm chmod", Path: path, Err: err}
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		unix.Unlink(path)
		return nil, &os.PathError{Op: "shm truncate", Path: path, Err: err}
	}
	if alloc {
		if err := allocate(fd, int64(size)); err != nil {
			unix.Close(fd)
			unix.Unlink(path)
			return nil, &os.PathError{Op: "shm allocate", Path: path, Err: err}
		}
	}
	m, err := mapFD(fd, path, size)
	if err != nil {
		unix.Unlink(path)
		return nil, err
	}
	return m, nil
}

// allocate gives the file fd its first size bytes of backing store:
// fallocate, or, where the file system has none, writing zeros (which
// allocates too).
func allocate(fd int, size int64) error {
	err := unix.Fallocate(fd, 0, 0, size)
	if !errors.Is(err, unix.EOPNOTSUPP) {
		return err
	}
	return writeZeros(fd, size)
}

// writeZeros writes zeros over the first size bytes of the file fd.
func writeZeros(fd int, size int64) error {
	zeros := make([]byte, 64<<10)
	for off := int64(0); off < size; {
		n, err := unix.Pwrite(fd, zeros[:min(int64(len(zeros)), size-off)], off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		off += int64(n)
	}
	return nil
}

// Open maps an existing file at path without following a symbolic link. The
// file must be a regular file of at least minSize bytes; the whole file is
// mapped and its size is fixed from then on (see Len).
func Open(path string, minSize int) (*Mapping, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "shm open", Path: path, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "shm stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: open %s: not a regular file", path)
	}
	if st.Size < int64(minSize) || st.Size > 1<<40 {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: open %s: size %d outside [%d, 1 TiB]", path, st.Size, minSize)
	}
	return mapFD(fd, path, int(st.Size))
}

func mapFD(fd int, path string, size int) (*Mapping, error) {
	f := os.NewFile(uintptr(fd), path)
	mm, err := mmap.MapRegion(f, size, mmap.RDWR, 0, 0)
	if err != nil {
		f.Close()
		return nil, &os.PathError{Op: "shm mmap", Path: path, Err: err}
	}
	return &Mapping{path: path, f: f, m: mm}, nil
}

// ErrReserveUnsupported reports that the file system can neither allocate
// a file's pages ahead (fallocate) nor the kernel fault them in without a
// signal on failure (MADV_POPULATE_WRITE, Linux 5.14): Reserve did nothing.
var ErrReserveUnsupported = errors.New("shm: reserving pages is not supported here")

// reserveSink keeps the page-touching loop of Reserve's fallback alive.
var reserveSink byte //nolint:unused // written, never read: the loads it sums may not be dropped

// Reserve allocates every page of the file and maps all of them in, so that
// later accesses neither fault nor fail for want of space. On tmpfs (/dev/shm)
// the pages are charged now, to this process's memory limit and the mount's
// size: a mount or a limit too small for the mapping fails here, with the
// error (ENOSPC, ENOMEM) or an OOM kill at start, instead of mid-run. The
// pages keep their contents (a new file's zeros).
//
// fallocate reserves the pages; MADV_POPULATE_WRITE maps them in writable and
// reports a failure as an error where a plain touch would raise SIGBUS. On a
// kernel without it (before 5.14) each page is read once, which is safe once
// fallocate succeeded: the pages are then allocated and mapped, and a first
// write costs only a minor fault. Where neither works it returns
// ErrReserveUnsupported.
func (m *Mapping) Reserve() error {
	allocated := true
	if err := unix.Fallocate(int(m.f.Fd()), 0, 0, int64(len(m.m))); err != nil {
		if !errors.Is(err, unix.EOPNOTSUPP) {
			return &os.PathError{Op: "shm reserve", Path: m.path, Err: err}
		}
		allocated = false
	}
	err := unix.Madvise(m.m, unix.MADV_POPULATE_WRITE)
	switch {
	case err == nil:
		return nil
	case !errors.Is(err, unix.EINVAL):
		return &os.PathError{Op: "shm populate", Path: m.path, Err: err}
	case !allocated:
		return ErrReserveUnsupported
	}
	var x byte
	for i, step := 0, os.Getpagesize(); i < len(m.m); i += step {
		x ^= m.m[i]
	}
	reserveSink = x
	return nil
}

// Bytes returns the mapped memory. It is valid until Close.
func (m *Mapping) Bytes() []byte { return m.m }

// Len is the mapped length in bytes.
func (m *Mapping) Len() int { return len(m.m) }

// Path is the file's path.
func (m *Mapping) Path() string { return m.path }

// Size returns the file's current size, which differs from Len when another
// process truncated or grew it after mapping (a touch past the end of a
// truncated file raises SIGBUS; callers check this before trusting a ring).
func (m *Mapping) Size() (int64, error) {
	fi, err := m.f.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}

// Close unmaps the memory and closes the file. It does not remove the file.
func (m *Mapping) Close() error {
	if m == nil || m.m == nil {
		return nil
	}
	err := m.m.Unmap()
	m.m = nil
	return errors.Join(err, m.f.Close())
}

// Unlink removes a file by path without following a final symbolic link
// (unlink never follows one). A missing file is not an error.
func Unlink(path string) error {
	if err := unix.Unlink(path); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "shm unlink", Path: path, Err: err}
	}
	return nil
}
