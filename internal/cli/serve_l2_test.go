package cli

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	ucli "github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/sidecar"
)

// serveConfigOf runs `ringside serve args...` up to its config.
func serveConfigOf(t *testing.T, args ...string) (sidecar.Config, error) {
	t.Helper()
	app := App()
	app.Writer, app.ErrWriter = io.Discard, io.Discard
	var cfg sidecar.Config
	var cerr error
	for _, c := range app.Commands {
		if c.Name == "serve" {
			c.Action = func(c *ucli.Context) error { cfg, cerr = ServeConfig(c); return nil }
		}
	}
	if err := app.Run(append([]string{"ringside", "serve"}, args...)); err != nil {
		return cfg, err
	}
	return cfg, cerr
}

// startServe starts the sidecar of cfg and returns whether its tier
// connected within a few seconds.
func startServe(t *testing.T, cfg sidecar.Config) (*sidecar.Server, bool) {
	t.Helper()
	srv, err := sidecar.New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if st := srv.State().L2; st != nil && st.Connected {
			return srv, true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return srv, false
}

func TestServeL2ACLPasswordFileEnvAndTLS(t *testing.T) {
	redis := redistest.Single(t, redistest.Options{User: "ringside", Password: "from-a-secret", TLS: true})
	dir := t.TempDir()
	pw := filepath.Join(dir, "password")
	os.WriteFile(pw, []byte("from-a-secret\n"), 0o600)
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, []byte("wrong\n"), 0o600)
	t.Setenv("TEST_REDIS_PASSWORD", "from-a-secret")
	shm, err := os.MkdirTemp("/dev/shm", "rs-cli-l2-")
	if err != nil {
		shm = t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	base := []string{"--pool.bytes", "1MiB", "--pool.slot-bytes", "4KiB", "--metrics.addr", "",
		"--l2.redis.addrs", redis.Addr, "--l2.redis.username", "ringside", "--l2.redis.tls-ca-file", redis.TLS.CA}
	for _, tc := range []struct {
		name    string
		args    []string
		connect bool
	}{
		{"password file", []string{"--l2.redis.password-file", pw}, true},
		{"password env", []string{"--l2.redis.password-env", "TEST_REDIS_PASSWORD"}, true},
		{"wrong password", []string{"--l2.redis.password-file", bad}, false},
		{"no password", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := filepath.Join(shm, strings.ReplaceAll(tc.name, " ", "-"))
			cfg, err := serveConfigOf(t, append(append([]string{"--dir", d}, base...), tc.args...)...)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.L2 == nil || cfg.L2.Redis.TLSFiles == nil || cfg.L2.Redis.TLSFiles.CA != redis.TLS.CA || cfg.L2.Redis.Username != "ringside" {
				t.Fatalf("tier config %+v", cfg.L2)
			}
			if _, ok := startServe(t, cfg); ok != tc.connect {
				t.Fatalf("connected %v, want %v", ok, tc.connect)
			}
		})
	}
	// Without TLS the server is not reached; a password on the command
	// line does not exist; a variable not set, or both sources, fail.
	for name, args := range map[string][]string{
		"env not set":   {"--l2.redis.password-env", "NOT_SET_ANYWHERE"},
		"file missing":  {"--l2.redis.password-file", filepath.Join(dir, "none")},
		"both sources":  {"--l2.redis.password-file", pw, "--l2.redis.password-env", "TEST_REDIS_PASSWORD"},
		"password flag": {"--l2.redis.password", "x"},
		"bad policy":    {"--l2.policy", "sometimes"},
		"bad CA":        {"--l2.redis.tls-ca-file", pw},
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := serveConfigOf(t, append(append([]string{"--dir", filepath.Join(shm, "x")}, base...), args...)...)
			if err == nil {
				_, err = sidecar.New(cfg, zerolog.Nop())
			}
			if err == nil {
				t.Fatal("accepted")
			}
		})
	}
	// Tier flags without an address are a mistake, not silently off.
	if _, err := serveConfigOf(t, "--dir", filepath.Join(shm, "y"), "--l2.policy", "write-on-evict"); err == nil || !strings.Contains(err.Error(), "--l2.policy") {
		t.Fatalf("tier flags without --l2.redis.addrs: %v", err)
	}
}

func TestInspectSidecarShowsTheTier(t *testing.T) {
	redis := redistest.Single(t, redistest.Options{})
	shm, err := os.MkdirTemp("/dev/shm", "rs-cli-inspect-")
	if err != nil {
		shm = t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cfg, err := serveConfigOf(t, "--dir", shm, "--pool.bytes", "1MiB", "--pool.slot-bytes", "4KiB", "--metrics.addr", addr,
		"--l2.redis.addrs", redis.Addr, "--l2.redis.prefix", "inspect:", "--l2.redis.ttl", "10m", "--l2.policy", "write-on-evict")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := startServe(t, cfg); !ok {
		t.Fatal("not connected")
	}
	var out strings.Builder
	deadline := time.Now().Add(10 * time.Second)
	for { // the metrics server starts with Serve, beside the tier
		out.Reset()
		app := App()
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run([]string{"ringside", "inspect", "sidecar", "--metrics.addr", addr})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, want := range []string{"l2: single [" + redis.Addr + "] connected true", `prefix "inspect:" ttl 10m0s`, "policy write-on-evict", "lookups 0", "writes 0"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("inspect sidecar lacks %q:\n%s", want, out.String())
		}
	}
	// And the metrics carry the tier's series.
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, m := range []string{"ringside_l2_lookups_total", "ringside_l2_fetch_blocks_total", "ringside_l2_writes_total", "ringside_l2_rejected_values_total",
		"ringside_l2_seconds_bucket", "ringside_l2_write_queue", "ringside_l2_writes_skipped_total", "ringside_l2_evicted_unwritten_total", "ringside_l2_bytes_total"} {
		if !strings.Contains(string(body), m) {
			t.Errorf("metrics lack %s", m)
		}
	}
}
