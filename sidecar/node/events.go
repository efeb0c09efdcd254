package node

import (
	"sort"

	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// The node's block descriptions and event logs (docs/kv-events.md, "The
// node tier"): what each pod's sidecar needs to announce the node tier's
// blocks in its engine's KV events.
//
// A description (wire.Describe) is accepted for a block whose every rank
// the node holds, from a connection that registered its namespace; the
// first one wins. It goes when any rank of the block leaves the pool. Each
// namespace with descriptions has an event log: stored when a description
// is accepted, removed when it goes. Readers keep their cursors themselves
// (the node keeps nothing per reader); the log keeps the stored entries of
// the blocks described now and the latest removals, and is compacted when
// the removals outnumber the blocks described (at least 1,024): a reader
// whose cursor is older than the compaction is told Gone and reads again
// from the beginning. Every sequence number is unique in the process, so a
// cursor never names an entry of another namespace or of a log made again.
// The caller holds Server.mu around every method.

type descRec struct {
	seq  uint64
	e    wire.Entry
	cost int64
}

type logEntry struct {
	seq    uint64
	op     uint8
	digest string
}

type nsLog struct {
	descs    map[string]*descRec // by digest (the namespace's width)
	log      []logEntry
	horizon  uint64 // a cursor in (0, horizon) is Gone
	removals int
}

type events struct {
	byNS    map[[16]byte]*nsLog
	seq     uint64 // the last sequence number given
	bytes   int64  // descriptions' cost, all namespaces
	limit   int64
	refused uint64 // descriptions refused for the bound
}

func newEvents(limit int64) *events {
	return &events{byNS: map[[16]byte]*nsLog{}, limit: limit}
}

// descCost is what a description is charged: its bytes and a record.
func descCost(e *wire.Entry) int64 { return 160 + int64(4*len(e.Tokens)+len(e.Extra)) }

// describe attaches e to digest d of namespace fp, which the caller found
// present at every rank.
func (v *events) describe(fp [16]byte, d string, e wire.Entry) wire.Status {
	l := v.byNS[fp]
	if l != nil && l.descs[d] != nil {
		return wire.Exists
	}
	c := descCost(&e)
	if v.bytes+c > v.limit {
		v.refused++
		return wire.Limit
	}
	if l == nil {
		l = &nsLog{descs: map[string]*descRec{}, horizon: v.seq + 1}
		v.byNS[fp] = l
	}
	v.seq++
	l.descs[d] = &descRec{seq: v.seq, e: e, cost: c}
	l.log = append(l.log, logEntry{seq: v.seq, op: wire.OpStored, digest: d})
	v.bytes += c
	return wire.OK
}

// removed is told that a value of namespace fp's digest d left the pool.
func (v *events) removed(fp [16]byte, d string) {
	l := v.byNS[fp]
	if l == nil || l.descs[d] == nil {
		return
	}
	v.bytes -= l.descs[d].cost
	delete(l.descs, d)
	v.seq++
	l.log = append(l.log, logEntry{seq: v.seq, op: wire.OpRemoved, digest: d})
	l.removals++
	if l.removals > max(1024, len(l.descs)) {
		v.compact(fp, l)
	}
}

// compact keeps the stored entries of the blocks described now.
func (v *events) compact(fp [16]byte, l *nsLog) {
	kept := l.log[:0]
	for _, e := range l.log {
		if r := l.descs[e.digest]; e.op == wire.OpStored && r != nil && r.seq == e.seq {
			kept = append(kept, e)
		} else {
			l.horizon = max(l.horizon, e.seq+1)
		}
	}
	clear(l.log[len(kept):])
	l.log, l.removals = kept, 0
	if len(l.log) == 0 && len(l.descs) == 0 {
		delete(v.byNS, fp)
	}
}

// read returns the entries of fp's log from cursor on, at most max of them
// and at most room encoded bytes, and the cursor to read from next. A
// cursor older than the log keeps, past its end, or of a log forgotten
// since (a namespace without descriptions has none) is Gone: the entries
// then start at the beginning.
func (v *events) read(fp [16]byte, width int, cursor uint64, maxN, room int) wire.EventsReply {
	l := v.byNS[fp]
	rep := wire.EventsReply{Status: wire.OK}
	if cursor > 0 && (l == nil || cursor < l.horizon || cursor > v.seq+1) {
		rep.Status, cursor = wire.Gone, 0
	}
	if l == nil {
		return rep // Next 0: a log made later is read from its beginning
	}
	rep.Next = v.seq + 1
	i := sort.Search(len(l.log), func(i int) bool { return l.log[i].seq >= cursor })
	for ; i < len(l.log) && len(rep.Entries) < maxN; i++ {
		le := l.log[i]
		e := wire.Entry{Op: le.op}
		if le.op == wire.OpStored {
			r := l.descs[le.digest]
			if r == nil || r.seq != le.seq {
				continue // gone since: its removal follows
			}
			e = r.e
		}
		copy(e.Digest[:width], le.digest)
		if room -= e.Size(); room < 0 {
			break
		}
		rep.Entries = append(rep.Entries, e)
	}
	if i < len(l.log) {
		rep.Next = l.log[i].seq
	}
	return rep
}

// stats: descriptions, their bytes, log entries.
func (v *events) stats() (descs int, bytes int64, entries int) {
	for _, l := range v.byNS {
		descs += len(l.descs)
		entries += len(l.log)
	}
	return descs, v.bytes, entries
}
