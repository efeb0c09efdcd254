package ring_test

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/wiregen"
	"github.com/ringside-kv/ringside/ring"
)

// Golden byte vectors shared with the Python connector
// (connector/python/tests/test_golden.py). Regenerate with
//
//	go test ./ring -run Golden -update
//
// and review the diff: any change to these files is a wire-format change.

var goldenUpdate = flag.Bool("update", false, "rewrite testdata/golden/ring from the Go encoding")

const goldenDir = "../testdata/golden/ring"

type goldenHeader struct {
	Magic         uint64 `json:"magic"`
	Version       uint32 `json:"version"`
	HeaderSize    uint32 `json:"header_size"`
	Capacity      uint64 `json:"capacity"`
	Align         uint32 `json:"align"`
	MaxRecord     uint32 `json:"max_record"`
	Epoch         uint64 `json:"epoch"`
	Flags         uint32 `json:"flags"`
	ProducerPID   uint32 `json:"producer_pid"`
	ProducerStart uint64 `json:"producer_start"`
	ConsumerPID   uint32 `json:"consumer_pid"`
	ConsumerStart uint64 `json:"consumer_start"`
}

type goldenRecord struct {
	Name       string `json:"name"`
	Len        uint32 `json:"len"`
	Type       uint16 `json:"type"`
	Flags      uint16 `json:"flags"`
	Seq        uint64 `json:"seq"`
	PayloadHex string `json:"payload_hex"`
	Note       string `json:"note,omitempty"`
	Hex        string `json:"hex"`
}

// goldenStep is one operation of the ring-image script: "append" a record
// whose payload follows PayloadRule, "publish", or "consume" Count records
// (Next each, then one Commit).
type goldenStep struct {
	Op    string `json:"op"`
	Len   int    `json:"len,omitempty"`
	Type  uint16 `json:"type,omitempty"`
	Flags uint16 `json:"flags,omitempty"`
	Seq   uint64 `json:"seq,omitempty"`
	Count int    `json:"count,omitempty"`
}

type goldenImage struct {
	Note      string         `json:"note"`
	Capacity  uint64         `json:"capacity"`
	MaxRecord uint32         `json:"max_record"`
	Epoch     uint64         `json:"epoch"`
	Flags     uint32         `json:"flags"`
	Peers     goldenHeader   `json:"peers"` // only the pid and start fields are used
	Steps     []goldenStep   `json:"steps"`
	Tail      uint64         `json:"tail"`
	Head      uint64         `json:"head"`
	Remaining []goldenRecord `json:"remaining"` // unconsumed records, in order
	File      string         `json:"file"`
}

type goldenManifest struct {
	Comment     string         `json:"comment"`
	PayloadRule string         `json:"payload_rule"`
	Header      goldenHeader   `json:"header"`
	HeaderFile  string         `json:"header_file"`
	Records     []goldenRecord `json:"records"`
	Image       goldenImage    `json:"image"`
	// Every wire constant of the package, header offsets included
	// (internal/wiregen's list, the same that _wire_ring.py is generated from):
	// connector/python/tests/test_wire.py checks the Python client against
	// them.
	Constants []goldenConst `json:"constants"`
}

type goldenConst struct {
	Name   string `json:"name"`   // Go name
	Python string `json:"python"` // public Python name (ringside.ring)
	Type   string `json:"type"`   // Go type
	Value  uint64 `json:"value"`
}

// goldenPayload is the payload of a record with sequence number seq.
func goldenPayload(seq uint64, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(seq*31 + uint64(i))
	}
	return b
}

func goldenRecordBytes(rh ring.RecordHeader, payload []byte) []byte {
	b := make([]byte, ring.RecordSize(len(payload)))
	ring.PutRecordHeader(b, rh)
	copy(b[ring.RecordHeaderSize:], payload)
	return b
}

var (
	goldenPeers = goldenHeader{ProducerPID: 4242, ProducerStart: 123456789, ConsumerPID: 4343, ConsumerStart: 987654321}
	goldenSteps = []goldenStep{
		{Op: "append", Len: 0, Type: 1, Seq: 1},
		{Op: "append", Len: 5, Type: 1, Seq: 2},
		{Op: "append", Len: 16, Type: 2, Flags: 0x8001, Seq: 3},
		{Op: "publish"},
		{Op: "append", Len: 1000, Type: 1, Seq: 4}, // a batch: three appends, one publish
		{Op: "append", Len: 1000, Type: 1, Seq: 5},
		{Op: "append", Len: 1000, Type: 1, Seq: 6},
		{Op: "publish"},
		{Op: "consume", Count: 6},
		{Op: "append", Len: 1000, Type: 3, Flags: 7, Seq: 7}, // 976 bytes left: pad record, wrap
		{Op: "publish"},
		{Op: "consume", Count: 1},
		{Op: "append", Len: 1000, Type: 1, Seq: 8},
		{Op: "append", Len: 1000, Type: 1, Seq: 9},
		{Op: "append", Len: 1000, Type: 1, Seq: 10},
		{Op: "append", Len: 8, Type: 1, Seq: 11}, // ends at offset 4088
		{Op: "publish"},
		{Op: "consume", Count: 4},
		{Op: "append", Len: 1, Type: 1, Seq: 12}, // 8 bytes left: tail gap, wrap
		{Op: "append", Len: 7, Type: 1, Seq: 13},
		{Op: "append", Len: 24, Type: 4, Flags: 0xffff, Seq: 0xfedcba9876543210},
		{Op: "publish"},
		{Op: "consume", Count: 1},
	}
)

const goldenEpoch = 0x0123456789abcdef

func buildGolden(t *testing.T) (goldenManifest, map[string][]byte) {
	t.Helper()
	files := map[string][]byte{}
	m := goldenManifest{
		Comment: "ringside ring layout v1 golden vectors; generated by `go test ./ring -run Golden -update`; hex files: lowercase, 32 bytes per line; " +
			"constants: every wire constant of package ring (python: its public name in ringside.ring)",
		PayloadRule: "payload byte i of the record with sequence number seq is (seq*31 + i) & 0xff",
		HeaderFile:  "header.hex",
	}
	wm, err := wiregen.Load(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range wm.Consts {
		m.Constants = append(m.Constants, goldenConst{Name: c.Name, Python: c.Python, Type: c.Type, Value: c.Value})
	}

	// 1. A header page.
	h := ring.Header{
		Magic: ring.Magic, Version: ring.Version, HeaderSize: ring.HeaderSize, Capacity: 65536,
		Align: ring.Align, MaxRecord: 16384, Epoch: goldenEpoch, Flags: ring.FlagCreatorProducer,
		ProducerPID: 1234, ProducerStart: 5678901, ConsumerPID: 4321, ConsumerStart: 1098765,
	}
	hb := make([]byte, ring.HeaderSize)
	ring.EncodeHeader(hb, &h)
	m.Header = goldenHeader(h)
	files[m.HeaderFile] = hb

	// 2. Single records.
	recs := []struct {
		name, note string
		rh         ring.RecordHeader
		payload    []byte
	}{
		{"empty", "", ring.RecordHeader{Len: 0, Type: 1, Seq: 1}, nil},
		{"five", "5-byte payload, 3 bytes of zero padding", ring.RecordHeader{Len: 5, Type: 2, Flags: 0x0102, Seq: 2}, goldenPayload(2, 5)},
		{"sixteen", "", ring.RecordHeader{Len: 16, Type: 0x1234, Flags: 0xffff, Seq: 0xfedcba9876543210}, goldenPayload(3, 16)},
		{"pad", "pad record covering 56 bytes: only its 16-byte header is written", ring.RecordHeader{Len: 40, Type: ring.TypePad}, nil},
	}
	for _, r := range recs {
		var b []byte
		if r.rh.Type == ring.TypePad {
			b = make([]byte, ring.RecordHeaderSize)
			ring.PutRecordHeader(b, r.rh)
		} else {
			b = goldenRecordBytes(r.rh, r.payload)
		}
		m.Records = append(m.Records, goldenRecord{
			Name: r.name, Len: r.rh.Len, Type: r.rh.Type, Flags: r.rh.Flags, Seq: r.rh.Seq,
			PayloadHex: hex.EncodeToString(r.payload), Note: r.note, Hex: hex.EncodeToString(b),
		})
	}

	// 3. A whole ring image after a fixed script.
	img := goldenImage{
		Note: "Format(capacity 4096, max record 0 = default, epoch, flags), take both roles, run steps, " +
			"then overwrite the producer/consumer pid and start-time words with peers' values",
		Capacity: 4096, MaxRecord: 0, Epoch: goldenEpoch, Flags: ring.FlagCreatorProducer,
		Peers: goldenPeers, Steps: goldenSteps, File: "ring4096.hex",
	}
	mem := shm.Aligned(ring.HeaderSize + int(img.Capacity))
	r, err := ring.Format(mem, img.Capacity, img.MaxRecord, img.Epoch, img.Flags)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ring.NewProducer(r, ring.DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	c, err := ring.NewConsumer(r, ring.DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	// The image pins the bytes a consumer leaves behind when it releases
	// records untouched (the Python client, a release build), not the
	// poison of a build with invariants.
	ring.KeepReleased(c)
	var unconsumed []goldenStep
	for _, s := range img.Steps {
		switch s.Op {
		case "append":
			if err := p.Append(s.Type, s.Flags, s.Seq, goldenPayload(s.Seq, s.Len)); err != nil {
				t.Fatalf("step %+v: %v", s, err)
			}
			unconsumed = append(unconsumed, s)
		case "publish":
			p.Publish()
		case "consume":
			for i := 0; i < s.Count; i++ {
				rec, err := c.Next()
				if err != nil {
					t.Fatalf("step %+v: %v", s, err)
				}
				want := unconsumed[0]
				unconsumed = unconsumed[1:]
				if rec.Seq != want.Seq || rec.Type != want.Type || rec.Flags != want.Flags ||
					!bytes.Equal(rec.Payload, goldenPayload(want.Seq, want.Len)) {
					t.Fatalf("consumed %+v, want %+v", rec, want)
				}
			}
			c.Commit()
		default:
			t.Fatalf("bad step %q", s.Op)
		}
	}
	img.Tail, img.Head = r.Positions()
	for _, s := range unconsumed {
		pl := goldenPayload(s.Seq, s.Len)
		rh := ring.RecordHeader{Len: uint32(s.Len), Type: s.Type, Flags: s.Flags, Seq: s.Seq}
		img.Remaining = append(img.Remaining, goldenRecord{
			Len: rh.Len, Type: rh.Type, Flags: rh.Flags, Seq: rh.Seq,
			PayloadHex: hex.EncodeToString(pl), Hex: hex.EncodeToString(goldenRecordBytes(rh, pl)),
		})
	}
	le := binary.LittleEndian
	le.PutUint32(mem[48:], goldenPeers.ProducerPID)
	le.PutUint64(mem[56:], goldenPeers.ProducerStart)
	le.PutUint32(mem[64:], goldenPeers.ConsumerPID)
	le.PutUint64(mem[72:], goldenPeers.ConsumerStart)
	files[img.File] = append([]byte(nil), mem...)
	m.Image = img
	return m, files
}

func goldenHexLines(b []byte) []byte {
	var sb strings.Builder
	for i := 0; i < len(b); i += 32 {
		sb.WriteString(hex.EncodeToString(b[i:min(i+32, len(b))]))
		sb.WriteByte('\n')
	}
	return []byte(sb.String())
}

func goldenReadHex(t *testing.T, name string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(goldenDir, name))
	if err != nil {
		t.Fatalf("%v (regenerate with go test ./ring -run Golden -update)", err)
	}
	b, err := hex.DecodeString(strings.Join(strings.Fields(string(raw)), ""))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

func goldenFirstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func TestGoldenVectors(t *testing.T) {
	m, files := buildGolden(t)
	manifest, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	manifest = append(manifest, '\n')
	if *goldenUpdate {
		if err := os.MkdirAll(goldenDir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(goldenDir, "vectors.json"), manifest, 0o644); err != nil {
			t.Fatal(err)
		}
		for name, b := range files {
			if err := os.WriteFile(filepath.Join(goldenDir, name), goldenHexLines(b), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("wrote %s", goldenDir)
		return
	}
	got, err := os.ReadFile(filepath.Join(goldenDir, "vectors.json"))
	if err != nil {
		t.Fatalf("%v (regenerate with go test ./ring -run Golden -update)", err)
	}
	if !bytes.Equal(got, manifest) {
		t.Errorf("vectors.json differs from the Go encoding at byte %d (wire format change? regenerate with -update and review)", goldenFirstDiff(got, manifest))
	}
	for name, want := range files {
		got := goldenReadHex(t, name)
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from the Go encoding at byte %d: file %d bytes, Go %d bytes", name, goldenFirstDiff(got, want), len(got), len(want))
		}
	}
	for _, r := range m.Records {
		b, _ := hex.DecodeString(r.Hex)
		if r.Type == ring.TypePad {
			continue
		}
		rh, err := ring.DecodeRecordHeader(b, len(b), 1<<20)
		if err != nil || rh.Len != r.Len || rh.Type != r.Type || rh.Flags != r.Flags || rh.Seq != r.Seq {
			t.Errorf("record %s decodes to %+v, %v", r.Name, rh, err)
		}
	}
}

// TestGoldenImageDecode attaches to the stored ring image and reads the
// records it still holds.
func TestGoldenImageDecode(t *testing.T) {
	var m goldenManifest
	raw, err := os.ReadFile(filepath.Join(goldenDir, "vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	h, err := ring.DecodeHeader(goldenReadHex(t, m.HeaderFile), -1)
	if err != nil || goldenHeader(h) != m.Header {
		t.Fatalf("header decodes to %+v, %v; want %+v", h, err, m.Header)
	}
	img := goldenReadHex(t, m.Image.File)
	mem := shm.Aligned(len(img))
	copy(mem, img)
	r, err := ring.Attach(mem)
	if err != nil {
		t.Fatal(err)
	}
	if tl, hd := r.Positions(); tl != m.Image.Tail || hd != m.Image.Head {
		t.Fatalf("positions %d/%d, manifest %d/%d", tl, hd, m.Image.Tail, m.Image.Head)
	}
	c, err := ring.NewConsumer(r, ring.DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range m.Image.Remaining {
		rec, err := c.Next()
		if err != nil {
			t.Fatal(err)
		}
		if rec.Seq != want.Seq || rec.Type != want.Type || rec.Flags != want.Flags || hex.EncodeToString(rec.Payload) != want.PayloadHex {
			t.Fatalf("read %+v, want %+v", rec, want)
		}
	}
	if _, err := c.Next(); err != ring.ErrEmpty {
		t.Fatalf("after the remaining records: %v, want ErrEmpty", err)
	}
}
