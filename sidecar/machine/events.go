package machine

import (
	"errors"

	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// KV events (docs/protocol.md, sections 5.11 to 5.13): a session describes
// the blocks its engine stores (Describe), and a scheduler reads its
// namespace's event log (Events) or a page of its described present blocks
// (EventSnapshot) to announce them in its engine's own event stream. The
// descriptions live in the cache (sidecar/cache/meta.go) as long as their
// blocks, charged to the describing session and its uid under the
// metadata bounds (chargeMeta counts them).

// eventsScan bounds the event-log entries one Events reply reads (entries
// of blocks that left since are read and left out).
const eventsScan = 8192

// describe records the descriptions of a Describe. The whole record is
// refused (status 7) when its descriptions, counted as if none of its
// blocks were described yet, would take the session, its uid or the
// sidecar past the metadata bounds. The Reply's value is the number of
// descriptions added.
func (h *handler) describe(p []byte) error {
	m, s, in := h.m, h.s, h.s.inst
	var r schema.Describe
	if err := r.Decode(p, in.width); err != nil {
		return malformed(err)
	}
	var cost int64
	for i := range r.Runs {
		run := &r.Runs[i]
		cost += int64(run.Blocks(in.width)) * cache.DescCost(in.width, int(run.TokensPerBlock), len(run.Extra), true)
	}
	if err := m.metaRoom(s, s.uid, cost); err != nil {
		return err
	}
	added := 0
	for i := range r.Runs {
		run := &r.Runs[i]
		n, err := m.cache.Describe(in.ns.id, run.Parent, run.Digests, run.Tokens, int(run.TokensPerBlock), run.Extra, s.uid+1, s.owner, h.now)
		if err != nil {
			return internal(err)
		}
		added += n
	}
	m.st.Described += uint64(added)
	h.ok(uint64(added))
	return nil
}

// eventWriter fills an EventsReply's entries within a payload bound.
type eventWriter struct {
	m     *Machine
	room  int
	limit int
	buf   []byte
	count int
}

// add appends e, or reports that it does not fit. An event larger than a
// whole reply can never be sent: it is left out (counted) and consumed.
func (w *eventWriter) add(e *cache.DescEvent) bool {
	if w.count >= w.limit {
		return false
	}
	ev := schema.Event{Op: uint8(e.Op), Digest: e.Digest, Parent: e.Parent, Tokens: e.Tokens, Extra: e.Extra}
	size := schema.EventSize(len(e.Digest), len(e.Tokens)/4, len(e.Extra), e.Parent != nil)
	if size > w.room {
		w.m.st.EventsTooLarge++
		return true
	}
	if len(w.buf)+size > w.room {
		return false
	}
	w.buf = schema.AppendEvent(w.buf, &ev)
	w.count++
	return true
}

func (h *handler) eventWriter(maxEntries uint32) *eventWriter {
	limit := schema.MaxEventsPerReply
	if maxEntries != 0 {
		limit = min(limit, int(maxEntries))
	}
	return &eventWriter{m: h.m, room: h.s.maxPayload - schema.EventsReplyHeaderSize, limit: limit}
}

// events answers Events (a Changes record): the namespace's events from
// the cursor on, as many as fit the completion ring's largest payload.
// The cursor (0, 0), or one that cannot be continued, is answered with the
// log's head and resync set, like Changes.
func (h *handler) events(p []byte) error {
	m, s := h.m, h.s
	var r schema.Changes
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	ns := s.inst.ns.id
	rep := schema.EventsReply{Width: uint8(s.inst.width)}
	ew := h.eventWriter(r.Max)
	var cur cache.Cursor
	var err error
	if r.Epoch == 0 && r.Seq == 0 {
		cur, err = m.cache.EventHead(ns)
		rep.Resync = true
	} else {
		cur, err = m.cache.EventsSince(ns, cache.Cursor{Epoch: r.Epoch, Seq: r.Seq}, ew.limit, eventsScan, ew.add)
		if errors.Is(err, cache.ErrResync) {
			cur, err = m.cache.EventHead(ns)
			rep.Resync = true
			ew.buf, ew.count = nil, 0
		}
	}
	if err != nil {
		return internal(err)
	}
	rep.Epoch, rep.Seq, rep.Count, rep.Entries = cur.Epoch, cur.Seq, ew.count, ew.buf
	h.out.reply(s.id, h.typ, h.seq, rep.Append)
	return nil
}

// eventSnapshot answers EventSnapshot (a Snapshot record): a page of the
// namespace's present, described blocks, with the event log's head cursor
// when it was read. Refused to workers, like Snapshot.
func (h *handler) eventSnapshot(p []byte) error {
	m, s := h.m, h.s
	if s.role == schema.RoleWorker {
		return schema.Errorf(schema.ErrCodeNotPermitted, "EventSnapshot is for scheduler and client sessions, not workers")
	}
	var r schema.Snapshot
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	ew := h.eventWriter(r.Max)
	cur, next, done, err := m.cache.EventSnapshotPage(s.inst.ns.id, r.From, m.cfg.SnapshotScan, ew.add)
	if err != nil {
		return internal(err)
	}
	rep := schema.EventsReply{Done: done, Epoch: cur.Epoch, Seq: cur.Seq, Next: next, Width: uint8(s.inst.width),
		Count: ew.count, Entries: ew.buf}
	h.out.reply(s.id, h.typ, h.seq, rep.Append)
	return nil
}

// metaRoom reports whether n more metadata bytes fit the session's, its
// uid's and the sidecar's bounds (block descriptions included), refusing
// them with status 7 naming the limit; it charges nothing.
func (m *Machine) metaRoom(s *session, uid uint32, n int64) *schema.Error {
	var umeta int64
	if u := m.uids[uid]; u != nil {
		umeta = u.meta
	}
	switch {
	case m.total.meta+m.cache.DescBytes()+n > m.cfg.MetaBytes:
		return m.refuse("metadata", "the sidecar's metadata would exceed %d bytes (--limits.metadata-bytes): release leases, drop hash batches, or retry later", m.cfg.MetaBytes)
	case umeta+m.cache.DescCharged(uid+1)+n > share(m.cfg.MetaBytes, m.cfg.UIDShare):
		return m.refuse("metadata-uid", "uid %d's metadata would exceed %d bytes, its share of --limits.metadata-bytes", uid, share(m.cfg.MetaBytes, m.cfg.UIDShare))
	case s != nil && s.use.meta+m.cache.DescOwned(s.owner)+n > share(m.cfg.MetaBytes, m.cfg.SessionShare):
		return m.refuse("metadata-session", "this session's metadata would exceed %d bytes, its share of --limits.metadata-bytes", share(m.cfg.MetaBytes, m.cfg.SessionShare))
	}
	return nil
}
