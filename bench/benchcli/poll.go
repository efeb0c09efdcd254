package benchcli

import (
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/bench/pollbench"
	"github.com/ringside-kv/ringside/internal/units"
)

// benchPollCommand is `ringside-bench poll`: per-call latency of polling
// waiting queries of 64, 256 and 1024 hashes on a live sidecar process.
func benchPollCommand() *cli.Command {
	// The bench.poll prefix keeps the sidecar's own variables (RINGSIDE_DIR)
	// from steering a benchmark.
	e := func(name string) []string { return env("bench.poll." + name) }
	return &cli.Command{
		Name:  "poll",
		Usage: "Poll latency on waiting queries of 64/256/1024 hashes against a live sidecar process: Go over the ring, Go over a Unix socket (same records), Python",
		Description: "Starts `ringside serve` (--ringside) with a private --dir, publishes --pages pages,\n" +
			"fills the instance's load budget with one lease, queues one waiting query per size and\n" +
			"times --batches batches of --polls Poll calls per row. The uds rows go through the hidden\n" +
			"`poll-relay` process, which forwards each framed record over its own ring session.\n" +
			"The python row runs `python3 -m ringside._pollbench` and is skipped, with the reason,\n" +
			"when Python or the session client (connector/python/ringside/client.py) is missing.",
		Flags: []cli.Flag{
			ringsideFlag(e("ringside")),
			&cli.StringFlag{Name: "dir", Usage: "sidecar directory (default /dev/shm/ringside-pollbench-<pid>); removed at the end if the run created it", EnvVars: e("dir")},
			&cli.StringFlag{Name: "sizes", Value: "64,256,1024", Usage: "hashes per waiting query, comma separated", EnvVars: e("sizes")},
			&cli.IntFlag{Name: "polls", Value: 1000, Usage: "timed polls per batch", EnvVars: e("polls")},
			&cli.IntFlag{Name: "batches", Value: 3, Usage: "batches per row (p50_ns is the median of the batch medians)", EnvVars: e("batches")},
			&cli.IntFlag{Name: "warmup", Value: 200, Usage: "untimed polls before each row", EnvVars: e("warmup")},
			&cli.IntFlag{Name: "pages", Value: 1024, Usage: "pages published and held under one lease (the budget is pages x page size)", EnvVars: e("pages")},
			&cli.StringFlag{Name: "page-bytes", Value: "64KiB", Usage: "bytes per page (and pool slot)", EnvVars: e("page-bytes")},
			&cli.DurationFlag{Name: "timeout", Value: time.Minute, Usage: "bound on startup, every call and every child process", EnvVars: e("timeout")},
			&cli.StringFlag{Name: "python", Value: "python3", Usage: "Python interpreter for the python row", EnvVars: e("python")},
			&cli.StringFlag{Name: "python-path", Usage: "directory holding the ringside Python package (default: connector/python near the executable or the working directory)", EnvVars: e("python-path")},
			&cli.BoolFlag{Name: "no-python", Usage: "skip the python row", EnvVars: e("no-python")},
			&cli.BoolFlag{Name: "no-uds", Usage: "skip the Unix-socket baseline", EnvVars: e("no-uds")},
			&cli.BoolFlag{Name: "json", Usage: "print one JSON object per row (JSON Lines); verdicts go to stderr", EnvVars: e("json")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress lines (and, with --json, no verdicts)", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			sizes, err := pollbench.ParseSizes(c.String("sizes"))
			if err != nil {
				return err
			}
			pb, err := units.ParseBytes(c.String("page-bytes"))
			if err != nil {
				return err
			}
			_, err = pollbench.Run(c.Context, pollbench.Config{
				Ringside:   c.String("ringside"),
				Dir:        c.String("dir"),
				Sizes:      sizes,
				Polls:      c.Int("polls"),
				Batches:    c.Int("batches"),
				Warmup:     c.Int("warmup"),
				Pages:      c.Int("pages"),
				PageBytes:  int(pb),
				Timeout:    c.Duration("timeout"),
				Python:     c.String("python"),
				PythonPath: c.String("python-path"),
				NoPython:   c.Bool("no-python"),
				NoUDS:      c.Bool("no-uds"),
				JSON:       c.Bool("json"),
				Quiet:      c.Bool("quiet"),
				Out:        c.App.Writer,
				Log:        c.App.ErrWriter,
			})
			return err
		},
	}
}

// benchPollRelayCommand is the socket front end of `poll`, run by it
// in a child process; not for direct use.
func benchPollRelayCommand() *cli.Command {
	e := func(name string) []string { return env("bench.poll-relay." + name) }
	return &cli.Command{
		Name:   "poll-relay",
		Usage:  "Unix-socket front end of `poll` (internal)",
		Hidden: true,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "sidecar", Required: true, Usage: "the sidecar's attach socket", EnvVars: e("sidecar")},
			&cli.StringFlag{Name: "listen", Required: true, Usage: "Unix socket to serve framed records on", EnvVars: e("listen")},
			&cli.StringFlag{Name: "instance", Required: true, Usage: "engine instance to attach as", EnvVars: e("instance")},
			&cli.StringFlag{Name: "model", Required: true, Usage: "model id", EnvVars: e("model")},
			&cli.StringFlag{Name: "layout", Required: true, Usage: "layout fingerprint", EnvVars: e("layout")},
			&cli.DurationFlag{Name: "timeout", Value: time.Minute, Usage: "bound on waiting for the client and on every call", EnvVars: e("timeout")},
		},
		Action: func(c *cli.Context) error {
			return pollbench.Relay(pollbench.RelayConfig{
				Sidecar:  c.String("sidecar"),
				Listen:   c.String("listen"),
				Instance: c.String("instance"),
				Model:    c.String("model"),
				Layout:   c.String("layout"),
				Timeout:  c.Duration("timeout"),
				Ready:    c.App.Writer,
			})
		},
	}
}
