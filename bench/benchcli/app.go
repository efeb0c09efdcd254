// Package benchcli is ringside-bench's command line: the benchmarks, each a
// subcommand (ring, poll, delta, replay, copy, l2, node) with its flags and their
// RINGSIDE_BENCH_* environment variables, and the hidden subcommands that
// the benchmarks re-run this executable as (their servers, relays and
// peers). The sidecar that poll and replay start is the product binary,
// `ringside serve`, found by harness.FindRingside.
package benchcli

import (
	"strings"

	"github.com/urfave/cli/v2"
)

// Version is set at build time with -ldflags "-X ...benchcli.Version=...".
var Version = "dev"

// App returns the ringside-bench command-line application.
func App() *cli.App {
	return &cli.App{
		Name:    "ringside-bench",
		Usage:   "ringside's benchmarks, against real rings and live sidecar processes",
		Version: Version,
		Commands: []*cli.Command{
			benchRingCommand(),
			benchPollCommand(),
			benchDeltaCommand(),
			benchReplayCommand(),
			benchCopyCommand(),
			benchL2Command(),
			benchNodeCommand(),
			// Hidden: run by the benchmarks above in child processes.
			benchRingServerCommand(),
			benchPollRelayCommand(),
			benchReplayRelayCommand(),
			benchCopyPeerCommand(),
		},
	}
}

// env names the environment variable of a flag: RINGSIDE_ and the flag name
// in upper case with dots and dashes as underscores (the rule of ringside's
// own flags, internal/cli).
func env(flag string) []string {
	r := strings.NewReplacer(".", "_", "-", "_")
	return []string{"RINGSIDE_" + strings.ToUpper(r.Replace(flag))}
}

// ringsideFlag is the --ringside flag of the benchmarks that start a
// sidecar.
func ringsideFlag(envVars []string) cli.Flag {
	return &cli.StringFlag{Name: "ringside", Usage: "the ringside executable to start as the sidecar (`PATH` serve ...); default: ringside beside this executable, else on $PATH", EnvVars: envVars}
}
