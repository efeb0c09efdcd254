package cli

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

func TestEveryFlagHasAnEnvVar(t *testing.T) {
	app := App()
	for _, f := range append(append(serveFlags(), l2Flags()...), logFlags()...) {
		names := f.Names()
		var buf bytes.Buffer
		buf.WriteString(f.String())
		if !strings.Contains(buf.String(), "$RINGSIDE_") {
			t.Errorf("flag %v has no RINGSIDE_ environment variable", names)
		}
	}
	_ = app
}

func TestServeReportsEveryBadSetting(t *testing.T) {
	app := App()
	var out bytes.Buffer
	app.ErrWriter = &out
	app.Writer = &out
	err := app.Run([]string{"ringside", "serve", "--pool.bytes", "1x", "--budget", "-1", "--ring.capacity", "1000", "--copy.backend", "magic"})
	if err == nil {
		t.Fatal("bad settings accepted")
	}
	for _, flag := range []string{"--pool.bytes", "--budget", "--ring.capacity", "--copy.backend"} {
		if !strings.Contains(err.Error(), flag) {
			t.Errorf("error does not name %s: %v", flag, err)
		}
	}
}

func TestCheckConfig(t *testing.T) {
	app := App()
	var out bytes.Buffer
	app.Writer, app.ErrWriter = &out, &out
	if err := app.Run([]string{"ringside", "serve", "--check-config", "--pool.bytes", "2GiB", "--dir", "/dev/shm/x"}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "settings ok") {
		t.Fatalf("output %q", out.String())
	}
	if err := app.Run([]string{"ringside", "serve", "--check-config", "--pool.bytes", "zz"}); err == nil {
		t.Fatal("bad setting passed --check-config")
	}
	err := app.Run([]string{"ringside", "serve", "--check-config", "--dir", "/dev/shm/x", "--group-access", "true"})
	if err == nil || !strings.Contains(err.Error(), "unexpected arguments") {
		t.Fatalf("a stray positional argument: %v", err)
	}
}

// The log flags count before the subcommand as on serve (serve's own win).
func TestLogFlagsBeforeTheSubcommand(t *testing.T) {
	t.Setenv("RINGSIDE_LOG_FORMAT", "") // restored after the test
	os.Unsetenv("RINGSIDE_LOG_FORMAT")
	for _, tc := range []struct {
		args   []string
		format string
	}{
		{[]string{"ringside", "serve"}, "json"},
		{[]string{"ringside", "--log.format=console", "serve"}, "console"},
		{[]string{"ringside", "serve", "--log.format=console"}, "console"},
		{[]string{"ringside", "--log.format=console", "serve", "--log.format=json"}, "json"},
	} {
		app := App()
		var got string
		for _, cmd := range app.Commands {
			if cmd.Name == "serve" {
				cmd.Action = func(c *cli.Context) error { got = logSetting(c, "log.format"); return nil }
			}
		}
		if err := app.Run(tc.args); err != nil {
			t.Fatal(tc.args, err)
		}
		if got != tc.format {
			t.Errorf("%q: log.format %q, want %q", tc.args, got, tc.format)
		}
	}
}
