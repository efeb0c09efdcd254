// Command gen writes the Python wire modules (connector/python/ringside/
// _wire_schema.py and _wire_ring.py) from the Go packages schema and ring
// (package wiregen). It runs from `go generate ./schema/`:
//
//	go run ../internal/wiregen/gen -root ..
//
// With -print PKG it prints package PKG's module instead
// (tests/test_wire.py compares that with the committed file).
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/ringside-kv/ringside/internal/wiregen"
)

func main() {
	root := flag.String("root", ".", "module root")
	only := flag.String("print", "", "print this package's module (schema, ring) instead of writing the files")
	flag.Parse()
	mods, err := wiregen.Generate(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if *only != "" {
		b, ok := mods[wiregen.Output(*only)]
		if !ok {
			fmt.Fprintf(os.Stderr, "gen: no package %q (of %v)\n", *only, wiregen.Sources)
			os.Exit(2)
		}
		_, err = os.Stdout.Write(b)
	} else {
		paths := make([]string, 0, len(mods))
		for p := range mods {
			paths = append(paths, p)
		}
		sort.Strings(paths)
		for _, p := range paths {
			if err = os.WriteFile(filepath.Join(*root, p), mods[p], 0o644); err != nil {
				break
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
