// Package kvevents reads an inference engine's KV cache events, the stream
// cache-aware routers consume: vLLM's ZMQ publisher (three-frame messages
// [topic, seq u64 big-endian, msgpack payload]) and its replay socket. It
// decodes what routers' decoders accept (llm-d's vLLM adapter, Dynamo's
// ZMQ relay): a payload is an array batch [ts, events, dp rank?]; an event
// is a tagged array ["BlockStored", block_hashes, parent, ...] (vLLM before
// 0.28) or a map with a "type" key (vLLM 0.28 on); a block hash is an
// integer or bytes (the last 8 bytes, big-endian, as llm-d reads them).
// It keeps one pod's blocks per tier (Index), detects gaps in the sequence
// and fills them from the replay socket (Stream).
package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
)

// ErrMalformed is wrapped by every decoding error.
var ErrMalformed = errors.New("kvevents: malformed")

// MaxPayload bounds one message's payload (vLLM's batches are a step's
// events: kilobytes to a few megabytes).
const MaxPayload = 64 << 20

// Event types.
const (
	BlockStored      = "BlockStored"
	BlockRemoved     = "BlockRemoved"
	AllBlocksCleared = "AllBlocksCleared"
)

// Event is one decoded event. Optional fields are nil when the event does
// not carry them (older engines, omitted defaults).
type Event struct {
	Type        string   `json:"type"`
	BlockHashes []uint64 `json:"block_hashes,omitempty"`
	Parent      *uint64  `json:"parent_block_hash,omitempty"`
	TokenIDs    []uint32 `json:"token_ids,omitempty"`
	BlockSize   int      `json:"block_size,omitempty"`
	LoraID      *int64   `json:"lora_id,omitempty"`
	Medium      string   `json:"medium,omitempty"` // as sent ("GPU", "CPU"); Tier() lowercases
	LoraName    *string  `json:"lora_name,omitempty"`
	ExtraKeys   any      `json:"extra_keys,omitempty"`
	GroupIdx    *int64   `json:"group_idx,omitempty"`
	SpecKind    *string  `json:"kv_cache_spec_kind,omitempty"`
	SlidingWin  *int64   `json:"kv_cache_spec_sliding_window,omitempty"`
	Locality    *string  `json:"locality,omitempty"`
	Ownership   *string  `json:"ownership,omitempty"`
	SessionID   *string  `json:"session_id,omitempty"`
}

// Tier is the event's storage tier as routers key it: the medium in lower
// case, "gpu" when the event names none (llm-d's default).
func (e *Event) Tier() string {
	if e.Medium == "" {
		return "gpu"
	}
	return strings.ToLower(e.Medium)
}

// Batch is one published batch.
type Batch struct {
	TS     float64 `json:"ts"`
	Events []Event `json:"events"`
	DPRank *int64  `json:"data_parallel_rank,omitempty"`
}

// Message is one message of the stream: its topic, sequence number and
// batch.
type Message struct {
	Topic string
	Seq   uint64
	Batch Batch
	raw   string // the payload
}

// Payload returns the message's msgpack payload as received.
func (m *Message) Payload() []byte { return []byte(m.raw) }

// EndSeq is the sequence number of the replay socket's end marker (-1).
const EndSeq = math.MaxUint64

// DecodeFrames decodes a message of exactly three frames: topic, an 8-byte
// big-endian sequence number and the msgpack payload.
func DecodeFrames(frames [][]byte) (Message, error) {
	if len(frames) != 3 {
		return Message{}, fmt.Errorf("%w: %d frames, want 3 (topic, seq, payload)", ErrMalformed, len(frames))
	}
	if len(frames[1]) != 8 {
		return Message{}, fmt.Errorf("%w: a sequence number of %d bytes, want 8", ErrMalformed, len(frames[1]))
	}
	b, err := DecodeBatch(frames[2])
	if err != nil {
		return Message{}, err
	}
	return Message{Topic: string(frames[0]), Seq: binary.BigEndian.Uint64(frames[1]), Batch: b, raw: string(frames[2])}, nil
}

// DecodeBatch decodes one payload.
func DecodeBatch(p []byte) (Batch, error) {
	if len(p) > MaxPayload {
		return Batch{}, fmt.Errorf("%w: payload of %d bytes, at most %d", ErrMalformed, len(p), MaxPayload)
	}
	if err := scan(p); err != nil {
		return Batch{}, err
	}
	r := bytes.NewReader(p)
	d := msgpack.NewDecoder(r) // exact types: bin ([]byte hashes) stays apart from str
	v, err := d.DecodeInterface()
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if r.Len() != 0 {
		return Batch{}, fmt.Errorf("%w: %d bytes after the batch", ErrMalformed, r.Len())
	}
	arr, ok := v.([]any)
	if !ok || len(arr) < 2 || len(arr) > 3 {
		return Batch{}, fmt.Errorf("%w: a batch is an array [ts, events, dp rank?], got %s", ErrMalformed, kind(v))
	}
	var b Batch
	if b.TS, ok = num(arr[0]); !ok {
		return Batch{}, fmt.Errorf("%w: batch ts is %s", ErrMalformed, kind(arr[0]))
	}
	evs, ok := arr[1].([]any)
	if !ok {
		return Batch{}, fmt.Errorf("%w: batch events are %s", ErrMalformed, kind(arr[1]))
	}
	if len(arr) == 3 && arr[2] != nil {
		r, ok := integer(arr[2])
		if !ok {
			return Batch{}, fmt.Errorf("%w: data parallel rank is %s", ErrMalformed, kind(arr[2]))
		}
		b.DPRank = &r
	}
	b.Events = make([]Event, 0, len(evs))
	for i, ev := range evs {
		e, err := decodeEvent(ev)
		if err != nil {
			return Batch{}, fmt.Errorf("event %d: %w", i, err)
		}
		b.Events = append(b.Events, e)
	}
	return b, nil
}

// Field order of the tagged-array (positional) form, after the tag: vLLM's
// struct fields in declaration order.
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"}
	removedFields = []string{"block_hashes", "medium", "group_idx", "locality", "ownership"}
)

func decodeEvent(v any) (Event, error) {
	var fields map[string]any
	var typ string
	switch x := v.(type) {
	case []any:
		if len(x) == 0 {
			return Event{}, fmt.Errorf("%w: an empty tagged event", ErrMalformed)
		}
		t, ok := x[0].(string)
		if !ok {
			return Event{}, fmt.Errorf("%w: event tag is %s", ErrMalformed, kind(x[0]))
		}
		typ = t
		var names []string
		switch t {
		case BlockStored:
			names = storedFields
		case BlockRemoved:
			names = removedFields
		}
		if len(x)-1 > len(names) && t != AllBlocksCleared {
			return Event{}, fmt.Errorf("%w: %s with %d fields, at most %d", ErrMalformed, t, len(x)-1, len(names))
		}
		fields = make(map[string]any, len(x)-1)
		for i, f := range x[1:] {
			if i < len(names) {
				fields[names[i]] = f
			}
		}
	case map[string]any:
		t, ok := x["type"].(string)
		if !ok {
			return Event{}, fmt.Errorf("%w: an event map without a string \"type\"", ErrMalformed)
		}
		typ, fields = t, x
	default:
		return Event{}, fmt.Errorf("%w: an event is a tagged array or a map, got %s", ErrMalformed, kind(v))
	}
	e := Event{Type: typ}
	switch typ {
	case AllBlocksCleared:
		return e, nil
	case BlockStored, BlockRemoved:
	default:
		return Event{}, fmt.Errorf("%w: unknown event type %q", ErrMalformed, typ)
	}
	hs, ok := fields["block_hashes"].([]any)
	if !ok {
		return Event{}, fmt.Errorf("%w: %s block_hashes is %s", ErrMalformed, typ, kind(fields["block_hashes"]))
	}
	for _, h := range hs {
		u, err := Hash(h)
		if err != nil {
			return Event{}, err
		}
		e.BlockHashes = append(e.BlockHashes, u)
	}
	var err error
	if e.Medium, err = optString(fields, "medium"); err != nil {
		return Event{}, err
	}
	if e.GroupIdx, err = optInt(fields, "group_idx"); err != nil {
		return Event{}, err
	}
	if e.Locality, err = optStringPtr(fields, "locality"); err != nil {
		return Event{}, err
	}
	if e.Ownership, err = optStringPtr(fields, "ownership"); err != nil {
		return Event{}, err
	}
	if typ == BlockRemoved {
		return e, nil
	}
	if p := fields["parent_block_hash"]; p != nil {
		u, err := Hash(p)
		if err != nil {
			return Event{}, err
		}
		e.Parent = &u
	}
	if t := fields["token_ids"]; t != nil {
		ts, ok := t.([]any)
		if !ok {
			return Event{}, fmt.Errorf("%w: token_ids is %s", ErrMalformed, kind(t))
		}
		e.TokenIDs = make([]uint32, len(ts))
		for i, x := range ts {
			n, ok := integer(x)
			if !ok || n < 0 || n > math.MaxUint32 {
				return Event{}, fmt.Errorf("%w: token id %v", ErrMalformed, x)
			}
			e.TokenIDs[i] = uint32(n)
		}
	}
	bs, err := optInt(fields, "block_size")
	if err != nil {
		return Event{}, err
	}
	if bs != nil {
		if *bs < 0 || *bs > math.MaxInt32 {
			return Event{}, fmt.Errorf("%w: block_size %d", ErrMalformed, *bs)
		}
		e.BlockSize = int(*bs)
	}
	if e.LoraID, err = optInt(fields, "lora_id"); err != nil {
		return Event{}, err
	}
	if e.LoraName, err = optStringPtr(fields, "lora_name"); err != nil {
		return Event{}, err
	}
	if e.SpecKind, err = optStringPtr(fields, "kv_cache_spec_kind"); err != nil {
		return Event{}, err
	}
	if e.SlidingWin, err = optInt(fields, "kv_cache_spec_sliding_window"); err != nil {
		return Event{}, err
	}
	if e.SessionID, err = optStringPtr(fields, "session_id"); err != nil {
		return Event{}, err
	}
	e.ExtraKeys = fields["extra_keys"]
	return e, nil
}

// Hash reads a block hash as routers do: an integer as its 64 bits, bytes
// as their last 8 bytes big-endian (shorter ones padded with leading
// zeros).
func Hash(v any) (uint64, error) {
	switch x := v.(type) {
	case uint64:
		return x, nil
	case []byte:
		if len(x) == 0 {
			return 0, fmt.Errorf("%w: an empty hash", ErrMalformed)
		}
		var b [8]byte
		if len(x) >= 8 {
			copy(b[:], x[len(x)-8:])
		} else {
			copy(b[8-len(x):], x)
		}
		return binary.BigEndian.Uint64(b[:]), nil
	}
	if n, ok := integer(v); ok {
		return uint64(n), nil // a negative (signed) hash keeps its 64 bits
	}
	return 0, fmt.Errorf("%w: a hash is an integer or bytes, got %s", ErrMalformed, kind(v))
}

func optString(f map[string]any, k string) (string, error) {
	p, err := optStringPtr(f, k)
	if p == nil {
		return "", err
	}
	return *p, err
}

func optStringPtr(f map[string]any, k string) (*string, error) {
	v, ok := f[k]
	if !ok || v == nil {
		return nil, nil
	}
	s, ok := v.(string)
	if !ok {
		return nil, fmt.Errorf("%w: %s is %s", ErrMalformed, k, kind(v))
	}
	return &s, nil
}

func optInt(f map[string]any, k string) (*int64, error) {
	v, ok := f[k]
	if !ok || v == nil {
		return nil, nil
	}
	n, ok := integer(v)
	if !ok {
		return nil, fmt.Errorf("%w: %s is %s", ErrMalformed, k, kind(v))
	}
	return &n, nil
}

func integer(v any) (int64, bool) {
	switch x := v.(type) {
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	case uint64:
		if x > math.MaxInt64 {
			return 0, false
		}
		return int64(x), true
	}
	return 0, false
}

func num(v any) (float64, bool) {
	switch x := v.(type) {
	case float64:
		return x, true
	case float32:
		return float64(x), true
	case uint64:
		return float64(x), true
	}
	if n, ok := integer(v); ok {
		return float64(n), true
	}
	return 0, false
}

func kind(v any) string {
	if v == nil {
		return "nil"
	}
	return fmt.Sprintf("%T", v)
}
