package sidecar_test

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
)

// A real sidecar with a pool of 16 blocks stores 32 and is asked for all 32:
// its pool hits none (block 0 was evicted, and a hit is a prefix), while
// /metrics says an unbounded pool would have hit all 32, which it saw
// stored, and that it would hold 32 distinct blocks.
func TestMetricsEstimateAnUnboundedPool(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	h := newHarness(t, func(c *sidecar.Config) { c.PoolBytes = 16 * slot; c.MetricsAddr = addr })
	c := h.dial(nil)
	src := newRegion(1, 32)
	if err := c.RegisterRegion(src.reg); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutHashes(1, digests("sizing", 32), false); err != nil {
		t.Fatal(err)
	}
	for first := uint32(0); first < 32; first += 16 {
		if r, err := c.Store(schema.View{Batch: 1, Start: first, Count: 16}, 1, pagesN(int(first), 16)); err != nil || r.Stored != 16 {
			t.Fatalf("store from %d: %+v %v", first, r, err)
		}
	}
	if n, err := c.Lookup(schema.View{Batch: 1, Count: 32}); err != nil || n != 0 {
		t.Fatalf("lookup: %d hits, %v; want 0 (block 0 evicted)", n, err)
	}
	var body string
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, want := range []string{
		"ringside_lookup_blocks_total 32", "ringside_hit_blocks_total 0", "ringside_evictions_total 16",
		"ringside_sizing_sampled_lookup_blocks_total 32", "ringside_sizing_sampled_seen_blocks_total 32",
		"ringside_sizing_distinct_blocks 32",
	} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}
