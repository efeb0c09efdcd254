package ring

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/ringside-kv/ringside/internal/shm"
)

// DefaultDir is where rings live unless configured otherwise.
const DefaultDir = "/dev/shm/ringside"

// Options configure a new ring file.
type Options struct {
	// Capacity of the data area in bytes: a power of two. Default 256 KiB.
	Capacity uint64
	// MaxRecord is the largest record, header included. Default capacity/4.
	MaxRecord uint32
	// Mode is the file mode. Default 0600; 0660 grants a shared group.
	Mode os.FileMode
	// Epoch is the boot token; zero picks a random one.
	Epoch uint64
	// Role is the side the creator takes, recorded in the header flags.
	CreatorProducer bool
}

// File is a ring in a shared-memory file.
type File struct {
	*Ring
	m *shm.Mapping
}

// ErrInUse reports that a ring file exists and a process that uses it is
// still alive.
var ErrInUse = errors.New("ring: file in use by a live process")

// Create makes a new ring file at path, allocated in full: a mount without
// room for it gives an error wrapping ENOSPC (errors.Is(err,
// syscall.ENOSPC)) and no file. If a file is already there it is
// replaced only when it is not a valid ring, or when every process recorded
// in it is dead (a ring left behind by a crash is never reused: its contents
// are not trusted); otherwise Create fails with ErrInUse. Symbolic links at
// path are never followed.
func Create(path string, o Options) (*File, error) {
	if o.Capacity == 0 {
		o.Capacity = 256 << 10
	}
	if o.Mode == 0 {
		o.Mode = 0o600
	}
	if o.Epoch == 0 {
		o.Epoch = RandomEpoch()
	}
	if o.Capacity > MaxCapacity || o.Capacity < MinCapacity {
		return nil, fmt.Errorf("ring: capacity %d outside [%d, %d]", o.Capacity, MinCapacity, MaxCapacity)
	}
	// Allocated before it is mapped: on a full mount Create fails with
	// ENOSPC instead of Format (or a later record) faulting with SIGBUS.
	size := HeaderSize + int(o.Capacity)
	m, err := shm.CreateAllocated(path, size, o.Mode)
	if errors.Is(err, shm.ErrExists) {
		if err := replaceStale(path); err != nil {
			return nil, err
		}
		m, err = shm.CreateAllocated(path, size, o.Mode)
	}
	if err != nil {
		return nil, err
	}
	var flags uint32
	if o.CreatorProducer {
		flags |= FlagCreatorProducer
	}
	r, err := Format(m.Bytes(), o.Capacity, o.MaxRecord, o.Epoch, flags)
	if err != nil {
		m.Close()
		shm.Unlink(path)
		return nil, err
	}
	// The creator claims its role at once, so that a concurrent Create never
	// takes a fresh ring for one left behind by a dead process.
	pid, start := shm.Self()
	if o.CreatorProducer {
		r.prodStart.Store(start)
		r.prodPID.Store(uint32(pid))
	} else {
		r.consStart.Store(start)
		r.consPID.Store(uint32(pid))
	}
	f := &File{Ring: r, m: m}
	r.check = f.checkSize
	return f, nil
}

// RemoveStale removes the ring file at path unless the process that
// created it (the sidecar, recorded on the side the header's creator flag
// names) is still alive, and reports whether it did. A file that is not a
// valid ring is removed. A ring whose creator died is removed even while
// its other side still maps it: that peer only ever sees a dead creator,
// and nobody else may use the file (a new sidecar has a new epoch).
func RemoveStale(path string) (bool, error) {
	if old, err := Open(path, 0); err == nil {
		live := old.ConsumerAlive()
		pid := old.Header().ConsumerPID
		if old.Header().Flags&FlagCreatorProducer != 0 {
			live, pid = old.ProducerAlive(), old.Header().ProducerPID
		}
		old.Close()
		if pid != 0 && live {
			return false, nil
		}
	}
	if err := shm.Unlink(path); err != nil {
		return false, err
	}
	return true, nil
}

// replaceStale removes the file at path if no live process uses it.
func replaceStale(path string) error {
	old, err := Open(path, 0)
	if err == nil {
		h := old.Header()
		live := (h.ProducerPID != 0 && old.ProducerAlive()) || (h.ConsumerPID != 0 && old.ConsumerAlive())
		old.Close()
		if live {
			return fmt.Errorf("%w: %s", ErrInUse, path)
		}
	}
	// Not a ring at all, or a ring whose processes are gone: replace it.
	return shm.Unlink(path)
}

// Open maps an existing ring file and validates its header. A non-zero epoch
// must match the header's (the sidecar tells clients the epoch of the rings
// it made, so a stale ring at the same path is refused).
func Open(path string, epoch uint64) (*File, error) {
	m, err := shm.Open(path, HeaderSize+MinCapacity)
	if err != nil {
		return nil, err
	}
	r, err := Attach(m.Bytes())
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if epoch != 0 && r.Epoch() != epoch {
		m.Close()
		return nil, fmt.Errorf("%w: %s has epoch %#x, expected %#x (stale ring)", ErrBadHeader, path, r.Epoch(), epoch)
	}
	f := &File{Ring: r, m: m}
	r.check = f.checkSize
	return f, nil
}

// checkSize detects a file that another process truncated or grew after it
// was mapped; touching a truncated mapping would raise SIGBUS.
func (f *File) checkSize() error {
	n, err := f.m.Size()
	if err != nil {
		return fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	if n != int64(f.m.Len()) {
		return fmt.Errorf("%w: %s changed size from %d to %d bytes", ErrCorrupt, f.m.Path(), f.m.Len(), n)
	}
	return nil
}

// Check verifies that the file still has the size it was mapped with.
func (f *File) Check() error { return f.checkSize() }

// Path is the ring file's path.
func (f *File) Path() string { return f.m.Path() }

// Close unmaps the ring. It does not remove the file; see Remove.
func (f *File) Close() error { return f.m.Close() }

// Remove unlinks the ring file; the mapping stays valid until Close.
func (f *File) Remove() error { return shm.Unlink(f.m.Path()) }

// RandomEpoch returns a random non-zero boot token.
func RandomEpoch() uint64 {
	var b [8]byte
	for {
		rand.Read(b[:])
		if e := binary.LittleEndian.Uint64(b[:]); e != 0 {
			return e
		}
	}
}

// EnsureDir creates dir (and parents) with the given mode if it does not
// exist, and refuses a dir that is a symbolic link or not a directory.
func EnsureDir(dir string, mode os.FileMode) error {
	if mode == 0 {
		mode = 0o700
	}
	if err := os.MkdirAll(dir, mode); err != nil {
		return err
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSymlink != 0 || !fi.IsDir() {
		return fmt.Errorf("ring: %s is not a directory (or is a symbolic link)", dir)
	}
	return nil
}
