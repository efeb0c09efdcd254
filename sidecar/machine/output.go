package machine

import (
	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
)

// SessionID names a session for the life of the sidecar; ids are never
// reused.
type SessionID uint64

// CopyID names one copy between the pool and a region; never reused.
type CopyID uint64

// Output is what one call of the Machine asks its caller to do. The
// caller owns it: the Machine resets it at the start of each call and
// fills it; payloads stay valid until the Output is passed to the Machine
// again.
type Output struct {
	// Replies to write to sessions' completion rings, in order. Replies to
	// sessions that ended are never emitted.
	Replies []Reply
	// Copies to submit to the copy engine; each must end in CopyDone.
	Copies []Copy
	// Registers are regions to register with the copy engine; each must
	// end in RegisterDone.
	Registers []Register
	// Unregister lists copy-engine handles the caller must unregister
	// (after the copies on them end; the engine's Unregister waits).
	Unregister []gpu.Handle
	// L2Lookups, L2Fetches and L2Writes are the shared tier's work (l2.go):
	// each must end in L2LookupDone, L2FetchDone, L2WriteDone.
	L2Lookups []L2Lookup
	L2Fetches []L2Fetch
	L2Writes  []L2Write
	// End reports that the session whose request was handled asked to end
	// (Detach): the caller stops reading its ring after sending Replies.
	End bool

	arena []byte
}

// Reply is one reply record: Type is already the reply's record type.
type Reply struct {
	Session SessionID
	Type    uint16
	Seq     uint64
	Payload []byte
}

// Copy is one copy to run. Pages and PoolOffsets are owned by the Copy.
type Copy struct {
	ID        CopyID
	Session   SessionID
	UID       uint32 // the session's uid
	Dir       gpu.Direction
	Region    gpu.Handle
	PageBytes uint64
	Pages     []uint32
	// PoolOffsets[i] is the byte offset in the pool of page i's slot.
	PoolOffsets []uint64
}

// Register asks the caller to register a region with the copy engine.
type Register struct {
	Session SessionID
	ID      uint32
	Region  gpu.Region
}

// CopyResult is how a copy ended.
type CopyResult struct {
	Err error // nil: every byte was copied
	// Exited reports that the process owning the region was found dead
	// after the copy: a store from it is discarded even if the copy
	// reported success (its pid may have been reused meanwhile).
	Exited bool
	Bytes  int64
}

func (o *Output) reset() {
	clear(o.Replies)
	clear(o.Copies)
	clear(o.Registers)
	clear(o.L2Lookups)
	clear(o.L2Fetches)
	clear(o.L2Writes)
	*o = Output{Replies: o.Replies[:0], Copies: o.Copies[:0], Registers: o.Registers[:0],
		Unregister: o.Unregister[:0], L2Lookups: o.L2Lookups[:0], L2Fetches: o.L2Fetches[:0], L2Writes: o.L2Writes[:0],
		arena: o.arena[:0]}
}

// reply appends an encoded reply; enc encodes into the arena. A payload
// keeps pointing at the array it was encoded into if a later append
// reallocates the arena, so every payload stays valid until reset.
func (o *Output) reply(sess SessionID, typ uint16, seq uint64, enc func([]byte) []byte) {
	start := len(o.arena)
	o.arena = enc(o.arena)
	o.Replies = append(o.Replies, Reply{Session: sess, Type: schema.ReplyType(typ), Seq: seq, Payload: o.arena[start:len(o.arena):len(o.arena)]})
}
