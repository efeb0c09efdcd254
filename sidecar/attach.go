package sidecar

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// attach runs the handshake on a new connection and then the session.
func (s *Server) attach(conn *net.UnixConn, accepted time.Time) {
	defer conn.Close()
	reply := func(r *schema.AttachReply, fds []int) error {
		r.Version = schema.Version
		conn.SetWriteDeadline(time.Now().Add(time.Second))
		var oob []byte
		if len(fds) > 0 {
			oob = syscall.UnixRights(fds...)
		}
		_, _, err := conn.WriteMsgUnix(r.Append(nil), oob, nil)
		return err
	}
	fail := func(st schema.Status, format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		s.log.Warn().Str("status", st.String()).Msg("attach refused: " + msg)
		s.met.attachErrors.Inc()
		reply(&schema.AttachReply{Status: st, Message: msg}, nil)
	}
	cred, err := sys.PeerCred(conn)
	if err != nil {
		fail(schema.ErrCodeNotPermitted, "%v", err)
		return
	}
	// The first message: an AttachRequest, or a RegionDescriptors
	// (descriptors.go) with the descriptors it names. Whatever descriptors
	// come are closed on every path.
	allowed := s.uidAllowed(cred.UID)
	wait := 5 * time.Second
	if !allowed {
		// Take the message off the socket first (bounded): closing with it
		// unread resets the connection, and the client would lose the
		// refusal.
		wait = time.Second
	}
	buf := make([]byte, maxFirstMessage)
	conn.SetReadDeadline(time.Now().Add(wait))
	n, fds, truncated, err := sys.ReadFDs(conn, buf, schema.MaxDescriptors)
	if n >= 4 && binary.LittleEndian.Uint32(buf) == schema.DescriptorsMagic {
		s.registerDescriptors(conn, cred, allowed, buf[:n], fds, truncated, err)
		return
	}
	sys.CloseFDs(fds)
	switch {
	case !allowed:
		fail(schema.ErrCodeNotPermitted, "uid %d is not allowed to attach (see --allow-uid)", cred.UID)
		return
	case err != nil:
		fail(schema.ErrCodeMalformed, "reading the attach request: %v", err)
		return
	case len(fds) > 0:
		fail(schema.ErrCodeMalformed, "the attach request carries %d descriptors: only a RegionDescriptors message carries any (all closed)", len(fds))
		return
	case truncated:
		fail(schema.ErrCodeMalformed, "the attach request is longer than %d bytes", len(buf))
		return
	}
	var req schema.AttachRequest
	if err := req.Decode(buf[:n]); err != nil {
		fail(schema.ErrCodeMalformed, "%v", err)
		return
	}
	if req.Version < schema.MinVersion || req.Version > schema.Version {
		fail(schema.ErrCodeBadVersion, "client speaks protocol version %d, this sidecar %d to %d (version 2 passes the rings as file descriptors)", req.Version, schema.MinVersion, schema.Version)
		return
	}
	if s.draining.Load() {
		fail(schema.ErrCodeShuttingDown, "the sidecar is shutting down")
		return
	}
	capacity := s.cfg.RingCapacity
	if req.RingCapacity != 0 {
		if !ringCapacityOK(uint64(req.RingCapacity), maxAskedRingCapacity) {
			fail(schema.ErrCodeTooLarge, "ring capacity %d must be a power of two in [%d KiB, %d MiB]", req.RingCapacity, minRingCapacity>>10, maxAskedRingCapacity>>20)
			return
		}
		capacity = uint64(req.RingCapacity)
	}
	// The session is bound to the process that connected, not to its pid:
	// a child it forks, or a later holder of the pid, never inherits it.
	pidfd, err := sys.PeerPidfd(conn, cred, accepted)
	if err != nil && !errors.Is(err, sys.ErrNoPidfd) {
		fail(schema.ErrCodeNotPermitted, "%v", err)
		return
	}
	ss, err := s.newSession(conn, cred, pidfd, &req, capacity)
	if err != nil {
		if pidfd != nil {
			pidfd.Close()
		}
		var se *schema.Error
		if errors.As(err, &se) {
			fail(se.Status, "%s", se.Message)
		} else {
			fail(schema.ErrCodeInternal, "%v", err)
		}
		return
	}
	rep := &schema.AttachReply{
		Status: schema.OK, Namespace: ss.ns, Session: uint64(ss.id), Epoch: s.epoch,
		PoolSlots: uint64(s.cfg.PoolBytes / s.cfg.Machine.SlotBytes), SlotBytes: uint32(s.cfg.Machine.SlotBytes),
		MaxPayload: uint32(ss.sub.MaxPayload()), SubmissionRing: ss.sub.Path(), CompletionRing: ss.cmp.Path(),
	}
	if err := reply(rep, []int{ss.sub.FD(), ss.cmp.FD()}); err != nil {
		ss.log.Warn().Err(err).Msg("attach reply not delivered")
		ss.shutdown("attach reply not delivered")
	}
	conn.SetReadDeadline(time.Time{})
	// The socket now only tells when the peer is gone. A client that writes
	// on it breaks the protocol (and could keep a sidecar thread busy
	// reading): its session ends. (Descriptors come on a connection of
	// their own, descriptors.go; any sent here are discarded by the kernel
	// with the message.)
	go func() {
		b := make([]byte, 64)
		if _, err := conn.Read(b); err != nil {
			ss.shutdown("socket closed")
		} else {
			ss.shutdown("the client wrote on the attach socket after the handshake")
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

// newSession admits the session in the machine and sets up its rings. The
// ring files are unlinked as soon as they exist: the client gets them as
// descriptors, and no other process can open them.
func (s *Server) newSession(conn *net.UnixConn, cred sys.Cred, pidfd *sys.Pidfd, req *schema.AttachRequest, capacity uint64) (*session, error) {
	outboxLimit := int(min(capacity, 4<<20))
	ringBytes := int64(2*(ring.HeaderSize+capacity)) + int64(outboxLimit)
	s.mu.Lock()
	att, serr := s.m.Attach(monotonic(), machine.AttachArgs{UID: cred.UID, PID: cred.PID, Req: req, RingBytes: ringBytes,
		MaxPayload: int(ring.DefaultMaxRecord(capacity)) - ring.RecordHeaderSize})
	s.mu.Unlock()
	if serr != nil {
		return nil, serr
	}
	undo := func() {
		out := new(machine.Output)
		s.mu.Lock()
		s.m.AttachFailed(monotonic(), att.Session, out)
		s.mu.Unlock()
		s.apply(out)
	}
	base := filepath.Join(s.cfg.Dir, fmt.Sprintf("s%d-%016x", att.Session, s.epoch))
	opts := ring.Options{Capacity: capacity, Mode: s.cfg.fileMode(), Epoch: s.epoch}
	sub, err := ring.Create(base+".sub", opts)
	if err != nil {
		undo()
		return nil, ringError(err)
	}
	sub.Remove()
	opts.CreatorProducer = true
	cmp, err := ring.Create(base+".cmp", opts)
	if err != nil {
		sub.Close()
		undo()
		return nil, ringError(err)
	}
	cmp.Remove()
	wait := ring.WaitConfig{Spin: s.cfg.Spin, Yield: s.cfg.Yield, Park: 10 * time.Millisecond, IdlePark: 160 * time.Millisecond}
	cons, err1 := ring.NewConsumer(sub.Ring, wait)
	prod, err2 := ring.NewProducer(cmp.Ring, wait)
	if err := errors.Join(err1, err2); err != nil {
		sub.Close()
		cmp.Close()
		undo()
		return nil, err
	}
	ss := &session{srv: s, id: att.Session, ns: att.Namespace, cred: cred, pidfd: pidfd, conn: conn, sub: sub, cmp: cmp, cons: cons, prod: prod}
	ss.log = s.log.With().Uint64("session", uint64(att.Session)).Str("instance", req.Instance).Uint32("rank", req.Rank).Int("pid", cred.PID).Logger()
	ss.ob = newOutbox(prod, cmp.MaxPayload(), outboxLimit, s.cfg.ReplyTimeout, func(err error) {
		ss.log.Warn().Err(err).Msg("completion ring: dropping the session")
		s.met.dropped.Inc()
		ss.shutdown("completion ring stuck: " + err.Error())
	})
	s.smu.Lock()
	s.sessions[ss.id] = ss
	s.smu.Unlock()
	if pidfd != nil && s.exits != nil {
		if err := s.exits.Watch(pidfd, func() { ss.shutdown("the attached process exited") }); err != nil {
			ss.log.Warn().Err(err).Msg("cannot watch the attached process")
		}
	}
	if pidfd != nil && pidfd.Exited() {
		ss.shutdown("the attached process exited")
	}
	s.met.attaches.Inc()
	ss.log.Info().Str("model", req.Model).Uint16("role", req.Role).Uint32("uid", cred.UID).Msg("attached")
	return ss, nil
}

// ringError maps a failure to create a session's rings to a status: a full
// shared-memory mount refuses the attach with status 8, with the reason.
func ringError(err error) error {
	if errors.Is(err, syscall.ENOSPC) {
		return schema.Errorf(schema.ErrCodeNoSpace, "no space for the session's rings in the shared-memory mount: %v", err)
	}
	if errors.Is(err, syscall.ENOMEM) {
		return schema.Errorf(schema.ErrCodeNoSpace, "no memory for the session's rings: %v", err)
	}
	return schema.Errorf(schema.ErrCodeInternal, "creating the session's rings: %v", err)
}
