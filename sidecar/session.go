package sidecar

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// session is one attached client: a ring pair, its regions, and the socket
// whose closing tells the sidecar that the peer is gone.
type session struct {
	srv   *Server
	id    uint64
	owner cache.SessionID
	inst  *instance
	role  uint16
	rank  int
	cred  sys.Cred
	log   zerolog.Logger
	conn  *net.UnixConn

	sub, cmp *ring.File
	cons     *ring.Consumer

	prodMu   sync.Mutex // guards prod, out and prodDone: replies come from copy callbacks too
	prod     *ring.Producer
	out      []byte
	prodDone bool // the completion ring is closed (and about to be unmapped): replies are dropped

	regions map[uint32]gpu.Handle // guarded by srv.mu
	pages   map[uint32]uint32     // page count of each region, guarded by srv.mu
	leases  int                   // live queries this session owns, guarded by srv.mu
	closed  atomic.Bool
	done    chan struct{}

	lifeMu   sync.Mutex // orders shutdown's wake-up against unmapping the rings
	unmapped bool

	// scratch for handlers (session goroutine only)
	slots   []uint32
	tickets []cache.Ticket
	changes []cache.Change
	snap    []byte // a Snapshot page's digests
	load    schema.Load
	store   schema.Store
}

// attach runs the handshake on a new connection and then the session.
func (s *Server) attach(conn *net.UnixConn) {
	defer conn.Close()
	reply := func(r *schema.AttachReply) {
		r.Version = schema.Version
		conn.SetWriteDeadline(time.Now().Add(time.Second))
		conn.Write(r.Append(nil))
	}
	fail := func(st schema.Status, format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		s.log.Warn().Str("status", st.String()).Msg("attach refused: " + msg)
		s.met.attachErrors.Inc()
		reply(&schema.AttachReply{Status: st, Message: msg})
	}
	cred, err := sys.PeerCred(conn)
	if err != nil {
		fail(schema.ErrCodeNotPermitted, "%v", err)
		return
	}
	if !s.uidAllowed(cred.UID) {
		// Take the request off the socket first (bounded): closing with it
		// unread resets the connection, and the client would lose the
		// refusal.
		conn.SetReadDeadline(time.Now().Add(time.Second))
		conn.Read(make([]byte, 8192))
		fail(schema.ErrCodeNotPermitted, "uid %d is not allowed to attach (see --allow-uid)", cred.UID)
		return
	}
	buf := make([]byte, 8192)
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := conn.Read(buf)
	if err != nil {
		fail(schema.ErrCodeMalformed, "reading the attach request: %v", err)
		return
	}
	var req schema.AttachRequest
	if err := req.Decode(buf[:n]); err != nil {
		fail(schema.ErrCodeMalformed, "%v", err)
		return
	}
	if req.Version != schema.Version {
		fail(schema.ErrCodeBadVersion, "client speaks protocol version %d, this sidecar %d", req.Version, schema.Version)
		return
	}
	if s.draining.Load() {
		fail(schema.ErrCodeShuttingDown, "the sidecar is shutting down")
		return
	}
	ss, err := s.newSession(conn, cred, &req)
	if err != nil {
		var se *schema.Error
		if errors.As(err, &se) {
			fail(se.Status, "%s", se.Message)
		} else {
			fail(schema.ErrCodeInternal, "%v", err)
		}
		return
	}
	reply(&schema.AttachReply{
		Status: schema.OK, Namespace: uint32(ss.inst.ns), Session: ss.id, Epoch: s.epoch,
		PoolSlots: uint64(s.cache.Capacity()), SlotBytes: uint32(s.cfg.SlotBytes),
		MaxPayload: uint32(ss.sub.MaxPayload()), SubmissionRing: ss.sub.Path(), CompletionRing: ss.cmp.Path(),
		PoolPath: s.pool.Path(),
	})
	conn.SetReadDeadline(time.Time{})
	// The socket now only tells when the peer is gone.
	go func() {
		b := make([]byte, 64)
		for {
			if _, err := conn.Read(b); err != nil {
				ss.shutdown()
				return
			}
		}
	}()
	ss.run()
}

func (s *Server) uidAllowed(uid uint32) bool {
	if uid == uint32(os.Getuid()) {
		return true
	}
	for _, u := range s.cfg.AllowUIDs {
		if u == uid {
			return true
		}
	}
	return false
}

func (s *Server) newSession(conn *net.UnixConn, cred sys.Cred, req *schema.AttachRequest) (*session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.sessions) >= s.cfg.MaxSessions {
		return nil, schema.Errorf(schema.ErrCodeTooLarge, "%d sessions attached, the maximum (--max-sessions)", len(s.sessions))
	}
	in, err := s.instanceLocked(req)
	if err != nil {
		return nil, err
	}
	s.nextSess++
	id := s.nextSess
	capacity := s.cfg.RingCapacity
	if req.RingCapacity != 0 {
		if req.RingCapacity < 64<<10 || req.RingCapacity > 64<<20 || req.RingCapacity&(req.RingCapacity-1) != 0 {
			return nil, schema.Errorf(schema.ErrCodeTooLarge, "ring capacity %d must be a power of two in [64 KiB, 64 MiB]", req.RingCapacity)
		}
		capacity = uint64(req.RingCapacity)
	}
	base := filepath.Join(s.cfg.Dir, fmt.Sprintf("s%d-%016x", id, s.epoch))
	opts := ring.Options{Capacity: capacity, Mode: s.cfg.fileMode(), Epoch: s.epoch}
	sub, err := ring.Create(base+".sub", opts)
	if err != nil {
		return nil, err
	}
	opts.CreatorProducer = true
	cmp, err := ring.Create(base+".cmp", opts)
	if err != nil {
		sub.Remove()
		sub.Close()
		return nil, err
	}
	wait := ring.WaitConfig{Spin: s.cfg.Spin, Yield: s.cfg.Yield, Park: 10 * time.Millisecond,
		IdlePark: 160 * time.Millisecond}
	cons, err1 := ring.NewConsumer(sub.Ring, wait)
	prod, err2 := ring.NewProducer(cmp.Ring, wait)
	if err := errors.Join(err1, err2); err != nil {
		sub.Remove()
		sub.Close()
		cmp.Remove()
		cmp.Close()
		return nil, err
	}
	ss := &session{
		srv: s, id: id, owner: cache.SessionID(1<<32 | id), inst: in, role: req.Role, rank: int(req.Rank),
		cred: cred, conn: conn, sub: sub, cmp: cmp, cons: cons, prod: prod,
		regions: map[uint32]gpu.Handle{}, pages: map[uint32]uint32{}, done: make(chan struct{}),
	}
	ss.log = s.log.With().Uint64("session", id).Str("instance", req.Instance).Int("rank", ss.rank).Int("pid", cred.PID).Logger()
	in.sessions++
	s.sessions[id] = ss
	s.met.attaches.Inc()
	ss.log.Info().Str("model", req.Model).Uint16("role", req.Role).Msg("attached")
	return ss, nil
}

// shutdown asks the session loop to end; it is safe from any goroutine.
func (ss *session) shutdown() {
	ss.closed.Store(true)
	ss.lifeMu.Lock()
	if !ss.unmapped {
		faultSafe(ss.cons.Interrupt) // the peer may have truncated the ring
	}
	ss.lifeMu.Unlock()
}

// run serves the submission ring until the peer goes away.
func (ss *session) run() {
	defer ss.cleanup()
	// A peer that truncates a ring file makes our mapping fault; turn that
	// into a panic we recover from, instead of a crash of the sidecar.
	debug.SetPanicOnFault(true)
	defer func() {
		if r := recover(); r != nil {
			ss.log.Error().Interface("panic", r).Msg("session aborted")
		}
	}()
	for !ss.closed.Load() {
		t0 := time.Now()
		// Closing interrupts the wait; the deadline only bounds it.
		err := ss.cons.Wait(t0.Add(time.Second))
		ss.srv.met.ringWait.Add(time.Since(t0).Seconds())
		switch {
		case err == nil:
		case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, ring.ErrClosed):
			continue
		case errors.Is(err, ring.ErrPeerDead), errors.Is(err, ring.ErrPeerClosed):
			ss.log.Info().Err(err).Msg("peer gone")
			return
		default:
			ss.log.Warn().Err(err).Msg("submission ring unusable")
			return
		}
		for i := 0; i < 256; i++ {
			rec, err := ss.cons.Next()
			if errors.Is(err, ring.ErrEmpty) {
				break
			}
			if err != nil {
				ss.log.Warn().Err(err).Msg("submission ring corrupt")
				return
			}
			if !ss.handle(rec) {
				return
			}
		}
		ss.cons.Commit()
	}
}

// cleanup releases everything the session held: leases, queries, pending
// writes, regions, budget, rings.
func (ss *session) cleanup() {
	s := ss.srv
	ss.closed.Store(true)
	// First let in-flight copies finish: a store must not land in a slot
	// that was freed and reused, and a load must not read one. Unregister
	// waits for the region's copies (their callbacks take s.mu, so it runs
	// without it).
	s.mu.Lock()
	regions := ss.regions
	ss.regions = map[uint32]gpu.Handle{}
	s.mu.Unlock()
	for _, h := range regions {
		s.copier.Unregister(h)
	}
	// Loads by other ranks may still read blocks under this session's
	// leases (a scheduler acquires, workers load): wait for them, bounded.
	for deadline := time.Now().Add(s.cfg.ReplyTimeout); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		s.mu.Lock()
		busy := false
		for _, q := range s.queries {
			if q.owner == ss && q.loading > 0 {
				busy = true
				break
			}
		}
		s.mu.Unlock()
		if !busy {
			break
		}
	}
	s.mu.Lock()
	r := s.cache.ReleaseOwner(ss.owner)
	for id, q := range s.queries {
		if q.owner == ss {
			s.unbudgetLocked(q)
			delete(s.queries, id)
		}
	}
	delete(s.sessions, ss.id)
	in := ss.inst
	in.sessions--
	if in.sessions == 0 {
		in.batches = map[uint64][]byte{}
		in.hashBytes = 0
	}
	s.mu.Unlock()
	// A copy callback may still reply after Unregister returned (the copy
	// engine counts a copy done before it runs the callback): once prodDone
	// is set under prodMu, no reply touches the ring we unmap below.
	// Closing touches the mappings, which the peer may have truncated:
	// that must not crash the sidecar.
	ss.prodMu.Lock()
	faultSafe(ss.prod.Close)
	ss.prodDone = true
	ss.prodMu.Unlock()
	faultSafe(ss.cons.Close)
	ss.sub.Remove()
	ss.cmp.Remove()
	ss.lifeMu.Lock()
	ss.unmapped = true
	ss.sub.Close()
	ss.cmp.Close()
	ss.lifeMu.Unlock()
	ss.conn.Close()
	s.met.detaches.Inc()
	ss.log.Info().Int("leases_released", r.Leases).Int("writes_aborted", r.Writes).Msg("detached")
}

// send writes one reply record. It is called from the session loop and from
// copy-completion callbacks.
func (ss *session) send(typ uint16, seq uint64, enc func([]byte) []byte) {
	ss.prodMu.Lock()
	defer ss.prodMu.Unlock()
	if ss.prodDone {
		return
	}
	ss.out = enc(ss.out[:0])
	if len(ss.out) > ss.cmp.MaxPayload() {
		ss.out = (&schema.Reply{Status: schema.ErrCodeInternal, Message: "reply too large"}).Append(ss.out[:0])
	}
	var err error
	if !faultSafe(func() {
		err = ss.prod.Write(typ|schema.ReplyBit, 0, seq, ss.out, time.Now().Add(ss.srv.cfg.ReplyTimeout))
	}) {
		// The peer truncated the completion ring (replies also come from
		// copy-completion goroutines, which must not crash the sidecar).
		err = fmt.Errorf("%w: fault writing the completion ring", ring.ErrCorrupt)
		ss.prodDone = true
	}
	if err != nil {
		ss.log.Warn().Err(err).Msg("completion ring: dropping the session")
		ss.shutdown()
	}
}

func (ss *session) reply(typ uint16, seq uint64, r schema.Reply) {
	if r.Status != schema.OK {
		ss.srv.met.errors.WithLabelValues(r.Status.String()).Inc()
	} else if seq == 0 {
		// A fire-and-forget request (protocol.md 3.2): answered only if
		// it fails.
		return
	}
	ss.send(typ, seq, r.Append)
}

func (ss *session) fail(typ uint16, seq uint64, err error) {
	var se *schema.Error
	if !errors.As(err, &se) {
		se = &schema.Error{Status: schema.ErrCodeInternal, Message: err.Error()}
	}
	if typ == schema.TypeAcquire || typ == schema.TypePoll {
		ss.srv.met.errors.WithLabelValues(se.Status.String()).Inc()
		ss.send(typ, seq, (&schema.LeaseReply{Status: se.Status, State: schema.StateMiss, Message: se.Message}).Append)
		return
	}
	if typ == schema.TypeChanges {
		ss.srv.met.errors.WithLabelValues(se.Status.String()).Inc()
		ss.send(typ, seq, (&schema.ChangesReply{Status: se.Status, Width: uint8(ss.inst.width)}).Append)
		return
	}
	if typ == schema.TypeSnapshot {
		ss.srv.met.errors.WithLabelValues(se.Status.String()).Inc()
		ss.send(typ, seq, (&schema.SnapshotReply{Status: se.Status, Width: uint8(ss.inst.width)}).Append)
		return
	}
	if typ == schema.TypeStore {
		ss.srv.met.errors.WithLabelValues(se.Status.String()).Inc()
		ss.send(typ, seq, (&schema.StoreReply{Status: se.Status, Message: se.Message}).Append)
		return
	}
	ss.reply(typ, seq, schema.Reply{Status: se.Status, Message: se.Message})
}

func malformed(err error) error {
	return &schema.Error{Status: schema.ErrCodeMalformed, Message: err.Error()}
}

// handle serves one record. It returns false when the session must end.
func (ss *session) handle(rec ring.Record) bool {
	s := ss.srv
	s.met.requests.WithLabelValues(schema.TypeName(rec.Type)).Inc()
	var err error
	switch rec.Type {
	case schema.TypePutHashes:
		err = ss.putHashes(rec)
	case schema.TypeDropHashes:
		var m schema.IDRequest
		if err = m.Decode(rec.Payload); err != nil {
			err = malformed(err)
			break
		}
		s.mu.Lock()
		b, ok := ss.inst.batches[m.ID]
		delete(ss.inst.batches, m.ID)
		ss.inst.hashBytes -= len(b)
		s.mu.Unlock()
		if !ok {
			err = schema.Errorf(schema.ErrCodeUnknownBatch, "batch %d", m.ID)
			break
		}
		ss.reply(rec.Type, rec.Seq, schema.Reply{})
	case schema.TypeLookup:
		err = ss.lookup(rec)
	case schema.TypeAcquire:
		err = ss.acquire(rec)
	case schema.TypePoll:
		err = ss.poll(rec)
	case schema.TypeRelease:
		err = ss.release(rec)
	case schema.TypeRegisterRegion:
		err = ss.registerRegion(rec)
	case schema.TypeLoad:
		err = ss.loadBlocks(rec)
	case schema.TypeStore:
		err = ss.storeBlocks(rec)
	case schema.TypeChanges:
		err = ss.changesSince(rec)
	case schema.TypeSnapshot:
		err = ss.snapshot(rec)
	case schema.TypePing:
		var m schema.IDRequest
		if err = m.Decode(rec.Payload); err == nil {
			ss.reply(rec.Type, rec.Seq, schema.Reply{Value: m.ID})
		} else {
			err = malformed(err)
		}
	case schema.TypeDetach:
		ss.reply(rec.Type, rec.Seq, schema.Reply{})
		ss.log.Info().Msg("detach requested")
		return false
	default:
		err = schema.Errorf(schema.ErrCodeUnknownType, "record type %#x", rec.Type)
	}
	if err != nil {
		ss.fail(rec.Type, rec.Seq, err)
	}
	return !ss.closed.Load()
}

func (ss *session) putHashes(rec ring.Record) error {
	s := ss.srv
	var m schema.PutHashes
	if err := m.Decode(rec.Payload, ss.inst.width); err != nil {
		return malformed(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b, exists := ss.inst.batches[m.Batch]
	if m.Flags&schema.FlagReplace != 0 && exists {
		// Reuse of the id: the old digests go (the limits below count the
		// new ones alone; if they refuse, the batch is left empty). A new
		// array: nothing may see the old one change.
		ss.inst.hashBytes -= len(b)
		b = nil
		ss.inst.batches[m.Batch] = b
	}
	switch {
	case m.Flags&(schema.FlagAppend|schema.FlagReplace) == 0 && exists:
		return schema.Errorf(schema.ErrCodeDuplicate, "batch %d is already registered (drop it first, or append)", m.Batch)
	case m.Flags&schema.FlagAppend != 0 && !exists:
		return schema.Errorf(schema.ErrCodeUnknownBatch, "batch %d: nothing to append to", m.Batch)
	case !exists && len(ss.inst.batches) >= s.cfg.MaxBatches:
		return schema.Errorf(schema.ErrCodeTooLarge, "%d batches registered, the maximum", len(ss.inst.batches))
	case (len(b)+len(m.Digests))/ss.inst.width > s.cfg.MaxBatchHashes:
		return schema.Errorf(schema.ErrCodeTooLarge, "batch %d would hold more than %d hashes", m.Batch, s.cfg.MaxBatchHashes)
	case ss.inst.hashBytes+len(m.Digests) > s.cfg.MaxHashBytes:
		return schema.Errorf(schema.ErrCodeTooLarge, "the instance's batches would hold more than %d bytes of hashes: drop finished batches", s.cfg.MaxHashBytes)
	}
	b = append(b, m.Digests...) // copies: the payload aliases the ring
	ss.inst.batches[m.Batch] = b
	ss.inst.hashBytes += len(m.Digests)
	v := uint64(len(b) / ss.inst.width)
	if m.Flags&schema.FlagLookup != 0 {
		hits, err := s.cache.Lookup(ss.inst.ns, b)
		if err != nil {
			return err
		}
		v = uint64(hits)
	}
	ss.sendLocked(rec.Type, rec.Seq, schema.Reply{Value: v})
	return nil
}

// sendLocked replies while s.mu is held (the reply does not take s.mu).
func (ss *session) sendLocked(typ uint16, seq uint64, r schema.Reply) { ss.reply(typ, seq, r) }

// view resolves a view to its digests. Caller holds s.mu.
func (ss *session) viewLocked(v schema.View) ([]byte, error) {
	b, ok := ss.inst.batches[v.Batch]
	if !ok {
		return nil, schema.Errorf(schema.ErrCodeUnknownBatch, "batch %d", v.Batch)
	}
	w := ss.inst.width
	n := uint64(len(b) / w)
	if uint64(v.Start)+uint64(v.Count) > n {
		return nil, schema.Errorf(schema.ErrCodeOutOfRange, "view [%d, %d) past the end of batch %d (%d hashes)", v.Start, uint64(v.Start)+uint64(v.Count), v.Batch, n)
	}
	return b[int(v.Start)*w : int(v.Start+v.Count)*w], nil
}

func (ss *session) lookup(rec ring.Record) error {
	s := ss.srv
	var m schema.Lookup
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	s.mu.Lock()
	d, err := ss.viewLocked(m.View)
	var hits int
	if err == nil {
		hits, err = s.cache.Lookup(ss.inst.ns, d)
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	ss.reply(rec.Type, rec.Seq, schema.Reply{Value: uint64(hits)})
	return nil
}

func (ss *session) acquire(rec ring.Record) error {
	s := ss.srv
	var m schema.Acquire
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	ttl := s.cfg.LeaseTTL
	if m.TTLms != 0 {
		ttl = min(time.Duration(m.TTLms)*time.Millisecond, s.cfg.MaxLeaseTTL)
	}
	s.mu.Lock()
	d, err := ss.viewLocked(m.View)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	if ss.leases >= s.cfg.MaxLeases {
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeTooLarge, "%d live leases in this session, the maximum: release finished ones", ss.leases)
	}
	rank := ss.rank
	l, err := s.cache.Acquire(ss.inst.ns, rank, d, ss.owner, ttl, monotonic())
	if err != nil {
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeInternal, "%v", err)
	}
	r := schema.LeaseReply{Lease: l.ID, Blocks: uint32(l.Blocks), State: schema.StateMiss}
	if l.ID != 0 {
		q := &query{lease: l.ID, inst: ss.inst, owner: ss, blocks: l.Blocks,
			bytes: int64(l.Blocks) * int64(s.cfg.SlotBytes) * int64(ss.inst.world)}
		if len(ss.inst.waiting) == 0 && s.budget.Admit(ss.inst.id, q.bytes) {
			q.budgeted, q.state = true, schema.StateReady
		} else {
			q.state = schema.StateWaiting
			ss.inst.waiting = append(ss.inst.waiting, q)
		}
		s.queries[l.ID] = q
		ss.leases++
		r.State = q.state
	}
	s.mu.Unlock()
	ss.send(rec.Type, rec.Seq, r.Append)
	return nil
}

// queryLocked finds a lease visible to this session: its own, or one of
// another session of the same engine instance (a scheduler acquires, the
// tensor-parallel workers load).
func (ss *session) queryLocked(id uint64) (*query, error) {
	q, ok := ss.srv.queries[id]
	if !ok || q.inst != ss.inst {
		return nil, schema.Errorf(schema.ErrCodeUnknownLease, "lease %d", id)
	}
	return q, nil
}

func (ss *session) poll(rec ring.Record) error {
	s := ss.srv
	var m schema.IDRequest
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	s.mu.Lock()
	q, err := ss.queryLocked(m.ID)
	var r schema.LeaseReply
	if err == nil {
		r = schema.LeaseReply{State: q.state, Lease: q.lease, Blocks: uint32(q.blocks)}
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	ss.send(rec.Type, rec.Seq, r.Append)
	return nil
}

func (ss *session) release(rec ring.Record) error {
	s := ss.srv
	var m schema.IDRequest
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	s.mu.Lock()
	q, err := ss.queryLocked(m.ID)
	if err == nil {
		if q.state != schema.StateMiss { // a missed query's lease is already gone
			s.cache.Release(q.lease)
		}
		s.unbudgetLocked(q)
		delete(s.queries, q.lease)
		q.owner.leases--
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	ss.reply(rec.Type, rec.Seq, schema.Reply{})
	return nil
}

func (ss *session) registerRegion(rec ring.Record) error {
	s := ss.srv
	var m schema.RegisterRegion
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	cudaIPC := m.Kind == schema.RegionCUDAIPC && gpu.Supports(s.copier, gpu.CUDAIPC)
	if m.Kind != schema.RegionHostProcess && !cudaIPC {
		return schema.Errorf(schema.ErrCodeNotPermitted, "region kind %d needs the CUDA copy backend, which this sidecar does not run (copy backend %s)", m.Kind, s.copier.Name())
	}
	if m.PID != uint64(ss.cred.PID) {
		return schema.Errorf(schema.ErrCodeNotPermitted, "region pid %d is not the attached process (%d): a session may only register its own memory", m.PID, ss.cred.PID)
	}
	if m.PageSize > s.cfg.SlotBytes {
		return schema.Errorf(schema.ErrCodeTooLarge, "page size %d is larger than the pool slot (%d bytes, --pool.slot-bytes)", m.PageSize, s.cfg.SlotBytes)
	}
	r := gpu.Region{Kind: gpu.HostProcess, PID: int(m.PID), Base: m.Base, Length: m.Length, PageSize: m.PageSize, PageCount: m.PageCount}
	for _, sg := range m.Segments {
		r.Segments = append(r.Segments, gpu.Segment{Offset: sg.Offset, Stride: sg.Stride, Length: sg.Length})
	}
	if cudaIPC {
		ipc, err := gpu.ParseIPCExtra(m.Extra)
		if err != nil {
			return malformed(err)
		}
		r.Kind, r.IPC = gpu.CUDAIPC, ipc
	}
	s.mu.Lock()
	_, dup := ss.regions[m.Region]
	s.mu.Unlock()
	if dup {
		return schema.Errorf(schema.ErrCodeDuplicate, "region %d is already registered", m.Region)
	}
	h, err := s.copier.Register(r)
	if errors.Is(err, gpu.ErrUnsupported) {
		// Memory the backend cannot reach (not shareable over CUDA IPC, a
		// GPU the sidecar does not see): a configuration problem.
		return schema.Errorf(schema.ErrCodeNotPermitted, "%v", err)
	}
	if err != nil {
		return schema.Errorf(schema.ErrCodeOutOfRange, "%v", err)
	}
	s.mu.Lock()
	ss.regions[m.Region] = h
	ss.pages[m.Region] = m.PageCount
	s.mu.Unlock()
	ss.reply(rec.Type, rec.Seq, schema.Reply{})
	return nil
}

func (ss *session) loadBlocks(rec ring.Record) error {
	s := ss.srv
	m := &ss.load
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	s.mu.Lock()
	q, err := ss.queryLocked(m.Lease)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	switch q.state {
	case schema.StateReady, schema.StateLoading, schema.StateLoaded:
	case schema.StateMiss:
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeExpired, "lease %d expired: recompute", m.Lease)
	default:
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeBadState, "lease %d is %s: poll until ready", m.Lease, q.state)
	}
	h, ok := ss.regions[m.Region]
	if !ok {
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeUnknownRegion, "region %d", m.Region)
	}
	ss.slots, err = s.cache.LeaseSlots(m.Lease, ss.rank, ss.slots[:0])
	if err != nil {
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeExpired, "%v", err)
	}
	if uint64(m.First)+uint64(len(m.Pages)) > uint64(len(ss.slots)) {
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeOutOfRange, "blocks [%d, %d) past the %d blocks of lease %d", m.First, uint64(m.First)+uint64(len(m.Pages)), len(ss.slots), m.Lease)
	}
	// Keep the lease alive for the copy (pinned blocks are never evicted,
	// and an expired lease would unpin them mid-copy).
	s.cache.Renew(m.Lease, s.cfg.LeaseTTL, monotonic())
	q.loading++
	q.state = schema.StateLoading
	s.mu.Unlock()
	offsets := make([]uint64, len(m.Pages))
	for i := range m.Pages {
		offsets[i] = uint64(ss.slots[int(m.First)+i]) * s.cfg.SlotBytes
	}
	n := len(m.Pages)
	typ, seq := rec.Type, rec.Seq
	done := func(res gpu.Result) {
		s.mu.Lock()
		q.loading--
		if q.loading == 0 && q.state == schema.StateLoading {
			q.state = schema.StateLoaded
		}
		s.mu.Unlock()
		s.met.copied(gpu.PoolToEngine, res)
		if res.Err != nil {
			ss.reply(typ, seq, schema.Reply{Status: schema.ErrCodeCopyFailed, Message: res.Err.Error()})
			return
		}
		ss.reply(typ, seq, schema.Reply{Value: uint64(n)})
	}
	if err := s.copier.Submit(gpu.Op{Dir: gpu.PoolToEngine, Region: h, Pages: m.Pages, PoolOffsets: offsets}, done); err != nil {
		s.mu.Lock()
		q.loading--
		if q.loading == 0 && q.state == schema.StateLoading {
			q.state = schema.StateReady
		}
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeOutOfRange, "%v", err)
	}
	return nil
}

func (ss *session) storeBlocks(rec ring.Record) error {
	s := ss.srv
	m := &ss.store
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	var r schema.StoreReply
	s.mu.Lock()
	h, ok := ss.regions[m.Region]
	if !ok {
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeUnknownRegion, "region %d", m.Region)
	}
	// Every page is checked, also those of blocks that turn out present
	// and are not copied: a bad index is a client bug to report.
	for _, p := range m.Pages {
		if p >= ss.pages[m.Region] {
			s.mu.Unlock()
			return schema.Errorf(schema.ErrCodeOutOfRange, "page %d past the %d pages of region %d", p, ss.pages[m.Region], m.Region)
		}
	}
	d, err := ss.viewLocked(m.View)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	w := ss.inst.width
	tickets := ss.tickets[:0]
	pages := make([]uint32, 0, len(m.Pages))
	offsets := make([]uint64, 0, len(m.Pages))
	now := monotonic()
	for i := range m.Pages {
		t, st, err := s.cache.BeginStore(ss.inst.ns, ss.rank, d[i*w:(i+1)*w], ss.owner, now)
		if err != nil {
			for _, t := range tickets {
				s.cache.AbortStore(t)
			}
			s.mu.Unlock()
			return schema.Errorf(schema.ErrCodeInternal, "%v", err)
		}
		switch st {
		case cache.Allocated:
			tickets = append(tickets, t)
			pages = append(pages, m.Pages[i])
			offsets = append(offsets, uint64(t.Slot)*s.cfg.SlotBytes)
		case cache.AlreadyPresent, cache.InFlight:
			r.Present++
		case cache.NoSpace:
			r.Skipped++
		}
	}
	s.mu.Unlock()
	ss.tickets = tickets[:0]
	if len(tickets) == 0 {
		ss.send(rec.Type, rec.Seq, r.Append)
		return nil
	}
	own := append([]cache.Ticket(nil), tickets...)
	typ, seq := rec.Type, rec.Seq
	done := func(res gpu.Result) {
		s.mu.Lock()
		for _, t := range own {
			if res.Err == nil && s.cache.CommitStore(t) == nil {
				r.Stored++
			} else {
				s.cache.AbortStore(t)
				r.Skipped++
			}
		}
		s.mu.Unlock()
		s.met.copied(gpu.EngineToPool, res)
		if res.Err != nil {
			r.Status, r.Message = schema.ErrCodeCopyFailed, res.Err.Error()
			s.met.errors.WithLabelValues(r.Status.String()).Inc()
		}
		ss.send(typ, seq, r.Append)
	}
	if err := s.copier.Submit(gpu.Op{Dir: gpu.EngineToPool, Region: h, Pages: pages, PoolOffsets: offsets}, done); err != nil {
		s.mu.Lock()
		for _, t := range own {
			s.cache.AbortStore(t)
		}
		s.mu.Unlock()
		return schema.Errorf(schema.ErrCodeOutOfRange, "%v", err)
	}
	return nil
}

func (ss *session) changesSince(rec ring.Record) error {
	s := ss.srv
	var m schema.Changes
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	w := ss.inst.width
	limit := (ss.cmp.MaxPayload() - 32) / (8 + w)
	limit = min(limit, schema.MaxChangesPerReply)
	if m.Max != 0 {
		limit = min(limit, int(m.Max))
	}
	r := schema.ChangesReply{Width: uint8(w)}
	s.mu.Lock()
	var cur cache.Cursor
	var err error
	if m.Epoch == 0 && m.Seq == 0 {
		// A new consumer starts at the head of the log; it learns the
		// present blocks from Lookup, or rebuilds from a snapshot.
		cur, err = s.cache.Head(ss.inst.ns)
		r.Resync = true
	} else {
		ss.changes, cur, err = s.cache.ChangesSince(ss.inst.ns, cache.Cursor{Epoch: m.Epoch, Seq: m.Seq}, limit, ss.changes[:0])
		if errors.Is(err, cache.ErrResync) {
			cur, err = s.cache.Head(ss.inst.ns)
			r.Resync = true
			ss.changes = ss.changes[:0]
		}
	}
	s.mu.Unlock()
	if err != nil {
		return schema.Errorf(schema.ErrCodeInternal, "%v", err)
	}
	r.Epoch, r.Next = cur.Epoch, cur.Seq
	entries := make([]byte, 0, len(ss.changes)*(8+w))
	for i := range ss.changes {
		c := &ss.changes[i]
		d := make([]byte, w)
		copy(d, c.Digest())
		entries = schema.AppendChange(entries, uint8(c.Op), d)
	}
	r.Entries = entries
	ss.send(rec.Type, rec.Seq, r.Append)
	return nil
}

// snapshot answers one page of the digests of the namespace's present
// blocks, with the log's head cursor when the page was read
// (docs/protocol.md, sections 5.10 and 11). A page scans at most
// cfg.SnapshotScan slots under s.mu.
func (ss *session) snapshot(rec ring.Record) error {
	s := ss.srv
	if ss.role == schema.RoleWorker {
		// The only request refused by role: a worker has no use for the
		// namespace's index, and a page holds the lock for a while.
		return schema.Errorf(schema.ErrCodeNotPermitted, "Snapshot is for scheduler and client sessions, not workers")
	}
	var m schema.Snapshot
	if err := m.Decode(rec.Payload); err != nil {
		return malformed(err)
	}
	w := ss.inst.width
	limit := min((ss.cmp.MaxPayload()-40)/w, schema.MaxSnapshotPerReply)
	if m.Max != 0 {
		limit = min(limit, int(m.Max))
	}
	limit = max(limit, 1) // never unbounded (a ring too small for one digest gets "reply too large")
	d := ss.snap[:0]
	s.mu.Lock()
	cur, next, done, err := s.cache.SnapshotPage(ss.inst.ns, m.From, limit, s.cfg.SnapshotScan, func(dg []byte) {
		d = append(d, dg...)
	})
	s.mu.Unlock()
	ss.snap = d
	if err != nil {
		return schema.Errorf(schema.ErrCodeInternal, "%v", err)
	}
	r := schema.SnapshotReply{Done: done, Epoch: cur.Epoch, Seq: cur.Seq, Next: next, Width: uint8(w), Entries: d}
	ss.send(rec.Type, rec.Seq, r.Append)
	return nil
}

var _ io.Closer = (*ring.File)(nil)

// faultSafe runs f, which touches a ring mapping, and reports false if that
// faulted: a peer that truncates a ring file makes any access past the new
// end raise SIGBUS, which must end the session, never the sidecar.
func faultSafe(f func()) (ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	f()
	return true
}
