package schema_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/ringside-kv/ringside/schema"
)

// Samples of the event records (their golden vectors are in samples()).
var (
	sDescribe = schema.Describe{Runs: []schema.DescribeRun{
		{Digests: digests(2, 16, 0x31), TokensPerBlock: 4, Tokens: seq(32, 0x40)},
		{Parent: digests(1, 16, 0x51), Digests: digests(1, 16, 0x61), TokensPerBlock: 2, Tokens: seq(8, 0x70), Extra: []byte("lora-a")},
	}}
	sEvents        = schema.Changes{Epoch: 0xCAFEBABE12345678, Seq: 0x10000000107, Max: 64}
	sEventSnapshot = schema.Snapshot{From: 96, Max: 8}
	sEventsReply8  = schema.EventsReply{Status: schema.OK, Epoch: 0xCAFEBABE12345678, Seq: 0x1000000010A, Width: 8, Count: 3,
		Entries: events(8,
			schema.Event{Op: schema.EventStored, Digest: digests(1, 8, 0x11), Tokens: seq(8, 0x20)},
			schema.Event{Op: schema.EventStored, Digest: digests(1, 8, 0x12), Parent: digests(1, 8, 0x11), Tokens: seq(8, 0x28), Extra: []byte("x")},
			schema.Event{Op: schema.EventRemoved, Digest: digests(1, 8, 0x13)},
		)}
	sEventsReply32 = schema.EventsReply{Status: schema.OK, Done: true, Epoch: 0xCAFEBABE12345678, Seq: 0x10000000100, Next: 1 << 20, Width: 32, Count: 1,
		Entries: events(32, schema.Event{Op: schema.EventStored, Digest: digests(1, 32, 0x41), Parent: digests(1, 32, 0x42), Tokens: seq(16, 0x50)})}
	sEventsResync = schema.EventsReply{Status: schema.OK, Resync: true, Epoch: 0xCAFEBABE12345678, Seq: 0x10000000000, Width: 16}
)

func events(width int, es ...schema.Event) []byte {
	var b []byte
	for i := range es {
		if len(es[i].Digest) != width {
			panic("sample event of the wrong width")
		}
		b = schema.AppendEvent(b, &es[i])
	}
	return b
}

func decDescribe(width int) func([]byte) (any, error) {
	return func(b []byte) (any, error) { var m schema.Describe; err := m.Decode(b, width); return m, err }
}

func decEventsReply(b []byte) (any, error) {
	var m schema.EventsReply
	err := m.Decode(b)
	return m, err
}

func TestDescribeLimits(t *testing.T) {
	run := func(blocks, tokens, extra int) schema.DescribeRun {
		return schema.DescribeRun{Digests: digests(blocks, 8, 1), TokensPerBlock: uint16(tokens), Tokens: make([]byte, 4*blocks*tokens), Extra: make([]byte, extra)}
	}
	ok := []schema.Describe{
		{Runs: []schema.DescribeRun{run(schema.MaxDescribeBlocks, 1, 0)}},
		{Runs: []schema.DescribeRun{run(1, schema.MaxDescribeTokens, schema.MaxDescribeExtra)}},
		{Runs: []schema.DescribeRun{run(schema.MaxDescribeBlocks/2, 1, 0), run(schema.MaxDescribeBlocks/2, 1, 0)}},
		{},
	}
	for i, m := range ok {
		var got schema.Describe
		if err := got.Decode(m.Append(nil, 8), 8); err != nil {
			t.Errorf("ok %d: %v", i, err)
		}
	}
	bad := map[string][]byte{
		"blocks":    (&schema.Describe{Runs: []schema.DescribeRun{run(schema.MaxDescribeBlocks+1, 1, 0)}}).Append(nil, 8),
		"two runs":  (&schema.Describe{Runs: []schema.DescribeRun{run(schema.MaxDescribeBlocks, 1, 0), run(1, 1, 0)}}).Append(nil, 8),
		"tokens":    (&schema.Describe{Runs: []schema.DescribeRun{run(1, schema.MaxDescribeTokens+1, 0)}}).Append(nil, 8),
		"no tokens": (&schema.Describe{Runs: []schema.DescribeRun{run(1, 0, 0)}}).Append(nil, 8),
		"extra":     (&schema.Describe{Runs: []schema.DescribeRun{run(1, 1, schema.MaxDescribeExtra+1)}}).Append(nil, 8),
		"no blocks": (&schema.Describe{Runs: []schema.DescribeRun{run(0, 1, 0)}}).Append(nil, 8),
		"run flags": flip(sDescribe.Append(nil, 16), 16, 2),
		"flags":     flip(sDescribe.Append(nil, 16), 4, 1),
		"truncated": sDescribe.Append(nil, 16)[:30],
		"trailing":  append(sDescribe.Append(nil, 16), 0),
		"many runs": append([]byte{0xff, 0xff, 0, 0, 0, 0, 0, 0}, make([]byte, 64)...),
	}
	for name, b := range bad {
		var got schema.Describe
		wantMalformed(t, got.Decode(b, 16), "Describe %s", name)
	}
	var got schema.Describe
	wantMalformed(t, got.Decode(sDescribe.Append(nil, 16), 12), "Describe of width 12")
}

func flip(b []byte, off int, v byte) []byte { b[off] ^= v; return b }

func TestEventsReplyChecks(t *testing.T) {
	base := sEventsReply8.Append(nil)
	bad := map[string][]byte{
		"width":        flip(sEventsReply8.Append(nil), 36, 1),
		"count":        flip(sEventsReply8.Append(nil), 32, 0x08), // 3 -> 11 entries
		"op":           flip(sEventsReply8.Append(nil), 40, 4),
		"flags":        flip(sEventsReply8.Append(nil), 41, 2),
		"removed+toks": removedWithTokens(),
		"truncated":    base[:len(base)-1],
		"trailing":     append(sEventsReply8.Append(nil), 0),
	}
	for name, b := range bad {
		var got schema.EventsReply
		wantMalformed(t, got.Decode(b), "EventsReply %s", name)
	}
	m := schema.EventsReply{Width: 8, Count: schema.MaxEventsPerReply + 1}
	for range m.Count {
		m.Entries = schema.AppendEvent(m.Entries, &schema.Event{Op: schema.EventRemoved, Digest: make([]byte, 8)})
	}
	var got schema.EventsReply
	wantMalformed(t, got.Decode(m.Append(nil)), "EventsReply of %d entries", m.Count)
	m.Count--
	m.Entries = m.Entries[:len(m.Entries)-16]
	if err := got.Decode(m.Append(nil)); err != nil || got.Count != schema.MaxEventsPerReply {
		t.Fatalf("%d entries: %v", m.Count, err)
	}
}

func removedWithTokens() []byte {
	m := schema.EventsReply{Width: 8, Count: 1, Entries: schema.AppendEvent(nil, &schema.Event{Op: schema.EventRemoved, Digest: make([]byte, 8), Tokens: make([]byte, 4)})}
	return m.Append(nil)
}

func TestEventsReplyIteration(t *testing.T) {
	var got schema.EventsReply
	if err := got.Decode(sEventsReply8.Append(nil)); err != nil {
		t.Fatal(err)
	}
	var ops []uint8
	got.Events(func(e *schema.Event) bool {
		ops = append(ops, e.Op)
		switch len(ops) {
		case 1:
			if e.Parent != nil || e.TokenCount() != 2 || e.Token(0) != 0x23222120 {
				t.Errorf("first: %+v", e)
			}
		case 2:
			if !bytes.Equal(e.Parent, digests(1, 8, 0x11)) || string(e.Extra) != "x" {
				t.Errorf("second: %+v", e)
			}
		}
		return true
	})
	if !bytes.Equal(ops, []byte{1, 1, 2}) {
		t.Fatalf("ops %v", ops)
	}
	n := 0
	got.Events(func(*schema.Event) bool { n++; return false })
	if n != 1 {
		t.Fatalf("stopping: %d calls", n)
	}
	if s := schema.EventSize(8, 2, 1, true); s != 8+8+8+8+1 {
		t.Fatalf("EventSize %d", s)
	}
	if !errors.Is(got.Decode(nil), schema.ErrMalformed) {
		t.Fatal("empty reply decoded")
	}
}

func FuzzDescribe(f *testing.F) {
	seeds(f, sDescribe.Append(nil, 16), (&schema.Describe{Runs: []schema.DescribeRun{{Digests: digests(1, 32, 2), TokensPerBlock: 1, Tokens: seq(4, 1)}}}).Append(nil, 32))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, w := range []int{8, 16, 32} {
			fuzzCodec(t, b, decDescribe(w), func(v any) []byte { m := v.(schema.Describe); return m.Append(nil, w) })
		}
	})
}

func FuzzEventsReply(f *testing.F) {
	seeds(f, sEventsReply8.Append(nil), sEventsReply32.Append(nil), sEventsResync.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decEventsReply, func(v any) []byte { m := v.(schema.EventsReply); return m.Append(nil) })
	})
}
