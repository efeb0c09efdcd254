// Package procmem is the only place in ringside's gpu tree that issues
// process_vm_readv/process_vm_writev or uses package unsafe. It copies byte
// ranges between a local buffer and another process's address space, batching
// every range of one request into as few system calls as the kernel allows.
//
// Nothing here knows about regions, pages or the pool: callers pass a local
// []byte and a list of (local offset, remote address, length) triples.
package procmem

import (
	"errors"
	"fmt"
	"unsafe"
)

// IOVMax is the kernel's per-call limit on iovecs on each side (UIO_MAXIOV).
const IOVMax = 1024

// Range is one transfer: Len bytes at local[Local:] <-> remote address Remote.
type Range struct {
	Local  uint64
	Remote uint64
	Len    uint64
}

// ErrNoProgress is returned when a call transferred zero bytes without an
// error: retrying would loop forever.
var ErrNoProgress = errors.New("procmem: transfer made no progress")

// ErrUnsupported is returned on platforms without process_vm_readv.
var ErrUnsupported = errors.New("procmem: process_vm_readv/writev unsupported on this platform")

// Error describes a failed transfer: which call, which process, and the
// remote address at which it stopped.
type Error struct {
	Op   string // "process_vm_readv" or "process_vm_writev"
	PID  int
	Addr uint64 // remote address of the first byte not transferred
	Done int64  // bytes transferred before the failure
	Err  error
}

func (e *Error) Error() string {
	return fmt.Sprintf("procmem: %s pid %d addr %#x (after %d bytes): %v", e.Op, e.PID, e.Addr, e.Done, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Stats reports what a transfer cost.
type Stats struct {
	Bytes int64 // bytes transferred
	Calls int   // system calls issued (including failed ones)
}

// Addr returns the virtual address of b[0] in this process (0 for an empty
// slice). Only meaningful while b stays alive; intended for memory that does
// not move (mmapped, or a heap slice kept reachable).
func Addr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

// checkLocal verifies every range lies inside local and that remote
// addresses do not wrap.
func checkLocal(local []byte, rs []Range) error {
	n := uint64(len(local))
	for i, r := range rs {
		if r.Local > n || r.Len > n-r.Local {
			return fmt.Errorf("procmem: range %d local [%d,+%d) outside buffer of %d bytes", i, r.Local, r.Len, n)
		}
		if r.Remote+r.Len < r.Remote {
			return fmt.Errorf("procmem: range %d remote %#x+%d wraps the address space", i, r.Remote, r.Len)
		}
	}
	return nil
}
