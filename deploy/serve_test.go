package deploy

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
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

// serveConfig is what the serve action does before serving: the log
// flags checked, then internal/cli's own ServeConfig.
func serveConfig(c *ucli.Context) (sidecar.Config, error) {
	if _, err := logx.New(io.Discard, c.String("log.format"), c.String("log.level")); err != nil {
		return sidecar.Config{}, fmt.Errorf("invalid settings: --log.*: %w", err)
	}
	return rcli.ServeConfig(c)
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
