package node

// index is the node pool's bookkeeping, without I/O: which slot holds which
// (namespace, digest, rank) value, the slots free, being written and
// present, the least recently used order of the pool and of each pod's
// blocks, and each pod's charge. Its caller holds a lock around every
// method.
type index struct {
	byKey  map[string]int32
	slots  []slotMeta
	free   []int32
	lru    list // every present slot; head: most recent
	owners map[string]*owner
	share  int // slots one owner may hold
	st     IndexStats
	// onRemove, if set, is told the key of every present value that leaves.
	onRemove func(key string)
}

// IndexStats are the index's counts.
type IndexStats struct {
	Slots, Free, Writing, Present int
	Owners                        int
	Evicted                       uint64 // blocks evicted for the pool's room
	EvictedShare                  uint64 // blocks evicted for their own pod's share
}

type slotState uint8

const (
	slotFree slotState = iota
	slotWriting
	slotPresent
)

type slotMeta struct {
	key    string
	state  slotState
	owner  *owner
	pins   int32
	length uint64
	g, o   links // in index.lru, in owner.lru
}

type links struct{ prev, next int32 }

// list is an intrusive doubly linked list of slots (-1: none); which links
// of a slot it uses is its get function's choice.
type list struct {
	head, tail int32
	n          int
}

type owner struct {
	name string // the pod's identity
	// declared is the name its first connection declared (logs).
	declared string
	used     int // slots charged: writing or present
	lru      list
	conns    int
}

func newIndex(slots, share int) *index {
	x := &index{byKey: map[string]int32{}, slots: make([]slotMeta, slots), free: make([]int32, slots),
		owners: map[string]*owner{}, share: max(share, 1)}
	x.lru = list{head: -1, tail: -1}
	for i := range x.free {
		x.free[i] = int32(slots - 1 - i) // slot 0 first
	}
	return x
}

func (x *index) gl(i int32) *links { return &x.slots[i].g }
func (x *index) ol(i int32) *links { return &x.slots[i].o }

func (x *index) pushFront(l *list, i int32, get func(int32) *links) {
	e := get(i)
	e.prev, e.next = -1, l.head
	if l.head >= 0 {
		get(l.head).prev = i
	} else {
		l.tail = i
	}
	l.head = i
	l.n++
}

func (x *index) unlink(l *list, i int32, get func(int32) *links) {
	e := get(i)
	if e.prev >= 0 {
		get(e.prev).next = e.next
	} else {
		l.head = e.next
	}
	if e.next >= 0 {
		get(e.next).prev = e.prev
	} else {
		l.tail = e.prev
	}
	e.prev, e.next = -1, -1
	l.n--
}

// attach counts a connection of the owner name (made on first use).
func (x *index) attach(name string) *owner {
	o := x.owners[name]
	if o == nil {
		o = &owner{name: name, lru: list{head: -1, tail: -1}}
		x.owners[name] = o
	}
	o.conns++
	return o
}

// detach ends a connection of o; an owner with neither connections nor
// charges is forgotten.
func (x *index) detach(o *owner) {
	o.conns--
	x.forget(o)
}

func (x *index) forget(o *owner) {
	if o.conns == 0 && o.used == 0 {
		delete(x.owners, o.name)
	}
}

// pin returns the slot and length of key's value and pins it (it is not
// evicted until unpin), making it the most recently used.
func (x *index) pin(key string) (int32, uint64, bool) {
	i, ok := x.byKey[key]
	if !ok || x.slots[i].state != slotPresent {
		return 0, 0, false
	}
	s := &x.slots[i]
	s.pins++
	x.unlink(&x.lru, i, x.gl)
	x.pushFront(&x.lru, i, x.gl)
	x.unlink(&s.owner.lru, i, x.ol)
	x.pushFront(&s.owner.lru, i, x.ol)
	return i, s.length, true
}

func (x *index) unpin(i int32) { x.slots[i].pins-- }

// allocResult is how allocate ended.
type allocResult uint8

const (
	allocOK allocResult = iota
	allocExists
	allocNoSpace
)

// allocate reserves a slot for key's value, charged to o: past o's share
// its own least recently used block is evicted, else, with no slot free,
// the pool's. A key present or being written is allocExists.
func (x *index) allocate(o *owner, key string) (int32, allocResult) {
	if _, ok := x.byKey[key]; ok {
		return 0, allocExists
	}
	if o.used >= x.share {
		if !x.evictFrom(&o.lru, x.ol) {
			return 0, allocNoSpace
		}
		x.st.EvictedShare++
	} else if len(x.free) == 0 {
		if !x.evictFrom(&x.lru, x.gl) {
			return 0, allocNoSpace
		}
		x.st.Evicted++
	}
	if len(x.free) == 0 {
		return 0, allocNoSpace
	}
	i := x.free[len(x.free)-1]
	x.free = x.free[:len(x.free)-1]
	x.slots[i] = slotMeta{key: key, state: slotWriting, owner: o, g: links{-1, -1}, o: links{-1, -1}}
	x.byKey[key] = i
	o.used++
	return i, allocOK
}

// evictFrom frees the least recently used slot of l that no reader pins.
func (x *index) evictFrom(l *list, get func(int32) *links) bool {
	for i := l.tail; i >= 0; i = get(i).prev {
		if x.slots[i].pins == 0 {
			x.release(i)
			return true
		}
	}
	return false
}

// commit ends a write: ok, the value of length bytes is present (the most
// recently used); else the slot is freed.
func (x *index) commit(i int32, ok bool, length uint64) {
	s := &x.slots[i]
	if !ok {
		x.release(i)
		return
	}
	s.state, s.length = slotPresent, length
	x.pushFront(&x.lru, i, x.gl)
	x.pushFront(&s.owner.lru, i, x.ol)
}

// release frees slot i, whatever its state but free.
func (x *index) release(i int32) {
	s := &x.slots[i]
	if s.state == slotPresent {
		x.unlink(&x.lru, i, x.gl)
		x.unlink(&s.owner.lru, i, x.ol)
		if x.onRemove != nil {
			x.onRemove(s.key)
		}
	}
	delete(x.byKey, s.key)
	o := s.owner
	o.used--
	*s = slotMeta{}
	x.free = append(x.free, i)
	x.forget(o)
}

// stats counts the slots by state.
func (x *index) stats() IndexStats {
	st := x.st
	st.Slots, st.Free, st.Present, st.Owners = len(x.slots), len(x.free), x.lru.n, len(x.owners)
	st.Writing = len(x.slots) - st.Free - st.Present
	return st
}

// check verifies the index's invariants (tests).
func (x *index) check() []string {
	var bad []string
	used := map[*owner]int{}
	present := 0
	for i := range x.slots {
		s := &x.slots[i]
		if s.state == slotFree {
			continue
		}
		used[s.owner]++
		if j, ok := x.byKey[s.key]; !ok || j != int32(i) {
			bad = append(bad, "slot not indexed by its key")
		}
		if s.state == slotPresent {
			present++
		}
		if s.pins < 0 {
			bad = append(bad, "negative pins")
		}
	}
	if present != x.lru.n || len(x.byKey)+len(x.free) != len(x.slots) {
		bad = append(bad, "counts disagree")
	}
	for _, o := range x.owners {
		if used[o] != o.used {
			bad = append(bad, "owner "+o.name+": charge differs from its slots")
		}
		if o.used > x.share {
			bad = append(bad, "owner "+o.name+": over its share")
		}
	}
	return bad
}
