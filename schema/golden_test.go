package schema_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/internal/wiregen"
	"github.com/ringside-kv/ringside/schema"
)

// Golden vectors shared with the Python connector
// (connector/python/tests/test_schema.py). Regenerate with
//
//	go test ./schema -run Golden -update
//
// and review the diff: any change to vectors.json is a wire-format change.

var goldenUpdate = flag.Bool("update", false, "rewrite ../testdata/golden/schema/vectors.json from the Go encoding")

const goldenFile = "../testdata/golden/schema/vectors.json"

type goldenVector struct {
	Name       string         `json:"name"`
	Message    string         `json:"message"`     // Go type in package schema
	RecordType uint16         `json:"record_type"` // ring record header type; 0 for the socket handshake
	Width      int            `json:"digest_width,omitempty"`
	Fields     map[string]any `json:"fields"` // snake_case; byte strings as lowercase hex
	Hex        string         `json:"hex"`
}

type goldenFileT struct {
	Comment string         `json:"comment"`
	Version uint16         `json:"version"`
	Vectors []goldenVector `json:"vectors"`
	// Every wire constant of the package (internal/wiregen's list, the
	// same that _wire_schema.py is generated from), with the Go String of the
	// typed ones, and what the decoders accept where Go has no constant:
	// connector/python/tests/test_wire.py checks the Python client
	// against them.
	Constants    []goldenConst `json:"constants"`
	DigestWidths []int         `json:"digest_widths"` // widths AttachRequest.Validate accepts
	RegionKinds  []int         `json:"region_kinds"`  // kinds RegisterRegion.Decode accepts
}

type goldenConst struct {
	Name   string `json:"name"`             // Go name
	Python string `json:"python"`           // public Python name (ringside.schema)
	Type   string `json:"type"`             // Go type
	Value  uint64 `json:"value"`            //
	String string `json:"string,omitempty"` // Status.String, State.String, TypeName (record types)
}

// goldenConstants lists the package's wire constants with their Go names.
func goldenConstants(t *testing.T) []goldenConst {
	t.Helper()
	m, err := wiregen.Load(".")
	if err != nil {
		t.Fatal(err)
	}
	var out []goldenConst
	for _, c := range m.Consts {
		g := goldenConst{Name: c.Name, Python: c.Python, Type: c.Type, Value: c.Value}
		switch {
		case c.Type == "Status":
			g.String = schema.Status(c.Value).String()
		case c.Type == "State":
			g.String = schema.State(c.Value).String()
		case c.Type == "uint16" && strings.HasPrefix(c.Name, "Type"):
			g.String = schema.TypeName(uint16(c.Value))
		}
		out = append(out, g)
	}
	return out
}

// acceptedDigestWidths probes AttachRequest.Validate.
func acceptedDigestWidths() []int {
	var ws []int
	for w := range 256 {
		m := sAttachRequest
		m.DigestWidth = uint8(w)
		if m.Validate() == nil {
			ws = append(ws, w)
		}
	}
	return ws
}

// acceptedRegionKinds probes RegisterRegion.Decode.
func acceptedRegionKinds() []int {
	var ks []int
	for k := range 256 {
		b := (&schema.RegisterRegion{Region: 1, Kind: uint8(k), PID: 1, Base: 1, Length: 1, PageSize: 1, PageCount: 1}).Append(nil)
		var m schema.RegisterRegion
		if m.Decode(b) == nil {
			ks = append(ks, k)
		}
	}
	return ks
}

func hx(b []byte) string { return hex.EncodeToString(b) }

func viewFields(v schema.View, f map[string]any) map[string]any {
	f["batch"], f["start"], f["count"] = v.Batch, v.Start, v.Count
	return f
}

func changeFields(m schema.ChangesReply) []map[string]any {
	out := []map[string]any{}
	for i := 0; i < m.Len(); i++ {
		op, d := m.ChangeAt(i)
		out = append(out, map[string]any{"op": op, "digest": hx(d)})
	}
	return out
}

// goldenFields is the JSON form of one sample's value.
func goldenFields(v any) (msg string, f map[string]any) {
	switch m := v.(type) {
	case schema.AttachRequest:
		return "AttachRequest", map[string]any{
			"version": m.Version, "role": m.Role, "rank": m.Rank, "world_size": m.WorldSize,
			"digest_width": m.DigestWidth, "ring_capacity": m.RingCapacity,
			"instance": m.Instance, "model": m.Model, "layout": m.Layout, "salt": m.Salt,
		}
	case schema.AttachReply:
		return "AttachReply", map[string]any{
			"version": m.Version, "status": m.Status, "namespace": m.Namespace, "session": m.Session,
			"epoch": m.Epoch, "pool_slots": m.PoolSlots, "slot_bytes": m.SlotBytes, "max_payload": m.MaxPayload,
			"submission_ring": m.SubmissionRing, "completion_ring": m.CompletionRing,
			"pool_path": m.PoolPath, "message": m.Message,
		}
	case schema.PutHashes:
		return "PutHashes", map[string]any{"batch": m.Batch, "flags": m.Flags, "digests": hx(m.Digests)}
	case schema.IDRequest:
		return "IDRequest", map[string]any{"id": m.ID}
	case schema.Lookup:
		return "Lookup", viewFields(m.View, map[string]any{})
	case schema.Acquire:
		return "Acquire", viewFields(m.View, map[string]any{"ttl_ms": m.TTLms})
	case schema.Retain:
		return "Retain", viewFields(m.View, map[string]any{"ttl_ms": m.TTLms, "priority": m.Priority, "flags": m.Flags, "owner": m.Owner})
	case schema.RegisterRegion:
		segs := []map[string]any{}
		for _, s := range m.Segments {
			segs = append(segs, map[string]any{"offset": s.Offset, "stride": s.Stride, "length": s.Length})
		}
		return "RegisterRegion", map[string]any{
			"region": m.Region, "kind": m.Kind, "pid": m.PID, "base": m.Base, "length": m.Length,
			"page_size": m.PageSize, "page_count": m.PageCount, "segments": segs, "extra": hx(m.Extra),
		}
	case schema.CUDAExtra:
		as := []map[string]any{}
		for _, a := range m.Allocations {
			as = append(as, map[string]any{"handle": hx(a.Handle[:]), "base": a.Base, "size": a.Size})
		}
		return "CUDAExtra", map[string]any{"gpu": hx(m.GPU[:]), "flags": m.Flags, "event": hx(m.Event[:]), "allocations": as}
	case schema.FDExtra:
		as := []map[string]any{}
		for _, a := range m.Allocations {
			as = append(as, map[string]any{"index": a.Index, "base": a.Base, "size": a.Size})
		}
		return "FDExtra", map[string]any{"gpu": hx(m.GPU[:]), "flags": m.Flags, "event": hx(m.Event[:]), "allocations": as}
	case schema.RegionDescriptors:
		_, f := goldenFields(m.Region)
		return "RegionDescriptors", map[string]any{"version": m.Version, "session": m.Session, "epoch": m.Epoch, "region": f}
	case schema.RegionDescriptorsReply:
		return "RegionDescriptorsReply", map[string]any{"version": m.Version, "status": m.Status, "region": m.Region, "message": m.Message}
	case schema.Load:
		return "Load", map[string]any{"lease": m.Lease, "region": m.Region, "first": m.First, "pages": m.Pages}
	case schema.Store:
		return "Store", viewFields(m.View, map[string]any{"region": m.Region, "pages": m.Pages})
	case schema.Changes:
		return "Changes", map[string]any{"epoch": m.Epoch, "seq": m.Seq, "max": m.Max}
	case schema.Reply:
		return "Reply", map[string]any{"status": m.Status, "value": m.Value, "message": m.Message}
	case schema.LeaseReply:
		return "LeaseReply", map[string]any{"status": m.Status, "state": m.State, "lease": m.Lease, "blocks": m.Blocks, "message": m.Message}
	case schema.StoreReply:
		return "StoreReply", map[string]any{"status": m.Status, "stored": m.Stored, "present": m.Present, "skipped": m.Skipped, "message": m.Message}
	case schema.Snapshot:
		return "Snapshot", map[string]any{"from": m.From, "max": m.Max}
	case schema.SnapshotReply:
		ds := []string{}
		for i := 0; i < m.Len(); i++ {
			ds = append(ds, hx(m.DigestAt(i)))
		}
		return "SnapshotReply", map[string]any{
			"status": m.Status, "done": m.Done, "epoch": m.Epoch, "seq": m.Seq, "next": m.Next, "width": m.Width,
			"entries": ds,
		}
	case schema.Describe:
		runs := []map[string]any{}
		for _, r := range m.Runs {
			f := map[string]any{"digests": hx(r.Digests), "tokens_per_block": r.TokensPerBlock, "tokens": hx(r.Tokens), "extra": hx(r.Extra)}
			if r.Parent != nil {
				f["parent"] = hx(r.Parent)
			}
			runs = append(runs, f)
		}
		return "Describe", map[string]any{"runs": runs}
	case schema.EventsReply:
		es := []map[string]any{}
		m.Events(func(e *schema.Event) bool {
			f := map[string]any{"op": e.Op, "digest": hx(e.Digest), "tokens": hx(e.Tokens), "extra": hx(e.Extra)}
			if e.Parent != nil {
				f["parent"] = hx(e.Parent)
			}
			es = append(es, f)
			return true
		})
		return "EventsReply", map[string]any{
			"status": m.Status, "resync": m.Resync, "done": m.Done, "epoch": m.Epoch, "seq": m.Seq, "next": m.Next,
			"width": m.Width, "entries": es,
		}
	case schema.ChangesReply:
		return "ChangesReply", map[string]any{
			"status": m.Status, "resync": m.Resync, "epoch": m.Epoch, "next": m.Next, "width": m.Width,
			"entries": changeFields(m),
		}
	}
	panic("goldenFields: unknown type")
}

func buildGoldenVectors(t *testing.T) goldenFileT {
	g := goldenFileT{
		Comment: "ringside schema golden vectors; generated by `go test ./schema -run Golden -update`. " +
			"fields: snake_case field values, byte strings as lowercase hex; hex: the exact payload bytes " +
			"(attach and descriptor messages: the socket message; CUDAExtra and FDExtra: RegisterRegion's extra bytes; others: the ring record payload, without the 16-byte record header). " +
			"PutHashes and Describe are encoded with digest_width. constants: every wire constant of package schema " +
			"(python: its public name in ringside.schema; string: Status.String, State.String or TypeName); " +
			"digest_widths and region_kinds: what the Go validation and decoder accept.",
		Version:      schema.Version,
		Constants:    goldenConstants(t),
		DigestWidths: acceptedDigestWidths(),
		RegionKinds:  acceptedRegionKinds(),
	}
	for _, s := range samples() {
		msg, f := goldenFields(s.value)
		v := goldenVector{Name: s.name, Message: msg, RecordType: s.rtype, Fields: f, Hex: hx(s.enc())}
		if _, ok := s.value.(schema.PutHashes); ok {
			v.Width = map[string]int{"PutHashes/w32": 32, "PutHashes/w8": 8, "PutHashes/w16": 16}[s.name]
		}
		if _, ok := s.value.(schema.Describe); ok {
			v.Width = 16
		}
		g.Vectors = append(g.Vectors, v)
	}
	return g
}

func marshalGolden(t *testing.T, g goldenFileT) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(g); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestGolden(t *testing.T) {
	want := marshalGolden(t, buildGoldenVectors(t))
	if *goldenUpdate {
		if err := os.MkdirAll(filepath.Dir(goldenFile), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(goldenFile, want, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", goldenFile)
	}
	got, err := os.ReadFile(goldenFile)
	if err != nil {
		t.Fatalf("%v (regenerate with go test ./schema -run Golden -update)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from the Go encoding: the wire format changed; if that is intended, "+
			"regenerate with -update, bump schema.Version if the change is incompatible, and review the diff", goldenFile)
	}

	// Every stored vector decodes with the Go decoders to its value.
	var g goldenFileT
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatal(err)
	}
	byName := map[string]sample{}
	for _, s := range samples() {
		byName[s.name] = s
	}
	seen := map[string]bool{}
	for _, v := range g.Vectors {
		s, ok := byName[v.Name]
		if !ok {
			t.Errorf("vector %q has no sample", v.Name)
			continue
		}
		seen[v.Message] = true
		b, err := hex.DecodeString(v.Hex)
		if err != nil {
			t.Fatalf("%s: %v", v.Name, err)
		}
		dec, err := s.dec(b)
		if err != nil || !same(dec, s.value) {
			t.Errorf("%s: stored bytes decode to %+v, %v", v.Name, dec, err)
		}
		if v.RecordType != 0 && strings.HasPrefix(schema.TypeName(v.RecordType), "type(") {
			t.Errorf("%s: record type %#x has no name", v.Name, v.RecordType)
		}
	}
	// Every typed constant has a name of its own in Go too.
	for _, c := range g.Constants {
		if c.String != "" && (strings.HasPrefix(c.String, "status(") || strings.HasPrefix(c.String, "state(") ||
			strings.HasPrefix(c.String, "type(")) {
			t.Errorf("constant %s (%d) has no name in Go: %s", c.Name, c.Value, c.String)
		}
	}
	for _, m := range []string{"AttachRequest", "AttachReply", "PutHashes", "IDRequest", "Lookup", "Acquire",
		"RegisterRegion", "CUDAExtra", "Load", "Store", "Changes", "Reply", "LeaseReply", "StoreReply", "ChangesReply",
		"Snapshot", "SnapshotReply", "Describe", "EventsReply", "Retain", "FDExtra", "RegionDescriptors", "RegionDescriptorsReply"} {
		if !seen[m] {
			t.Errorf("no golden vector for %s", m)
		}
	}
}
