package cli

import (
	"fmt"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// l2Flags are the shared tier's flags (off unless --l2.redis.addrs is
// given). The password is never a flag: it comes from a file or from an
// environment variable the flags name.
func l2Flags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "l2.redis.addrs", Usage: "shared tier, one for every node's sidecar: comma-separated host:port of a Redis node, or seed nodes of a Redis Cluster (empty: no tier, and any other --l2 flag is an error; docs/architecture.md, \"The shared tier\")", EnvVars: env("l2.redis.addrs")},
		&cli.StringFlag{Name: "l2.redis.mode", Value: l2.DefaultMode, Usage: "auto (ask the server whether it is a cluster), single or cluster", EnvVars: env("l2.redis.mode")},
		&cli.StringFlag{Name: "l2.redis.username", Usage: "Redis ACL user (empty: the default user)", EnvVars: env("l2.redis.username")},
		&cli.StringFlag{Name: "l2.redis.password-file", Usage: "file holding the Redis password (one line; a trailing newline is dropped), read again for each new connection so that a rotated secret takes effect; the password itself is never a flag", EnvVars: env("l2.redis.password-file")},
		&cli.StringFlag{Name: "l2.redis.password-env", Usage: "name of an environment variable holding the Redis password (the password itself is never a flag)", EnvVars: env("l2.redis.password-env")},
		&cli.BoolFlag{Name: "l2.redis.tls", Usage: "connect with TLS (implied by --l2.redis.tls-ca-file, --l2.redis.tls-cert-file and --l2.redis.tls-key-file)", EnvVars: env("l2.redis.tls")},
		&cli.StringFlag{Name: "l2.redis.tls-ca-file", Usage: "PEM file of the CA that signed the servers' certificates (default: the system's roots)", EnvVars: env("l2.redis.tls-ca-file")},
		&cli.StringFlag{Name: "l2.redis.tls-cert-file", Usage: "PEM client certificate, for servers that authenticate clients (with --l2.redis.tls-key-file)", EnvVars: env("l2.redis.tls-cert-file")},
		&cli.StringFlag{Name: "l2.redis.tls-key-file", Usage: "PEM key of the client certificate", EnvVars: env("l2.redis.tls-key-file")},
		&cli.StringFlag{Name: "l2.redis.tls-server-name", Usage: "name to verify the servers' certificates against (default: the host of each address)", EnvVars: env("l2.redis.tls-server-name")},
		&cli.StringFlag{Name: "l2.redis.prefix", Value: l2.DefaultPrefix, Usage: "prefix of every key the sidecar writes", EnvVars: env("l2.redis.prefix")},
		&cli.DurationFlag{Name: "l2.redis.ttl", Value: 0, Usage: "time to live of every value (0: none; the server's maxmemory policy bounds the tier)", EnvVars: env("l2.redis.ttl")},
		&cli.DurationFlag{Name: "l2.redis.lookup-timeout", Value: l2.DefaultLookupTimeout, Usage: "a lookup of the tier not answered by then is a miss (the engine's reply waits no longer)", EnvVars: env("l2.redis.lookup-timeout")},
		&cli.DurationFlag{Name: "l2.redis.io-timeout", Value: l2.DefaultIOTimeout, Usage: "bound on a fetch and a write (a fetch not done by then is a miss: the engine recomputes)", EnvVars: env("l2.redis.io-timeout")},
		&cli.IntFlag{Name: "l2.redis.writers", Value: l2.DefaultWriters, Usage: "goroutines writing to the tier", EnvVars: env("l2.redis.writers")},
		&cli.IntFlag{Name: "l2.redis.write-queue", Value: l2.DefaultQueue, Usage: "writes that may wait for a writer; past it a write is skipped (counted), never slowing a store", EnvVars: env("l2.redis.write-queue")},
		&cli.IntFlag{Name: "l2.redis.pool-size", Value: l2.DefaultPoolSize, Usage: "connections per Redis node", EnvVars: env("l2.redis.pool-size")},
		&cli.StringFlag{Name: "l2.policy", Value: machine.WriteThrough.String(), Usage: "when blocks go to the tier: write-through (when stored) or write-on-evict (the LRU's tail, written ahead of eviction)", EnvVars: env("l2.policy")},
		&cli.IntFlag{Name: "l2.write-slots", Usage: "most pool slots writes to the tier may pin at once (0: a sixteenth of the pool); past it writes are skipped (counted), never slowing a store", EnvVars: env("l2.write-slots")},
		&cli.IntFlag{Name: "l2.evict-ahead", Usage: "write-on-evict: blocks at the LRU's tail kept written (0: --l2.write-slots)", EnvVars: env("l2.evict-ahead")},
		&cli.IntFlag{Name: "l2.max-lookup-blocks", Value: machine.DefaultL2MaxBlocks, Usage: "most blocks one lookup asks the tier about", EnvVars: env("l2.max-lookup-blocks")},
		&cli.IntFlag{Name: "l2.max-fetch-blocks", Value: machine.DefaultL2MaxBlocks, Usage: "most blocks one acquire fetches from the tier", EnvVars: env("l2.max-fetch-blocks")},
	}
}

// nodeFlags are the node tier's flags in `ringside serve` (off unless
// --node.socket is given).
func nodeFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "node.socket", Usage: "node tier, one for every sidecar of the node: the socket of the node's `ringside node` process (e.g. /run/ringside-node/node.sock, a host directory only ringside containers mount); empty: no node tier. Beneath the pool and above Redis: docs/architecture.md, \"The node tier\"", EnvVars: env("node.socket")},
		&cli.StringFlag{Name: "node.pod", Usage: "this sidecar's pod name, as the node tier logs it; the node charges its writes to its pod's network namespace, or to this name where the node runs with --pod-identity declared (not verified); empty: the host name, the pod's name in Kubernetes", EnvVars: env("node.pod")},
		&cli.DurationFlag{Name: "node.lookup-timeout", Value: node.DefaultLookupTimeout, Usage: "a lookup of the node tier not answered by then is a miss", EnvVars: env("node.lookup-timeout")},
		&cli.DurationFlag{Name: "node.io-timeout", Value: node.DefaultClientIO, Usage: "bound on a fetch from and a write to the node tier (and on attaching)", EnvVars: env("node.io-timeout")},
		&cli.IntFlag{Name: "node.writers", Value: node.DefaultWriters, Usage: "goroutines writing to the node tier", EnvVars: env("node.writers")},
		&cli.IntFlag{Name: "node.write-queue", Value: node.DefaultQueue, Usage: "writes to the node tier that may wait for a writer; past it a write is refused (counted), never slowing a store", EnvVars: env("node.write-queue")},
		&cli.IntFlag{Name: "node.inflight", Value: node.DefaultInflight, Usage: "lookups and fetches of the node tier running at once; past it they miss at once", EnvVars: env("node.inflight")},
	}
}

// l2Config collects the tiers' flags; nil when both are off. Every
// problem is appended to errs.
func l2Config(c *cli.Context, errs *[]string) *sidecar.L2Config {
	addrs := c.String("l2.redis.addrs")
	nodeSock := strings.TrimSpace(c.String("node.socket"))
	if nodeSock == "" {
		for _, f := range nodeFlags() {
			if n := f.Names()[0]; c.IsSet(n) && n != "node.socket" {
				*errs = append(*errs, fmt.Sprintf("--%s: set, but the node tier is off (no --node.socket)", n))
			}
		}
	}
	if strings.TrimSpace(addrs) == "" {
		for _, f := range l2Flags() {
			n := f.Names()[0]
			if !c.IsSet(n) || n == "l2.redis.addrs" || (nodeSock != "" && !strings.HasPrefix(n, "l2.redis.")) {
				continue
			}
			if nodeSock != "" {
				*errs = append(*errs, fmt.Sprintf("--%s: set, but the Redis tier is off (no --l2.redis.addrs)", n))
			} else {
				*errs = append(*errs, fmt.Sprintf("--%s: set, but the tier is off (no --l2.redis.addrs)", n))
			}
		}
		if nodeSock == "" {
			return nil
		}
	}
	bad := func(format string, args ...any) { *errs = append(*errs, fmt.Sprintf(format, args...)) }
	cfg := &sidecar.L2Config{Redis: l2.Config{
		Mode: c.String("l2.redis.mode"), Username: c.String("l2.redis.username"), Prefix: c.String("l2.redis.prefix"),
		TTL: c.Duration("l2.redis.ttl"), LookupTimeout: c.Duration("l2.redis.lookup-timeout"), IOTimeout: c.Duration("l2.redis.io-timeout"),
		Writers: c.Int("l2.redis.writers"), Queue: c.Int("l2.redis.write-queue"), PoolSize: c.Int("l2.redis.pool-size"),
	}, Tier: machine.L2Config{WriteSlots: c.Int("l2.write-slots"), EvictAhead: c.Int("l2.evict-ahead"),
		MaxLookupBlocks: c.Int("l2.max-lookup-blocks"), MaxFetchBlocks: c.Int("l2.max-fetch-blocks")}}
	if nodeSock != "" {
		cfg.Node = &node.ClientConfig{Socket: nodeSock, Pod: c.String("node.pod"), LookupTimeout: c.Duration("node.lookup-timeout"),
			IOTimeout: c.Duration("node.io-timeout"), Writers: c.Int("node.writers"), Queue: c.Int("node.write-queue"), Inflight: c.Int("node.inflight")}
	}
	for _, a := range strings.Split(addrs, ",") {
		if a = strings.TrimSpace(a); a != "" {
			cfg.Redis.Addrs = append(cfg.Redis.Addrs, a)
		}
	}
	switch p := c.String("l2.policy"); p {
	case machine.WriteThrough.String():
		cfg.Tier.Policy = machine.WriteThrough
	case machine.WriteOnEvict.String():
		cfg.Tier.Policy = machine.WriteOnEvict
	default:
		bad("--l2.policy: %q: want write-through or write-on-evict", p)
	}
	// Read by the tier at start (and the file again at each new
	// connection, so that a rotated Secret takes effect).
	cfg.Redis.PasswordFile, cfg.Redis.PasswordEnv = c.String("l2.redis.password-file"), c.String("l2.redis.password-env")
	// The TLS files are read by the tier at start, like the password file.
	ca, cert, key := c.String("l2.redis.tls-ca-file"), c.String("l2.redis.tls-cert-file"), c.String("l2.redis.tls-key-file")
	if c.Bool("l2.redis.tls") || ca != "" || cert != "" || key != "" {
		if (cert == "") != (key == "") {
			bad("--l2.redis.tls-cert-file and --l2.redis.tls-key-file go together")
		}
		cfg.Redis.TLSFiles = &l2.TLSFiles{CA: ca, Cert: cert, Key: key, ServerName: c.String("l2.redis.tls-server-name")}
	}
	return cfg
}
