package reliability

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/ringside-kv/ringside/schema"
)

func init() {
	defect(Defect{Issue: 16, Point: 20, Title: "Request type 0x7FFF is answered with reply type 0xFFFF (the ring's pad type): the reply cannot be written and the session is dropped instead of getting status 2",
		Tests:  "TestUnknownRequestType",
		Before: "at d6f9fd5: \"request type 0x7fff: no reply under its seq: ring: peer closed the ring\", and the ping after it: peer closed (0x7FFE, 0x4000, 0x0100 answered status 2)",
		Fix:    "0x7FFF is reserved: it is answered with status 2 in a reply of record type 0x8000 (ReservedReplyType); the session goes on"})
}

// TestUnknownRequestType: every request type the sidecar does not know,
// 0x7FFF included (its reply type would be 0x7FFF|ReplyBit = 0xFFFF, the
// ring's pad type), is answered with status 2 (unknown type) under the
// request's seq, and the session stays usable. The reply is matched by seq
// only: what record type it carries is the sidecar's choice.
func TestUnknownRequestType(t *testing.T) {
	row := record(t, "Faults", "requests of unknown types: 0x7FFF (whose reply type would be the pad type 0xFFFF), 0x7FFE, 0x4000, 0x0100, each followed by a Ping",
		"each is answered with status 2 (unknown type), matched by seq; the session stays usable (the Ping after it works)", "")
	sc := startSidecar(t, newDir(t))
	for _, typ := range []uint16{0x7FFF, 0x7FFE, 0x4000, 0x0100} {
		t.Run(fmt.Sprintf("%#04x", typ), func(t *testing.T) {
			c := dial(t, opts(sc.sock, fmt.Sprintf("unknown-%04x", typ)))
			seq, err := c.Submit(typ, []byte{1, 2, 3, 4, 5, 6, 7, 8})
			if err != nil {
				t.Fatal(err)
			}
			b, err := c.Await(seq)
			st := "no reply"
			switch {
			case err != nil:
				t.Errorf("request type %#04x: no reply under its seq: %v", typ, err)
				st = err.Error()
			case len(b) < 4:
				t.Errorf("request type %#04x: a %d-byte reply", typ, len(b))
			default:
				s := schema.Status(binary.LittleEndian.Uint32(b))
				st = fmt.Sprintf("status %d", uint32(s))
				if s != schema.ErrCodeUnknownType {
					t.Errorf("request type %#04x answered with status %d, want %d (unknown type)", typ, uint32(s), uint32(schema.ErrCodeUnknownType))
				}
			}
			perr := c.Ping(uint64(typ))
			if perr != nil {
				t.Errorf("after request type %#04x the session is unusable: ping: %v", typ, perr)
			}
			row.add("%#04x: %s, then ping: %v", typ, short(st, 80), perr)
		})
	}
	checkAlive(t, sc)
}
