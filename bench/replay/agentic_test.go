package replay

import (
	"reflect"
	"slices"
	"testing"
)

// smallAgentic is the default shape at a tenth of the size, for speed.
var smallAgentic = AgenticConfig{Seed: 7, Sessions: 200, ScanRequests: 300}

func TestAgenticDeterministic(t *testing.T) {
	a, err := Generate(smallAgentic, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Generate(smallAgentic, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a.Requests, b.Requests) || !slices.Equal(a.digests, b.digests) {
		t.Fatal("the same seed generated two different workloads")
	}
	other := smallAgentic
	other.Seed = 8
	c, err := Generate(other, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(a.Requests, c.Requests) {
		t.Fatal("seeds 7 and 8 generated the same workload")
	}
}

// TestAgenticShape checks the documented shape: sessions whose turns
// extend their prefix and end once, shared system prompts, forks, long
// gaps with other sessions in between, hints on some non-final turns
// only, and a scan whose pages nobody else reads.
func TestAgenticShape(t *testing.T) {
	cfg := smallAgentic
	cfg.defaults()
	w, err := Generate(cfg, LoadOptions{PageTokens: 512})
	if err != nil {
		t.Fatal(err)
	}
	if want := 2*cfg.Sessions + cfg.ScanRequests; len(w.Requests) < want {
		t.Fatalf("%d requests, want at least %d (2 turns a session and the scan)", len(w.Requests), want)
	}
	sysBlocks := cfg.SystemTokens / genBlockTokens
	type sess struct {
		reqs []int
		ends int
	}
	sessions := map[int]*sess{}
	readers := map[uint32]map[int]bool{} // page -> sessions reading it
	firstReader := map[uint32]int{}
	var hinted, finalHinted, scans int
	for i, r := range w.Requests {
		if i > 0 && r.ArrivalMs < w.Requests[i-1].ArrivalMs {
			t.Fatalf("request %d arrives before request %d", i, i-1)
		}
		if r.Session < 0 {
			t.Fatalf("request %d has no session", i)
		}
		s := sessions[r.Session]
		if s == nil {
			s = &sess{}
			sessions[r.Session] = s
		}
		s.reqs = append(s.reqs, i)
		if r.SessionEnd {
			s.ends++
		}
		if r.RetainSec > 0 {
			hinted++
			if r.SessionEnd {
				finalHinted++
			}
		}
		if r.Tenant == cfg.Tenants {
			scans++
			if r.Priority != -1 || !r.SessionEnd {
				t.Errorf("scan request %d: %+v", i, r.RequestMeta)
			}
		}
		if len(r.Pages) != r.InputTokens/512 {
			t.Fatalf("request %d: %d pages for %d tokens", i, len(r.Pages), r.InputTokens)
		}
		for _, p := range r.Pages {
			if readers[p] == nil {
				readers[p] = map[int]bool{}
				firstReader[p] = r.Session
			}
			readers[p][r.Session] = true
		}
	}
	if scans != cfg.ScanRequests {
		t.Errorf("%d scan requests, want %d", scans, cfg.ScanRequests)
	}
	if hinted == 0 || finalHinted != 0 {
		t.Errorf("%d hinted requests, %d of them final: want some, none final", hinted, finalHinted)
	}
	firsts := map[[6]uint32]int{} // system prompts
	var forks, gapsOver60s, interleaved int
	for id, s := range sessions {
		if s.ends != 1 || !w.Requests[s.reqs[len(s.reqs)-1]].SessionEnd {
			t.Fatalf("session %d: %d ends, last turn %+v", id, s.ends, w.Requests[s.reqs[len(s.reqs)-1]].RequestMeta)
		}
		first := w.Requests[s.reqs[0]]
		if first.Tenant == cfg.Tenants { // the scan: unique pages
			for _, p := range first.Pages {
				if len(readers[p]) != 1 {
					t.Fatalf("scan request %d shares page %d", s.reqs[0], p)
				}
			}
			continue
		}
		firsts[[6]uint32(first.Pages[:sysBlocks])]++
		// A fork's first prompt goes on, past the system prompt, with
		// pages an earlier session read first.
		if len(first.Pages) > sysBlocks && firstReader[first.Pages[sysBlocks]] != id {
			forks++
		}
		for k := 1; k < len(s.reqs); k++ {
			prev, cur := w.Requests[s.reqs[k-1]], w.Requests[s.reqs[k]]
			if cur.Turn != k || len(cur.Pages) < len(prev.Pages) || !slices.Equal(cur.Pages[:len(prev.Pages)], prev.Pages) {
				t.Fatalf("session %d turn %d does not extend turn %d", id, k, k-1)
			}
			if cur.ArrivalMs-prev.ArrivalMs > 60_000 {
				gapsOver60s++
			}
			if s.reqs[k]-s.reqs[k-1] > 100 {
				interleaved++
			}
		}
	}
	if len(firsts) != cfg.Tenants {
		t.Errorf("%d distinct system prompts, want %d (one per tenant)", len(firsts), cfg.Tenants)
	}
	if forks < cfg.Sessions/20 {
		t.Errorf("%d forks of %d sessions", forks, cfg.Sessions)
	}
	if gapsOver60s < cfg.Sessions/4 || interleaved < cfg.Sessions/4 {
		t.Errorf("%d gaps over 60 s, %d over 100 requests apart: want long idle gaps", gapsOver60s, interleaved)
	}
}

// TestScanHeavy: --workload agentic-scan is the agentic workload with
// 6,000 one-off scan requests of 2,048-16,384 tokens, named apart.
func TestScanHeavy(t *testing.T) {
	c := ScanHeavy
	c.Sessions = 50
	raw := Agentic(c)
	scans := 0
	for _, r := range raw {
		if r.meta.Priority == -1 {
			scans++
			if *r.InputLength < 2048 || *r.InputLength > 16384 {
				t.Fatalf("scan prompt of %d tokens", *r.InputLength)
			}
		}
	}
	if scans != 6000 {
		t.Errorf("%d scan requests, want 6000", scans)
	}
	w, err := Generate(ScanHeavy, LoadOptions{PageTokens: 512, Limit: 10})
	if err != nil || w.Files[0] != "agentic-scan (generated, seed 1)" {
		t.Errorf("named %v (%v)", w.Files, err)
	}
}
