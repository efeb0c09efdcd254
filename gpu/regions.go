package gpu

import (
	"fmt"
	"os"
	"sync"
	"time"
)

// regionTable is what Host and CUDA keep alike: the registered regions by
// handle, and whether Close has run, under one read-write lock. Submit
// holds the read lock while it queues an op, so Close (which takes the
// write lock) cannot stop the queue underneath it.
type regionTable[R any] struct {
	mu      sync.RWMutex
	regions map[Handle]R
	next    Handle
	closed  bool
}

func newRegionTable[R any]() regionTable[R] {
	return regionTable[R]{regions: make(map[Handle]R)}
}

// add registers reg under a handle not in use (never 0), or fails with
// os.ErrClosed once the table is closed.
func (t *regionTable[R]) add(reg R) (Handle, error) {
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

// remove takes h out of the table and returns its region.
func (t *regionTable[R]) remove(h Handle) (R, error) {
	t.mu.Lock()
	reg, ok := t.regions[h]
	delete(t.regions, h)
	t.mu.Unlock()
	if !ok {
		return reg, fmt.Errorf("%w: handle %d", ErrUnknownRegion, h)
	}
	return reg, nil
}

// isClosed reports whether close has run.
func (t *regionTable[R]) isClosed() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.closed
}

// close marks the table closed and reports whether it was open.
func (t *regionTable[R]) close() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	was := !t.closed
	t.closed = true
	return was
}

// submit is the part of Submit both backends share: it checks op's
// direction and callback, finds op's region under the read lock and calls
// queue with it and the submission time while still holding the lock. Every
// error, queue's included, is returned as a *CopyError naming op's
// direction and region.
func (t *regionTable[R]) submit(op Op, done func(Result), queue func(reg R, submitted time.Time) error) error {
	if op.Dir != PoolToEngine && op.Dir != EngineToPool {
		return opError(op, fmt.Errorf("%w: direction %d", ErrInvalidOp, uint8(op.Dir)))
	}
	if done == nil {
		return opError(op, fmt.Errorf("%w: nil done callback", ErrInvalidOp))
	}
	now := time.Now()
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return opError(op, os.ErrClosed)
	}
	reg, ok := t.regions[op.Region]
	if !ok {
		return opError(op, ErrUnknownRegion)
	}
	if err := queue(reg, now); err != nil {
		return opError(op, err)
	}
	return nil
}

// opError returns err as a *CopyError of op: a *CopyError (from
// PlanRanges, with the index of the failing page) gets op's direction and
// region, anything else is wrapped with Index -1.
func opError(op Op, err error) error {
	if ce, ok := err.(*CopyError); ok {
		ce.Dir, ce.Region = op.Dir, op.Region
		return ce
	}
	return &CopyError{Dir: op.Dir, Region: op.Region, Index: -1, Err: err}
}
