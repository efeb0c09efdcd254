// Package wire is the node tier's wire format (docs/protocol.md, section
// 17): the fixed-layout messages a sidecar and `ringside node` exchange over
// a SOCK_SEQPACKET Unix socket, one message a datagram. Block bytes never
// cross the socket: writes move through the connection's window, a memfd
// the node passes in the Hello reply; fetches land straight in the pod's
// pool, whose descriptor the sidecar passes with its Hello.
//
// Every decoder checks the exact length, the bounds of every count and that
// every reserved byte is zero; it returns an error wrapping ErrMalformed
// otherwise (ErrVersion for a header of another version). A value that
// decodes encodes back to the same bytes.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Constants of the wire.
const (
	Magic      = 0x444e5352 // "RSND", little-endian
	Version    = 2
	HeaderSize = 16
	// MaxMessage bounds a datagram, either way.
	MaxMessage = 65536
	// MaxItems bounds the items of a Fetch or a Put (and of their reply);
	// MaxLookup the digests of a Lookup.
	MaxItems  = 64
	MaxLookup = 1024
	// MaxLookupKeys bounds a Lookup's digests times its namespace's world
	// size: the values one Lookup may make the node look for.
	MaxLookupKeys = 16384
	// MaxPod bounds a pod name.
	MaxPod = 63
	// DigestSize is an item's digest field: the digest, zero padded.
	DigestSize = 32
)

// Type is a message's type; a reply's is its request's with ReplyBit.
type Type uint16

// Message types.
const (
	TypeHello    Type = 0x01
	TypeRegister Type = 0x02
	TypeLookup   Type = 0x03
	// 0x04 was version 1's Get (through the window), replaced by Fetch.
	TypePut  Type = 0x05
	ReplyBit Type = 0x80
)

// Status is a reply's (or an item's) outcome.
type Status uint16

// Statuses.
const (
	OK            Status = 0
	NotFound      Status = 1  // no such block (Fetch), or nothing found
	Exists        Status = 2  // Put: the node holds the block already (nothing copied)
	Malformed     Status = 3  // the request failed its decoder or a bound
	NotRegistered Status = 4  // the namespace was not registered on this connection
	NoSpace       Status = 5  // Put: no slot could be freed (every candidate in use)
	Rejected      Status = 6  // Put: the value in the window failed its header or checksum
	Limit         Status = 7  // too many namespaces, or pods attached
	BadVersion    Status = 8  // Hello of a version the node does not speak
	Denied        Status = 9  // the peer's uid may not attach
	Mismatch      Status = 10 // Register: the fingerprint is registered with another layout, width or world
)

var statusNames = [...]string{"ok", "not_found", "exists", "malformed", "not_registered", "no_space", "rejected", "limit", "bad_version", "denied", "mismatch", "gone", "not_resident", "fault"}

func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", uint16(s))
}

// Errors of the decoders.
var (
	ErrMalformed = errors.New("node wire: malformed message")
	ErrVersion   = errors.New("node wire: unsupported version")
)

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

var le = binary.LittleEndian

// Header starts every message:
//
//	off size field
//	  0    4 magic "RSND"
//	  4    2 version (2)
//	  6    2 type
//	  8    8 id (a request's, echoed by its reply)
type Header struct {
	Type Type
	ID   uint64
}

// Append appends the header.
func (h Header) Append(b []byte) []byte {
	b = le.AppendUint32(b, Magic)
	b = le.AppendUint16(b, Version)
	b = le.AppendUint16(b, uint16(h.Type))
	return le.AppendUint64(b, h.ID)
}

// DecodeHeader decodes a message's header and returns its body.
func DecodeHeader(b []byte) (Header, []byte, error) {
	if len(b) < HeaderSize || len(b) > MaxMessage {
		return Header{}, nil, malformed("message of %d bytes", len(b))
	}
	if le.Uint32(b) != Magic {
		return Header{}, nil, malformed("bad magic %#x", le.Uint32(b))
	}
	if v := le.Uint16(b[4:]); v != Version {
		return Header{}, nil, fmt.Errorf("%w: %d (want %d)", ErrVersion, v, Version)
	}
	return Header{Type: Type(le.Uint16(b[6:])), ID: le.Uint64(b[8:])}, b[HeaderSize:], nil
}

func zero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// Hello (sidecar → node) names the pod whose share the connection's writes
// are charged to, and may carry one descriptor (SCM_RIGHTS): the pod's
// pool, which Fetch copies into:
//
//	off size field
//	  0    2 pod name length (1..63)
//	  2    6 zero
//	  8    n pod name ([A-Za-z0-9._-])
type Hello struct {
	Pod string
}

// ValidPod reports whether s may name a pod.
func ValidPod(s string) bool {
	if len(s) == 0 || len(s) > MaxPod {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// Append appends the body.
func (m Hello) Append(b []byte) []byte {
	b = le.AppendUint16(b, uint16(len(m.Pod)))
	b = append(b, 0, 0, 0, 0, 0, 0)
	return append(b, m.Pod...)
}

// DecodeHello decodes a Hello body.
func DecodeHello(b []byte) (Hello, error) {
	if len(b) < 8 {
		return Hello{}, malformed("hello of %d bytes", len(b))
	}
	n := int(le.Uint16(b))
	if !zero(b[2:8]) || len(b) != 8+n {
		return Hello{}, malformed("hello: reserved bytes, or a name of %d bytes in %d", n, len(b)-8)
	}
	p := string(b[8:])
	if !ValidPod(p) {
		return Hello{}, malformed("hello: pod name %q", p)
	}
	return Hello{Pod: p}, nil
}

// HelloReply (node → sidecar) carries the window's descriptor (SCM_RIGHTS)
// when Status is OK, and the node's bounds:
//
//	off size field
//	  0    2 status
//	  2    2 zero
//	  4    4 window slots
//	  8    8 slot stride (bytes a window or pool slot takes)
//	 16    8 largest payload
//	 24    8 pool bytes
//	 32    8 the pod's share, bytes
//	 40    8 epoch (random, new with each node process)
//	 48    4 most namespaces a connection may register
//	 52    4 zero
type HelloReply struct {
	Status        Status
	WindowSlots   uint32
	SlotStride    uint64
	MaxPayload    uint64
	PoolBytes     uint64
	ShareBytes    uint64
	Epoch         uint64
	MaxNamespaces uint32
}

// HelloReplySize is a HelloReply body's size.
const HelloReplySize = 56

// Append appends the body.
func (m HelloReply) Append(b []byte) []byte {
	b = le.AppendUint16(b, uint16(m.Status))
	b = le.AppendUint16(b, 0)
	b = le.AppendUint32(b, m.WindowSlots)
	for _, v := range []uint64{m.SlotStride, m.MaxPayload, m.PoolBytes, m.ShareBytes, m.Epoch} {
		b = le.AppendUint64(b, v)
	}
	b = le.AppendUint32(b, m.MaxNamespaces)
	return le.AppendUint32(b, 0)
}

// DecodeHelloReply decodes a HelloReply body.
func DecodeHelloReply(b []byte) (HelloReply, error) {
	if len(b) != HelloReplySize || !zero(b[2:4]) || !zero(b[52:56]) {
		return HelloReply{}, malformed("hello reply of %d bytes, or reserved bytes set", len(b))
	}
	m := HelloReply{Status: Status(le.Uint16(b)), WindowSlots: le.Uint32(b[4:]), SlotStride: le.Uint64(b[8:]),
		MaxPayload: le.Uint64(b[16:]), PoolBytes: le.Uint64(b[24:]), ShareBytes: le.Uint64(b[32:]), Epoch: le.Uint64(b[40:]),
		MaxNamespaces: le.Uint32(b[48:])}
	if m.Status == OK && (m.WindowSlots == 0 || m.MaxPayload == 0 || m.SlotStride < m.MaxPayload) {
		return HelloReply{}, malformed("hello reply: %d window slots of %d bytes for payloads of %d", m.WindowSlots, m.SlotStride, m.MaxPayload)
	}
	return m, nil
}

// NS names a namespace as the shared tier does (machine.L2Namespace):
//
//	off size field
//	  0   16 namespace fingerprint
//	 16    8 layout fingerprint
//	 24    1 digest width (8, 16 or 32)
//	 25    1 zero
//	 26    2 world size (1..1024)
//	 28    4 zero
type NS struct {
	FP     [16]byte
	Layout uint64
	Width  uint8
	World  uint16
}

// NSSize is an NS's size: the Register body.
const NSSize = 32

// MaxWorld bounds a namespace's world size.
const MaxWorld = 1024

// Append appends the namespace.
func (n NS) Append(b []byte) []byte {
	b = append(b, n.FP[:]...)
	b = le.AppendUint64(b, n.Layout)
	b = append(b, n.Width, 0)
	b = le.AppendUint16(b, n.World)
	return le.AppendUint32(b, 0)
}

func validWidth(w int) bool { return w == 8 || w == 16 || w == 32 }

// DecodeNS decodes a Register body.
func DecodeNS(b []byte) (NS, error) {
	if len(b) != NSSize || b[25] != 0 || !zero(b[28:32]) {
		return NS{}, malformed("namespace of %d bytes, or reserved bytes set", len(b))
	}
	n := NS{FP: [16]byte(b[:16]), Layout: le.Uint64(b[16:]), Width: b[24], World: le.Uint16(b[26:])}
	if !validWidth(int(n.Width)) || n.World == 0 || n.World > MaxWorld {
		return NS{}, malformed("namespace: width %d, world %d", n.Width, n.World)
	}
	return n, nil
}

// StatusReply answers Register and Lookup (Value: the leading blocks found,
// every rank of each):
//
//	off size field
//	  0    2 status
//	  2    2 zero
//	  4    4 value
type StatusReply struct {
	Status Status
	Value  uint32
}

// Append appends the body.
func (m StatusReply) Append(b []byte) []byte {
	b = le.AppendUint16(b, uint16(m.Status))
	b = le.AppendUint16(b, 0)
	return le.AppendUint32(b, m.Value)
}

// DecodeStatusReply decodes a StatusReply body.
func DecodeStatusReply(b []byte) (StatusReply, error) {
	if len(b) != 8 || !zero(b[2:4]) {
		return StatusReply{}, malformed("status reply of %d bytes, or reserved bytes set", len(b))
	}
	return StatusReply{Status: Status(le.Uint16(b)), Value: le.Uint32(b[4:])}, nil
}

// Lookup asks how many leading blocks of Digests the node holds, every
// rank of each:
//
//	off size field
//	  0   16 namespace fingerprint
//	 16    4 count (1..1024)
//	 20    1 digest width
//	 21    3 zero
//	 24  c·w the digests
type Lookup struct {
	FP      [16]byte
	Width   int
	Digests []byte // count × Width
}

// Append appends the body.
func (m Lookup) Append(b []byte) []byte {
	b = append(b, m.FP[:]...)
	b = le.AppendUint32(b, uint32(len(m.Digests)/max(m.Width, 1)))
	b = append(b, byte(m.Width), 0, 0, 0)
	return append(b, m.Digests...)
}

// DecodeLookup decodes a Lookup body; Digests is a slice of b.
func DecodeLookup(b []byte) (Lookup, error) {
	if len(b) < 24 || !zero(b[21:24]) {
		return Lookup{}, malformed("lookup of %d bytes, or reserved bytes set", len(b))
	}
	n, w := int(le.Uint32(b[16:])), int(b[20])
	if !validWidth(w) || n < 1 || n > MaxLookup || len(b) != 24+n*w {
		return Lookup{}, malformed("lookup: %d digests of width %d in %d bytes", n, w, len(b)-24)
	}
	return Lookup{FP: [16]byte(b[:16]), Width: w, Digests: b[24:]}, nil
}

// Item is one block rank of a Put:
//
//	off size field
//	  0   32 digest (zero padded)
//	 32    2 rank
//	 34    2 zero
//	 36    4 window slot
//	 40    8 value length (header and payload in the window slot)
type Item struct {
	Digest [DigestSize]byte
	Rank   uint16
	Slot   uint32
	Length uint64
}

// Items is a Put: a namespace and its items.
//
//	off size field
//	  0   16 namespace fingerprint
//	 16    4 count (1..64)
//	 20    4 zero
//	 24 c·48 the items
type Items struct {
	FP    [16]byte
	Items []Item
}

// ItemSize is the size of one item of a Put.
const ItemSize = 48

// Append appends the body.
func (m Items) Append(b []byte) []byte {
	b = append(b, m.FP[:]...)
	b = le.AppendUint32(b, uint32(len(m.Items)))
	b = le.AppendUint32(b, 0)
	for _, it := range m.Items {
		b = append(b, it.Digest[:]...)
		b = le.AppendUint16(b, it.Rank)
		b = le.AppendUint16(b, 0)
		b = le.AppendUint32(b, it.Slot)
		b = le.AppendUint64(b, it.Length)
	}
	return b
}

// DecodeItems decodes a Put's body.
func DecodeItems(b []byte) (Items, error) {
	if len(b) < 24 || !zero(b[20:24]) {
		return Items{}, malformed("items of %d bytes, or reserved bytes set", len(b))
	}
	n := int(le.Uint32(b[16:]))
	if n < 1 || n > MaxItems || len(b) != 24+n*ItemSize {
		return Items{}, malformed("%d items in %d bytes", n, len(b)-24)
	}
	m := Items{FP: [16]byte(b[:16]), Items: make([]Item, n)}
	for i := range m.Items {
		p := b[24+i*ItemSize:]
		if !zero(p[34:36]) {
			return Items{}, malformed("item %d: reserved bytes set", i)
		}
		m.Items[i] = Item{Digest: [DigestSize]byte(p[:32]), Rank: le.Uint16(p[32:]), Slot: le.Uint32(p[36:]), Length: le.Uint64(p[40:])}
	}
	return m, nil
}

// ItemReply is how one item ended:
//
//	off size field
//	  0    2 status
//	  2    6 zero
//	  8    8 value length (Put: the bytes taken)
type ItemReply struct {
	Status Status
	Length uint64
}

// ItemsReply answers a Put or a Describe, one ItemReply an item, in order:
//
//	off size field
//	  0    2 status (of the whole request)
//	  2    2 zero
//	  4    4 count (0 when the status is not OK; else the request's)
//	  8  c·16 the items
type ItemsReply struct {
	Status Status
	Items  []ItemReply
}

// Append appends the body.
func (m ItemsReply) Append(b []byte) []byte {
	b = le.AppendUint16(b, uint16(m.Status))
	b = le.AppendUint16(b, 0)
	b = le.AppendUint32(b, uint32(len(m.Items)))
	for _, it := range m.Items {
		b = le.AppendUint16(b, uint16(it.Status))
		b = append(b, 0, 0, 0, 0, 0, 0)
		b = le.AppendUint64(b, it.Length)
	}
	return b
}

// DecodeItemsReply decodes an ItemsReply body.
func DecodeItemsReply(b []byte) (ItemsReply, error) {
	if len(b) < 8 || !zero(b[2:4]) {
		return ItemsReply{}, malformed("items reply of %d bytes, or reserved bytes set", len(b))
	}
	n := int(le.Uint32(b[4:]))
	if n > MaxItems || len(b) != 8+16*n {
		return ItemsReply{}, malformed("items reply: %d items in %d bytes", n, len(b)-8)
	}
	m := ItemsReply{Status: Status(le.Uint16(b))}
	for i := 0; i < n; i++ {
		p := b[8+16*i:]
		if !zero(p[2:8]) {
			return ItemsReply{}, malformed("item reply %d: reserved bytes set", i)
		}
		m.Items = append(m.Items, ItemReply{Status: Status(le.Uint16(p)), Length: le.Uint64(p[8:])})
	}
	return m, nil
}

// Message builds a whole message: the header and a body.
func Message(t Type, id uint64, body func([]byte) []byte) []byte {
	b := Header{Type: t, ID: id}.Append(make([]byte, 0, 256))
	if body != nil {
		b = body(b)
	}
	return b
}

// Block descriptions and the node's event log (added within version 1):
// what a sidecar needs to announce the node tier's blocks in its engine's
// KV events (docs/kv-events.md). A Describe attaches descriptions to blocks
// the node holds; an Events request reads a namespace's event log from a
// cursor the sidecar keeps.
const (
	TypeDescribe Type = 0x06
	TypeEvents   Type = 0x07
	// Gone (Events): the cursor is older than the log keeps; the reply's
	// entries start at the log's beginning and rebuild the whole set.
	Gone Status = 11
)

// Bounds of a description.
const (
	// MaxDescTokens bounds a description's token ids, MaxDescExtra its
	// engine-defined bytes.
	MaxDescTokens = 4096
	MaxDescExtra  = 1024
	// MaxEvents bounds the entries of one Events reply.
	MaxEvents = 1024
	// EntryHead is an entry's fixed part.
	EntryHead = 40
)

// Event-log entry kinds (the op of an Entry).
const (
	OpStored  uint8 = 1
	OpRemoved uint8 = 2
)

// Entry is one block's description (a Describe's, or a stored entry of an
// Events reply) or a removal:
//
//	off size field
//	  0    1 op (1 stored / described, 2 removed)
//	  1    1 flags (bit 0: a parent; stored only)
//	  2    2 token ids (0..4096; removed: 0)
//	  4    2 extra bytes (0..1024; removed: 0)
//	  6    2 zero
//	  8   32 digest (zero padded past the namespace's width)
//	 40   32 parent digest (stored only; zero padded; zero without a parent)
//	 72  4·t token ids (u32 each; stored only)
//	  …    e extra bytes (stored only)
type Entry struct {
	Op        uint8
	HasParent bool
	Digest    [DigestSize]byte
	Parent    [DigestSize]byte
	Tokens    []uint32
	Extra     []byte
}

// Size is the entry's encoded size.
func (e *Entry) Size() int {
	if e.Op != OpStored {
		return EntryHead
	}
	return EntryHead + DigestSize + 4*len(e.Tokens) + len(e.Extra)
}

// Append appends the entry.
func (e *Entry) Append(b []byte) []byte {
	var fl uint8
	if e.HasParent {
		fl = 1
	}
	b = append(b, e.Op, fl)
	b = le.AppendUint16(b, uint16(len(e.Tokens)))
	b = le.AppendUint16(b, uint16(len(e.Extra)))
	b = append(b, 0, 0)
	b = append(b, e.Digest[:]...)
	if e.Op != OpStored {
		return b
	}
	b = append(b, e.Parent[:]...)
	for _, t := range e.Tokens {
		b = le.AppendUint32(b, t)
	}
	return append(b, e.Extra...)
}

// decodeEntry decodes one entry at the start of b and returns the rest.
func decodeEntry(b []byte) (Entry, []byte, error) {
	if len(b) < EntryHead || !zero(b[6:8]) {
		return Entry{}, nil, malformed("entry of %d bytes, or reserved bytes set", len(b))
	}
	e := Entry{Op: b[0], HasParent: b[1] == 1, Digest: [DigestSize]byte(b[8:40])}
	t, x := int(le.Uint16(b[2:])), int(le.Uint16(b[4:]))
	switch {
	case e.Op == OpRemoved && b[1] == 0 && t == 0 && x == 0:
		return e, b[EntryHead:], nil
	case e.Op != OpStored || b[1] > 1 || t > MaxDescTokens || x > MaxDescExtra:
		return Entry{}, nil, malformed("entry: op %d, flags %d, %d tokens, %d extra bytes", e.Op, b[1], t, x)
	}
	n := EntryHead + DigestSize + 4*t + x
	if len(b) < n {
		return Entry{}, nil, malformed("entry of %d bytes in %d", n, len(b))
	}
	e.Parent = [DigestSize]byte(b[40:72])
	if !e.HasParent && !zero(e.Parent[:]) {
		return Entry{}, nil, malformed("entry: a parent digest without its flag")
	}
	e.Tokens = make([]uint32, t)
	for i := range e.Tokens {
		e.Tokens[i] = le.Uint32(b[72+4*i:])
	}
	e.Extra = append([]byte(nil), b[72+4*t:n]...)
	return e, b[n:], nil
}

// Describe attaches descriptions to blocks of a namespace (every entry's
// op is 1):
//
//	off size field
//	  0   16 namespace fingerprint
//	 16    4 count (1..64)
//	 20    4 zero
//	 24    … the entries
//
// Its reply is an ItemsReply, one item an entry (Length 0).
type Describe struct {
	FP      [16]byte
	Entries []Entry
}

// Append appends the body.
func (m Describe) Append(b []byte) []byte {
	b = append(b, m.FP[:]...)
	b = le.AppendUint32(b, uint32(len(m.Entries)))
	b = le.AppendUint32(b, 0)
	for i := range m.Entries {
		b = m.Entries[i].Append(b)
	}
	return b
}

// DecodeDescribe decodes a Describe body.
func DecodeDescribe(b []byte) (Describe, error) {
	if len(b) < 24 || !zero(b[20:24]) {
		return Describe{}, malformed("describe of %d bytes, or reserved bytes set", len(b))
	}
	n := int(le.Uint32(b[16:]))
	if n < 1 || n > MaxItems {
		return Describe{}, malformed("describe: %d entries", n)
	}
	m := Describe{FP: [16]byte(b[:16]), Entries: make([]Entry, 0, n)}
	rest := b[24:]
	for i := 0; i < n; i++ {
		e, r, err := decodeEntry(rest)
		if err != nil {
			return Describe{}, err
		}
		if e.Op != OpStored {
			return Describe{}, malformed("describe: entry %d is not a description", i)
		}
		m.Entries, rest = append(m.Entries, e), r
	}
	if len(rest) != 0 {
		return Describe{}, malformed("describe: %d bytes past the entries", len(rest))
	}
	return m, nil
}

// Events reads a namespace's event log from a cursor:
//
//	off size field
//	  0   16 namespace fingerprint
//	 16    8 cursor (the log's sequence number to read from; 0: the beginning)
//	 24    4 most entries wanted (1..1024)
//	 28    4 zero
type Events struct {
	FP     [16]byte
	Cursor uint64
	Max    uint32
}

// EventsSize is an Events body's size.
const EventsSize = 32

// Append appends the body.
func (m Events) Append(b []byte) []byte {
	b = append(b, m.FP[:]...)
	b = le.AppendUint64(b, m.Cursor)
	b = le.AppendUint32(b, m.Max)
	return le.AppendUint32(b, 0)
}

// DecodeEvents decodes an Events body.
func DecodeEvents(b []byte) (Events, error) {
	if len(b) != EventsSize || !zero(b[28:32]) {
		return Events{}, malformed("events of %d bytes, or reserved bytes set", len(b))
	}
	m := Events{FP: [16]byte(b[:16]), Cursor: le.Uint64(b[16:]), Max: le.Uint32(b[24:])}
	if m.Max < 1 || m.Max > MaxEvents {
		return Events{}, malformed("events: %d entries wanted", m.Max)
	}
	return m, nil
}

// EventsReply answers Events:
//
//	off size field
//	  0    2 status (0; 11: the cursor was older than the log keeps, and
//	         the entries start at its beginning; 4: not registered)
//	  2    2 zero
//	  4    4 count
//	  8    8 next cursor (the sequence number to read from next)
//	 16    … the entries, in the log's order
//
// A stored entry carries the block's description as it is when the node
// reads it; a stored entry of a block gone since is left out (its removal
// follows).
type EventsReply struct {
	Status  Status
	Next    uint64
	Entries []Entry
}

// Append appends the body.
func (m EventsReply) Append(b []byte) []byte {
	b = le.AppendUint16(b, uint16(m.Status))
	b = le.AppendUint16(b, 0)
	b = le.AppendUint32(b, uint32(len(m.Entries)))
	b = le.AppendUint64(b, m.Next)
	for i := range m.Entries {
		b = m.Entries[i].Append(b)
	}
	return b
}

// DecodeEventsReply decodes an EventsReply body.
func DecodeEventsReply(b []byte) (EventsReply, error) {
	if len(b) < 16 || !zero(b[2:4]) {
		return EventsReply{}, malformed("events reply of %d bytes, or reserved bytes set", len(b))
	}
	n := int(le.Uint32(b[4:]))
	if n > MaxEvents {
		return EventsReply{}, malformed("events reply: %d entries", n)
	}
	m := EventsReply{Status: Status(le.Uint16(b)), Next: le.Uint64(b[8:])}
	rest := b[16:]
	for i := 0; i < n; i++ {
		e, r, err := decodeEntry(rest)
		if err != nil {
			return EventsReply{}, err
		}
		m.Entries, rest = append(m.Entries, e), r
	}
	if len(rest) != 0 {
		return EventsReply{}, malformed("events reply: %d bytes past the entries", len(rest))
	}
	return m, nil
}

// Fetches into the pod's pool (version 2): a sidecar that passed its pool's
// descriptor with its Hello asks the node to copy values straight into its
// pool, one copy, instead of through the window (TypeGet). The node copies
// a value's payload to the item's pool offset and checksums what it wrote
// in the same pass; the reply carries the value's header and that
// checksum, which the sidecar checks against the header before it trusts
// the bytes.
const (
	TypeFetch Type = 0x08
	// NotResident (Fetch): the item's pool range is not all in memory (the
	// sidecar populates its pool's pages before it asks; the node never
	// allocates a page of a pod's pool).
	NotResident Status = 12
	// Fault (Fetch): the pool faulted under the node's copy (the pod's
	// pool was truncated, or its mount is full): nothing to trust there.
	Fault Status = 13
	// FetchItemSize is a Fetch item's size, FetchReplyItemSize a reply
	// item's; ValueHeaderSize the value header a reply item carries.
	FetchItemSize      = 56
	ValueHeaderSize    = 96
	FetchReplyItemSize = 16 + ValueHeaderSize
)

// FetchItem is one value of a Fetch:
//
//	off size field
//	  0   32 digest (zero padded)
//	 32    2 rank
//	 34    6 zero
//	 40    8 pool offset (where the payload goes in the pod's pool)
//	 48    8 largest payload the sidecar takes there (1..)
type FetchItem struct {
	Digest [DigestSize]byte
	Rank   uint16
	Offset uint64
	Max    uint64
}

// Fetch asks for values to be copied into the pod's pool:
//
//	off size field
//	  0   16 namespace fingerprint
//	 16    4 count (1..64)
//	 20    4 zero
//	 24 c·56 the items
type Fetch struct {
	FP    [16]byte
	Items []FetchItem
}

// Append appends the body.
func (m Fetch) Append(b []byte) []byte {
	b = append(b, m.FP[:]...)
	b = le.AppendUint32(b, uint32(len(m.Items)))
	b = le.AppendUint32(b, 0)
	for _, it := range m.Items {
		b = append(b, it.Digest[:]...)
		b = le.AppendUint16(b, it.Rank)
		b = append(b, 0, 0, 0, 0, 0, 0)
		b = le.AppendUint64(b, it.Offset)
		b = le.AppendUint64(b, it.Max)
	}
	return b
}

// DecodeFetch decodes a Fetch body.
func DecodeFetch(b []byte) (Fetch, error) {
	if len(b) < 24 || !zero(b[20:24]) {
		return Fetch{}, malformed("fetch of %d bytes, or reserved bytes set", len(b))
	}
	n := int(le.Uint32(b[16:]))
	if n < 1 || n > MaxItems || len(b) != 24+n*FetchItemSize {
		return Fetch{}, malformed("%d fetch items in %d bytes", n, len(b)-24)
	}
	m := Fetch{FP: [16]byte(b[:16]), Items: make([]FetchItem, n)}
	for i := range m.Items {
		p := b[24+i*FetchItemSize:]
		if !zero(p[34:40]) {
			return Fetch{}, malformed("fetch item %d: reserved bytes set", i)
		}
		it := FetchItem{Digest: [DigestSize]byte(p[:32]), Rank: le.Uint16(p[32:]), Offset: le.Uint64(p[40:]), Max: le.Uint64(p[48:])}
		if it.Max == 0 {
			return Fetch{}, malformed("fetch item %d: a largest payload of 0", i)
		}
		m.Items[i] = it
	}
	return m, nil
}

// FetchReplyItem is how one item of a Fetch ended:
//
//	off size field
//	  0    2 status
//	  2    2 zero
//	  4    4 CRC32C of the payload as written into the pod's pool
//	  8    8 payload length (the bytes written at the item's offset)
//	 16   96 the value's header (OK only; zero otherwise)
type FetchReplyItem struct {
	Status Status
	CRC    uint32
	Length uint64
	Header [ValueHeaderSize]byte
}

// FetchReply answers a Fetch, one item an item, in order:
//
//	off size field
//	  0    2 status (of the whole request)
//	  2    2 zero
//	  4    4 count (0 when the status is not OK; else the request's)
//	  8 c·112 the items
type FetchReply struct {
	Status Status
	Items  []FetchReplyItem
}

// Append appends the body.
func (m FetchReply) Append(b []byte) []byte {
	b = le.AppendUint16(b, uint16(m.Status))
	b = le.AppendUint16(b, 0)
	b = le.AppendUint32(b, uint32(len(m.Items)))
	for _, it := range m.Items {
		b = le.AppendUint16(b, uint16(it.Status))
		b = le.AppendUint16(b, 0)
		b = le.AppendUint32(b, it.CRC)
		b = le.AppendUint64(b, it.Length)
		b = append(b, it.Header[:]...)
	}
	return b
}

// DecodeFetchReply decodes a FetchReply body.
func DecodeFetchReply(b []byte) (FetchReply, error) {
	if len(b) < 8 || !zero(b[2:4]) {
		return FetchReply{}, malformed("fetch reply of %d bytes, or reserved bytes set", len(b))
	}
	n := int(le.Uint32(b[4:]))
	if n > MaxItems || len(b) != 8+FetchReplyItemSize*n {
		return FetchReply{}, malformed("fetch reply: %d items in %d bytes", n, len(b)-8)
	}
	m := FetchReply{Status: Status(le.Uint16(b))}
	for i := 0; i < n; i++ {
		p := b[8+FetchReplyItemSize*i:]
		if !zero(p[2:4]) {
			return FetchReply{}, malformed("fetch reply item %d: reserved bytes set", i)
		}
		it := FetchReplyItem{Status: Status(le.Uint16(p)), CRC: le.Uint32(p[4:]), Length: le.Uint64(p[8:]), Header: [ValueHeaderSize]byte(p[16:FetchReplyItemSize])}
		if it.Status != OK && (it.CRC != 0 || it.Length != 0 || !zero(it.Header[:])) {
			return FetchReply{}, malformed("fetch reply item %d: %v with a value", i, it.Status)
		}
		m.Items = append(m.Items, it)
	}
	return m, nil
}
