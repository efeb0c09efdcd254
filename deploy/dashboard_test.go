package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

const dashboardFile = "grafana/ringside-dashboard.json"

// targetLabels are added by Prometheus to every scraped series, not
// exposed by the sidecar: a query may select and group by them.
var targetLabels = map[string]bool{"job": true, "instance": true}

var (
	seriesRe  = regexp.MustCompile(`\b(ringside_[a-z0-9_]+)\b(\s*\{([^}]*)\})?`)
	matcherRe = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"`)
	byRe      = regexp.MustCompile(`\b(by|without)\s*\(([^)]*)\)`)
	literalRe = regexp.MustCompile(`^[A-Za-z0-9_ ]+(\|[A-Za-z0-9_ ]+)*$`)
	labelVals = regexp.MustCompile(`^label_values\((?:(ringside_[a-z0-9_]+)(?:\{[^}]*\})?\s*,\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)$`)
)

// dashboard is the part of Grafana's dashboard model the test reads.
type dashboard struct {
	Inputs []struct {
		Name, Type, PluginID string
	} `json:"__inputs"`
	Requires []struct {
		Type, ID, Version string
	} `json:"__requires"`
	SchemaVersion int     `json:"schemaVersion"`
	UID           string  `json:"uid"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []struct {
			Name       string          `json:"name"`
			Datasource json.RawMessage `json:"datasource"`
			Query      json.RawMessage `json:"query"`
			Definition string          `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	GridPos    struct{ H, W, X, Y int }
	Panels     []panel `json:"panels"` // a collapsed row's
	Targets    []struct {
		Datasource json.RawMessage `json:"datasource"`
		Expr       string          `json:"expr"`
	} `json:"targets"`
}

func readDashboard(t *testing.T) (dashboard, []byte) {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d, raw
}

// TestDashboardIsImportable checks the Grafana 10+ import form: the
// Prometheus data source is the ${DS_PROMETHEUS} input, which every panel,
// query and variable uses; unique panel ids; panels inside the 24-column grid.
func TestDashboardIsImportable(t *testing.T) {
	d, _ := readDashboard(t)
	if len(d.Inputs) != 1 || d.Inputs[0].Name != "DS_PROMETHEUS" || d.Inputs[0].Type != "datasource" || d.Inputs[0].PluginID != "prometheus" {
		t.Errorf("__inputs %+v: want one datasource input DS_PROMETHEUS of plugin prometheus", d.Inputs)
	}
	grafana := ""
	for _, r := range d.Requires {
		if r.Type == "grafana" {
			grafana = r.Version
		}
	}
	if !strings.HasPrefix(grafana, "10.") && !strings.HasPrefix(grafana, "11.") {
		t.Errorf("__requires names Grafana %q; want 10.x", grafana)
	}
	if d.SchemaVersion < 37 || d.UID == "" {
		t.Errorf("schemaVersion %d (want 37 or later: Grafana 10), uid %q", d.SchemaVersion, d.UID)
	}
	const ds = `{"type":"prometheus","uid":"${DS_PROMETHEUS}"}`
	sameDS := func(raw json.RawMessage) bool {
		var a, b any
		return json.Unmarshal(raw, &a) == nil && json.Unmarshal([]byte(ds), &b) == nil && fmt.Sprint(a) == fmt.Sprint(b)
	}
	ids := map[int]string{}
	for _, p := range allPanels(d.Panels) {
		if prev, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q share id %d", prev, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if p.GridPos.W <= 0 || p.GridPos.X < 0 || p.GridPos.X+p.GridPos.W > 24 || p.GridPos.H <= 0 {
			t.Errorf("panel %q: gridPos %+v is outside the 24-column grid", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		if !sameDS(p.Datasource) {
			t.Errorf("panel %q: datasource %s, want %s", p.Title, p.Datasource, ds)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			if !sameDS(q.Datasource) {
				t.Errorf("panel %q: a query's datasource is %s, want %s", p.Title, q.Datasource, ds)
			}
		}
	}
	for _, v := range d.Templating.List {
		if !sameDS(v.Datasource) {
			t.Errorf("variable %s: datasource %s, want %s", v.Name, v.Datasource, ds)
		}
	}
	// deploy/README.md says how to import it and what each row shows.
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "`"+dashboardFile+"`") || !strings.Contains(string(readme), "DS_PROMETHEUS") {
		t.Errorf("deploy/README.md does not say how to import %s (its DS_PROMETHEUS input)", dashboardFile)
	}
	rows := 0
	for _, p := range allPanels(d.Panels) {
		if p.Type == "row" {
			rows++
			if !strings.Contains(string(readme), "\n| "+p.Title+" |") {
				t.Errorf("deploy/README.md's table of the dashboard has no row %q", p.Title)
			}
		}
	}
	if rows == 0 {
		t.Errorf("the dashboard has no rows")
	}
}

func allPanels(ps []panel) []panel {
	var out []panel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// TestDashboardMetricsExist starts a real sidecar with every optional part
// on (runningSidecarMetrics) and checks every series the dashboard names
// against what its /metrics said: each query's ringside_* series (a
// histogram only as _bucket, _sum or _count), each label a selector
// matches, each literal value it matches, each label of a `by (...)`
// grouping, each label_values() variable. Series named in titles and
// descriptions must exist too. And every ringside_* family the sidecar
// exports has a panel, so that a new series is not left off.
func TestDashboardMetricsExist(t *testing.T) {
	d, raw := readDashboard(t)
	e := runningSidecarMetrics(t)
	for _, f := range dashboardFindings(d, raw, e) {
		t.Error(f)
	}
}

// dashboardFindings is what TestDashboardMetricsExist reports.
func dashboardFindings(d dashboard, raw []byte, e *exposition) []string {
	var bad []string
	used := map[string]bool{}
	var queries []string
	for _, p := range allPanels(d.Panels) {
		for _, q := range p.Targets {
			queries = append(queries, q.Expr)
			bad = append(bad, checkQuery(p.Title, q.Expr, e, used)...)
		}
	}
	for _, v := range d.Templating.List {
		var q struct {
			Query string `json:"query"`
		}
		var s string
		switch {
		case json.Unmarshal(v.Query, &q) == nil && q.Query != "":
			s = q.Query
		case json.Unmarshal(v.Query, &s) == nil:
		}
		for _, def := range []string{s, v.Definition} {
			m := labelVals.FindStringSubmatch(def)
			if m == nil {
				bad = append(bad, fmt.Sprintf("variable %s: query %q is not label_values(ringside_..., label)", v.Name, def))
				continue
			}
			bad = append(bad, checkQuery("variable "+v.Name, strings.TrimSuffix(strings.TrimPrefix(def, "label_values("), ")"), e, used)...)
			if m[1] != "" && !targetLabels[m[2]] && e.samples[m[1]][m[2]] == nil {
				bad = append(bad, fmt.Sprintf("variable %s: %s has no label %q", v.Name, m[1], m[2]))
			}
		}
	}
	// Every other string (titles, descriptions) may name a family.
	var all any
	json.Unmarshal(raw, &all)
	var walk func(any)
	walk = func(x any) {
		switch x := x.(type) {
		case map[string]any:
			for k, v := range x {
				if k != "expr" && k != "query" && k != "definition" {
					walk(v)
				}
			}
		case []any:
			for _, v := range x {
				walk(v)
			}
		case string:
			for _, m := range seriesRe.FindAllStringSubmatch(x, -1) {
				if _, err := e.family(m[1]); err != nil && e.types[m[1]] == "" {
					bad = append(bad, fmt.Sprintf("text %q names %s, which the sidecar does not expose", x, m[1]))
				}
			}
		}
	}
	walk(all)

	for fam := range e.types {
		if strings.HasPrefix(fam, "ringside_") && !used[fam] {
			bad = append(bad, fmt.Sprintf("the sidecar exports %s (a %s) but no panel queries it", fam, e.types[fam]))
		}
	}
	// The panels an operator looks for first.
	joined := strings.Join(queries, "\n")
	for _, want := range []string{"ringside_hit_blocks_total", "ringside_lookup_blocks_total", `ringside_requests_total{`,
		"ringside_copy_seconds_total", "ringside_pool_slots_free", "ringside_evictions_total", "ringside_sessions{",
		"ringside_errors_total", "histogram_quantile(0.99, sum by (le, op) (rate(ringside_l2_seconds_bucket", "ringside_cuda_device_failed"} {
		if !strings.Contains(joined, want) {
			bad = append(bad, fmt.Sprintf("no query contains %q", want))
		}
	}
	slices.Sort(bad)
	return slices.Compact(bad)
}

// checkQuery checks one PromQL expression's series, matchers and groupings
// against e, and marks the families it uses.
func checkQuery(where, expr string, e *exposition, used map[string]bool) []string {
	var bad []string
	sels := seriesRe.FindAllStringSubmatchIndex(expr, -1)
	if len(sels) == 0 {
		bad = append(bad, fmt.Sprintf("%s: query %q names no ringside_* series", where, expr))
	}
	for _, ix := range sels {
		name := expr[ix[2]:ix[3]]
		fam, err := e.family(name)
		if err != nil {
			bad = append(bad, fmt.Sprintf("%s: %v", where, err))
			continue
		}
		used[fam] = true
		if ix[6] < 0 {
			continue
		}
		for _, m := range matcherRe.FindAllStringSubmatch(expr[ix[6]:ix[7]], -1) {
			label, op, val := m[1], m[2], m[3]
			if targetLabels[label] {
				continue
			}
			vals := e.samples[name][label]
			if vals == nil {
				bad = append(bad, fmt.Sprintf("%s: %s has no label %q", where, name, label))
				continue
			}
			if strings.Contains(val, "$") || (op != "=" && op != "=~") {
				continue
			}
			if op == "=~" && !literalRe.MatchString(val) {
				continue
			}
			for _, v := range strings.Split(val, "|") {
				if !vals[v] {
					bad = append(bad, fmt.Sprintf("%s: %s{%s} never has the value %q (it has %v)", where, name, label, v, keys(vals)))
				}
			}
		}
	}
	for _, ix := range byRe.FindAllStringSubmatchIndex(expr, -1) {
		group := aggregated(expr, ix[0], ix[1])
		if expr[ix[2]:ix[3]] == "without" {
			continue
		}
		for _, label := range strings.Split(expr[ix[4]:ix[5]], ",") {
			label = strings.TrimSpace(label)
			if label == "" || targetLabels[label] {
				continue
			}
			for _, m := range seriesRe.FindAllStringSubmatch(group, -1) {
				if e.samples[m[1]] != nil && e.samples[m[1]][label] == nil {
					bad = append(bad, fmt.Sprintf("%s: groups %s by %q, a label it does not have", where, m[1], label))
				}
			}
		}
	}
	return bad
}

// aggregated returns the argument of the aggregation whose `by (...)`
// clause spans expr[from:to]: the parenthesized group after it
// (`sum by (x) (...)`), else the one before it (`sum(...) by (x)`).
func aggregated(expr string, from, to int) string {
	rest := strings.TrimLeft(expr[to:], " ")
	if strings.HasPrefix(rest, "(") {
		depth := 0
		for i, c := range rest {
			switch c {
			case '(':
				depth++
			case ')':
				depth--
				if depth == 0 {
					return rest[:i+1]
				}
			}
		}
		return rest
	}
	before := strings.TrimRight(expr[:from], " ")
	depth := 0
	for i := len(before) - 1; i >= 0; i-- {
		switch before[i] {
		case ')':
			depth++
		case '(':
			depth--
			if depth == 0 {
				return before[i:]
			}
		}
	}
	return before
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// TestDashboardChecker runs the query checks of TestDashboardMetricsExist on
// queries that must pass and queries that must fail, against a small
// exposition of the same shapes (no sidecar needed).
func TestDashboardChecker(t *testing.T) {
	e, err := parseExposition(strings.NewReader(`# HELP ringside_sessions Attached sessions.
# TYPE ringside_sessions gauge
ringside_sessions 1
# TYPE ringside_errors_total counter
ringside_errors_total{status="no space"} 0
ringside_errors_total{status="say \"hi\"\\"} 0
# TYPE ringside_l2_seconds histogram
ringside_l2_seconds_bucket{op="fetch",le="0.1"} 0
ringside_l2_seconds_bucket{op="fetch",le="+Inf"} 0
ringside_l2_seconds_sum{op="fetch"} 0
ringside_l2_seconds_count{op="fetch"} 0
# TYPE ringside_x_count counter
ringside_x_count 3
`))
	if err != nil {
		t.Fatal(err)
	}
	if !e.samples["ringside_errors_total"]["status"][`say "hi"\`] {
		t.Errorf("escaped label value not parsed: %v", e.samples["ringside_errors_total"]["status"])
	}
	for _, tc := range []struct {
		expr string
		want string // "" passes, else a finding contains it
	}{
		{`sum(ringside_sessions{job=~"$job", instance=~"$instance"})`, ""},
		{`sum by (instance) (ringside_sessions)`, ""},
		{`histogram_quantile(0.9, sum by (le, op) (rate(ringside_l2_seconds_bucket{op="fetch"}[5m])))`, ""},
		{`rate(ringside_l2_seconds_sum[5m]) / rate(ringside_l2_seconds_count[5m])`, ""},
		{`rate(ringside_x_count[5m])`, ""},
		{`sum(rate(ringside_errors_total{status=~"no space"}[5m])) by (status)`, ""},
		{`ringside_session`, "exposes no series ringside_session"},
		{`rate(ringside_l2_seconds[5m])`, "is a histogram"},
		{`rate(ringside_x[5m])`, "exposes no series ringside_x"},
		{`ringside_sessions_count`, "exposes no series ringside_sessions_count"},
		{`sum by (code) (rate(ringside_errors_total[5m]))`, `by "code"`},
		{`sum(rate(ringside_errors_total[5m])) by (code)`, `by "code"`},
		{`sum by (le) (ringside_sessions)`, `by "le"`},
		{`ringside_errors_total{status="nospace"}`, `never has the value "nospace"`},
		{`ringside_errors_total{status=~"no space|expired"}`, `never has the value "expired"`},
		{`ringside_errors_total{reason="x"}`, `has no label "reason"`},
		{`sum(up)`, "names no ringside_* series"},
	} {
		got := strings.Join(checkQuery("q", tc.expr, e, map[string]bool{}), "\n")
		if tc.want == "" && got != "" || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%s: findings %q, want %q", tc.expr, got, tc.want)
		}
	}
}
