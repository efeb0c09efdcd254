package cli

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

var update = flag.Bool("update", false, "rewrite the serve flags' section of docs/configuration.md")

// configurationDoc is docs/configuration.md, from this package's directory.
var configurationDoc = filepath.Join("..", "..", "docs", "configuration.md")

// TestConfigurationDoc checks that docs/configuration.md lists the flags of
// `ringside serve` as the binary defines them; with -update it rewrites
// that section (make docs does).
func TestConfigurationDoc(t *testing.T) {
	checkDocSection(t, serveFlagsBegin, serveFlagsEnd, serveFlagsMarkdown(), "serve")
	checkDocSection(t, nodeFlagsBegin, nodeFlagsEnd, nodeFlagsMarkdown(), "node")
}

func checkDocSection(t *testing.T, begin, end, want, cmd string) {
	t.Helper()
	raw, err := os.ReadFile(configurationDoc)
	if err != nil {
		t.Fatal(err)
	}
	text := string(raw)
	before, rest, ok := strings.Cut(text, begin+"\n")
	if !ok {
		t.Fatalf("%s lacks the line %s", configurationDoc, begin)
	}
	got, after, ok := strings.Cut(rest, end)
	if !ok {
		t.Fatalf("%s lacks the line %s after the begin marker", configurationDoc, end)
	}
	if *update {
		if got != want {
			if err := os.WriteFile(configurationDoc, []byte(before+begin+"\n"+want+end+after), 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("rewrote the %s flags of %s", cmd, configurationDoc)
		}
		return
	}
	if got != want {
		gl, wl := strings.Split(got, "\n"), strings.Split(want, "\n")
		i := 0
		for i < len(gl) && i < len(wl) && gl[i] == wl[i] {
			i++
		}
		line := func(l []string) string {
			if i < len(l) {
				return l[i]
			}
			return "(end of section)"
		}
		t.Fatalf("docs/configuration.md's %s flags differ from the flags of `ringside %s`; regenerate them with `make docs` "+
			"(or `go test ./internal/cli -run TestConfigurationDoc -update`).\nfirst difference, line %d of the section:\n  page:  %s\n  flags: %s",
			cmd, cmd, i+1, line(gl), line(wl))
	}
}

// Every visible flag of serve is in the generated tables exactly once, with
// its environment variable and default; the hidden ones are not.
func TestServeFlagsMarkdownListsEveryFlag(t *testing.T) {
	md := serveFlagsMarkdown()
	for _, f := range append(append(append(serveFlags(), l2Flags()...), nodeFlags()...), logFlags()...) {
		name := f.Names()[0]
		row := "| `--" + name + "` | `" + env(name)[0] + "` | "
		n := strings.Count(md, row)
		v, ok := f.(cli.VisibleFlag)
		hidden := ok && !v.IsVisible()
		switch {
		case hidden && n != 0:
			t.Errorf("hidden flag --%s is in the docs", name)
		case !hidden && n != 1:
			t.Errorf("flag --%s: %d rows starting %q, want 1", name, n, row)
		}
	}
	for _, want := range []string{
		"| `--pool.bytes` | `RINGSIDE_POOL_BYTES` | `auto` | ",
		"| `--pool.reserve` | `RINGSIDE_POOL_RESERVE` | `true` | ",
		"| `--lease.ttl` | `RINGSIDE_LEASE_TTL` | `30s` | ",
		"| `--socket` | `RINGSIDE_SOCKET` | — | ",
		"| `--limits.pin-share` | `RINGSIDE_LIMITS_PIN_SHARE` | `0.5` | ",
		"`--group-access`",                        // a flag named in a usage is code
		"[docs/architecture.md](architecture.md)", // a page, a link
		"### Shared tier\n",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("generated docs lack %q", want)
		}
	}
	// A table cell cannot hold a newline or a bare pipe.
	for _, l := range strings.Split(md, "\n") {
		if strings.HasPrefix(l, "| `--") && strings.Count(strings.ReplaceAll(l, `\|`, ""), "|") != 5 {
			t.Errorf("row with other than 4 cells: %s", l)
		}
	}
}
