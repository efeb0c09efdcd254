//go:build linux

package cuda

import "golang.org/x/sys/unix"

// MemlockLimit returns RLIMIT_MEMLOCK (soft, hard); Unlimited means none.
// Whether cuMemHostRegister is charged against it depends on the driver
// (unverified); the gpu package reports it next to the pool size.
func MemlockLimit() (soft, hard uint64, err error) {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &r); err != nil {
		return 0, 0, err
	}
	return r.Cur, r.Max, nil
}
