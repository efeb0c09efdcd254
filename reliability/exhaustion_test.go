package reliability

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime"
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

// exhaustHog is what one hog of the "hogs" child did.
type exhaustHog struct {
	Name   string
	OK     int           // requests accepted
	Status schema.Status // the refusal that ended it (0: stopped)
	Msg    string        // the refusal's message
	Err    string        // a client error, if any
	Expect int           // the quota it should reach (-1: none, a flood)
}

func init() { childRoles["hogs"] = hogsChild }

// hogsChild runs the hogs of TestResourceExhaustion in a process of their
// own (an attacker is another process: in the test's process its busy
// goroutines would compete with the bystander's client for the Go
// scheduler, which no sidecar can help): one session registers one-digest
// batches without end, one 4096-digest batches, one opens leases without
// releasing, and one floods pipelined PutHashes (FlagLookup), Lookup and
// Load requests until the three others have hit their quotas (at least
// RS_HOGS_MIN_MS). It prints the results as JSON.
func hogsChild() int {
	sock := os.Getenv("RS_SOCK")
	var stop atomic.Bool
	var quotaDone atomic.Int32
	var wg sync.WaitGroup
	results := make([]exhaustHog, 4)
	run := func(i int, name string, expect int, setup func(c *connector.Client) error, gen func(i int) (uint16, []byte)) error {
		c, err := connector.Dial(opts(sock, "hog-"+name))
		if err != nil {
			return fmt.Errorf("hog %s: %w", name, err)
		}
		if setup != nil {
			if err := setup(c); err != nil {
				return fmt.Errorf("hog %s: %w", name, err)
			}
		}
		wg.Go(func() {
			ok, st, msg, err := hog(c, gen, &stop)
			results[i] = exhaustHog{Name: name, OK: ok, Status: st, Msg: msg, Expect: expect}
			if err != nil {
				results[i].Err = err.Error()
			}
			c.Close()
			if expect > 0 {
				quotaDone.Add(1)
			}
		})
		return nil
	}
	one := digests("one", 1)
	big := digests("big", 4096)
	acq := (&schema.Acquire{View: schema.View{Batch: 1, Count: 1}, TTLms: 600000}).Append(nil)
	flood := [3][]byte{
		(&schema.PutHashes{Batch: 1, Flags: schema.FlagReplace | schema.FlagLookup, Digests: one}).Append(nil, 32),
		(&schema.Lookup{View: schema.View{Batch: 1, Count: 1}}).Append(nil),
	}
	var regions []*region // the sidecar copies into them: keep them
	storeOne := func(c *connector.Client) error {
		r := newRegion(1, 2)
		regions = append(regions, r)
		fillPage(r.page(0), one, 0x406)
		if err := c.RegisterRegion(r.reg); err != nil {
			return err
		}
		if _, err := c.PutHashes(1, one, false); err != nil {
			return err
		}
		if st, err := c.Store(schema.View{Batch: 1, Count: 1}, 1, []uint32{0}); err != nil || st.Stored+st.Present != 1 {
			return fmt.Errorf("store: %+v %v", st, err)
		}
		return nil
	}
	err := errors.Join(
		run(0, "batches", 1<<16, nil, func(i int) (uint16, []byte) {
			return schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(i + 1), Digests: one}).Append(nil, 32)
		}),
		run(1, "hash-bytes", (256<<20)/len(big), nil, func(i int) (uint16, []byte) {
			return schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(i + 1), Digests: big}).Append(nil, 32)
		}),
		run(2, "leases", 1<<16, storeOne, func(int) (uint16, []byte) { return schema.TypeAcquire, acq }),
		run(3, "flood", -1, func(c *connector.Client) error {
			if err := storeOne(c); err != nil {
				return err
			}
			l, err := c.Acquire(schema.View{Batch: 1, Count: 1}, time.Minute)
			if err != nil || l.Lease == 0 {
				return fmt.Errorf("lease: %+v %v", l, err)
			}
			flood[2] = (&schema.Load{Lease: l.Lease, Region: 1, Pages: []uint32{1}}).Append(nil)
			return nil
		}, func(i int) (uint16, []byte) {
			return [3]uint16{schema.TypePutHashes, schema.TypeLookup, schema.TypeLoad}[i%3], flood[i%3]
		}),
	)
	t0 := time.Now()
	minDur := time.Duration(envInt("RS_HOGS_MIN_MS", 2000)) * time.Millisecond
	for err == nil && (quotaDone.Load() < 3 || time.Since(t0) < minDur) && time.Since(t0) < 60*time.Second {
		time.Sleep(10 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	runtime.KeepAlive(regions)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		return 1
	}
	return 0
}

// TestResourceExhaustion: sessions of another process that register
// batches without end, hold leases without releasing, flood the ring with
// pipelined requests that take the locks and the copy path, and attach
// without end, next to a bystander of another tenant whose every loaded
// byte is checked.
func TestResourceExhaustion(t *testing.T) {
	row := record(t, "Resource exhaustion", "from another process: one session registers hash batches without end, one registers 4096-digest batches without end, one opens leases without releasing, one floods its ring with pipelined PutHashes (FlagLookup), Lookup and Load requests (at least 2 s, until the others hit their quotas); then sessions attach without end",
		"each hog is bounded by its quota with status 7 and a message naming the maximum (65,536 batches per instance, 256 MiB of digests per instance, 65,536 leases per session, --max-sessions 16); everything is reclaimed when they leave; a bystander of another tenant (PutHashes, Store, Lookup, Acquire, Load with every byte checked, Release, DropHashes) sees no failure, timeout or wrong byte while and after the hogs run, and its median Lookup and Load latency under attack stays within 8x of its median without attack in the same run (measured on 2 vCPUs, 16 runs: Lookup 1.3-5.4x, median 2.6x; Load 1.3-2.6x; a control with every CPU kept busy by a process that never talks to the sidecar: about 1.0x, so the slowdown is queueing behind the flood inside the sidecar, not CPU sharing)",
		"1. leaks / pins never released; 7. backpressure")
	// The per-instance and per-session bounds under test here, not the
	// per-uid shares (all hogs run as this test's uid; TestMetadataMemoryBound
	// and TestPinQuota are about those): the uid may hold every session and
	// pin, and a session the instance's whole 256 MiB of digests.
	sc := startSidecar(t, newDir(t), "--max-sessions", "16", "--ring.capacity", "1MiB", "--budget", "1GiB",
		"--limits.metadata-bytes", "2GiB", "--limits.uid-share", "1", "--limits.pin-share", "1")
	by := startBystander(t, sc)
	by.baseline(300)
	by.contend(200) // what busy CPUs alone do to it: the bound's control
	var results []exhaustHog
	by.during(func() {
		cmd := child("hogs", "RS_SOCK="+sc.sock)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Errorf("hogs: %v: %s", err, short(stderr.String(), 500))
			return
		}
		if err := json.Unmarshal(out, &results); err != nil || len(results) != 4 {
			t.Errorf("hogs printed %q: %v", short(string(out), 300), err)
		}
	})
	by.baseline(300)
	rep := by.check(t, 8)
	if len(results) != 4 {
		t.FailNow()
	}
	for _, r := range results[:3] {
		if r.Err != "" || r.Status != schema.ErrCodeTooLarge || r.OK != r.Expect || !strings.Contains(r.Msg, "maximum") && !strings.Contains(r.Msg, "more than") {
			t.Errorf("%s hog: %d accepted (want %d), refusal %v %q, err %s", r.Name, r.OK, r.Expect, r.Status, r.Msg, r.Err)
		}
	}
	if f := results[3]; f.Err != "" || f.Status != 0 {
		t.Errorf("flood: %d answered, then status %v %q, err %s", f.OK, f.Status, f.Msg, f.Err)
	}
	one := digests("one", 1)
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
	if err := by.c.Ping(1); err != nil {
		t.Fatal(err)
	}
	for _, c := range extra {
		c.Close()
	}
	var parts []string
	for _, r := range results[:3] {
		parts = append(parts, fmt.Sprintf("%s: %d accepted then status %d %q", r.Name, r.OK, r.Status, short(r.Msg, 60)))
	}
	row.add("%s; flood: %d requests answered", strings.Join(parts, "; "), results[3].OK)
	row.add("%v", rep)
	row.add("quotas free again after the hogs left; session flood: 15 more attached, the next refused: %v", refusal)
	t.Log(row.Numbers)
}
