package cache

import (
	"fmt"
	"strconv"
)

// Op is the kind of a delta-log change.
type Op uint8

const (
	// OpStored: the block became present (all ranks committed).
	OpStored Op = iota + 1
	// OpEvicted: the block was evicted to make room.
	OpEvicted
	// OpCleared: Clear dropped every block of the namespace; the consumer
	// must forget all of them. Pinned blocks that survived Clear follow
	// as OpStored changes.
	OpCleared
)

func (o Op) String() string {
	switch o {
	case OpStored:
		return "Stored"
	case OpEvicted:
		return "Evicted"
	case OpCleared:
		return "Cleared"
	}
	return "Op(" + strconv.Itoa(int(o)) + ")"
}

// Cursor is a position in one namespace's delta log: the epoch of the
// cache instance and the sequence number of the next change to read.
// The zero Cursor is never valid; start from Snapshot or Head.
type Cursor struct {
	Epoch uint64
	Seq   uint64
}

// Change is one delta-log entry. The digest is a copy taken when the
// change was logged, so it stays right even if the slot is reused later.
type Change struct {
	Seq   uint64
	Slot  uint32 // head (rank 0) slot at the time of the change; NoSlot for OpCleared
	Op    Op
	Width uint8
	Raw   [MaxDigestLen]byte
}

// Digest returns the change's digest (empty for OpCleared).
func (c *Change) Digest() []byte { return c.Raw[:c.Width] }

// logEntry is one ring entry: 8 (seq) + 4 (slot) + 1 (op) + 32 (digest),
// padded to 48 bytes.
type logEntry struct {
	seq    uint64
	slot   uint32
	op     Op
	digest [MaxDigestLen]byte
}

const logEntrySize = 48

type deltaLog struct {
	epoch uint64
	base  uint64 // seq of the first change this log ever held
	head  uint64 // seq of the next change; entries [max(base, head-len(ents)), head) are readable
	mask  uint64
	ents  []logEntry
}

func (l *deltaLog) init(size int, epoch, base uint64) {
	l.epoch = epoch
	l.base, l.head = base, base
	l.ents = make([]logEntry, size)
	l.mask = uint64(size - 1)
}

func (l *deltaLog) bytes() int64 { return int64(len(l.ents)) * logEntrySize }

// oldest is the seq of the oldest readable entry.
func (l *deltaLog) oldest() uint64 {
	if l.head-l.base > uint64(len(l.ents)) {
		return l.head - uint64(len(l.ents))
	}
	return l.base
}

func (l *deltaLog) append(op Op, slot uint32, d []byte) {
	e := &l.ents[l.head&l.mask]
	e.seq, e.slot, e.op = l.head, slot, op
	e.digest = [MaxDigestLen]byte{}
	copy(e.digest[:], d)
	l.head++
}

// logAppend appends a change to n's log, first doubling the log (up to
// DeltaLogSize, within MaxLogBytes) when the append would overwrite its
// oldest entry: a namespace's log costs memory in proportion to how much
// it changes, not DeltaLogSize from the start.
func (c *Cache) logAppend(n *namespace, op Op, slot uint32, d []byte) {
	c.logGrowAppend(&n.log, op, slot, d)
}

// logGrowAppend appends to l (a change log or an event log), growing it as
// logAppend says.
func (c *Cache) logGrowAppend(l *deltaLog, op Op, slot uint32, d []byte) {
	if size := len(l.ents); l.head-l.base >= uint64(size) && size < c.cfg.DeltaLogSize {
		grow := int64(size) * logEntrySize
		if c.cfg.MaxLogBytes == 0 || c.logBytes+grow <= c.cfg.MaxLogBytes {
			ents := make([]logEntry, 2*size)
			mask := uint64(2*size - 1)
			for q := l.oldest(); q < l.head; q++ {
				ents[q&mask] = l.ents[q&l.mask]
			}
			l.ents, l.mask = ents, mask
			c.logBytes += grow
		}
	}
	l.append(op, slot, d)
}

// Head returns the cursor just past the newest change of ns.
func (c *Cache) Head(ns NamespaceID) (Cursor, error) {
	n, err := c.ns(ns)
	if err != nil {
		return Cursor{}, err
	}
	return Cursor{Epoch: n.log.epoch, Seq: n.log.head}, nil
}

// ChangesSince appends to buf[:0] up to max (< 0: all) changes of ns from cur
// and returns them with the cursor to pass next time. It returns
// ErrResync if cur belongs to another epoch, lies in the future, or points
// at changes the ring has already overwritten; the consumer must then
// rebuild from Snapshot. Cost is proportional to the changes returned.
func (c *Cache) ChangesSince(ns NamespaceID, cur Cursor, max int, buf []Change) ([]Change, Cursor, error) {
	n, err := c.ns(ns)
	if err != nil {
		return buf[:0], cur, err
	}
	l := &n.log
	if cur.Epoch != l.epoch {
		return buf[:0], cur, fmt.Errorf("%w: epoch %d, want %d", ErrResync, cur.Epoch, l.epoch)
	}
	if cur.Seq > l.head {
		return buf[:0], cur, fmt.Errorf("%w: seq %d is past head %d", ErrResync, cur.Seq, l.head)
	}
	if cur.Seq < l.oldest() {
		return buf[:0], cur, fmt.Errorf("%w: seq %d overwritten or from another namespace (oldest %d)", ErrResync, cur.Seq, l.oldest())
	}
	out := buf[:0]
	end := l.head
	if max >= 0 && end-cur.Seq > uint64(max) {
		end = cur.Seq + uint64(max)
	}
	for s := cur.Seq; s < end; s++ {
		e := &l.ents[s&l.mask]
		ch := Change{Seq: e.seq, Slot: e.slot, Op: e.op, Raw: e.digest}
		if e.op != OpCleared {
			ch.Width = uint8(n.width)
		}
		out = append(out, ch)
	}
	return out, Cursor{Epoch: l.epoch, Seq: end}, nil
}

// Snapshot calls fn with the digest of every present block of ns (until fn
// returns false) and returns the cursor from which ChangesSince continues
// the snapshot. The digest slice is only valid during the call and fn must
// not call into the Cache. Cost is proportional to capacity.
func (c *Cache) Snapshot(ns NamespaceID, fn func(digest []byte) bool) (Cursor, error) {
	n, err := c.ns(ns)
	if err != nil {
		return Cursor{}, err
	}
	cur := Cursor{Epoch: n.log.epoch, Seq: n.log.head}
	id := uint16(ns)
	for s := uint32(0); s < c.capacity; s++ {
		if !c.presentHeadOf(s, id, n.world) {
			continue
		}
		if !fn(c.digest[s][:n.width]) {
			break
		}
	}
	return cur, nil
}

// presentHeadOf reports whether slot s is the head of a present block of
// namespace id (of world size world): meta == stStored means rank 0 and
// stored, and done counts the ranks stored.
func (c *Cache) presentHeadOf(s uint32, id uint16, world int) bool {
	return c.nsOf[s] == id && c.meta[s] == stStored && int(c.done[s]) == world
}

// SnapshotPage is Snapshot in pages, for a consumer that must not hold the
// caller's lock for a whole scan. It scans slots from position from on, in
// slot order, and calls fn with the digest of each present block of ns it
// finds: at most maxEntries digests and at most maxScan slots (either <= 0:
// no bound). It returns the head cursor of ns's log at the time of the call,
// the position from which the next page continues, and done when the scan
// reached the end of the pool (no more pages). next > from unless done;
// from >= capacity is done at once. The digest slice is only valid during
// the call and fn must not call into the Cache. Cost is proportional to the
// slots scanned.
//
// Paging with nothing changing between pages visits every present block
// exactly once. With changes between pages, a page holds only digests
// present when it was read, so a mirror of the pages followed by the log
// from the first page's cursor ends equal to the namespace (docs/protocol.md,
// section 11).
func (c *Cache) SnapshotPage(ns NamespaceID, from uint64, maxEntries, maxScan int, fn func(digest []byte)) (cur Cursor, next uint64, done bool, err error) {
	n, err := c.ns(ns)
	if err != nil {
		return Cursor{}, from, false, err
	}
	cur = Cursor{Epoch: n.log.epoch, Seq: n.log.head}
	capacity := uint64(c.capacity)
	if from >= capacity {
		return cur, from, true, nil
	}
	if n.blocks == 0 {
		return cur, capacity, true, nil // nothing present anywhere
	}
	end := capacity
	if maxScan > 0 && capacity-from > uint64(maxScan) {
		end = from + uint64(maxScan)
	}
	id := uint16(ns)
	got := 0
	for s := from; s < end; s++ {
		if !c.presentHeadOf(uint32(s), id, n.world) {
			continue
		}
		fn(c.digest[s][:n.width])
		if got++; maxEntries > 0 && got >= maxEntries {
			end = s + 1
			break
		}
	}
	return cur, end, end >= capacity, nil
}

// Clear drops every present, unpinned block of ns and logs OpCleared,
// followed by OpStored for each pinned block that survived. Incomplete
// blocks (writes in flight) are left alone and may become present later.
// It returns the number of blocks dropped. Cost is proportional to
// capacity.
func (c *Cache) Clear(ns NamespaceID) (int, error) {
	n, err := c.ns(ns)
	if err != nil {
		return 0, err
	}
	id := uint16(ns)
	dropped := 0
	for _, sent := range c.evictionLists() {
		for s := c.prev[sent]; s != sent; {
			p := c.prev[s]
			if s < c.capacity && c.nsOf[s] == id {
				c.evictBlock(s, false)
				dropped++
			}
			s = p
		}
	}
	c.st.cleared += uint64(dropped)
	c.logAppend(n, OpCleared, NoSlot, nil)
	if n.blocks > 0 { // pinned survivors
		for s := uint32(0); s < c.capacity; s++ {
			if c.nsOf[s] == id && c.meta[s] == stStored && int(c.done[s]) == n.world {
				c.logAppend(n, OpStored, s, c.digest[s][:n.width])
			}
		}
	}
	return dropped, nil
}
