package replay

import (
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"strings"

	hdrhistogram "github.com/HdrHistogram/hdrhistogram-go"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/ringside-kv/ringside/bench/harness"
)

const (
	plotW = 8 * vg.Inch
	plotH = 5 * vg.Inch
)

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = x
	p.Y.Label.Text = y
	p.Add(plotter.NewGrid())
	return p
}

// plotHitRate: hit ratio against capacity, the live sidecar's beside the
// offline LRU's, and the never-evicting cache's as a ceiling.
func (rep *Report) plotHitRate(path string) error {
	c := &rep.Config
	p := newPlot(fmt.Sprintf("Hit ratio vs pool capacity (%d-token pages, %d engines%s)", c.PageTokens, c.Engines, map[bool]string{true: ", sequential", false: ""}[c.Sequential]),
		fmt.Sprintf("pool capacity, GiB of KV at %s per page (log scale)", bytesStr(float64(c.modelPageBytes()))), "page hit ratio (%)")
	p.X.Scale = plot.LogScale{}
	var ticks []plot.Tick
	var oracle, live plotter.XYs
	gib := func(pages int) float64 { return float64(int64(pages)*c.modelPageBytes()) / (1 << 30) }
	last := 0.0
	for _, o := range rep.OracleCurve {
		g := gib(o.CapacityPages)
		oracle = append(oracle, plotter.XY{X: g, Y: o.HitRatio() * 100})
		t := plot.Tick{Value: g}
		if last == 0 || g >= 3.5*last { // labels a factor of 4 apart, at least
			t.Label, last = c.gibLabel(o.CapacityPages), g
		}
		ticks = append(ticks, t)
	}
	for _, r := range rep.runsOf("ring") {
		live = append(live, plotter.XY{X: gib(r.CapacityPages), Y: ratio(r.Counts.HitPages, r.Counts.TotalPages) * 100})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	l, err := plotter.NewLine(oracle)
	if err != nil {
		return err
	}
	l.Color = plotutil.Color(0)
	l.Width = vg.Points(2)
	s, err := plotter.NewScatter(live)
	if err != nil {
		return err
	}
	s.GlyphStyle.Shape = draw.CircleGlyph{}
	s.GlyphStyle.Radius = vg.Points(5)
	s.Color = plotutil.Color(1)
	lo, hi := oracle[0].X, oracle[len(oracle)-1].X
	if hi == lo {
		lo, hi = lo/2, hi*2
	}
	u, err := plotter.NewLine(plotter.XYs{{X: lo, Y: rep.Unbound * 100}, {X: hi, Y: rep.Unbound * 100}})
	if err != nil {
		return err
	}
	u.Dashes = []vg.Length{vg.Points(6), vg.Points(4)}
	u.Color = color.Gray{Y: 100}
	p.Add(l, s, u)
	p.Legend.Add("offline LRU (oracle), same semantics", l)
	p.Legend.Add("live sidecar (this run)", s)
	p.Legend.Add(fmt.Sprintf("cache that never evicts (%.1f%%)", rep.Unbound*100), u)
	p.Legend.Top, p.Legend.Left = true, true
	p.Y.Min = 0
	p.Y.Max = math.Max(rep.Unbound*100*1.4, 1)
	return p.Save(plotW, plotH, path)
}

// nines maps a percentile to -log10(1 - q): 50% -> 0.3, 90% -> 1, 99% ->
// 2, 99.9% -> 3, so that the tail gets room.
func nines(q float64) float64 { return -math.Log10(1 - q/100) }

// plotLatency: latency against percentile (an HDR percentile plot) for
// each operation, over every run of the ring transport, and the socket
// baseline's lookup and acquire.
func (rep *Report) plotLatency(path string) error {
	c := &rep.Config
	p := newPlot(fmt.Sprintf("Connector call latency, %d engines (HDR percentiles, all capacities)", c.Engines), "percentile", "latency (us, log scale)")
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	var ticks []plot.Tick
	for _, q := range []float64{50, 90, 99, 99.9, 99.99} {
		ticks = append(ticks, plot.Tick{Value: nines(q), Label: fmt.Sprintf("%g%%", q)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	curve := func(x *hdrhistogram.Histogram) plotter.XYs {
		var xy plotter.XYs
		for _, q := range []float64{10, 25, 50, 60, 70, 80, 90, 95, 97, 98, 99, 99.5, 99.7, 99.8, 99.9, 99.95, 99.97, 99.99} {
			if x.TotalCount() < 10 && q > 90 {
				break
			}
			if q > 0 && float64(x.TotalCount())*(1-q/100) < 1 {
				break
			}
			v := float64(x.ValueAtQuantile(q)) / 1e3
			xy = append(xy, plotter.XY{X: nines(q), Y: math.Max(v, 0.01)})
		}
		return xy
	}
	i := 0
	add := func(h hists, key, label string, dashed bool) error {
		x, ok := h[key]
		if !ok || x.TotalCount() == 0 {
			return nil
		}
		l, err := plotter.NewLine(curve(x))
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(1.5)
		if dashed {
			l.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
		}
		i++
		p.Add(l)
		p.Legend.Add(label, l)
		return nil
	}
	ring := rep.merged("ring")
	for _, k := range []string{"lookup", "acquire", "load", "store", "release", stepOp, walkOp} {
		if err := add(ring, k, k+" (ring)", false); err != nil {
			return err
		}
	}
	udsH := rep.merged("uds")
	for _, k := range []string{"lookup", "acquire"} {
		if err := add(udsH, k, k+" (uds)", true); err != nil {
			return err
		}
	}
	p.Legend.Top, p.Legend.Left = false, false
	return p.Save(plotW, plotH, path)
}

// plotStepCost: per-step metadata cost along the replay, per capacity:
// the delta method (dashed) and the walk (solid), as medians over windows
// of steps.
func (rep *Report) plotStepCost(path string) error {
	c := &rep.Config
	p := newPlot("Per-step metadata cost over the replay: walk (solid) vs delta log (dashed)",
		"request (trace order)", "cost per step (us, median per window, log scale)")
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	top := 0.0
	for i, r := range rep.runsOf("ring") {
		if len(r.Steps) == 0 {
			continue
		}
		win := max(1, len(r.Steps)/150)
		var dxy, wxy plotter.XYs
		for lo := 0; lo < len(r.Steps); lo += win {
			hi := min(len(r.Steps), lo+win)
			var d, w []int64
			for _, s := range r.Steps[lo:hi] {
				d = append(d, s.DeltaNs)
				if s.WalkNs > 0 {
					w = append(w, s.WalkNs)
				}
			}
			x := float64(r.Steps[(lo+hi)/2].Request)
			dxy = append(dxy, plotter.XY{X: x, Y: math.Max(float64(harness.Median(d))/1e3, 0.01)})
			top = math.Max(top, dxy[len(dxy)-1].Y)
			if len(w) > 0 {
				wxy = append(wxy, plotter.XY{X: x, Y: math.Max(float64(harness.Median(w))/1e3, 0.01)})
				top = math.Max(top, wxy[len(wxy)-1].Y)
			}
		}
		label := fmt.Sprintf("%s (%d pages)", c.gibLabel(r.CapacityPages), r.CapacityPages)
		if len(wxy) > 0 {
			l, err := plotter.NewLine(wxy)
			if err != nil {
				return err
			}
			l.Color = plotutil.Color(i)
			l.Width = vg.Points(1.5)
			p.Add(l)
			p.Legend.Add(label, l)
		}
		l, err := plotter.NewLine(dxy)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(i)
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(l)
		if len(wxy) == 0 {
			p.Legend.Add(label, l)
		}
	}
	p.Legend.Top, p.Legend.Left = true, true
	p.Y.Max = top * 30 // room for the legend
	return p.Save(plotW, plotH, path)
}

// plotPolicies: prefix-hit ratio against capacity for the offline LRU,
// vLLM's ARC and MIN's prefix hits (lines), the optimum's bound (MIN's
// block hits, thick dashed), the live sidecar (points) and the cache that
// never evicts.
func (rep *Report) plotPolicies(path string) error {
	c := &rep.Config
	w := rep.Workload
	name := strings.Join(w.Files, ", ")
	if c.Workload == "trace" {
		name = filepath.Base(name)
	}
	p := newPlot(fmt.Sprintf("Prefix-hit ratio by policy: %s (%d-token pages)", name, c.PageTokens),
		"pool capacity, pages (log scale)", "hit ratio (%)")
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	var lru, arc, minPrefix, bound, mqp, mqp2, live plotter.XYs
	top := rep.Unbound * 100
	for _, pt := range rep.PolicyCurve {
		x := float64(pt.CapacityPages)
		lru = append(lru, plotter.XY{X: x, Y: pt.LRU.HitRatio() * 100})
		arc = append(arc, plotter.XY{X: x, Y: pt.ARC.HitRatio() * 100})
		minPrefix = append(minPrefix, plotter.XY{X: x, Y: pt.MIN.HitRatio() * 100})
		bound = append(bound, plotter.XY{X: x, Y: pt.MIN.BlockHitRatio() * 100})
		mqp = append(mqp, plotter.XY{X: x, Y: pt.MQP.HitRatio() * 100})
		mqp2 = append(mqp2, plotter.XY{X: x, Y: pt.MQP2.HitRatio() * 100})
		top = math.Max(top, pt.MIN.BlockHitRatio()*100)
	}
	for _, r := range rep.runsOf("ring") {
		live = append(live, plotter.XY{X: float64(r.CapacityPages), Y: ratio(r.Counts.HitPages, r.Counts.TotalPages) * 100})
	}
	if len(lru) == 0 {
		return nil
	}
	for i, s := range []struct {
		xy     plotter.XYs
		label  string
		width  float64
		dashes bool
	}{
		{bound, "optimum: MIN's block hits (bound on any policy's prefix hits)", 2.5, true},
		{minPrefix, "prefix hits following MIN's decisions", 1.5, false},
		{arc, "ARC as vLLM's offloading connector runs it", 1.5, false},
		{lru, "LRU, the sidecar's policy (offline oracle)", 2, false},
		{mqp, "MQP", 2, false},
		{mqp2, "MQP2", 2, false},
	} {
		l, err := plotter.NewLine(s.xy)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(s.width)
		if s.dashes {
			l.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		}
		p.Add(l)
		p.Legend.Add(s.label, l)
	}
	if len(live) > 0 {
		s, err := plotter.NewScatter(live)
		if err != nil {
			return err
		}
		s.GlyphStyle.Shape = draw.CircleGlyph{}
		s.GlyphStyle.Radius = vg.Points(4)
		s.Color = plotutil.Color(6)
		p.Add(s)
		p.Legend.Add("live sidecar (this run)", s)
	}
	lo, hi := lru[0].X, lru[len(lru)-1].X
	if hi == lo {
		lo, hi = lo/2, hi*2
	}
	u, err := plotter.NewLine(plotter.XYs{{X: lo, Y: rep.Unbound * 100}, {X: hi, Y: rep.Unbound * 100}})
	if err != nil {
		return err
	}
	u.Dashes = []vg.Length{vg.Points(2), vg.Points(3)}
	u.Color = color.Gray{Y: 100}
	p.Add(u)
	p.Legend.Add(fmt.Sprintf("cache that never evicts (%.1f%%)", rep.Unbound*100), u)
	p.Y.Min = 0
	if top > 60 { // high curves: the legend goes under them
		p.Y.Max = 100
		p.Legend.Top, p.Legend.Left = false, false
	} else {
		p.Y.Max = math.Max(top*1.5, 1)
		p.Legend.Top, p.Legend.Left = true, true
	}
	return p.Save(plotW, plotH, path)
}
