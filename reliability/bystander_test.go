package reliability

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// A bystander is an innocent session of a tenant of its own (its own salt,
// so its own namespace) that keeps working while a test attacks the
// sidecar, and tells afterwards whether the attack reached it. One round
// of its loop is
//
//	PutHashes → Store → Lookup → Acquire → (Poll) → Load → Release → DropHashes
//
// over fresh digests whose pages hold content only this bystander writes
// (fillPage with its own tag): every byte it loads is checked with pageOK,
// and every answer must be exact (all blocks stored, found, leased,
// loaded). With bystanderOptions.Every a round also runs Ping, Poll,
// Changes and Snapshot (every request type an engine sends) and checks
// that the change log and the snapshot list only digests it registered
// itself; with Attach it also attaches and detaches a second session of
// its tenant.
//
// Every call's latency is recorded by request type and phase, and every
// failure (an error status, a wrong answer, a timeout: the client's
// per-call timeout is 3 s) is counted. Use:
//
//	b := startBystander(t, sc)
//	b.baseline(300)                  // warm-up, then 300 rounds before the attack
//	b.during(func() { ...attack... }) // rounds run while the attack runs
//	b.baseline(300)                  // 300 rounds after it (they stop at a failure)
//	rep := b.check(t, 5)             // fails t on any failure or wrong byte, or
//	row.add("%v", rep)               // a median Lookup/Load ratio over 5
//
// The latency "without attack" is that of the rounds before and after the
// attack together, so that a change in the machine's load during the test
// (other processes on a shared machine) weighs on both sides. Each call is
// made after an idle gap (300 µs), and the client parks at once while it
// waits (ring.ParkWait): every call then wakes the sidecar's session and
// the client, in every phase, instead of racing two spinning threads on
// whatever CPUs are free.
//
// During during(), the bystander's client belongs to the bystander's own
// goroutine: the attack must not use it.
type bystander struct {
	t    *testing.T
	o    connector.Options
	c    *connector.Client
	cfg  bystanderOptions
	reg  *region
	tag  uint64 // fillPage tag: the content is this bystander's alone
	warm bool
	hit  bool // during has run: baseline now records the phase after

	round   uint64            // rounds begun: the batch id of the current one
	own     map[[32]byte]bool // every digest this bystander registered
	cursor  [2]uint64         // change-log cursor (epoch, seq)
	loadPgs []uint32          // the pages loads land in
	attackN atomic.Int64      // rounds run under attack (failed ones too)

	mu     sync.Mutex // guards what the round loop records
	lat    [phases]map[string][]time.Duration
	fails  [phases]int
	first  [phases][]string // the first few failures, for the message
	wrong  [phases]int      // pages loaded with wrong bytes
	rounds [phases]int      // rounds completed without a failure
}

// bystanderOptions tune a bystander; the zero value is the core loop.
type bystanderOptions struct {
	Blocks int           // blocks per round (default 4)
	Every  bool          // also Ping, Poll, Changes and Snapshot in every round
	Attach bool          // also attach and detach a second session each round
	Gap    time.Duration // idle time before each call (default 300 µs; negative: none)
	// PageBytes is the page size of its region (default 4 KiB); it must
	// not exceed the pool's slot.
	PageBytes int
}

// The phases of a bystander's rounds.
const (
	phaseBefore = iota // baseline before the attack
	phaseAttack
	phaseAfter // baseline after the attack
	phaseCPU   // the control: no attack, every CPU kept busy by another process (contend)
	phases
)

var phaseNames = [phases]string{"before the attack", "under attack", "after the attack", "with the CPUs busy"}

var bystanders atomic.Int64

// startBystander attaches a bystander with the core loop.
func startBystander(t *testing.T, sc *sidecar) *bystander {
	t.Helper()
	return startBystanderWith(t, sc, bystanderOptions{})
}

// startBystanderWith attaches a bystander: a session of a tenant of its
// own, with a region of 2×Blocks pages (Blocks to store from, Blocks to
// load into).
func startBystanderWith(t *testing.T, sc *sidecar, cfg bystanderOptions) *bystander {
	t.Helper()
	if cfg.Blocks == 0 {
		cfg.Blocks = 4
	}
	if cfg.PageBytes == 0 {
		cfg.PageBytes = slot
	}
	if cfg.Gap == 0 {
		cfg.Gap = 300 * time.Microsecond
	}
	n := bystanders.Add(1)
	o := opts(sc.sock, fmt.Sprintf("bystander-%d", n))
	o.Salt = fmt.Sprintf("bystander-tenant-%d", n)
	o.Timeout = 3 * time.Second
	o.Wait = ring.ParkWait
	h := sha256.Sum256([]byte(o.Salt))
	b := &bystander{t: t, o: o, cfg: cfg, tag: binary.LittleEndian.Uint64(h[:]), own: map[[32]byte]bool{}}
	for i := range b.lat {
		b.lat[i] = map[string][]time.Duration{}
	}
	b.c = dial(t, o)
	b.reg = regionPages(1, make([]byte, 2*cfg.Blocks*cfg.PageBytes), cfg.PageBytes)
	keepFor(sc, b.reg.buf)
	if err := b.c.RegisterRegion(b.reg.reg); err != nil {
		t.Fatalf("bystander region: %v", err)
	}
	for j := 0; j < cfg.Blocks; j++ {
		b.loadPgs = append(b.loadPgs, uint32(cfg.Blocks+j))
	}
	return b
}

// regionPages is regionOver with pages of pageBytes.
func regionPages(id uint32, buf []byte, pageBytes int) *region {
	r := regionOver(id, buf)
	r.reg.PageSize, r.reg.PageCount = uint64(pageBytes), uint32(len(buf)/pageBytes)
	return r
}

// page returns page i of the bystander's region.
func (b *bystander) page(i int) []byte {
	p := b.cfg.PageBytes
	return b.reg.buf[i*p : (i+1)*p]
}

// keepFor keeps buf reachable until the sidecar process exits. The sidecar
// writes registered memory with process_vm_writev, which the garbage
// collector does not see: a region must outlive every copy the sidecar may
// still run into it, also one that a test gave up waiting for.
func keepFor(sc *sidecar, buf []byte) {
	exited := sc.exited
	go func() {
		<-exited
		runtime.KeepAlive(buf)
	}()
}

// baseline runs n rounds without attack: before during() has run (after a
// warm-up of n/5 rounds, at least 20, the first time), or after it. It
// stops at the first round that fails.
func (b *bystander) baseline(n int) {
	b.t.Helper()
	ph := phaseBefore
	if b.hit {
		ph = phaseAfter
	}
	if !b.warm {
		for i := 0; i < max(20, n/5); i++ {
			if !b.roundOnce(ph, false) {
				return
			}
		}
		b.warm = true
	}
	for i := 0; i < n; i++ {
		if !b.roundOnce(ph, true) {
			return
		}
	}
}

// during runs attack in the calling goroutine while the bystander runs
// rounds in its own, and returns when attack has returned and the round in
// progress has ended. during may be called more than once; the rounds add
// up.
func (b *bystander) during(attack func()) {
	b.t.Helper()
	b.hit = true
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			b.roundOnce(phaseAttack, true)
			b.attackN.Add(1)
		}
	}()
	defer func() {
		close(stop)
		<-done
	}()
	attack()
}

// contend runs n rounds of the control phase: no attack, while a child
// process that never talks to the sidecar keeps every CPU busy (one
// spinning thread per CPU). What it does to the bystander's latency is
// what CPU sharing alone does; the report shows it beside the attack's.
func (b *bystander) contend(n int) {
	b.t.Helper()
	cmd := child("spin", fmt.Sprintf("RS_SPIN_THREADS=%d", runtime.NumCPU()))
	if err := cmd.Start(); err != nil {
		b.t.Fatalf("spin: %v", err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	time.Sleep(50 * time.Millisecond) // its threads running
	for i := 0; i < n; i++ {
		if !b.roundOnce(phaseCPU, true) {
			return
		}
	}
}

// spinChild keeps RS_SPIN_THREADS threads busy until it is killed.
func spinChild() int {
	n := envInt("RS_SPIN_THREADS", 1)
	runtime.GOMAXPROCS(n)
	for i := 0; i < n; i++ {
		go func() {
			x := uint64(1)
			for {
				x = x*6364136223846793005 + 1442695040888963407
				spinSink.Store(x)
			}
		}()
	}
	select {}
}

var spinSink atomic.Uint64

func init() { childRoles["spin"] = spinChild }

// waitRounds blocks (an attack calls it) until the bystander has run n
// rounds under attack in all, or within has passed.
func (b *bystander) waitRounds(n int, within time.Duration) {
	deadline := time.Now().Add(within)
	for b.attackN.Load() < int64(n) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}

// note records one call: its latency (unless timed is false: a warm-up)
// and its failure.
func (b *bystander) note(ph int, timed bool, op string, d time.Duration, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if timed {
		b.lat[ph][op] = append(b.lat[ph][op], d)
	}
	if err != nil {
		b.fail(ph, fmt.Sprintf("round %d %s after %v: %v", b.round, op, d.Round(time.Millisecond), err))
	}
}

// fail counts a failure of phase ph; b.mu is held.
func (b *bystander) fail(ph int, msg string) {
	b.fails[ph]++
	if len(b.first[ph]) < 5 {
		b.first[ph] = append(b.first[ph], msg)
	}
}

// roundOnce runs one round of phase ph and reports whether it completed
// without a failure; a failed call ends the round (the lease, if one was
// taken, is still released, and the batch dropped). timed is false for the
// warm-up.
func (b *bystander) roundOnce(ph int, timed bool) (ok bool) {
	k := b.cfg.Blocks
	b.round++
	batch := b.round
	d := digests(fmt.Sprintf("%s/%d", b.o.Salt, batch), k)
	dg := func(j int) []byte { return d[j*32 : (j+1)*32] }
	for j := 0; j < k; j++ {
		fillPage(b.page(j), dg(j), b.tag)
		clear(b.page(k + j))
		b.own[[32]byte(dg(j))] = true
	}
	v := schema.View{Batch: batch, Count: uint32(k)}
	failed := false
	step := func(op string, f func() error) bool {
		if b.cfg.Gap > 0 {
			time.Sleep(b.cfg.Gap)
		}
		t0 := time.Now()
		err := f()
		b.note(ph, timed, op, time.Since(t0), err)
		failed = failed || err != nil
		return err == nil
	}
	defer func() {
		ok = !failed
		if ok && timed {
			b.mu.Lock()
			b.rounds[ph]++
			b.mu.Unlock()
		}
	}()
	if b.cfg.Every && !step("Ping", func() error { return b.c.Ping(batch) }) {
		return
	}
	if !step("PutHashes", func() error {
		n, err := b.c.PutHashes(batch, d, false)
		if err == nil && n != k {
			err = fmt.Errorf("batch of %d hashes, want %d", n, k)
		}
		return err
	}) {
		return
	}
	defer step("DropHashes", func() error { return b.c.DropHashes(batch) })
	if !step("Store", func() error {
		r, err := b.c.Store(v, 1, iota32(k))
		if err == nil && int(r.Stored+r.Present) != k {
			err = fmt.Errorf("stored %d, present %d, skipped %d of %d blocks", r.Stored, r.Present, r.Skipped, k)
		}
		return err
	}) {
		return
	}
	if !step("Lookup", func() error {
		n, err := b.c.Lookup(v)
		if err == nil && n != k {
			err = fmt.Errorf("%d of %d blocks present right after storing them", n, k)
		}
		return err
	}) {
		return
	}
	var l schema.LeaseReply
	if !step("Acquire", func() error {
		var err error
		l, err = b.c.Acquire(v, 30*time.Second)
		if err == nil && (l.Lease == 0 || int(l.Blocks) != k) {
			err = fmt.Errorf("lease %d of %d blocks, want %d", l.Lease, l.Blocks, k)
		}
		return err
	}) {
		return
	}
	defer step("Release", func() error { return b.c.Release(l.Lease) })
	// Poll until the lease may load (over its load budget it waits); with
	// Every, poll once anyway.
	for i := 0; l.State == schema.StateWaiting || b.cfg.Every && i == 0; i++ {
		if !step("Poll", func() error {
			var err error
			l, err = b.c.Poll(l.Lease)
			if err == nil && l.State != schema.StateReady && l.State != schema.StateWaiting {
				err = fmt.Errorf("lease %d is %v, want ready", l.Lease, l.State)
			}
			if err == nil && l.State == schema.StateWaiting && i > 100 {
				err = fmt.Errorf("lease %d still waiting for its load budget after %d polls", l.Lease, i)
			}
			return err
		}) {
			return
		}
		if l.State == schema.StateWaiting {
			time.Sleep(time.Millisecond)
		}
	}
	if !step("Load", func() error {
		n, err := b.c.Load(l.Lease, 1, 0, b.loadPgs)
		if err == nil && n != k {
			err = fmt.Errorf("loaded %d of %d blocks", n, k)
		}
		return err
	}) {
		return
	}
	for j := 0; j < k; j++ {
		if !pageOK(b.page(k+j), dg(j), b.tag) {
			failed = true
			b.mu.Lock()
			b.wrong[ph]++
			b.fail(ph, fmt.Sprintf("round %d: block %d loaded with wrong bytes", batch, j))
			b.mu.Unlock()
		}
	}
	if b.cfg.Every {
		if !step("Changes", b.changes) || !step("Snapshot", b.snapshot) {
			return
		}
	}
	if b.cfg.Attach {
		var c2 *connector.Client
		o := b.o
		o.Instance += "-again"
		if !step("Attach", func() error {
			var err error
			c2, err = connector.Dial(o)
			return err
		}) {
			return
		}
		step("Detach", c2.Close)
	}
	return
}

// changes reads the change log from the bystander's cursor: every entry
// must name a digest the bystander itself registered.
func (b *bystander) changes() error {
	r, err := b.c.Changes(b.cursor[0], b.cursor[1], 256)
	if err != nil {
		return err
	}
	b.cursor = [2]uint64{r.Epoch, r.Next}
	for i := 0; i < r.Len(); i++ {
		if _, dg := r.ChangeAt(i); !b.own[[32]byte(dg)] {
			return fmt.Errorf("change log entry %d names a digest this tenant never registered: %x", i, dg[:8])
		}
	}
	return nil
}

// snapshot reads the first page of the namespace's snapshot: every digest
// must be one the bystander itself registered.
func (b *bystander) snapshot() error {
	r, err := b.c.Snapshot(0, 64)
	if err != nil {
		return err
	}
	for i := 0; i < r.Len(); i++ {
		if dg := r.DigestAt(i); !b.own[[32]byte(dg)] {
			return fmt.Errorf("snapshot entry %d names a digest this tenant never registered: %x", i, dg[:8])
		}
	}
	return nil
}

// opStats is one request type's latency in one phase.
type opStats struct {
	N             int
	P50, P99, Max time.Duration
}

func stats(d []time.Duration) opStats {
	if len(d) == 0 {
		return opStats{}
	}
	return opStats{N: len(d), P50: percentile(d, 0.5), P99: percentile(d, 0.99), Max: slices.Max(d)}
}

// bystanderReport is what check found; String renders it for a report row.
type bystanderReport struct {
	Rounds [phases]int // rounds completed without a failure
	Fails  [phases]int // failures: calls, wrong answers, pages with wrong bytes
	Wrong  [phases]int // pages loaded with wrong bytes
	// Base is each request type's latency without attack (before and
	// after together), Attack under attack.
	Base, Attack map[string]opStats
	Ratio        map[string]float64 // attack p50 / baseline p50, for the checked types
	// CPU is each checked type's p50 with every CPU kept busy by a process
	// that never talks to the sidecar (contend; absent if not run), over
	// its baseline p50: what CPU sharing alone does to the bystander.
	CPU     map[string]float64
	Bound   float64
	Slowest string // the slowest call under attack (type and latency)
}

// checkedOps are the request types whose median latency under attack is
// held to the bound.
var checkedOps = []string{"Lookup", "Load"}

// check fails t if any call of the bystander failed or timed out, any
// answer was wrong, any byte it loaded was wrong (in any phase), it
// completed fewer than 5 rounds under attack, or its median Lookup or Load
// latency under attack is more than bound times its median without attack.
// It returns the numbers for the report.
func (b *bystander) check(t *testing.T, bound float64) bystanderReport {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	rep := bystanderReport{Rounds: b.rounds, Fails: b.fails, Wrong: b.wrong, Base: map[string]opStats{}, Attack: map[string]opStats{},
		Ratio: map[string]float64{}, CPU: map[string]float64{}, Bound: bound}
	for op := range b.lat[phaseBefore] {
		rep.Base[op] = stats(append(slices.Clone(b.lat[phaseBefore][op]), b.lat[phaseAfter][op]...))
	}
	var slowest time.Duration
	for op, d := range b.lat[phaseAttack] {
		s := stats(d)
		rep.Attack[op] = s
		if s.Max > slowest {
			slowest = s.Max
			rep.Slowest = fmt.Sprintf("%s %v", op, slowest.Round(time.Microsecond))
		}
	}
	for ph := range phases {
		if b.fails[ph] > 0 {
			t.Errorf("bystander: %d failures %s (%d pages with wrong bytes): %s", b.fails[ph], phaseNames[ph], b.wrong[ph], strings.Join(b.first[ph], "; "))
		}
	}
	if b.rounds[phaseAttack] < 5 {
		t.Errorf("bystander completed only %d rounds under attack", b.rounds[phaseAttack])
	}
	for _, op := range checkedOps {
		base, att := rep.Base[op], rep.Attack[op]
		if base.N == 0 || att.N == 0 {
			t.Errorf("bystander: no %s measured (%d without attack, %d under attack)", op, base.N, att.N)
			continue
		}
		r := float64(att.P50) / float64(base.P50)
		rep.Ratio[op] = r
		// The control (contend), where run, is reported beside the ratio:
		// it tells the sidecar's own queueing from CPU sharing.
		if d := b.lat[phaseCPU][op]; len(d) > 0 {
			rep.CPU[op] = float64(stats(d).P50) / float64(base.P50)
		}
		if r > bound {
			t.Errorf("bystander median %s %v under attack vs %v without: ratio %.1f > %.0f (p99 %v vs %v)", op,
				att.P50.Round(time.Microsecond), base.P50.Round(time.Microsecond), r, bound,
				att.P99.Round(time.Microsecond), base.P99.Round(time.Microsecond))
		}
	}
	return rep
}

// String renders the report: rounds, failures, wrong pages, the slowest
// call under attack, then per request type (the checked ones first) the
// p50 and p99 without attack → under attack.
func (r bystanderReport) String() string {
	var b strings.Builder
	fails := r.Fails[phaseAttack] + r.Fails[phaseAfter]
	fmt.Fprintf(&b, "bystander: %d rounds without attack (%d before, %d after), %d under attack; %d failures under or after it, %d pages with wrong bytes",
		r.Rounds[phaseBefore]+r.Rounds[phaseAfter], r.Rounds[phaseBefore], r.Rounds[phaseAfter], r.Rounds[phaseAttack], fails, r.Wrong[phaseAttack]+r.Wrong[phaseAfter])
	if r.Slowest != "" {
		fmt.Fprintf(&b, "; slowest call under attack: %s", r.Slowest)
	}
	var ops []string
	for op := range r.Base {
		if !slices.Contains(checkedOps, op) {
			ops = append(ops, op)
		}
	}
	slices.Sort(ops)
	us := func(d time.Duration) string { return d.Round(time.Microsecond).String() }
	for _, op := range append(slices.Clone(checkedOps), ops...) {
		base, att := r.Base[op], r.Attack[op]
		if base.N == 0 {
			continue
		}
		fmt.Fprintf(&b, "; %s p50 %s → %s", op, us(base.P50), us(att.P50))
		if ratio, ok := r.Ratio[op]; ok {
			if c, ok := r.CPU[op]; ok {
				fmt.Fprintf(&b, " (×%.1f, bound %.0f; busy CPUs alone ×%.1f)", ratio, r.Bound, c)
			} else {
				fmt.Fprintf(&b, " (×%.1f, bound %.0f)", ratio, r.Bound)
			}
		}
		fmt.Fprintf(&b, ", p99 %s → %s", us(base.P99), us(att.P99))
	}
	return b.String()
}
