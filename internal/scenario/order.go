package scenario

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Orderer is a driver whose scripts order what the sidecar does on its
// own, as raft's interaction tests deliver messages (the pure driver):
// time passes only at `tick`, and each node (a NodeOrderer) may hold its
// copies and the shared tier's work for the script to end.
type Orderer interface {
	// Tick moves every node's clock on by d and lets their deadlines
	// pass.
	Tick(d time.Duration) error
}

// NodeOrderer is a node of an Orderer.
type NodeOrderer interface {
	// HoldCopies keeps the copies the node's Machine asks for in flight
	// from now on (false: copies run at once again).
	HoldCopies(hold bool)
	// Copies lists the copies in flight, oldest first; EndCopies ends the
	// n oldest (fail: they fail) and returns them.
	Copies() []CopyInfo
	EndCopies(n int, fail bool) []CopyInfo
	// HoldTier keeps the shared tier's lookups, fetches and writes for
	// the script to deliver from now on.
	HoldTier()
	// Tier lists the tier's work held, oldest first.
	Tier() TierWork
	// DeliverLookups answers the n oldest lookups from the tier's values
	// (fail: as a tier that failed, holding nothing); DeliverFetches
	// fills the n oldest fetches' slots from them, fail(i) making block i
	// of each invalid; DeliverWrites writes the n oldest writes' values
	// (fail: the tier refused them, writing nothing).
	DeliverLookups(n int, fail bool) []TierItem
	DeliverFetches(n int, fail func(block int) bool) []TierItem
	DeliverWrites(n int, fail bool) []TierItem
	// Holding reports whether the node holds copies or the tier's work:
	// a request may then stay unanswered.
	Holding() bool
}

// CopyInfo is a copy in flight.
type CopyInfo struct {
	Session Session
	Store   bool // a store's copy (into the pool), else a load's
	Pages   []uint32
}

// TierWork is the shared tier's work a node holds.
type TierWork struct {
	Lookups, Fetches, Writes []TierItem
}

// TierItem is one lookup, fetch or write of the tier: its blocks (flat
// digests of Width bytes) and ranks and, once delivered, how it ended.
type TierItem struct {
	Digests      []byte
	Width, World int
	Found        int      // a lookup's leading blocks the tier held
	Outcomes     []string // a fetch's blocks: fetched, missing or failed
	Failed       bool     // a lookup the tier failed, a write it refused
}

// Parker is a Session whose requests may stay unanswered while its node
// holds copies or the tier's work (the pure driver's). The interpreter
// then runs each request on a goroutine of its own, which Park's function
// suspends until the reply has come (Arrived) and the script lets it go
// on.
type Parker interface {
	// Park sets what the session's transport calls when a request got no
	// reply at once (nil: such a request fails).
	Park(park func(seq uint64) ([]byte, error))
	// Arrived returns the reply to request seq if it has come (and hands
	// it over: the transport forgets it).
	Arrived(seq uint64) ([]byte, bool)
	// Ended reports that the session ended: no reply will come.
	Ended() bool
}

// errEnded is what a parked request gets when its session ends first.
var errEnded = errors.New("the session ended")

type result struct {
	out string
	err error
}

type waitFor struct {
	seq   uint64
	reply chan []byte
}

// parked is a request waiting for its reply.
type parked struct {
	line string
	s    *sess
	p    Parker
	park func(seq uint64) ([]byte, error)
	done chan result  // the command's output, once it ended
	wait chan waitFor // the request it waits for
	w    waitFor
}

// run runs a session command. Where its node holds copies or the tier's
// work, it runs on a goroutine: if its request gets no reply at once, the
// command prints "no reply yet" and its output comes later, after the
// command that let its reply come, as "reply to COMMAND: OUTPUT".
func (r *runner) run(s *sess, line string, f func() (string, error)) (string, error) {
	p, ok := s.s.(Parker)
	no, ook := s.node.n.(NodeOrderer)
	if !ok || !ook || !no.Holding() {
		return f()
	}
	pk := &parked{line: line, s: s, p: p, done: make(chan result, 1), wait: make(chan waitFor, 1)}
	pk.park = func(seq uint64) ([]byte, error) {
		w := waitFor{seq: seq, reply: make(chan []byte)}
		pk.wait <- w
		b, ok := <-w.reply
		if !ok {
			return nil, errEnded
		}
		return b, nil
	}
	p.Park(pk.park)
	go func() {
		ended := false
		defer func() {
			if !ended { // the test failed on this goroutine (runtime.Goexit)
				pk.done <- result{err: errors.New("the request's goroutine stopped")}
			}
		}()
		out, err := f()
		ended = true
		pk.done <- result{out, err}
	}()
	select {
	case res := <-pk.done:
		p.Park(nil)
		return res.out, res.err
	case pk.w = <-pk.wait:
		r.parked = append(r.parked, pk)
		return "no reply yet", nil
	}
}

// wake lets the parked requests whose replies came go on, oldest first,
// and returns their outputs; a request whose session ended prints "none".
func (r *runner) wake() (string, error) {
	var b strings.Builder
	for i := 0; i < len(r.parked); {
		pk := r.parked[i]
		reply, ok := pk.p.Arrived(pk.w.seq)
		switch {
		case ok:
			pk.p.Park(pk.park)
			pk.w.reply <- reply
		case pk.p.Ended():
			close(pk.w.reply)
		default:
			i++
			continue
		}
		select {
		case res := <-pk.done:
			pk.p.Park(nil)
			r.parked = append(r.parked[:i:i], r.parked[i+1:]...)
			switch {
			case errors.Is(res.err, errEnded):
				fmt.Fprintf(&b, "reply to %s: none, the session ended\n", pk.line)
			case res.err != nil:
				return "", fmt.Errorf("%s: %v", pk.line, res.err)
			default:
				fmt.Fprintf(&b, "reply to %s: %s\n", pk.line, strings.TrimSuffix(res.out, "\n"))
			}
			i = 0 // its end may have answered others
		case pk.w = <-pk.wait:
			i++
		}
	}
	return b.String(), nil
}

// abandonParked ends the goroutines of requests never answered.
func (r *runner) abandonParked() {
	for _, pk := range r.parked {
		close(pk.w.reply)
		<-pk.done
	}
}

func (r *runner) orderer(nd *node) (NodeOrderer, error) {
	no, ok := nd.n.(NodeOrderer)
	if !ok {
		return nil, fmt.Errorf("the %s driver does not let scripts order copies or the tier (run this file on the pure driver only)", r.d.Name())
	}
	return no, nil
}

// sessionName is the name of a driver's session (ended ones too).
func (r *runner) sessionName(s Session) string {
	for _, ss := range r.all {
		if ss.s == s {
			return ss.name
		}
	}
	return "?"
}

func (r *runner) nodeCommand(cmd string, a *args) (string, error) {
	if cmd == "tick" {
		o, ok := r.d.(Orderer)
		if !ok {
			return "", fmt.Errorf("the %s driver does not let scripts order time", r.d.Name())
		}
		ms, err := a.needNum("ms")
		if err != nil {
			return "", err
		}
		return "ok", o.Tick(time.Duration(ms) * time.Millisecond)
	}
	if cmd == "tier" && a.word(0) == "values" {
		n, err := r.d.TierValues()
		return fmt.Sprintf("values=%d", n), err
	}
	nd, err := r.nodeOf(a)
	if err != nil {
		return "", err
	}
	switch cmd {
	case "pool":
		p, err := nd.n.Pool()
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("blocks=%d pending=%d pinned=%d leases=%d loads=%d writers=%d used=%d free=%d",
			p.Blocks, p.Pending, p.Pinned, p.Leases, p.Loads, p.Writers, p.Used, p.Free), nil
	case "usage":
		u, err := nd.n.Usage()
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("sessions=%d meta-bytes=%d", u.Sessions, u.MetaBytes), nil
	case "counters":
		return r.counters(nd, a.has("machine"))
	case "copies":
		return r.copies(nd, a)
	case "tier":
		return r.tier(nd, a)
	}
	return "", fmt.Errorf("unknown command %q", cmd)
}

func (r *runner) counters(nd *node, machine bool) (string, error) {
	c, err := nd.n.Counters()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "stored-slots=%d evictions=%d evicted-unwritten=%d\n", c.StoredSlots, c.Evictions, c.EvictedUnwritten)
	if t := c.Tier; t != nil {
		fmt.Fprintf(&b, "tier lookups=%d lookup-blocks=%d lookup-hits=%d lookup-timeouts=%d\n",
			t.Lookups, t.LookupBlocks, t.LookupHits, t.LookupTimeouts)
		fmt.Fprintf(&b, "tier fetches=%d fetch-blocks=%d fetched=%d fetch-misses=%d fetch-timeouts=%d fetch-no-space=%d\n",
			t.Fetches, t.FetchBlocks, t.Fetched, t.FetchMisses, t.FetchTimeouts, t.FetchNoSpace)
		fmt.Fprintf(&b, "tier writes=%d writes-skipped=%d writes-refused=%d writing-slots=%d pending-lookups=%d pending-fetches=%d\n",
			t.Writes, t.WritesSkipped, t.WritesRefused, t.WritingSlots, t.PendingLookups, t.PendingFetches)
	}
	if machine {
		m := c.Machine
		if m == nil {
			return "", fmt.Errorf("counters machine: the %s driver cannot see the Machine's counters", r.d.Name())
		}
		fmt.Fprintf(&b, "machine discarded-ended-stores=%d discarded-exited-stores=%d doomed-writes=%d\n",
			m.DiscardedEndedStores, m.DiscardedExitedStores, m.DoomedWrites)
	}
	return b.String(), nil
}

func (r *runner) copyLines(cs []CopyInfo, suffix string) string {
	if len(cs) == 0 {
		return "none"
	}
	var b strings.Builder
	for _, c := range cs {
		what := "load"
		if c.Store {
			what = "store"
		}
		fmt.Fprintf(&b, "%s s=%s pages=%s%s\n", what, r.sessionName(c.Session), pageSpec(c.Pages), suffix)
	}
	return b.String()
}

// pageSpec prints a page list as PageList parses it.
func pageSpec(pages []uint32) string {
	var items []string
	for i := 0; i < len(pages); {
		j := i
		for j+1 < len(pages) && pages[j+1] == pages[j]+1 {
			j++
		}
		if j > i {
			items = append(items, fmt.Sprintf("%d-%d", pages[i], pages[j]))
		} else {
			items = append(items, fmt.Sprint(pages[i]))
		}
		i = j + 1
	}
	return strings.Join(items, ",")
}

// copies: `copies` lists the copies in flight, `copies hold` holds them,
// `copies release [n=N] [fail]` ends them.
func (r *runner) copies(nd *node, a *args) (string, error) {
	no, err := r.orderer(nd)
	if err != nil {
		return "", err
	}
	switch a.word(0) {
	case "":
		return r.copyLines(no.Copies(), ""), nil
	case "hold":
		no.HoldCopies(true)
		return "ok", nil
	case "release":
		n, err := a.num("n", 0)
		if err != nil {
			return "", err
		}
		fail := a.has("fail")
		held := no.Copies()
		if n == 0 {
			n = uint64(len(held))
		}
		if int(n) > len(held) {
			return "", fmt.Errorf("n=%d: %d copies in flight", n, len(held))
		}
		suffix := ": done"
		if fail {
			suffix = ": failed"
		}
		var ended []CopyInfo
		if n > 0 {
			ended = no.EndCopies(int(n), fail)
		}
		if !a.has("n") {
			no.HoldCopies(false)
		}
		return r.copyLines(ended, suffix), nil
	}
	return "", errors.New("copies: hold, release, or nothing")
}

func (r *runner) tierLine(kind string, it TierItem) string {
	s := kind + " " + r.digestNames(it.Digests, it.Width)
	if it.World > 1 {
		s += fmt.Sprintf(" ranks=%d", it.World)
	}
	return s
}

// tier: `tier` lists the work held, `tier hold` holds it, `tier deliver
// lookups|fetches|writes [n=N] [fail[=BLOCKS]]` delivers it.
func (r *runner) tier(nd *node, a *args) (string, error) {
	if nd.cfg.Tier == nil {
		return "", errors.New("the node has no tier (sidecar ... tier=on)")
	}
	no, err := r.orderer(nd)
	if err != nil {
		return "", err
	}
	switch a.word(0) {
	case "":
		w := no.Tier()
		var b strings.Builder
		for _, it := range w.Lookups {
			fmt.Fprintf(&b, "%s\n", r.tierLine("lookup", it))
		}
		for _, it := range w.Fetches {
			fmt.Fprintf(&b, "%s\n", r.tierLine("fetch", it))
		}
		for _, it := range w.Writes {
			fmt.Fprintf(&b, "%s\n", r.tierLine("write", it))
		}
		if b.Len() == 0 {
			return "none", nil
		}
		return b.String(), nil
	case "hold":
		no.HoldTier()
		return "ok", nil
	case "deliver":
	default:
		return "", errors.New("tier: hold, deliver, values, or nothing")
	}
	kind := a.word(1)
	w := no.Tier()
	held := map[string]int{"lookups": len(w.Lookups), "fetches": len(w.Fetches), "writes": len(w.Writes)}
	have, ok := held[kind]
	if !ok {
		return "", errors.New("tier deliver: lookups, fetches or writes")
	}
	n, err := a.num("n", uint64(have))
	if err != nil {
		return "", err
	}
	if int(n) > have || n == 0 {
		return "", fmt.Errorf("tier deliver %s n=%d: %d held", kind, n, have)
	}
	var b strings.Builder
	switch kind {
	case "lookups":
		for _, it := range no.DeliverLookups(int(n), a.has("fail")) {
			if it.Failed {
				fmt.Fprintf(&b, "%s: failed\n", r.tierLine("lookup", it))
			} else {
				fmt.Fprintf(&b, "%s: found=%d\n", r.tierLine("lookup", it), it.Found)
			}
		}
	case "fetches":
		var fail func(int) bool
		if a.has("fail") {
			spec := a.str("fail", "")
			blocks, err := PageList(spec)
			if err != nil {
				return "", fmt.Errorf("fail=%s: block positions", spec)
			}
			fail = func(i int) bool {
				if spec == "" {
					return true
				}
				for _, x := range blocks {
					if int(x) == i {
						return true
					}
				}
				return false
			}
		}
		for _, it := range no.DeliverFetches(int(n), fail) {
			fmt.Fprintf(&b, "%s:", r.tierLine("fetch", it))
			for _, o := range []string{"fetched", "missing", "failed"} {
				var flat []byte
				for i, got := range it.Outcomes {
					if got == o {
						flat = append(flat, it.Digests[i*it.Width:(i+1)*it.Width]...)
					}
				}
				if len(flat) > 0 {
					fmt.Fprintf(&b, " %s=%s", o, r.digestNames(flat, it.Width))
				}
			}
			b.WriteString("\n")
		}
	case "writes":
		for _, it := range no.DeliverWrites(int(n), a.has("fail")) {
			res := "written"
			if it.Failed {
				res = "refused"
			}
			fmt.Fprintf(&b, "%s: %s\n", r.tierLine("write", it), res)
		}
	}
	return b.String(), nil
}
