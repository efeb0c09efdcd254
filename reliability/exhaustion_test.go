package reliability

import (
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// hog submits records from gen in windows until one is answered with
// status 7 (or stop), and returns how many were accepted and the refusal.
func hog(c *connector.Client, gen func(i int) (uint16, []byte), stop *atomic.Bool) (int, schema.Status, string, error) {
	ok := 0
	for i := 0; !stop.Load(); {
		var seqs []uint64
		for k := 0; k < 256; k++ {
			typ, b := gen(i)
			i++
			seq, err := c.Submit(typ, b)
			if err != nil {
				return ok, 0, "", err
			}
			seqs = append(seqs, seq)
		}
		var refused schema.Status
		var msg string
		for _, seq := range seqs {
			b, err := c.Await(seq)
			if err != nil {
				return ok, 0, "", err
			}
			st := schema.Status(binary.LittleEndian.Uint32(b))
			switch {
			case st == schema.OK:
				ok++
			case refused == 0:
				refused = st
				var r schema.Reply
				var lr schema.LeaseReply
				if typ, _ := gen(0); typ == schema.TypeAcquire && lr.Decode(b) == nil {
					msg = lr.Message
				} else if r.Decode(b) == nil {
					msg = r.Message
				}
			}
		}
		if refused != 0 {
			return ok, refused, msg, nil
		}
	}
	return ok, 0, "", nil
}

// pingLatencies measures n round trips of c.
func pingLatencies(t *testing.T, c *connector.Client, n int) []time.Duration {
	out := make([]time.Duration, 0, n)
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if err := c.Ping(uint64(i)); err != nil {
			t.Errorf("bystander ping: %v", err)
			return out
		}
		out = append(out, time.Since(t0))
	}
	return out
}

// TestResourceExhaustion: sessions that register batches without end,
// hold leases without releasing, flood the ring, and attach without end,
// next to a bystander session whose ping latency is measured.
func TestResourceExhaustion(t *testing.T) {
	row := record(t, "Resource exhaustion", "one session registers hash batches without end, one registers 4096-digest batches without end, one opens leases without releasing, one floods its ring with pipelined requests; then sessions attach without end",
		"each hog is bounded by its quota with status 7 and a message naming the maximum (65,536 batches per instance, 256 MiB of digests per instance, 65,536 leases per session, --max-sessions 16); everything is reclaimed when they leave; a bystander session's median ping latency under attack stays within 25x its baseline median measured in the same run",
		"1. leaks / pins never released; 7. backpressure")
	sc := startSidecar(t, newDir(t), "--max-sessions", "16", "--ring.capacity", "1MiB", "--budget", "1GiB")
	by := dial(t, opts(sc.sock, "bystander"))
	pingLatencies(t, by, 500) // warm up
	base := pingLatencies(t, by, 3000)
	var stop atomic.Bool
	var quotaDone atomic.Int32 // quota hogs finished
	type result struct {
		name   string
		ok     int
		st     schema.Status
		msg    string
		err    error
		expect int
	}
	results := make([]result, 4)
	var wg sync.WaitGroup
	run := func(i int, name string, expect int, setup func(c *connector.Client), gen func(i int) (uint16, []byte)) {
		c := dial(t, opts(sc.sock, "hog-"+name))
		if setup != nil {
			setup(c)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, st, msg, err := hog(c, gen, &stop)
			results[i] = result{name, ok, st, msg, err, expect}
			c.Close()
			if expect > 0 {
				quotaDone.Add(1)
			}
		}()
	}
	one := digests("one", 1)
	run(0, "batches", 1<<16, nil, func(i int) (uint16, []byte) {
		return schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(i + 1), Digests: one}).Append(nil, 32)
	})
	big := digests("big", 4096)
	run(1, "hash-bytes", (256<<20)/len(big), nil, func(i int) (uint16, []byte) {
		return schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(i + 1), Digests: big}).Append(nil, 32)
	})
	reg := newRegion(1, 1)
	acq := (&schema.Acquire{View: schema.View{Batch: 1, Count: 1}, TTLms: 600000}).Append(nil)
	run(2, "leases", 1<<16, func(c *connector.Client) {
		c.RegisterRegion(reg.reg)
		c.PutHashes(1, one, false)
		if r, err := c.Store(schema.View{Batch: 1, Count: 1}, 1, []uint32{0}); err != nil || r.Stored+r.Present != 1 {
			t.Fatal(r, err)
		}
	}, func(int) (uint16, []byte) { return schema.TypeAcquire, acq })
	ping := schema.IDRequest{ID: 1}.Append(nil)
	run(3, "flood", -1, nil, func(int) (uint16, []byte) { return schema.TypePing, ping })
	time.Sleep(20 * time.Millisecond)
	t0 := time.Now()
	attacked := pingLatencies(t, by, 3000)
	during := time.Since(t0)
	// Keep attacking until the quota hogs are done, then stop the flood.
	for quotaDone.Load() < 3 && time.Since(t0) < 60*time.Second {
		attacked = append(attacked, pingLatencies(t, by, 100)...)
	}
	stop.Store(true)
	wg.Wait()
	for _, r := range results[:3] {
		if r.err != nil || r.st != schema.ErrCodeTooLarge || r.ok != r.expect || !strings.Contains(r.msg, "maximum") && !strings.Contains(r.msg, "more than") {
			t.Errorf("%s hog: %d accepted (want %d), refusal %v %q, err %v", r.name, r.ok, r.expect, r.st, r.msg, r.err)
		}
	}
	if results[3].err != nil {
		t.Errorf("flood: %v", results[3].err)
	}
	b50, a50 := percentile(base, 0.5), percentile(attacked, 0.5)
	b99, a99 := percentile(base, 0.99), percentile(attacked, 0.99)
	ratio := float64(a50) / float64(b50)
	if ratio > 25 {
		t.Errorf("bystander median ping %v under attack vs %v baseline: ratio %.1f > 25", a50, b50, ratio)
	}
	// Everything is reclaimed: the hogs' quotas are free again.
	sc.waitQuiet(t, 1, 5*time.Second)
	again := dial(t, opts(sc.sock, "hog-leases"))
	if _, err := again.PutHashes(1, one, false); err != nil {
		t.Fatalf("after the hogs left: %v", err)
	}
	again.Close()
	// Sessions without end: 16 in all, the 17th is refused.
	var extra []*connector.Client
	var refusal error
	for i := 0; i < 32; i++ {
		c, err := connector.Dial(opts(sc.sock, fmt.Sprintf("many-%d", i)))
		if err != nil {
			refusal = err
			break
		}
		extra = append(extra, c)
	}
	if status(refusal) != schema.ErrCodeTooLarge || len(extra) != 15 {
		t.Errorf("session flood: %d attached besides the bystander, refusal %v", len(extra), refusal)
	}
	if err := by.Ping(1); err != nil {
		t.Fatal(err)
	}
	for _, c := range extra {
		c.Close()
	}
	var parts []string
	for _, r := range results[:3] {
		parts = append(parts, fmt.Sprintf("%s: %d accepted then status %d %q", r.name, r.ok, r.st, short(r.msg, 60)))
	}
	row.add("%s; flood: %d pings answered", strings.Join(parts, "; "), results[3].ok)
	row.add("bystander ping p50 %v → %v under attack (ratio %.1f, bound 25), p99 %v → %v, %d pings over %v of attack", b50.Round(time.Microsecond), a50.Round(time.Microsecond), ratio, b99.Round(time.Microsecond), a99.Round(time.Microsecond), len(attacked), during.Round(time.Millisecond))
	row.add("quotas free again after the hogs left; session flood: 15 more attached, the next refused: %v", refusal)
}
