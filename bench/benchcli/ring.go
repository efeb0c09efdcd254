package benchcli

import (
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/bench/ringbench"
)

// benchRingCommand is `ringside-bench ring`: ring latency and throughput
// between two processes, against a socket and a bare ping-pong.
func benchRingCommand() *cli.Command {
	// Env names carry the bench.ring prefix so that the sidecar's variables
	// (RINGSIDE_DIR) never steer, or get removed by, a benchmark.
	e := func(name string) []string { return env("bench.ring." + name) }
	return &cli.Command{
		Name:  "ring",
		Usage: "round-trip latency (Go and Python clients, ring vs Unix socket vs bare ping-pong) and one-way throughput of the shared-memory ring",
		Description: "The server side runs in a separate process (this executable, re-run as the hidden\n" +
			"`ring-server`). Python rows spawn `python3 -m ringside._benchpeer` and are\n" +
			"skipped, with the reason, when Python or connector/python is missing.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "dir", Usage: "directory for the benchmark's rings and socket (default /dev/shm/ringside-bench-<pid>); removed at the end if the run created it", EnvVars: e("dir")},
			&cli.IntFlag{Name: "rounds", Value: 20000, Usage: "timed round trips per latency row", EnvVars: e("rounds")},
			&cli.IntFlag{Name: "warmup", Value: 1000, Usage: "untimed round trips before each latency row", EnvVars: e("warmup")},
			&cli.IntFlag{Name: "msgs", Value: 5_000_000, Usage: "64-byte records in the one-way throughput row", EnvVars: e("msgs")},
			&cli.IntFlag{Name: "batch", Value: 32, Usage: "throughput row: records per Publish and per Commit", EnvVars: e("batch")},
			&cli.Uint64Flag{Name: "capacity", Value: 64 << 10, Usage: "data capacity of every ring in bytes (power of two)", EnvVars: e("capacity")},
			&cli.DurationFlag{Name: "timeout", Value: ringbenchDefaultTimeout, Usage: "bound on every row (each side's waits)", EnvVars: e("timeout")},
			&cli.StringFlag{Name: "python", Value: "python3", Usage: "Python interpreter for the Python rows", EnvVars: e("python")},
			&cli.StringFlag{Name: "python-path", Usage: "directory holding the ringside Python package (default: connector/python found near the executable or the working directory)", EnvVars: e("python-path")},
			&cli.BoolFlag{Name: "json", Usage: "print one JSON object per row (JSON Lines); verdicts go to stderr", EnvVars: e("json")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress lines (and, with --json, no verdicts)", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			_, err := ringbench.Run(c.Context, ringbench.Config{
				Dir:        c.String("dir"),
				Rounds:     c.Int("rounds"),
				Warmup:     c.Int("warmup"),
				Msgs:       c.Int("msgs"),
				Batch:      c.Int("batch"),
				Capacity:   c.Uint64("capacity"),
				Timeout:    c.Duration("timeout"),
				Python:     c.String("python"),
				PythonPath: c.String("python-path"),
				JSON:       c.Bool("json"),
				Quiet:      c.Bool("quiet"),
				Out:        c.App.Writer,
				Log:        c.App.ErrWriter,
			})
			return err
		},
	}
}

const ringbenchDefaultTimeout = 30 * time.Second

// benchRingServerCommand is the server side of `ring`, run by it in a
// child process; not for direct use.
func benchRingServerCommand() *cli.Command {
	e := func(name string) []string { return env("bench.ring-server." + name) }
	return &cli.Command{
		Name:   "ring-server",
		Usage:  "server process of `ring` (internal)",
		Hidden: true,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "mode", Required: true, Usage: "ring, uds, pingpong or throughput", EnvVars: e("mode")},
			&cli.StringFlag{Name: "req", Usage: "request ring path", EnvVars: e("req")},
			&cli.StringFlag{Name: "resp", Usage: "response ring path", EnvVars: e("resp")},
			&cli.StringFlag{Name: "socket", Usage: "Unix socket path to listen on", EnvVars: e("socket")},
			&cli.StringFlag{Name: "file", Usage: "ping-pong word file", EnvVars: e("file")},
			&cli.StringFlag{Name: "wait", Value: "spin", Usage: "spin or park", EnvVars: e("wait")},
			&cli.IntFlag{Name: "count", Required: true, Usage: "requests to serve, warm-up included", EnvVars: e("count")},
			&cli.IntFlag{Name: "batch", Value: 32, Usage: "throughput: records per Commit", EnvVars: e("batch")},
			&cli.DurationFlag{Name: "timeout", Value: ringbenchDefaultTimeout, Usage: "bound on every wait", EnvVars: e("timeout")},
		},
		Action: func(c *cli.Context) error {
			return ringbench.Serve(ringbench.ServerConfig{
				Mode:    c.String("mode"),
				Req:     c.String("req"),
				Resp:    c.String("resp"),
				Socket:  c.String("socket"),
				File:    c.String("file"),
				Wait:    c.String("wait"),
				Count:   c.Int("count"),
				Batch:   c.Int("batch"),
				Timeout: c.Duration("timeout"),
				Ready:   c.App.Writer,
			})
		},
	}
}
