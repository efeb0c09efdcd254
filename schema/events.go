package schema

// The records of KV events (docs/protocol.md, sections 5.11 to 5.13 and
// 6.6): an engine describes the blocks it stores (Describe: each block's
// parent digest and token ids, as an event consumer needs them to compute
// its own keys), and a scheduler reads the namespace's event log (Events)
// or a page of its described present blocks (EventSnapshot) to announce
// them in the engine's own event stream. Events carries a Changes record,
// EventSnapshot a Snapshot record; both are answered with an EventsReply.

// Limits of the event records.
const (
	// MaxDescribeBlocks bounds the blocks of all runs of one Describe.
	MaxDescribeBlocks = 4096
	// MaxDescribeTokens bounds the token ids of one block (a block's size
	// in tokens).
	MaxDescribeTokens = 4096
	// MaxDescribeExtra bounds the engine-defined bytes of one run.
	MaxDescribeExtra = 1024
	// MaxEventsPerReply bounds the entries of one EventsReply.
	MaxEventsPerReply = 4096
)

// DescribeRunHeaderSize is the size of a Describe run's header: u32 blocks,
// u16 tokens per block, u16 extra length, u8 flags, u8[7] zero.
//
//wire:struct DescribeRun "<IHHB7x" blocks tokens_per_block extra_len flags size=DescribeRunHeaderSize
const DescribeRunHeaderSize = 16

// DescribeFlagParent is a Describe run's (and an event entry's) flags bit
// 0: a parent digest follows the header.
const DescribeFlagParent uint8 = 1

// EventsReply flags.
const (
	EventsFlagResync uint32 = 1 // Events: the cursor cannot be continued, rebuild from EventSnapshot
	EventsFlagDone   uint32 = 2 // EventSnapshot: the scan reached the end of the pool, no more pages
)

// EventHeaderSize is the size of an event entry before its digest: u8 op,
// u8 flags, u16 tokens, u16 extra length, u16 zero.
//
//wire:struct EventHeader "<BBHH2x" op flags tokens extra_len size=EventHeaderSize
const EventHeaderSize = 8

// Event operations.
const (
	EventStored  uint8 = 1 // the block is present and described
	EventRemoved uint8 = 2 // a block that was announced left the pool
)

// DescribeRun describes a run of consecutive blocks of one prefix chain:
// block i's parent is block i-1, the first block's is Parent (nil: the
// first block of its chain).
type DescribeRun struct {
	Parent         []byte // width bytes, or nil
	Digests        []byte // count × width
	TokensPerBlock uint16
	Tokens         []byte // count × TokensPerBlock × 4: u32 token ids, little-endian
	Extra          []byte // engine-defined, the same for every block of the run
}

// Blocks is the number of blocks of the run (by its digests).
func (r *DescribeRun) Blocks(width int) int {
	if width <= 0 {
		return 0
	}
	return len(r.Digests) / width
}

// Describe gives the sidecar what KV events need of blocks the engine
// stores (docs/protocol.md, section 5.11).
//
//	0 u32 runs   4 u32 flags (0; checked)
//	8 runs, back to back, each:
//	  0 u32 blocks n   4 u16 tokens per block t   6 u16 extra length e
//	  8 u8 flags (bit 0: parent)   9 u8[7] zero
//	 16 parent (width bytes, with flag bit 0)   n × width digests
//	    n × t × u32 token ids   e extra bytes
//
//wire:struct Describe "<II" count(runs) _
type Describe struct {
	Runs []DescribeRun
}

// Append encodes m for digests of width bytes.
func (m *Describe) Append(dst []byte, width int) []byte {
	w := writer{dst}
	w.u32(uint32(len(m.Runs)))
	w.u32(0)
	for i := range m.Runs {
		r := &m.Runs[i]
		w.u32(uint32(r.Blocks(width)))
		w.u16(r.TokensPerBlock)
		w.u16(uint16(len(r.Extra)))
		var f uint8
		if r.Parent != nil {
			f = DescribeFlagParent
		}
		w.u8(f)
		w.zero(7)
		w.raw(r.Parent)
		w.raw(r.Digests)
		w.raw(r.Tokens)
		w.raw(r.Extra)
	}
	return w.b
}

// Decode parses m for digests of width bytes; its byte fields alias b.
func (m *Describe) Decode(b []byte, width int) error {
	r := reader{b: b, what: "Describe"}
	if width != 8 && width != 16 && width != 32 {
		r.fail("digest width %d", width)
	}
	n := r.u32()
	if f := r.u32(); r.err == nil && f != 0 {
		r.fail("flags %#x", f)
	}
	if r.err == nil && n > MaxDescribeBlocks {
		r.fail("%d runs, at most %d blocks per record", n, MaxDescribeBlocks)
	}
	m.Runs = m.Runs[:0]
	total := 0
	for i := uint32(0); i < n && r.err == nil; i++ {
		blocks := r.u32()
		t := r.u16()
		e := r.u16()
		f := r.u8()
		r.bytes(7)
		switch {
		case r.err != nil:
		case blocks == 0:
			r.fail("run %d has no blocks", i)
		case uint64(total)+uint64(blocks) > MaxDescribeBlocks:
			r.fail("more than %d blocks", MaxDescribeBlocks)
		case t == 0 || t > MaxDescribeTokens:
			r.fail("run %d: %d tokens per block, want 1..%d", i, t, MaxDescribeTokens)
		case e > MaxDescribeExtra:
			r.fail("run %d: %d extra bytes, at most %d", i, e, MaxDescribeExtra)
		case f&^DescribeFlagParent != 0:
			r.fail("run %d: flags %#x", i, f)
		}
		if r.err != nil {
			break
		}
		total += int(blocks)
		run := DescribeRun{TokensPerBlock: t}
		if f&DescribeFlagParent != 0 {
			run.Parent = r.bytes(width)
		}
		run.Digests = r.bytes(int(blocks) * width)
		run.Tokens = r.bytes(int(blocks) * int(t) * 4)
		if e > 0 {
			run.Extra = r.bytes(int(e))
		}
		m.Runs = append(m.Runs, run)
	}
	return r.done()
}

// Event is one entry of an EventsReply. Removed entries carry the digest
// alone.
type Event struct {
	Op     uint8
	Digest []byte // width bytes
	Parent []byte // width bytes, or nil: the first block of its chain
	Tokens []byte // u32 token ids, little-endian
	Extra  []byte
}

// TokenCount is the number of token ids of e.
func (e *Event) TokenCount() int { return len(e.Tokens) / 4 }

// Token returns token id i of e.
func (e *Event) Token(i int) uint32 { return le.Uint32(e.Tokens[4*i:]) }

// EventSize is the encoded size of an entry with that many token ids and
// extra bytes (and a parent digest, or not).
func EventSize(width, tokens, extra int, parent bool) int {
	n := EventHeaderSize + width + 4*tokens + extra
	if parent {
		n += width
	}
	return n
}

// AppendEvent appends one entry to an EventsReply's Entries buffer.
//
//	0 u8 op   1 u8 flags (bit 0: parent)   2 u16 tokens t   4 u16 extra length e
//	6 u16 zero   8 digest (width)   parent (width, with flag bit 0)
//	t × u32 token ids   e extra bytes
func AppendEvent(dst []byte, e *Event) []byte {
	var f uint8
	if e.Parent != nil {
		f = DescribeFlagParent
	}
	t, x := len(e.Tokens)/4, len(e.Extra)
	dst = append(dst, e.Op, f, byte(t), byte(t>>8), byte(x), byte(x>>8), 0, 0)
	dst = append(dst, e.Digest...)
	dst = append(dst, e.Parent...)
	dst = append(dst, e.Tokens[:4*t]...)
	return append(dst, e.Extra...)
}

// EventsReply answers Events (a read of the event log from a cursor) and
// EventSnapshot (a page of the described present blocks).
//
//	 0 u32 status   4 u32 flags (bit 0: resync; bit 1: done)
//	 8 u64 epoch   16 u64 seq (Events: the cursor to send next;
//	                           EventSnapshot: the log's head when read)
//	24 u64 next (EventSnapshot: the from of the next page; Events: 0)
//	32 u32 count   36 u8 digest width   37 u8[3] zero
//	40 count × entry (see AppendEvent)
//
//wire:struct EventsReply "<IIQQQIB3x" status ~flags epoch seq next count(entries) width size=EventsReplyHeaderSize
type EventsReply struct {
	Status  Status
	Resync  bool
	Done    bool
	Epoch   uint64
	Seq     uint64
	Next    uint64
	Width   uint8
	Count   int
	Entries []byte
}

// EventsReplyHeaderSize is the size of an EventsReply before its entries.
const EventsReplyHeaderSize = 40

// Append encodes m (Count must be the number of entries in Entries).
func (m *EventsReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(uint32(m.Status))
	var flags uint32
	if m.Resync {
		flags |= EventsFlagResync
	}
	if m.Done {
		flags |= EventsFlagDone
	}
	w.u32(flags)
	w.u64(m.Epoch)
	w.u64(m.Seq)
	w.u64(m.Next)
	w.u32(uint32(m.Count))
	w.u8(m.Width)
	w.zero(3)
	w.raw(m.Entries)
	return w.b
}

// Decode parses m and checks every entry; Entries aliases b.
func (m *EventsReply) Decode(b []byte) error {
	r := reader{b: b, what: "events reply"}
	m.Status = Status(r.u32())
	flags := r.u32()
	m.Resync = flags&EventsFlagResync != 0
	m.Done = flags&EventsFlagDone != 0
	m.Epoch = r.u64()
	m.Seq = r.u64()
	m.Next = r.u64()
	n := r.u32()
	m.Width = r.u8()
	r.bytes(3)
	if r.err == nil && m.Width != 8 && m.Width != 16 && m.Width != 32 {
		r.fail("digest width %d", m.Width)
	}
	if r.err == nil && n > MaxEventsPerReply {
		r.fail("%d entries, at most %d", n, MaxEventsPerReply)
	}
	start := r.off
	for i := uint32(0); i < n && r.err == nil; i++ {
		readEvent(&r, int(m.Width), nil)
	}
	if r.err == nil {
		m.Count, m.Entries = int(n), b[start:r.off:r.off]
	}
	return r.done()
}

// readEvent reads one entry into e (nil: checks only).
func readEvent(r *reader, width int, e *Event) {
	op := r.u8()
	f := r.u8()
	t := r.u16()
	x := r.u16()
	r.u16()
	switch {
	case r.err != nil:
		return
	case op != EventStored && op != EventRemoved:
		r.fail("event op %d", op)
	case f&^DescribeFlagParent != 0:
		r.fail("event flags %#x", f)
	case t > MaxDescribeTokens:
		r.fail("event with %d tokens, at most %d", t, MaxDescribeTokens)
	case x > MaxDescribeExtra:
		r.fail("event with %d extra bytes, at most %d", x, MaxDescribeExtra)
	case op == EventRemoved && (f != 0 || t != 0 || x != 0):
		r.fail("a removed event carries its digest alone")
	}
	d := r.bytes(width)
	var p []byte
	if f&DescribeFlagParent != 0 {
		p = r.bytes(width)
	}
	var tk, ex []byte
	if t > 0 {
		tk = r.bytes(4 * int(t))
	}
	if x > 0 {
		ex = r.bytes(int(x))
	}
	if e != nil && r.err == nil {
		*e = Event{Op: op, Digest: d, Parent: p, Tokens: tk, Extra: ex}
	}
}

// Events calls fn with each entry of m, in order (the byte fields alias
// Entries), until fn returns false. m must have been decoded (or built with
// AppendEvent).
func (m *EventsReply) Events(fn func(e *Event) bool) {
	r := reader{b: m.Entries, what: "events reply"}
	var e Event
	for i := 0; i < m.Count && r.err == nil; i++ {
		readEvent(&r, int(m.Width), &e)
		if r.err != nil || !fn(&e) {
			return
		}
	}
}
