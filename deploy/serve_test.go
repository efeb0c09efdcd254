package deploy

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	ucli "github.com/urfave/cli/v2"
	corev1 "k8s.io/api/core/v1"

	rcli "github.com/ringside-kv/ringside/internal/cli"
	"github.com/ringside-kv/ringside/internal/logx"
	"github.com/ringside-kv/ringside/sidecar"
)

// parseServe runs the sidecar container's command line and RINGSIDE_*
// environment through the real ringside CLI (cli.App(), the `serve`
// command's own flag definitions, env vars and parser) with the command's
// action swapped for one that only builds and validates the configuration,
// so nothing is served. It returns the effective sidecar configuration.
func parseServe(ct *corev1.Container) (sidecar.Config, error) {
	argv := []string{"ringside"}
	if len(ct.Command) > 0 {
		if filepath.Base(ct.Command[0]) != "ringside" {
			return sidecar.Config{}, fmt.Errorf("command %q does not run ringside", ct.Command)
		}
		argv = append(argv, ct.Command[1:]...)
	}
	argv = append(argv, ct.Args...)
	if len(argv) < 2 || argv[1] != "serve" {
		return sidecar.Config{}, fmt.Errorf("arguments %q do not start with the serve command", argv[1:])
	}
	if len(ct.EnvFrom) > 0 {
		return sidecar.Config{}, errors.New("envFrom cannot be checked: set RINGSIDE_* variables one by one")
	}
	env := map[string]string{}
	for _, e := range ct.Env {
		if !strings.HasPrefix(e.Name, "RINGSIDE_") {
			continue
		}
		if e.ValueFrom != nil {
			return sidecar.Config{}, fmt.Errorf("%s uses valueFrom, which cannot be checked", e.Name)
		}
		env[e.Name] = e.Value
	}

	app := rcli.App()
	app.Writer, app.ErrWriter = io.Discard, io.Discard
	var serve *ucli.Command
	for _, c := range app.Commands {
		if c.Name == "serve" {
			serve = c
		}
	}
	if serve == nil {
		return sidecar.Config{}, errors.New("the ringside CLI has no serve command")
	}
	var cfg sidecar.Config
	ran := false
	serve.Action = func(c *ucli.Context) error {
		ran = true
		var err error
		cfg, err = serveConfig(c)
		return err
	}
	if err := withRingsideEnv(env, func() error { return app.Run(argv) }); err != nil {
		return cfg, err
	}
	if !ran {
		return cfg, errors.New("serve did not run (help or version asked?)")
	}
	return cfg, nil
}

// serveConfig mirrors internal/cli's sidecarConfig and the logger setup of
// the serve action: every flag into a sidecar.Config, then EnsureDefaults
// and Validate. (A `serve --check-config` flag would let the test call the
// real function instead of this copy.)
func serveConfig(c *ucli.Context) (sidecar.Config, error) {
	var errs []string
	if _, err := logx.New(io.Discard, c.String("log.format"), c.String("log.level")); err != nil {
		errs = append(errs, "--log.*: "+err.Error())
	}
	size := func(flag string) uint64 {
		if c.String(flag) == "auto" {
			return 0
		}
		v, err := rcli.ParseBytes(c.String(flag))
		if err != nil {
			errs = append(errs, fmt.Sprintf("--%s: %v", flag, err))
		}
		return v
	}
	cfg := sidecar.Config{
		Dir:          c.String("dir"),
		Socket:       c.String("socket"),
		PoolBytes:    size("pool.bytes"),
		SlotBytes:    size("pool.slot-bytes"),
		Budget:       int64(size("budget")),
		LeaseTTL:     c.Duration("lease.ttl"),
		MaxLeaseTTL:  c.Duration("lease.max-ttl"),
		WriteTimeout: c.Duration("write-timeout"),
		RingCapacity: size("ring.capacity"),
		Spin:         c.Duration("ring.spin"),
		Yield:        c.Duration("ring.yield"),
		CopyBackend:  c.String("copy.backend"),
		CopyWorkers:  c.Int("copy.workers"),
		MetricsAddr:  c.String("metrics.addr"),
		GroupAccess:  c.Bool("group-access"),
		MaxSessions:  c.Int("max-sessions"),
	}
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
	if c.Args().Len() > 0 {
		// serve ignores positional arguments: `--group-access true` or a
		// flag value split off by mistake would go unnoticed.
		errs = append(errs, fmt.Sprintf("unexpected arguments %q (serve takes none)", c.Args().Slice()))
	}
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		errs = append(errs, strings.Split(err.Error(), "\n")...)
	}
	if len(errs) > 0 {
		return cfg, fmt.Errorf("invalid settings: %s", strings.Join(errs, "; "))
	}
	return cfg, nil
}

// envMu serialises withRingsideEnv: the CLI reads RINGSIDE_* variables from
// the process environment, and the tests render and check in parallel.
var envMu sync.Mutex

// withRingsideEnv runs fn with exactly the given RINGSIDE_* variables set
// (those of the test process are hidden meanwhile and restored after).
func withRingsideEnv(env map[string]string, fn func() error) error {
	envMu.Lock()
	defer envMu.Unlock()
	saved := map[string]string{}
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "RINGSIDE_") {
			saved[k] = v
			os.Unsetenv(k)
		}
	}
	for k, v := range env {
		os.Setenv(k, v)
	}
	defer func() {
		for k := range env {
			os.Unsetenv(k)
		}
		for k, v := range saved {
			os.Setenv(k, v)
		}
	}()
	return fn()
}
