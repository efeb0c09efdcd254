// Command ringside is the KV-cache sidecar for LLM inference engines: one
// binary with the subcommands serve, inspect and version. The benchmarks
// are cmd/ringside-bench; this binary links none of their code (see
// deps_test.go).
package main

import (
	"fmt"
	"os"

	"github.com/ringside-kv/ringside/internal/cli"
)

func main() {
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "ringside:", err)
		os.Exit(1)
	}
}
