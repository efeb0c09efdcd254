package benchcli

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/bench/nodebench"
	"github.com/ringside-kv/ringside/internal/units"
)

// benchNodeCommand is `ringside-bench node`: the node tier's fetch
// throughput against a plain copy of the same bytes.
func benchNodeCommand() *cli.Command {
	e := func(name string) []string { return env("bench.node." + name) }
	return &cli.Command{
		Name:  "node",
		Usage: "the node tier (sidecar/node): GB/s of fetches from a node pool into a pod pool, per block size, against Go's copy() of the same blocks, alternated in the same run",
		Description: "Runs the node tier's server and a sidecar's client of it in this process, over the real\n" +
			"socket and memfds (as sidecar/node's BenchmarkNodeTier), writes --working-bytes of blocks,\n" +
			"then alternates: fetches of --blocks of them at a time, cycling through them, into the pod pool (the client's Fetches of up\n" +
			"to 64 values, the node's copy with CRC32C straight into the pool, the client's check of each reply) until --total-bytes,\n" +
			"and a copy() of the same bytes block by block. Every fetched byte is compared. The default block sizes\n" +
			"are real models' blocks of 16 and 32 tokens, bf16: 192 KiB (Qwen2.5-0.5B, 16 tokens), 640 KiB (Llama-3.1-70B\n" +
			"per rank at tensor parallelism 8, 16 tokens), 2 MiB and 4 MiB (Llama-3.1-8B, 16 and 32 tokens).",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "block-bytes", Value: "192KiB,640KiB,2MiB,4MiB", Usage: "block (value) sizes, comma separated", EnvVars: e("block-bytes")},
			&cli.IntFlag{Name: "blocks", Value: 64, Usage: "blocks per fetch (an acquire's fetch)", EnvVars: e("blocks")},
			&cli.StringFlag{Name: "total-bytes", Value: "256MiB", Usage: "bytes fetched, and copied, per block size and repetition", EnvVars: e("total-bytes")},
			&cli.StringFlag{Name: "working-bytes", Value: "128MiB", Usage: "blocks the node holds, which the fetches (and the copies) cycle through: beyond the CPU's caches", EnvVars: e("working-bytes")},
			&cli.IntFlag{Name: "inflight", Value: 1, Usage: "fetches in flight at once, of different blocks (as concurrent acquires' fetches); the copy then copies as many", EnvVars: e("inflight")},
			&cli.IntFlag{Name: "reps", Value: 5, Usage: "repetitions, each a fetch pass and a copy pass (the medians are reported)", EnvVars: e("reps")},
			&cli.StringFlag{Name: "dir", Usage: "directory of the node's socket (default $TMPDIR/ringside-nodebench-<pid>)", EnvVars: e("dir")},
			&cli.BoolFlag{Name: "json", Usage: "print JSON Lines (rows node_fetch)", EnvVars: e("json")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress lines", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			var sizes []int
			for _, f := range strings.Split(c.String("block-bytes"), ",") {
				v, err := units.ParseBytes(strings.TrimSpace(f))
				if err != nil || v < 4096 || v > 64<<20 {
					return fmt.Errorf("--block-bytes %q: want sizes of 4KiB to 64MiB", f)
				}
				sizes = append(sizes, int(v))
			}
			total, err := units.ParseBytes(c.String("total-bytes"))
			if err != nil {
				return fmt.Errorf("--total-bytes: %w", err)
			}
			working, err := units.ParseBytes(c.String("working-bytes"))
			if err != nil {
				return fmt.Errorf("--working-bytes: %w", err)
			}
			ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
			defer stop()
			_, err = nodebench.Run(ctx, nodebench.Config{BlockBytes: sizes, Blocks: c.Int("blocks"), TotalBytes: int64(total), WorkingBytes: int64(working), Reps: c.Int("reps"), Inflight: c.Int("inflight"),
				Dir: c.String("dir"), JSON: c.Bool("json"), Quiet: c.Bool("quiet"), Out: c.App.Writer, Log: c.App.ErrWriter})
			return err
		},
	}
}
