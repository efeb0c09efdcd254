package replay

import (
	hdrhistogram "github.com/HdrHistogram/hdrhistogram-go"
)

// Ops timed per call, in report order. "step" is the engine's per-step
// metadata cost (method delta: the change log over the transport, applied
// to its view; method walk: a visit of every block of that view), and
// "request" is the connector's whole cost for one request (every call,
// copies included, modelled prefill excluded).
var opNames = []string{"lookup", "acquire", "load", "store", "release", "retain", "hashes", "step", "request"}

const (
	histMin = 1              // ns
	histMax = 120 * 1e9      // ns: two minutes
	histSig = 3              // significant figures: 0.1% resolution
	walkOp  = "step (walk)"  // key of the walk histogram
	stepOp  = "step (delta)" // key of the delta histogram
)

// hists are the latency histograms of one engine or one run, by op key.
type hists map[string]*hdrhistogram.Histogram

func newHists() hists { return hists{} }

func (h hists) record(op string, ns int64) {
	x, ok := h[op]
	if !ok {
		x = hdrhistogram.New(histMin, int64(histMax), histSig)
		h[op] = x
	}
	if ns < histMin {
		ns = histMin
	}
	if ns > int64(histMax) {
		ns = int64(histMax)
	}
	x.RecordValue(ns)
}

func (h hists) merge(o hists) {
	for k, v := range o {
		x, ok := h[k]
		if !ok {
			x = hdrhistogram.New(histMin, int64(histMax), histSig)
			h[k] = x
		}
		x.Merge(v)
	}
}

// Summary is a histogram's percentiles, in ns.
type Summary struct {
	Count               int64
	P50, P90, P99, P999 int64
	Max                 int64
	Mean                float64
}

func summarize(x *hdrhistogram.Histogram) Summary {
	if x == nil || x.TotalCount() == 0 {
		return Summary{}
	}
	return Summary{
		Count: x.TotalCount(),
		P50:   x.ValueAtQuantile(50), P90: x.ValueAtQuantile(90),
		P99: x.ValueAtQuantile(99), P999: x.ValueAtQuantile(99.9),
		Max: x.Max(), Mean: x.Mean(),
	}
}
