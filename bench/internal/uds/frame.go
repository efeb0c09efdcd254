// Package uds is the Unix-socket baseline shared by the benchmarks: ring
// records framed unchanged on a SOCK_STREAM Unix socket, a client for them,
// and the relay process that forwards every frame to a live sidecar over
// its own ring session.
//
// The framing carries the ring's records unchanged: a 16-byte header laid
// out like a ring record header (u32 payload length, u16 type, u16 flags,
// u64 correlation number, little endian) and exactly length payload bytes.
//
// Both ends use blocking read(2) and write(2) on the socket, as a C or Rust
// socket server would, rather than Go's netpoller (epoll plus a goroutine
// hand-off on every message), so that the baseline charges the socket's
// cost and not the Go runtime's.
package uds

import (
	"encoding/binary"
	"fmt"
	"io"
	"time"

	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// FrameHeader is the size of a frame header (that of a ring record header).
const FrameHeader = ring.RecordHeaderSize

// MaxFrame bounds a frame's payload (a peer's garbage length must not make
// us allocate gigabytes).
const MaxFrame = 16 << 20

// Conn reads and writes frames on a blocking socket: one read(2) per frame
// in the common case (it buffers) and one write(2) per frame.
type Conn struct {
	fd   int
	rbuf []byte
	r, w int // unread bytes are rbuf[r:w]
	out  []byte
	in   []byte
}

// NewConn wraps a connected socket; every read and write waits at most
// timeout.
func NewConn(fd int, timeout time.Duration) (*Conn, error) {
	if err := sys.SetTimeouts(fd, timeout); err != nil {
		return nil, err
	}
	return &Conn{fd: fd, rbuf: make([]byte, 64<<10)}, nil
}

// Close closes the socket.
func (f *Conn) Close() error { return sys.Close(f.fd) }

// Write sends one frame.
func (f *Conn) Write(typ, flags uint16, seq uint64, payload []byte) error {
	f.out = f.out[:0]
	f.out = binary.LittleEndian.AppendUint32(f.out, uint32(len(payload)))
	f.out = binary.LittleEndian.AppendUint16(f.out, typ)
	f.out = binary.LittleEndian.AppendUint16(f.out, flags)
	f.out = binary.LittleEndian.AppendUint64(f.out, seq)
	f.out = append(f.out, payload...)
	return sys.WriteAll(f.fd, f.out)
}

// fill makes at least n unread bytes available.
func (f *Conn) fill(n int) error {
	if f.w-f.r >= n {
		return nil
	}
	if f.r > 0 {
		f.w = copy(f.rbuf, f.rbuf[f.r:f.w])
		f.r = 0
	}
	if n > len(f.rbuf) {
		nb := make([]byte, n)
		copy(nb, f.rbuf[:f.w])
		f.rbuf = nb
	}
	for f.w < n {
		m, err := sys.Read(f.fd, f.rbuf[f.w:])
		if err != nil {
			return err
		}
		if m == 0 {
			if f.w == 0 {
				return io.EOF
			}
			return io.ErrUnexpectedEOF
		}
		f.w += m
	}
	return nil
}

// Read returns the next frame; the payload is valid until the next Read.
func (f *Conn) Read() (typ uint16, seq uint64, payload []byte, err error) {
	if err = f.fill(FrameHeader); err != nil {
		return 0, 0, nil, err
	}
	h := f.rbuf[f.r:]
	n := binary.LittleEndian.Uint32(h[0:])
	typ = binary.LittleEndian.Uint16(h[4:])
	seq = binary.LittleEndian.Uint64(h[8:])
	if n > MaxFrame {
		return 0, 0, nil, fmt.Errorf("frame of %d bytes", n)
	}
	if err = f.fill(FrameHeader + int(n)); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, 0, nil, err
	}
	f.in = append(f.in[:0], f.rbuf[f.r+FrameHeader:f.r+FrameHeader+int(n)]...)
	f.r += FrameHeader + int(n)
	return typ, seq, f.in, nil
}

// Listen binds and listens on a SOCK_STREAM Unix socket.
func Listen(path string) (int, error) { return sys.ListenStream(path) }

// Accept accepts one connection on lfd, waiting at most timeout, and wraps
// it with the same timeout on every read and write.
func Accept(lfd int, timeout time.Duration) (*Conn, error) {
	fd, err := sys.AcceptStream(lfd, timeout)
	if err != nil {
		return nil, err
	}
	c, err := NewConn(fd, timeout)
	if err != nil {
		sys.Close(fd)
		return nil, err
	}
	return c, nil
}

// CloseListener closes a listening socket.
func CloseListener(lfd int) error { return sys.Close(lfd) }

// Client sends request records as frames and waits for each reply: the
// same records, in the same order, as a connector.Client sends on its ring.
type Client struct {
	fc  *Conn
	seq uint64
}

// Dial connects to a relay (or any frame server) at path.
func Dial(path string, timeout time.Duration) (*Client, error) {
	fd, err := sys.DialStream(path)
	if err != nil {
		return nil, err
	}
	fc, err := NewConn(fd, timeout)
	if err != nil {
		sys.Close(fd)
		return nil, err
	}
	return &Client{fc: fc}, nil
}

// Close closes the connection (the relay then ends).
func (u *Client) Close() error { return u.fc.Close() }

// Call sends one request record and returns its reply payload, valid until
// the next call.
func (u *Client) Call(typ uint16, payload []byte) ([]byte, error) {
	u.seq++
	if err := u.fc.Write(typ, 0, u.seq, payload); err != nil {
		return nil, err
	}
	rt, seq, p, err := u.fc.Read()
	if err != nil {
		return nil, err
	}
	if rt != typ|schema.ReplyBit || seq != u.seq {
		return nil, fmt.Errorf("reply type %#x seq %d, want %#x seq %d", rt, seq, typ|schema.ReplyBit, u.seq)
	}
	return p, nil
}
