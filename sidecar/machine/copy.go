package machine

import (
	"errors"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// chunkPages is how many pages one chunk through r moves: ChunkBytes of
// them, or CUDAChunkBytes for a region the CUDA backend serves.
func (m *Machine) chunkPages(r *region) int {
	limit := m.cfg.ChunkBytes
	if m.cfg.RegionKind != nil && m.cfg.RegionKind(r.handle) == gpu.CUDAIPC {
		limit = m.cfg.CUDAChunkBytes
	}
	if r.pageBytes == 0 || limit <= r.pageBytes {
		return 1
	}
	return int(limit / r.pageBytes)
}

// chunkMeta is what the record of a chunk of n pages costs.
func chunkMeta(n int) int64 { return int64(copyMeta + 12*n) }

// addChunk registers one chunk of req and emits its Copy. The chunk's
// metadata must be charged already.
func (h *handler) addChunk(req *copyReq, r *region, pages []uint32, offsets []uint64, meta int64) *copyOp {
	m := h.m
	m.nextCopy++
	op := &copyOp{id: m.nextCopy, req: req, meta: meta, pages: len(pages)}
	m.copies[op.id] = op
	req.left++
	h.s.copyMeta += meta
	m.st.CopiesStarted++
	h.out.Copies = append(h.out.Copies, Copy{ID: op.id, Session: h.s.id, UID: h.s.uid, Dir: req.dir, Region: r.handle, PageBytes: r.pageBytes,
		Pages: append([]uint32(nil), pages...), PoolOffsets: offsets})
	return op
}

// geometry checks a copy through r against its namespace's block size,
// which the namespace's first Store fixes for as long as it lives: a load
// then always copies exactly the bytes a store wrote, never a slot's tail
// or a neighbour.
func (h *handler) geometry(r *region, pages int) error {
	ns := h.s.inst.ns
	switch {
	case ns.pageBytes == 0 && h.typ == schema.TypeStore && pages == 0:
		return nil // an empty store copies nothing: it fixes nothing
	case ns.pageBytes == 0 && h.typ == schema.TypeStore:
		ns.pageBytes = r.pageBytes
	case ns.pageBytes == 0:
		return schema.Errorf(schema.ErrCodeMismatch, "nothing was ever stored in this namespace")
	case r.pageBytes != ns.pageBytes:
		return schema.Errorf(schema.ErrCodeMismatch, "region pages of %d bytes, but the namespace's blocks are %d bytes (its first store fixed that): a copy must move exactly one stored block", r.pageBytes, ns.pageBytes)
	}
	return nil
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
	if err := h.geometry(rg, len(r.Pages)); err != nil {
		return err
	}
	if len(r.Pages) == 0 {
		h.ok(0)
		return nil
	}
	per := m.chunkPages(rg)
	nChunks := (len(r.Pages) + per - 1) / per
	meta := int64(nChunks)*copyMeta + 12*int64(len(r.Pages))
	if err := m.chargeMeta(s, s.uid, meta); err != nil {
		return err
	}
	req := &copyReq{sess: s, uid: s.uid, typ: h.typ, seq: h.seq, dir: gpu.PoolToEngine, q: q, pages: len(r.Pages)}
	for i := 0; i < len(r.Pages); i += per {
		e := min(i+per, len(r.Pages))
		// The chunk's own pin: its blocks stay put until its CopyDone,
		// whatever happens to the lease meanwhile.
		id, slots, err := m.cache.BeginLoad(r.Lease, s.rank, int(r.First)+i, e-i, nil)
		if err != nil {
			// Cannot happen after the checks above; give back what the
			// chunks not started hold.
			m.uncharge(s, s.uid, usage{meta: meta - int64(req.left)*copyMeta - 12*int64(i)})
			if req.left == 0 {
				return internal(err)
			}
			req.err = err
			break
		}
		offsets := make([]uint64, len(slots))
		for k, sl := range slots {
			offsets[k] = uint64(sl) * m.cfg.SlotBytes
		}
		op := h.addChunk(req, rg, r.Pages[i:e], offsets, chunkMeta(e-i))
		op.load = id
	}
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
	if err := h.geometry(rg, len(r.Pages)); err != nil {
		return err
	}
	w := in.width
	per := m.chunkPages(rg)
	// Charge the largest record the store can need before reserving
	// anything; the excess goes back below.
	maxMeta := int64((len(r.Pages)+per-1)/per)*copyMeta + 12*int64(len(r.Pages))
	if err := m.chargeMeta(s, s.uid, maxMeta); err != nil {
		return err
	}
	// Only blocks of several ranks are charged as incomplete: they may wait
	// for ranks that never come until --write-timeout. A one-rank block is
	// incomplete only while its chunk copies.
	var ch cache.Charge
	if in.world > 1 {
		ch = cache.Charge{Key: s.uid + 1, Limit: m.pendingLimit()}
	}
	req := &copyReq{sess: s, uid: s.uid, typ: h.typ, seq: h.seq, dir: gpu.EngineToPool}
	var tickets []cache.Ticket
	var pages []uint32
	var offsets []uint64
	used := int64(0)
	flush := func() {
		if len(tickets) == 0 {
			return
		}
		meta := chunkMeta(len(tickets))
		used += meta
		op := h.addChunk(req, rg, pages, offsets, meta)
		op.tickets = tickets
		tickets, pages, offsets = nil, nil, nil
	}
	for i := range r.Pages {
		t, st, err := m.cache.BeginStoreCharged(in.ns.id, s.rank, d[i*w:(i+1)*w], s.owner, h.now, ch)
		if err != nil {
			return internal(err) // cannot happen: the view and rank are valid
		}
		switch st {
		case cache.Allocated:
			tickets = append(tickets, t)
			pages = append(pages, r.Pages[i])
			offsets = append(offsets, uint64(t.Slot)*m.cfg.SlotBytes)
			if len(tickets) == per {
				flush()
			}
		case cache.AlreadyPresent, cache.InFlight:
			req.reply.Present++
		case cache.NoSpace:
			req.reply.Skipped++
		case cache.OverQuota:
			req.reply.Skipped++
			m.st.QuotaRefusals["pending"]++
		}
	}
	flush()
	m.uncharge(s, s.uid, usage{meta: maxMeta - used})
	if req.left == 0 {
		h.out.reply(s.id, h.typ, h.seq, req.reply.Append)
	}
	return nil
}

// CopyDone applies the end of one chunk: a load's pins are dropped; a
// store's blocks are committed, or discarded when the copy failed, its
// process exited during it, or its session ended before it did (Detach
// handled, socket closed, process gone: from then on the engine may hand
// the pages to another request, so what the copy read is not trusted).
// When the request's last chunk ends, its reply goes to the session that
// asked, if it is still there.
func (m *Machine) CopyDone(now int64, id CopyID, res CopyResult, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	op := m.copies[id]
	if op == nil {
		return
	}
	delete(m.copies, id)
	req := op.req
	m.uncharge(req.sess, req.uid, usage{meta: op.meta})
	if !req.sess.gone {
		req.sess.copyMeta -= op.meta
	}
	failed := res.Err != nil || (res.Exited && req.dir == gpu.EngineToPool)
	if failed {
		m.st.CopiesFailed++
		if req.err == nil {
			req.err = res.Err
		}
		req.exited = req.exited || res.Exited
	} else {
		m.st.CopiesOK++
	}
	ended := req.dir == gpu.EngineToPool && !failed && !req.sess.live()
	switch req.dir {
	case gpu.PoolToEngine:
		m.cache.EndLoad(op.load)
	case gpu.EngineToPool:
		for _, t := range op.tickets {
			if failed || ended {
				m.cache.AbortStore(t)
				req.reply.Skipped++
				if ended {
					m.st.DiscardedEndedStores++
				}
				continue
			}
			switch err := m.cache.CommitStore(t); {
			case err == nil:
				req.reply.Stored++
				m.l2Committed(t.Slot) // waiting acquires, write-through: once every rank is in
			case errors.Is(err, cache.ErrDoomed):
				m.st.DoomedWrites++
				req.reply.Skipped++
			default:
				req.reply.Skipped++
			}
		}
	}
	if req.dir == gpu.EngineToPool {
		m.l2EvictAhead() // write-on-evict: stores are what fill the pool
	}
	req.left--
	if req.left > 0 {
		m.check()
		return
	}
	var payload func([]byte) []byte
	switch req.dir {
	case gpu.PoolToEngine:
		if q := req.q; m.queries[q.lease] == q {
			q.loading--
			if q.loading == 0 && q.state == schema.StateLoading {
				q.state = schema.StateLoaded
			}
		}
		if req.err != nil {
			r := schema.Reply{Status: schema.ErrCodeCopyFailed, Message: req.err.Error()}
			payload = r.Append
		} else if req.seq != 0 { // a fire-and-forget Load that succeeded gets no reply
			r := schema.Reply{Value: uint64(req.pages)}
			payload = r.Append
		}
	case gpu.EngineToPool:
		r := req.reply
		switch {
		case req.err != nil:
			r.Status, r.Message = schema.ErrCodeCopyFailed, req.err.Error()
		case req.exited:
			m.st.DiscardedExitedStores++
			r.Status, r.Message = schema.ErrCodeCopyFailed, "the process that owns the region exited during the copy: the store was discarded"
		}
		payload = r.Append
	}
	if req.sess.live() && payload != nil {
		out.reply(req.sess.id, req.typ, req.seq, payload)
	}
	m.check()
}
