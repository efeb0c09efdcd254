// Package wiregen reads ringside's wire constants out of the Go packages
// that define them (schema and ring) and renders them as the Python module
// connector/python/ringside/_wire.py, so that the Python client has no
// constant of its own: `go generate ./schema/` writes the file, and a test in
// this package fails when the committed file differs from what the Go source
// says now.
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
// Names are mechanical: the package name and the Go name in upper snake
// case, TypePutHashes in schema is SCHEMA_TYPE_PUT_HASHES, offTail in ring is
// RING_OFF_TAIL (PyName). ringside.schema and ringside.ring give them their
// public Python names.
package wiregen

import (
	"bytes"
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
	"strings"
	"unicode"
)

// Sources are the packages, relative to the module root, whose constants
// make up the wire.
var Sources = []string{"schema", "ring"}

// Output is the generated module, relative to the module root.
const Output = "connector/python/ringside/_wire.py"

// Const is one wire constant.
type Const struct {
	Pkg     string // package name: "schema", "ring"
	Name    string // Go name
	Python  string // name in _wire.py (PyName)
	Type    string // Go type: "uint16", "Status", "untyped int"
	Value   uint64
	Hex     bool   // written in hexadecimal in the Go source
	Comment string // the Go line comment, if any
	File    string // base name of the declaring file
	Group   string // first sentence of the doc comment of the declaring const declaration
	block   int    // which const declaration of its package
}

// Load type-checks the package in dir (its non-test files for the default
// build context) and returns its wire constants in source order: files by
// name, declarations as written.
func Load(dir string) ([]Const, error) {
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
	var out []Const
	seen := map[string]string{}
	block := 0
	for i, f := range files {
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
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
						Pkg: pkg.Name(), Name: id.Name, Python: PyName(pkg.Name(), id.Name), Type: typ, Value: v,
						Comment: strings.TrimSpace(strings.TrimPrefix(textOf(vs.Comment), "//")),
						File:    names[i], Group: group, block: block,
					}
					if j < len(vs.Values) {
						if lit, ok := vs.Values[j].(*ast.BasicLit); ok && strings.HasPrefix(strings.ToLower(lit.Value), "0x") {
							k.Hex = true
						}
					}
					if prev, dup := seen[k.Python]; dup {
						return nil, fmt.Errorf("wiregen: %s.%s and %s.%s both map to %s", pkg.Name(), prev, pkg.Name(), id.Name, k.Python)
					}
					seen[k.Python] = id.Name
					out = append(out, k)
				}
			}
		}
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

// PyName is the _wire.py name of constant name of package pkg: both in upper
// snake case, joined by an underscore. A word starts at an upper-case letter
// that follows a lower-case letter or a digit, or that ends a run of
// capitals before a lower-case letter: TypePutHashes is TYPE_PUT_HASHES,
// offProducerPID OFF_PRODUCER_PID, ErrCodeOK ERR_CODE_OK, RegionCUDAIPC
// REGION_CUDAIPC.
func PyName(pkg, name string) string {
	var b strings.Builder
	b.WriteString(strings.ToUpper(pkg))
	b.WriteByte('_')
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
func LoadAll(root string) ([]Const, error) {
	var all []Const
	for _, s := range Sources {
		cs, err := Load(filepath.Join(root, s))
		if err != nil {
			return nil, err
		}
		all = append(all, cs...)
	}
	return all, nil
}

// Python renders the constants as the _wire.py module.
func Python(cs []Const) []byte {
	var b bytes.Buffer
	b.WriteString(`"""ringside wire constants: GENERATED by internal/wiregen from the Go packages
` + strings.Join(Sources, " and ") + `. DO NOT EDIT: change the Go constant and run ` + "`go generate ./schema/`" + `.

Every package-level integer constant of those packages, named
PACKAGE_GO_NAME_IN_UPPER_SNAKE_CASE. ringside.schema and ringside.ring give
them their public names; tests/test_wire.py checks both against the Go
golden vectors, and internal/wiregen's test fails when this file is stale.
"""

`)
	pkg, file, block := "", "", -1
	for _, c := range cs {
		if c.Pkg != pkg || c.File != file {
			pkg, file = c.Pkg, c.File
			fmt.Fprintf(&b, "\n# %s/%s\n", c.Pkg, c.File)
		}
		if c.block != block {
			block = c.block
			b.WriteByte('\n')
			writeComment(&b, c.Group)
		}
		val := fmt.Sprintf("%d", c.Value)
		if c.Hex {
			val = fmt.Sprintf("%#x", c.Value)
		}
		line := fmt.Sprintf("%s = %s", c.Python, val)
		note := c.Name + " " + c.Type
		if c.Comment != "" {
			note += ": " + c.Comment
		}
		fmt.Fprintf(&b, "%s  # %s\n", line, note)
	}
	return b.Bytes()
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

// Generate loads the constants under root and renders _wire.py.
func Generate(root string) ([]byte, error) {
	cs, err := LoadAll(root)
	if err != nil {
		return nil, err
	}
	return Python(cs), nil
}
