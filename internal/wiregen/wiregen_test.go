package wiregen_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ringside-kv/ringside/internal/wiregen"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

const root = "../.."

// The committed Python module is what the Go constants say now: a Go
// constant changed without `go generate ./schema/` fails here (and so fails
// make test and CI).
func TestGeneratedFileIsCurrent(t *testing.T) {
	want, err := wiregen.Generate(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(root, wiregen.Output))
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
		t.Fatalf("%s is stale: run go generate ./schema/ and commit it\nline %d committed: %s\nline %d from Go:   %s",
			wiregen.Output, i+1, line(gl), i+1, line(wl))
	}
}

// The loader's values are the compiler's.
func TestLoadMatchesCompiled(t *testing.T) {
	cs, err := wiregen.LoadAll(root)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]uint64{}
	for _, c := range cs {
		got[c.Pkg+"."+c.Name] = c.Value
	}
	for name, want := range map[string]uint64{
		"schema.Version":            uint64(schema.Version),
		"schema.TypeSnapshot":       uint64(schema.TypeSnapshot),
		"schema.ReplyBit":           uint64(schema.ReplyBit),
		"schema.OK":                 uint64(schema.OK),
		"schema.ErrCodeBadState":    uint64(schema.ErrCodeBadState),
		"schema.StateReleased":      uint64(schema.StateReleased),
		"schema.MaxPagesPerRecord":  schema.MaxPagesPerRecord,
		"schema.AttachReplyMagic":   uint64(schema.AttachReplyMagic),
		"schema.RegionCUDAIPC":      uint64(schema.RegionCUDAIPC),
		"schema.CUDAAllocationSize": schema.CUDAAllocationSize,
		"ring.Magic":                ring.Magic,
		"ring.MinCapacity":          ring.MinCapacity,
		"ring.MaxCapacity":          ring.MaxCapacity,
		"ring.TypePad":              uint64(ring.TypePad),
		"ring.FlagCreatorProducer":  uint64(ring.FlagCreatorProducer),
		"ring.RecordHeaderSize":     ring.RecordHeaderSize,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s: loaded %d (found %v), compiled %d", name, v, ok, want)
		}
	}
	// Not wire constants: a time.Duration and a string.
	for _, name := range []string{"ring.AliveEvery", "ring.DefaultDir"} {
		if _, ok := got[name]; ok {
			t.Errorf("%s loaded as a wire constant", name)
		}
	}
	// The header offsets are unexported in Go and still part of the wire.
	if got["ring.offTail"] != 128 || got["ring.offConsFutex"] != 388 {
		t.Errorf("ring offsets: offTail %d, offConsFutex %d", got["ring.offTail"], got["ring.offConsFutex"])
	}
}

func TestPyName(t *testing.T) {
	for _, tc := range []struct{ pkg, name, want string }{
		{"schema", "TypePutHashes", "SCHEMA_TYPE_PUT_HASHES"},
		{"schema", "OK", "SCHEMA_OK"},
		{"schema", "ErrCodeOutOfRange", "SCHEMA_ERR_CODE_OUT_OF_RANGE"},
		{"schema", "RegionCUDAIPC", "SCHEMA_REGION_CUDAIPC"},
		{"schema", "CUDAExtraHeaderSize", "SCHEMA_CUDA_EXTRA_HEADER_SIZE"},
		{"ring", "offProducerPID", "RING_OFF_PRODUCER_PID"},
		{"ring", "MaxCapacity", "RING_MAX_CAPACITY"},
		{"ring", "Type2Pad", "RING_TYPE2_PAD"},
	} {
		if got := wiregen.PyName(tc.pkg, tc.name); got != tc.want {
			t.Errorf("PyName(%s, %s) = %s, want %s", tc.pkg, tc.name, got, tc.want)
		}
	}
}

// A constant changed in a copy of the tree shows in the generated module,
// and two constants that map to one name are an error.
func TestLoadSeesChanges(t *testing.T) {
	dir := t.TempDir()
	write := func(src string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, "x.go"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("module example.com/x\n")
	if err := os.Rename(filepath.Join(dir, "x.go"), filepath.Join(dir, "go.mod")); err != nil {
		t.Fatal(err)
	}
	write("package x\n\nimport \"time\"\n\ntype Kind uint8\n\n// Limits.\nconst (\n\tMaxPages = 4096 // lowered\n\tKindA Kind = 0x2\n\tWait = time.Second\n\tname = \"n\"\n\tbig = 1 << 40\n)\n")
	cs, err := wiregen.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	py := string(wiregen.Python(cs))
	for _, want := range []string{
		"X_MAX_PAGES = 4096  # MaxPages untyped int: lowered\n",
		"X_KIND_A = 0x2  # KindA Kind\n",
		"X_BIG = 1099511627776  # big untyped int\n",
		"# Limits.\n",
	} {
		if !strings.Contains(py, want) {
			t.Errorf("generated module lacks %q:\n%s", want, py)
		}
	}
	if strings.Contains(py, "WAIT") || strings.Contains(py, "X_NAME") {
		t.Errorf("generated module has a non-wire constant:\n%s", py)
	}
	write("package x\n\nconst (\n\tOffA = 1\n\toffA = 2\n)\n")
	if _, err := wiregen.Load(dir); err == nil || !strings.Contains(err.Error(), "X_OFF_A") {
		t.Errorf("two constants with one Python name: %v", err)
	}
	write("package x\n\nconst Neg = -1\n")
	if _, err := wiregen.Load(dir); err == nil {
		t.Error("a negative constant loaded")
	}
}
