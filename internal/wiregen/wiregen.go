// Package wiregen reads ringside's wire out of the Go packages that define
// it (schema and ring) and renders each package as a Python module,
// connector/python/ringside/_wire_schema.py and _wire_ring.py, so that the
// Python client has no wire constant, name table or record layout of its
// own: `go generate ./schema/` writes the files, and a test in this package
// fails when a committed file differs from what the Go source says now.
//
// A wire constant is every package-level constant of an integer kind
// declared in a non-test file of a source package: exported or not (the
// ring's header offsets are unexported in Go), typed with a basic integer
// type or a type of that package (schema.Status, schema.State), or untyped.
// Constants of other packages' types (ring.AliveEvery, a time.Duration) and
// non-integers (ring.DefaultDir) are not wire constants. Values are the
// compiler's: the package is type-checked with go/types, so expressions
// (1 << 30, 4 << 10) are evaluated exactly as Go evaluates them. A constant
// whose declaration names an imported package is not a wire constant: the
// wire is declared in these packages alone.
//
// Names are the public Python names, mechanical: the Go name in upper snake
// case, TypePutHashes is TYPE_PUT_HASHES, offTail OFF_TAIL (PyName), but
// for the few in Renames. The constants of a type in Enums are the members
// of a Python IntEnum of that type, named without the type's prefix
// (ErrCodeMalformed is Status.MALFORMED), and each enum and each family in
// Tables has a table of Go's String text (STATUS_NAMES, TYPE_NAMES).
//
// A record's fixed header is declared beside its offset diagram with a
// directive,
//
//	//wire:struct NAME "FORMAT" FIELD... [size=CONST] [min=CONST]
//
// FORMAT is a little-endian Python struct format (x, B, H, I, Q and s, with
// counts); each FIELD names one of its values, checked against the golden
// vectors of message NAME (testdata/golden) by this package's test and by
// connector/python/tests/test_wire.py: a field of the vector (snake case),
// _ (zero), a constant of the package (AttachMagic), count(F) (the items of
// list F, or the digests of byte field F), len(F) (the UTF-8 bytes of string
// F), or ~F (derived, not checked). size=CONST: the header's size is that
// constant's value. min=CONST: the record may also end at that constant's
// value, a boundary between fields, its missing fields then 0 (fields
// appended within a version, docs/protocol.md section 13). The module
// renders it as NAME in upper snake case, a struct.Struct, with the
// diagram as its comment.
package wiregen

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"go/ast"
	"go/build"
	"go/constant"
	"go/parser"
	"go/token"
	"go/types"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"unicode"

	"github.com/ringside-kv/ringside/schema"
)

// Sources are the packages, relative to the module root, whose wire the
// Python client speaks.
var Sources = []string{"schema", "ring"}

// Output is the generated module of package pkg, relative to the module
// root.
func Output(pkg string) string { return "connector/python/ringside/_wire_" + pkg + ".py" }

// Renames are the Python names that are not the mechanical ones (Go's
// acronym runs), by package and Go name.
var Renames = map[string]string{"schema.RegionCUDAIPC": "REGION_CUDA_IPC", "schema.RegionCUDAFD": "REGION_CUDA_FD"}

// Enum renders the constants of one named type as a Python IntEnum.
type Enum struct {
	Trim   string                // prefix the members' names drop: ErrCode (ErrCodeMalformed is MALFORMED)
	Names  string                // the table of String's text: STATUS_NAMES
	String func(v uint64) string // Go's String
}

// Enums are the named types, by package and type name, whose constants are
// a Python IntEnum.
var Enums = map[string]Enum{
	"schema.Status": {Trim: "ErrCode", Names: "STATUS_NAMES", String: func(v uint64) string { return schema.Status(v).String() }},
	"schema.State":  {Trim: "State", Names: "STATE_NAMES", String: func(v uint64) string { return schema.State(v).String() }},
}

// Table is a family of plain constants with a table of Go's names for them.
type Table struct {
	Pkg, Type, Prefix string                // the family: constants of this package and Go type whose names start so
	Names             string                // the table: TYPE_NAMES
	String            func(v uint64) string // Go's name of a value
}

// Tables are the families with a name table: schema's record types.
var Tables = []Table{
	{Pkg: "schema", Type: "uint16", Prefix: "Type", Names: "TYPE_NAMES", String: func(v uint64) string { return schema.TypeName(uint16(v)) }},
}

// Const is one wire constant.
type Const struct {
	Pkg     string // package name: "schema", "ring"
	Name    string // Go name
	Python  string // public Python name: TYPE_PUT_HASHES, Status.MALFORMED
	Type    string // Go type: "uint16", "Status", "untyped int"
	Value   uint64
	Hex     bool   // written in hexadecimal in the Go source
	Comment string // the Go line comment, if any
	File    string // base name of the declaring file
	Group   string // first sentence of the doc comment of the declaring const declaration
	block   int    // which const declaration of its package
}

// Struct is one record header declared with //wire:struct.
type Struct struct {
	Pkg     string
	Name    string   // the message: a Go type name (PutHashes) or a header's (ChangeHeader)
	Python  string   // PUT_HASHES
	Format  string   // Python struct format: "<QII"
	Size    int      // bytes
	Fields  []string // one per value of Format: batch, count(digests), flags
	SizeOf  string   // size=CONST: the constant whose value is Size
	MinOf   string   // min=CONST: the constant whose value is MinSize
	MinSize int      // the shortest record (0: Size); its missing fields are 0
	Diagram []string // the offset diagram beside the directive (else the first sentence of its comment)
	File    string
}

// Module is the wire of one Go package.
type Module struct {
	Pkg     string
	Consts  []Const
	Structs []Struct
	enums   map[string]string // Go type -> first sentence of its doc comment
}

// Load type-checks the package in dir (its non-test files for the default
// build context) and returns its wire: constants and record headers in
// source order, files by name.
func Load(dir string) (*Module, error) {
	bp, err := build.Default.ImportDir(dir, 0)
	if err != nil {
		return nil, fmt.Errorf("wiregen: %s: %w", dir, err)
	}
	fset := token.NewFileSet()
	names := append([]string(nil), bp.GoFiles...)
	sort.Strings(names)
	var files []*ast.File
	for _, n := range names {
		f, err := parser.ParseFile(fset, filepath.Join(dir, n), nil, parser.ParseComments)
		if err != nil {
			return nil, fmt.Errorf("wiregen: %w", err)
		}
		files = append(files, f)
	}
	// Imports are not type-checked (that would type-check their whole
	// dependency tree, seconds, and far longer under the race detector):
	// every import is an empty package, and the errors that makes in code
	// using them are ignored. A constant that names an import is not a wire
	// constant (its type or value is another package's); any other constant
	// must check cleanly.
	var errs []error
	conf := types.Config{Importer: emptyImporter{}, Error: func(err error) { errs = append(errs, err) }}
	info := &types.Info{Defs: map[*ast.Ident]types.Object{}, Uses: map[*ast.Ident]types.Object{}}
	pkg, _ := conf.Check(bp.ImportPath, fset, files, info)
	usesImport := func(vs *ast.ValueSpec) bool {
		found := false
		check := func(n ast.Node) bool {
			if id, ok := n.(*ast.Ident); ok {
				if _, ok := info.Uses[id].(*types.PkgName); ok {
					found = true
				}
			}
			return !found
		}
		if vs.Type != nil {
			ast.Inspect(vs.Type, check)
		}
		for _, v := range vs.Values {
			ast.Inspect(v, check)
		}
		return found
	}
	m := &Module{Pkg: pkg.Name(), enums: map[string]string{}}
	seen := map[string]string{}
	claim := func(py, goName string) error {
		if prev, dup := seen[py]; dup {
			return fmt.Errorf("wiregen: %s.%s and %s.%s both map to %s", pkg.Name(), prev, pkg.Name(), goName, py)
		}
		seen[py] = goName
		return nil
	}
	for name := range Enums {
		if p, t, _ := strings.Cut(name, "."); p == pkg.Name() {
			m.enums[t] = ""
			if err := claim(t, t); err != nil {
				return nil, err
			}
		}
	}
	block := 0
	for i, f := range files {
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok {
				continue
			}
			if gd.Tok == token.TYPE {
				for _, spec := range gd.Specs {
					ts := spec.(*ast.TypeSpec)
					if _, ok := m.enums[ts.Name.Name]; ok {
						doc := ts.Doc
						if doc == nil {
							doc = gd.Doc
						}
						m.enums[ts.Name.Name] = firstSentence(doc)
					}
				}
			}
			if gd.Tok != token.CONST {
				continue
			}
			block++
			group := firstSentence(gd.Doc)
			var last *ast.ValueSpec // the spec whose type and values an implicit one repeats
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				if vs.Type != nil || len(vs.Values) > 0 {
					last = vs
				}
				if last != nil && usesImport(last) {
					continue
				}
				for j, id := range vs.Names {
					c, ok := info.Defs[id].(*types.Const)
					if !ok || id.Name == "_" || c.Parent() != pkg.Scope() {
						continue
					}
					if c.Val().Kind() == constant.Unknown {
						return nil, fmt.Errorf("wiregen: %s: constant %s does not type-check: %v", fset.Position(id.Pos()), id.Name, errors.Join(errs...))
					}
					typ, ok := wireType(c.Type(), pkg)
					if !ok {
						continue
					}
					v, exact := constant.Uint64Val(constant.ToInt(c.Val()))
					if !exact {
						return nil, fmt.Errorf("wiregen: %s.%s = %s is not a non-negative 64-bit integer", pkg.Name(), id.Name, c.Val())
					}
					k := Const{
						Pkg: pkg.Name(), Name: id.Name, Python: pyConst(pkg.Name(), id.Name, typ), Type: typ, Value: v,
						Comment: strings.TrimSpace(strings.TrimPrefix(textOf(vs.Comment), "//")),
						File:    names[i], Group: group, block: block,
					}
					if j < len(vs.Values) {
						if lit, ok := vs.Values[j].(*ast.BasicLit); ok && strings.HasPrefix(strings.ToLower(lit.Value), "0x") {
							k.Hex = true
						}
					}
					if err := claim(k.Python, id.Name); err != nil {
						return nil, err
					}
					m.Consts = append(m.Consts, k)
				}
			}
		}
	}
	for i, f := range files {
		for _, g := range f.Comments {
			var diagram []string
			for _, c := range g.List {
				if line, ok := strings.CutPrefix(c.Text, "//\t"); ok {
					diagram = append(diagram, strings.TrimRight(line, " \t"))
					continue
				}
				dir, ok := strings.CutPrefix(c.Text, "//wire:struct ")
				if !ok {
					continue
				}
				s, err := parseStruct(dir)
				if err != nil {
					return nil, fmt.Errorf("wiregen: %s: %w", fset.Position(c.Pos()), err)
				}
				s.Pkg, s.File, s.Diagram = pkg.Name(), names[i], diagram
				if len(diagram) == 0 {
					s.Diagram = []string{firstSentence(g)}
				}
				if err := claim(s.Python, s.Name); err != nil {
					return nil, err
				}
				m.Structs = append(m.Structs, s)
			}
		}
	}
	for i := range m.Structs {
		s := &m.Structs[i]
		if s.MinOf != "" {
			c, ok := m.Const(s.MinOf)
			if !ok {
				return nil, fmt.Errorf("wiregen: struct %s: min=%s is no wire constant of %s", s.Name, s.MinOf, pkg.Name())
			}
			items, _, _ := parseFormat(s.Format)
			boundary, off := false, 0
			for _, it := range items {
				if off == int(c.Value) {
					boundary = true
				}
				off += it.size
			}
			if c.Value == 0 || c.Value >= uint64(s.Size) || !boundary {
				return nil, fmt.Errorf("wiregen: struct %s: min=%s (%d) is not the start of a field of %q", s.Name, s.MinOf, c.Value, s.Format)
			}
			s.MinSize = int(c.Value)
		}
		if s.SizeOf == "" {
			continue
		}
		c, ok := m.Const(s.SizeOf)
		if !ok {
			return nil, fmt.Errorf("wiregen: struct %s: size=%s is no wire constant of %s", s.Name, s.SizeOf, pkg.Name())
		}
		if c.Value != uint64(s.Size) {
			return nil, fmt.Errorf("wiregen: struct %s: format %q is %d bytes, %s is %d", s.Name, s.Format, s.Size, s.SizeOf, c.Value)
		}
	}
	return m, nil
}

// Const returns the wire constant with Go name name.
func (m *Module) Const(name string) (Const, bool) {
	for _, c := range m.Consts {
		if c.Name == name {
			return c, true
		}
	}
	return Const{}, false
}

// pyConst is the public Python name of constant name of type typ in pkg.
func pyConst(pkg, name, typ string) string {
	if r, ok := Renames[pkg+"."+name]; ok {
		return r
	}
	if e, ok := Enums[pkg+"."+typ]; ok {
		return typ + "." + PyName(strings.TrimPrefix(name, e.Trim))
	}
	return PyName(name)
}

// parseStruct parses a //wire:struct directive (without its prefix).
func parseStruct(dir string) (Struct, error) {
	name, rest, _ := strings.Cut(strings.TrimSpace(dir), " ")
	rest = strings.TrimSpace(rest)
	q, err := strconv.QuotedPrefix(rest)
	if err != nil {
		return Struct{}, fmt.Errorf("//wire:struct %s: the format is not a quoted string: %s", name, rest)
	}
	format, _ := strconv.Unquote(q)
	s := Struct{Name: name, Python: PyName(name), Format: format}
	for _, f := range strings.Fields(rest[len(q):]) {
		if v, ok := strings.CutPrefix(f, "size="); ok {
			s.SizeOf = v
			continue
		}
		if v, ok := strings.CutPrefix(f, "min="); ok {
			s.MinOf = v
			continue
		}
		s.Fields = append(s.Fields, f)
	}
	items, size, err := parseFormat(format)
	if err != nil {
		return Struct{}, fmt.Errorf("//wire:struct %s: %w", name, err)
	}
	if len(items) != len(s.Fields) {
		return Struct{}, fmt.Errorf("//wire:struct %s: format %q has %d values, %d fields named", name, format, len(items), len(s.Fields))
	}
	s.Size = size
	return s, nil
}

// item is one value of a struct format: an integer of size bytes, or
// (bytes) a byte string of size bytes.
type item struct {
	size  int
	bytes bool
}

// parseFormat reads a little-endian Python struct format of x, B, H, I, Q
// and s codes (each with an optional count): its values and its size.
func parseFormat(f string) ([]item, int, error) {
	body, ok := strings.CutPrefix(f, "<")
	if !ok {
		return nil, 0, fmt.Errorf("format %q is not little-endian (<)", f)
	}
	var items []item
	size := 0
	for i := 0; i < len(body); {
		j := i
		for j < len(body) && body[j] >= '0' && body[j] <= '9' {
			j++
		}
		n := 1
		if j > i {
			n, _ = strconv.Atoi(body[i:j])
		}
		if j == len(body) {
			return nil, 0, fmt.Errorf("format %q ends in a count", f)
		}
		switch c := body[j]; c {
		case 'x':
			size += n
		case 's':
			items = append(items, item{n, true})
			size += n
		case 'B', 'H', 'I', 'Q':
			w := map[byte]int{'B': 1, 'H': 2, 'I': 4, 'Q': 8}[c]
			for range n {
				items = append(items, item{w, false})
			}
			size += n * w
		default:
			return nil, 0, fmt.Errorf("format %q: code %q (want x, B, H, I, Q or s)", f, c)
		}
		i = j + 1
	}
	return items, size, nil
}

// Unpack reads the header's values from the start of b as Python's
// struct.unpack_from does: a uint64 per integer, a []byte per byte string.
// A record of at least MinSize bytes (min=) reads its missing fields as 0.
func (s Struct) Unpack(b []byte) ([]any, error) {
	if s.MinSize > 0 && len(b) >= s.MinSize && len(b) < s.Size {
		b = append(bytes.Clone(b), make([]byte, s.Size-len(b))...)
	}
	if len(b) < s.Size {
		return nil, fmt.Errorf("%s: %d bytes, the header is %d", s.Name, len(b), s.Size)
	}
	body := s.Format[1:]
	var out []any
	off := 0
	for i := 0; i < len(body); {
		j := i
		for body[j] >= '0' && body[j] <= '9' {
			j++
		}
		n := 1
		if j > i {
			n, _ = strconv.Atoi(body[i:j])
		}
		switch body[j] {
		case 'x':
			off += n
		case 's':
			out = append(out, b[off:off+n])
			off += n
		default:
			for range n {
				switch body[j] {
				case 'B':
					out = append(out, uint64(b[off]))
					off++
				case 'H':
					out = append(out, uint64(binary.LittleEndian.Uint16(b[off:])))
					off += 2
				case 'I':
					out = append(out, uint64(binary.LittleEndian.Uint32(b[off:])))
					off += 4
				case 'Q':
					out = append(out, binary.LittleEndian.Uint64(b[off:]))
					off += 8
				}
			}
		}
		i = j + 1
	}
	return out, nil
}

// emptyImporter imports every package as an empty one (and unsafe as
// itself).
type emptyImporter struct{}

func (emptyImporter) Import(path string) (*types.Package, error) {
	if path == "unsafe" {
		return types.Unsafe, nil
	}
	name := path[strings.LastIndexByte(path, '/')+1:]
	if i := strings.IndexAny(name, ".-"); i > 0 {
		name = name[:i]
	}
	p := types.NewPackage(path, name)
	p.MarkComplete()
	return p, nil
}

// wireType names t if it is the type of a wire constant: an integer basic
// type (typed or untyped) or a named integer type declared in pkg.
func wireType(t types.Type, pkg *types.Package) (string, bool) {
	switch t := t.(type) {
	case *types.Basic:
		return t.Name(), t.Info()&types.IsInteger != 0
	case *types.Named:
		b, ok := t.Underlying().(*types.Basic)
		if !ok || b.Info()&types.IsInteger == 0 || t.Obj().Pkg() != pkg {
			return "", false
		}
		return t.Obj().Name(), true
	}
	return "", false
}

// firstSentence is the first sentence of a doc comment, on one line.
func firstSentence(g *ast.CommentGroup) string {
	s := strings.TrimSpace(g.Text())
	if i := strings.Index(s, "\n\n"); i >= 0 {
		s = s[:i]
	}
	s = strings.Join(strings.Fields(s), " ")
	if i := strings.Index(s, ". "); i >= 0 {
		s = s[:i+1]
	}
	return s
}

func textOf(g *ast.CommentGroup) string {
	if g == nil || len(g.List) == 0 {
		return ""
	}
	return g.List[0].Text
}

// PyName is name in upper snake case. A word starts at an upper-case letter
// that follows a lower-case letter or a digit, or that ends a run of
// capitals before a lower-case letter: TypePutHashes is TYPE_PUT_HASHES,
// offProducerPID OFF_PRODUCER_PID, ErrCodeOK ERR_CODE_OK, RegionCUDAIPC
// REGION_CUDAIPC.
func PyName(name string) string {
	var b strings.Builder
	r := []rune(name)
	for i, c := range r {
		if i > 0 && unicode.IsUpper(c) {
			prev := r[i-1]
			next := i+1 < len(r) && unicode.IsLower(r[i+1])
			if unicode.IsLower(prev) || unicode.IsDigit(prev) || (unicode.IsUpper(prev) && next) {
				b.WriteByte('_')
			}
		}
		b.WriteRune(unicode.ToUpper(c))
	}
	return b.String()
}

// LoadAll loads every package of Sources under the module root.
func LoadAll(root string) ([]*Module, error) {
	var all []*Module
	for _, s := range Sources {
		m, err := Load(filepath.Join(root, s))
		if err != nil {
			return nil, err
		}
		all = append(all, m)
	}
	return all, nil
}

// Python renders the module.
func Python(m *Module) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, `"""ringside wire of the Go package %s: GENERATED by internal/wiregen. DO NOT EDIT:
change the Go source and run `+"`go generate ./schema/`"+`.

Every wire constant of the package under its public name (the Go name in
upper snake case), the typed ones as IntEnum members with Go's String text,
and the fixed header of each record as a struct.Struct beside the Go offset
diagram. ringside.%s re-exports them; tests/test_wire.py checks them against
the Go golden vectors, and internal/wiregen's test fails when this file is
stale.
"""
`, m.Pkg, m.Pkg)
	if len(m.Structs) > 0 {
		b.WriteString("\nimport struct\n")
	}
	if len(m.enums) > 0 {
		b.WriteString("from enum import IntEnum\n")
	}
	var public []string
	done := map[string]bool{}
	file, block := "", -1
	for _, c := range m.Consts {
		if c.File != file {
			file = c.File
			fmt.Fprintf(&b, "\n# %s/%s\n", c.Pkg, c.File)
		}
		if c.block != block {
			block = c.block
			b.WriteByte('\n')
			writeComment(&b, c.Group)
		}
		if _, ok := m.enums[c.Type]; ok {
			if !done[c.Type] {
				done[c.Type] = true
				public = append(public, c.Type, Enums[m.Pkg+"."+c.Type].Names)
				writeEnum(&b, m, c.Type)
			}
			continue
		}
		val := fmt.Sprintf("%d", c.Value)
		if c.Hex {
			val = fmt.Sprintf("%#x", c.Value)
		}
		note := c.Name + " " + c.Type
		if c.Comment != "" {
			note += ": " + c.Comment
		}
		fmt.Fprintf(&b, "%s = %s  # %s\n", c.Python, val, note)
		public = append(public, c.Python)
	}
	for _, t := range Tables {
		if t.Pkg != m.Pkg {
			continue
		}
		fmt.Fprintf(&b, "\n# Go's names of the %s %s* constants.\n%s = {\n", t.Type, t.Prefix, t.Names)
		for _, c := range m.Consts {
			if c.Type == t.Type && strings.HasPrefix(c.Name, t.Prefix) {
				fmt.Fprintf(&b, "    %s: %q,\n", c.Python, t.String(c.Value))
			}
		}
		b.WriteString("}\n")
		public = append(public, t.Names)
	}
	if len(m.Structs) > 0 {
		b.WriteString("\n\n# Record layouts: each fixed header as a struct.Struct (format and size), its fields\n" +
			"# named as in the Go directive (_ a zero word, ~F derived), beside the Go offset diagram.\n")
	}
	file = ""
	for _, s := range m.Structs {
		if s.File != file {
			file = s.File
			fmt.Fprintf(&b, "\n# %s/%s\n", s.Pkg, s.File)
		}
		fmt.Fprintf(&b, "\n# %s:\n", s.Name)
		for _, d := range s.Diagram {
			fmt.Fprintf(&b, "#   %s\n", d)
		}
		size := fmt.Sprintf("%d bytes", s.Size)
		if s.SizeOf != "" {
			size += " (" + s.SizeOf + ")"
		}
		if s.MinOf != "" {
			size += fmt.Sprintf(", or %d (%s) without the fields past it", s.MinSize, s.MinOf)
		}
		fmt.Fprintf(&b, "%s = struct.Struct(%q)  # %s: %s\n", s.Python, s.Format, size, strings.Join(s.Fields, ", "))
		public = append(public, s.Python)
	}
	if len(m.Structs) > 0 {
		b.WriteString("\n# Each layout by its Go message name: (layout, its fields, the name of the constant that is its size).\nLAYOUTS = {\n")
		for _, s := range m.Structs {
			var fs []string
			for _, f := range s.Fields {
				fs = append(fs, strconv.Quote(f))
			}
			size := "None"
			if s.SizeOf != "" {
				c, _ := m.Const(s.SizeOf)
				size = strconv.Quote(c.Python)
			}
			fmt.Fprintf(&b, "    %q: (%s, (%s,), %s),\n", s.Name, s.Python, strings.Join(fs, ", "), size)
		}
		b.WriteString("}\n")
		public = append(public, "LAYOUTS")
	}
	b.WriteString("\n__all__ = [\n")
	for _, p := range public {
		fmt.Fprintf(&b, "    %q,\n", p)
	}
	b.WriteString("]\n")
	return b.Bytes()
}

// writeEnum renders the constants of Go type typ as an IntEnum and its
// table of Go's String text.
func writeEnum(b *bytes.Buffer, m *Module, typ string) {
	e := Enums[m.Pkg+"."+typ]
	fmt.Fprintf(b, "class %s(IntEnum):\n", typ)
	doc := m.enums[typ]
	if doc != "" {
		doc += " "
	}
	fmt.Fprintf(b, "    \"\"\"%sstr() is Go's String: %s.\"\"\"\n\n", doc, e.Names)
	for _, c := range m.Consts {
		if c.Type != typ {
			continue
		}
		note := c.Name
		if c.Comment != "" {
			note += ": " + c.Comment
		}
		fmt.Fprintf(b, "    %s = %d  # %s\n", strings.TrimPrefix(c.Python, typ+"."), c.Value, note)
	}
	fmt.Fprintf(b, "\n    def __str__(self) -> str:\n        return %s[self.value]\n\n\n", e.Names)
	fmt.Fprintf(b, "# Go's %s.String of each %s.\n%s = {\n", typ, typ, e.Names)
	for _, c := range m.Consts {
		if c.Type == typ {
			fmt.Fprintf(b, "    %d: %q,\n", c.Value, e.String(c.Value))
		}
	}
	b.WriteString("}\n")
}

// writeComment writes s as Python comment lines of at most about 100
// characters.
func writeComment(b *bytes.Buffer, s string) {
	line := "#"
	for _, w := range strings.Fields(s) {
		if len(line) > 1 && len(line)+1+len(w) > 100 {
			b.WriteString(line + "\n")
			line = "#"
		}
		line += " " + w
	}
	if len(line) > 1 {
		b.WriteString(line + "\n")
	}
}

// Generate loads the packages under root and renders their modules, by
// output path.
func Generate(root string) (map[string][]byte, error) {
	ms, err := LoadAll(root)
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for _, m := range ms {
		out[Output(m.Pkg)] = Python(m)
	}
	return out, nil
}
