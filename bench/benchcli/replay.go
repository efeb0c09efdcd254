package benchcli

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/ringside-kv/ringside/bench/replay"
	"github.com/ringside-kv/ringside/internal/units"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// benchReplayCommand is `ringside-bench replay`: a trace replayed through
// live sidecar processes, one per pool capacity, against an offline LRU.
func benchReplayCommand() *cli.Command {
	e := func(name string) []string { return env("bench.replay." + name) }
	return &cli.Command{
		Name:  "replay",
		Usage: "replay request traces (Mooncake JSONL) through live sidecars over a capacity sweep, against an exact offline LRU, vLLM's ARC, the offline optimum and the multi-queue policies MQP and MQP2; latency, step cost, sidecar CPU; table, JSON Lines, CSV and PNG plots",
		Description: "Expands each trace block into --page-tokens pages (chained hashes), starts `ringside serve`\n" +
			"(--ringside) once per --capacity-pages, and drives it from --engines simulated engine\n" +
			"instances, each its own session with its own registered memory: per request, register the\n" +
			"hashes, look up, acquire (poll until ready) and load the hit prefix, store the missed pages,\n" +
			"release. Every engine step first catches up with the change log (delta) and, as the baseline,\n" +
			"walks its whole view of the cache. Hit rates are printed beside an exact offline model of the\n" +
			"sidecar's --cache.policy (LRU, or MQP) of the same semantics; with --sequential (one request\n" +
			"at a time, trace order) they must be equal.\n" +
			"Beside them, offline: ARC as vLLM's offloading connector runs it, and the optimum's bound\n" +
			"(Belady's MIN with bypass: its block hits bound any policy's prefix hits), and the cache's\n" +
			"multi-queue policies MQP and MQP2 (tip history, measured lifetime, scan guards).\n" +
			"--offline runs those alone, no sidecar.\n" +
			"--workload agentic replays a generated agentic workload (sessions, tool calls, forks, a scan)\n" +
			"instead of --trace.\n" +
			"A Unix-socket run of the same replay (through a relay process) is the transport baseline.\n" +
			"Files in --out: replay.jsonl, capacity.csv, policies.csv, ops.csv, sidecar.csv, steps.csv,\n" +
			"verdicts.txt, hit-rate.png, policies.png, latency.png, step-cost.png.",
		Flags: []cli.Flag{
			ringsideFlag(e("ringside")),
			&cli.StringSliceFlag{Name: "trace", Usage: "trace file, JSON Lines {timestamp ms, input_length, output_length, hash_ids} (repeatable: merged by timestamp, sharing no blocks)", EnvVars: e("trace")},
			&cli.StringFlag{Name: "workload", Value: "trace", Usage: "trace (the --trace files), agentic (generated: agent sessions with tool calls, forks, long idle gaps and a one-off scan; docs/benchmarks.md), or agentic-scan (the same with a scan three times as long, of longer prompts)", EnvVars: e("workload")},
			&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "seed of the generated workload", EnvVars: e("seed")},
			&cli.IntFlag{Name: "page-tokens", Value: replay.DefaultPageTokens, Usage: "tokens per engine page", EnvVars: e("page-tokens")},
			&cli.IntFlag{Name: "block-tokens", Value: 512, Usage: "tokens per trace block (hash id)", EnvVars: e("block-tokens")},
			&cli.IntSliceFlag{Name: "capacity-pages", Usage: "pool capacity in pages, one run each (repeatable or comma separated; default: 1, 4, 16 and 64 GiB of model KV)", EnvVars: e("capacity-pages")},
			&cli.IntFlag{Name: "engines", Value: replay.DefaultEngines, Usage: "simulated engine instances (sessions), each with its own memory", EnvVars: e("engines")},
			&cli.StringFlag{Name: "cache.policy", Value: cache.DefaultPolicy.String(), Usage: "the sidecars' eviction policy (serve --cache.policy, and serve's default): lru, mqp or mqp2; the runs are checked against its exact offline model (LRU, MQP or MQP2: bench/replay/mqp.go, mqp2.go); --nodes and the shared tier are modelled with lru only, --node-tier's pods with any", EnvVars: e("cache.policy")},
			&cli.BoolFlag{Name: "informed", Usage: "also report LRUs told which pages are read again (ever, within 1000, 300, 100 requests): what an online policy lacks, beside the optimum (analysis, offline)", EnvVars: e("informed")},
			&cli.BoolFlag{Name: "offline", Usage: "run no sidecar: the offline policies alone (LRU, ARC, the optimum, MQP, MQP2) at the --capacity-pages; bounded by CPU, not /dev/shm", EnvVars: e("offline")},
			&cli.BoolFlag{Name: "hints", Usage: "also run each capacity with retention hints: each request's hint (the agentic workload's; a trace line's optional session, session_end, retain_s, priority) sent as a Retain after its store, a session's last request ending its retentions, priority -1 sending nothing (transport ring+hints; not checked against a model)", EnvVars: e("hints")},
			&cli.BoolFlag{Name: "sequential", Usage: "one request at a time in trace order: deterministic hit rates, equal to the offline LRU's", EnvVars: e("sequential")},
			&cli.Float64Flag{Name: "pace", Usage: "0: as fast as possible; F: at the trace's timestamps divided by F (1 = real time)", EnvVars: e("pace")},
			&cli.Float64Flag{Name: "prefill-tps", Usage: "modelled prefill speed in tokens/s: an engine waits missed tokens / this before storing (0: no wait)", EnvVars: e("prefill-tps")},
			&cli.StringFlag{Name: "page-bytes", Value: "auto", Usage: "bytes each page really copies (and pool slot bytes); auto: 4KiB, the model's page scaled down to fit a small machine", EnvVars: e("page-bytes")},
			&cli.StringFlag{Name: "kv-bytes-per-token", Value: "128KiB", Usage: "model KV bytes per token (Llama-3-8B: 128KiB), for the GiB equivalents of capacities", EnvVars: e("kv-bytes-per-token")},
			&cli.IntFlag{Name: "limit", Usage: "replay only the first N requests (0: all)", EnvVars: e("limit")},
			&cli.IntFlag{Name: "nodes", Value: 1, Usage: "sidecars (nodes, each a pool of the capacity) the engines are spread over: engine e on node e mod nodes", EnvVars: e("nodes")},
			&cli.StringFlag{Name: "l2.redis.addrs", Usage: "a Redis node or cluster (comma-separated seeds) the nodes share as their tier: each capacity runs without it (ring) and with it (ring+l2)", EnvVars: e("l2.redis.addrs")},
			&cli.StringFlag{Name: "l2.start", Usage: "start the shared tier for the run: single (one redis-server) or cluster (3 masters, 3 replicas); needs redis-server and redis-cli", EnvVars: e("l2.start")},
			&cli.BoolFlag{Name: "node-tier", Usage: "one node's pods: every engine its own pod (sidecar), the capacity their pages in all; each capacity runs with pods' own pools of capacity/engines (ring) and with smaller pools over one real `ringside node` holding the rest of the capacity (ring+node, one run per --node-tier.pod-fraction); modelled under any --cache.policy, the node tier an LRU (exact with --sequential)", EnvVars: e("node-tier")},
			&cli.Float64SliceFlag{Name: "node-tier.pod-fraction", Usage: "--node-tier: each pod's pool in the ring+node runs, as a fraction of capacity/engines (at least 16 pages; the node tier holds the rest); repeatable or comma separated (default 0.25,0.0625)", EnvVars: e("node-tier.pod-fraction")},
			&cli.BoolFlag{Name: "no-uds", Usage: "skip the Unix-socket baseline run", EnvVars: e("no-uds")},
			&cli.IntFlag{Name: "uds-capacity-pages", Usage: "capacity of the Unix-socket run (default: the smallest of the sweep, the quickest run)", EnvVars: e("uds-capacity-pages")},
			&cli.BoolFlag{Name: "no-walk", Usage: "skip the walk-the-cache baseline of the per-step metadata", EnvVars: e("no-walk")},
			&cli.StringFlag{Name: "dir", Usage: "base directory of the sidecars (default /dev/shm/ringside-replay-<pid>); removed at the end", EnvVars: e("dir")},
			&cli.StringFlag{Name: "out", Value: "ringside-replay", Usage: "report directory (JSON Lines, CSV, PNG plots); - for none", EnvVars: e("out")},
			&cli.DurationFlag{Name: "timeout", Value: time.Minute, Usage: "bound on startup, every call and every child process", EnvVars: e("timeout")},
			&cli.BoolFlag{Name: "json", Usage: "print JSON Lines (rows replay, replay_policy, replay_op, replay_sidecar); verdicts go to stderr", EnvVars: e("json")},
			&cli.BoolFlag{Name: "quiet", Usage: "no progress bar or lines (and, with --json, no verdicts)", EnvVars: e("quiet")},
		},
		Action: func(c *cli.Context) error {
			pb := int64(0)
			if s := c.String("page-bytes"); s != "auto" && s != "" {
				v, err := units.ParseBytes(s)
				if err != nil {
					return fmt.Errorf("--page-bytes: %w", err)
				}
				pb = int64(v)
			}
			kv, err := units.ParseBytes(c.String("kv-bytes-per-token"))
			if err != nil {
				return fmt.Errorf("--kv-bytes-per-token: %w", err)
			}
			progress := false
			if f, ok := c.App.ErrWriter.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
				progress = true
			}
			// Interrupted, the run still stops its sidecars and removes
			// their directories.
			ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
			defer stop()
			_, err = replay.Run(ctx, replay.Config{
				Ringside:             c.String("ringside"),
				Traces:               c.StringSlice("trace"),
				Workload:             c.String("workload"),
				Seed:                 c.Uint64("seed"),
				PageTokens:           c.Int("page-tokens"),
				BlockTokens:          c.Int("block-tokens"),
				CapacityPages:        c.IntSlice("capacity-pages"),
				Engines:              c.Int("engines"),
				Sequential:           c.Bool("sequential"),
				Offline:              c.Bool("offline"),
				Informed:             c.Bool("informed"),
				Policy:               c.String("cache.policy"),
				Hints:                c.Bool("hints"),
				Pace:                 c.Float64("pace"),
				PrefillTPS:           c.Float64("prefill-tps"),
				PageBytes:            int(pb),
				KVBytesPerToken:      int(kv),
				Limit:                c.Int("limit"),
				Nodes:                c.Int("nodes"),
				L2Addrs:              splitAddrs(c.String("l2.redis.addrs")),
				L2Start:              c.String("l2.start"),
				NodeTier:             c.Bool("node-tier"),
				NodeTierPodFractions: c.Float64Slice("node-tier.pod-fraction"),
				NoUDS:                c.Bool("no-uds"),
				UDSCapacity:          c.Int("uds-capacity-pages"),
				NoWalk:               c.Bool("no-walk"),
				Dir:                  c.String("dir"),
				OutDir:               c.String("out"),
				Timeout:              c.Duration("timeout"),
				JSON:                 c.Bool("json"),
				Quiet:                c.Bool("quiet"),
				Progress:             progress,
				Out:                  c.App.Writer,
				Log:                  c.App.ErrWriter,
			})
			return err
		},
	}
}

// benchReplayRelayCommand is the socket front end of `replay`, one
// per engine, run by it in a child process; not for direct use.
func benchReplayRelayCommand() *cli.Command {
	e := func(name string) []string { return env("bench.replay-relay." + name) }
	return &cli.Command{
		Name:   "replay-relay",
		Usage:  "Unix-socket front end of `replay` (internal)",
		Hidden: true,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "sidecar", Required: true, Usage: "the sidecar's attach socket", EnvVars: e("sidecar")},
			&cli.StringFlag{Name: "listen", Required: true, Usage: "Unix socket to serve framed records on", EnvVars: e("listen")},
			&cli.StringFlag{Name: "instance", Required: true, Usage: "engine instance to attach as", EnvVars: e("instance")},
			&cli.StringFlag{Name: "model", Required: true, Usage: "model id", EnvVars: e("model")},
			&cli.StringFlag{Name: "layout", Required: true, Usage: "layout fingerprint", EnvVars: e("layout")},
			&cli.StringSliceFlag{Name: "region", Usage: "engine memory to map and register: ID:PAGE_BYTES:PAGES:PATH (repeatable)", EnvVars: e("region")},
			&cli.DurationFlag{Name: "timeout", Value: time.Minute, Usage: "bound on waiting for the client and on every call", EnvVars: e("timeout")},
		},
		Action: func(c *cli.Context) error {
			var regions []replay.RegionFile
			for _, s := range c.StringSlice("region") {
				r, err := replay.ParseRegion(s)
				if err != nil {
					return err
				}
				regions = append(regions, r)
			}
			return replay.Relay(replay.RelayConfig{
				Sidecar:  c.String("sidecar"),
				Listen:   c.String("listen"),
				Instance: c.String("instance"),
				Model:    c.String("model"),
				Layout:   c.String("layout"),
				Timeout:  c.Duration("timeout"),
				Ready:    c.App.Writer,
				Regions:  regions,
			})
		},
	}
}

func splitAddrs(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}
