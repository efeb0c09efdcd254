package cli

import (
	"context"
	"fmt"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/internal/units"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

func serveFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "dir", Value: ring.DefaultDir, Usage: "directory of the socket, the rings and the pool, on a memory-backed mount; created (mode 0700) if missing; refused at start if another uid owns it or may write to it (a group other than the sidecar's own only with --group-access); one sidecar per directory: it holds DIR/ringside.lock, and a second one refuses to start, naming the first's pid", EnvVars: env("dir")},
		&cli.StringFlag{Name: "socket", Usage: "attach socket path (empty: DIR/ringside.sock)", EnvVars: env("socket")},
		&cli.StringFlag{Name: "pool.bytes", Value: "auto", Usage: "size of the shared-memory block pool (e.g. 512MiB, 16GiB); auto: " + units.FormatBytes(sidecar.DefaultPoolBytes) + ", or half the free space of --dir if less. The pool does not survive a restart: a new sidecar recreates it empty, so nothing written before a crash is ever served", EnvVars: env("pool.bytes")},
		&cli.StringFlag{Name: "pool.slot-bytes", Value: units.FormatBytes(machine.DefaultSlotBytes), Usage: "bytes per pool slot: one tensor-parallel rank's shard of one block; engine pages must not be larger, and a smaller page wastes the rest of its slot", EnvVars: env("pool.slot-bytes")},
		&cli.BoolFlag{Name: "pool.reserve", Value: true, Usage: "allocate and map in the whole pool at start: its memory is charged now (a memory limit or /dev/shm size too small for it fails at start, not as the pool fills) and copies never take first-touch page faults; --pool.reserve=false leaves the pool file sparse, charged as it fills: a full mount then fails stores, or crashes the sidecar (SIGBUS) where it writes a never-touched pool page itself", EnvVars: env("pool.reserve")},
		&cli.StringFlag{Name: "budget", Value: units.FormatBytes(machine.DefaultBudgetBytes), Usage: "bytes an engine instance may have admitted for loading at once; a query over it waits, in order, and holds its share from admission until its lease is released or expires", EnvVars: env("budget")},
		&cli.DurationFlag{Name: "lease.ttl", Value: machine.DefaultLeaseTTL, Usage: "default lease lifetime: a query still waiting when its lease ends resolves as a miss (the engine recomputes); loads renew the lease while they copy", EnvVars: env("lease.ttl")},
		&cli.DurationFlag{Name: "lease.max-ttl", Value: machine.DefaultMaxLeaseTTL, Usage: "longest lease lifetime a client may ask for", EnvVars: env("lease.max-ttl")},
		&cli.DurationFlag{Name: "retain.max-ttl", Value: machine.DefaultMaxRetainTTL, Usage: "longest time a Retain may keep blocks for (a retention hint: its blocks are evicted after every block without one, never refused a store); a longer one is refused", EnvVars: env("retain.max-ttl")},
		&cli.StringFlag{Name: "cache.policy", Value: cache.DefaultPolicy.String(), Usage: "eviction policy of the pool: mqp2 (four LRU queues by reuse count with per-request prefix history, a learned tip offset, a lifetime relative to the pool, a scan guard for one-off requests, repeated lookups counted once, retention hints as evidence: a retained block is kept longer than its peers; 3.6 more bytes of index per slot), mqp (its predecessor, tuned on 512-token blocks), or lru (least recently used); under lru and mqp every unretained block is evicted before any retained one; docs/architecture.md", EnvVars: env("cache.policy")},
		&cli.DurationFlag{Name: "write-timeout", Value: cache.DefaultWriteTimeout, Usage: "a block left half-written this long (a store begun, not finished by every rank) is reclaimed", EnvVars: env("write-timeout")},
		&cli.StringFlag{Name: "ring.capacity", Value: units.FormatBytes(sidecar.DefaultRingCapacity), Usage: "data capacity of each session ring (a power of two)", EnvVars: env("ring.capacity")},
		&cli.DurationFlag{Name: "ring.spin", Value: ring.DefaultWait.Spin, Usage: "how long a session loop busy-polls before yielding, then parking on a futex (what an idle session costs: docs/architecture.md, \"The ring\")", EnvVars: env("ring.spin")},
		&cli.DurationFlag{Name: "ring.yield", Value: ring.DefaultWait.Yield, Usage: "how long a session loop yields the CPU after spinning, before parking on the futex", EnvVars: env("ring.yield")},
		&cli.BoolFlag{Name: "sched.batch", Value: true, Usage: "run the sidecar's threads under SCHED_BATCH, so that an engine waking the sidecar is never preempted by it on a shared CPU (--sched.batch=false: the default policy)", EnvVars: env("sched.batch")},
		&cli.StringFlag{Name: "copy.backend", Value: sidecar.DefaultCopyBackend, Usage: "copy engine: auto (CUDA for GPU regions when a GPU and driver are usable, else host only), host, or cuda (fail at start without CUDA)", EnvVars: env("copy.backend")},
		&cli.IntFlag{Name: "copy.workers", Value: sidecar.DefaultCopyWorkers, Usage: "host copy goroutines: the chunks of host regions in flight (GPU regions: --copy.cuda-inflight)", EnvVars: env("copy.workers")},
		&cli.StringFlag{Name: "metrics.addr", Value: sidecar.DefaultMetricsAddr, Usage: "address of /metrics, /healthz, /readyz and /debug/state (empty: off)", EnvVars: env("metrics.addr")},
		&cli.DurationFlag{Name: "metrics.read-timeout", Value: sidecar.DefaultMetricsReadTimeout, Usage: "longest time to read one request on the metrics port (its headers: at most 5s)", EnvVars: env("metrics.read-timeout")},
		&cli.DurationFlag{Name: "metrics.write-timeout", Value: sidecar.DefaultMetricsWriteTimeout, Usage: "longest time to write one response on the metrics port", EnvVars: env("metrics.write-timeout")},
		&cli.DurationFlag{Name: "metrics.idle-timeout", Value: sidecar.DefaultMetricsIdleTimeout, Usage: "close a keep-alive connection to the metrics port after this long without a request", EnvVars: env("metrics.idle-timeout")},
		&cli.IntFlag{Name: "metrics.max-conns", Value: sidecar.DefaultMetricsMaxConns, Usage: "most open connections to the metrics port; when all are open, a new one closes the one idle longest, so idle clients cannot lock out probes", EnvVars: env("metrics.max-conns")},
		&cli.StringFlag{Name: "allow-uid", Usage: "comma-separated uids allowed to attach besides the sidecar's own (checked with SO_PEERCRED); their rings reach them as descriptors, so they need no group access", EnvVars: env("allow-uid")},
		&cli.BoolFlag{Name: "group-access", Usage: "for engines of another uid in a group shared with the sidecar: create --dir group-writable (0770) and the rings and the pool group read-write (0660), and accept a --dir writable by a group other than the sidecar's own", EnvVars: env("group-access")},
		&cli.IntFlag{Name: "max-sessions", Value: machine.DefaultMaxSessions, Usage: "most concurrent sessions (one uid: its --limits.uid-share of them)", EnvVars: env("max-sessions")},
		&cli.StringFlag{Name: "limits.memory", Value: "auto", Usage: "memory the sidecar may use in all, pool included; auto: its cgroup's limit (v1 or v2), if any. With a limit, GOMEMLIMIT (unless set), --limits.metadata-bytes and --limits.ring-bytes default to shares of what the pool leaves", EnvVars: env("limits.memory")},
		&cli.StringFlag{Name: "limits.metadata-bytes", Value: "auto", Usage: "bound on the metadata of all clients together (hash batches, queries, regions, copies in flight, sessions, namespaces, change logs); auto: 30% of what the pool leaves of --limits.memory, else " + units.FormatBytes(machine.DefaultMetaBytes), EnvVars: env("limits.metadata-bytes")},
		&cli.StringFlag{Name: "limits.ring-bytes", Value: "auto", Usage: "bound on the shared memory of all sessions' rings and reply queues; auto: 25% of what the pool leaves of --limits.memory, else " + units.FormatBytes(machine.DefaultRingBytes), EnvVars: env("limits.ring-bytes")},
		&cli.IntFlag{Name: "limits.namespaces", Value: machine.DefaultMaxNamespaces, Usage: "most namespaces (model, layout, salt, width, world); an idle one is reclaimed when a new one needs room", EnvVars: env("limits.namespaces")},
		&cli.Float64Flag{Name: "limits.pin-share", Value: machine.DefaultPinShare, Usage: "part of the pool the leases of one uid may pin, counting each block once: the rest stays evictable, so other tenants can always store; tenants that do not trust each other run under different uids", EnvVars: env("limits.pin-share")},
		&cli.Float64Flag{Name: "limits.retain-share", Value: machine.DefaultRetainShare, Usage: "part of the pool the blocks one uid retains (Retain hints) may take, counted apart from --limits.pin-share: a hint never shortens nor refuses a lease; at most --limits.pin-share (checked at start)", EnvVars: env("limits.retain-share")},
		&cli.Float64Flag{Name: "limits.pending-share", Value: machine.DefaultPendingShare, Usage: "part of the pool one uid may hold in blocks some tensor-parallel ranks have not written yet, or reserved for fetches from the shared tier", EnvVars: env("limits.pending-share")},
		&cli.Float64Flag{Name: "limits.uid-share", Value: machine.DefaultUIDShare, Usage: "part of the metadata and ring bounds, and of --max-sessions, one uid may hold", EnvVars: env("limits.uid-share")},
		&cli.Float64Flag{Name: "limits.session-share", Value: machine.DefaultSessionShare, Usage: "part of the metadata bound one session may hold", EnvVars: env("limits.session-share")},
		&cli.StringFlag{Name: "copy.chunk-bytes", Value: units.FormatBytes(machine.DefaultChunkBytes), Usage: "copies of host regions are split into chunks of at most this size, run round robin between sessions", EnvVars: env("copy.chunk-bytes")},
		&cli.StringFlag{Name: "copy.cuda-chunk-bytes", Value: units.FormatBytes(machine.DefaultCUDAChunkBytes), Usage: "copies of GPU (CUDA IPC) regions are split into chunks of at most this size, in place of --copy.chunk-bytes: asynchronous DMA costs no CPU while it runs and needs large chunks to keep the PCIe link busy", EnvVars: env("copy.cuda-chunk-bytes")},
		&cli.IntFlag{Name: "copy.cuda-inflight", Value: sidecar.DefaultCopyCUDAInflight, Usage: "chunks of GPU regions in flight per GPU, in place of --copy.workers: a budget of their own, so a slow host copy never holds up a GPU copy, nor the reverse; a GPU copies them one after another, so all must fit in --copy.stall at PCIe speed (checked at start)", EnvVars: env("copy.cuda-inflight")},
		&cli.DurationFlag{Name: "copy.stall", Value: sidecar.DefaultCopyStall, Usage: "a copy chunk (host or GPU) running longer counts as stuck: another worker takes its turn, and its session's queued chunks are cancelled until it returns", EnvVars: env("copy.stall")},
		&cli.DurationFlag{Name: "reply-timeout", Value: sidecar.DefaultReplyTimeout, Usage: "a session whose client frees no room in its completion ring this long (it stopped reading) is dropped", EnvVars: env("reply-timeout")},
		&cli.IntFlag{Name: "debug.prefill-blocks", Hidden: true, Usage: "benchmarks: fill the index with N synthetic blocks of a private namespace (no bytes)", EnvVars: env("debug.prefill-blocks")},
		&cli.BoolFlag{Name: "check-config", Usage: "parse and validate the settings, print them, and exit without serving", EnvVars: env("check-config")},
	}
}

func serveCommand() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "run the sidecar: a KV block pool in shared memory served through rings",
		Flags: append(append(append(serveFlags(), l2Flags()...), nodeFlags()...), logFlags()...),
		Action: func(c *cli.Context) error {
			log, err := logger(c)
			if err != nil {
				return err
			}
			cfg, err := ServeConfig(c)
			if err != nil {
				return err
			}
			if c.Bool("check-config") {
				fmt.Fprintf(c.App.Writer, "settings ok: %+v\n", cfg)
				return nil
			}
			log.Info().Str("version", Version).Msg("starting ringside")
			if c.Bool("sched.batch") {
				// Before the sidecar starts its goroutines' threads: those
				// created later inherit the policy.
				if n, err := sys.SetBatchScheduling(); err != nil {
					log.Warn().Err(err).Msg("could not switch to SCHED_BATCH; waking the sidecar may preempt the engine")
				} else {
					log.Debug().Int("threads", n).Msg("SCHED_BATCH")
				}
			}
			// Before New creates the socket: a client that sees it may
			// stop the sidecar at once, and SIGTERM must then shut it
			// down cleanly, not kill it.
			ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			srv, err := sidecar.New(cfg, log)
			if err != nil {
				return err
			}
			return srv.Serve(ctx)
		},
	}
}

// ServeConfig collects serve's flags (and their RINGSIDE_* variables) into
// a validated Config and reports every bad setting at once. Exported so
// that the deployment tests run manifests through the real thing.
func ServeConfig(c *cli.Context) (sidecar.Config, error) {
	cfg, errs := serveSettings(c)
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		errs = append(errs, strings.Split(err.Error(), "\n")...)
	}
	if len(errs) > 0 {
		return cfg, fmt.Errorf("invalid settings:\n  %s", strings.Join(errs, "\n  "))
	}
	return cfg, nil
}

// serveSettings is the Config serve's flags give, before its defaults are
// filled in, and what could not be parsed.
func serveSettings(c *cli.Context) (sidecar.Config, []string) {
	var errs []string
	if c.Args().Len() > 0 {
		// serve takes no positional arguments: `--group-access true` (a
		// bool flag given a separate value) would otherwise go unnoticed.
		errs = append(errs, fmt.Sprintf("unexpected arguments %q (serve takes none)", c.Args().Slice()))
	}
	size := func(flag string) uint64 {
		if c.String(flag) == "auto" {
			return 0
		}
		v, err := ParseBytes(c.String(flag))
		if err != nil {
			errs = append(errs, fmt.Sprintf("--%s: %v", flag, err))
		}
		return v
	}
	cfg := sidecar.Config{
		Dir:           c.String("dir"),
		Socket:        c.String("socket"),
		PoolBytes:     size("pool.bytes"),
		PoolReserve:   c.Bool("pool.reserve"),
		WriteTimeout:  c.Duration("write-timeout"),
		RingCapacity:  size("ring.capacity"),
		Spin:          c.Duration("ring.spin"),
		Yield:         c.Duration("ring.yield"),
		CopyBackend:   c.String("copy.backend"),
		CopyWorkers:   c.Int("copy.workers"),
		MetricsAddr:   c.String("metrics.addr"),
		GroupAccess:   c.Bool("group-access"),
		PrefillBlocks: c.Int("debug.prefill-blocks"),
		MemoryLimit:   int64(size("limits.memory")),
		CopyStall:     c.Duration("copy.stall"),
		ReplyTimeout:  c.Duration("reply-timeout"),
		HTTP: sidecar.HTTPConfig{
			ReadTimeout:  c.Duration("metrics.read-timeout"),
			WriteTimeout: c.Duration("metrics.write-timeout"),
			IdleTimeout:  c.Duration("metrics.idle-timeout"),
			MaxConns:     c.Int("metrics.max-conns"),
		},
		CopyCUDAInflight: c.Int("copy.cuda-inflight"),
		Machine: machine.Config{
			SlotBytes:      size("pool.slot-bytes"),
			Budget:         int64(size("budget")),
			LeaseTTL:       c.Duration("lease.ttl"),
			MaxLeaseTTL:    c.Duration("lease.max-ttl"),
			MaxRetainTTL:   c.Duration("retain.max-ttl"),
			MaxSessions:    c.Int("max-sessions"),
			MetaBytes:      int64(size("limits.metadata-bytes")),
			RingBytes:      int64(size("limits.ring-bytes")),
			MaxNamespaces:  c.Int("limits.namespaces"),
			PinShare:       c.Float64("limits.pin-share"),
			RetainShare:    c.Float64("limits.retain-share"),
			PendingShare:   c.Float64("limits.pending-share"),
			UIDShare:       c.Float64("limits.uid-share"),
			SessionShare:   c.Float64("limits.session-share"),
			ChunkBytes:     size("copy.chunk-bytes"),
			CUDAChunkBytes: size("copy.cuda-chunk-bytes"),
		},
	}
	pol, err := cache.ParsePolicy(c.String("cache.policy"))
	if err != nil {
		errs = append(errs, fmt.Sprintf("--cache.policy: %q is not %s", c.String("cache.policy"), cache.PolicyNames))
	}
	cfg.CachePolicy = pol
	cfg.L2 = l2Config(c, &errs)
	if s := c.String("allow-uid"); s != "" {
		for _, f := range strings.Split(s, ",") {
			u, err := strconv.ParseUint(strings.TrimSpace(f), 10, 32)
			if err != nil {
				errs = append(errs, fmt.Sprintf("--allow-uid: %q is not a uid", f))
				continue
			}
			cfg.AllowUIDs = append(cfg.AllowUIDs, uint32(u))
		}
	}
	return cfg, errs
}

var _ = context.Background
