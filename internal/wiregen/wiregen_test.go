package wiregen_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/internal/wiregen"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

const root = "../.."

// The committed Python modules are what the Go source says now: a Go
// constant, String or record directive changed without `go generate
// ./schema/` fails here (and so fails make test and CI).
func TestGeneratedFilesAreCurrent(t *testing.T) {
	mods, err := wiregen.Generate(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(mods) != len(wiregen.Sources) {
		t.Fatalf("%d modules for %d packages", len(mods), len(wiregen.Sources))
	}
	for path, want := range mods {
		got, err := os.ReadFile(filepath.Join(root, path))
		if err != nil {
			t.Fatalf("%v (run go generate ./schema/)", err)
		}
		if !bytes.Equal(got, want) {
			gl, wl := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
			i := 0
			for i < len(gl) && i < len(wl) && gl[i] == wl[i] {
				i++
			}
			line := func(ls []string) string {
				if i < len(ls) {
					return ls[i]
				}
				return "(end of file)"
			}
			t.Errorf("%s is stale: run go generate ./schema/ and commit it\nline %d committed: %s\nline %d from Go:   %s",
				path, i+1, line(gl), i+1, line(wl))
		}
	}
}

func loadAll(t *testing.T) map[string]*wiregen.Module {
	t.Helper()
	ms, err := wiregen.LoadAll(root)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*wiregen.Module{}
	for _, m := range ms {
		out[m.Pkg] = m
	}
	return out
}

// The loader's values are the compiler's, under their public Python names.
func TestLoadMatchesCompiled(t *testing.T) {
	got := map[string]wiregen.Const{}
	for _, m := range loadAll(t) {
		for _, c := range m.Consts {
			got[c.Pkg+"."+c.Name] = c
		}
	}
	for name, want := range map[string]struct {
		value  uint64
		python string
	}{
		"schema.Version":            {uint64(schema.Version), "VERSION"},
		"schema.TypeSnapshot":       {uint64(schema.TypeSnapshot), "TYPE_SNAPSHOT"},
		"schema.ReplyBit":           {uint64(schema.ReplyBit), "REPLY_BIT"},
		"schema.OK":                 {uint64(schema.OK), "Status.OK"},
		"schema.ErrCodeBadState":    {uint64(schema.ErrCodeBadState), "Status.BAD_STATE"},
		"schema.StateReleased":      {uint64(schema.StateReleased), "State.RELEASED"},
		"schema.MaxPagesPerRecord":  {schema.MaxPagesPerRecord, "MAX_PAGES_PER_RECORD"},
		"schema.AttachReplyMagic":   {uint64(schema.AttachReplyMagic), "ATTACH_REPLY_MAGIC"},
		"schema.RegionCUDAIPC":      {uint64(schema.RegionCUDAIPC), "REGION_CUDA_IPC"},
		"schema.CUDAAllocationSize": {schema.CUDAAllocationSize, "CUDA_ALLOCATION_SIZE"},
		"ring.Magic":                {ring.Magic, "MAGIC"},
		"ring.MinCapacity":          {ring.MinCapacity, "MIN_CAPACITY"},
		"ring.MaxCapacity":          {ring.MaxCapacity, "MAX_CAPACITY"},
		"ring.TypePad":              {uint64(ring.TypePad), "TYPE_PAD"},
		"ring.FlagCreatorProducer":  {uint64(ring.FlagCreatorProducer), "FLAG_CREATOR_PRODUCER"},
		"ring.RecordHeaderSize":     {ring.RecordHeaderSize, "RECORD_HEADER_SIZE"},
	} {
		c, ok := got[name]
		if !ok || c.Value != want.value || c.Python != want.python {
			t.Errorf("%s: loaded %d as %q (found %v), compiled %d, want %q", name, c.Value, c.Python, ok, want.value, want.python)
		}
	}
	// Not wire constants: a time.Duration and a string.
	for _, name := range []string{"ring.AliveEvery", "ring.DefaultDir"} {
		if _, ok := got[name]; ok {
			t.Errorf("%s loaded as a wire constant", name)
		}
	}
	// The header offsets are unexported in Go and still part of the wire.
	if got["ring.offTail"].Value != 128 || got["ring.offConsFutex"].Value != 388 {
		t.Errorf("ring offsets: offTail %d, offConsFutex %d", got["ring.offTail"].Value, got["ring.offConsFutex"].Value)
	}
}

// The name tables are Go's String text, and every value of an enum or a
// table family has a name of its own in Go.
func TestNamesAreGoStrings(t *testing.T) {
	m := loadAll(t)["schema"]
	py := string(wiregen.Python(m))
	for _, c := range m.Consts {
		var want string
		switch {
		case c.Type == "Status":
			want = fmt.Sprintf("    %d: %q,\n", c.Value, schema.Status(c.Value).String())
		case c.Type == "State":
			want = fmt.Sprintf("    %d: %q,\n", c.Value, schema.State(c.Value).String())
		case c.Type == "uint16" && strings.HasPrefix(c.Name, "Type"):
			want = fmt.Sprintf("    %s: %q,\n", c.Python, schema.TypeName(uint16(c.Value)))
		default:
			continue
		}
		if !strings.Contains(py, want) {
			t.Errorf("%s: the module lacks %q", c.Name, want)
		}
		if strings.Contains(want, `: "status(`) || strings.Contains(want, `: "state(`) || strings.Contains(want, `: "type(`) {
			t.Errorf("%s has no name in Go: %s", c.Name, want)
		}
	}
	for _, want := range []string{"class Status(IntEnum):\n", "    MALFORMED = 1  # ErrCodeMalformed: ", "class State(IntEnum):\n", "    WAITING = 1  # StateWaiting: "} {
		if !strings.Contains(py, want) {
			t.Errorf("the module lacks %q", want)
		}
	}
}

func TestPyName(t *testing.T) {
	for _, tc := range []struct{ name, want string }{
		{"TypePutHashes", "TYPE_PUT_HASHES"},
		{"OK", "OK"},
		{"ErrCodeOutOfRange", "ERR_CODE_OUT_OF_RANGE"},
		{"RegionCUDAIPC", "REGION_CUDAIPC"},
		{"CUDAExtraHeaderSize", "CUDA_EXTRA_HEADER_SIZE"},
		{"IDRequest", "ID_REQUEST"},
		{"offProducerPID", "OFF_PRODUCER_PID"},
		{"MaxCapacity", "MAX_CAPACITY"},
		{"Type2Pad", "TYPE2_PAD"},
	} {
		if got := wiregen.PyName(tc.name); got != tc.want {
			t.Errorf("PyName(%s) = %s, want %s", tc.name, got, tc.want)
		}
	}
}

// A constant or a record directive changed in a copy of the tree shows in
// the generated module, and what cannot be rendered is an error.
func TestLoadSeesChanges(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module example.com/x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	write := func(src string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, "x.go"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("package x\n\nimport \"time\"\n\ntype Kind uint8\n\n// Limits.\nconst (\n\tMaxPages = 4096 // lowered\n\tKindA Kind = 0x2\n\tWait = time.Second\n\tname = \"n\"\n\tbig = 1 << 40\n\tHeadSize = 12\n)\n\n" +
		"// Head is a record.\n//\n//\t0 u64 id   8 u8 kind   9 u8[3] zero\n//\n//wire:struct Head \"<QB3x\" id kind size=HeadSize\ntype Head struct{}\n")
	m, err := wiregen.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	py := string(wiregen.Python(m))
	for _, want := range []string{
		"MAX_PAGES = 4096  # MaxPages untyped int: lowered\n",
		"KIND_A = 0x2  # KindA Kind\n",
		"BIG = 1099511627776  # big untyped int\n",
		"# Limits.\n",
		"# Head:\n#   0 u64 id   8 u8 kind   9 u8[3] zero\nHEAD = struct.Struct(\"<QB3x\")  # 12 bytes (HeadSize): id, kind\n",
		"\nimport struct\n",
		"    \"HEAD\",\n",
	} {
		if !strings.Contains(py, want) {
			t.Errorf("generated module lacks %q:\n%s", want, py)
		}
	}
	if strings.Contains(py, "WAIT") || strings.Contains(py, "NAME =") || strings.Contains(py, "import IntEnum") {
		t.Errorf("generated module has a non-wire constant or an enum:\n%s", py)
	}
	for src, msg := range map[string]string{
		"package x\n\nconst (\n\tOffA = 1\n\toffA = 2\n)\n":                                       "OFF_A",
		"package x\n\nconst Neg = -1\n":                                                           "non-negative",
		"package x\n\n//wire:struct A \">Q\" a\ntype A struct{}\n":                                "little-endian",
		"package x\n\n//wire:struct A \"<Qd\" a b\ntype A struct{}\n":                             "code",
		"package x\n\n//wire:struct A \"<QI\" a\ntype A struct{}\n":                               "2 values, 1 fields",
		"package x\n\n//wire:struct A <Q a\ntype A struct{}\n":                                    "quoted",
		"package x\n\nconst ASize = 4\n\n//wire:struct A \"<Q\" a size=ASize\ntype A struct{}\n":  "8 bytes, ASize is 4",
		"package x\n\n//wire:struct A \"<Q\" a size=Nothing\ntype A struct{}\n":                   "no wire constant",
		"package x\n\nconst AMin = 2\n\n//wire:struct A \"<QQ\" a b min=AMin\ntype A struct{}\n":  "not the start of a field",
		"package x\n\nconst AMin = 16\n\n//wire:struct A \"<QQ\" a b min=AMin\ntype A struct{}\n": "not the start of a field",
		"package x\n\n//wire:struct A \"<QQ\" a b min=Nothing\ntype A struct{}\n":                 "no wire constant",
		"package x\n\nconst A = 1\n\n//wire:struct A \"<Q\" a\ntype S struct{}\n":                 "both map to A",
		"package x\n\n//wire:struct A \"<Q\" a\n//wire:struct A \"<I\" a\ntype S struct{}\n":      "both map to A",
		"package x\n\n//wire:struct A \"<Q2\" a\ntype S struct{}\n":                               "ends in a count",
		"package x\n\n//wire:struct A \"<Q\" a\n\n//wire:struct B \"<4sx\" b\ntype S struct{}\n":  "",
	} {
		write(src)
		_, err := wiregen.Load(dir)
		switch {
		case msg == "" && err != nil:
			t.Errorf("%q: %v", src, err)
		case msg != "" && (err == nil || !strings.Contains(err.Error(), msg)):
			t.Errorf("%q: error %v, want one saying %q", src, err, msg)
		}
	}
}

// goldenVector is one golden vector: the bytes of message msg of package
// pkg and the values they encode.
type goldenVector struct {
	pkg, msg, name string
	fields         map[string]any
	b              []byte
	width          int // digest width of the vector, if any
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	f, err := os.Open(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d := json.NewDecoder(f)
	d.UseNumber() // sequence numbers past 2^53
	if err := d.Decode(v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// goldenVectors reads every golden vector with a record header:
// testdata/golden/schema's messages, testdata/golden/ring's header page and
// records.
func goldenVectors(t *testing.T) []goldenVector {
	var sv struct {
		Vectors []struct {
			Name, Message, Hex string
			Width              int `json:"digest_width"`
			Fields             map[string]any
		}
	}
	readJSON(t, "testdata/golden/schema/vectors.json", &sv)
	var out []goldenVector
	for _, v := range sv.Vectors {
		b, err := hex.DecodeString(v.Hex)
		if err != nil {
			t.Fatalf("%s: %v", v.Name, err)
		}
		out = append(out, goldenVector{"schema", v.Message, v.Name, v.Fields, b, v.Width})
	}
	var rv struct {
		Header     map[string]any
		HeaderFile string `json:"header_file"`
		Records    []map[string]any
	}
	readJSON(t, "testdata/golden/ring/vectors.json", &rv)
	hx, err := os.ReadFile(filepath.Join(root, "testdata/golden/ring", rv.HeaderFile))
	if err != nil {
		t.Fatal(err)
	}
	hb, err := hex.DecodeString(strings.Join(strings.Fields(string(hx)), ""))
	if err != nil {
		t.Fatal(err)
	}
	out = append(out, goldenVector{"ring", "Header", "header", rv.Header, hb, 0})
	for _, r := range rv.Records {
		b, err := hex.DecodeString(r["hex"].(string))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, goldenVector{"ring", "RecordHeader", r["name"].(string), r, b, 0})
	}
	return out
}

// want is the value header field f of s must have in vector v (a uint64 or
// a []byte), or ok false for a field that is not checked (~F). The rules
// are the package doc's; connector/python/tests/test_wire.py has the same.
func want(m *wiregen.Module, f string, v goldenVector) (any, bool, error) {
	if f == "_" {
		return uint64(0), true, nil
	}
	if strings.HasPrefix(f, "~") {
		return nil, false, nil
	}
	if f[0] >= 'A' && f[0] <= 'Z' {
		c, ok := m.Const(f)
		if !ok {
			return nil, false, fmt.Errorf("%s is no constant of %s", f, m.Pkg)
		}
		return c.Value, true, nil
	}
	fn, arg, call := strings.Cut(strings.TrimSuffix(f, ")"), "(")
	key := f
	if call {
		key = arg
	}
	x, ok := v.fields[key]
	if !ok {
		return nil, false, fmt.Errorf("the vector has no field %q", key)
	}
	switch {
	case call && fn == "len":
		s, ok := x.(string)
		if !ok {
			return nil, false, fmt.Errorf("len(%s): not a string", key)
		}
		return uint64(len(s)), true, nil
	case call && fn == "count":
		switch x := x.(type) {
		case []any:
			return uint64(len(x)), true, nil
		case string:
			if v.width == 0 {
				return nil, false, fmt.Errorf("count(%s): the vector has no digest width", key)
			}
			return uint64(len(x) / 2 / v.width), true, nil
		}
		return nil, false, fmt.Errorf("count(%s): neither a list nor bytes", key)
	case call:
		return nil, false, fmt.Errorf("%s: unknown function %s", f, fn)
	}
	switch x := x.(type) {
	case json.Number:
		u, err := strconv.ParseUint(x.String(), 10, 64)
		return u, true, err
	case bool:
		if x {
			return uint64(1), true, nil
		}
		return uint64(0), true, nil
	case string:
		b, err := hex.DecodeString(x)
		return b, true, err
	}
	return nil, false, fmt.Errorf("field %s: %T", key, x)
}

// Every record header decodes, by its directive's format, to the values of
// the golden vectors of its message; one with no vector of its own has a
// size constant instead.
func TestStructsMatchGoldenVectors(t *testing.T) {
	mods := loadAll(t)
	vectors := goldenVectors(t)
	n := 0
	for _, m := range mods {
		for _, s := range m.Structs {
			checked := 0
			for _, v := range vectors {
				if v.pkg != m.Pkg || v.msg != s.Name {
					continue
				}
				got, err := s.Unpack(v.b)
				if err != nil {
					t.Errorf("%s: %v", v.name, err)
					continue
				}
				for i, f := range s.Fields {
					w, ok, err := want(m, f, v)
					if err != nil {
						t.Errorf("%s %s: field %s: %v", m.Pkg, v.name, f, err)
						continue
					}
					if !ok {
						continue
					}
					zero := f == "_"
					if b, isBytes := got[i].([]byte); isBytes && zero {
						got[i] = uint64(len(bytes.Trim(b, "\x00")))
					}
					if fmt.Sprint(got[i]) != fmt.Sprint(w) {
						t.Errorf("%s %s: %s %q field %d (%s) is %v, the vector says %v", m.Pkg, v.name, s.Name, s.Format, i, f, got[i], w)
					}
					checked++
				}
			}
			if checked == 0 && s.SizeOf == "" {
				t.Errorf("%s.%s: no golden vector checks it and it names no size constant", m.Pkg, s.Name)
			}
			n++
		}
	}
	if n < 20 {
		t.Errorf("%d record headers declared, want every fixed header of schema and ring", n)
	}
}
