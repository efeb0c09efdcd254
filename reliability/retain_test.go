package reliability

import (
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/schema"
)

// Retention hints (Retain, docs/protocol.md section 5.14) come from the
// callers of an engine, through its API: a caller chooses what to retain,
// for how long, and at which priority. Such hints must never starve the
// engine's loads, and one caller must not end or change another's.

// TestRetentionCannotStarveLoads: one caller of an engine asks to retain
// the whole pool for an hour at the highest priority; the engine's other
// requests must still get their leases (a lease is what turns a hit into
// a load), and another caller of the same engine must not end or lower
// that retention.
func TestRetentionCannotStarveLoads(t *testing.T) {
	row := record(t, "Isolation", "a 64-slot pool holds 64 blocks of one engine (one uid); a caller's hint (Retain, owner A) asks to retain the first 32 for an hour at priority 3, then 32 more; the engine then acquires the other 32 for its other callers' requests; another caller (owner B) of the engine sends END and a priority-0 Retain over A's blocks",
		"A retains at most --limits.retain-share (a quarter: 16 blocks), and more is refused (status 7); the engine's lease of 32 other blocks gets all 32 (--limits.pin-share, untouched by retention) and loads them byte-exact; B ends and renews none of A's retentions, A ends all of its own",
		"")
	sc := startSidecar(t, newDir(t), "--pool.bytes", "256KiB", "--lease.ttl", "30s")
	e := dial(t, opts(sc.sock, "retain-engine"))
	slots := int(e.Info().PoolSlots)
	if slots != 64 {
		t.Fatalf("pool of %d slots, want 64", slots)
	}
	half := slots / 2
	reg := newRegion(1, slots)
	if err := e.RegisterRegion(reg.reg); err != nil {
		t.Fatal(err)
	}
	hinted, others := digests("retain-caller-a", half), digests("retain-others", half)
	for j := 0; j < half; j++ {
		fillPage(reg.page(j), hinted[j*32:(j+1)*32], 0xA)
		fillPage(reg.page(half+j), others[j*32:(j+1)*32], 0xB)
	}
	va, vo := schema.View{Batch: 1, Count: uint32(half)}, schema.View{Batch: 2, Count: uint32(half)}
	for _, b := range []struct {
		v     schema.View
		d     []byte
		first uint32
	}{{va, hinted, 0}, {vo, others, uint32(half)}} {
		if _, err := e.PutHashes(b.v.Batch, b.d, false); err != nil {
			t.Fatal(err)
		}
		pages := iota32(half)
		for i := range pages {
			pages[i] += b.first
		}
		if sr, err := e.Store(b.v, 1, pages); err != nil || int(sr.Stored) != half {
			t.Fatalf("store of batch %d: %+v %v", b.v.Batch, sr, err)
		}
	}

	const ownerA, ownerB = 0xA11CE, 0xB0B
	retained, err := e.RetainOwned(va, ownerA, time.Hour, schema.MaxRetainPriority, false)
	if err != nil {
		t.Fatalf("caller A's hint: %v", err)
	}
	if retained > slots/4 {
		t.Errorf("caller A retained %d blocks, more than --limits.retain-share (a quarter of %d slots)", retained, slots)
	}
	more, errMore := e.RetainOwned(vo, ownerA, time.Hour, schema.MaxRetainPriority, false)
	if errMore == nil || status(errMore) != schema.ErrCodeTooLarge {
		t.Errorf("caller A's second hint, past its share: retained %d, %v; want status 7", more, errMore)
	}

	// The engine's other callers: their prefix is a hit, and a lease of it
	// loads it.
	l, err := e.Acquire(vo, 30*time.Second)
	loaded, bad := 0, 0
	switch {
	case err != nil:
		t.Errorf("the lease for the other callers' %d blocks was refused while caller A retains %d: %v", half, retained, err)
	case int(l.Blocks) != half:
		t.Errorf("the lease for the other callers' %d blocks holds %d while caller A retains %d", half, l.Blocks, retained)
	}
	if err == nil && l.Lease != 0 {
		dst := newRegion(2, half)
		if err := e.RegisterRegion(dst.reg); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Load(l.Lease, 2, 0, iota32(int(l.Blocks))); err != nil {
			t.Errorf("load: %v", err)
		}
		for j := 0; j < int(l.Blocks); j++ {
			if pageOK(dst.page(j), others[j*32:(j+1)*32], 0xB) {
				loaded++
			} else {
				bad++
			}
		}
		if loaded != int(l.Blocks) {
			t.Errorf("loaded %d of %d blocks byte-exact (%d wrong)", loaded, l.Blocks, bad)
		}
		if err := e.Release(l.Lease); err != nil {
			t.Error(err)
		}
	}

	// Another caller of the same engine (same uid) cannot end, renew or
	// re-prioritise A's retentions (its Retain goes on past them: nothing
	// to retain, no refusal); A can end them.
	vr := schema.View{Batch: 1, Count: uint32(retained)}
	endedB, errEndB := e.RetainOwned(vr, ownerB, 0, 0, true)
	renewedB, errRenewB := e.RetainOwned(vr, ownerB, time.Minute, 0, false)
	if errEndB != nil || endedB != 0 {
		t.Errorf("caller B's END over A's blocks: ended %d, %v; want 0", endedB, errEndB)
	}
	if errRenewB != nil || renewedB != 0 {
		t.Errorf("caller B's Retain over A's blocks: renewed %d, %v; want 0", renewedB, errRenewB)
	}
	endedA, errEndA := e.RetainOwned(va, ownerA, 0, 0, true)
	if errEndA != nil || endedA != retained {
		t.Errorf("caller A's END: ended %d of its %d, %v", endedA, retained, errEndA)
	}
	row.add("A retained %d of %d blocks asked (a pool of %d slots), its second hint: %d, %v", retained, half, slots, more, errMore)
	row.add("the engine's lease of %d other blocks: %d blocks, %d loaded byte-exact, %d wrong (%v)", half, l.Blocks, loaded, bad, err)
	row.add("B's END ended %d, its Retain renewed %d (%v); A's END ended %d", endedB, renewedB, errRenewB, endedA)
}

// TestRetainShareAtStart: a retain share outside (0, 1], or above the pin
// share, is refused at start, naming both flags where they conflict.
func TestRetainShareAtStart(t *testing.T) {
	row := record(t, "Configuration", "ringside serve with --limits.retain-share above --limits.pin-share (0.6 against the default 0.5; the default 0.25 against --limits.pin-share 0.2), or outside (0, 1]",
		"the sidecar exits at start, and its error names --limits.retain-share (and --limits.pin-share when they conflict)", "")
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--limits.retain-share", "0.6"}, []string{"--limits.retain-share", "--limits.pin-share"}},
		{[]string{"--limits.pin-share", "0.2"}, []string{"--limits.retain-share", "--limits.pin-share"}},
		{[]string{"--limits.retain-share", "1.5"}, []string{"--limits.retain-share"}},
		{[]string{"--limits.retain-share", "-0.1"}, []string{"--limits.retain-share"}},
	} {
		s, log, err := tryStart(t, newDir(t), tc.args...)
		if s != nil || err == nil {
			t.Errorf("%v: the sidecar started", tc.args)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(log, w) {
				t.Errorf("%v: the error does not name %s: %s", tc.args, w, log)
			}
		}
		row.add("%s: %s", strings.Join(tc.args, " "), short(lastLine(log), 200))
	}
	// At the pin share itself, it starts.
	if s, log, err := tryStart(t, newDir(t), "--limits.retain-share", "0.5", "--limits.pin-share", "0.5"); s == nil {
		t.Errorf("a retain share equal to the pin share: %v %s", err, log)
	}
}
