// Package benchtest lets a benchmark package's test binary stand in for
// both executables that a benchmark runs: re-executed with the package's
// child variable set, it is `ringside` for `serve` (internal/cli) and
// `ringside-bench` for everything else (the hidden servers, relays and
// peers of bench/benchcli), so that the tests run the real command lines
// in real child processes.
package benchtest

import (
	"fmt"
	"os"
	"testing"

	"github.com/ringside-kv/ringside/bench/benchcli"
	"github.com/ringside-kv/ringside/internal/cli"
)

// Main is a test binary's TestMain: as a child (childEnv=1) it runs the
// command line and exits; otherwise it sets childEnv for the children it
// will start and runs the tests.
func Main(m *testing.M, childEnv string) {
	if os.Getenv(childEnv) == "1" {
		app := benchcli.App()
		if len(os.Args) > 1 && (os.Args[1] == "serve" || os.Args[1] == "node") {
			app = cli.App()
		}
		if err := app.Run(os.Args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Setenv(childEnv, "1") // inherited by the child processes only
	os.Exit(m.Run())
}

// Ringside is the --ringside flag that makes a benchmark start this test
// binary as its sidecar.
func Ringside(t testing.TB) []string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return []string{"--ringside", exe}
}
