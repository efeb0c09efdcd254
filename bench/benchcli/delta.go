package benchcli

import (
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/bench/deltabench"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// benchDeltaCommand is `ringside-bench delta`: the cache's metadata cost per
// engine step (delta log versus a walk of the index) and per block.
func benchDeltaCommand() *cli.Command {
	e := func(name string) []string { return env("bench.delta." + name) }
	return &cli.Command{
		Name:  "delta",
		Usage: "per-step cost of following the cache through its delta log vs walking the index, and metadata bytes per block (in process)",
		Description: "Fills a cache.Cache with N present blocks (random 32-byte digests), then runs engine\n" +
			"steps that each store --stores new blocks (evicting old ones) while a consumer follows\n" +
			"the cache either through ChangesSince (method delta) or through Snapshot (method walk).\n" +
			"step_ns is the consumer's median cost per step; store_ns, the stores' cost, is common\n" +
			"to both. The memory row is for the largest size.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "sizes", Value: "10k,100k,1M,10M", Usage: "cached-block counts, comma separated (k = 1000, M = 1000000)", EnvVars: e("sizes")},
			&cli.IntFlag{Name: "steps", Value: 1000, Usage: "timed steps per method and size (walks stop early after --walk-budget)", EnvVars: e("steps")},
			&cli.IntFlag{Name: "warmup", Value: 50, Usage: "untimed steps before each method", EnvVars: e("warmup")},
			&cli.IntFlag{Name: "stores", Value: 32, Usage: "new blocks stored per step", EnvVars: e("stores")},
			&cli.DurationFlag{Name: "walk-budget", Value: deltabenchWalkBudget, Usage: "time after which walk rows stop (at least 11 steps)", EnvVars: e("walk-budget")},
			&cli.StringFlag{Name: "cache.policy", Value: cache.DefaultPolicy.String(), Usage: "the cache's eviction policy (serve --cache.policy): lru, mqp or mqp2", EnvVars: e("cache.policy")},
			&cli.BoolFlag{Name: "json", Usage: "print one JSON object per row (JSON Lines); verdicts go to stderr", EnvVars: e("json")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress lines (and, with --json, no verdicts)", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			sizes, err := deltabench.ParseSizes(c.String("sizes"))
			if err != nil {
				return err
			}
			_, err = deltabench.Run(deltabench.Config{
				Sizes:         sizes,
				Steps:         c.Int("steps"),
				Warmup:        c.Int("warmup"),
				StoresPerStep: c.Int("stores"),
				WalkBudget:    c.Duration("walk-budget"),
				Policy:        c.String("cache.policy"),
				JSON:          c.Bool("json"),
				Quiet:         c.Bool("quiet"),
				Out:           c.App.Writer,
				Log:           c.App.ErrWriter,
			})
			return err
		},
	}
}

const deltabenchWalkBudget = 3 * time.Second
