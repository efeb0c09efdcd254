package cli

import (
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/internal/units"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// DefaultNodeMetricsAddr is `ringside node`'s metrics address (the
// sidecar's is :9477).
const DefaultNodeMetricsAddr = ":9478"

// nodeCommandFlags are `ringside node`'s flags (RINGSIDE_NODE_* variables,
// apart from serve's).
func nodeCommandFlags() []cli.Flag {
	e := func(flag string) []string { return env("node." + flag) }
	return []cli.Flag{
		&cli.StringFlag{Name: "dir", Value: node.DefaultDir, Usage: "directory of the socket and the lock: a host directory only ringside containers mount (created 0700, 0770 with --group-access); one node process per directory", EnvVars: e("dir")},
		&cli.StringFlag{Name: "socket", Usage: "the socket's path (empty: DIR/" + node.SocketName + ")", EnvVars: e("socket")},
		&cli.StringFlag{Name: "dir.owner", Usage: "UID:GID: make --dir (creating it if missing) owned by them, mode 0700 (0770 with --group-access), and exit without serving: an init container's job, run as root with only CAP_CHOWN and CAP_FOWNER, so that the node process itself runs without privilege on a host directory the kubelet created", EnvVars: e("dir.owner")},
		&cli.StringFlag{Name: "pool.bytes", Value: units.FormatBytes(node.DefaultPoolBytes), Usage: "the node pool's size, in node memory (a memfd, charged to this process's memory limit); it does not survive this process: a restart empties the tier", EnvVars: e("pool.bytes")},
		&cli.StringFlag{Name: "pool.slot-bytes", Value: units.FormatBytes(node.DefaultSlotBytes), Usage: "the largest block payload (one rank's shard); each slot takes 4 KiB more for the value's header. A sidecar with larger slots (--pool.slot-bytes) does not attach", EnvVars: e("pool.slot-bytes")},
		&cli.BoolFlag{Name: "pool.reserve", Value: true, Usage: "allocate the whole pool at start, so that a memory limit too small for it fails now, not as the pool fills", EnvVars: e("pool.reserve")},
		&cli.Float64Flag{Name: "pod-share", Value: node.DefaultPodShare, Usage: "part of the pool the blocks one pod wrote may hold (the default fits eight pods); a write past it evicts that pod's own least recently used block", EnvVars: e("pod-share")},
		&cli.StringFlag{Name: "pool.desc-bytes", Value: units.FormatBytes(node.DefaultDescBytes), Usage: "bound on the block descriptions (token ids, parents) the node keeps so that each pod's sidecar can announce the node tier's blocks in its engine's KV events; blocks described past it are cached but not announced", EnvVars: e("pool.desc-bytes")},
		&cli.IntFlag{Name: "max-pods", Value: node.DefaultMaxPods, Usage: "sidecar connections at once", EnvVars: e("max-pods")},
		&cli.StringFlag{Name: "pod-identity", Value: node.DefaultPodIdentity, Usage: "what makes a pod, for --pod-share and --conns-per-pod: " + node.IdentityNetNS + " (its network namespace, which the kernel reports and a sidecar cannot choose; Linux 5.14 or later) or " + node.IdentityDeclared + " (the pod name its sidecar declares: for pods in the node's network namespace, hostNetwork, which " + node.IdentityNetNS + " counts as one pod)", EnvVars: e("pod-identity")},
		&cli.IntFlag{Name: "conns-per-pod", Value: node.DefaultConnsPerPod, Usage: "sidecar connections one pod may hold at once (a sidecar needs one; a restart briefly two)", EnvVars: e("conns-per-pod")},
		&cli.IntFlag{Name: "max-namespaces", Value: node.DefaultMaxNamespaces, Usage: "namespaces one connection may register", EnvVars: e("max-namespaces")},
		&cli.IntFlag{Name: "window-slots", Value: node.DefaultWindowSlots, Usage: "slots of each connection's window (the memory written blocks move through; fetched ones land in the pod's pool straight), each a pool slot's size", EnvVars: e("window-slots")},
		&cli.DurationFlag{Name: "io-timeout", Value: node.DefaultIOTimeout, Usage: "a sidecar that sends no Hello this long after connecting, or does not read a reply this long, is dropped", EnvVars: e("io-timeout")},
		&cli.StringFlag{Name: "allow-uid", Usage: "comma-separated uids allowed to attach besides the node process's own (SO_PEERCRED)", EnvVars: e("allow-uid")},
		&cli.BoolFlag{Name: "group-access", Usage: "make --dir group-accessible (0770) and the socket group read-write (0660), for sidecars of another uid in a shared group", EnvVars: e("group-access")},
		&cli.StringFlag{Name: "metrics.addr", Value: DefaultNodeMetricsAddr, Usage: "address of /metrics (ringside_node_server_*), /healthz and /readyz (empty: off)", EnvVars: e("metrics.addr")},
		&cli.BoolFlag{Name: "check-config", Usage: "parse and validate the settings, print them, and exit", EnvVars: e("check-config")},
	}
}

func nodeCommand() *cli.Command {
	return &cli.Command{
		Name:  "node",
		Usage: "run the node tier: one pool in node memory that every sidecar of the node shares (a DaemonSet)",
		Flags: append(nodeCommandFlags(), logFlags()...),
		Action: func(c *cli.Context) error {
			log, err := logger(c)
			if err != nil {
				return err
			}
			cfg, err := NodeConfig(c)
			if err != nil {
				return err
			}
			if o := c.String("dir.owner"); o != "" {
				return prepareNodeDir(cfg, o)
			}
			if c.Bool("check-config") {
				fmt.Fprintf(c.App.Writer, "settings ok: %+v\n", cfg)
				return nil
			}
			ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			log.Info().Str("version", Version).Msg("starting the ringside node tier")
			srv, err := node.NewServer(cfg, log)
			if err != nil {
				return err
			}
			if addr := c.String("metrics.addr"); addr != "" {
				hs := &http.Server{Addr: addr, Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
					WriteTimeout: 10 * time.Second, IdleTimeout: time.Minute}
				go func() {
					if err := hs.ListenAndServe(); err != nil && err != http.ErrServerClosed {
						log.Error().Err(err).Str("addr", addr).Msg("metrics server")
					}
				}()
				defer hs.Close()
			}
			return srv.Serve(ctx)
		},
	}
}

// NodeConfig collects `ringside node`'s flags into a validated
// configuration and reports every bad setting at once.
func NodeConfig(c *cli.Context) (node.ServerConfig, error) {
	var errs []string
	if c.Args().Len() > 0 {
		errs = append(errs, fmt.Sprintf("unexpected arguments %q (node takes none)", c.Args().Slice()))
	}
	size := func(flag string) uint64 {
		v, err := ParseBytes(c.String(flag))
		if err != nil {
			errs = append(errs, fmt.Sprintf("--%s: %v", flag, err))
		}
		return v
	}
	cfg := node.ServerConfig{Dir: c.String("dir"), Socket: c.String("socket"), PoolBytes: size("pool.bytes"), SlotBytes: size("pool.slot-bytes"),
		Reserve: c.Bool("pool.reserve"), PodShare: c.Float64("pod-share"), PodIdentity: c.String("pod-identity"), MaxPods: c.Int("max-pods"), ConnsPerPod: c.Int("conns-per-pod"), MaxNamespaces: c.Int("max-namespaces"),
		WindowSlots: c.Int("window-slots"), IOTimeout: c.Duration("io-timeout"), GroupAccess: c.Bool("group-access"),
		DescBytes: int64(size("pool.desc-bytes"))}
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
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		errs = append(errs, strings.Split(err.Error(), "\n")...)
	}
	if len(errs) > 0 {
		return cfg, fmt.Errorf("invalid settings:\n  %s", strings.Join(errs, "\n  "))
	}
	return cfg, nil
}

// prepareNodeDir makes cfg.Dir owned by owner ("UID:GID") with the node
// process's mode.
func prepareNodeDir(cfg node.ServerConfig, owner string) error {
	u, g, ok := strings.Cut(owner, ":")
	uid, err1 := strconv.ParseUint(u, 10, 32)
	gid, err2 := strconv.ParseUint(g, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return fmt.Errorf("--dir.owner: %q is not UID:GID", owner)
	}
	mode := os.FileMode(0o700)
	if cfg.GroupAccess {
		mode = 0o770
	}
	if err := os.MkdirAll(cfg.Dir, mode); err != nil {
		return fmt.Errorf("--dir: %w", err)
	}
	if fi, err := os.Lstat(cfg.Dir); err != nil || !fi.IsDir() {
		return fmt.Errorf("--dir %s is not a directory", cfg.Dir)
	}
	if err := os.Chown(cfg.Dir, int(uid), int(gid)); err != nil {
		return fmt.Errorf("--dir.owner: %w", err)
	}
	return os.Chmod(cfg.Dir, mode)
}
