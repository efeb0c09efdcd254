//go:build !linux

package cuda

import "errors"

// MemlockLimit is unknown off Linux.
func MemlockLimit() (soft, hard uint64, err error) {
	return 0, 0, errors.New("cuda: RLIMIT_MEMLOCK unknown on this platform")
}
