// Package connector is the Go client of the ringside sidecar: it attaches
// over the Unix socket and then speaks the ring protocol exactly as an
// engine's plugin does. The benchmarks use it; so can Go engines.
//
// A Client's typed requests (Lookup, Acquire, Store, ...) encode a record,
// hand it to its Transport and decode the reply. Dial's transport is the
// session's rings (ring.go); tests give a Client another transport (the
// state machine alone, in sidecar/machine's scenario driver) and reuse the
// same typed requests.
//
// A Client is not safe for concurrent use: one goroutine drives it, the way
// one engine process drives its session. Every call of the ring transport
// has a deadline; a cache that is slow or gone yields an error, which an
// engine treats as a miss.
package connector

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// Transport carries a session's request records and their replies.
type Transport interface {
	// Submit sends one request record and returns its correlation number
	// (never 0); Await(seq) collects the reply.
	Submit(typ uint16, payload []byte) (seq uint64, err error)
	// Await returns the payload of the reply to request seq, valid until
	// the next call on the transport.
	Await(seq uint64) ([]byte, error)
	// Send sends one request with seq 0, fire and forget: the sidecar
	// answers it only if it fails, and the transport counts such answers
	// (QuietFailures) as it sees them. Records are handled in order, so a
	// later request sees this one's effect.
	Send(typ uint16, payload []byte) error
	// QuietFailures returns how many requests sent with Send failed (their
	// replies seen so far) and the last such reply's status.
	QuietFailures() (int, schema.Status)
	// Close ends the transport once the session's Detach was answered.
	Close() error
	// Abandon ends it without detaching, as a crashed engine would.
	Abandon()
}

// Client is one attached session.
type Client struct {
	t      Transport
	width  int
	ring   *ringTransport // Dial's transport; nil for another one
	closed bool
}

// New returns a Client whose requests go through t, with digests of width
// bytes (8, 16 or 32).
func New(t Transport, width int) *Client { return &Client{t: t, width: width} }

// Transport returns the Client's transport.
func (c *Client) Transport() Transport { return c.t }

// SocketFD returns the descriptor of the session's attach socket (valid
// until Close; -1 after, or without the ring transport): tests use it to
// misbehave on it.
func (c *Client) SocketFD() int {
	if c.ring == nil || c.ring.unmapped {
		return -1
	}
	raw, err := c.ring.conn.SyscallConn()
	if err != nil {
		return -1
	}
	fd := -1
	raw.Control(func(s uintptr) { fd = int(s) })
	return fd
}

// RingFDs returns the descriptors of the session's submission and
// completion rings (valid until Close; -1 without the ring transport):
// tests use them to attack their own rings, since the files have no name.
func (c *Client) RingFDs() (sub, cmp int) {
	if c.ring == nil || c.ring.unmapped {
		return -1, -1
	}
	return c.ring.sub.FD(), c.ring.cmp.FD()
}

// Info is the sidecar's attach reply: session id, epoch, pool geometry
// (zero without the ring transport).
func (c *Client) Info() schema.AttachReply {
	if c.ring == nil {
		return schema.AttachReply{}
	}
	return c.ring.info
}

// MaxPayload is the largest request payload the session's rings carry (0
// without the ring transport).
func (c *Client) MaxPayload() int {
	if c.ring == nil {
		return 0
	}
	return c.ring.sub.MaxPayload()
}

// Close detaches cleanly (or just drops the session if the sidecar is gone).
func (c *Client) Close() error {
	if c.closed {
		return nil
	}
	c.closed = true
	_, err := c.Call(schema.TypeDetach, nil)
	cerr := c.t.Close()
	if err != nil && !errors.Is(err, ring.ErrPeerClosed) && !errors.Is(err, ring.ErrPeerDead) {
		return err
	}
	return cerr
}

// Abandon drops the session without detaching, as a crashed engine would:
// the socket closes and the sidecar reclaims everything the session held.
func (c *Client) Abandon() {
	c.closed = true
	c.t.Abandon()
}

// Submit sends one request without waiting and returns its correlation
// number; Await collects the reply. Use it to keep several loads or stores
// in flight.
func (c *Client) Submit(typ uint16, payload []byte) (uint64, error) { return c.t.Submit(typ, payload) }

// Send sends one request whose reply nobody waits for (fire and forget),
// with seq 0: the sidecar answers it only if it fails, and the transport
// counts such replies in QuietFailures. Records are handled in order, so a
// later request sees this one's effect.
func (c *Client) Send(typ uint16, payload []byte) error { return c.t.Send(typ, payload) }

// QuietFailures returns how many requests sent with Send failed (their
// replies seen so far) and the last such reply's status.
func (c *Client) QuietFailures() (int, schema.Status) { return c.t.QuietFailures() }

// Await waits for the reply to request seq and returns its payload (valid
// until the next call on c).
func (c *Client) Await(seq uint64) ([]byte, error) { return c.t.Await(seq) }

// Call sends one request and returns its reply's payload (valid until the
// next call on c), whatever its status.
func (c *Client) Call(typ uint16, payload []byte) ([]byte, error) {
	seq, err := c.t.Submit(typ, payload)
	if err != nil {
		return nil, err
	}
	return c.t.Await(seq)
}

// reply is a reply record type of schema: decoded in place, with its
// status (and message, where it has one).
type reply[R any] interface {
	*R
	Decode(b []byte) error
}

// request sends one request and decodes its reply into an R; a status
// other than OK is an *schema.Error, returned with the decoded reply.
func request[R any, P reply[R]](c *Client, typ uint16, payload []byte, status func(*R) (schema.Status, string)) (R, error) {
	var r R
	b, err := c.Call(typ, payload)
	if err != nil {
		return r, err
	}
	if err := P(&r).Decode(b); err != nil {
		return r, err
	}
	if st, msg := status(&r); st != schema.OK {
		return r, &schema.Error{Status: st, Message: msg}
	}
	return r, nil
}

func replyStatus(r *schema.Reply) (schema.Status, string)          { return r.Status, r.Message }
func leaseStatus(r *schema.LeaseReply) (schema.Status, string)     { return r.Status, r.Message }
func storeStatus(r *schema.StoreReply) (schema.Status, string)     { return r.Status, r.Message }
func changesStatus(r *schema.ChangesReply) (schema.Status, string) { return r.Status, "" }
func eventsStatus(r *schema.EventsReply) (schema.Status, string)   { return r.Status, "" }

// simple sends a request answered by a common Reply and returns its value.
func (c *Client) simple(typ uint16, payload []byte) (uint64, error) {
	r, err := request[schema.Reply](c, typ, payload, replyStatus)
	return r.Value, err
}

// PutHashes registers digests (len a multiple of the digest width) as batch
// id, or appends them when appendTo is set, and returns the batch length.
func (c *Client) PutHashes(batch uint64, digests []byte, appendTo bool) (int, error) {
	var flags uint32
	if appendTo {
		flags = schema.FlagAppend
	}
	return c.PutHashesFlags(batch, digests, flags)
}

// PutHashesLookup registers digests as a new batch and returns what a
// Lookup of the whole batch answers (the number of leading blocks the
// sidecar holds), in one round trip (FlagLookup).
func (c *Client) PutHashesLookup(batch uint64, digests []byte) (int, error) {
	return c.PutHashesFlags(batch, digests, schema.FlagLookup)
}

// PutHashesFlags sends a PutHashes with any flags (schema.FlagAppend,
// FlagLookup, FlagReplace) and returns the Reply's value: the batch length,
// or with FlagLookup the number of leading blocks the sidecar holds.
func (c *Client) PutHashesFlags(batch uint64, digests []byte, flags uint32) (int, error) {
	m := schema.PutHashes{Batch: batch, Flags: flags, Digests: digests}
	n, err := c.simple(schema.TypePutHashes, m.Append(nil, c.width))
	return int(n), err
}

// DropHashes forgets a batch.
func (c *Client) DropHashes(batch uint64) error {
	_, err := c.simple(schema.TypeDropHashes, schema.IDRequest{ID: batch}.Append(nil))
	return err
}

// Lookup returns the number of leading blocks of v that the sidecar holds.
func (c *Client) Lookup(v schema.View) (int, error) {
	n, err := c.simple(schema.TypeLookup, (&schema.Lookup{View: v}).Append(nil))
	return int(n), err
}

// Acquire pins the leading present blocks of v under a lease.
func (c *Client) Acquire(v schema.View, ttl time.Duration) (schema.LeaseReply, error) {
	p := (&schema.Acquire{View: v, TTLms: uint32(ttl / time.Millisecond)}).Append(nil)
	return request[schema.LeaseReply](c, schema.TypeAcquire, p, leaseStatus)
}

// Retain keeps the leading present blocks of v for ttl (rounded up to a
// millisecond) at priority prio (0..schema.MaxRetainPriority, the highest
// kept longest), or, with end, ends the retention this uid set on v's
// blocks (ttl and prio are then ignored); it is RetainOwned with owner 0.
func (c *Client) Retain(v schema.View, ttl time.Duration, prio int, end bool) (int, error) {
	return c.RetainOwned(v, 0, ttl, prio, end)
}

// RetainOwned is Retain on behalf of owner, an identity the client
// chooses within its uid (e.g. a hash of a caller's session id; 0: none):
// a block's retention belongs to the uid and owner that set it, and only
// the same uid and owner renew, re-prioritise or end it. It returns how
// many blocks' retention it set, renewed or ended (docs/protocol.md,
// section 5.14). Owner 0 is sent in the 24-byte form every sidecar that
// knows Retain reads; a sidecar that predates the owner answers one with
// an owner with status 1. A sidecar that predates Retain answers status 2
// (an *schema.Error): stop sending it for the session.
func (c *Client) RetainOwned(v schema.View, owner uint64, ttl time.Duration, prio int, end bool) (int, error) {
	m := schema.Retain{View: v, Owner: owner}
	if end {
		m.Flags = schema.RetainFlagEnd
	} else {
		if prio < 0 || prio > schema.MaxRetainPriority {
			return 0, fmt.Errorf("connector: retain priority %d not in 0..%d", prio, schema.MaxRetainPriority)
		}
		if ttl <= 0 {
			return 0, fmt.Errorf("connector: retain ttl %v must be positive", ttl)
		}
		ms := (ttl + time.Millisecond - 1) / time.Millisecond
		m.TTLms = uint32(min(ms, math.MaxUint32))
		m.Priority = uint8(prio)
	}
	n, err := c.simple(schema.TypeRetain, m.Append(nil))
	return int(n), err
}

// Poll returns a lease's state.
func (c *Client) Poll(lease uint64) (schema.LeaseReply, error) {
	return request[schema.LeaseReply](c, schema.TypePoll, schema.IDRequest{ID: lease}.Append(nil), leaseStatus)
}

// Release ends a lease.
func (c *Client) Release(lease uint64) error {
	_, err := c.simple(schema.TypeRelease, schema.IDRequest{ID: lease}.Append(nil))
	return err
}

// RegisterRegion registers engine memory.
func (c *Client) RegisterRegion(r schema.RegisterRegion) error {
	_, err := c.simple(schema.TypeRegisterRegion, r.Append(nil))
	return err
}

// Load copies lease blocks first.. into pages of a region and waits for it.
func (c *Client) Load(lease uint64, region, first uint32, pages []uint32) (int, error) {
	n, err := c.simple(schema.TypeLoad, (&schema.Load{Lease: lease, Region: region, First: first, Pages: pages}).Append(nil))
	return int(n), err
}

// Store copies pages of a region into the pool as the blocks of v.
func (c *Client) Store(v schema.View, region uint32, pages []uint32) (schema.StoreReply, error) {
	p := (&schema.Store{View: v, Region: region, Pages: pages}).Append(nil)
	return request[schema.StoreReply](c, schema.TypeStore, p, storeStatus)
}

// Changes reads the change log from a cursor (zero cursor: start at the
// head). The reply's Entries alias an internal buffer until the next call.
func (c *Client) Changes(epoch, seq uint64, max uint32) (schema.ChangesReply, error) {
	p := (&schema.Changes{Epoch: epoch, Seq: seq, Max: max}).Append(nil)
	return request[schema.ChangesReply](c, schema.TypeChanges, p, changesStatus)
}

// Snapshot reads one page of the digests of the namespace's present blocks
// from scan position from (0 starts; then the previous reply's Next), at
// most max of them (0: the sidecar's bound). docs/protocol.md section 11
// tells how pages and Changes rebuild a mirror. The reply's Entries alias an
// internal buffer until the next call. A refusal (status) is an
// *schema.Error, also when it comes as a common Reply (a sidecar that does
// not know Snapshot answers status 2 that way).
func (c *Client) Snapshot(from uint64, max uint32) (schema.SnapshotReply, error) {
	p := (&schema.Snapshot{From: from, Max: max}).Append(nil)
	b, err := c.Call(schema.TypeSnapshot, p)
	if err != nil {
		return schema.SnapshotReply{}, err
	}
	if len(b) >= 4 && binary.LittleEndian.Uint32(b) != 0 {
		st := schema.Status(binary.LittleEndian.Uint32(b))
		var r schema.SnapshotReply
		var msg string
		if r.Decode(b) != nil { // not a SnapshotReply: a common Reply carries a message
			var common schema.Reply
			if common.Decode(b) == nil {
				msg = common.Message
			}
			r = schema.SnapshotReply{Status: st}
		}
		return r, &schema.Error{Status: st, Message: msg}
	}
	var r schema.SnapshotReply
	return r, r.Decode(b)
}

// Describe describes blocks for KV events (docs/protocol.md section 5.11)
// and returns the descriptions added (blocks described before keep
// theirs).
func (c *Client) Describe(runs []schema.DescribeRun) (int, error) {
	n, err := c.simple(schema.TypeDescribe, (&schema.Describe{Runs: runs}).Append(nil, c.width))
	return int(n), err
}

// Events reads the namespace's event log from a cursor, as Changes reads
// the change log (zero cursor: start at the head). The reply's Entries
// alias an internal buffer until the next call.
func (c *Client) Events(epoch, seq uint64, max uint32) (schema.EventsReply, error) {
	p := (&schema.Changes{Epoch: epoch, Seq: seq, Max: max}).Append(nil)
	return request[schema.EventsReply](c, schema.TypeEvents, p, eventsStatus)
}

// EventSnapshot reads one page of the namespace's present, described
// blocks from scan position from, at most max of them, as Snapshot pages
// the present ones. The reply's Entries alias an internal buffer until the
// next call.
func (c *Client) EventSnapshot(from uint64, max uint32) (schema.EventsReply, error) {
	p := (&schema.Snapshot{From: from, Max: max}).Append(nil)
	return request[schema.EventsReply](c, schema.TypeEventSnapshot, p, eventsStatus)
}

// Ping checks the round trip.
func (c *Client) Ping(v uint64) error {
	got, err := c.simple(schema.TypePing, schema.IDRequest{ID: v}.Append(nil))
	if err == nil && got != v {
		err = fmt.Errorf("connector: ping answered %d, want %d", got, v)
	}
	return err
}
