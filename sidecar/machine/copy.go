package machine

import (
	"errors"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// startCopy charges a copy's record to the session and registers it.
func (h *handler) startCopy(dir gpu.Direction, r *region, pages []uint32, offsets []uint64) (*copyOp, error) {
	m, s := h.m, h.s
	meta := int64(copyMeta + 12*len(pages))
	if err := m.chargeMeta(s, s.uid, meta); err != nil {
		return nil, err
	}
	s.copyMeta += meta
	m.nextCopy++
	op := &copyOp{id: m.nextCopy, sess: s, uid: s.uid, typ: h.typ, seq: h.seq, dir: dir, meta: meta, pages: len(pages)}
	m.copies[op.id] = op
	m.st.CopiesStarted++
	c := Copy{ID: op.id, Session: s.id, Dir: dir, Region: r.handle, PageBytes: r.pageBytes,
		Pages: append([]uint32(nil), pages...), PoolOffsets: offsets}
	h.out.Copies = append(h.out.Copies, c)
	return op, nil
}

// regionFor checks a region and the page indices a request names in it.
func (h *handler) regionFor(id uint32, pages []uint32) (*region, error) {
	r, ok := h.s.regions[id]
	if !ok || r.pending {
		return nil, schema.Errorf(schema.ErrCodeUnknownRegion, "region %d", id)
	}
	// Every page is checked, also those of blocks that turn out present
	// and are not copied: a bad index is a client bug to report.
	for _, p := range pages {
		if p >= r.pages {
			return nil, schema.Errorf(schema.ErrCodeOutOfRange, "page %d past the %d pages of region %d", p, r.pages, id)
		}
	}
	return r, nil
}

func (h *handler) load(p []byte) error {
	m, s := h.m, h.s
	var r schema.Load
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	q, err := h.query(r.Lease)
	if err != nil {
		return err
	}
	switch q.state {
	case schema.StateReady, schema.StateLoading, schema.StateLoaded:
	case schema.StateMiss:
		return schema.Errorf(schema.ErrCodeExpired, "lease %d expired: recompute", r.Lease)
	default:
		return schema.Errorf(schema.ErrCodeBadState, "lease %d is %s: poll until ready", r.Lease, q.state)
	}
	rg, err := h.regionFor(r.Region, r.Pages)
	if err != nil {
		return err
	}
	if uint64(r.First)+uint64(len(r.Pages)) > uint64(q.blocks) {
		return schema.Errorf(schema.ErrCodeOutOfRange, "blocks [%d, %d) past the %d blocks of lease %d", r.First, uint64(r.First)+uint64(len(r.Pages)), q.blocks, r.Lease)
	}
	if len(r.Pages) == 0 {
		h.ok(0)
		return nil
	}
	// The copy's own pin: the blocks stay put until CopyDone, whatever
	// happens to the lease meanwhile.
	id, slots, err := m.cache.BeginLoad(r.Lease, s.rank, int(r.First), len(r.Pages), nil)
	if err != nil {
		return schema.Errorf(schema.ErrCodeExpired, "%v", err)
	}
	offsets := make([]uint64, len(slots))
	for i, sl := range slots {
		offsets[i] = uint64(sl) * m.cfg.SlotBytes
	}
	op, err := h.startCopy(gpu.PoolToEngine, rg, r.Pages, offsets)
	if err != nil {
		m.cache.EndLoad(id)
		return err
	}
	op.q, op.load = q, id
	m.cache.Renew(r.Lease, m.cfg.LeaseTTL, h.now)
	q.loading++
	q.state = schema.StateLoading
	return nil
}

func (h *handler) store(p []byte) error {
	m, s, in := h.m, h.s, h.s.inst
	var r schema.Store
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	rg, err := h.regionFor(r.Region, r.Pages)
	if err != nil {
		return err
	}
	d, err := h.view(r.View)
	if err != nil {
		return err
	}
	w := in.width
	var rep schema.StoreReply
	var tickets []cache.Ticket
	var pages []uint32
	var offsets []uint64
	ch := cache.Charge{Key: s.uid + 1, Limit: m.pendingLimit()}
	for i := range r.Pages {
		t, st, err := m.cache.BeginStoreCharged(in.ns.id, s.rank, d[i*w:(i+1)*w], s.owner, h.now, ch)
		if err != nil {
			for _, t := range tickets {
				m.cache.AbortStore(t)
			}
			return internal(err)
		}
		switch st {
		case cache.Allocated:
			tickets = append(tickets, t)
			pages = append(pages, r.Pages[i])
			offsets = append(offsets, uint64(t.Slot)*m.cfg.SlotBytes)
		case cache.AlreadyPresent, cache.InFlight:
			rep.Present++
		case cache.NoSpace:
			rep.Skipped++
		case cache.OverQuota:
			rep.Skipped++
			m.st.QuotaRefusals["pending"]++
		}
	}
	if len(tickets) == 0 {
		h.out.reply(s.id, h.typ, h.seq, rep.Append)
		return nil
	}
	op, err := h.startCopy(gpu.EngineToPool, rg, pages, offsets)
	if err != nil {
		for _, t := range tickets {
			m.cache.AbortStore(t)
		}
		return err
	}
	op.tickets, op.reply = tickets, rep
	return nil
}

// CopyDone applies the end of a copy: a load's pins are dropped and its
// query moves on; a store's blocks are committed, or discarded when the
// copy failed or its process exited during it. The reply goes to the
// session that asked, if it is still there.
func (m *Machine) CopyDone(now int64, id CopyID, res CopyResult, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	op := m.copies[id]
	if op == nil {
		return
	}
	delete(m.copies, id)
	m.uncharge(op.sess, op.uid, usage{meta: op.meta})
	if !op.sess.gone {
		op.sess.copyMeta -= op.meta
	}
	failed := res.Err != nil || (res.Exited && op.dir == gpu.EngineToPool)
	if failed {
		m.st.CopiesFailed++
	} else {
		m.st.CopiesOK++
	}
	var payload func([]byte) []byte
	switch op.dir {
	case gpu.PoolToEngine:
		m.cache.EndLoad(op.load)
		if q := op.q; m.queries[q.lease] == q {
			q.loading--
			if q.loading == 0 && q.state == schema.StateLoading {
				q.state = schema.StateLoaded
			}
		}
		if res.Err != nil {
			r := schema.Reply{Status: schema.ErrCodeCopyFailed, Message: res.Err.Error()}
			payload = r.Append
		} else if op.seq != 0 { // a fire-and-forget Load that succeeded gets no reply
			r := schema.Reply{Value: uint64(op.pages)}
			payload = r.Append
		}
	case gpu.EngineToPool:
		r := op.reply
		for _, t := range op.tickets {
			if failed {
				m.cache.AbortStore(t)
				r.Skipped++
				continue
			}
			switch err := m.cache.CommitStore(t); {
			case err == nil:
				r.Stored++
			case errors.Is(err, cache.ErrDoomed):
				m.st.DoomedWrites++
				r.Skipped++
			default:
				r.Skipped++
			}
		}
		switch {
		case res.Err != nil:
			r.Status, r.Message = schema.ErrCodeCopyFailed, res.Err.Error()
		case failed:
			m.st.DiscardedExitedStores++
			r.Status, r.Message = schema.ErrCodeCopyFailed, "the process that owns the region exited during the copy: the store was discarded"
		}
		payload = r.Append
	}
	if !op.sess.gone && payload != nil {
		out.reply(op.sess.id, op.typ, op.seq, payload)
	}
	m.check()
}
