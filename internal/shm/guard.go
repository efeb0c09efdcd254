package shm

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// GuardBytes is the size of each PROT_NONE guard area of GuardedAnon.
const GuardBytes = 64 << 10

// GuardedAnon maps n bytes (rounded up to whole pages) of private, zeroed,
// read-write anonymous memory between two PROT_NONE guard areas of
// GuardBytes each, so that any access just before or just past buf faults:
// in this process a SIGSEGV, in another process's process_vm_readv/writev
// an EFAULT. It is for tests that register buf with the sidecar and must
// prove that no copy leaves it. release unmaps everything (guards
// included); buf must not be used afterwards.
func GuardedAnon(n int) (buf []byte, release func() error, err error) {
	page := os.Getpagesize()
	if n <= 0 || n > 1<<36 {
		return nil, nil, fmt.Errorf("shm: guarded mapping of %d bytes", n)
	}
	size := (n + page - 1) / page * page
	mem, err := unix.Mmap(-1, 0, GuardBytes+size+GuardBytes, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil, fmt.Errorf("shm: guarded mapping: %w", err)
	}
	buf = mem[GuardBytes : GuardBytes+size : GuardBytes+size]
	if err := unix.Mprotect(buf, unix.PROT_READ|unix.PROT_WRITE); err != nil {
		unix.Munmap(mem)
		return nil, nil, fmt.Errorf("shm: guarded mapping: mprotect: %w", err)
	}
	return buf, func() error { return unix.Munmap(mem) }, nil
}
