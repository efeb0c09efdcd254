package benchcli

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/bench/copybench"
	"github.com/ringside-kv/ringside/gpu/gputest"
	"github.com/ringside-kv/ringside/internal/units"
)

// benchCopyCommand is `ringside-bench copy`: copy-engine bandwidth between
// the pool and engine memory in a second process.
func benchCopyCommand() *cli.Command {
	e := func(name string) []string { return env("bench.copy." + name) }
	return &cli.Command{
		Name:  "copy",
		Usage: "copy-engine bandwidth pool<->engine memory of a second process, batched vs per-range vs one plain copy, per page size and count",
		Description: "The engine side is this executable re-run as the hidden `copy-peer`: host memory\n" +
			"for --backend host (copied with process_vm_readv/writev), device memory exported with CUDA IPC\n" +
			"for --backend cuda. Directions: h2d = pool to engine (load), d2h = engine to pool (store).\n" +
			"ceiling = one plain copy of the same bytes (host: copy() in this process; cuda: one\n" +
			"cuMemcpy{HtoD,DtoH}Async of the contiguous pinned buffer).",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "backend", Value: "host", Usage: "host or cuda", EnvVars: e("backend")},
			&cli.StringFlag{Name: "page-bytes", Value: "16KiB,64KiB,256KiB,2MiB", Usage: "page sizes, comma separated", EnvVars: e("page-bytes")},
			&cli.StringFlag{Name: "pages", Value: "1,4,16,64,256,1024,4096", Usage: "pages per op, comma separated", EnvVars: e("pages")},
			&cli.StringFlag{Name: "max-bytes", Usage: "skip rows whose op moves more bytes (default 1GiB for host, 8GiB for cuda); pools and the peer's buffer are this large", EnvVars: e("max-bytes")},
			&cli.DurationFlag{Name: "min-time", Usage: "timed duration per row (default 40ms)", EnvVars: e("min-time")},
			&cli.BoolFlag{Name: "json", Usage: "print one JSON object per row (JSON Lines); verdicts go to stderr", EnvVars: e("json")},
			&cli.StringFlag{Name: "out", Usage: "also write the rows as JSON Lines to this file", EnvVars: e("out")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress lines", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			var pbs []uint64
			for _, f := range strings.Split(c.String("page-bytes"), ",") {
				b, err := units.ParseBytes(strings.TrimSpace(f))
				if err != nil || b == 0 {
					return fmt.Errorf("--page-bytes %q: %v", f, err)
				}
				pbs = append(pbs, b)
			}
			var pages []int
			for _, f := range strings.Split(c.String("pages"), ",") {
				n, err := strconv.Atoi(strings.TrimSpace(f))
				if err != nil || n <= 0 {
					return fmt.Errorf("--pages %q: want positive integers", f)
				}
				pages = append(pages, n)
			}
			var maxBytes uint64
			if s := c.String("max-bytes"); s != "" {
				var err error
				if maxBytes, err = units.ParseBytes(s); err != nil {
					return fmt.Errorf("--max-bytes: %v", err)
				}
			}
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			var jsonOut *os.File
			if p := c.String("out"); p != "" {
				if jsonOut, err = os.Create(p); err != nil {
					return fmt.Errorf("--out: %w", err)
				}
				defer jsonOut.Close()
			}
			cfg := copybench.Config{
				Backend:   c.String("backend"),
				PageBytes: pbs,
				Pages:     pages,
				MaxBytes:  maxBytes,
				MinTime:   c.Duration("min-time"),
				PeerArgv:  []string{exe, "copy-peer"},
				JSON:      c.Bool("json"),
				Quiet:     c.Bool("quiet"),
				Out:       c.App.Writer,
				Log:       c.App.ErrWriter,
			}
			if jsonOut != nil {
				cfg.JSONOut = jsonOut
			}
			_, err = copybench.Run(cfg)
			return err
		},
	}
}

// benchCopyPeerCommand is the engine side of `bench copy`; not for direct
// use (it serves requests on stdin).
func benchCopyPeerCommand() *cli.Command {
	return &cli.Command{
		Name:   "copy-peer",
		Usage:  "engine-side process of `bench copy` (internal)",
		Hidden: true,
		Action: func(c *cli.Context) error {
			kind := os.Getenv(gputest.PeerEnv)
			if kind == "" {
				return fmt.Errorf("copy-peer is started by `ringside-bench copy` (%s unset)", gputest.PeerEnv)
			}
			if code := gputest.PeerMain(kind); code != 0 {
				return cli.Exit("", code)
			}
			return nil
		},
	}
}
