// Command plot renders the figures of `make bench-vllm-peers` (the
// vllm_compare_* rows of bench/vllm/compare.py) as PNGs, one per figure:
//
//	go run ./bench/vllm/plot -in results.jsonl -out docs/img
//
// The Python side has no plotting library in the vLLM venv (matplotlib is
// not in its lock); the repository already plots with gonum (bench/replay),
// so the rows are written as JSON Lines and drawn here.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// row holds the fields of the rows drawn here.
type row struct {
	Bench       string  `json:"bench"`
	Connector   string  `json:"connector"`
	InFlight    int     `json:"requests_in_flight"`
	Sched       float64 `json:"scheduler_us_per_step"`
	Worker      float64 `json:"worker_us_per_step"`
	StepMs      float64 `json:"step_ms_mean"`
	TokPerS     float64 `json:"output_tokens_per_s"`
	AdmittedMs  float64 `json:"admitted_ms"`
	RingsideCPU float64 `json:"ringside_server_cpu_pct"`
	LMCacheCPU  float64 `json:"lmcache_server_cpu_pct"`
	HitMs       float64 `json:"hit_ms"`
	RecomputeMs float64 `json:"recompute_ms"`
}

// order is the arms' order in every plot (and their colours).
var order = []string{"none", "null", "ringside", "lmcache", "offloading", "example"}

func rank(name string) int {
	for i, n := range order {
		if n == name {
			return i
		}
	}
	return len(order)
}

func read(r io.Reader) ([]row, error) {
	var rows []row
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		b := sc.Bytes()
		if len(b) == 0 || b[0] != '{' {
			continue // make's and the driver's own lines
		}
		var x row
		if err := json.Unmarshal(b, &x); err != nil {
			return nil, fmt.Errorf("bad row %q: %w", b, err)
		}
		rows = append(rows, x)
	}
	return rows, sc.Err()
}

// figure is one load plot: a value per arm against requests in flight.
type figure struct {
	file, title, y string
	log            bool
	value          func(row) (float64, bool)
}

func figures() []figure {
	pos := func(v float64) (float64, bool) { return v, v > 0 }
	return []figure{
		{"sched", "Scheduler-side connector time per engine step", "µs per step (log scale)", true, func(r row) (float64, bool) { return pos(r.Sched) }},
		{"worker", "Worker-side connector time per engine step", "µs per step (log scale)", true, func(r row) (float64, bool) { return pos(r.Worker) }},
		{"step", "Mean engine step time", "ms per step", false, func(r row) (float64, bool) { return pos(r.StepMs) }},
		{"tokps", "Engine throughput (same workload for every arm)", "output tokens per second", false, func(r row) (float64, bool) { return pos(r.TokPerS) }},
		{"admitted", "Time until every request is admitted", "ms (log scale)", true, func(r row) (float64, bool) { return pos(r.AdmittedMs) }},
		{"server-cpu", "Out-of-engine process CPU (ringside sidecar, LMCache server)", "% of one vCPU", false, func(r row) (float64, bool) {
			switch r.Connector {
			case "ringside":
				return r.RingsideCPU, true
			case "lmcache":
				return r.LMCacheCPU, true
			}
			return 0, false
		}},
	}
}

func loadPlot(rows []row, f figure, path string) error {
	byArm := map[string]plotter.XYs{}
	for _, r := range rows {
		if r.Bench != "vllm_compare_load" {
			continue
		}
		if v, ok := f.value(r); ok {
			byArm[r.Connector] = append(byArm[r.Connector], plotter.XY{X: float64(r.InFlight), Y: v})
		}
	}
	if len(byArm) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = f.title
	p.X.Label.Text = "requests in flight (log scale)"
	p.Y.Label.Text = f.y
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	if f.log {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	} else {
		p.Y.Min = 0
	}
	p.Add(plotter.NewGrid())
	arms := make([]string, 0, len(byArm))
	for a := range byArm {
		arms = append(arms, a)
	}
	sort.Slice(arms, func(i, j int) bool { return rank(arms[i]) < rank(arms[j]) })
	for _, a := range arms {
		xy := byArm[a]
		sort.Slice(xy, func(i, j int) bool { return xy[i].X < xy[j].X })
		l, s, err := plotter.NewLinePoints(xy)
		if err != nil {
			return err
		}
		c := plotutil.Color(rank(a))
		l.Color, s.Color = c, c
		s.Shape = plotutil.Shape(rank(a))
		if a == "ringside" {
			l.Width = vg.Points(2.5)
		}
		p.Add(l, s)
		p.Legend.Add(a, l, s)
	}
	p.Legend.Top, p.Legend.Left = true, true
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

func ttftPlot(rows []row, path string) error {
	var arms []row
	for _, r := range rows {
		if r.Bench == "vllm_compare_ttft" {
			arms = append(arms, r)
		}
	}
	if len(arms) == 0 {
		return nil
	}
	sort.Slice(arms, func(i, j int) bool { return rank(arms[i].Connector) < rank(arms[j].Connector) })
	hit, rec := make(plotter.Values, len(arms)), make(plotter.Values, len(arms))
	names := make([]string, len(arms))
	top := 0.0
	for i, r := range arms {
		hit[i], rec[i], names[i] = r.HitMs, r.RecomputeMs, r.Connector
		top = math.Max(top, math.Max(r.HitMs, r.RecomputeMs))
	}
	p := plot.New()
	p.Title.Text = "Time to first token, the same long prompt: a hit (after a prefix-cache reset) and a recompute"
	p.Y.Label.Text = "ms (median)"
	p.Add(plotter.NewGrid())
	w := vg.Points(18)
	b1, err := plotter.NewBarChart(hit, w)
	if err != nil {
		return err
	}
	b2, err := plotter.NewBarChart(rec, w)
	if err != nil {
		return err
	}
	b1.Color, b2.Color = plotutil.Color(2), plotutil.Color(7)
	b1.Offset, b2.Offset = -w/2, w/2
	p.Add(b1, b2)
	p.Legend.Add("hit", b1)
	p.Legend.Add("recompute", b2)
	p.Legend.Top = true
	p.NominalX(names...)
	p.Y.Min, p.Y.Max = 0, top*1.1
	for i, r := range arms {
		lbl, err := plotter.NewLabels(plotter.XYLabels{
			XYs:    []plotter.XY{{X: float64(i) - 0.2, Y: r.HitMs}},
			Labels: []string{fmt.Sprintf("%.0f", r.HitMs)},
		})
		if err != nil {
			return err
		}
		lbl.Offset = vg.Point{X: -vg.Points(6), Y: vg.Points(2)}
		p.Add(lbl)
	}
	p.Legend.TextStyle.Font.Size = vg.Points(11)
	p.Title.TextStyle.Font.Size = vg.Points(11)
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

func run(in, out, prefix string) error {
	var r io.Reader = os.Stdin
	if in != "-" {
		f, err := os.Open(in)
		if err != nil {
			return err
		}
		defer f.Close()
		r = f
	}
	rows, err := read(r)
	if err != nil {
		return err
	}
	if len(rows) == 0 {
		return errors.New("no rows")
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	for _, f := range figures() {
		if err := loadPlot(rows, f, filepath.Join(out, prefix+f.file+".png")); err != nil {
			return fmt.Errorf("%s: %w", f.file, err)
		}
	}
	return ttftPlot(rows, filepath.Join(out, prefix+"ttft.png"))
}

func main() {
	in := flag.String("in", "-", "JSON Lines from make bench-vllm-peers (- for stdin)")
	out := flag.String("out", "docs/img", "directory of the PNGs")
	prefix := flag.String("prefix", "vllm-compare-", "file name prefix")
	flag.Parse()
	if err := run(*in, *out, *prefix); err != nil {
		fmt.Fprintln(os.Stderr, "plot:", err)
		os.Exit(1)
	}
}
