// Command ringside-bench runs ringside's benchmarks: ring, poll, delta,
// replay and copy (docs/benchmarks.md). It is a binary of its own so that
// the product, ringside, links none of their code, plotting or test peers.
package main

import (
	"fmt"
	"os"

	"github.com/ringside-kv/ringside/bench/benchcli"
)

func main() {
	if err := benchcli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "ringside-bench:", err)
		os.Exit(1)
	}
}
