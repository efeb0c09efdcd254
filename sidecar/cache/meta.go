package cache

import (
	"fmt"
	"strconv"
)

// Block descriptions and the event log: what KV events need
// (docs/architecture.md, "KV events for routers").
//
// A description is what the engine that stored a block says of it: the
// digest of its parent in the prefix chain (none for a chain's first
// block), its token ids and a few engine-defined bytes. A router needs
// them to compute its own keys for the block, and they outlive the request
// that stored it, so that an engine that starts later (or again) can
// announce the block. Describe attaches a description to a block in the
// index (incomplete or present); one for a digest not in the index yet (the
// engine describes a block before its workers' stores arrive) waits,
// pending, for the block's first BeginStore, at most WriteTimeout
// (ReapDescs drops it after that). The first description of a block wins:
// a later one of the same digest is ignored. A block's description goes
// when the block goes (freeGroup).
//
// The event log of a namespace (a delta ring like the change log, created
// at the namespace's first description) records EventStored when a block
// is both present and described (whichever came second) and EventRemoved
// when such a block leaves the pool (evicted or cleared). A block that is
// never described is never in it. Entries hold the digest alone: a reader
// gets the description as it is when it reads (EventsSince skips a stored
// entry whose block is gone by then; its removal follows).
//
// Every description is charged, in DescCost bytes, to a caller-chosen key
// (the sidecar's uid+1), to its owner (the describing session, until
// ForgetDescOwner) and to the total, so that the caller can hold them to
// its metadata bounds.

// EventOp is the kind of an event-log entry.
type EventOp uint8

const (
	// EventStored: the block is present and described.
	EventStored EventOp = 1
	// EventRemoved: a present, described block left the pool.
	EventRemoved EventOp = 2
)

func (o EventOp) String() string {
	switch o {
	case EventStored:
		return "Stored"
	case EventRemoved:
		return "Removed"
	}
	return "EventOp(" + strconv.Itoa(int(o)) + ")"
}

// DescOverhead is what one description costs besides its bytes: its map
// entry and record, 90 to 150 bytes depending on how full the map is
// (measured in meta_test.go's TestDescMemory), counted at the worst.
const DescOverhead = 160

// Bounds on one description.
const (
	MaxDescTokens = 1<<16 - 1
	MaxDescExtra  = 1<<16 - 1
)

// DescCost is the bytes one description of tokens token ids and extra
// bytes takes (with a parent digest of width bytes, or none).
func DescCost(width, tokens, extra int, parent bool) int64 {
	n := 4*tokens + extra
	if parent {
		n += width
	}
	return descCost(n)
}

// descCost is DescCost of a description of n bytes: the allocator rounds
// them up to its size class (at most 1/8 more).
func descCost(n int) int64 { return DescOverhead + int64(n+n/8) }

// descRec is one description.
type descRec struct {
	b      []byte // parent digest (width bytes, if parent), token ids (4 bytes each, little-endian), extra
	tokens uint16
	extra  uint16
	parent bool
	key    uint32
	owner  SessionID
}

func (d *descRec) cost() int64 { return descCost(len(d.b)) }

// view fills e's description fields from d (aliasing d.b).
func (d *descRec) view(width int, e *DescEvent) {
	b := d.b
	e.Parent = nil
	if d.parent {
		e.Parent, b = b[:width:width], b[width:]
	}
	t := 4 * int(d.tokens)
	e.Tokens, e.Extra = b[:t:t], b[t:]
}

type pendKey struct {
	ns uint16
	d  [MaxDigestLen]byte
}

type pendDesc struct {
	rec      descRec
	deadline int64
	gen      uint64
}

type pendRef struct {
	key      pendKey
	gen      uint64
	deadline int64
}

// eventsState is the Cache's part for KV events. Its maps exist from the
// first Describe on.
type eventsState struct {
	descs   map[uint32]descRec // head slot -> description
	pend    map[pendKey]pendDesc
	pendNS  map[uint16]map[pendKey]struct{} // pend's keys by namespace (RemoveNamespace drops its own only)
	queue   []pendRef                       // pend in deadline order (stale refs are skipped)
	qhead   int
	gen     uint64
	total   int64
	byKey   map[uint32]int64
	byOwner map[SessionID]int64
}

// nsEvents is a namespace's event log.
type nsEvents struct {
	log deltaLog
}

// DescEvent is one event as a reader sees it. Its byte fields alias the
// Cache and are valid only during the callback.
type DescEvent struct {
	Op     EventOp
	Digest []byte
	Parent []byte // nil: the first block of its chain (and for EventRemoved)
	Tokens []byte // u32 token ids, little-endian
	Extra  []byte
	// Node: the description is the node tier's (a block of the node set
	// the pool does not announce; nodeset.go).
	Node bool
}

// Describe attaches to each block of a run of digests of ns its
// description: block i's parent is block i-1, the first block's is parent
// (nil: none); its token ids are perBlock u32 values (little-endian) from
// tokens, in order; extra is the same for every block. Blocks already
// described keep their description. Each new description is charged to key
// and owner (DescCost). It returns how many descriptions were added.
func (c *Cache) Describe(ns NamespaceID, parent, digests, tokens []byte, perBlock int, extra []byte, key uint32, owner SessionID, now int64) (int, error) {
	n, err := c.ns(ns)
	if err != nil {
		return 0, err
	}
	w := n.width
	switch {
	case len(digests) == 0 || len(digests)%w != 0:
		return 0, fmt.Errorf("%w: %d digest bytes is not a positive multiple of width %d", ErrBadDigest, len(digests), w)
	case parent != nil && len(parent) != w:
		return 0, fmt.Errorf("%w: parent of %d bytes, want %d", ErrBadDigest, len(parent), w)
	case perBlock < 1 || perBlock > MaxDescTokens || len(extra) > MaxDescExtra:
		return 0, fmt.Errorf("%w: %d tokens per block, %d extra bytes", ErrBadDesc, perBlock, len(extra))
	case len(tokens) != len(digests)/w*perBlock*4:
		return 0, fmt.Errorf("%w: %d token bytes for %d blocks of %d tokens", ErrBadDesc, len(tokens), len(digests)/w, perBlock)
	}
	ev := &c.ev
	if ev.descs == nil {
		ev.descs, ev.pend, ev.pendNS = map[uint32]descRec{}, map[pendKey]pendDesc{}, map[uint16]map[pendKey]struct{}{}
		ev.byKey, ev.byOwner = map[uint32]int64{}, map[SessionID]int64{}
	}
	added := 0
	tb := 4 * perBlock
	for i := 0; i*w < len(digests); i++ {
		d := digests[i*w : (i+1)*w]
		p := parent
		if i > 0 {
			p = digests[(i-1)*w : i*w]
		}
		tk := tokens[i*tb : (i+1)*tb]
		head := c.find(uint16(ns), d)
		if head != NoSlot {
			if _, ok := ev.descs[head]; ok {
				continue
			}
			ev.descs[head] = c.newDesc(p, tk, extra, perBlock, key, owner)
			if c.present(head) {
				c.announce(n, head)
			}
			added++
			continue
		}
		k := pendKey{ns: uint16(ns)}
		copy(k.d[:], d)
		if _, ok := ev.pend[k]; ok {
			continue
		}
		ev.gen++
		dl := addDeadline(now, c.cfg.WriteTimeout)
		ev.pend[k] = pendDesc{rec: c.newDesc(p, tk, extra, perBlock, key, owner), deadline: dl, gen: ev.gen}
		byNS := ev.pendNS[k.ns]
		if byNS == nil {
			byNS = map[pendKey]struct{}{}
			ev.pendNS[k.ns] = byNS
		}
		byNS[k] = struct{}{}
		ev.queue = append(ev.queue, pendRef{key: k, gen: ev.gen, deadline: dl})
		added++
	}
	c.compactQueue()
	return added, nil
}

// ErrBadDesc reports a description of the wrong shape.
var ErrBadDesc = fmt.Errorf("cache: malformed description")

func (c *Cache) newDesc(parent, tokens, extra []byte, perBlock int, key uint32, owner SessionID) descRec {
	b := make([]byte, 0, len(parent)+len(tokens)+len(extra))
	b = append(append(append(b, parent...), tokens...), extra...)
	r := descRec{b: b, tokens: uint16(perBlock), extra: uint16(len(extra)), parent: parent != nil, key: key, owner: owner}
	cost := r.cost()
	ev := &c.ev
	ev.total += cost
	ev.byKey[key] += cost
	if owner != 0 {
		ev.byOwner[owner] += cost
	}
	return r
}

func (c *Cache) unchargeDesc(r *descRec) {
	ev := &c.ev
	cost := r.cost()
	ev.total -= cost
	if v := ev.byKey[r.key] - cost; v > 0 {
		ev.byKey[r.key] = v
	} else {
		delete(ev.byKey, r.key)
	}
	if v, ok := ev.byOwner[r.owner]; ok {
		if v -= cost; v > 0 {
			ev.byOwner[r.owner] = v
		} else {
			delete(ev.byOwner, r.owner)
		}
	}
}

// announce logs EventStored for head, a present block of n just described
// (or just present).
func (c *Cache) announce(n *namespace, head uint32) {
	if n.nodeHas(c.digest[head][:n.width]) {
		return // announced already, as the node tier's
	}
	c.logGrowAppend(c.eventLog(n), OpStored, head, c.digest[head][:n.width])
}

// eventLog returns n's event log, creating it (InitialLogSize entries).
func (c *Cache) eventLog(n *namespace) *deltaLog {
	if n.ev == nil {
		n.ev = &nsEvents{}
		n.ev.log.init(c.cfg.InitialLogSize, n.log.epoch, n.log.base)
		c.logBytes += n.ev.log.bytes()
	}
	return &n.ev.log
}

// adoptDesc moves a pending description of (ns, d) onto head, a block
// BeginStore has just put in the index.
func (c *Cache) adoptDesc(ns uint16, d []byte, head uint32) {
	if len(c.ev.pend) == 0 {
		return
	}
	k := pendKey{ns: ns}
	copy(k.d[:], d)
	p, ok := c.ev.pend[k]
	if !ok {
		return
	}
	c.ev.dropPend(k)
	c.ev.descs[head] = p.rec
}

// describedPresent logs EventStored for head, which has just become
// present, if it is described.
func (c *Cache) describedPresent(n *namespace, head uint32) {
	if len(c.ev.descs) == 0 {
		return
	}
	if _, ok := c.ev.descs[head]; ok {
		c.announce(n, head)
	}
}

// dropDesc forgets head's description as its block leaves the index (call
// before its slots are freed): a present block's removal is logged.
func (c *Cache) dropDesc(head uint32) {
	if len(c.ev.descs) == 0 {
		return
	}
	r, ok := c.ev.descs[head]
	if !ok {
		return
	}
	delete(c.ev.descs, head)
	if n := c.nsList[c.nsOf[head]-1]; c.present(head) && !n.nodeHas(c.digest[head][:n.width]) {
		c.logGrowAppend(c.eventLog(n), OpEvicted, head, c.digest[head][:n.width])
	}
	c.unchargeDesc(&r)
}

// ReapDescs drops the pending descriptions (of blocks never stored) whose
// deadline passed, and returns how many.
func (c *Cache) ReapDescs(now int64) int {
	ev := &c.ev
	dropped := 0
	for ev.qhead < len(ev.queue) && ev.queue[ev.qhead].deadline <= now {
		ref := ev.queue[ev.qhead]
		ev.queue[ev.qhead] = pendRef{}
		ev.qhead++
		if p, ok := ev.pend[ref.key]; ok && p.gen == ref.gen {
			ev.dropPend(ref.key)
			c.unchargeDesc(&p.rec)
			dropped++
		}
	}
	c.compactQueue()
	return dropped
}

// compactQueue keeps the pending queue's dead prefix (and its stale
// references) from growing without bound.
func (c *Cache) compactQueue() {
	ev := &c.ev
	switch {
	case ev.qhead == len(ev.queue):
		ev.queue, ev.qhead = ev.queue[:0], 0
	case ev.qhead > 1024 && ev.qhead*2 > len(ev.queue):
		ev.queue = append(ev.queue[:0], ev.queue[ev.qhead:]...)
		ev.qhead = 0
	}
	if len(ev.queue)-ev.qhead > 4*len(ev.pend)+1024 { // mostly adopted: drop the stale refs
		q := ev.queue[:0]
		for _, r := range ev.queue[ev.qhead:] {
			if p, ok := ev.pend[r.key]; ok && p.gen == r.gen {
				q = append(q, r)
			}
		}
		clear(ev.queue[len(q):])
		ev.queue, ev.qhead = q, 0
	}
}

// dropPend forgets the pending description of k (in pend).
func (ev *eventsState) dropPend(k pendKey) {
	delete(ev.pend, k)
	if byNS := ev.pendNS[k.ns]; byNS != nil {
		delete(byNS, k)
		if len(byNS) == 0 {
			delete(ev.pendNS, k.ns)
		}
	}
}

// dropNamespaceDescs forgets the pending descriptions of ns and its event
// log (RemoveNamespace).
func (c *Cache) dropNamespaceDescs(id NamespaceID, n *namespace) {
	for k := range c.ev.pendNS[uint16(id)] {
		p := c.ev.pend[k]
		delete(c.ev.pend, k)
		c.unchargeDesc(&p.rec)
	}
	delete(c.ev.pendNS, uint16(id))
	if n.ev != nil {
		c.logBytes -= n.ev.log.bytes()
		n.ev = nil
	}
}

// DescBytes returns the bytes all descriptions take (DescCost each).
func (c *Cache) DescBytes() int64 { return c.ev.total }

// DescCharged returns the description bytes charged to key.
func (c *Cache) DescCharged(key uint32) int64 { return c.ev.byKey[key] }

// DescOwned returns the description bytes charged to owner.
func (c *Cache) DescOwned(owner SessionID) int64 { return c.ev.byOwner[owner] }

// ForgetDescOwner ends owner's part of the charges (its session ended):
// its descriptions stay, charged to their key and the total.
func (c *Cache) ForgetDescOwner(owner SessionID) { delete(c.ev.byOwner, owner) }

// Descriptions returns how many blocks are described (in the index) and
// how many descriptions wait for their block.
func (c *Cache) Descriptions() (attached, pending int) { return len(c.ev.descs), len(c.ev.pend) }

// EventHead returns the cursor just past the newest event of ns.
func (c *Cache) EventHead(ns NamespaceID) (Cursor, error) {
	n, err := c.ns(ns)
	if err != nil {
		return Cursor{}, err
	}
	if n.ev == nil {
		return Cursor{Epoch: n.log.epoch, Seq: n.log.base}, nil
	}
	return Cursor{Epoch: n.ev.log.epoch, Seq: n.ev.log.head}, nil
}

// EventsSince calls fn with the events of ns from cur on, in order, until
// fn returns false (that event is not consumed), maxEntries events were
// given (<= 0: no bound) or maxScan entries were read (<= 0: no bound),
// and returns the cursor of the first entry not consumed. A stored entry
// whose block is no longer present and described when read is consumed
// without a call. It returns ErrResync as ChangesSince does. Cost is
// proportional to the entries read.
func (c *Cache) EventsSince(ns NamespaceID, cur Cursor, maxEntries, maxScan int, fn func(e *DescEvent) bool) (Cursor, error) {
	n, err := c.ns(ns)
	if err != nil {
		return cur, err
	}
	epoch, base, head := n.log.epoch, n.log.base, n.log.base
	var l *deltaLog
	if n.ev != nil {
		l = &n.ev.log
		head = l.head
	}
	switch {
	case cur.Epoch != epoch:
		return cur, fmt.Errorf("%w: epoch %d, want %d", ErrResync, cur.Epoch, epoch)
	case cur.Seq > head:
		return cur, fmt.Errorf("%w: seq %d is past head %d", ErrResync, cur.Seq, head)
	case l == nil && cur.Seq < base || l != nil && cur.Seq < l.oldest():
		return cur, fmt.Errorf("%w: seq %d overwritten or from another namespace", ErrResync, cur.Seq)
	}
	end := head
	if maxScan > 0 && end-cur.Seq > uint64(maxScan) {
		end = cur.Seq + uint64(maxScan)
	}
	got := 0
	var e DescEvent
	s := cur.Seq
	for ; s < end; s++ {
		if maxEntries > 0 && got >= maxEntries {
			break
		}
		le := &l.ents[s&l.mask]
		d := le.digest[:n.width]
		if le.op == OpEvicted {
			e = DescEvent{Op: EventRemoved, Digest: d}
		} else {
			h := c.find(uint16(ns), d)
			r, ok := c.ev.descs[h]
			switch {
			case h != NoSlot && ok && c.present(h):
				e = DescEvent{Op: EventStored, Digest: d}
				r.view(n.width, &e)
			case !n.nodeEvent(d, &e):
				continue
			}
		}
		if !fn(&e) {
			break
		}
		got++
	}
	return Cursor{Epoch: epoch, Seq: s}, nil
}

// EventSnapshotPage calls fn with each present, described block of ns (as
// an EventStored event) found scanning the pool's slots from position from
// on, at most maxScan slots (<= 0: no bound), until fn returns false (that
// block is not consumed). It returns the head cursor of ns's event log at
// the time of the call, the position the next page starts at, and done when
// the scan reached the end of the pool. Past the pool's slots (positions
// capacity and up) come the namespace's node-set blocks that the pool does
// not announce (nodeset.go), and done is when those are read too. Pages
// and the event log from the
// first page's cursor rebuild the set of announced blocks exactly, as
// SnapshotPage and the change log do (docs/protocol.md, section 11.1).
func (c *Cache) EventSnapshotPage(ns NamespaceID, from uint64, maxScan int, fn func(e *DescEvent) bool) (cur Cursor, next uint64, done bool, err error) {
	cur, err = c.EventHead(ns)
	if err != nil {
		return cur, from, false, err
	}
	n := c.nsList[ns-1]
	capacity := uint64(c.capacity)
	if from >= capacity { // the node set's entries, by id, follow the pool's slots
		nx, done := c.nodeSnapshotPage(uint16(ns), n, from-capacity, maxScan, fn)
		return cur, capacity + nx, done, nil
	}
	nodeLeft := n.node != nil && n.node.live > 0
	if n.ev == nil || n.blocks == 0 || len(c.ev.descs) == 0 {
		return cur, capacity, !nodeLeft, nil
	}
	end := capacity
	if maxScan > 0 && capacity-from > uint64(maxScan) {
		end = from + uint64(maxScan)
	}
	id := uint16(ns)
	var e DescEvent
	for s := from; s < end; s++ {
		if !c.presentHeadOf(uint32(s), id, n.world) {
			continue
		}
		r, ok := c.ev.descs[uint32(s)]
		if !ok {
			continue
		}
		e = DescEvent{Op: EventStored, Digest: c.digest[s][:n.width]}
		r.view(n.width, &e)
		if !fn(&e) {
			return cur, s, false, nil
		}
	}
	return cur, end, end >= capacity && !nodeLeft, nil
}

// checkDescs verifies the descriptions' invariants (CheckInvariants).
func (c *Cache) checkDescs(bad func(format string, args ...any)) {
	c.checkNodeSets(bad)
	ev := &c.ev
	var total int64
	byKey := map[uint32]int64{}
	byOwner := map[SessionID]int64{}
	count := func(r *descRec) {
		total += r.cost()
		byKey[r.key] += r.cost()
		byOwner[r.owner] += r.cost()
	}
	for h, r := range ev.descs {
		if h >= c.capacity || c.state(h) == stFree || c.rank(h) != 0 || c.isDoomed(h) {
			bad("description on slot %d, which is no block's head", h)
			continue
		}
		w := c.nsList[c.nsOf[h]-1].width
		if c.find(c.nsOf[h], c.digest[h][:w]) != h {
			bad("description on head %d, which is not in the index", h)
		}
		extra := 0
		if r.parent {
			extra = w
		}
		if len(r.b) != extra+4*int(r.tokens)+int(r.extra) {
			bad("head %d: description of %d bytes, want %d", h, len(r.b), extra+4*int(r.tokens)+int(r.extra))
		}
		count(&r)
	}
	byNS := 0
	for ns, ks := range ev.pendNS {
		byNS += len(ks)
		for k := range ks {
			if _, ok := ev.pend[k]; !ok || k.ns != ns {
				bad("pending description indexed under namespace %d, not pending there", ns)
			}
		}
	}
	if byNS != len(ev.pend) {
		bad("%d pending descriptions, %d indexed by namespace", len(ev.pend), byNS)
	}
	for k, p := range ev.pend {
		if k.ns == 0 || int(k.ns) > len(c.nsList) || c.nsList[k.ns-1] == nil {
			bad("pending description in namespace %d, which does not exist", k.ns)
			continue
		}
		w := c.nsList[k.ns-1].width
		if c.find(k.ns, k.d[:w]) != NoSlot {
			bad("pending description of a digest in the index (namespace %d)", k.ns)
		}
		if want := 4*int(p.rec.tokens) + int(p.rec.extra); p.rec.parent && len(p.rec.b) != want+w || !p.rec.parent && len(p.rec.b) != want {
			bad("pending description of %d bytes, want %d (and the parent)", len(p.rec.b), want)
		}
		count(&p.rec)
	}
	if total != ev.total {
		bad("descriptions cost %d, charged %d", total, ev.total)
	}
	for k, v := range ev.byKey {
		if byKey[k] != v {
			bad("descriptions of key %d cost %d, charged %d", k, byKey[k], v)
		}
	}
	for k, v := range byKey {
		if ev.byKey[k] != v {
			bad("descriptions of key %d cost %d, charged %d", k, v, ev.byKey[k])
		}
	}
	for o, v := range ev.byOwner {
		if byOwner[o] != v {
			bad("descriptions of owner %d cost %d, charged %d", o, byOwner[o], v)
		}
	}
	for _, n := range c.nsList {
		if n != nil && n.ev != nil && (n.ev.log.epoch != n.log.epoch || n.ev.log.base != n.log.base) {
			bad("an event log whose epoch or base differs from its change log's")
		}
	}
}
