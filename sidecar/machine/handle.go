package machine

import (
	"errors"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// Handle serves one request record of session id. payload may alias ring
// memory: the Machine keeps nothing that points into it.
func (m *Machine) Handle(now int64, id SessionID, typ uint16, seq uint64, payload []byte, out *Output) {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	s := m.sessions[id]
	if s == nil {
		return
	}
	h := handler{m: m, s: s, now: now, typ: typ, seq: seq, out: out}
	var err error
	switch typ {
	case schema.TypePutHashes:
		err = h.putHashes(payload)
	case schema.TypeDropHashes:
		err = h.dropHashes(payload)
	case schema.TypeLookup:
		err = h.lookup(payload)
	case schema.TypeAcquire:
		err = h.acquire(payload)
	case schema.TypePoll:
		err = h.poll(payload)
	case schema.TypeRelease:
		err = h.release(payload)
	case schema.TypeRegisterRegion:
		err = h.registerRegion(payload)
	case schema.TypeLoad:
		err = h.load(payload)
	case schema.TypeStore:
		err = h.store(payload)
	case schema.TypeChanges:
		err = h.changes(payload)
	case schema.TypeSnapshot:
		err = h.snapshot(payload)
	case schema.TypeDescribe: // events.go
		err = h.describe(payload)
	case schema.TypeEvents:
		err = h.events(payload)
	case schema.TypeEventSnapshot:
		err = h.eventSnapshot(payload)
	case schema.TypeRetain:
		err = h.retain(payload)
	case schema.TypePing:
		var r schema.IDRequest
		if err = r.Decode(payload); err == nil {
			h.ok(r.ID)
		}
	case schema.TypeDetach:
		s.ended = true // before the reply: no store of s commits after it (copy.go)
		h.ok(0)
		out.End = true
	default:
		err = schema.Errorf(schema.ErrCodeUnknownType, "record type %#x", typ)
	}
	if err != nil {
		h.fail(err)
	}
	m.check()
}

// handler serves one request.
type handler struct {
	m   *Machine
	s   *session
	now int64
	typ uint16
	seq uint64
	out *Output
}

// ok answers with a common Reply; a fire-and-forget request (seq 0) that
// succeeds gets no reply (docs/protocol.md, section 3.2).
func (h *handler) ok(v uint64) {
	if h.seq == 0 {
		return
	}
	r := schema.Reply{Value: v}
	h.out.reply(h.s.id, h.typ, h.seq, r.Append)
}

// fail answers an error in the layout of the request's reply.
func (h *handler) fail(err error) {
	var se *schema.Error
	if errors.As(err, &se) {
	} else if errors.Is(err, schema.ErrMalformed) {
		se = &schema.Error{Status: schema.ErrCodeMalformed, Message: err.Error()}
	} else {
		se = &schema.Error{Status: schema.ErrCodeInternal, Message: err.Error()}
	}
	failReply(h.out, h.s, h.typ, h.seq, se)
}

func failReply(out *Output, s *session, typ uint16, seq uint64, se *schema.Error) {
	switch typ {
	case schema.TypeAcquire, schema.TypePoll:
		r := schema.LeaseReply{Status: se.Status, State: schema.StateMiss, Message: se.Message}
		out.reply(s.id, typ, seq, r.Append)
	case schema.TypeChanges:
		r := schema.ChangesReply{Status: se.Status, Width: uint8(s.inst.width)}
		out.reply(s.id, typ, seq, r.Append)
	case schema.TypeSnapshot:
		r := schema.SnapshotReply{Status: se.Status, Width: uint8(s.inst.width)}
		out.reply(s.id, typ, seq, r.Append)
	case schema.TypeEvents, schema.TypeEventSnapshot:
		r := schema.EventsReply{Status: se.Status, Width: uint8(s.inst.width)}
		out.reply(s.id, typ, seq, r.Append)
	case schema.TypeStore:
		r := schema.StoreReply{Status: se.Status, Message: se.Message}
		out.reply(s.id, typ, seq, r.Append)
	default:
		r := schema.Reply{Status: se.Status, Message: se.Message}
		out.reply(s.id, typ, seq, r.Append)
	}
}

func malformed(err error) error {
	return &schema.Error{Status: schema.ErrCodeMalformed, Message: err.Error()}
}

// view resolves a view of the session's instance to its digests.
func (h *handler) view(v schema.View) ([]byte, error) {
	b, ok := h.s.inst.batches[v.Batch]
	if !ok {
		return nil, schema.Errorf(schema.ErrCodeUnknownBatch, "batch %d", v.Batch)
	}
	w := h.s.inst.width
	n := uint64(len(b.d) / w)
	if uint64(v.Start)+uint64(v.Count) > n {
		return nil, schema.Errorf(schema.ErrCodeOutOfRange, "view [%d, %d) past the end of batch %d (%d hashes)", v.Start, uint64(v.Start)+uint64(v.Count), v.Batch, n)
	}
	return b.d[int(v.Start)*w : int(v.Start+v.Count)*w], nil
}

func (h *handler) putHashes(p []byte) error {
	m, s, in := h.m, h.s, h.s.inst
	var r schema.PutHashes
	if err := r.Decode(p, in.width); err != nil {
		return malformed(err)
	}
	b, exists := in.batches[r.Batch]
	switch {
	case r.Flags&(schema.FlagAppend|schema.FlagReplace) == 0 && exists:
		return schema.Errorf(schema.ErrCodeDuplicate, "batch %d is already registered (drop it first, or append)", r.Batch)
	case r.Flags&schema.FlagAppend != 0 && !exists:
		return schema.Errorf(schema.ErrCodeUnknownBatch, "batch %d: nothing to append to", r.Batch)
	case !exists && len(in.batches) >= m.cfg.MaxBatches:
		return m.refuse("batches", "%d batches registered, the maximum", len(in.batches))
	}
	old := 0
	if exists {
		old = len(b.d)
	}
	keep := old
	if r.Flags&schema.FlagReplace != 0 {
		keep = 0
	}
	switch {
	case (keep+len(r.Digests))/in.width > m.cfg.MaxBatchHashes:
		return m.refuse("batch-hashes", "batch %d would hold more than %d hashes", r.Batch, m.cfg.MaxBatchHashes)
	case in.hashBytes-old+keep+len(r.Digests) > m.cfg.MaxHashBytes:
		return m.refuse("hash-bytes", "the instance's batches would hold more than %d bytes of hashes: drop finished batches", m.cfg.MaxHashBytes)
	}
	if !exists {
		b = &batch{owner: s, uid: s.uid}
	}
	// The new digests, in a new array when replacing (nothing may see the
	// old one change) or when appending past its capacity.
	var d []byte
	if keep == 0 {
		d = make([]byte, len(r.Digests))
		copy(d, r.Digests)
	} else {
		d = append(b.d, r.Digests...) // copies: the payload aliases the ring
	}
	charge := int64(batchMeta + cap(d))
	if delta := charge - b.charge; delta > 0 {
		if err := m.chargeMeta(b.owner, b.uid, delta); err != nil {
			return err
		}
	} else if delta < 0 {
		m.uncharge(b.owner, b.uid, usage{meta: -delta})
	}
	b.d, b.charge = d, charge
	in.batches[r.Batch] = b
	in.hashBytes += len(d) - old
	v := uint64(len(d) / in.width)
	if r.Flags&schema.FlagLookup != 0 {
		hits, err := m.cache.Lookup(in.ns.id, d)
		if err != nil {
			return internal(err)
		}
		if h.l2Lookup(d, hits) {
			return nil // answered once the shared tier has been asked
		}
		v = uint64(hits)
	}
	h.ok(v)
	return nil
}

func (h *handler) dropHashes(p []byte) error {
	in := h.s.inst
	var r schema.IDRequest
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	b, ok := in.batches[r.ID]
	if !ok {
		return schema.Errorf(schema.ErrCodeUnknownBatch, "batch %d", r.ID)
	}
	delete(in.batches, r.ID)
	in.hashBytes -= len(b.d)
	h.m.uncharge(b.owner, b.uid, usage{meta: b.charge})
	h.ok(0)
	return nil
}

func (h *handler) lookup(p []byte) error {
	var r schema.Lookup
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	d, err := h.view(r.View)
	if err != nil {
		return err
	}
	hits, err := h.m.cache.Lookup(h.s.inst.ns.id, d)
	if err != nil {
		return internal(err)
	}
	if h.l2Lookup(d, hits) {
		return nil // answered once the shared tier has been asked
	}
	h.ok(uint64(hits))
	return nil
}

func (h *handler) acquire(p []byte) error {
	m, s, in := h.m, h.s, h.s.inst
	var r schema.Acquire
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	ttl := m.cfg.LeaseTTL
	if r.TTLms != 0 {
		ttl = min(time.Duration(r.TTLms)*time.Millisecond, m.cfg.MaxLeaseTTL)
	}
	d, err := h.view(r.View)
	if err != nil {
		return err
	}
	if s.leases >= m.cfg.MaxLeases {
		return m.refuse("leases", "%d live leases in this session, the maximum: release finished ones", s.leases)
	}
	// A lease pins distinct blocks, so it never exceeds the pool.
	blocksMax := min(len(d)/in.width, m.slots)
	meta := int64(queryMeta + 4*blocksMax)
	if err := m.chargeMeta(s, s.uid, meta); err != nil {
		return err
	}
	// The distinct blocks a uid's leases pin stay within its pin quota
	// (--limits.pin-share of the pool): past it the lease is shorter (fewer
	// hits), so that other tenants can always store. Its retentions take
	// none of that room (they have a share of their own, retain).
	l, short, fetch, promised, err := h.l2Acquire(d, ttl)
	if err != nil {
		m.uncharge(s, s.uid, usage{meta: meta})
		return internal(err)
	}
	if short {
		m.st.QuotaRefusals["pins"]++
		if l.ID == 0 {
			m.uncharge(s, s.uid, usage{meta: meta})
			return schema.Errorf(schema.ErrCodeTooLarge, "uid %d's leases pin its share of the pool (--limits.pin-share): release leases", s.uid)
		}
	}
	rep := schema.LeaseReply{Lease: l.ID, Blocks: uint32(l.Blocks), State: schema.StateMiss}
	if l.ID == 0 {
		m.uncharge(s, s.uid, usage{meta: meta})
	} else {
		q := &query{lease: l.ID, inst: in, owner: s, blocks: l.Blocks, meta: meta, bytes: m.leaseBytes(in, l.Blocks)}
		if fetch != nil {
			// It waits for the shared tier's fetch (l2.go), then for the
			// budget like any other.
			fetch.q, q.state = q, schema.StateWaiting
			rep.Blocks = uint32(promised)
		} else if len(in.waiting) == 0 && m.budget.Admit(in.id, q.bytes) {
			q.budgeted, q.state = true, schema.StateReady
		} else {
			q.state = schema.StateWaiting
			in.waiting = append(in.waiting, q)
		}
		m.queries[l.ID] = q
		s.leases++
		rep.State = q.state
	}
	h.out.reply(s.id, h.typ, h.seq, rep.Append)
	return nil
}

// retain sets, renews or (RetainFlagEnd) ends the retention of a view's
// blocks (docs/protocol.md, section 5.14). A retention belongs to the
// session's uid and the record's owner: only they renew, re-prioritise or
// end it. It is charged to the uid against a share of the pool of its own
// (--limits.retain-share), apart from its leases' pins, so that hints
// never shorten nor refuse a lease; and it outlives the session: only its
// deadline, END, eviction or Clear end it.
func (h *handler) retain(p []byte) error {
	m, s := h.m, h.s
	var r schema.Retain
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	d, err := h.view(r.View)
	if err != nil {
		return err
	}
	key := s.uid + 1 // the uid's charge key (acquire, l2.go)
	if r.Flags&schema.RetainFlagEnd != 0 {
		n, err := m.cache.EndRetain(s.inst.ns.id, d, key, r.Owner)
		if err != nil {
			return internal(err)
		}
		h.ok(uint64(n))
		return nil
	}
	ttl := time.Duration(r.TTLms) * time.Millisecond
	if ttl > m.cfg.MaxRetainTTL {
		return schema.Errorf(schema.ErrCodeTooLarge, "ttl %d ms is longer than the longest retention, %v (--retain.max-ttl)", r.TTLms, m.cfg.MaxRetainTTL)
	}
	n, short, err := m.cache.Retain(s.inst.ns.id, d, cache.Charge{Key: key, Limit: m.retainLimit()}, r.Owner, ttl, int(r.Priority), h.now)
	if err != nil {
		return internal(err)
	}
	if short {
		m.st.QuotaRefusals["retains"]++
		if n == 0 {
			return schema.Errorf(schema.ErrCodeTooLarge, "uid %d's retained blocks take its share of the pool for retention (--limits.retain-share): end retentions or let them expire", s.uid)
		}
	}
	h.ok(uint64(n))
	return nil
}

// query finds a lease visible to the session: its own, or one of another
// session of the same engine instance (a scheduler acquires, the
// tensor-parallel workers load).
func (h *handler) query(id uint64) (*query, error) {
	q, ok := h.m.queries[id]
	if !ok || q.inst != h.s.inst {
		return nil, schema.Errorf(schema.ErrCodeUnknownLease, "lease %d", id)
	}
	return q, nil
}

func (h *handler) poll(p []byte) error {
	var r schema.IDRequest
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	q, err := h.query(r.ID)
	if err != nil {
		return err
	}
	rep := schema.LeaseReply{State: q.state, Lease: q.lease, Blocks: uint32(h.m.l2Blocks(q))}
	h.out.reply(h.s.id, h.typ, h.seq, rep.Append)
	return nil
}

func (h *handler) release(p []byte) error {
	var r schema.IDRequest
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	q, err := h.query(r.ID)
	if err != nil {
		return err
	}
	h.m.dropQuery(q)
	delete(h.m.queries, q.lease)
	h.ok(0)
	return nil
}

func (h *handler) registerRegion(p []byte) error {
	var r schema.RegisterRegion
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	if r.Kind == schema.RegionCUDAFD {
		// Its descriptors cannot travel through a ring.
		return schema.Errorf(schema.ErrCodeMalformed, "region kind %d (GPU memory shared by file descriptor) is registered with a "+
			"RegionDescriptors message on the attach socket, which carries the descriptors, not on the ring", r.Kind)
	}
	g, meta, err := h.m.checkRegion(h.s, &r, 0)
	if err != nil {
		return err
	}
	h.m.addRegion(h.s, r.Region, g, meta, h.seq, false)
	return nil
}

// RegisterDescriptors handles a RegionDescriptors message that came on the
// attach socket for session id (the caller checked that its sender is the
// process that attached the session), carrying descriptors descriptors:
// r is its RegisterRegion, of kind schema.RegionCUDAFD. It checks what a
// RegisterRegion on the ring is checked for, and that the FDExtra names
// exactly the descriptors that came. On success out.Registers holds the
// region to register, whose allocations' FD fields are the indexes of
// their descriptors in the message (the caller substitutes the
// descriptors); its RegisterDone sends nothing on the ring and returns
// the outcome. Otherwise the returned error says why (a *schema.Error),
// and nothing was registered.
func (m *Machine) RegisterDescriptors(now int64, id SessionID, r *schema.RegisterRegion, descriptors int, out *Output) error {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	s := m.sessions[id]
	switch {
	case s == nil:
		return schema.Errorf(schema.ErrCodeNotPermitted, "session %d is not attached", id)
	case r.Kind != schema.RegionCUDAFD:
		return schema.Errorf(schema.ErrCodeMalformed, "a RegionDescriptors message registers a region of kind %d, not %d", schema.RegionCUDAFD, r.Kind)
	}
	g, meta, err := m.checkRegion(s, r, descriptors)
	if err != nil {
		return err
	}
	m.addRegion(s, r.Region, g, meta, 0, true)
	m.check()
	return nil
}

// checkRegion makes the checks of a registration (docs/protocol.md,
// RegisterRegion) and returns the copy engine's region and the metadata it
// charges. descriptors is how many descriptors came with a RegionCUDAFD
// region.
func (m *Machine) checkRegion(s *session, r *schema.RegisterRegion, descriptors int) (gpu.Region, int64, error) {
	cuda := (r.Kind == schema.RegionCUDAIPC || r.Kind == schema.RegionCUDAFD) && m.cfg.CUDAIPC
	switch {
	case r.Kind != schema.RegionHostProcess && !cuda:
		return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeNotPermitted, "region kind %d needs the CUDA copy backend, which this sidecar does not run", r.Kind)
	case r.Kind == schema.RegionHostProcess && s.pid <= 0:
		return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeNotPermitted, "the sidecar cannot see this process (SO_PEERCRED gave pid %d: another pid namespace): host-memory regions need the engine and the sidecar in one pid namespace (shareProcessNamespace in Kubernetes)", s.pid)
	case r.PID != uint64(s.pid):
		return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeNotPermitted, "region pid %d is not the attached process (%d): a session may only register its own memory", r.PID, s.pid)
	case r.PageSize > m.cfg.SlotBytes:
		return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeTooLarge, "page size %d is larger than the pool slot (%d bytes, --pool.slot-bytes)", r.PageSize, m.cfg.SlotBytes)
	case s.regions[r.Region] != nil:
		return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeDuplicate, "region %d is already registered", r.Region)
	case len(s.regions) >= m.cfg.MaxRegions:
		return gpu.Region{}, 0, m.refuse("regions", "%d regions registered in this session, the maximum", len(s.regions))
	}
	g := gpu.Region{Kind: gpu.HostProcess, PID: int(r.PID), Base: r.Base, Length: r.Length, PageSize: r.PageSize, PageCount: r.PageCount}
	for _, sg := range r.Segments {
		g.Segments = append(g.Segments, gpu.Segment{Offset: sg.Offset, Stride: sg.Stride, Length: sg.Length})
	}
	switch r.Kind {
	case schema.RegionCUDAIPC:
		if len(r.Extra) == schema.CUDAExtraHeaderSize {
			// Version 2's extra: one handle, the GPU, an offset (88 bytes).
			// A version 3 extra is longer: it names at least one allocation.
			return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeNotPermitted, "the CUDA IPC extra is %d bytes, the one-allocation form of protocol version 2: "+
				"this sidecar needs every device allocation of the region (protocol version 3): upgrade the engine plugin", len(r.Extra))
		}
		var x schema.CUDAExtra
		if err := x.Decode(r.Extra); err != nil {
			return gpu.Region{}, 0, malformed(err)
		}
		g.Kind = gpu.CUDAIPC
		g.IPC = gpu.IPCMem{GPU: x.GPU, Event: x.Event, HasEvent: x.Flags&schema.CUDAExtraFlagEvent != 0,
			Allocations: make([]gpu.IPCAllocation, len(x.Allocations))}
		for i, a := range x.Allocations {
			g.IPC.Allocations[i] = gpu.IPCAllocation{Handle: a.Handle, Base: a.Base, Size: a.Size}
		}
	case schema.RegionCUDAFD:
		var x schema.FDExtra
		if err := x.Decode(r.Extra); err != nil {
			return gpu.Region{}, 0, malformed(err)
		}
		if len(x.Allocations) != descriptors {
			return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeMalformed, "the message names %d descriptors and carries %d: "+
				"every allocation's descriptor comes with the message that names it, and nothing else", len(x.Allocations), descriptors)
		}
		g.Kind = gpu.CUDAFD
		g.IPC = gpu.IPCMem{GPU: x.GPU, Event: x.Event, HasEvent: x.Flags&schema.CUDAExtraFlagEvent != 0,
			Allocations: make([]gpu.IPCAllocation, len(x.Allocations))}
		for i, a := range x.Allocations {
			g.IPC.Allocations[i] = gpu.IPCAllocation{FD: int(a.Index), Base: a.Base, Size: a.Size}
		}
	}
	if err := g.Validate(); err != nil {
		return gpu.Region{}, 0, schema.Errorf(schema.ErrCodeOutOfRange, "%v", err)
	}
	meta := int64(regionMeta + 24*len(r.Segments) + schema.CUDAAllocationSize*len(g.IPC.Allocations))
	if err := m.chargeMeta(s, s.uid, meta); err != nil {
		return gpu.Region{}, 0, err
	}
	return g, meta, nil
}

// addRegion records a region whose registration is in flight and asks the
// caller to register it with the copy engine. socket: it came in a
// RegionDescriptors message, answered on its own connection.
func (m *Machine) addRegion(s *session, id uint32, g gpu.Region, meta int64, seq uint64, socket bool) {
	s.regions[id] = &region{pageBytes: g.PageSize, pages: g.PageCount, pending: true, meta: meta, seq: seq, socket: socket}
	m.out.Registers = append(m.out.Registers, Register{Session: s.id, ID: id, Region: g})
}

// RegisterDone completes a registration: h is the copy engine's handle, or
// err why it refused the region. It returns the registration's outcome:
// nil when the region is registered, else why not (a *schema.Error; the
// same status a ring reply carries). A region registered on the ring is
// answered there too; one from a RegionDescriptors message (its caller
// answers on the message's connection) is not.
func (m *Machine) RegisterDone(now int64, id SessionID, regionID uint32, hd gpu.Handle, err error, out *Output) error {
	out.reset()
	m.out = out
	defer func() { m.out = nil }()
	s := m.sessions[id]
	if s == nil || s.regions[regionID] == nil || !s.regions[regionID].pending {
		if err == nil {
			out.Unregister = append(out.Unregister, hd) // the session ended meanwhile
		}
		return schema.Errorf(schema.ErrCodeUnknownRegion, "the session ended before region %d was registered", regionID)
	}
	r := s.regions[regionID]
	seq := r.seq
	if err != nil {
		delete(s.regions, regionID)
		m.uncharge(s, s.uid, usage{meta: r.meta})
		st := schema.ErrCodeOutOfRange
		if errors.Is(err, gpu.ErrUnsupported) {
			// Memory the backend cannot reach (not shareable over CUDA IPC,
			// a GPU the sidecar does not see): a configuration problem.
			st = schema.ErrCodeNotPermitted
		}
		se := schema.Errorf(st, "%v", err)
		if !r.socket {
			failReply(out, s, schema.TypeRegisterRegion, seq, se)
		}
		return se
	}
	r.handle, r.pending = hd, false
	if seq != 0 && !r.socket {
		rep := schema.Reply{}
		out.reply(s.id, schema.TypeRegisterRegion, seq, rep.Append)
	}
	m.check()
	return nil
}

func (h *handler) changes(p []byte) error {
	m, s := h.m, h.s
	var r schema.Changes
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	w := s.inst.width
	limit := min((s.maxPayload-32)/(8+w), schema.MaxChangesPerReply)
	if r.Max != 0 {
		limit = min(limit, int(r.Max))
	}
	limit = max(limit, 0)
	rep := schema.ChangesReply{Width: uint8(w)}
	var changes []cache.Change
	var cur cache.Cursor
	var err error
	ns := s.inst.ns.id
	if r.Epoch == 0 && r.Seq == 0 {
		// A new consumer starts at the head of the log; it learns the
		// present blocks from Lookup, or rebuilds from a snapshot.
		cur, err = m.cache.Head(ns)
		rep.Resync = true
	} else {
		changes, cur, err = m.cache.ChangesSince(ns, cache.Cursor{Epoch: r.Epoch, Seq: r.Seq}, limit, nil)
		if errors.Is(err, cache.ErrResync) {
			cur, err = m.cache.Head(ns)
			rep.Resync = true
			changes = nil
		}
	}
	if err != nil {
		return internal(err)
	}
	rep.Epoch, rep.Next = cur.Epoch, cur.Seq
	entries := make([]byte, 0, len(changes)*(8+w))
	for i := range changes {
		entries = schema.AppendChange(entries, uint8(changes[i].Op), changes[i].Digest())
	}
	rep.Entries = entries
	h.out.reply(s.id, h.typ, h.seq, rep.Append)
	return nil
}

// snapshot answers one page of the digests of the namespace's present
// blocks, with the log's head cursor when the page was read
// (docs/protocol.md, sections 5.10 and 11). A page scans at most
// SnapshotScan slots.
func (h *handler) snapshot(p []byte) error {
	m, s := h.m, h.s
	if s.role == schema.RoleWorker {
		// The only request refused by role: a worker has no use for the
		// namespace's index, and a page takes a while.
		return schema.Errorf(schema.ErrCodeNotPermitted, "Snapshot is for scheduler and client sessions, not workers")
	}
	var r schema.Snapshot
	if err := r.Decode(p); err != nil {
		return malformed(err)
	}
	w := s.inst.width
	limit := min((s.maxPayload-40)/w, schema.MaxSnapshotPerReply)
	if r.Max != 0 {
		limit = min(limit, int(r.Max))
	}
	limit = max(limit, 1) // never unbounded (a ring too small for one digest gets "reply too large")
	var d []byte
	cur, next, done, err := m.cache.SnapshotPage(s.inst.ns.id, r.From, limit, m.cfg.SnapshotScan, func(dg []byte) {
		d = append(d, dg...)
	})
	if err != nil {
		return internal(err)
	}
	rep := schema.SnapshotReply{Done: done, Epoch: cur.Epoch, Seq: cur.Seq, Next: next, Width: uint8(w), Entries: d}
	h.out.reply(s.id, h.typ, h.seq, rep.Append)
	return nil
}

// leaseBytes is what a lease of blocks charges its instance's load budget:
// the bytes a Load of it copies, blocks × the namespace's page bytes ×
// world (slot bytes while no block has fixed the page size: a slot of
// 256 KiB holding a 16 KiB page charged 16 times the copy, and the
// budget admitted a sixteenth of the loads it has room for).
func (m *Machine) leaseBytes(in *instance, blocks int) int64 {
	page := in.ns.pageBytes
	if page == 0 || page > m.cfg.SlotBytes {
		page = m.cfg.SlotBytes
	}
	return int64(blocks) * int64(page) * int64(in.world)
}
