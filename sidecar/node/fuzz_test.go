package node

import (
	"testing"

	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// FuzzServe sends one arbitrary message, after a valid Hello and a
// Register, to a live node process over its socket: the node answers it or
// ends the connection, never panics, keeps its index consistent, and goes
// on serving another sidecar's block byte for byte.
//
//	go test -run '^$' -fuzz '^FuzzServe$' -fuzztime 30s ./sidecar/node/
func FuzzServe(f *testing.F) {
	for _, m := range [][]byte{
		wire.Message(wire.TypeLookup, 7, wire.Lookup{FP: testNS.FP, Width: 16, Digests: digest(1)}.Append),
		wire.Message(wire.TypeFetch, 7, func(b []byte) []byte {
			it := wire.FetchItem{Offset: testSlot, Max: testSlot}
			copy(it.Digest[:], digest(1))
			return wire.Fetch{FP: testNS.FP, Items: []wire.FetchItem{it}}.Append(b)
		}),
		wire.Message(wire.TypePut, 7, func(b []byte) []byte {
			it := wire.Item{Slot: 2, Length: l2.HeaderSize + testSlot}
			copy(it.Digest[:], digest(2))
			return wire.Items{FP: testNS.FP, Items: []wire.Item{it}}.Append(b)
		}),
		wire.Message(wire.TypeRegister, 7, wireNS(otherNS).Append),
		wire.Message(wire.TypeDescribe, 7, wire.Describe{FP: testNS.FP, Entries: []wire.Entry{descOf(1, -1), descOf(2, 1)}}.Append),
		wire.Message(wire.TypeEvents, 7, wire.Events{FP: testNS.FP, Cursor: 1, Max: 8}.Append),
		wire.Message(wire.TypeHello, 7, wire.Hello{Pod: "x"}.Append),
		{1, 2, 3},
	} {
		f.Add(m, byte(0))
	}
	s := startServer(f, nil)
	good := newTestClient(f, s.Socket(), "good")
	good.write(f, 1, 0)
	waitFor(f, "stored", func() bool { return good.Stats().WritesOK.Load() == 1 })
	f.Fuzz(func(t *testing.T, msg []byte, scribble byte) {
		r := rawDial(t, s.Socket(), "fuzz")
		r.register(testNS)
		// A window slot holding a value, maybe mangled.
		p := make([]byte, testSlot)
		w := r.win.Bytes()[2*r.rep.SlotStride:]
		n := l2.PutValue(w, testNS, digest(2), 0, p)
		w[int(scribble)%n] ^= scribble
		if err := r.send(msg); err == nil {
			r.recv()
		}
		r.sock.Close()
		if bad := s.checkIndex(); len(bad) > 0 {
			t.Fatalf("index: %v", bad)
		}
		if got := good.fetch(t, 1); !got[0] {
			t.Fatal("the good sidecar's block is gone")
		}
	})
}
