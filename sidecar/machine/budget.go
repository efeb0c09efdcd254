package machine

import (
	"errors"
	"fmt"
)

// ErrBudget reports a Done that returns more than was admitted.
var ErrBudget = errors.New("machine: budget accounting error")

// OwnerID names who a Budget charges: the sidecar charges engine instances.
type OwnerID uint64

// DefaultBudgetBytes is the default per-owner admission budget.
const DefaultBudgetBytes = 64 << 20

// Budget is the per-owner admission budget for bytes being loaded from the
// pool. A query that does not fit waits (the caller keeps it in state
// Loading and retries Admit after a Done). A single query larger than the
// whole budget is admitted when the owner has nothing else loading; other
// queries then wait until it is Done. Without that rule such a query would
// wait forever. Fairness between waiting queries is the caller's concern.
// Not safe for concurrent use.
type Budget struct {
	limit    int64
	inflight map[OwnerID]int64
}

// NewBudget returns a Budget of limit bytes per owner (<= 0: default).
func NewBudget(limit int64) *Budget {
	if limit <= 0 {
		limit = DefaultBudgetBytes
	}
	return &Budget{limit: limit, inflight: make(map[OwnerID]int64)}
}

// Limit returns the per-owner limit.
func (b *Budget) Limit() int64 { return b.limit }

// Admit reserves n bytes for owner and reports whether they fit.
func (b *Budget) Admit(owner OwnerID, n int64) bool {
	if n < 0 {
		return false
	}
	cur := b.inflight[owner]
	if cur > 0 && cur+n > b.limit {
		return false
	}
	if n > 0 {
		b.inflight[owner] = cur + n
	}
	return true
}

// Done returns n admitted bytes of owner. Returning more than is in flight
// is an accounting error and changes nothing.
func (b *Budget) Done(owner OwnerID, n int64) error {
	cur := b.inflight[owner]
	if n < 0 || n > cur {
		return fmt.Errorf("%w: owner %d returns %d bytes, %d in flight", ErrBudget, owner, n, cur)
	}
	if cur == n {
		delete(b.inflight, owner)
	} else {
		b.inflight[owner] = cur - n
	}
	return nil
}

// InFlight returns the bytes owner has admitted and not yet returned.
func (b *Budget) InFlight(owner OwnerID) int64 { return b.inflight[owner] }

// Forget drops owner's accounting (the session died).
func (b *Budget) Forget(owner OwnerID) { delete(b.inflight, owner) }
