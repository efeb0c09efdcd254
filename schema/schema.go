// Package schema is ringside's wire protocol: the attach handshake on the
// Unix socket and the fixed-layout records that travel through a session's
// rings. The sidecar and the Go client use this package; the Python client
// follows docs/protocol.md, and golden vectors in testdata/golden/schema keep
// the two byte-identical.
//
// Every integer is little-endian at a fixed offset. Every decoder checks
// lengths and ranges before use and returns an error wrapping ErrMalformed;
// none panics on any input (fuzz tests hold it to that).
//
// A request's ring record carries its type and a client-chosen correlation
// number in the ring's record header (ring.RecordHeader.Seq); the reply
// carries the request type with ReplyBit set and the same correlation number.
// Every reply payload starts with a status code (u32).
package schema

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Version is the protocol version spoken in the attach handshake. Version
// 2 hands the session's rings to the client as file descriptors with the
// AttachReply (SCM_RIGHTS) instead of paths it opens: no other process can
// open a session's rings (docs/protocol.md, section 4.3). Version 3 changes
// RegisterRegion's CUDA IPC extra bytes only (CUDAExtra: one handle per
// device allocation, and an event for stores to wait on).
const Version uint16 = 3

// MinVersion is the oldest protocol version the sidecar still attaches:
// version 2 differs from 3 only in the CUDA IPC extra, and its CUDA regions
// are refused (their one allocation cannot hold a KV cache that vLLM
// allocates one tensor per layer).
const MinVersion uint16 = 2

// Record types. Requests flow engine -> sidecar on the submission ring,
// replies sidecar -> engine on the completion ring with ReplyBit set.
const (
	TypePutHashes      uint16 = 0x01 // register (or extend) a hash batch
	TypeDropHashes     uint16 = 0x02 // forget a hash batch
	TypeLookup         uint16 = 0x03 // count leading present blocks of a view
	TypeAcquire        uint16 = 0x04 // pin leading present blocks under a lease, admit against the budget
	TypePoll           uint16 = 0x05 // state of a lease
	TypeRelease        uint16 = 0x06 // end a lease
	TypeRegisterRegion uint16 = 0x07 // register engine memory
	TypeLoad           uint16 = 0x08 // copy a lease's blocks into engine pages
	TypeStore          uint16 = 0x09 // copy engine pages into the pool
	TypeChanges        uint16 = 0x0A // read the namespace's change log since a cursor
	TypeDetach         uint16 = 0x0B // end the session cleanly
	TypePing           uint16 = 0x0C // liveness and round-trip check
	TypeSnapshot       uint16 = 0x0D // read a page of the namespace's present blocks
	TypeDescribe       uint16 = 0x0E // describe blocks for KV events: parent digests, token ids
	TypeEvents         uint16 = 0x0F // read the namespace's event log since a cursor
	TypeEventSnapshot  uint16 = 0x10 // read a page of the namespace's described present blocks
	TypeRetain         uint16 = 0x11 // keep a view's blocks for a while at a priority, or end that (added within version 3)

	// ReservedType is never a request: its reply type would be the ring's
	// padding type 0xFFFF. Like any unknown type it is answered with
	// status 2, in a Reply whose record type is ReplyBit alone
	// (ReservedReplyType). (Not named Type*: it is no record type.)
	ReservedType uint16 = 0x7FFF

	ReplyBit uint16 = 0x8000
	// ReservedReplyType is the record type of the reply to a request of type
	// ReservedType.
	ReservedReplyType uint16 = ReplyBit
)

// ReplyType is the record type of the reply to a request of type t.
func ReplyType(t uint16) uint16 {
	if t == ReservedType {
		return ReservedReplyType
	}
	return t | ReplyBit
}

// TypeName names a record type for logs and errors.
func TypeName(t uint16) string {
	if t == ReservedType|ReplyBit { // the ring's padding type, never a reply
		return fmt.Sprintf("type(%#x)", t)
	}
	n, ok := typeNames[t&^ReplyBit]
	if !ok {
		return fmt.Sprintf("type(%#x)", t)
	}
	if t&ReplyBit != 0 {
		return n + "Reply"
	}
	return n
}

var typeNames = map[uint16]string{
	TypePutHashes: "PutHashes", TypeDropHashes: "DropHashes", TypeLookup: "Lookup",
	TypeAcquire: "Acquire", TypePoll: "Poll", TypeRelease: "Release",
	TypeRegisterRegion: "RegisterRegion", TypeLoad: "Load", TypeStore: "Store",
	TypeChanges: "Changes", TypeDetach: "Detach", TypePing: "Ping", TypeSnapshot: "Snapshot",
	TypeDescribe: "Describe", TypeEvents: "Events", TypeEventSnapshot: "EventSnapshot",
	TypeRetain: "Retain",
}

// Status is the result code at the start of every reply.
type Status uint32

// Status codes. docs/protocol.md lists what each means for the engine.
const (
	OK                   Status = 0
	ErrCodeMalformed     Status = 1 // the record could not be decoded
	ErrCodeUnknownType   Status = 2
	ErrCodeUnknownBatch  Status = 3
	ErrCodeUnknownLease  Status = 4
	ErrCodeUnknownRegion Status = 5
	ErrCodeOutOfRange    Status = 6  // view past a batch, page index past a region
	ErrCodeTooLarge      Status = 7  // over a configured bound
	ErrCodeNoSpace       Status = 8  // the pool has nothing evictable
	ErrCodeExpired       Status = 9  // the lease's deadline passed: treat as a miss
	ErrCodeDuplicate     Status = 10 // id already in use
	ErrCodeCopyFailed    Status = 11 // the copy engine failed (bad address, dead process)
	ErrCodeNotPermitted  Status = 12
	ErrCodeInternal      Status = 13
	ErrCodeShuttingDown  Status = 14
	ErrCodeBadVersion    Status = 15
	ErrCodeBadState      Status = 16 // e.g. Load on a lease that is still waiting for budget
	ErrCodeMismatch      Status = 17 // a region's page size differs from its namespace's block size
)

var statusNames = [...]string{
	"ok", "malformed record", "unknown record type", "unknown hash batch", "unknown lease",
	"unknown region", "out of range", "too large", "no space", "expired", "duplicate id",
	"copy failed", "not permitted", "internal error", "shutting down", "unsupported protocol version",
	"bad state", "mismatch",
}

func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", uint32(s))
}

// Error is a non-OK status with the sidecar's message.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string {
	if e.Message == "" {
		return "ringside: " + e.Status.String()
	}
	return "ringside: " + e.Status.String() + ": " + e.Message
}

// Errorf builds an *Error.
func Errorf(s Status, format string, args ...any) *Error {
	return &Error{Status: s, Message: fmt.Sprintf(format, args...)}
}

// ErrMalformed is wrapped by every decoding error.
var ErrMalformed = errors.New("schema: malformed")

// Limits on what one record may carry. A ring's maximum record size bounds
// them further.
const (
	MaxHashesPerRecord  = 4096
	MaxPagesPerRecord   = 8192
	MaxSegments         = 1024
	MaxStringLen        = 1024
	MaxChangesPerReply  = 4096
	MaxSnapshotPerReply = 4096
	MaxWorldSize        = 64 // tensor-parallel ranks of one engine instance (attach)
)

// Query (lease) states reported by Acquire and Poll.
type State uint32

const (
	StateWaiting  State = 1 // admitted, blocks pinned, waiting for load budget ("Loading" in the docs' query life cycle)
	StateReady    State = 2 // budget granted: Load may run
	StateLoading  State = 3 // a Load is copying
	StateLoaded   State = 4 // the last Load completed
	StateMiss     State = 5 // resolved as a miss (deadline passed, or nothing to pin): recompute
	StateReleased State = 6
)

func (s State) String() string {
	switch s {
	case StateWaiting:
		return "waiting"
	case StateReady:
		return "ready"
	case StateLoading:
		return "loading"
	case StateLoaded:
		return "loaded"
	case StateMiss:
		return "miss"
	case StateReleased:
		return "released"
	}
	return fmt.Sprintf("state(%d)", uint32(s))
}

var le = binary.LittleEndian

// reader decodes fixed-layout fields with bounds checks; the first failure
// sticks and later reads return zero.
type reader struct {
	b    []byte
	off  int
	err  error
	what string
}

func (r *reader) need(n int) bool {
	if r.err != nil {
		return false
	}
	if n < 0 || r.off+n > len(r.b) || r.off+n < r.off {
		r.err = fmt.Errorf("%w: %s: need %d bytes at offset %d, have %d", ErrMalformed, r.what, n, r.off, len(r.b))
		return false
	}
	return true
}

func (r *reader) u8() uint8 {
	if !r.need(1) {
		return 0
	}
	v := r.b[r.off]
	r.off++
	return v
}

func (r *reader) u16() uint16 {
	if !r.need(2) {
		return 0
	}
	v := le.Uint16(r.b[r.off:])
	r.off += 2
	return v
}

func (r *reader) u32() uint32 {
	if !r.need(4) {
		return 0
	}
	v := le.Uint32(r.b[r.off:])
	r.off += 4
	return v
}

func (r *reader) u64() uint64 {
	if !r.need(8) {
		return 0
	}
	v := le.Uint64(r.b[r.off:])
	r.off += 8
	return v
}

func (r *reader) bytes(n int) []byte {
	if !r.need(n) {
		return nil
	}
	v := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return v
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s: %s", ErrMalformed, r.what, fmt.Sprintf(format, args...))
	}
}

// done checks that the whole input was consumed.
func (r *reader) done() error {
	if r.err == nil && r.off != len(r.b) {
		r.err = fmt.Errorf("%w: %s: %d trailing bytes", ErrMalformed, r.what, len(r.b)-r.off)
	}
	return r.err
}

// writer appends fixed-layout fields.
type writer struct{ b []byte }

func (w *writer) u8(v uint8)   { w.b = append(w.b, v) }
func (w *writer) u16(v uint16) { w.b = le.AppendUint16(w.b, v) }
func (w *writer) u32(v uint32) { w.b = le.AppendUint32(w.b, v) }
func (w *writer) u64(v uint64) { w.b = le.AppendUint64(w.b, v) }
func (w *writer) raw(v []byte) { w.b = append(w.b, v...) }
func (w *writer) zero(n int)   { w.b = append(w.b, make([]byte, n)...) }
