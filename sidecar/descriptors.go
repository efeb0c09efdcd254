package sidecar

import (
	"encoding/binary"
	"errors"
	"net"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// maxFirstMessage bounds the first message of a connection to the attach
// socket: an AttachRequest (a few KiB), or a RegionDescriptors of the most
// segments and descriptors.
const maxFirstMessage = schema.RegionDescriptorsHeaderSize + 48 + schema.SegmentSize*schema.MaxSegments +
	schema.FDExtraHeaderSize + schema.FDAllocationSize*schema.MaxDescriptors

// registerDescriptors serves a RegionDescriptors message (docs/protocol.md,
// section 5.5.2): GPU memory an attached process shares by file
// descriptor, one per allocation, carried by the message (fds). It checks
// the sender (the process that attached the session, of an allowed uid),
// the message and the descriptors, registers the region with the machine
// and the copy engine, and answers on conn. Every descriptor received is
// closed: right after the copy engine imported them, or on the refusal.
// readErr and truncated are how reading the message went.
func (s *Server) registerDescriptors(conn *net.UnixConn, cred sys.Cred, allowed bool, msg []byte, fds []int, truncated bool, readErr error) {
	defer func() { sys.CloseFDs(fds) }()
	var region uint32
	answer := func(err error) {
		rep := schema.RegionDescriptorsReply{Version: schema.Version, Region: region}
		if err != nil {
			var se *schema.Error
			if !errors.As(err, &se) {
				se = schema.Errorf(schema.ErrCodeInternal, "%v", err)
			}
			rep.Status, rep.Message = se.Status, se.Message
			s.log.Warn().Str("status", se.Status.String()).Int("pid", cred.PID).Uint32("region", region).Int("descriptors", len(fds)).
				Msg("descriptor region refused: " + se.Message)
			s.met.status(binary.LittleEndian.AppendUint32(nil, uint32(se.Status))) // an error reply, by status
		}
		sys.CloseFDs(fds) // before the answer: the client may count its peer's descriptors once answered
		fds = nil
		conn.SetWriteDeadline(time.Now().Add(time.Second))
		conn.Write(rep.Append(nil))
		drainDescriptors(conn)
	}
	var m schema.RegionDescriptors
	switch err := m.Decode(msg); {
	case !allowed:
		answer(schema.Errorf(schema.ErrCodeNotPermitted, "uid %d is not allowed to attach (see --allow-uid)", cred.UID))
		return
	case readErr != nil:
		answer(schema.Errorf(schema.ErrCodeMalformed, "reading the RegionDescriptors message: %v", readErr))
		return
	case truncated:
		answer(schema.Errorf(schema.ErrCodeMalformed, "the RegionDescriptors message is longer than %d bytes or carries more than %d descriptors "+
			"(all closed)", maxFirstMessage, schema.MaxDescriptors))
		return
	case err != nil:
		answer(schema.Errorf(schema.ErrCodeMalformed, "%v (its %d descriptors closed)", err, len(fds)))
		return
	}
	region = m.Region.Region
	if m.Version < schema.MinVersion || m.Version > schema.Version {
		answer(schema.Errorf(schema.ErrCodeBadVersion, "client speaks protocol version %d, this sidecar %d to %d", m.Version, schema.MinVersion, schema.Version))
		return
	}
	if s.draining.Load() {
		answer(schema.Errorf(schema.ErrCodeShuttingDown, "the sidecar is shutting down"))
		return
	}
	ss := s.session(machine.SessionID(m.Session))
	switch {
	case m.Epoch != s.epoch:
		answer(schema.Errorf(schema.ErrCodeNotPermitted, "epoch %#x is not this sidecar's (%#x): the session belongs to another run of the sidecar; attach again",
			m.Epoch, s.epoch))
		return
	case ss == nil || ss.closed.Load():
		answer(schema.Errorf(schema.ErrCodeNotPermitted, "session %d is not attached", m.Session))
		return
	case cred.PID <= 0 || cred.PID != ss.cred.PID || cred.UID != ss.cred.UID:
		answer(schema.Errorf(schema.ErrCodeNotPermitted, "only the process that attached session %d (pid %d) may register its memory; this is pid %d, uid %d "+
			"(a pid of 0: another pid namespace, which the sidecar cannot tell apart)", m.Session, ss.cred.PID, cred.PID, cred.UID))
		return
	case !ss.alive():
		answer(schema.Errorf(schema.ErrCodeNotPermitted, "the process that attached session %d has exited", m.Session))
		return
	}
	for i, fd := range fds {
		if kind, target, notFile := sys.FDKind(fd); notFile {
			answer(schema.Errorf(schema.ErrCodeNotPermitted, "descriptor %d is a %s (%s), not a CUDA allocation (all %d closed)", i, kind, target, len(fds)))
			return
		}
	}
	out := s.outs.Get().(*machine.Output)
	defer s.outs.Put(out)
	s.mu.Lock()
	err := s.m.RegisterDescriptors(monotonic(), ss.id, &m.Region, len(fds), out)
	s.mu.Unlock()
	if err != nil {
		answer(err)
		return
	}
	rg := out.Registers[0]
	g := rg.Region
	g.IPC.Allocations = append([]gpu.IPCAllocation(nil), g.IPC.Allocations...)
	for i := range g.IPC.Allocations {
		g.IPC.Allocations[i].FD = fds[g.IPC.Allocations[i].FD] // the machine named each by its index
	}
	h, err := s.copier.Register(g)
	sys.CloseFDs(fds) // the imports hold the memory
	fds = nil
	if err == nil {
		s.sched.route(h, g)
	}
	var res error
	s.machineCall(func(o *machine.Output) { res = s.m.RegisterDone(monotonic(), rg.Session, rg.ID, h, err, o) })
	if res == nil {
		ss.log.Info().Uint32("region", rg.ID).Int("allocations", len(g.IPC.Allocations)).Uint64("page_size", g.PageSize).
			Uint32("pages", g.PageCount).Msg("registered GPU memory shared by file descriptor")
	}
	answer(res)
}

// drainDescriptors reads (bounded: drainMessages datagrams within
// drainWait) what a client sent after its RegionDescriptors, closing the
// descriptors that came with it, until the client closes its end:
// closing a connection with datagrams unread resets it, and the client
// would lose the answer.
func drainDescriptors(conn *net.UnixConn) {
	conn.SetReadDeadline(time.Now().Add(drainWait))
	buf := make([]byte, 64)
	for range drainMessages {
		n, fds, _, err := sys.ReadFDs(conn, buf, schema.MaxDescriptors)
		sys.CloseFDs(fds)
		if err != nil || (n == 0 && len(fds) == 0) {
			return
		}
	}
}

const (
	drainMessages = 64
	drainWait     = 100 * time.Millisecond
)
