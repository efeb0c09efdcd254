package ringbench

import (
	"sync"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/ring"
)

func newHeapRing(tb testing.TB, capacity uint64) *ring.Ring {
	tb.Helper()
	r, err := ring.Format(shm.Aligned(ring.HeaderSize+int(capacity)), capacity, 0, 1, ring.FlagCreatorProducer)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

// BenchmarkAppendPublishNextCommit is the ring's per-record cost without a
// second thread: batches of 32 64-byte records appended and published, then
// borrowed and committed, in one goroutine.
func BenchmarkAppendPublishNextCommit(b *testing.B) {
	const batch = 32
	r := newHeapRing(b, 64<<10)
	p, err := ring.NewProducer(r, ring.DefaultWait)
	if err != nil {
		b.Fatal(err)
	}
	c, err := ring.NewConsumer(r, ring.DefaultWait)
	if err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, ThroughputBytes)
	b.SetBytes(ThroughputBytes)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i += batch {
		n := min(batch, b.N-i)
		for k := 0; k < n; k++ {
			if err := p.Append(1, 0, uint64(i+k), payload); err != nil {
				b.Fatal(err)
			}
		}
		p.Publish()
		for k := 0; k < n; k++ {
			rec, err := c.Next()
			if err != nil || rec.Seq != uint64(i+k) {
				b.Fatalf("record %d: %v (seq %d)", i+k, err, rec.Seq)
			}
		}
		c.Commit()
	}
}

// BenchmarkSPSC streams 64-byte records from a producer goroutine to a
// consumer goroutine through an in-process ring: Append x32 then Publish,
// Next until empty then Commit.
func BenchmarkSPSC(b *testing.B) {
	const batch = 32
	r := newHeapRing(b, 64<<10)
	wc, _ := WaitConfig("spin")
	p, err := ring.NewProducer(r, wc)
	if err != nil {
		b.Fatal(err)
	}
	c, err := ring.NewConsumer(r, wc)
	if err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, ThroughputBytes)
	deadline := time.Now().Add(time.Minute)
	b.SetBytes(ThroughputBytes)
	b.ReportAllocs()
	b.ResetTimer()
	var wg sync.WaitGroup
	var cerr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for got := 0; got < b.N; {
			rec, err := c.Next()
			if err == ring.ErrEmpty {
				c.Commit()
				if err := c.Wait(deadline); err != nil {
					cerr = err
					return
				}
				continue
			}
			if err != nil || rec.Seq != uint64(got) {
				cerr = err
				return
			}
			got++
			if got%batch == 0 {
				c.Commit()
			}
		}
		c.Commit()
	}()
	for sent := 0; sent < b.N; {
		n := min(batch, b.N-sent)
		k := 0
		for ; k < n; k++ {
			if err := p.Append(1, 0, uint64(sent+k), payload); err == ring.ErrFull {
				break
			} else if err != nil {
				b.Fatal(err)
			}
		}
		p.Publish()
		sent += k
		if k < n {
			if err := p.WaitSpace(ring.RecordSize(ThroughputBytes), deadline); err != nil {
				b.Fatal(err)
			}
		}
	}
	wg.Wait()
	if cerr != nil {
		b.Fatal(cerr)
	}
}

func TestRank(t *testing.T) {
	s := newSamples(100)
	for i := 100; i >= 1; i-- {
		s.add(time.Duration(i))
	}
	if got := s.summary(); got.n != 100 || got.p50 != 50 || got.p99 != 99 || got.mean != 50 {
		t.Errorf("summary %+v", got)
	}
	if got := (&samples{}).summary(); got.n != 0 {
		t.Errorf("empty summary %+v", got)
	}
}

func TestVerdicts(t *testing.T) {
	rows := []Row{
		{Client: "go", Transport: "pingpong", Metric: "rtt", PayloadBytes: 8, Wait: "spin", P50: 200, Status: "ok"},
		{Client: "go", Transport: "ring", Metric: "rtt", PayloadBytes: 16, Wait: "spin", P50: 300, Status: "ok"},
		{Client: "go", Transport: "ring", Metric: "one-way", PayloadBytes: 64, Wait: "spin", MsgsPerSec: 5e6, Status: "ok"},
		{Client: "python", Transport: "ring", Metric: "rtt", PayloadBytes: 16, Wait: "spin", Status: "skipped"},
	}
	v := Verdicts(rows)
	want := []string{
		"target Go->Go ring p50 <= 0.5 µs (16 B, spin): met (0.30 µs)",
		"target Go->Go ring p50 <= 2x bare ping-pong: met (0.30 µs vs ping-pong 0.20 µs, 1.5x)",
		"target Python->Go ring p50 <= 5 µs (16 B, spin): not measured",
		"target ring >= 5x faster than socket at p50 (go client, 16 B, spin): not measured",
		"target Go->Go throughput >= 10 M 64-byte records/s: MISSED (5.00 M/s)",
	}
	for _, w := range want {
		found := false
		for _, l := range v {
			found = found || l == w
		}
		if !found {
			t.Errorf("no verdict %q in\n%v", w, v)
		}
	}
}
