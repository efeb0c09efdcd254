package cache

import (
	"errors"
	"fmt"
)

// checkMarkers checks MQP queue q: its block counter, and that the
// markers found in it (front to back) are its marker ring, newest first,
// with ticks that never increase towards the back.
func (c *Cache) checkMarkers(q, blocks int, found []uint8, bad func(string, ...any)) {
	m := c.mqp
	if m.nb[q] != blocks {
		bad("mqp: queue %d holds %d blocks, counter %d", q, blocks, m.nb[q])
	}
	if len(found) != int(m.mkLen[q]) {
		bad("mqp: queue %d holds %d markers, ring %d", q, len(found), m.mkLen[q])
		return
	}
	for i, id := range found {
		want := m.mkRing[q][(int(m.mkHead[q])+len(found)-1-i)%mqpMarkersPerQ]
		if id != want {
			bad("mqp: queue %d marker %d is %d, ring says %d", q, i, id, want)
		}
		if i > 0 && m.mk[id] > m.mk[found[i-1]] {
			bad("mqp: queue %d markers out of order", q)
		}
		if m.mk[id] > m.now {
			bad("mqp: marker %d stamped %d after the clock %d", id, m.mk[id], m.now)
		}
	}
}

// CheckInvariants verifies every structural invariant of the Cache and
// returns all violations found (nil if none). It is O(capacity + side
// tables) and meant for tests and debug builds.
func (c *Cache) CheckInvariants() error {
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < 20 {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	n := c.capacity
	if c.nFree+c.nReserved+c.nWriting+c.nStored != int(n) {
		bad("free %d + reserved %d + writing %d + stored %d != capacity %d", c.nFree, c.nReserved, c.nWriting, c.nStored, n)
	}

	// Free list.
	free := 0
	for s := c.freeHead; s != NoSlot; s = c.next[s] {
		if s >= n {
			bad("free list: slot %d out of range", s)
			break
		}
		if free++; free > int(n) {
			bad("free list: cycle")
			break
		}
		if c.meta[s] != stFree || c.nsOf[s] != 0 || c.ring[s] != NoSlot {
			bad("free list: slot %d meta %d ns %d ring %d", s, c.meta[s], c.nsOf[s], c.ring[s])
		}
	}
	if free != c.nFree {
		bad("free list length %d != nFree %d", free, c.nFree)
	}

	// Slot scan.
	var cnt [4]int
	heads, present, pinnedBlocks, evictable := 0, 0, 0, 0
	nsBlocks := make([]int, len(c.nsList))
	nsPending := make([]int, len(c.nsList))
	nsDoomed := make([]int, len(c.nsList))
	groupTimers, doomedHeads := 0, 0
	for s := uint32(0); s < n; s++ {
		cnt[c.state(s)]++
		if c.state(s) == stFree {
			if c.meta[s] != stFree {
				bad("slot %d: free with rank bits", s)
			}
			continue
		}
		if c.rank(s) != 0 {
			continue // checked from its head
		}
		heads++
		id := c.nsOf[s]
		if id == 0 || int(id) > len(c.nsList) || c.nsList[id-1] == nil {
			bad("head %d: bad namespace %d", s, id)
			continue
		}
		ns := c.nsList[id-1]
		// Ring: ranks 0..W-1 in order, members point at head.
		stored, writing, m, r := 0, 0, s, 0
		for {
			if c.state(m) == stFree || c.rank(m) != r || c.nsOf[m] != id {
				bad("block %d: member %d state %d rank %d (want %d) ns %d", s, m, c.state(m), c.rank(m), r, c.nsOf[m])
				break
			}
			if r > 0 && c.prev[m] != s {
				bad("block %d: member %d prev %d", s, m, c.prev[m])
			}
			switch c.state(m) {
			case stStored:
				stored++
			case stWriting:
				writing++
				wi := c.aux[m]
				if int(wi) >= len(c.writers) || !c.writers[wi].live || c.writers[wi].slot != m {
					bad("slot %d: writing without matching writer %d", m, wi)
				}
			}
			r++
			if m = c.ring[m]; m == s || m >= n || r > MaxWorldSize {
				break
			}
		}
		if r != ns.world || m != s {
			bad("block %d: ring length %d, world %d", s, r, ns.world)
		}
		doomed := c.isDoomed(s)
		if int(c.done[s]&^doomedBit) != stored {
			bad("block %d: done %d, stored members %d", s, c.done[s], stored)
		}
		if doomed {
			nsDoomed[id-1]++
			doomedHeads++
			if writing == 0 {
				bad("doomed block %d: no write in flight, yet not freed", s)
			}
			if got := c.find(id, c.digest[s][:ns.width]); got == s {
				bad("doomed block %d: still indexed", s)
			}
			if _, ok := c.pendingKey[s]; ok {
				bad("doomed block %d: still charged", s)
			}
			continue
		}
		if w := ns.width; w < MaxDigestLen {
			for _, b := range c.digest[s][w:] {
				if b != 0 {
					bad("block %d: digest padding not zero", s)
					break
				}
			}
		}
		if got := c.find(id, c.digest[s][:ns.width]); got != s {
			bad("block %d: index finds %d", s, got)
		}
		if stored == ns.world {
			present++
			nsBlocks[id-1]++
			if c.aux[s] == 0 {
				evictable += ns.world
				if c.prev[s] == NoSlot || c.next[s] == NoSlot {
					bad("block %d: unpinned present block not in LRU", s)
				}
			} else {
				pinnedBlocks++
				if c.prev[s] != NoSlot || c.next[s] != NoSlot {
					bad("block %d: pinned block in LRU", s)
				}
			}
		} else {
			nsPending[id-1]++
			groupTimers++
			ti := c.next[s]
			if int(ti) >= len(c.timers) || c.timers[ti].kind != timerGroup || c.timers[ti].idx != s {
				bad("pending block %d: timer back-pointer %d broken", s, ti)
			}
			if c.prev[s] != NoSlot {
				bad("pending block %d: prev %d", s, c.prev[s])
			}
			if writing == 0 && stored == 0 {
				bad("pending block %d: nothing written nor writing", s)
			}
		}
	}
	if cnt[stFree] != c.nFree || cnt[stReserved] != c.nReserved || cnt[stWriting] != c.nWriting || cnt[stStored] != c.nStored {
		bad("state counts %v != free %d reserved %d writing %d stored %d", cnt, c.nFree, c.nReserved, c.nWriting, c.nStored)
	}
	live, logBytes, logs := 0, int64(0), 0
	for i, ns := range c.nsList {
		if ns == nil {
			if nsBlocks[i]+nsPending[i]+nsDoomed[i] != 0 {
				bad("removed namespace %d still owns slots", i+1)
			}
			continue
		}
		live++
		logs++
		logBytes += ns.log.bytes()
		if ns.ev != nil { // its event log (meta.go)
			logs++
			logBytes += ns.ev.log.bytes()
		}
		if id, ok := c.nsByKey[ns.key]; !ok || int(id) != i+1 {
			bad("namespace %d: key maps to %d (%v)", i+1, id, ok)
		}
		if ns.blocks != nsBlocks[i] || ns.pending != nsPending[i] || ns.doomed != nsDoomed[i] {
			bad("namespace %d: blocks %d/%d pending %d/%d doomed %d/%d", i+1, ns.blocks, nsBlocks[i], ns.pending, nsPending[i], ns.doomed, nsDoomed[i])
		}
		l := &ns.log
		if len(l.ents) == 0 || len(l.ents)&(len(l.ents)-1) != 0 || len(l.ents) > c.cfg.DeltaLogSize || l.head < l.base {
			bad("namespace %d: log of %d entries, base %d head %d", i+1, len(l.ents), l.base, l.head)
			continue
		}
		for q := l.oldest(); q < l.head; q++ {
			if l.ents[q&l.mask].seq != q {
				bad("namespace %d: log entry %d has seq %d", i+1, q, l.ents[q&l.mask].seq)
				break
			}
		}
	}
	if live != c.nsLive || len(c.nsByKey) != live || live+len(c.nsFree) != len(c.nsList) {
		bad("namespaces: %d live, counter %d, keys %d, free ids %d, list %d", live, c.nsLive, len(c.nsByKey), len(c.nsFree), len(c.nsList))
	}
	if logBytes != c.logBytes || (c.cfg.MaxLogBytes > 0 && logBytes > c.cfg.MaxLogBytes && live > 0 && logBytes > int64(logs)*int64(c.cfg.InitialLogSize)*logEntrySize) {
		bad("log bytes %d, counter %d, bound %d", logBytes, c.logBytes, c.cfg.MaxLogBytes)
	}
	// Charges of incomplete blocks.
	charged := map[uint32]int{}
	for h, key := range c.pendingKey {
		if h >= n || c.rank(h) != 0 || c.state(h) == stFree || c.isDoomed(h) || c.present(h) {
			bad("charge of slot %d: not an incomplete head", h)
			continue
		}
		charged[key] += c.worldOf(h)
	}
	for key, v := range c.pendingByKey {
		if charged[key] != v || v <= 0 {
			bad("charge key %d: %d slots counted, %d held", key, v, charged[key])
		}
	}
	if len(charged) != len(c.pendingByKey) {
		bad("%d charge keys hold slots, %d counted", len(charged), len(c.pendingByKey))
	}
	if heads-doomedHeads != c.entries {
		bad("heads %d (doomed %d) != index entries %d", heads, doomedHeads, c.entries)
	}
	if doomedHeads != c.doomed {
		bad("doomed blocks %d != counter %d", doomedHeads, c.doomed)
	}
	if evictable != c.evictable {
		bad("evictable %d != computed %d", c.evictable, evictable)
	}
	if pinnedBlocks != c.pinned {
		bad("pinned %d != computed %d", c.pinned, pinnedBlocks)
	}

	// Index table.
	entries := 0
	tn := uint32(len(c.table))
	for i, e := range c.table {
		if e == 0 {
			continue
		}
		entries++
		s := e - 1
		if s >= n || c.state(s) == stFree || c.rank(s) != 0 {
			bad("index[%d]: slot %d is not a head", i, s)
			continue
		}
		w := c.nsList[c.nsOf[s]-1].width
		h := hashKey(c.nsOf[s], c.digest[s][:w])
		if c.tags[i] != tagOf(h) {
			bad("index[%d]: tag %d, want %d", i, c.tags[i], tagOf(h))
		}
		for j := c.home(h); j != uint32(i); {
			if c.table[j] == 0 {
				bad("index[%d]: empty bucket %d on probe path", i, j)
				break
			}
			if j++; j == tn {
				j = 0
			}
		}
	}
	if entries != c.entries {
		bad("index: %d entries, counter %d", entries, c.entries)
	}

	// LRU list, or MQP's queues.
	lru := 0
	queues := []uint32{c.sentinel}
	if c.mqp != nil {
		queues = c.mqp.qSent[:]
	}
	for q, sent := range queues {
		blocks, steps := 0, 0
		var markers []uint8
		for s := c.next[sent]; s != sent; s = c.next[s] {
			if steps++; steps > int(n)+mqpMarkers {
				bad("lru %d: cycle", q)
				break
			}
			if c.prev[c.next[s]] != s {
				bad("lru %d: next(%d).prev != %d", q, s, s)
			}
			if c.isMarker(s) && s < uint32(len(c.prev)) {
				markers = append(markers, uint8(s-c.mqp.mkBase))
				continue
			}
			if s >= n {
				bad("lru %d: slot %d out of range", q, s)
				break
			}
			blocks++
			if c.rank(s) != 0 || !c.present(s) || c.aux[s] != 0 {
				bad("lru %d: slot %d not an unpinned present head", q, s)
			}
			if c.retains[s] != nil && !c.retainsAsEvidence() {
				bad("lru %d: slot %d is retained", q, s)
			}
			if c.mqp != nil {
				if lv := int(c.mqpLevelOf(s)); lv != q {
					bad("mqp: slot %d in queue %d has level %d", s, q, lv)
				}
				if cnt := c.mqpCount(s); cnt == 0 || int(mqpLevel(cnt)) < q {
					bad("mqp: slot %d in queue %d has count %d", s, q, cnt)
				}
			}
		}
		lru += blocks
		if c.mqp != nil {
			c.checkMarkers(q, blocks, markers, bad)
		}
	}
	if c.mqp != nil {
		m := c.mqp
		if m.mkFreeN+int(m.mkLen[1])+int(m.mkLen[2])+int(m.mkLen[3]) != mqpMarkers {
			bad("mqp: %d free markers + %v listed != %d", m.mkFreeN, m.mkLen, mqpMarkers)
		}
		for i := 0; i < m.mkFreeN; i++ {
			if x := m.mkBase + uint32(m.mkFree[i]); c.prev[x] != NoSlot || c.next[x] != NoSlot {
				bad("mqp: free marker %d is linked", m.mkFree[i])
			}
		}
	}
	retained, retainTimers, listed := c.checkRetains(bad)
	if lru != c.lruLen || lru+listed+pinnedBlocks != present {
		bad("lru length %d, counter %d, retained listed %d, pinned %d, present %d", lru, c.lruLen, listed, pinnedBlocks, present)
	}

	// Leases and pins.
	pins := make(map[uint32]uint32)
	leaseTimers := 0
	for id := range c.tailLoads {
		if _, ok := c.loads[id]; !ok {
			bad("tail pin %d: no such load", id)
		}
	}
	for w, word := range c.marks {
		for b := 0; word != 0 && b < 64; b++ {
			if word&(1<<b) == 0 {
				continue
			}
			word &^= 1 << b
			if s := uint32(w*64 + b); s >= n || c.rank(s) != 0 || !c.present(s) {
				bad("slot %d: marked, but not the head of a present block", s)
			}
		}
	}
	for id, heads := range c.loads {
		if id == 0 || id > c.nextLoad {
			bad("load %d: id beyond counter %d", id, c.nextLoad)
		}
		for _, h := range heads {
			pins[h]++
		}
	}
	for id, li := range c.leaseByID {
		l := &c.leases[li]
		if l.id != id {
			bad("lease %d: record %d has id %d", id, li, l.id)
		}
		if len(l.heads) == 0 && !l.open {
			bad("lease %d: no blocks", id)
		}
		for _, h := range l.heads {
			pins[h]++
		}
		if hi := l.heapIdx; hi < 0 || int(hi) >= len(c.timers) || c.timers[hi].kind != timerLease || c.timers[hi].idx != uint32(li) {
			bad("lease %d: timer back-pointer %d broken", id, hi)
		} else {
			leaseTimers++
		}
		if id > c.nextLeaseID {
			bad("lease %d: id beyond counter %d", id, c.nextLeaseID)
		}
	}
	keyPins := map[uint32]map[uint32]uint32{}
	for _, li := range c.leaseByID {
		l := &c.leases[li]
		if l.key == 0 || len(l.heads) == 0 {
			continue // an open lease that holds nothing charges nothing
		}
		if keyPins[l.key] == nil {
			keyPins[l.key] = map[uint32]uint32{}
		}
		for _, h := range l.heads {
			keyPins[l.key][h]++
		}
	}
	if len(keyPins) != len(c.pinKey) || len(c.pinByKey) != len(c.pinKey) {
		bad("pin charges: %d keys in leases, %d kept, %d counted", len(keyPins), len(c.pinKey), len(c.pinByKey))
	}
	for key, want := range keyPins {
		got, slots := c.pinKey[key], 0
		for h, n := range want {
			if got[h] != n {
				bad("pin charge key %d block %d: %d, leases hold %d", key, h, got[h], n)
			}
			slots += c.worldOf(h)
		}
		if len(got) != len(want) || c.pinByKey[key] != slots {
			bad("pin charge key %d: %d slots counted, leases pin %d", key, c.pinByKey[key], slots)
		}
	}
	// Retention charges: each key's counter is the slots of the blocks it
	// retains, apart from its pins.
	if len(retained) != len(c.retainByKey) {
		bad("retention charges: %d keys retain, %d counted", len(retained), len(c.retainByKey))
	}
	for key, heads := range retained {
		slots := 0
		for _, h := range heads {
			slots += c.worldOf(h)
		}
		if c.retainByKey[key] != slots {
			bad("retention charge key %d: %d slots counted, its retentions hold %d", key, c.retainByKey[key], slots)
		}
	}
	for h, p := range pins {
		if h >= n || c.rank(h) != 0 || !c.present(h) || c.aux[h] != p {
			bad("block %d: pins %d, leases and loads hold %d", h, c.aux[h], p)
		}
	}
	if len(pins) != pinnedBlocks {
		bad("%d blocks leased or loading, %d pinned", len(pins), pinnedBlocks)
	}

	// Writers.
	live = 0
	for i := range c.writers {
		w := &c.writers[i]
		if !w.live {
			continue
		}
		live++
		if c.state(w.slot) != stWriting || c.aux[w.slot] != uint32(i) {
			bad("writer %d: slot %d not writing with it", i, w.slot)
		}
	}
	if live != c.liveWriter || live != c.nWriting {
		bad("live writers %d, counter %d, writing slots %d", live, c.liveWriter, c.nWriting)
	}

	// Timers.
	if len(c.timers) != leaseTimers+groupTimers+retainTimers {
		bad("timers %d != leases %d + pending blocks %d + retentions %d", len(c.timers), leaseTimers, groupTimers, retainTimers)
	}
	for i := 1; i < len(c.timers); i++ {
		if c.timers[i].less(&c.timers[(i-1)/2]) {
			bad("timer heap order broken at %d", i)
			break
		}
	}

	// Owners.
	ol, ow := 0, 0
	for id, o := range c.owners {
		if o.leases < 0 && o.writers < 0 {
			bad("owner %d: empty but kept", id)
		}
		prev := int32(-1)
		for li := o.leases; li >= 0; li = c.leases[li].next {
			l := &c.leases[li]
			if l.owner != id || l.prev != prev {
				bad("owner %d: lease list broken at %d", id, li)
				break
			}
			if _, ok := c.leaseByID[l.id]; !ok {
				bad("owner %d: dead lease %d in list", id, l.id)
			}
			prev = li
			if ol++; ol > len(c.leases) {
				bad("owner lease lists cycle")
				break
			}
		}
		prev = -1
		for wi := o.writers; wi >= 0; wi = c.writers[wi].next {
			w := &c.writers[wi]
			if w.owner != id || w.prev != prev || !w.live {
				bad("owner %d: writer list broken at %d", id, wi)
				break
			}
			prev = wi
			if ow++; ow > len(c.writers) {
				bad("owner writer lists cycle")
				break
			}
		}
	}
	if ol != len(c.leaseByID) || ow != live {
		bad("owner lists hold %d leases/%d writers, live %d/%d", ol, ow, len(c.leaseByID), live)
	}
	c.checkDescs(bad)
	return errors.Join(errs...)
}
