package replay

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/schema"
)

// maxHashesPerRecord bounds one PutHashes record (128 KiB of digests),
// well inside a ring's largest record at the default ring capacity.
const maxHashesPerRecord = 4096

const regionID = 1

// engine is one simulated engine instance: one session (over the rings or
// over the socket relay), its own KV memory (a shared-memory file mapped
// here, registered as a host region) and its own view of the cache, kept by
// the change log.
type engine struct {
	id        int
	rpc       rpc
	w         *Workload
	mem       *shm.Mapping
	region    []byte
	pageBytes int
	walk      bool
	prefill   float64 // tokens per second; 0: no modelled prefill
	batch     uint64

	// change-log consumer
	cursorEpoch, cursorSeq uint64
	view                   blockView
	resyncs                int
	walkBuf                []byte
	walkTotal              time.Duration

	// hints: send each request's retention hint (hintOf) after its store.
	hints bool
	pace  float64

	// beforeRelease, when set, runs after the store and before the
	// release (a sequential run with the tier waits for its writes).
	beforeRelease func() error

	h     hists
	st    runCounts
	steps []stepSample
	dig   []byte
	pages []uint32
}

// runCounts are a run's page counts, as the sidecar answered them.
type runCounts struct {
	Requests      int64
	TotalPages    int64
	HitPages      int64 // Lookup answers
	LoadedPages   int64 // pages copied into engine memory
	StoredPages   int64
	PresentPages  int64
	SkippedPages  int64
	MissedLeases  int64 // leases resolved as a miss before the load
	VerifiedPages int64 // loaded pages whose bytes were checked
	// With --hints: Retain records sent, the blocks they retained, and
	// the session ends sent and the retentions they ended.
	Retains, RetainedPages, Ends, EndedPages int64
}

func (c *runCounts) add(o runCounts) {
	c.Requests += o.Requests
	c.TotalPages += o.TotalPages
	c.HitPages += o.HitPages
	c.LoadedPages += o.LoadedPages
	c.StoredPages += o.StoredPages
	c.PresentPages += o.PresentPages
	c.SkippedPages += o.SkippedPages
	c.MissedLeases += o.MissedLeases
	c.VerifiedPages += o.VerifiedPages
	c.Retains += o.Retains
	c.RetainedPages += o.RetainedPages
	c.Ends += o.Ends
	c.EndedPages += o.EndedPages
}

// MaxHintTTL is the longest retention the replay asks for: the sidecar's
// default --retain.max-ttl (a longer one is refused).
const MaxHintTTL = time.Hour

// hintOf maps a request's retention hint (RequestMeta) to a Retain: a
// request of priority -1 (a one-off, the scan's) sends nothing; a
// session's last request (SessionEnd) ends the retentions on its prefix;
// a request with RetainSec > 0 retains its prefix at retention priority
// Priority (0..3) for RetainSec of trace time: RetainSec / pace real
// seconds when paced, RetainSec real seconds when not (the replay then
// runs faster than the trace, so a hint outlives the gap it covers),
// at most MaxHintTTL. send is false when there is nothing to send.
func hintOf(m RequestMeta, pace float64) (ttl time.Duration, prio uint8, end, send bool) {
	switch {
	case m.Priority < 0:
		return 0, 0, false, false
	case m.SessionEnd:
		return 0, 0, true, true
	case m.RetainSec > 0:
		sec := m.RetainSec
		if pace > 0 {
			sec /= pace
		}
		ttl = min(MaxHintTTL, max(time.Millisecond, time.Duration(sec*float64(time.Second))))
		return ttl, uint8(min(m.Priority, schema.MaxRetainPriority)), false, true
	}
	return 0, 0, false, false
}

// stepSample is one engine step's metadata cost.
type stepSample struct {
	Request int     // index in the workload
	AtSec   float64 // since the run started
	Engine  int
	DeltaNs int64
	WalkNs  int64 // 0 when the walk is off
	Changes int   // change-log entries read
	Blocks  int   // blocks in the engine's view (what a walk visits)
}

// blockView is an engine's copy of the set of present blocks: the digests
// in a dense array and a hash index into it, keyed by the digest's first 8
// bytes (sha256 digests: a collision among the trace's few million pages
// is vanishingly unlikely, and it would only blur the view, never the
// cache).
type blockView struct {
	idx  map[uint64]int32
	keys [][DigestWidth]byte
}

func viewKey(d []byte) uint64 { return binary.LittleEndian.Uint64(d) }

func (v *blockView) add(d []byte) {
	k := viewKey(d)
	if _, ok := v.idx[k]; ok {
		return
	}
	v.idx[k] = int32(len(v.keys))
	var full [DigestWidth]byte
	copy(full[:], d)
	v.keys = append(v.keys, full)
}

func (v *blockView) remove(d []byte) {
	k := viewKey(d)
	i, ok := v.idx[k]
	if !ok {
		return
	}
	last := v.keys[len(v.keys)-1]
	v.keys[i] = last
	v.idx[viewKey(last[:])] = i
	v.keys = v.keys[:len(v.keys)-1]
	delete(v.idx, k)
}

func (v *blockView) reset() {
	v.idx = map[uint64]int32{}
	v.keys = v.keys[:0]
}

// syncDelta catches up with the change log (the delta method) and returns
// the entries read.
func (e *engine) syncDelta() (int, error) {
	n := 0
	for {
		rep, err := e.rpc.changes(e.cursorEpoch, e.cursorSeq)
		if err != nil {
			return n, err
		}
		if rep.Resync {
			// A new consumer starts at the head (an empty view is right
			// only for an empty cache: the first call of a run); a later
			// resync means the log overran this engine's cursor.
			if e.cursorEpoch != 0 {
				e.resyncs++
			}
			e.view.reset()
		}
		for i := 0; i < rep.Len(); i++ {
			op, d := rep.ChangeAt(i)
			switch op {
			case schema.OpStored:
				e.view.add(d)
			case schema.OpEvicted:
				e.view.remove(d)
			case schema.OpCleared:
				e.view.reset()
			}
		}
		n += rep.Len()
		e.cursorEpoch, e.cursorSeq = rep.Epoch, rep.Next
		if rep.Len() < schema.MaxChangesPerReply && !rep.Resync {
			return n, nil
		}
		if rep.Resync && rep.Len() == 0 {
			return n, nil
		}
	}
}

// walkView is the walk method: every block of the view is visited in its
// index (a hash table, as the sidecar's is) and its digest copied into the
// step's metadata, as a connector does that rebuilds its per-step view
// from the whole cache.
func (e *engine) walkView() int {
	b := e.walkBuf[:0]
	for _, i := range e.view.idx {
		b = append(b, e.view.keys[i][:]...)
	}
	e.walkBuf = b
	return len(e.view.idx)
}

// walkDue reports whether this step walks: always, unless the walks so far
// took more than walkShare of the replay's time (at very large caches a
// walk per step would dominate the run; the steps without one are
// recorded with walk_ns 0).
func (e *engine) walkDue(runStart time.Time) bool {
	return e.walk && float64(e.walkTotal) <= walkShare*float64(time.Since(runStart))
}

// walkShare bounds the walk baseline's share of a run's time.
const walkShare = 0.10

func (e *engine) timed(op string, t0 time.Time) int64 {
	ns := int64(time.Since(t0))
	e.h.record(op, ns)
	return ns
}

// stamp writes page p's id into the first bytes of region page i, so that
// a later load of p can be checked.
func (e *engine) stamp(i int, p uint32) {
	binary.LittleEndian.PutUint64(e.region[i*e.pageBytes:], uint64(p)+1)
}

func (e *engine) stampOf(i int) uint64 {
	return binary.LittleEndian.Uint64(e.region[i*e.pageBytes:])
}

// step runs one engine step for request idx: the per-step metadata
// (delta, and the walk baseline), then the request's connector calls:
// register its hashes, look up, acquire (and poll until ready), load the
// hit prefix into engine memory, model the prefill, store the missed
// pages, release, drop the hashes.
func (e *engine) step(idx int, runStart time.Time) error {
	req := &e.w.Requests[idx]
	n := len(req.Pages)
	e.st.Requests++
	e.st.TotalPages += int64(n)
	at := time.Since(runStart).Seconds()

	t0 := time.Now()
	changes, err := e.syncDelta()
	if err != nil {
		return fmt.Errorf("changes: %w", err)
	}
	s := stepSample{Request: idx, AtSec: at, Engine: e.id, Changes: changes, Blocks: len(e.view.keys)}
	s.DeltaNs = e.timed(stepOp, t0)
	if e.walkDue(runStart) {
		t0 = time.Now()
		e.walkView()
		s.WalkNs = e.timed(walkOp, t0)
		e.walkTotal += time.Duration(s.WalkNs)
	}
	e.steps = append(e.steps, s)
	if n == 0 {
		return nil
	}
	var total int64

	e.batch++
	batch := e.batch
	e.dig = e.w.AppendDigests(e.dig[:0], req.Pages)
	t0 = time.Now()
	for first := 0; first < n; first += maxHashesPerRecord {
		end := min(n, first+maxHashesPerRecord)
		if err := e.rpc.putHashes(batch, e.dig[first*DigestWidth:end*DigestWidth], first > 0); err != nil {
			return fmt.Errorf("put hashes: %w", err)
		}
	}
	total += e.timed("hashes", t0)

	t0 = time.Now()
	h, err := e.rpc.lookup(schema.View{Batch: batch, Count: uint32(n)})
	if err != nil {
		return fmt.Errorf("lookup: %w", err)
	}
	total += e.timed("lookup", t0)
	e.st.HitPages += int64(h)

	var lease uint64
	loaded := 0
	if h > 0 {
		t0 = time.Now()
		l, err := e.rpc.acquire(schema.View{Batch: batch, Count: uint32(h)}, 0)
		for err == nil && l.State == schema.StateWaiting {
			l, err = e.rpc.poll(l.Lease)
		}
		if err != nil {
			return fmt.Errorf("acquire: %w", err)
		}
		total += e.timed("acquire", t0)
		lease = l.Lease
		if l.State == schema.StateMiss {
			e.st.MissedLeases++
		} else if l.Blocks > 0 {
			loaded = int(l.Blocks)
			e.pages = e.pages[:0]
			for i := 0; i < loaded; i++ {
				e.stamp(i, ^uint32(0)) // anything but the page's own stamp
				e.pages = append(e.pages, uint32(i))
			}
			t0 = time.Now()
			got, err := e.rpc.load(lease, regionID, 0, e.pages)
			if err != nil {
				return fmt.Errorf("load %d pages: %w", loaded, err)
			}
			total += e.timed("load", t0)
			if got != loaded {
				return fmt.Errorf("load: %d of %d pages", got, loaded)
			}
			for i := 0; i < loaded; i++ {
				if e.stampOf(i) != uint64(req.Pages[i])+1 {
					return fmt.Errorf("request %d: loaded page %d holds the bytes of page %d, want %d", idx, i, int64(e.stampOf(i))-1, req.Pages[i])
				}
			}
			e.st.LoadedPages += int64(loaded)
			e.st.VerifiedPages += int64(loaded)
		}
	}

	if e.prefill > 0 && n > loaded {
		time.Sleep(time.Duration(float64((n-loaded)*e.w.PageTokens) / e.prefill * 1e9))
	}

	// The engine recomputes what it did not load and stores it: from the
	// lookup's answer on, or from what the lease held if that is less (a
	// fetch from the tier may bring fewer blocks than the lookup found).
	from := h
	if h > 0 {
		from = loaded
	}
	if n > from {
		e.pages = e.pages[:0]
		for i := from; i < n; i++ {
			e.stamp(i, req.Pages[i])
			e.pages = append(e.pages, uint32(i))
		}
		t0 = time.Now()
		r, err := e.rpc.store(schema.View{Batch: batch, Start: uint32(from), Count: uint32(n - from)}, regionID, e.pages)
		if err != nil {
			return fmt.Errorf("store %d pages: %w", n-h, err)
		}
		total += e.timed("store", t0)
		e.st.StoredPages += int64(r.Stored)
		e.st.PresentPages += int64(r.Present)
		e.st.SkippedPages += int64(r.Skipped)
	}

	if e.beforeRelease != nil {
		if err := e.beforeRelease(); err != nil {
			return err
		}
	}
	if lease != 0 {
		t0 = time.Now()
		if err := e.rpc.release(lease); err != nil {
			return fmt.Errorf("release: %w", err)
		}
		total += e.timed("release", t0)
	}
	if e.hints {
		if ttl, prio, end, send := hintOf(req.RequestMeta, e.pace); send {
			t0 = time.Now()
			got, err := e.rpc.retain(schema.View{Batch: batch, Count: uint32(n)}, ttl, prio, end)
			if err != nil {
				return fmt.Errorf("retain: %w", err)
			}
			total += e.timed("retain", t0)
			if end {
				e.st.Ends++
				e.st.EndedPages += int64(got)
			} else {
				e.st.Retains++
				e.st.RetainedPages += int64(got)
			}
		}
	}
	t0 = time.Now()
	if err := e.rpc.dropHashes(batch); err != nil {
		return fmt.Errorf("drop hashes: %w", err)
	}
	total += int64(time.Since(t0))
	e.h.record("request", total)
	return nil
}
