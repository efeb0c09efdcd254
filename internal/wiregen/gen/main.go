// Command gen writes connector/python/ringside/_wire.py from the Go wire
// constants (package wiregen). It runs from `go generate ./schema/`:
//
//	go run ../internal/wiregen/gen -root ..
//
// With -o - it prints the module instead (tests/test_wire.py compares that
// with the committed file).
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/ringside-kv/ringside/internal/wiregen"
)

func main() {
	root := flag.String("root", ".", "module root")
	out := flag.String("o", "", "output file (default: ROOT/"+wiregen.Output+"; - for stdout)")
	flag.Parse()
	b, err := wiregen.Generate(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	switch *out {
	case "-":
		_, err = os.Stdout.Write(b)
	case "":
		err = os.WriteFile(filepath.Join(*root, wiregen.Output), b, 0o644)
	default:
		err = os.WriteFile(*out, b, 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
