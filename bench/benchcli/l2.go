package benchcli

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/bench/l2bench"
	"github.com/ringside-kv/ringside/internal/units"
)

// benchL2Command is `ringside-bench l2`: the shared tier's store and fetch
// throughput through live sidecars against a plain client loop.
func benchL2Command() *cli.Command {
	e := func(name string) []string { return env("bench.l2." + name) }
	return &cli.Command{
		Name:  "l2",
		Usage: "the shared tier (Redis) through live sidecars: store and fetch GB/s per value size, against a plain go-redis loop of SET/GET of the same values (the ceiling), single node and cluster",
		Description: "Starts redis-server (a single node, and a cluster of 3 masters with a replica each) unless\n" +
			"--topology addrs:HOST:PORT,... names one, and two sidecars (--pool.slot-bytes = the value size)\n" +
			"per value size. Store: an engine stores N blocks on sidecar A; timed until A's tier has written\n" +
			"them all. Fetch: an engine on sidecar B acquires them; timed until its lease is ready (every\n" +
			"byte then loaded and compared). The ceiling's loops run in the same run against the same server.",
		Flags: []cli.Flag{
			ringsideFlag(e("ringside")),
			&cli.StringFlag{Name: "topology", Value: "single,cluster", Usage: "comma separated: single, cluster (started here), or addrs:HOST:PORT[;HOST:PORT...] (an existing server)", EnvVars: e("topology")},
			&cli.StringFlag{Name: "value-bytes", Value: "256KiB,1MiB,4MiB,16MiB", Usage: "value (block) sizes, comma separated", EnvVars: e("value-bytes")},
			&cli.StringFlag{Name: "total-bytes", Value: "256MiB", Usage: "bytes stored and fetched per value size and repetition", EnvVars: e("total-bytes")},
			&cli.IntFlag{Name: "reps", Value: 3, Usage: "repetitions (the median is reported)", EnvVars: e("reps")},
			&cli.IntFlag{Name: "writers", Value: 8, Usage: "the tier's writers (--l2.redis.writers), and the ceiling's SET goroutines", EnvVars: e("writers")},
			&cli.StringFlag{Name: "dir", Usage: "base directory of the sidecars (default /dev/shm/ringside-l2bench-<pid>)", EnvVars: e("dir")},
			&cli.DurationFlag{Name: "timeout", Value: 2 * time.Minute, Usage: "bound on startup and every measurement", EnvVars: e("timeout")},
			&cli.BoolFlag{Name: "json", Usage: "print JSON Lines (rows l2)", EnvVars: e("json")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress lines", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			var values []uint64
			for _, f := range strings.Split(c.String("value-bytes"), ",") {
				v, err := units.ParseBytes(strings.TrimSpace(f))
				if err != nil || v < 4096 {
					return fmt.Errorf("--value-bytes %q: want sizes of at least 4KiB", f)
				}
				values = append(values, v)
			}
			total, err := units.ParseBytes(c.String("total-bytes"))
			if err != nil {
				return fmt.Errorf("--total-bytes: %w", err)
			}
			var topos []string
			for _, t := range strings.Split(c.String("topology"), ",") {
				if t = strings.TrimSpace(t); t != "" {
					topos = append(topos, strings.ReplaceAll(t, ";", ","))
				}
			}
			ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
			defer stop()
			_, err = l2bench.Run(ctx, l2bench.Config{Ringside: c.String("ringside"), Topologies: topos, ValueBytes: values,
				TotalBytes: total, Reps: c.Int("reps"), Writers: c.Int("writers"), Dir: c.String("dir"), Timeout: c.Duration("timeout"),
				JSON: c.Bool("json"), Quiet: c.Bool("quiet"), Out: c.App.Writer, Log: c.App.ErrWriter})
			return err
		},
	}
}
