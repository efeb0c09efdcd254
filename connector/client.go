// Package connector is the Go client of the ringside sidecar: it attaches
// over the Unix socket and then speaks the ring protocol exactly as an
// engine's plugin does. The benchmarks use it; so can Go engines.
//
// A Client is not safe for concurrent use: one goroutine drives it, the way
// one engine process drives its session. Every call has a deadline; a cache
// that is slow or gone yields an error, which an engine treats as a miss.
package connector

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// Options configure a session.
type Options struct {
	Socket       string // default /dev/shm/ringside/ringside.sock
	Instance     string // engine instance id (required)
	Model        string // model id (required)
	Layout       string // layout fingerprint (required)
	Salt         string // tenant salt
	Role         uint16 // schema.RoleScheduler, RoleWorker or RoleClient (default)
	Rank         int
	WorldSize    int // default 1
	DigestWidth  int // 8, 16 or 32 (default 32)
	RingCapacity uint32
	Timeout      time.Duration // per call (default 5s)
	Wait         ring.WaitConfig
	// Version is the protocol version to attach with (default
	// schema.Version; older ones for compatibility tests).
	Version uint16
}

// Client is one attached session.
type Client struct {
	opts    Options
	conn    *net.UnixConn
	sub     *ring.File
	cmp     *ring.File
	prod    *ring.Producer
	cons    *ring.Consumer
	info    schema.AttachReply
	seq     uint64
	pending map[uint64][]byte // replies that arrived for other calls
	buf     []byte
	closed  bool
	// unmapped is set once the rings are unmapped (Close, Abandon): a call
	// after that returns an error instead of faulting.
	unmapped bool
	// Failed fire-and-forget requests (Send) seen by Await.
	quietFailures int
	lastQuiet     schema.Status
}

// Dial attaches to the sidecar.
func Dial(o Options) (*Client, error) {
	if o.Socket == "" {
		o.Socket = ring.DefaultDir + "/ringside.sock"
	}
	if o.Role == 0 {
		o.Role = schema.RoleClient
	}
	if o.WorldSize == 0 {
		o.WorldSize = 1
	}
	if o.DigestWidth == 0 {
		o.DigestWidth = 32
	}
	if o.Timeout == 0 {
		o.Timeout = 5 * time.Second
	}
	if o.Wait == (ring.WaitConfig{}) {
		o.Wait = ring.DefaultWait
	}
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: o.Socket, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("connector: dial %s: %w", o.Socket, err)
	}
	version := o.Version
	if version == 0 {
		version = schema.Version
	}
	req := schema.AttachRequest{
		Version: version, Role: o.Role, Rank: uint32(o.Rank), WorldSize: uint32(o.WorldSize),
		DigestWidth: uint8(o.DigestWidth), RingCapacity: o.RingCapacity,
		Instance: o.Instance, Model: o.Model, Layout: o.Layout, Salt: o.Salt,
	}
	if err := req.Validate(); err != nil {
		conn.Close()
		return nil, err
	}
	conn.SetDeadline(time.Now().Add(o.Timeout))
	_, werr := conn.Write(req.Append(nil))
	// A sidecar that refuses the peer's uid answers before reading the
	// request and closes: the write may fail, the refusal is still there
	// to read. A successful reply carries the two rings as descriptors
	// (protocol version 2): the submission ring first.
	b := make([]byte, 8192)
	oob := make([]byte, syscall.CmsgSpace(2*4))
	n, oobn, _, _, err := conn.ReadMsgUnix(b, oob)
	if err != nil {
		conn.Close()
		if werr != nil {
			return nil, fmt.Errorf("connector: attach: %w", werr)
		}
		return nil, fmt.Errorf("connector: attach reply: %w", err)
	}
	fds, ferr := parseRights(oob[:oobn])
	conn.SetDeadline(time.Time{})
	c := &Client{opts: o, conn: conn, pending: map[uint64][]byte{}}
	fail := func(err error) (*Client, error) {
		for _, fd := range fds {
			syscall.Close(fd)
		}
		conn.Close()
		return nil, err
	}
	if err := c.info.Decode(b[:n]); err != nil {
		return fail(err)
	}
	if c.info.Status != schema.OK {
		return fail(&schema.Error{Status: c.info.Status, Message: c.info.Message})
	}
	if ferr != nil || len(fds) != 2 {
		return fail(fmt.Errorf("connector: attach reply carried %d ring descriptors, want 2 (%v)", len(fds), ferr))
	}
	subFD, cmpFD := fds[0], fds[1]
	// ring.OpenFD takes its descriptor over, also on error.
	if c.sub, err = ring.OpenFD(subFD, c.info.SubmissionRing, c.info.Epoch); err != nil {
		syscall.Close(cmpFD)
		conn.Close()
		return nil, fmt.Errorf("connector: rings: %w", err)
	}
	if c.cmp, err = ring.OpenFD(cmpFD, c.info.CompletionRing, c.info.Epoch); err == nil {
		if c.prod, err = ring.NewProducer(c.sub.Ring, o.Wait); err == nil {
			c.cons, err = ring.NewConsumer(c.cmp.Ring, o.Wait)
		}
	}
	if err != nil {
		c.closeFiles()
		return nil, fmt.Errorf("connector: rings: %w", err)
	}
	return c, nil
}

// parseRights returns the descriptors of SCM_RIGHTS messages in oob.
func parseRights(oob []byte) ([]int, error) {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for i := range msgs {
		f, err := syscall.ParseUnixRights(&msgs[i])
		if err != nil {
			return fds, err
		}
		fds = append(fds, f...)
	}
	return fds, nil
}

// SocketFD returns the descriptor of the session's attach socket (valid
// until Close; -1 after): tests use it to misbehave on it.
func (c *Client) SocketFD() int {
	if c.unmapped {
		return -1
	}
	raw, err := c.conn.SyscallConn()
	if err != nil {
		return -1
	}
	fd := -1
	raw.Control(func(s uintptr) { fd = int(s) })
	return fd
}

// RingFDs returns the descriptors of the session's submission and
// completion rings (valid until Close): tests use them to attack their own
// rings, since the files have no name.
func (c *Client) RingFDs() (sub, cmp int) {
	if c.unmapped {
		return -1, -1
	}
	return c.sub.FD(), c.cmp.FD()
}

// Info is the sidecar's attach reply: session id, epoch, pool geometry.
func (c *Client) Info() schema.AttachReply { return c.info }

// MaxPayload is the largest request payload the session's rings carry.
func (c *Client) MaxPayload() int { return c.sub.MaxPayload() }

func (c *Client) closeFiles() {
	c.unmapped = true
	if c.sub != nil {
		c.sub.Close()
	}
	if c.cmp != nil {
		c.cmp.Close()
	}
	c.conn.Close()
}

// Close detaches cleanly (or just drops the session if the sidecar is gone).
func (c *Client) Close() error {
	if c.closed {
		return nil
	}
	c.closed = true
	_, err := c.call(schema.TypeDetach, nil)
	c.prod.Close()
	c.cons.Close()
	c.closeFiles()
	if err != nil && !errors.Is(err, ring.ErrPeerClosed) && !errors.Is(err, ring.ErrPeerDead) {
		return err
	}
	return nil
}

// Submit sends one request without waiting and returns its correlation
// number; Await collects the reply. Use it to keep several loads or stores
// in flight.
func (c *Client) Submit(typ uint16, payload []byte) (uint64, error) {
	if c.unmapped { // after Close or Abandon: never touch the unmapped rings
		return 0, fmt.Errorf("connector: %w", ring.ErrClosed)
	}
	c.seq++
	err := c.prod.Write(typ, 0, c.seq, payload, time.Now().Add(c.opts.Timeout))
	return c.seq, err
}

// Send sends one request whose reply nobody waits for (fire and forget),
// with seq 0: the sidecar answers it only if it fails, and Await counts such
// replies in QuietFailures and drops them. Records are handled in order, so
// a later request sees this one's effect.
func (c *Client) Send(typ uint16, payload []byte) error {
	if c.unmapped {
		return fmt.Errorf("connector: %w", ring.ErrClosed)
	}
	return c.prod.Write(typ, 0, 0, payload, time.Now().Add(c.opts.Timeout))
}

// QuietFailures returns how many requests sent with Send failed (their
// replies seen so far) and the last such reply's status.
func (c *Client) QuietFailures() (int, schema.Status) { return c.quietFailures, c.lastQuiet }

// Await waits for the reply to request seq and returns its payload (valid
// until the next call on c).
func (c *Client) Await(seq uint64) ([]byte, error) {
	if p, ok := c.pending[seq]; ok {
		delete(c.pending, seq)
		return p, nil
	}
	if c.unmapped {
		return nil, fmt.Errorf("connector: %w", ring.ErrClosed)
	}
	deadline := time.Now().Add(c.opts.Timeout)
	for {
		rec, err := c.cons.Next()
		if errors.Is(err, ring.ErrEmpty) {
			c.cons.Commit()
			if err := c.cons.Wait(deadline); err != nil {
				return nil, err
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		if rec.Seq == seq {
			c.buf = append(c.buf[:0], rec.Payload...)
			c.cons.Commit()
			return c.buf, nil
		}
		if rec.Seq == 0 { // a failed Send (an old sidecar answers every one: status 0 is not counted)
			if len(rec.Payload) >= 4 {
				if st := schema.Status(binary.LittleEndian.Uint32(rec.Payload)); st != schema.OK {
					c.quietFailures++
					c.lastQuiet = st
				}
			}
			continue
		}
		if len(c.pending) > 1<<16 {
			return nil, errors.New("connector: too many unclaimed replies")
		}
		c.pending[rec.Seq] = append([]byte(nil), rec.Payload...)
	}
}

func (c *Client) call(typ uint16, payload []byte) ([]byte, error) {
	seq, err := c.Submit(typ, payload)
	if err != nil {
		return nil, err
	}
	return c.Await(seq)
}

func (c *Client) simple(typ uint16, payload []byte) (uint64, error) {
	b, err := c.call(typ, payload)
	if err != nil {
		return 0, err
	}
	var r schema.Reply
	if err := r.Decode(b); err != nil {
		return 0, err
	}
	return r.Value, r.Err()
}

// PutHashes registers digests (len a multiple of the digest width) as batch
// id, or appends them when appendTo is set, and returns the batch length.
func (c *Client) PutHashes(batch uint64, digests []byte, appendTo bool) (int, error) {
	m := schema.PutHashes{Batch: batch, Digests: digests}
	if appendTo {
		m.Flags = schema.FlagAppend
	}
	n, err := c.simple(schema.TypePutHashes, m.Append(nil, c.opts.DigestWidth))
	return int(n), err
}

// PutHashesLookup registers digests as a new batch and returns what a
// Lookup of the whole batch answers (the number of leading blocks the
// sidecar holds), in one round trip (FlagLookup).
func (c *Client) PutHashesLookup(batch uint64, digests []byte) (int, error) {
	m := schema.PutHashes{Batch: batch, Flags: schema.FlagLookup, Digests: digests}
	n, err := c.simple(schema.TypePutHashes, m.Append(nil, c.opts.DigestWidth))
	return int(n), err
}

// PutHashesFlags sends a PutHashes with any flags (schema.FlagAppend,
// FlagLookup, FlagReplace) and returns the Reply's value: the batch length,
// or with FlagLookup the number of leading blocks the sidecar holds.
func (c *Client) PutHashesFlags(batch uint64, digests []byte, flags uint32) (int, error) {
	m := schema.PutHashes{Batch: batch, Flags: flags, Digests: digests}
	n, err := c.simple(schema.TypePutHashes, m.Append(nil, c.opts.DigestWidth))
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

func (c *Client) lease(typ uint16, payload []byte) (schema.LeaseReply, error) {
	var r schema.LeaseReply
	b, err := c.call(typ, payload)
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}

// Acquire pins the leading present blocks of v under a lease.
func (c *Client) Acquire(v schema.View, ttl time.Duration) (schema.LeaseReply, error) {
	return c.lease(schema.TypeAcquire, (&schema.Acquire{View: v, TTLms: uint32(ttl / time.Millisecond)}).Append(nil))
}

// Poll returns a lease's state.
func (c *Client) Poll(lease uint64) (schema.LeaseReply, error) {
	return c.lease(schema.TypePoll, schema.IDRequest{ID: lease}.Append(nil))
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
	var r schema.StoreReply
	b, err := c.call(schema.TypeStore, (&schema.Store{View: v, Region: region, Pages: pages}).Append(nil))
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}

// Changes reads the change log from a cursor (zero cursor: start at the
// head). The reply's Entries alias an internal buffer until the next call.
func (c *Client) Changes(epoch, seq uint64, max uint32) (schema.ChangesReply, error) {
	var r schema.ChangesReply
	b, err := c.call(schema.TypeChanges, (&schema.Changes{Epoch: epoch, Seq: seq, Max: max}).Append(nil))
	if err != nil {
		return r, err
	}
	if err := r.Decode(b); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status}
	}
	return r, nil
}

// Snapshot reads one page of the digests of the namespace's present blocks
// from scan position from (0 starts; then the previous reply's Next), at
// most max of them (0: the sidecar's bound). docs/protocol.md section 11
// tells how pages and Changes rebuild a mirror. The reply's Entries alias an
// internal buffer until the next call. A refusal (status) is an
// *schema.Error, also when it comes as a common Reply (a sidecar that does
// not know Snapshot answers status 2 that way).
func (c *Client) Snapshot(from uint64, max uint32) (schema.SnapshotReply, error) {
	var r schema.SnapshotReply
	b, err := c.call(schema.TypeSnapshot, (&schema.Snapshot{From: from, Max: max}).Append(nil))
	if err != nil {
		return r, err
	}
	if len(b) >= 4 && binary.LittleEndian.Uint32(b) != 0 {
		st := schema.Status(binary.LittleEndian.Uint32(b))
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
	if err := r.Decode(b); err != nil {
		return r, err
	}
	return r, nil
}

// Ping checks the round trip.
func (c *Client) Ping(v uint64) error {
	got, err := c.simple(schema.TypePing, schema.IDRequest{ID: v}.Append(nil))
	if err == nil && got != v {
		err = fmt.Errorf("connector: ping answered %d, want %d", got, v)
	}
	return err
}

var _ = os.ErrDeadlineExceeded

// Abandon drops the session without detaching, as a crashed engine would:
// the socket closes and the sidecar reclaims everything the session held.
func (c *Client) Abandon() {
	c.closed = true
	c.closeFiles()
}
