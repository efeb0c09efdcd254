package reliability

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// waitGone waits until the sidecar no longer lists session id.
func (s *sidecar) waitGone(t *testing.T, id uint64, within time.Duration) time.Duration {
	t.Helper()
	t0 := time.Now()
	for {
		found := false
		for _, ss := range s.state().Sessions {
			if ss.ID == id {
				found = true
			}
		}
		if !found {
			return time.Since(t0)
		}
		if time.Since(t0) > within {
			t.Fatalf("session %d still attached after %v", id, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRingFileCorrupted truncates ring files and overwrites them with
// garbage under a live session, on both rings and on every path that
// writes replies (the session loop and copy completions).
func TestRingFileCorrupted(t *testing.T) {
	row := record(t, "Faults", "a live session's ring file truncated (submission ring; completion ring while a Ping reply and while a Store reply from a copy completion are written), or overwritten with garbage (header page; data area behind a published tail; the client's completion ring)",
		"the sidecar survives (no crash; a fault in a mapping is recovered), ends only that session, closes its rings, and keeps serving another session; the Go client gets an error, never a panic or a hang", "")
	sc := startSidecar(t, newDir(t))
	by := dial(t, opts(sc.sock, "bystander"))
	cases := []struct {
		name   string
		attack func(t *testing.T, c *connector.Client) // the victim's rings are not used afterwards
	}{
		{"truncate submission ring", func(t *testing.T, c *connector.Client) {
			os.Truncate(ringPath(c, true), 0)
		}},
		{"truncate completion ring, then Ping", func(t *testing.T, c *connector.Client) {
			os.Truncate(ringPath(c, false), 0)
			c.Submit(schema.TypePing, schema.IDRequest{ID: 1}.Append(nil))
		}},
		{"truncate completion ring, then Store (reply from a copy completion)", func(t *testing.T, c *connector.Client) {
			r := newRegion(1, 4)
			c.RegisterRegion(r.reg)
			c.PutHashes(1, digests(t.Name(), 4), false)
			os.Truncate(ringPath(c, false), 0)
			c.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: 1, Count: 4}, Region: 1, Pages: iota32(4)}).Append(nil))
		}},
		{"garbage header page", func(t *testing.T, c *connector.Client) {
			overwrite(t, ringPath(c, true), 0, 4096)
		}},
		{"garbage records behind a published tail", func(t *testing.T, c *connector.Client) {
			overwrite(t, ringPath(c, true), ring.HeaderSize, 4096)
			f, _ := os.OpenFile(ringPath(c, true), os.O_RDWR, 0)
			defer f.Close()
			var tail [8]byte
			tail[0] = 0x40 // tail = 64: the consumer reads 64 bytes of garbage
			f.WriteAt(tail[:], 128)
		}},
	}
	var took []string
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := connector.Dial(opts(sc.sock, "victim"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Abandon()
			tc.attack(t, c)
			d := sc.waitGone(t, c.Info().Session, 5*time.Second)
			took = append(took, d.Round(time.Millisecond).String())
			if !sc.alive() {
				t.Fatalf("sidecar died: %s", sc.logTail())
			}
			for i := 0; ; i++ { // the session leaves the table just before its rings are closed
				if !holdsRing(sc.pid(), c, true) && !holdsRing(sc.pid(), c, false) {
					break
				}
				if i == 200 {
					t.Fatal("the sidecar still holds the session's rings")
				}
				time.Sleep(5 * time.Millisecond)
			}
			if err := by.Ping(7); err != nil {
				t.Fatalf("bystander: %v", err)
			}
		})
	}
	// The client side: garbage in the completion ring it reads.
	c, err := connector.Dial(opts(sc.sock, "victim-client"))
	if err != nil {
		t.Fatal(err)
	}
	// Garbage in the first reply record's header, written after the sidecar
	// published it (garbage written earlier would be overwritten by the
	// sidecar's own record, or its tail store).
	seq, err := c.Submit(schema.TypePing, schema.IDRequest{ID: 1}.Append(nil))
	if err != nil {
		t.Fatal(err)
	}
	cf, err := openRing(c, false, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		if tail, head := cf.Positions(); tail > head {
			break
		}
		if i == 2000 {
			t.Fatal("the sidecar never published the reply")
		}
		time.Sleep(time.Millisecond)
	}
	cf.Close()
	garbage := make([]byte, 4)
	binary.LittleEndian.PutUint32(garbage, 0xFFFFFFF0) // a length past any record
	if fh, err := os.OpenFile(ringPath(c, false), os.O_RDWR, 0); err != nil {
		t.Fatal(err)
	} else {
		fh.WriteAt(garbage, ring.HeaderSize) // the first record's length field
		fh.Close()
	}
	_, cerr := c.Await(seq)
	if cerr == nil || !errors.Is(cerr, ring.ErrCorrupt) {
		t.Errorf("client on a corrupt completion ring: %v, want ErrCorrupt", cerr)
	}
	c.Abandon()
	sc.waitQuiet(t, 1, 5*time.Second)
	row.add("%d attacks: each victim session ended in %s; sidecar alive, bystander served after each, %d session faults recovered", len(cases), strings.Join(took, ", "), sc.logCount("session aborted"))
	row.add("client on a garbage completion ring: %v", cerr)
}

func overwrite(t *testing.T, path string, off int64, n int) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	rand.Read(b)
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// ringerChild creates a ring file as its creator would (RS_RING, consumer
// side like the sidecar's submission ring) and exits: a ring left behind by
// a dead process.
func ringerChild() int {
	f, err := ring.Create(os.Getenv("RS_RING"), ring.Options{Capacity: 64 << 10, Epoch: 0xab})
	if err != nil {
		fmt.Println(err)
		return 1
	}
	f.Close()
	return 0
}

// TestStaleRingsAndEpoch leaves ring files of a dead process, garbage with
// a ring's name, and a live process's ring in the directory before the
// sidecar starts; then opens a live ring with the wrong epoch.
func TestStaleRingsAndEpoch(t *testing.T) {
	row := record(t, "Faults", "ring files left behind: one created by a process that died, garbage under a ring's name, one whose creator is alive; a client opening a live ring with a wrong epoch",
		"at start the sidecar removes the dead process's ring and the garbage and leaves the live creator's ring; a wrong epoch is refused (ErrBadHeader)", "2. restart / fault tolerance")
	dir := newDir(t)
	dead := filepath.Join(dir, "s1-00000000000000ab.sub")
	cmd := child("ringer", "RS_RING="+dead)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ringer: %v %s", err, out)
	}
	garbage := filepath.Join(dir, "s2-00000000000000ab.cmp")
	os.WriteFile(garbage, make([]byte, 10000), 0o600)
	liveRing := filepath.Join(dir, "s3-00000000000000ab.sub")
	lf, err := ring.Create(liveRing, ring.Options{Capacity: 64 << 10, Epoch: 0xab})
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	sc := startSidecar(t, dir)
	for _, p := range []string{dead, garbage} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s is still there", p)
		}
	}
	if _, err := os.Stat(liveRing); err != nil {
		t.Errorf("the live process's ring was removed: %v", err)
	}
	c := dial(t, opts(sc.sock, "epoch"))
	_, err = openRing(c, true, c.Info().Epoch^1)
	if !errors.Is(err, ring.ErrBadHeader) {
		t.Fatalf("wrong epoch: %v", err)
	}
	if f, err := openRing(c, true, c.Info().Epoch); err != nil {
		t.Fatalf("right epoch: %v", err)
	} else {
		f.Close()
	}
	if err := c.Ping(1); err != nil {
		t.Fatal(err)
	}
	os.Remove(liveRing)
	row.add("dead creator's ring and garbage removed at start, live creator's ring kept; wrong epoch: %v", short(err.Error(), 90))
}

// TestPeerStopsReading: a client that keeps submitting requests that take
// the locks and the copy path, but never drains its completion ring, loses
// its session after ReplyTimeout; a bystander of another tenant keeps
// working meanwhile.
func TestPeerStopsReading(t *testing.T) {
	row := record(t, "Faults", "a peer that stops reading its completion ring and keeps submitting PutHashes (FlagLookup), Lookup, Poll and Load requests (the locks and the copy path) until its rings are full",
		"the sidecar drops that session after ReplyTimeout (2 s), not before, and within 6 s of the flood; its next call fails within 500 ms; a bystander of another tenant (PutHashes, Store, Lookup, Acquire, Load with every byte checked, Release, DropHashes) sees no failure, timeout or wrong byte, and its median Lookup and Load latency under attack stays within 5x of its median without attack in the same run", "3. hangs from lost completions / unbounded waits")
	sc := startSidecar(t, newDir(t), "--ring.capacity", "64KiB")
	b := startBystander(t, sc)
	b.baseline(300)
	w := newWedger(t, sc, "deaf")
	w.prepLoad(t)
	var gone, failFast time.Duration
	var callErr error
	b.during(func() {
		w.flood(w.genMix)
		var err error
		gone, failFast, callErr, err = w.dropped(sc, 6*time.Second)
		if err != nil {
			t.Error(err)
			return
		}
		// A lower bound, not a speed check: the sidecar must wait out its
		// ReplyTimeout before dropping a session that stopped reading.
		if gone < 2*time.Second-200*time.Millisecond {
			t.Errorf("dropped %v after the flood began, before ReplyTimeout", gone)
		}
		b.waitRounds(20, 3*time.Second)
	})
	b.baseline(300)
	rep := b.check(t, 5)
	if callErr != nil {
		row.add("%d requests submitted until the rings stayed full (%v); session dropped %v after the flood began; next call failed in %v (%v)",
			w.sent, w.full.Round(time.Millisecond), gone.Round(time.Millisecond), failFast.Round(time.Microsecond), short(callErr.Error(), 60))
	}
	row.add("%v", rep)
	t.Log(row.Numbers)
}

// rawSession attaches with the Go client, then takes over the submission
// ring with a producer of its own, so that the test can write records
// byte by byte (the client's own producer is never used again).
func rawSession(t *testing.T, sock, instance string) (*connector.Client, *ring.Producer, *ring.File) {
	t.Helper()
	c, err := connector.Dial(opts(sock, instance))
	if err != nil {
		t.Fatal(err)
	}
	f, err := openRing(c, true, c.Info().Epoch)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ring.NewProducer(f.Ring, ring.DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	return c, p, f
}

// TestPeerStopsWritingMidRecord: a producer that wrote part of a record
// (header and half the payload) but never published the tail.
func TestPeerStopsWritingMidRecord(t *testing.T) {
	row := record(t, "Faults", "a peer that stops writing mid-record: header and half a payload written, tail not published; then it dies in that state",
		"nothing is handled before the tail store (ring shows 0 bytes used, request counter unchanged); the sidecar keeps serving others; publishing later delivers the record intact; dying mid-record ends the session cleanly", "3. hangs from lost completions / unbounded waits")
	sc := startSidecar(t, newDir(t))
	by := dial(t, opts(sc.sock, "bystander"))
	c, p, f := rawSession(t, sc.sock, "half")
	defer f.Close()
	before := sc.metricSum("ringside_requests_total")
	payload, err := p.Claim(schema.TypePing, 0, 1<<40, 8)
	if err != nil {
		t.Fatal(err)
	}
	copy(payload[:4], []byte{0x2a, 0, 0, 0}) // half the payload; the rest later
	time.Sleep(300 * time.Millisecond)
	var used uint64 = 1
	for _, ss := range sc.state().Sessions {
		if ss.ID == c.Info().Session {
			used = ss.SubmissionUsed
		}
	}
	if err := by.Ping(3); err != nil {
		t.Fatal(err)
	}
	after := sc.metricSum("ringside_requests_total")
	if used != 0 || after != before+1 { // +1: the bystander's ping
		t.Fatalf("the sidecar saw an unpublished record: used %d bytes, requests %v -> %v", used, before, after)
	}
	copy(payload[4:], []byte{0, 0, 0, 0})
	p.Publish()
	b, err := c.Await(1 << 40)
	var r schema.Reply
	if err != nil || r.Decode(b) != nil || r.Value != 0x2a {
		t.Fatalf("published record: %+v %v", r, err)
	}
	// Die mid-record: claim, write half, close the socket.
	if _, err := p.Claim(schema.TypeStore, 0, 1<<41, 64); err != nil {
		t.Fatal(err)
	}
	c.Abandon()
	gone := sc.waitGone(t, c.Info().Session, 5*time.Second)
	if err := by.Ping(4); err != nil {
		t.Fatal(err)
	}
	row.add("unpublished half record: 0 bytes visible, 0 requests handled for 300 ms; after publishing, the reply echoed 0x2a; a peer dying mid-record was cleaned up in %v", gone.Round(time.Millisecond))
}

// TestLeaseExpiryFollowsMonotonicTime: leases expire after their TTL of
// elapsed time, measured on the monotonic clock, and no deadline code reads
// the wall clock.
func TestLeaseExpiryFollowsMonotonicTime(t *testing.T) {
	row := record(t, "Faults", "a clock jump (the wall clock cannot be moved here: leases must not depend on it)",
		"code inspection: lease and write deadlines come from sidecar.monotonic() (time.Since of a start instant) and sidecar/cache takes now as an argument; no deadline code reads wall-clock seconds; a lease expires after TTL of elapsed time (within TTL + reap interval 100 ms + 300 ms slack), never before", "")
	// Inspection: the clock of every deadline.
	src, err := os.ReadFile("../sidecar/server.go")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`func monotonic\(\) int64 \{ return int64\(time\.Since\(monoBase\)\) \}`).Match(src) {
		t.Fatal("sidecar.monotonic is no longer time.Since(monoBase): review the clock of leases")
	}
	files, _ := filepath.Glob("../sidecar/*.go")
	cf, _ := filepath.Glob("../sidecar/cache/*.go")
	wall := regexp.MustCompile(`\.Unix(Nano|Milli|Micro)?\(\)|time\.Now\(\)\.Sub\(|\.Round\(0\)`)
	inspected := 0
	for _, f := range append(files, cf...) {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, _ := os.ReadFile(f)
		inspected++
		if m := wall.Find(b); m != nil {
			t.Errorf("%s reads the wall clock (%s): deadlines must use monotonic()", f, m)
		}
		if strings.Contains(f, "/cache/") && strings.Contains(string(b), "time.Now()") {
			t.Errorf("%s reads the clock: sidecar/cache must take now as an argument", f)
		}
	}
	sc := startSidecar(t, newDir(t))
	c := dial(t, opts(sc.sock, "clock"))
	r := newRegion(1, 2)
	c.RegisterRegion(r.reg)
	c.PutHashes(1, digests("clock", 1), false)
	if _, err := c.Store(schema.View{Batch: 1, Count: 1}, 1, []uint32{0}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ttl := range []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, 1000 * time.Millisecond} {
		t0 := time.Now()
		l, err := c.Acquire(schema.View{Batch: 1, Count: 1}, ttl)
		if err != nil || l.Lease == 0 {
			t.Fatal(l, err)
		}
		var expired time.Duration
		for {
			p, err := c.Poll(l.Lease)
			if err != nil {
				t.Fatal(err)
			}
			el := time.Since(t0)
			if p.State == schema.StateMiss {
				expired = el
				break
			}
			if el > ttl+2*time.Second {
				t.Fatalf("lease of %v not expired after %v", ttl, el)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if expired < ttl || expired > ttl+400*time.Millisecond {
			t.Errorf("lease of %v expired after %v", ttl, expired)
		}
		if _, err := c.Load(l.Lease, 1, 0, []uint32{1}); status(err) != schema.ErrCodeExpired {
			t.Errorf("load of an expired lease: %v", err)
		}
		c.Release(l.Lease)
		got = append(got, fmt.Sprintf("%v→%v", ttl, expired.Round(time.Millisecond)))
	}
	row.add("%d sidecar source files inspected, no wall-clock deadline; TTL→expiry %s; loads of expired leases answered status 9", inspected, strings.Join(got, ", "))
}
