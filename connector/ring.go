package connector

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
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

// ringTransport is the transport of a session Dial attached: the two
// shared-memory rings the attach reply carried, and the attach socket,
// whose close tells the sidecar that the session ended.
type ringTransport struct {
	timeout time.Duration
	conn    *net.UnixConn
	sub     *ring.File
	cmp     *ring.File
	prod    *ring.Producer
	cons    *ring.Consumer
	info    schema.AttachReply
	seq     uint64
	pending map[uint64][]byte // replies that arrived for other calls
	buf     []byte
	// unmapped is set once the rings are unmapped (Close, Abandon): a call
	// after that returns an error instead of faulting.
	unmapped bool
	// Failed fire-and-forget requests (Send) seen by Await.
	quietFailures int
	lastQuiet     schema.Status
}

// Dial attaches to the sidecar: the Client's transport is the session's
// rings.
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
	n, oobn, err := readAttachReply(func() (int, int, error) {
		n, oobn, _, _, err := conn.ReadMsgUnix(b, oob)
		return n, oobn, err
	})
	if err != nil {
		conn.Close()
		if werr != nil {
			return nil, fmt.Errorf("connector: attach: %w", werr)
		}
		return nil, fmt.Errorf("connector: attach reply: %w", err)
	}
	fds, ferr := parseRights(oob[:oobn])
	conn.SetDeadline(time.Time{})
	t := &ringTransport{timeout: o.Timeout, conn: conn, pending: map[uint64][]byte{}}
	fail := func(err error) (*Client, error) {
		for _, fd := range fds {
			syscall.Close(fd)
		}
		conn.Close()
		return nil, err
	}
	if err := t.info.Decode(b[:n]); err != nil {
		return fail(err)
	}
	if t.info.Status != schema.OK {
		return fail(&schema.Error{Status: t.info.Status, Message: t.info.Message})
	}
	if ferr != nil || len(fds) != 2 {
		return fail(fmt.Errorf("connector: attach reply carried %d ring descriptors, want 2 (%v)", len(fds), ferr))
	}
	subFD, cmpFD := fds[0], fds[1]
	// ring.OpenFD takes its descriptor over, also on error.
	if t.sub, err = ring.OpenFD(subFD, t.info.SubmissionRing, t.info.Epoch); err != nil {
		syscall.Close(cmpFD)
		conn.Close()
		return nil, fmt.Errorf("connector: rings: %w", err)
	}
	if t.cmp, err = ring.OpenFD(cmpFD, t.info.CompletionRing, t.info.Epoch); err == nil {
		if t.prod, err = ring.NewProducer(t.sub.Ring, o.Wait); err == nil {
			t.cons, err = ring.NewConsumer(t.cmp.Ring, o.Wait)
		}
	}
	if err != nil {
		t.closeFiles()
		return nil, fmt.Errorf("connector: rings: %w", err)
	}
	c := New(t, o.DigestWidth)
	c.ring = t
	return c, nil
}

// readAttachReply reads the attach reply with read, and once more after an
// end of file. The sidecar writes a refusal and closes at once, and Linux
// can report the close before the reply: a read of a SEQPACKET socket
// checks its queue, then its shutdown flag (__unix_dgram_recvmsg in
// net/unix/af_unix.c), so a reply queued and a close made between those
// two checks read as end of file. Once the close is seen, a reply sent
// before it is in the queue (docs/protocol.md, section 4.1).
func readAttachReply(read func() (n, oobn int, err error)) (n, oobn int, err error) {
	n, oobn, err = read()
	if errors.Is(err, io.EOF) {
		n, oobn, err = read()
	}
	return n, oobn, err
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

func (t *ringTransport) closeFiles() {
	t.unmapped = true
	if t.sub != nil {
		t.sub.Close()
	}
	if t.cmp != nil {
		t.cmp.Close()
	}
	t.conn.Close()
}

// Close unmaps the rings and closes the socket (the Detach was sent).
func (t *ringTransport) Close() error {
	t.prod.Close()
	t.cons.Close()
	t.closeFiles()
	return nil
}

// Abandon closes everything without a word to the sidecar.
func (t *ringTransport) Abandon() { t.closeFiles() }

func (t *ringTransport) Submit(typ uint16, payload []byte) (uint64, error) {
	if t.unmapped { // after Close or Abandon: never touch the unmapped rings
		return 0, fmt.Errorf("connector: %w", ring.ErrClosed)
	}
	t.seq++
	err := t.prod.Write(typ, 0, t.seq, payload, time.Now().Add(t.timeout))
	return t.seq, err
}

func (t *ringTransport) Send(typ uint16, payload []byte) error {
	if t.unmapped {
		return fmt.Errorf("connector: %w", ring.ErrClosed)
	}
	return t.prod.Write(typ, 0, 0, payload, time.Now().Add(t.timeout))
}

func (t *ringTransport) QuietFailures() (int, schema.Status) { return t.quietFailures, t.lastQuiet }

func (t *ringTransport) Await(seq uint64) ([]byte, error) {
	if p, ok := t.pending[seq]; ok {
		delete(t.pending, seq)
		return p, nil
	}
	if t.unmapped {
		return nil, fmt.Errorf("connector: %w", ring.ErrClosed)
	}
	deadline := time.Now().Add(t.timeout)
	for {
		rec, err := t.cons.Next()
		if errors.Is(err, ring.ErrEmpty) {
			t.cons.Commit()
			if err := t.cons.Wait(deadline); err != nil {
				return nil, err
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		if rec.Seq == seq {
			t.buf = append(t.buf[:0], rec.Payload...)
			t.cons.Commit()
			return t.buf, nil
		}
		if rec.Seq == 0 { // a failed Send (an old sidecar answers every one: status 0 is not counted)
			if len(rec.Payload) >= 4 {
				if st := schema.Status(binary.LittleEndian.Uint32(rec.Payload)); st != schema.OK {
					t.quietFailures++
					t.lastQuiet = st
				}
			}
			continue
		}
		if len(t.pending) > 1<<16 {
			return nil, errors.New("connector: too many unclaimed replies")
		}
		t.pending[rec.Seq] = append([]byte(nil), rec.Payload...)
	}
}
