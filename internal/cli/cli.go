// Package cli defines ringside's command line: flags (each with a RINGSIDE_
// environment variable), subcommands, and the wiring from flags to the
// sidecar and the inspector. The benchmarks are another binary,
// ringside-bench (bench/benchcli), that this one never links.
package cli

import (
	"errors"
	"strings"

	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/internal/logx"
	"github.com/ringside-kv/ringside/internal/units"
)

// Version is set at build time with -ldflags "-X ...cli.Version=...".
var Version = "dev"

// App returns the ringside command-line application.
func App() *cli.App {
	return &cli.App{
		Name:    "ringside",
		Usage:   "KV-cache connector sidecar for LLM inference engines",
		Version: Version,
		Flags:   logFlags(),
		Commands: []*cli.Command{
			serveCommand(),
			nodeCommand(),
			inspectCommand(),
			eventsCommand(),
			movedBenchCommand(),
			{
				Name:  "version",
				Usage: "print the version",
				Action: func(c *cli.Context) error {
					_, err := c.App.Writer.Write([]byte("ringside " + Version + "\n"))
					return err
				},
			},
		},
	}
}

// logFlags are accepted before the subcommand and on serve.
func logFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "log.format", Value: "json", Usage: "log format: json (one object a line) or console (for people)", EnvVars: env("log.format")},
		&cli.StringFlag{Name: "log.level", Value: "info", Usage: "log level: trace, debug, info, warn, error", EnvVars: env("log.level")},
	}
}

// env names the environment variable of a flag: RINGSIDE_ and the flag name
// in upper case with dots and dashes as underscores.
func env(flag string) []string {
	r := strings.NewReplacer(".", "_", "-", "_")
	return []string{"RINGSIDE_" + strings.ToUpper(r.Replace(flag))}
}

// logger builds the logger from the log flags: serve's own, else those
// given before the subcommand (`ringside --log.format=console serve`).
func logger(c *cli.Context) (zerolog.Logger, error) {
	return logx.New(c.App.ErrWriter, logSetting(c, "log.format"), logSetting(c, "log.level"))
}

// logSetting is the value of a log flag set on the nearest command that
// defines it (the subcommand's, then the app's), else its default: a
// subcommand's own log flags would otherwise hide those given before it.
func logSetting(c *cli.Context, name string) string {
	for _, x := range c.Lineage() {
		if x.IsSet(name) {
			return x.String(name)
		}
	}
	return c.String(name)
}

// ParseBytes parses sizes like 4096, 64KiB, 1.5GiB, 16GB (powers of 1000)
// or 16G (powers of 1024): see units.ParseBytes.
func ParseBytes(s string) (uint64, error) { return units.ParseBytes(s) }

// movedBenchCommand answers `ringside bench ...`, which ran the benchmarks
// before they became their own binary, with where they are now.
func movedBenchCommand() *cli.Command {
	return &cli.Command{
		Name:            "bench",
		Hidden:          true,
		SkipFlagParsing: true,
		Action: func(*cli.Context) error {
			return errors.New("the benchmarks are their own binary now: ringside-bench ring|poll|delta|replay|copy (make build builds bin/ringside-bench)")
		},
	}
}
