package ring

import (
	"fmt"

	"github.com/ringside-kv/ringside/internal/shm"
)

// FD is the ring file's descriptor (valid until Close): the sidecar passes
// it to the session's client with the attach reply.
func (f *File) FD() int { return f.m.FD() }

// OpenFD maps a ring from a descriptor (taking it over) and validates its
// header like Open; name is for errors. A non-zero epoch must match.
func OpenFD(fd int, name string, epoch uint64) (*File, error) {
	m, err := shm.OpenFD(fd, name, HeaderSize+MinCapacity)
	if err != nil {
		return nil, err
	}
	r, err := Attach(m.Bytes())
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if epoch != 0 && r.Epoch() != epoch {
		m.Close()
		return nil, fmt.Errorf("%w: %s has epoch %#x, expected %#x (stale ring)", ErrBadHeader, name, r.Epoch(), epoch)
	}
	f := &File{Ring: r, m: m}
	r.check = f.checkSize
	return f, nil
}
