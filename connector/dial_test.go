package connector

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/ringside-kv/ringside/schema"
)

// seqpacketPair returns the two ends of a connected SOCK_SEQPACKET pair.
func seqpacketPair(t *testing.T) (client, sidecar *net.UnixConn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "seqpacket")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
		t.Cleanup(func() { conns[i].Close() })
	}
	return conns[0], conns[1]
}

// The attach reply is read once more after an end of file, and only then.
// "early EOF" is what Linux returns when a refusal and the sidecar's close
// land between the two checks of one read (docs/protocol.md, section 4.1):
// the read reports end of file although the refusal is queued. That
// interleaving cannot be forced from user space, so the first read returns
// what the kernel returned then, and the reads after it read the socket.
func TestReadAttachReply(t *testing.T) {
	refusal := (&schema.AttachReply{Version: schema.Version, Status: schema.ErrCodeTooLarge, Message: "over the bound"}).Append(nil)
	cases := []struct {
		name    string
		reply   bool  // the sidecar wrote the refusal before closing
		first   error // what the first read returns instead of reading (nil: it reads)
		reads   int
		refused bool // the refusal was read
		err     error
	}{
		{name: "reply then close", reply: true, reads: 1, refused: true},
		{name: "early EOF, reply queued", reply: true, first: io.EOF, reads: 2, refused: true},
		{name: "close without a reply", reads: 2, err: io.EOF},
		{name: "early EOF, nothing queued", first: io.EOF, reads: 2, err: io.EOF},
		{name: "another error is not retried", reply: true, first: syscall.ECONNRESET, reads: 1, err: syscall.ECONNRESET},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			client, sidecar := seqpacketPair(t)
			if tc.reply {
				if _, err := sidecar.Write(refusal); err != nil {
					t.Fatal(err)
				}
			}
			sidecar.Close()
			b, oob := make([]byte, 8192), make([]byte, syscall.CmsgSpace(8))
			reads := 0
			n, _, err := readAttachReply(func() (int, int, error) {
				reads++
				if reads == 1 && tc.first != nil {
					return 0, 0, tc.first
				}
				n, oobn, _, _, err := client.ReadMsgUnix(b, oob)
				return n, oobn, err
			})
			if reads != tc.reads {
				t.Errorf("%d reads, want %d", reads, tc.reads)
			}
			if !errors.Is(err, tc.err) {
				t.Fatalf("error %v, want %v", err, tc.err)
			}
			if !tc.refused {
				return
			}
			var r schema.AttachReply
			if err := r.Decode(b[:n]); err != nil || r.Status != schema.ErrCodeTooLarge || r.Message != "over the bound" {
				t.Fatalf("reply %+v (%v), want the refusal", r, err)
			}
		})
	}
}
