package machine

import (
	"errors"
	"fmt"

	"github.com/ringside-kv/ringside/internal/invariants"
	"github.com/ringside-kv/ringside/schema"
)

// check panics with every broken invariant in invariants builds; it
// compiles to nothing otherwise. A full check is O(state), so on a large
// state it runs on every n-th call only, n growing with the state's size
// (an amortised cost of a few dozen steps a call): small states, as in
// unit tests, are checked after every call.
func (m *Machine) check() {
	if !invariants.Enabled {
		return
	}
	m.calls++
	size := m.slots + len(m.queries) + len(m.copies) + len(m.sessions)
	for _, in := range m.instances {
		size += len(in.batches)
	}
	if every := size / 32; every > 1 && m.calls%uint64(every) != 0 {
		return
	}
	if err := m.CheckInvariants(); err != nil {
		panic(fmt.Sprintf("machine: invariants broken: %v", err))
	}
}

// CheckInvariants verifies the Machine's accounting against its records
// and the cache's own invariants. It is O(state) and meant for tests and
// invariants builds.
func (m *Machine) CheckInvariants() error {
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < 20 {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	if err := m.cache.CheckInvariants(); err != nil {
		errs = append(errs, err)
	}
	// Recompute every holder's usage from the records.
	sess := map[*session]*usage{}
	uid := map[uint32]*usage{}
	var total usage
	at := func(s *session, u uint32, c usage) {
		total.add(c)
		if uid[u] == nil {
			uid[u] = &usage{}
		}
		uid[u].add(c)
		if s != nil && !s.gone {
			if sess[s] == nil {
				sess[s] = &usage{}
			}
			sess[s].add(c)
		}
	}
	for id, s := range m.sessions {
		if s.id != id || s.gone {
			bad("session %d: record says id %d gone %v", id, s.id, s.gone)
		}
		if m.instances[s.inst.name] != s.inst {
			bad("session %d: instance %q not registered", id, s.inst.name)
		}
		at(s, s.uid, usage{meta: sessionMeta, sessions: 1, rings: s.use.rings})
		for _, r := range s.regions {
			at(s, s.uid, usage{meta: r.meta})
		}
		leases := 0
		for _, q := range m.queries {
			if q.owner == s {
				leases++
			}
		}
		if leases != s.leases {
			bad("session %d: %d leases counted, %d queries", id, s.leases, leases)
		}
	}
	for _, q := range m.queries {
		if q.owner.gone {
			bad("lease %d: owned by a session that ended", q.lease)
		}
		at(q.owner, q.owner.uid, usage{meta: q.meta})
		if _, live := m.cache.LeaseBlocks(q.lease); live != (q.state != schema.StateMiss) {
			bad("lease %d: state %v but cache lease live %v", q.lease, q.state, live)
		}
	}
	budgeted := map[OwnerID]int64{}
	sessionsOf := map[*instance]int{}
	for _, s := range m.sessions {
		sessionsOf[s.inst]++
	}
	for name, in := range m.instances {
		if in.name != name {
			bad("instance %q: record says %q", name, in.name)
		}
		if sessionsOf[in] != in.sessions || in.sessions == 0 {
			bad("instance %q: %d sessions counted, %d live", name, in.sessions, sessionsOf[in])
		}
		if m.namespaces[in.ns.id] != in.ns {
			bad("instance %q: namespace %d not registered", name, in.ns.id)
		}
		at(nil, in.uid, usage{meta: instanceMeta})
		hb := 0
		for id, b := range in.batches {
			hb += len(b.d)
			if b.charge != int64(batchMeta+cap(b.d)) {
				bad("batch %d: charged %d, holds %d", id, b.charge, batchMeta+cap(b.d))
			}
			at(b.owner, b.uid, usage{meta: b.charge})
		}
		if hb != in.hashBytes {
			bad("instance %q: %d hash bytes counted, batches hold %d", name, in.hashBytes, hb)
		}
		for _, w := range in.waiting {
			if w.state != schema.StateWaiting || w.budgeted || w.inst != in {
				bad("instance %q: waiting query %d in state %v budgeted %v", name, w.lease, w.state, w.budgeted)
			}
		}
	}
	for _, q := range m.queries {
		if q.budgeted {
			budgeted[q.inst.id] += q.bytes
		}
	}
	for _, in := range m.instances {
		if got := m.budget.InFlight(in.id); got != budgeted[in.id] {
			bad("instance %q: budget holds %d, budgeted queries %d", in.name, got, budgeted[in.id])
		}
	}
	for _, op := range m.copies {
		at(op.req.sess, op.req.uid, usage{meta: op.meta})
	}
	m.l2Charges(at)
	m.l2Invariants(bad)
	nsSessions := map[*nsRec]int{}
	for _, in := range m.instances {
		nsSessions[in.ns] += in.sessions
	}
	for id, n := range m.namespaces {
		if n.id != id {
			bad("namespace %d: record says %d", id, n.id)
		}
		if nsSessions[n] != n.sessions {
			bad("namespace %d: %d sessions counted, %d live", id, n.sessions, nsSessions[n])
		}
		total.meta += namespaceMeta
	}
	if len(m.namespaces) != m.cache.Namespaces()-m.foreignNamespaces() {
		bad("%d namespaces recorded, the cache holds %d (%d not the machine's)", len(m.namespaces), m.cache.Namespaces(), m.foreignNamespaces())
	}
	if total != m.total {
		bad("total usage %+v, records add up to %+v", m.total, total)
	}
	for u, got := range m.uids {
		want := uid[u]
		if want == nil || *want != *got {
			bad("uid %d: usage %+v, records add up to %+v", u, *got, want)
		}
		if got.zero() {
			bad("uid %d: idle but kept", u)
		}
	}
	for u, want := range uid {
		if !want.zero() && m.uids[u] == nil {
			bad("uid %d: records hold %+v, no usage kept", u, *want)
		}
	}
	for s, want := range sess {
		got := s.use
		if got != *want {
			bad("session %d: usage %+v, records add up to %+v", s.id, got, *want)
		}
	}
	var cm int64
	for _, op := range m.copies {
		if op.req.sess.gone {
			continue
		}
		if m.sessions[op.req.sess.id] != op.req.sess {
			bad("copy %d: session %d not live yet not gone", op.id, op.req.sess.id)
		}
	}
	for _, s := range m.sessions {
		cm = 0
		for _, op := range m.copies {
			if op.req.sess == s {
				cm += op.meta
			}
		}
		cm += m.l2Meta(s)
		if cm != s.copyMeta {
			bad("session %d: copy meta %d, copies hold %d", s.id, s.copyMeta, cm)
		}
		// What a uid's leases pin stays within its pin share, and what it
		// retains within its retain share, each counted on its own.
		if got := m.cache.PinnedCharged(s.uid + 1); got > m.pinLimit() {
			bad("uid %d: %d slots pinned, its share is %d", s.uid, got, m.pinLimit())
		}
		if got := m.cache.RetainedCharged(s.uid + 1); got > m.retainLimit() {
			bad("uid %d: %d slots retained, its retain share is %d", s.uid, got, m.retainLimit())
		}
	}
	return errors.Join(errs...)
}

// foreignNamespaces counts namespaces in the cache the Machine did not
// create (e.g. the sidecar's prefill namespace).
func (m *Machine) foreignNamespaces() int { return m.foreign }
