//go:build !linux

package procmem

// Read is unsupported off Linux.
func Read(pid int, local []byte, rs []Range) (Stats, error) {
	if err := checkLocal(local, rs); err != nil {
		return Stats{}, err
	}
	return Stats{}, ErrUnsupported
}

// Write is unsupported off Linux.
func Write(pid int, local []byte, rs []Range) (Stats, error) {
	if err := checkLocal(local, rs); err != nil {
		return Stats{}, err
	}
	return Stats{}, ErrUnsupported
}
