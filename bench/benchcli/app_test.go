package benchcli

import (
	"bytes"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/sidecar/cache"
)

// TestCommands pins the subcommands: the benchmarks keep the names they
// had under `ringside bench`, and the hidden ones are what the benchmarks
// re-run this executable as.
func TestCommands(t *testing.T) {
	var visible, hidden []string
	for _, c := range App().Commands {
		if c.Hidden {
			hidden = append(hidden, c.Name)
		} else {
			visible = append(visible, c.Name)
		}
	}
	if want := []string{"ring", "poll", "delta", "replay", "copy", "l2", "node"}; !slices.Equal(visible, want) {
		t.Errorf("benchmarks %v, want %v", visible, want)
	}
	if want := []string{"ring-server", "poll-relay", "replay-relay", "copy-peer"}; !slices.Equal(hidden, want) {
		t.Errorf("hidden subcommands %v, want %v", hidden, want)
	}
}

// TestEveryFlagHasAnEnvVar: RINGSIDE_BENCH_<SUBCOMMAND>_<FLAG>, so that
// the sidecar's own variables (RINGSIDE_DIR) never steer a benchmark.
func TestEveryFlagHasAnEnvVar(t *testing.T) {
	for _, c := range App().Commands {
		prefix := "RINGSIDE_" + strings.ToUpper(strings.NewReplacer("-", "_").Replace("bench_"+c.Name)) + "_"
		for _, f := range c.Flags {
			if !strings.Contains(f.String(), "$"+prefix) {
				t.Errorf("%s --%s has no %s variable: %s", c.Name, f.Names()[0], prefix, f.String())
			}
		}
	}
}

// TestNoRingside: poll, replay and l2 say which executable is missing and how
// to point at one, before they start anything.
func TestNoRingside(t *testing.T) {
	dir := t.TempDir() + "/never-made"
	for _, args := range [][]string{
		{"poll", "--dir", dir},
		{"replay", "--dir", dir, "--out", "-", "--trace", "../replay/testdata/conversation_trace_300.jsonl"},
		{"l2", "--dir", dir},
	} {
		app := App()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		argv := append([]string{"ringside-bench", args[0], "--ringside", "/nonexistent/ringside"}, args[1:]...)
		err := app.Run(argv)
		if err == nil || !strings.Contains(err.Error(), "--ringside /nonexistent/ringside") {
			t.Errorf("%s: %v", args[0], err)
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("a benchmark with no sidecar made its directory (stat: %v)", err)
	}
}

// TestPolicyDefaultIsServes: the benchmarks that start or build a cache
// default to the eviction policy `ringside serve` runs by default, so
// that a replay without --cache.policy measures the product as shipped.
func TestPolicyDefaultIsServes(t *testing.T) {
	for _, c := range App().Commands {
		for _, f := range c.Flags {
			if f.Names()[0] != "cache.policy" {
				continue
			}
			sf, ok := f.(*cli.StringFlag)
			if !ok || sf.Value != cache.DefaultPolicy.String() {
				t.Errorf("%s --cache.policy defaults to %v, want serve's %s", c.Name, f, cache.DefaultPolicy)
			}
		}
	}
}
