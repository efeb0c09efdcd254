package sidecar

import (
	"encoding/binary"
	"errors"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// The node tier's blocks in the pod's KV events (docs/kv-events.md, "The
// node tier"). One goroutine, off the engine's path, every
// nodeEventsInterval:
//
//  1. describes to the node the blocks of this pool that the node tier
//     holds: those whose description attached (the pool's event log,
//     followed with a cursor of its own) and those a write has just put
//     there (the client's OnStored), whichever came second; the node
//     answers "not held" or "described already" to the others;
//  2. reads each namespace's event log in the node tier from a cursor it
//     keeps (from the beginning again on a new epoch or Gone, rebuilding
//     the set), each read bounded by --node.io-timeout, and mirrors it into
//     the namespace's node set in the cache, which the connector reads as
//     part of the namespace's event log (sidecar/cache/nodeset.go).
//
// Only the namespaces of the Machine (its engines attached with them) are
// followed; every entry is checked against its namespace's digest width
// (Client.ReadEvents, and the cache's NodeStored).

const (
	nodeEventsInterval = 50 * time.Millisecond
	// nodeEventsBytes bounds the node sets' descriptions (DescCost each,
	// about 270 bytes for a 16-token block: some 250,000 blocks), the
	// node's own default bound (--pool.desc-bytes); blocks past it are
	// not announced (counted).
	nodeEventsBytes = 64 << 20
	// nodeReadsPerPoll bounds the reads of one namespace's log a poll
	// (of wire.MaxEvents entries each, at most one datagram); the last
	// one, empty, says it is read to its end.
	nodeReadsPerPoll = 8
	// nodeStoredQueue bounds the blocks written and waiting to be
	// described; past it they are dropped (counted).
	nodeStoredQueue = 4096
	// nodeDescribePerPoll bounds the descriptions sent a poll.
	nodeDescribePerPoll = 4096
)

// nodeEventStats are the follower's counts.
type nodeEventStats struct {
	Stored, Removed, Dropped, Rebuilds, ReadFailures atomic.Uint64
	Described, DescribeDropped                       atomic.Uint64
}

type storedBlock struct {
	fp [16]byte
	d  [wire.DigestSize]byte
}

// nodeFollow is the follower's state of one namespace.
type nodeFollow struct {
	ns         machine.L2Namespace
	epoch      uint64 // of the node process the cursor belongs to (0: none yet)
	cursor     uint64
	rebuilding bool         // reading from the beginning: NodeSweep once caught up
	pool       cache.Cursor // on the pool's event log
	poolValid  bool
}

type nodeFollower struct {
	s      *Server
	node   *node.Client
	met    nodeEventStats
	stored chan storedBlock
	nss    map[cache.NamespaceID]*nodeFollow
}

func newNodeFollower(s *Server) *nodeFollower {
	f := &nodeFollower{s: s, node: s.node, stored: make(chan storedBlock, nodeStoredQueue), nss: map[cache.NamespaceID]*nodeFollow{}}
	s.node.OnStored(func(fp [16]byte, d []byte) {
		b := storedBlock{fp: fp}
		copy(b.d[:], d)
		select {
		case f.stored <- b:
		default:
			f.met.DescribeDropped.Add(1)
		}
	})
	return f
}

func (f *nodeFollower) run() {
	defer f.s.wg.Done()
	t := time.NewTicker(nodeEventsInterval)
	defer t.Stop()
	for {
		select {
		case <-f.s.stop:
			return
		case <-t.C:
		}
		f.poll()
	}
}

// describeBatch is the descriptions of one namespace to send.
type describeBatch struct {
	ns      machine.L2Namespace
	entries []wire.Entry
}

func (f *nodeFollower) poll() {
	batches := f.collect()
	for _, b := range batches {
		for len(b.entries) > 0 {
			n := min(len(b.entries), wire.MaxItems)
			for _, st := range f.node.Describe(b.ns, b.entries[:n]) {
				if st == wire.OK {
					f.met.Described.Add(1)
				}
			}
			b.entries = b.entries[n:]
		}
	}
	f.s.mu.Lock()
	ids := make([]cache.NamespaceID, 0, len(f.nss))
	for id := range f.nss {
		ids = append(ids, id)
	}
	f.s.mu.Unlock()
	for _, id := range ids {
		f.follow(id)
	}
}

// collect, under the Machine's lock, updates the namespaces followed and
// gathers the descriptions to send: blocks of the pool described since the
// last poll, and blocks just written.
func (f *nodeFollower) collect() []describeBatch {
	s := f.s
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.m.Cache()
	seen := map[cache.NamespaceID]bool{}
	s.m.L2Namespaces(func(id cache.NamespaceID, ns machine.L2Namespace) {
		seen[id] = true
		if fl := f.nss[id]; fl == nil || fl.ns != ns {
			f.nss[id] = &nodeFollow{ns: ns}
		}
	})
	for id := range f.nss {
		if !seen[id] {
			delete(f.nss, id) // removed with its node set (RemoveNamespace)
		}
	}
	var out []describeBatch
	byFP := map[[16]byte]int{}
	batch := func(id cache.NamespaceID, fl *nodeFollow) *describeBatch {
		i, ok := byFP[fl.ns.FP]
		if !ok {
			i = len(out)
			byFP[fl.ns.FP] = i
			out = append(out, describeBatch{ns: fl.ns})
		}
		return &out[i]
	}
	left := nodeDescribePerPoll
	add := func(b *describeBatch, e *cache.DescEvent) {
		left--
		b.entries = append(b.entries, toEntry(e))
	}
	for id, fl := range f.nss {
		if left <= 0 {
			break
		}
		if !fl.poolValid {
			fl.pool, _ = c.EventTail(id)
			fl.poolValid = true
		}
		cur, err := c.EventsSince(id, fl.pool, left, 8192, func(e *cache.DescEvent) bool {
			if e.Op == cache.EventStored && !e.Node {
				add(batch(id, fl), e)
			}
			return true
		})
		if errors.Is(err, cache.ErrResync) {
			cur, err = c.EventHead(id)
		}
		if err == nil {
			fl.pool = cur
		}
	}
	for left > 0 {
		var b storedBlock
		select {
		case b = <-f.stored:
		default:
			left = 0
			continue
		}
		for id, fl := range f.nss {
			if fl.ns.FP == b.fp {
				c.PoolDescribed(id, b.d[:fl.ns.Width], func(e *cache.DescEvent) { add(batch(id, fl), e) })
				break
			}
		}
	}
	return out
}

// toEntry is a pool's description as the node's wire carries it.
func toEntry(e *cache.DescEvent) wire.Entry {
	w := wire.Entry{Op: wire.OpStored, HasParent: e.Parent != nil, Tokens: make([]uint32, len(e.Tokens)/4),
		Extra: append([]byte(nil), e.Extra...)}
	copy(w.Digest[:], e.Digest)
	copy(w.Parent[:], e.Parent)
	for i := range w.Tokens {
		w.Tokens[i] = binary.LittleEndian.Uint32(e.Tokens[4*i:])
	}
	return w
}

// follow reads namespace id's event log in the node tier, up to
// nodeReadsPerPoll reads, and mirrors it into the namespace's node set.
func (f *nodeFollower) follow(id cache.NamespaceID) {
	s := f.s
	s.mu.Lock()
	fl := f.nss[id]
	var ns machine.L2Namespace
	var epoch, cursor uint64
	if fl != nil {
		ns, epoch, cursor = fl.ns, fl.epoch, fl.cursor
	}
	s.mu.Unlock()
	if fl == nil {
		return
	}
	for r := 0; r < nodeReadsPerPoll; r++ {
		ev, ok := f.node.ReadEvents(ns, cursor, wire.MaxEvents)
		if !ok {
			f.met.ReadFailures.Add(1)
			return
		}
		restart := ev.Epoch != epoch || ev.Gone
		s.mu.Lock()
		if f.nss[id] != fl { // the namespace went meanwhile
			s.mu.Unlock()
			return
		}
		c := s.m.Cache()
		if restart && ev.Epoch != epoch && !ev.Gone && cursor != 0 {
			// Another node process: this cursor means nothing there.
			fl.epoch, fl.cursor = ev.Epoch, 0
			fl.rebuilding = true
			c.NodeRebuild(id)
			f.met.Rebuilds.Add(1)
			s.mu.Unlock()
			epoch, cursor = ev.Epoch, 0
			continue
		}
		if restart {
			c.NodeRebuild(id)
			fl.rebuilding = true
			if epoch != 0 || cursor != 0 {
				f.met.Rebuilds.Add(1)
			}
		}
		for i := range ev.Entries {
			e := &ev.Entries[i]
			d := e.Digest[:ns.Width]
			if e.Op == wire.OpStored {
				var parent []byte
				if e.HasParent {
					parent = e.Parent[:ns.Width]
				}
				added, full, err := c.NodeStored(id, d, parent, e.Tokens, e.Extra, nodeEventsBytes)
				switch {
				case err != nil || full:
					f.met.Dropped.Add(1)
				case added:
					f.met.Stored.Add(1)
				}
			} else if gone, _ := c.NodeRemoved(id, d); gone {
				f.met.Removed.Add(1)
			}
		}
		// A reply holds what fits one datagram, often fewer than asked:
		// only an empty one says the log is read to its end.
		caughtUp := len(ev.Entries) == 0
		if fl.rebuilding && caughtUp {
			if n, _ := c.NodeSweep(id); n > 0 {
				f.met.Removed.Add(uint64(n))
			}
			fl.rebuilding = false
		}
		fl.epoch, fl.cursor = ev.Epoch, ev.Next
		s.mu.Unlock()
		epoch, cursor = ev.Epoch, ev.Next
		if caughtUp {
			return
		}
	}
}
