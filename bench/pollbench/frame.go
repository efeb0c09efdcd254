package pollbench

import (
	"encoding/binary"
	"fmt"
	"io"
	"time"

	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// The socket baseline carries the ring's records unchanged: a 16-byte
// header laid out like a ring record header (u32 payload length, u16 type,
// u16 flags, u64 correlation number, little endian) and exactly length
// payload bytes, on a SOCK_STREAM Unix socket.
//
// Both ends use blocking read(2) and write(2) on the socket, as a C or Rust
// socket server would, rather than Go's netpoller (epoll plus a goroutine
// hand-off on every message), so that the baseline charges the socket's
// cost and not the Go runtime's.
const frameHeader = ring.RecordHeaderSize

// maxFrame bounds a frame's payload (a peer's garbage length must not make
// us allocate gigabytes).
const maxFrame = 16 << 20

// frameConn reads and writes frames on a blocking socket: one read(2) per
// frame in the common case (it buffers) and one write(2) per frame.
type frameConn struct {
	fd   int
	rbuf []byte
	r, w int // unread bytes are rbuf[r:w]
	out  []byte
	in   []byte
}

func newFrameConn(fd int, timeout time.Duration) (*frameConn, error) {
	if err := sys.SetTimeouts(fd, timeout); err != nil {
		return nil, err
	}
	return &frameConn{fd: fd, rbuf: make([]byte, 64<<10)}, nil
}

func (f *frameConn) close() error { return sys.Close(f.fd) }

func (f *frameConn) write(typ, flags uint16, seq uint64, payload []byte) error {
	f.out = f.out[:0]
	f.out = binary.LittleEndian.AppendUint32(f.out, uint32(len(payload)))
	f.out = binary.LittleEndian.AppendUint16(f.out, typ)
	f.out = binary.LittleEndian.AppendUint16(f.out, flags)
	f.out = binary.LittleEndian.AppendUint64(f.out, seq)
	f.out = append(f.out, payload...)
	return sys.WriteAll(f.fd, f.out)
}

// fill makes at least n unread bytes available.
func (f *frameConn) fill(n int) error {
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

// read returns the next frame; the payload is valid until the next read.
func (f *frameConn) read() (typ uint16, seq uint64, payload []byte, err error) {
	if err = f.fill(frameHeader); err != nil {
		return 0, 0, nil, err
	}
	h := f.rbuf[f.r:]
	n := binary.LittleEndian.Uint32(h[0:])
	typ = binary.LittleEndian.Uint16(h[4:])
	seq = binary.LittleEndian.Uint64(h[8:])
	if n > maxFrame {
		return 0, 0, nil, fmt.Errorf("frame of %d bytes", n)
	}
	if err = f.fill(frameHeader + int(n)); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, 0, nil, err
	}
	f.in = append(f.in[:0], f.rbuf[f.r+frameHeader:f.r+frameHeader+int(n)]...)
	f.r += frameHeader + int(n)
	return typ, seq, f.in, nil
}

// listenUDS binds and listens on a SOCK_STREAM Unix socket.
func listenUDS(path string) (int, error) { return sys.ListenStream(path) }

// acceptUDS accepts one connection, waiting at most timeout.
func acceptUDS(lfd int, timeout time.Duration) (int, error) { return sys.AcceptStream(lfd, timeout) }

// udsClient is the Go client of the socket baseline: the same Poll record
// and the same reply record as connector.Client.Poll, framed on a socket.
type udsClient struct {
	fc  *frameConn
	seq uint64
	req []byte
}

func dialUDS(path string, timeout time.Duration) (*udsClient, error) {
	fd, err := sys.DialStream(path)
	if err != nil {
		return nil, err
	}
	fc, err := newFrameConn(fd, timeout)
	if err != nil {
		sys.Close(fd)
		return nil, err
	}
	return &udsClient{fc: fc}, nil
}

func (u *udsClient) close() error { return u.fc.close() }

func (u *udsClient) poll(lease uint64) (schema.LeaseReply, error) {
	var r schema.LeaseReply
	u.seq++
	u.req = schema.IDRequest{ID: lease}.Append(u.req[:0])
	if err := u.fc.write(schema.TypePoll, 0, u.seq, u.req); err != nil {
		return r, err
	}
	typ, seq, p, err := u.fc.read()
	if err != nil {
		return r, err
	}
	if typ != schema.TypePoll|schema.ReplyBit || seq != u.seq {
		return r, fmt.Errorf("reply type %#x seq %d, want %#x seq %d", typ, seq, schema.TypePoll|schema.ReplyBit, u.seq)
	}
	if err := r.Decode(p); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}
