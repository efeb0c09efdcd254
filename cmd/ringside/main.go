// Command ringside is the KV-cache sidecar for LLM inference engines: one
// binary with the subcommands serve, bench, inspect and version.
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
