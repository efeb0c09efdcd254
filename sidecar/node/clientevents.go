package node

import (
	"time"

	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// The client's side of the node's block descriptions and event logs
// (docs/kv-events.md, "The node tier"). Both calls wait at most
// --node.io-timeout, on the caller's goroutine.

// Describe attaches descriptions to blocks of ns the node tier holds and
// returns each one's status (nil: not attached, or no valid reply in time).
func (c *Client) Describe(ns machine.L2Namespace, entries []wire.Entry) []wire.Status {
	if len(entries) == 0 || len(entries) > wire.MaxItems || !c.take() {
		return nil
	}
	defer c.give()
	cc := c.cur.Load()
	if cc == nil || !cc.use() {
		return nil
	}
	defer cc.users.Done()
	deadline := time.Now().Add(c.cfg.IOTimeout)
	if !cc.register(ns, deadline) {
		return nil
	}
	b, err := cc.call(wire.TypeDescribe, wire.Describe{FP: ns.FP, Entries: entries}.Append, nil, deadline)
	if err != nil {
		return nil
	}
	rep, err := wire.DecodeItemsReply(b)
	if err != nil || rep.Status != wire.OK || len(rep.Items) != len(entries) {
		return nil
	}
	st := make([]wire.Status, len(rep.Items))
	for i, it := range rep.Items {
		st[i] = it.Status
	}
	return st
}

// NodeEvents is one read of a namespace's event log.
type NodeEvents struct {
	// Epoch is the node process's the cursors belong to: a cursor of
	// another epoch is void (read from 0).
	Epoch uint64
	// Gone: the entries start at the log's beginning, and what the reader
	// learned before of this namespace is void.
	Gone    bool
	Next    uint64
	Entries []wire.Entry
}

// ReadEvents reads ns's event log in the node tier from cursor, at most
// maxN entries. False: not attached, not in time, or a reply that fails
// its checks (a node that answers outside the namespace's digest width,
// with more entries than asked, or with an empty description).
func (c *Client) ReadEvents(ns machine.L2Namespace, cursor uint64, maxN int) (NodeEvents, bool) {
	if maxN < 1 || maxN > wire.MaxEvents || !c.take() {
		return NodeEvents{}, false
	}
	defer c.give()
	cc := c.cur.Load()
	if cc == nil || !cc.use() {
		return NodeEvents{}, false
	}
	defer cc.users.Done()
	deadline := time.Now().Add(c.cfg.IOTimeout)
	if !cc.register(ns, deadline) {
		return NodeEvents{}, false
	}
	b, err := cc.call(wire.TypeEvents, wire.Events{FP: ns.FP, Cursor: cursor, Max: uint32(maxN)}.Append, nil, deadline)
	if err != nil {
		return NodeEvents{}, false
	}
	rep, err := wire.DecodeEventsReply(b)
	if err != nil || (rep.Status != wire.OK && rep.Status != wire.Gone) || len(rep.Entries) > maxN {
		return NodeEvents{}, false
	}
	if !entriesFit(ns, rep.Entries) {
		c.log.Warn().Msg("node tier: an event entry outside its namespace's digest width, or without tokens; the read is dropped")
		return NodeEvents{}, false
	}
	return NodeEvents{Epoch: cc.epoch, Gone: rep.Status == wire.Gone, Next: rep.Next, Entries: rep.Entries}, true
}

// entriesFit checks a node's entries against the namespace the request
// named: digests and parents within its width, a description's tokens.
func entriesFit(ns machine.L2Namespace, es []wire.Entry) bool {
	if ns.Width < 1 || ns.Width > wire.DigestSize {
		return false
	}
	for i := range es {
		e := &es[i]
		if !zero(e.Digest[ns.Width:]) || !zero(e.Parent[ns.Width:]) || (e.Op == wire.OpStored && len(e.Tokens) == 0) {
			return false
		}
	}
	return true
}
