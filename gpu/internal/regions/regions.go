// Package regions holds what the copy backends (gpu/host, gpu/cuda) keep
// alike: their registered regions by handle and the opening of Submit.
package regions

import (
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/ringside-kv/ringside/gpu"
)

// Table is a backend's registered regions by handle, and whether Close has
// run, under one read-write lock. Submit holds the read lock while it
// queues an op, so Close (which takes the write lock) cannot stop the queue
// underneath it.
type Table[R any] struct {
	mu      sync.RWMutex
	regions map[gpu.Handle]R
	next    gpu.Handle
	closed  bool
}

// New returns an empty, open table.
func New[R any]() Table[R] {
	return Table[R]{regions: make(map[gpu.Handle]R)}
}

// Add registers reg under a handle not in use (never 0), or fails with
// os.ErrClosed once the table is closed.
func (t *Table[R]) Add(reg R) (gpu.Handle, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, fmt.Errorf("gpu: register: %w", os.ErrClosed)
	}
	for {
		t.next++
		if _, used := t.regions[t.next]; t.next != 0 && !used {
			break
		}
	}
	t.regions[t.next] = reg
	return t.next, nil
}

// Remove takes h out of the table and returns its region.
func (t *Table[R]) Remove(h gpu.Handle) (R, error) {
	t.mu.Lock()
	reg, ok := t.regions[h]
	delete(t.regions, h)
	t.mu.Unlock()
	if !ok {
		return reg, fmt.Errorf("%w: handle %d", gpu.ErrUnknownRegion, h)
	}
	return reg, nil
}

// IsClosed reports whether close has run.
func (t *Table[R]) IsClosed() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.closed
}

// Close marks the table closed and reports whether it was open.
func (t *Table[R]) Close() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	was := !t.closed
	t.closed = true
	return was
}

// Submit is the part of Submit both backends share: it checks op's
// direction and callback, finds op's region under the read lock and calls
// queue with it and the submission time while still holding the lock. Every
// error, queue's included, is returned as a *gpu.CopyError naming op's
// direction and region.
func (t *Table[R]) Submit(op gpu.Op, done func(gpu.Result), queue func(reg R, submitted time.Time) error) error {
	if op.Dir != gpu.PoolToEngine && op.Dir != gpu.EngineToPool {
		return opError(op, fmt.Errorf("%w: direction %d", gpu.ErrInvalidOp, uint8(op.Dir)))
	}
	if done == nil {
		return opError(op, fmt.Errorf("%w: nil done callback", gpu.ErrInvalidOp))
	}
	now := time.Now()
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return opError(op, os.ErrClosed)
	}
	reg, ok := t.regions[op.Region]
	if !ok {
		return opError(op, gpu.ErrUnknownRegion)
	}
	if err := queue(reg, now); err != nil {
		return opError(op, err)
	}
	return nil
}

// opError returns err as a *gpu.CopyError of op: a *gpu.CopyError (from
// PlanRanges, with the index of the failing page) gets op's direction and
// region, anything else is wrapped with Index -1.
func opError(op gpu.Op, err error) error {
	if ce, ok := err.(*gpu.CopyError); ok {
		ce.Dir, ce.Region = op.Dir, op.Region
		return ce
	}
	return &gpu.CopyError{Dir: op.Dir, Region: op.Region, Index: -1, Err: err}
}
