package cli

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"
)

// The serve flags' section of docs/configuration.md lies between these
// markers; TestConfigurationDoc checks it against serveFlagsMarkdown and,
// with -update, rewrites it.
const (
	serveFlagsBegin = "<!-- serve-flags: begin (generated: go test ./internal/cli -run TestConfigurationDoc -update) -->"
	serveFlagsEnd   = "<!-- serve-flags: end -->"
	nodeFlagsBegin  = "<!-- node-flags: begin (generated: go test ./internal/cli -run TestConfigurationDoc -update) -->"
	nodeFlagsEnd    = "<!-- node-flags: end -->"
)

// nodeFlagGroups is the order of `ringside node`'s tables.
var nodeFlagGroups = []flagGroup{
	{"", "General", "The directory and its socket, who may attach, and the bounds of each sidecar's connection."},
	{"dir", "Preparing the directory", "For an init container that makes a host directory the node process's and exits (deploy/README.md, \"Node tier\")."},
	{"pool", "Pool", "The node pool, a memfd in node memory."},
	{"metrics", "Metrics port", ""},
	{"log", "Logs", ""},
}

// flagGroup is one table of the page: the flags whose name starts with
// prefix and a dot ("" for the flags without a dot).
type flagGroup struct {
	prefix, title, intro string
}

// serveFlagGroups is the order of the page's tables. A flag whose prefix is
// missing here still appears, in a table of its own after these.
var serveFlagGroups = []flagGroup{
	{"", "General", "The directory, who may attach, sessions, loads and stores, and the check of the settings."},
	{"pool", "Pool", "The block pool in shared memory, in `--dir`."},
	{"lease", "Leases", "A lease holds the blocks a query found while the engine loads them."},
	{"ring", "Rings", "Each session's pair of rings, and how a session loop waits on them."},
	{"sched", "Scheduling", ""},
	{"copy", "Copies", "The copy engine: host regions go through `--copy.workers` goroutines, GPU regions through the CUDA backend."},
	{"limits", "Limits", "Bounds that keep one client, uid or session from taking what the others need."},
	{"metrics", "Metrics port", "Bounds on its HTTP server, so that slow or idle clients cannot hold it."},
	{"l2", "Shared tier", "A Redis (or Redis Cluster) tier behind the pool, off unless `--l2.redis.addrs` is given."},
	{"node", "Node tier", "The node's `ringside node` process beneath the pool and above Redis, off unless `--node.socket` is given. The `--l2.policy`, `--l2.write-slots`, `--l2.evict-ahead` and `--l2.max-*` flags above apply to it too. `ringside node`'s own flags are in [its section](#ringside-node)."},
	{"log", "Logs", "Also accepted before the subcommand: `ringside --log.format=console serve`."},
}

// serveFlagsMarkdown renders the visible flags of `ringside serve`, as the
// binary defines them (App), as the Markdown tables of
// docs/configuration.md: flag, environment variable, default, meaning.
func serveFlagsMarkdown() string { return commandFlagsMarkdown("serve", serveFlagGroups) }

// nodeFlagsMarkdown renders `ringside node`'s flags likewise.
func nodeFlagsMarkdown() string { return commandFlagsMarkdown("node", nodeFlagGroups) }

func commandFlagsMarkdown(name string, groupOrder []flagGroup) string {
	var serve *cli.Command
	for _, c := range App().Commands {
		if c.Name == name {
			serve = c
		}
	}
	if serve == nil {
		panic("cli: no " + name + " command")
	}
	groups := append([]flagGroup(nil), groupOrder...)
	byPrefix := map[string][]cli.Flag{}
	for _, f := range serve.Flags {
		if v, ok := f.(cli.VisibleFlag); ok && !v.IsVisible() {
			continue
		}
		p := flagPrefix(f.Names()[0])
		if _, known := byPrefix[p]; !known && !hasGroup(groups, p) {
			groups = append(groups, flagGroup{prefix: p, title: "`" + p + ".*`"})
		}
		byPrefix[p] = append(byPrefix[p], f)
	}
	var b strings.Builder
	for _, g := range groups {
		flags := byPrefix[g.prefix]
		if len(flags) == 0 {
			continue
		}
		fmt.Fprintf(&b, "### %s\n\n", g.title)
		if g.intro != "" {
			fmt.Fprintf(&b, "%s\n\n", g.intro)
		}
		b.WriteString("| flag | environment variable | default | meaning |\n|---|---|---|---|\n")
		for _, f := range flags {
			fmt.Fprintf(&b, "| `--%s` | %s | %s | %s |\n", f.Names()[0], flagEnv(f), flagDefault(f), markdownUsage(f))
		}
		b.WriteString("\n")
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// flagPrefix is the part of a flag's name before its first dot.
func flagPrefix(name string) string {
	p, _, ok := strings.Cut(name, ".")
	if !ok {
		return ""
	}
	return p
}

func hasGroup(groups []flagGroup, prefix string) bool {
	for _, g := range groups {
		if g.prefix == prefix {
			return true
		}
	}
	return false
}

func flagEnv(f cli.Flag) string {
	d, ok := f.(cli.DocGenerationFlag)
	if !ok || len(d.GetEnvVars()) == 0 {
		return "—"
	}
	return "`" + strings.Join(d.GetEnvVars(), "`, `") + "`"
}

// flagDefault is the flag's default as one would type it.
func flagDefault(f cli.Flag) string {
	var v string
	switch f := f.(type) {
	case *cli.StringFlag:
		v = f.Value
	case *cli.BoolFlag:
		v = strconv.FormatBool(f.Value)
	case *cli.IntFlag:
		v = strconv.Itoa(f.Value)
	case *cli.Float64Flag:
		v = strconv.FormatFloat(f.Value, 'g', -1, 64)
	case *cli.DurationFlag:
		v = f.Value.String()
	default:
		panic(fmt.Sprintf("cli: flag --%s: type %T has no default text for the docs", f.Names()[0], f))
	}
	if v == "" {
		return "—"
	}
	return "`" + v + "`"
}

// flagRef matches a flag named in a usage string, with its value if any;
// docRef a page of docs/, which the page links to (it is in docs/ too).
var (
	flagRef = regexp.MustCompile(`--[a-z0-9]+(?:[.-][a-z0-9]+)*(?:=[a-z0-9]+)?`)
	docRef  = regexp.MustCompile(`\bdocs/([a-z0-9-]+\.md)\b`)
)

// markdownUsage is the flag's usage with the flags it names as code, the
// pages it names as links, and table cells' pipes escaped.
func markdownUsage(f cli.Flag) string {
	d, ok := f.(cli.DocGenerationFlag)
	if !ok {
		return ""
	}
	u := strings.ReplaceAll(d.GetUsage(), "|", `\|`)
	u = flagRef.ReplaceAllString(u, "`$0`")
	return docRef.ReplaceAllString(u, "[$0]($1)")
}
