package wire_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"reflect"
	"testing"

	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// Golden vectors: one message of each kind, as bytes. Regenerate with
//
//	go test ./sidecar/node/wire -run Golden -update
//
// and review the diff: any change to testdata/golden.json is a change of
// the wire (docs/protocol.md, section 17).
var update = flag.Bool("update", false, "rewrite testdata/golden.json")

func fp(b byte) (f [16]byte) {
	for i := range f {
		f[i] = b + byte(i)
	}
	return f
}

func dg(b byte, w int) (d [wire.DigestSize]byte) {
	for i := 0; i < w; i++ {
		d[i] = b ^ byte(i)
	}
	return d
}

func goldenMessages() []struct {
	name string
	msg  []byte
} {
	d1, d2 := dg(0xa0, 16), dg(0xb0, 16)
	return []struct {
		name string
		msg  []byte
	}{
		{"hello", wire.Message(wire.TypeHello, 1, wire.Hello{Pod: "vllm-0"}.Append)},
		{"hello_reply", wire.Message(wire.TypeHello|wire.ReplyBit, 1, wire.HelloReply{Status: wire.OK, WindowSlots: 64, SlotStride: 266240,
			MaxPayload: 262144, PoolBytes: 4 << 30, ShareBytes: 512 << 20, Epoch: 0x1122334455667788, MaxNamespaces: 64}.Append)},
		{"register", wire.Message(wire.TypeRegister, 2, wire.NS{FP: fp(1), Layout: 0xfeedface, Width: 16, World: 2}.Append)},
		{"register_reply", wire.Message(wire.TypeRegister|wire.ReplyBit, 2, wire.StatusReply{Status: wire.OK}.Append)},
		{"lookup", wire.Message(wire.TypeLookup, 3, wire.Lookup{FP: fp(1), Width: 16, Digests: append(d1[:16:16], d2[:16]...)}.Append)},
		{"lookup_reply", wire.Message(wire.TypeLookup|wire.ReplyBit, 3, wire.StatusReply{Status: wire.OK, Value: 1}.Append)},
		{"put", wire.Message(wire.TypePut, 5, func(b []byte) []byte {
			return wire.Items{FP: fp(1), Items: []wire.Item{{Digest: d2, Rank: 1, Slot: 7, Length: 4192}}}.Append(b)
		})},
		{"put_reply", wire.Message(wire.TypePut|wire.ReplyBit, 5, wire.ItemsReply{Status: wire.OK, Items: []wire.ItemReply{{Status: wire.Exists}}}.Append)},
		{"describe", wire.Message(wire.TypeDescribe, 6, wire.Describe{FP: fp(1), Entries: []wire.Entry{
			{Op: wire.OpStored, Digest: d1, Tokens: []uint32{1, 2, 3, 4}},
			{Op: wire.OpStored, HasParent: true, Digest: d2, Parent: d1, Tokens: []uint32{5, 6, 7, 8}, Extra: []byte("lora-a")},
		}}.Append)},
		{"describe_reply", wire.Message(wire.TypeDescribe|wire.ReplyBit, 6, wire.ItemsReply{Status: wire.OK, Items: []wire.ItemReply{{Status: wire.OK}, {Status: wire.NotFound}}}.Append)},
		{"fetch", wire.Message(wire.TypeFetch, 8, wire.Fetch{FP: fp(1), Items: []wire.FetchItem{{Digest: d1, Rank: 0, Offset: 3 << 18, Max: 1 << 18},
			{Digest: d1, Rank: 1, Offset: 9 << 18, Max: 1 << 18}}}.Append)},
		{"fetch_reply", wire.Message(wire.TypeFetch|wire.ReplyBit, 8, wire.FetchReply{Status: wire.OK, Items: []wire.FetchReplyItem{
			{Status: wire.OK, CRC: 0xdeadbeef, Length: 4096, Header: [wire.ValueHeaderSize]byte{0x52, 0x53, 0x4c, 0x32, 1}}, {Status: wire.NotResident}}}.Append)},
		{"events", wire.Message(wire.TypeEvents, 7, wire.Events{FP: fp(1), Cursor: 42, Max: 256}.Append)},
		{"events_reply", wire.Message(wire.TypeEvents|wire.ReplyBit, 7, wire.EventsReply{Status: wire.OK, Next: 45, Entries: []wire.Entry{
			{Op: wire.OpStored, HasParent: true, Digest: d2, Parent: d1, Tokens: []uint32{5, 6, 7, 8}},
			{Op: wire.OpRemoved, Digest: d1},
		}}.Append)},
	}
}

func TestGolden(t *testing.T) {
	const file = "testdata/golden.json"
	got := map[string]string{}
	for _, m := range goldenMessages() {
		got[m.name] = hex.EncodeToString(m.msg)
		if _, _, err := wire.DecodeHeader(m.msg); err != nil {
			t.Fatalf("%s: %v", m.name, err)
		}
	}
	if *update {
		b, _ := json.MarshalIndent(got, "", "  ")
		if err := os.WriteFile(file, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var want map[string]string
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("the wire changed (rerun with -update and review):\ngot  %v\nwant %v", got, want)
	}
}

// Hand-made vectors that every decoder must refuse.
func TestRefused(t *testing.T) {
	ok := wire.Message(wire.TypeRegister, 1, wire.NS{FP: fp(1), Layout: 1, Width: 16, World: 1}.Append)
	if _, _, err := wire.DecodeHeader(ok); err != nil {
		t.Fatal(err)
	}
	v1 := bytes.Clone(ok)
	v1[4] = 1
	if _, _, err := wire.DecodeHeader(v1); !errors.Is(err, wire.ErrVersion) {
		t.Fatalf("version 1: %v", err)
	}
	bad := bytes.Clone(ok)
	bad[0] = 'X'
	if _, _, err := wire.DecodeHeader(bad); !errors.Is(err, wire.ErrMalformed) {
		t.Fatalf("magic: %v", err)
	}
	for name, body := range map[string][]byte{
		"width 7":    wire.NS{FP: fp(1), Width: 7, World: 1}.Append(nil),
		"world 0":    wire.NS{FP: fp(1), Width: 8, World: 0}.Append(nil),
		"world 2000": wire.NS{FP: fp(1), Width: 8, World: 2000}.Append(nil),
		"short":      wire.NS{FP: fp(1), Width: 8, World: 1}.Append(nil)[:31],
	} {
		if _, err := wire.DecodeNS(body); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("%s: %v", name, err)
		}
	}
	for _, pod := range []string{"", "a/b", "x y", string(make([]byte, 64))} {
		if _, err := wire.DecodeHello(wire.Hello{Pod: pod}.Append(nil)); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("pod %q: %v", pod, err)
		}
	}
	many := wire.Items{Items: make([]wire.Item, wire.MaxItems+1)}
	if _, err := wire.DecodeItems(many.Append(nil)); !errors.Is(err, wire.ErrMalformed) {
		t.Errorf("65 items: %v", err)
	}
	if _, err := wire.DecodeItems(wire.Items{}.Append(nil)); !errors.Is(err, wire.ErrMalformed) {
		t.Errorf("no items: %v", err)
	}
	st := wire.Entry{Op: wire.OpStored, Tokens: []uint32{1}}
	for name, body := range map[string][]byte{
		"no entries":      wire.Describe{}.Append(nil),
		"a removal":       wire.Describe{Entries: []wire.Entry{{Op: wire.OpRemoved}}}.Append(nil),
		"op 3":            wire.Describe{Entries: []wire.Entry{{Op: 3}}}.Append(nil),
		"too many tokens": wire.Describe{Entries: []wire.Entry{{Op: wire.OpStored, Tokens: make([]uint32, wire.MaxDescTokens+1)}}}.Append(nil),
		"too much extra":  wire.Describe{Entries: []wire.Entry{{Op: wire.OpStored, Extra: make([]byte, wire.MaxDescExtra+1)}}}.Append(nil),
		"parent no flag":  wire.Describe{Entries: []wire.Entry{{Op: wire.OpStored, Parent: dg(1, 8)}}}.Append(nil),
		"trailing":        append(wire.Describe{Entries: []wire.Entry{st}}.Append(nil), 0),
		"truncated":       wire.Describe{Entries: []wire.Entry{st}}.Append(nil)[:24+wire.EntryHead+wire.DigestSize],
	} {
		if _, err := wire.DecodeDescribe(body); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("describe, %s: %v", name, err)
		}
	}
	for _, n := range []uint32{0, wire.MaxEvents + 1} {
		if _, err := wire.DecodeEvents(wire.Events{Max: n}.Append(nil)); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("events of %d: %v", n, err)
		}
	}
	rm := wire.EventsReply{Entries: []wire.Entry{{Op: wire.OpRemoved}}}.Append(nil)
	rm[16+1] = 1 // a removal with a parent flag
	if _, err := wire.DecodeEventsReply(rm); !errors.Is(err, wire.ErrMalformed) {
		t.Errorf("removal with flags: %v", err)
	}
	for name, body := range map[string][]byte{
		"no items":  wire.Fetch{}.Append(nil),
		"65 items":  wire.Fetch{Items: make([]wire.FetchItem, wire.MaxItems+1)}.Append(nil),
		"max 0":     wire.Fetch{Items: []wire.FetchItem{{Offset: 4096}}}.Append(nil),
		"truncated": wire.Fetch{Items: []wire.FetchItem{{Max: 1}}}.Append(nil)[:24+wire.FetchItemSize-1],
	} {
		if _, err := wire.DecodeFetch(body); !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("fetch, %s: %v", name, err)
		}
	}
	if _, err := wire.DecodeFetchReply(wire.FetchReply{Items: []wire.FetchReplyItem{{Status: wire.NotFound, Length: 1}}}.Append(nil)); !errors.Is(err, wire.ErrMalformed) {
		t.Errorf("fetch reply, a miss with a length: %v", err)
	}
	lk := wire.Lookup{Width: 16, Digests: make([]byte, 16*(wire.MaxLookup+1))}
	if _, err := wire.DecodeLookup(lk.Append(nil)); !errors.Is(err, wire.ErrMalformed) {
		t.Errorf("1025 digests: %v", err)
	}
}

// fuzzRoundTrip checks one decoder: an error wraps ErrMalformed; a value
// re-encodes to the very bytes it came from (the encodings are canonical).
func fuzzRoundTrip[T any](t *testing.T, b []byte, dec func([]byte) (T, error), enc func(T, []byte) []byte) {
	v, err := dec(b)
	if err != nil {
		if !errors.Is(err, wire.ErrMalformed) {
			t.Fatalf("error %v does not wrap ErrMalformed", err)
		}
		return
	}
	if b2 := enc(v, nil); !bytes.Equal(b, b2) {
		t.Fatalf("re-encoding differs:\nin  %x\nout %x", b, b2)
	}
}

func seeds(f *testing.F) {
	for _, m := range goldenMessages() {
		f.Add(m.msg[wire.HeaderSize:])
	}
}

func FuzzHeader(f *testing.F) {
	for _, m := range goldenMessages() {
		f.Add(m.msg)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, body, err := wire.DecodeHeader(b)
		if err != nil {
			if !errors.Is(err, wire.ErrMalformed) && !errors.Is(err, wire.ErrVersion) {
				t.Fatalf("error %v", err)
			}
			return
		}
		if got := append(h.Append(nil), body...); !bytes.Equal(got, b) {
			t.Fatalf("re-encoding differs")
		}
	})
}

func FuzzHello(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeHello, func(v wire.Hello, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzHelloReply(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeHelloReply, func(v wire.HelloReply, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzNS(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeNS, func(v wire.NS, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzStatusReply(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeStatusReply, func(v wire.StatusReply, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzLookup(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeLookup, func(v wire.Lookup, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzItems(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeItems, func(v wire.Items, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzItemsReply(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeItemsReply, func(v wire.ItemsReply, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzDescribe(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeDescribe, func(v wire.Describe, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzEvents(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeEvents, func(v wire.Events, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzEventsReply(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeEventsReply, func(v wire.EventsReply, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzFetch(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeFetch, func(v wire.Fetch, d []byte) []byte { return v.Append(d) })
	})
}

func FuzzFetchReply(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzRoundTrip(t, b, wire.DecodeFetchReply, func(v wire.FetchReply, d []byte) []byte { return v.Append(d) })
	})
}
