package cache

import (
	"encoding/binary"
	"fmt"
	"sort"
)

// The node tier's blocks in a namespace's event log (docs/kv-events.md,
// "The node tier"). The sidecar follows the node process's event log of
// each namespace and mirrors it here, as a node set per namespace: each
// block the node tier holds described, with its description. A pod's
// announced set is the union of its pool's present, described blocks and
// its node set: the namespace's event log records EventStored when a block
// enters either and EventRemoved only when it has left both, so a reader
// of the log (the connector) sees one set. A block in both is read with
// the pool's description.
//
// A node set's entries keep the order they came in (with holes where
// entries went, compacted when the holes outnumber them), so that
// EventSnapshotPage can page through them after the pool's slots, at
// positions capacity + the entry's id, and miss none that stays.

// nodeSet is one namespace's mirror of the node tier's described blocks.
type nodeSet struct {
	ents []nodeEnt                  // by id, ascending; dead ones are holes
	idx  map[[MaxDigestLen]byte]int // digest -> position in ents
	next uint64                     // the next entry's id
	gen  uint64                     // the current rebuild's generation
	live int
}

type nodeEnt struct {
	id   uint64
	gen  uint64
	d    [MaxDigestLen]byte
	rec  descRec
	live bool
}

// nodeHas reports whether n's node set holds d.
func (n *namespace) nodeHas(d []byte) bool {
	if n.node == nil || n.node.live == 0 {
		return false
	}
	var k [MaxDigestLen]byte
	copy(k[:], d)
	_, ok := n.node.idx[k]
	return ok
}

// poolAnnounced reports whether d is a present, described block of n in
// the pool.
func (c *Cache) poolAnnounced(ns uint16, d []byte) bool {
	if len(c.ev.descs) == 0 {
		return false
	}
	h := c.find(ns, d)
	if h == NoSlot || !c.present(h) {
		return false
	}
	_, ok := c.ev.descs[h]
	return ok
}

// NodeStored adds block d of ns, which the node tier holds, with its
// description (parent nil: none; token ids; extra bytes) to ns's node set,
// and logs EventStored if the pool does not announce it already; added
// reports whether it is new. A block in the node set already is kept as it
// is (and counts as seen by the current rebuild). full: the node sets'
// descriptions would pass maxBytes (DescCost each), and nothing was added.
func (c *Cache) NodeStored(ns NamespaceID, d, parent []byte, tokens []uint32, extra []byte, maxBytes int64) (added, full bool, err error) {
	n, err := c.ns(ns)
	if err != nil {
		return false, false, err
	}
	switch {
	case len(d) != n.width || parent != nil && len(parent) != n.width:
		return false, false, fmt.Errorf("%w: a node-tier block of %d bytes (parent %d), want %d", ErrBadDigest, len(d), len(parent), n.width)
	case len(tokens) < 1 || len(tokens) > MaxDescTokens || len(extra) > MaxDescExtra:
		return false, false, fmt.Errorf("%w: %d tokens, %d extra bytes", ErrBadDesc, len(tokens), len(extra))
	}
	if n.node == nil {
		n.node = &nodeSet{idx: map[[MaxDigestLen]byte]int{}}
	}
	s := n.node
	var k [MaxDigestLen]byte
	copy(k[:], d)
	if i, ok := s.idx[k]; ok {
		s.ents[i].gen = s.gen
		return false, false, nil
	}
	cost := DescCost(n.width, len(tokens), len(extra), parent != nil)
	if c.nodeBytes+cost > maxBytes {
		return false, true, nil
	}
	b := make([]byte, 0, len(parent)+4*len(tokens)+len(extra))
	b = append(b, parent...)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	b = append(b, extra...)
	s.idx[k] = len(s.ents)
	s.ents = append(s.ents, nodeEnt{id: s.next, gen: s.gen, d: k, live: true,
		rec: descRec{b: b, tokens: uint16(len(tokens)), extra: uint16(len(extra)), parent: parent != nil}})
	s.next++
	s.live++
	c.nodeBytes += cost
	if !c.poolAnnounced(uint16(ns), d) {
		c.logGrowAppend(c.eventLog(n), OpStored, NoSlot, d)
	}
	return true, false, nil
}

// NodeRemoved drops block d of ns from ns's node set (the node tier no
// longer holds it described) and logs EventRemoved if the pool does not
// announce it. It reports whether the set held it.
func (c *Cache) NodeRemoved(ns NamespaceID, d []byte) (bool, error) {
	n, err := c.ns(ns)
	if err != nil {
		return false, err
	}
	if len(d) != n.width {
		return false, fmt.Errorf("%w: a node-tier block of %d bytes, want %d", ErrBadDigest, len(d), n.width)
	}
	if n.node == nil {
		return false, nil
	}
	var k [MaxDigestLen]byte
	copy(k[:], d)
	i, ok := n.node.idx[k]
	if !ok {
		return false, nil
	}
	c.nodeDrop(n, uint16(ns), i)
	return true, nil
}

// nodeDrop removes the entry at position i of n's node set.
func (c *Cache) nodeDrop(n *namespace, ns uint16, i int) {
	s := n.node
	e := &s.ents[i]
	d := e.d[:n.width]
	if !c.poolAnnounced(ns, d) {
		c.logGrowAppend(c.eventLog(n), OpEvicted, NoSlot, d)
	}
	c.nodeBytes -= e.rec.cost()
	delete(s.idx, e.d)
	e.live, e.rec = false, descRec{}
	s.live--
	c.nodeCompact(s)
}

// nodeCompact drops the holes of s once they outnumber its entries.
func (c *Cache) nodeCompact(s *nodeSet) {
	dead := len(s.ents) - s.live
	if dead <= 1024 || dead <= s.live {
		if s.live == 0 {
			s.ents = s.ents[:0]
		}
		return
	}
	out := s.ents[:0]
	for _, e := range s.ents {
		if e.live {
			s.idx[e.d] = len(out)
			out = append(out, e)
		}
	}
	clear(s.ents[len(out):])
	s.ents = out
}

// NodeRebuild starts a rebuild of ns's node set (the node's log was read
// again from its beginning): NodeSweep then drops every block NodeStored
// was not given since.
func (c *Cache) NodeRebuild(ns NamespaceID) error {
	n, err := c.ns(ns)
	if err != nil {
		return err
	}
	if n.node != nil {
		n.node.gen++
	}
	return nil
}

// NodeSweep ends a rebuild of ns's node set, dropping (and logging the
// removal of) the blocks the rebuild did not see; it returns how many.
func (c *Cache) NodeSweep(ns NamespaceID) (int, error) {
	n, err := c.ns(ns)
	if err != nil {
		return 0, err
	}
	if n.node == nil {
		return 0, nil
	}
	s := n.node
	var stale [][MaxDigestLen]byte
	for _, e := range s.ents {
		if e.live && e.gen != s.gen {
			stale = append(stale, e.d)
		}
	}
	for _, k := range stale {
		if i, ok := s.idx[k]; ok {
			c.nodeDrop(n, uint16(ns), i)
		}
	}
	return len(stale), nil
}

// NodeBlocks returns the blocks in every namespace's node set and the
// bytes their descriptions take (DescCost each).
func (c *Cache) NodeBlocks() (blocks int, bytes int64) {
	for _, n := range c.nsList {
		if n != nil && n.node != nil {
			blocks += n.node.live
		}
	}
	return blocks, c.nodeBytes
}

// dropNodeSet forgets n's node set (RemoveNamespace).
func (c *Cache) dropNodeSet(n *namespace) {
	if n.node == nil {
		return
	}
	for _, e := range n.node.ents {
		if e.live {
			c.nodeBytes -= e.rec.cost()
		}
	}
	n.node = nil
}

// nodeEvent fills e with d's node-set description, if n's node set has d.
func (n *namespace) nodeEvent(d []byte, e *DescEvent) bool {
	if n.node == nil || n.node.live == 0 {
		return false
	}
	var k [MaxDigestLen]byte
	copy(k[:], d)
	i, ok := n.node.idx[k]
	if !ok {
		return false
	}
	ent := &n.node.ents[i]
	*e = DescEvent{Op: EventStored, Digest: ent.d[:n.width], Node: true}
	ent.rec.view(n.width, e)
	return true
}

// nodeSnapshotPage is EventSnapshotPage's part past the pool's slots: the
// entries of n's node set from id from on, at most maxScan, that the pool
// does not announce.
func (c *Cache) nodeSnapshotPage(ns uint16, n *namespace, from uint64, maxScan int, fn func(e *DescEvent) bool) (next uint64, done bool) {
	s := n.node
	if s == nil {
		return from, true
	}
	i := sort.Search(len(s.ents), func(i int) bool { return s.ents[i].id >= from })
	var e DescEvent
	for scanned := 0; i < len(s.ents); i++ {
		if maxScan > 0 && scanned >= maxScan {
			return s.ents[i].id, false
		}
		scanned++
		ent := &s.ents[i]
		if !ent.live || c.poolAnnounced(ns, ent.d[:n.width]) {
			continue
		}
		e = DescEvent{Op: EventStored, Digest: ent.d[:n.width], Node: true}
		ent.rec.view(n.width, &e)
		if !fn(&e) {
			return ent.id, false
		}
	}
	return s.next, true
}

// checkNodeSets verifies the node sets' invariants (CheckInvariants).
func (c *Cache) checkNodeSets(bad func(format string, args ...any)) {
	var total int64
	for _, n := range c.nsList {
		if n == nil || n.node == nil {
			continue
		}
		s := n.node
		live := 0
		for i, e := range s.ents {
			if i > 0 && s.ents[i-1].id >= e.id {
				bad("node set: ids out of order at %d", i)
			}
			if !e.live {
				continue
			}
			live++
			total += e.rec.cost()
			if j, ok := s.idx[e.d]; !ok || j != i {
				bad("node set: entry %d not indexed at its position", i)
			}
		}
		if live != s.live || len(s.idx) != live {
			bad("node set: %d live entries, counted %d, indexed %d", live, s.live, len(s.idx))
		}
	}
	if total != c.nodeBytes {
		bad("node sets cost %d, counted %d", total, c.nodeBytes)
	}
}

// EventTail returns the cursor of the oldest entry of ns's event log that
// can still be read.
func (c *Cache) EventTail(ns NamespaceID) (Cursor, error) {
	n, err := c.ns(ns)
	if err != nil {
		return Cursor{}, err
	}
	if n.ev == nil {
		return Cursor{Epoch: n.log.epoch, Seq: n.log.base}, nil
	}
	return Cursor{Epoch: n.ev.log.epoch, Seq: n.ev.log.oldest()}, nil
}

// PoolDescribed calls fn with d's description if d is a present, described
// block of ns in the pool, and reports whether it is.
func (c *Cache) PoolDescribed(ns NamespaceID, d []byte, fn func(e *DescEvent)) bool {
	n, err := c.ns(ns)
	if err != nil || len(d) != n.width || len(c.ev.descs) == 0 {
		return false
	}
	h := c.find(uint16(ns), d)
	if h == NoSlot || !c.present(h) {
		return false
	}
	r, ok := c.ev.descs[h]
	if !ok {
		return false
	}
	e := DescEvent{Op: EventStored, Digest: c.digest[h][:n.width]}
	r.view(n.width, &e)
	fn(&e)
	return true
}
