// Package node is the node tier (docs/architecture.md, "The node tier"):
// `ringside node`, one process per node that owns a pool of KV blocks in
// node memory (Server), and the sidecar's client of it (Client), which
// sidecar/tier.go drives as it drives the Redis tier.
//
// The node process maps its pool alone. Each attached sidecar gets a window
// of its own (a sealed memfd passed over the socket); block bytes move
// between a sidecar's pod pool and the node's pool through that window, and
// the node does the copies into and out of its pool itself, checking every
// value it takes (header and CRC32C, computed over its own copy).
package node

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/internal/sys"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/node/wire"
)

// ServerConfig configures a Server (`ringside node`).
type ServerConfig struct {
	// Dir holds the socket and the lock; a host directory only ringside
	// containers mount.
	Dir string
	// Socket is the socket's path (default Dir/node.sock).
	Socket string
	// PoolBytes is the pool's size; SlotBytes the largest payload of a
	// block (each slot takes SlotBytes + SlotHeadroom).
	PoolBytes, SlotBytes uint64
	// Reserve allocates the pool's pages at start.
	Reserve bool
	// PodShare is the part of the pool one pod's writes may hold.
	PodShare float64
	// PodIdentity is what makes a pod: IdentityNetNS (the network
	// namespace the kernel reports for a connection, which a sidecar
	// cannot choose) or IdentityDeclared (the name in its Hello).
	PodIdentity string
	// MaxPods bounds connections; ConnsPerPod those of one pod;
	// MaxNamespaces the namespaces of one connection; WindowSlots the
	// slots of each connection's window.
	MaxPods, ConnsPerPod, MaxNamespaces, WindowSlots int
	// IOTimeout bounds the Hello's arrival after a connect and every
	// reply's write: a sidecar that does not read its replies is dropped.
	IOTimeout time.Duration
	// AllowUIDs may attach besides the node process's own uid.
	AllowUIDs []uint32
	// GroupAccess makes Dir and the socket group-accessible (0770, 0660).
	GroupAccess bool
	// DescBytes bounds the block descriptions the node keeps for KV
	// events, all namespaces together.
	DescBytes int64
}

// Defaults.
const (
	DefaultDir           = "/run/ringside-node"
	DefaultPoolBytes     = 4 << 30
	DefaultSlotBytes     = machine.DefaultSlotBytes
	DefaultPodShare      = 0.125
	DefaultMaxPods       = 16
	DefaultConnsPerPod   = 2
	DefaultMaxNamespaces = 64
	DefaultWindowSlots   = 64
	DefaultIOTimeout     = 2 * time.Second
	DefaultDescBytes     = 64 << 20
	// SlotHeadroom is what a slot holds beside its payload: the value's
	// header, rounded up to keep slots and payloads page-aligned (the
	// header sits just before the payload's page).
	SlotHeadroom = 4096
	// SocketName is the socket's name in Dir.
	SocketName = "node.sock"
)

// Pod identities (--pod-identity).
const (
	// IdentityNetNS: a pod is a network namespace, as Kubernetes makes one
	// per pod; the kernel reports a connection's (SO_NETNS_COOKIE).
	IdentityNetNS = "netns"
	// IdentityDeclared: a pod is the name its sidecar declares (for pods
	// that share the node's network namespace, hostNetwork, and trust
	// each other).
	IdentityDeclared   = "declared"
	DefaultPodIdentity = IdentityNetNS
)

// EnsureDefaults fills zero fields.
func (c *ServerConfig) EnsureDefaults() {
	if c.Dir == "" {
		c.Dir = DefaultDir
	}
	if c.Socket == "" {
		c.Socket = filepath.Join(c.Dir, SocketName)
	}
	if c.PoolBytes == 0 {
		c.PoolBytes = DefaultPoolBytes
	}
	if c.SlotBytes == 0 {
		c.SlotBytes = DefaultSlotBytes
	}
	if c.PodShare == 0 {
		c.PodShare = DefaultPodShare
	}
	if c.MaxPods == 0 {
		c.MaxPods = DefaultMaxPods
	}
	if c.ConnsPerPod == 0 {
		c.ConnsPerPod = DefaultConnsPerPod
	}
	if c.PodIdentity == "" {
		c.PodIdentity = DefaultPodIdentity
	}
	if c.MaxNamespaces == 0 {
		c.MaxNamespaces = DefaultMaxNamespaces
	}
	if c.WindowSlots == 0 {
		c.WindowSlots = DefaultWindowSlots
	}
	if c.IOTimeout == 0 {
		c.IOTimeout = DefaultIOTimeout
	}
	if c.DescBytes == 0 {
		c.DescBytes = DefaultDescBytes
	}
}

// Stride is the bytes a slot (of the pool or a window) takes.
func (c *ServerConfig) Stride() uint64 { return c.SlotBytes + SlotHeadroom }

// Validate reports every bad field, each naming its flag.
func (c *ServerConfig) Validate() error {
	var errs []error
	bad := func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--%s: %s", flag, fmt.Sprintf(format, args...)))
	}
	if c.SlotBytes < 4096 || c.SlotBytes > 1<<30 || c.SlotBytes%4096 != 0 {
		bad("pool.slot-bytes", "%d: a multiple of 4 KiB, from 4 KiB to 1 GiB", c.SlotBytes)
	}
	if c.PoolBytes < 2*c.Stride() || c.PoolBytes > 1<<40 {
		bad("pool.bytes", "%d: at least two slots of %d bytes, at most 1 TiB", c.PoolBytes, c.Stride())
	}
	if c.PodShare <= 0 || c.PodShare > 1 {
		bad("pod-share", "%v: in (0, 1]", c.PodShare)
	}
	if c.MaxPods < 1 || c.MaxPods > 1024 {
		bad("max-pods", "%d: 1 to 1024", c.MaxPods)
	}
	if c.ConnsPerPod < 1 || c.ConnsPerPod > c.MaxPods {
		bad("conns-per-pod", "%d: 1 to --max-pods (%d)", c.ConnsPerPod, c.MaxPods)
	}
	if c.PodIdentity != IdentityNetNS && c.PodIdentity != IdentityDeclared {
		bad("pod-identity", "%q: %s or %s", c.PodIdentity, IdentityNetNS, IdentityDeclared)
	}
	if c.MaxNamespaces < 1 || c.MaxNamespaces > 4096 {
		bad("max-namespaces", "%d: 1 to 4096", c.MaxNamespaces)
	}
	if c.WindowSlots < 2 || c.WindowSlots > 4096 {
		bad("window-slots", "%d: 2 to 4096", c.WindowSlots)
	}
	if c.IOTimeout < time.Millisecond {
		bad("io-timeout", "%v: at least 1ms", c.IOTimeout)
	}
	if c.DescBytes < 1<<20 || c.DescBytes > 1<<36 {
		bad("pool.desc-bytes", "%d: 1 MiB to 64 GiB", c.DescBytes)
	}
	return errors.Join(errs...)
}

// Server is a running node tier.
type Server struct {
	cfg ServerConfig
	log zerolog.Logger
	// clog logs what connections do. Sidecars connect at will, a hostile
	// one as fast as it can, so it is sampled: 50 lines a second, then one
	// in 1,000 (the counters count every event).
	clog   zerolog.Logger
	pool   *shm.Mapping
	stride uint64
	epoch  uint64
	ln     *net.UnixListener
	lock   *sys.FileLock

	mu    sync.Mutex // guards idx, ev, conns and pending
	idx   *index
	ev    *events
	conns map[*srvConn]struct{}
	// pending counts connections not yet past their Hello, by the
	// network namespace they came from, and all together (pendingAll):
	// each holds a goroutine and a message buffer until its Hello or
	// --io-timeout, so a sidecar connecting in a loop must not hold many.
	pending    map[uint64]int
	pendingAll int

	met ServerStats
	// beforeCopy, when set (tests), runs in a Fetch after the value is
	// pinned and before its copy into the pod's pool: a node stalled
	// mid-fetch.
	beforeCopy atomic.Pointer[func()]
	wg         sync.WaitGroup
	stop       chan struct{}
	done       chan struct{} // closed when Serve has released everything
	once       sync.Once
}

// ServerStats are the node's counts (atomics).
type ServerStats struct {
	Attaches, AttachRefused                 atomic.Uint64
	PendingRefused, AcceptErrors            atomic.Uint64 // connections closed at once: their pod, or the node, had too many without a Hello; accept(2) failures (out of descriptors), retried
	AttachPodLimit, AttachRenamed           atomic.Uint64 // attaches refused past --conns-per-pod; attaches under another name than the pod's first
	Lookups, LookupBlocks, LookupHits       atomic.Uint64
	GetItems, GetHits                       atomic.Uint64
	PutItems, PutStored, PutExists, PutFull atomic.Uint64
	Rejected, Malformed, NotRegistered      atomic.Uint64
	Dropped                                 atomic.Uint64 // connections ended for not reading their replies, or a bad header
	Described, DescribeRefused, EventReads  atomic.Uint64
	FetchNotResident, FetchFaults           atomic.Uint64 // Fetch items refused: the pod's pool range not in memory; a fault under the copy
	BytesIn, BytesOut                       atomic.Uint64
}

// NewServer creates the pool and the socket. Call Serve to run.
func NewServer(cfg ServerConfig, log zerolog.Logger) (*Server, error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	mode := os.FileMode(0o700)
	if cfg.GroupAccess {
		mode = 0o770
	}
	if err := os.MkdirAll(cfg.Dir, mode); err != nil {
		return nil, fmt.Errorf("--dir: %w", err)
	}
	// Write-only: the sidecars see the directory through a read-only
	// mount, as the node's uid; a lock file they could open they could
	// hold, and no node process could start again.
	lock, err := sys.TryLockWriteOnly(filepath.Join(cfg.Dir, "node.lock"), []byte(strconv.Itoa(os.Getpid())+"\n"))
	if err != nil {
		return nil, fmt.Errorf("--dir %s: another node process holds it: %w", cfg.Dir, err)
	}
	s := &Server{cfg: cfg, log: log, clog: log.Sample(&zerolog.BurstSampler{Burst: 50, Period: time.Second, NextSampler: &zerolog.BasicSampler{N: 1000}}), stride: cfg.Stride(), lock: lock, conns: map[*srvConn]struct{}{}, pending: map[uint64]int{}, stop: make(chan struct{}), done: make(chan struct{})}
	slots := cfg.PoolBytes / s.stride
	s.pool, err = shm.CreateMemfd("ringside-node-pool", int(slots*s.stride), cfg.Reserve)
	if err != nil {
		lock.Unlock()
		return nil, fmt.Errorf("--pool.bytes: %w", err)
	}
	share := int(float64(slots) * cfg.PodShare)
	s.idx = newIndex(int(slots), share)
	s.ev = newEvents(cfg.DescBytes)
	s.idx.onRemove = func(key string) {
		// key: fingerprint (16), digest (its width), rank (2)
		s.ev.removed([16]byte([]byte(key[:16])), key[16:len(key)-2])
	}
	var e [8]byte
	rand.Read(e[:])
	s.epoch = binary.LittleEndian.Uint64(e[:])
	if err := shm.Unlink(cfg.Socket); err != nil {
		s.closeResources()
		return nil, err
	}
	s.ln, err = net.ListenUnix("unixpacket", &net.UnixAddr{Name: cfg.Socket, Net: "unixpacket"})
	if err != nil {
		s.closeResources()
		return nil, fmt.Errorf("--socket: %w", err)
	}
	if cfg.GroupAccess {
		os.Chmod(cfg.Socket, 0o660)
	} else {
		os.Chmod(cfg.Socket, 0o600)
	}
	if cfg.PodIdentity == IdentityNetNS {
		if _, err := sys.NetNSCookie(s.ln); err != nil {
			s.closeResources()
			return nil, fmt.Errorf("--pod-identity %s needs Linux 5.14 or later, whose sockets report their network namespace: %w; on an older kernel use --pod-identity %s (docs/architecture.md, \"The node tier\")", IdentityNetNS, err, IdentityDeclared)
		}
	}
	log.Info().Str("socket", cfg.Socket).Uint64("pool_bytes", slots*s.stride).Uint64("slots", slots).Uint64("slot_bytes", cfg.SlotBytes).
		Int("pod_share_slots", max(share, 1)).Int("max_pods", cfg.MaxPods).Int("conns_per_pod", cfg.ConnsPerPod).Str("pod_identity", cfg.PodIdentity).Int("window_slots", cfg.WindowSlots).Msg("node tier ready")
	return s, nil
}

// Socket is the socket's path.
func (s *Server) Socket() string { return s.cfg.Socket }

// Epoch is this process's epoch (in every HelloReply).
func (s *Server) Epoch() uint64 { return s.epoch }

// Stats returns the counts.
func (s *Server) Stats() *ServerStats { return &s.met }

// Index returns the pool's state.
func (s *Server) Index() IndexStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.idx.stats()
}

// Conns is the number of attached connections.
func (s *Server) Conns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// OwnerUsed is the slots charged to the pod whose identity is name: the
// declared name, or NetNSIdentity of the pod's cookie (tests, inspection).
func (s *Server) OwnerUsed(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o := s.idx.owners[name]; o != nil {
		return o.used
	}
	return 0
}

// NetNSIdentity is the identity of the pod in the network namespace of
// cookie, under --pod-identity netns.
func NetNSIdentity(cookie uint64) string { return "netns:" + strconv.FormatUint(cookie, 10) }

// ShareSlots is the slots one pod may hold.
func (s *Server) ShareSlots() int { return s.idx.share }

// checkIndex verifies the index's invariants (tests).
func (s *Server) checkIndex() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.idx.check()
}

// Serve accepts connections until ctx ends or Shutdown, then closes every
// connection and waits for them.
func (s *Server) Serve(ctx context.Context) error {
	go func() {
		select {
		case <-ctx.Done():
			s.Shutdown()
		case <-s.stop:
		}
	}()
	var err error
	var delay time.Duration
accept:
	for {
		c, aerr := s.ln.AcceptUnix()
		if aerr != nil {
			select {
			case <-s.stop:
				break accept
			default:
			}
			if errors.Is(aerr, net.ErrClosed) {
				err = aerr
				s.Shutdown()
				break
			}
			// Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): a
			// flood of connections must not end the tier. Retry, backing
			// off as net/http does.
			s.met.AcceptErrors.Add(1)
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.clog.Warn().Err(aerr).Dur("retry_in", delay).Msg("accept failed")
			select {
			case <-s.stop:
				break accept
			case <-time.After(delay):
			}
			continue
		}
		delay = 0
		cookie, cerr := sys.NetNSCookie(c)
		if !s.admitPending(cookie) {
			s.met.AttachRefused.Add(1)
			s.met.PendingRefused.Add(1)
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(c, cookie, cerr)
		}()
	}
	s.wg.Wait()
	s.closeResources()
	s.log.Info().Msg("node tier stopped")
	close(s.done)
	return err
}

// admitPending counts a new connection from the network namespace cookie
// as pending, unless that namespace has --conns-per-pod pending already
// (under --pod-identity declared, where pods may share one: --max-pods),
// or the node twice --max-pods.
func (s *Server) admitPending(cookie uint64) bool {
	per := s.cfg.ConnsPerPod
	if s.cfg.PodIdentity == IdentityDeclared {
		per = s.cfg.MaxPods
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending[cookie] >= per || s.pendingAll >= 2*s.cfg.MaxPods {
		return false
	}
	s.pending[cookie]++
	s.pendingAll++
	return true
}

func (s *Server) donePending(cookie uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending[cookie]--; s.pending[cookie] == 0 {
		delete(s.pending, cookie)
	}
	s.pendingAll--
}

// Done is closed once Serve has returned everything it held (the pool, the
// socket, the directory's lock).
func (s *Server) Done() <-chan struct{} { return s.done }

// Shutdown stops accepting and ends every connection.
func (s *Server) Shutdown() {
	s.once.Do(func() {
		close(s.stop)
		s.ln.Close()
		// Each connection's reads end; its goroutine then closes it, after
		// any copy into the pod's pool: the sidecar takes the socket's end
		// to mean that no copy of this node's into its pool is left.
		s.mu.Lock()
		for c := range s.conns {
			c.sock.CloseRead()
		}
		s.mu.Unlock()
	})
}

func (s *Server) closeResources() {
	if s.pool != nil {
		s.pool.Close()
	}
	shm.Unlink(s.cfg.Socket)
	s.lock.Unlock()
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

// srvConn is one attached sidecar.
type srvConn struct {
	s     *Server
	sock  *net.UnixConn
	pod   string
	owner *owner
	win   *shm.Mapping
	// podPool is the pod's pool (nil: the sidecar passed none; its
	// fetches go through the window); vec is mincore's scratch.
	podPool *shm.Mapping
	vec     []byte
	ns      map[[16]byte]wire.NS
	keyBuf  []byte
	out     []byte
}

// serveConn runs one connection: the Hello, then requests in order.
// cookie is its network namespace's (cerr: the kernel did not say), which
// admitPending counted as pending until the Hello is done.
func (s *Server) serveConn(sock *net.UnixConn, cookie uint64, cerr error) {
	defer sock.Close()
	pending := true
	donePending := func() {
		if pending {
			pending = false
			s.donePending(cookie)
		}
	}
	defer donePending()
	c := &srvConn{s: s, sock: sock, ns: map[[16]byte]wire.NS{}}
	buf := make([]byte, wire.MaxMessage+1)
	sock.SetReadDeadline(time.Now().Add(s.cfg.IOTimeout))
	n, fds, trunc, err := sys.ReadFDs(sock, buf, 1)
	if err != nil || trunc {
		sys.CloseFDs(fds)
		s.met.AttachRefused.Add(1)
		return
	}
	h, body, err := wire.DecodeHeader(buf[:n])
	refuse := func(st wire.Status, why string) {
		s.met.AttachRefused.Add(1)
		s.clog.Warn().Str("status", st.String()).Msg("attach refused: " + why)
		c.reply(wire.TypeHello|wire.ReplyBit, h.ID, wire.HelloReply{Status: st}.Append, nil)
	}
	if errors.Is(err, wire.ErrVersion) {
		sys.CloseFDs(fds)
		refuse(wire.BadVersion, err.Error())
		return
	}
	if err != nil || h.Type != wire.TypeHello {
		sys.CloseFDs(fds)
		s.met.AttachRefused.Add(1)
		return
	}
	hello, err := wire.DecodeHello(body)
	if err != nil {
		sys.CloseFDs(fds)
		refuse(wire.Malformed, err.Error())
		return
	}
	cred, err := sys.PeerCred(sock)
	if err != nil || !s.uidAllowed(cred.UID) {
		sys.CloseFDs(fds)
		refuse(wire.Denied, fmt.Sprintf("uid %d may not attach (--allow-uid)", cred.UID))
		return
	}
	if len(fds) > 1 {
		sys.CloseFDs(fds)
		refuse(wire.Malformed, fmt.Sprintf("a hello with %d descriptors (one at most: the pod's pool)", len(fds)))
		return
	}
	if len(fds) == 1 {
		// The pod's pool, which Fetch copies into: a file in memory (a
		// copy never waits on a device or a server), mapped here until
		// the connection ends. The pod may still truncate it: every copy
		// into it is fault-safe.
		if !shm.OnMemoryFS(fds[0]) {
			sys.CloseFDs(fds)
			refuse(wire.Malformed, "the pod's pool is not a file in memory (tmpfs or hugetlbfs)")
			return
		}
		if c.podPool, err = shm.OpenFD(fds[0], "pod-pool", 4096); err != nil {
			refuse(wire.Malformed, "the pod's pool: "+err.Error())
			return
		}
		defer c.podPool.Close()
	}
	c.pod = hello.Pod
	id := c.pod
	if s.cfg.PodIdentity == IdentityNetNS {
		if cerr != nil {
			refuse(wire.Denied, "its network namespace: "+cerr.Error())
			return
		}
		id = NetNSIdentity(cookie)
	}
	s.mu.Lock()
	if len(s.conns) >= s.cfg.MaxPods {
		s.mu.Unlock()
		refuse(wire.Limit, fmt.Sprintf("%d connections already (--max-pods)", s.cfg.MaxPods))
		return
	}
	if o := s.idx.owners[id]; o != nil && o.conns >= s.cfg.ConnsPerPod && s.liveConns(o) >= s.cfg.ConnsPerPod {
		n := o.conns
		s.mu.Unlock()
		s.met.AttachPodLimit.Add(1)
		refuse(wire.Limit, fmt.Sprintf("pod %s (declaring %q) has %d connections already (--conns-per-pod); under --pod-identity %s, pods that share the node's network namespace (hostNetwork) count as one", id, c.pod, n, IdentityNetNS))
		return
	}
	select {
	case <-s.stop:
		s.mu.Unlock()
		return
	default:
	}
	s.conns[c] = struct{}{}
	c.owner = s.idx.attach(id)
	if c.owner.declared == "" {
		c.owner.declared = c.pod
	}
	first := c.owner.declared
	s.mu.Unlock()
	if first != c.pod {
		// Another name from the same pod: a sidecar renamed, or pods in
		// one network namespace (hostNetwork), which share a share.
		s.met.AttachRenamed.Add(1)
		s.clog.Warn().Str("pod", c.pod).Str("identity", id).Str("first_declared", first).
			Msg("a sidecar declared another pod name than its pod's first: both are charged to one share (pods in the node's network namespace count as one under --pod-identity netns)")
	}
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.idx.detach(c.owner)
		s.mu.Unlock()
	}()
	// Allocated now: charged to the node process, not to whichever
	// side first touches a page.
	c.win, err = shm.CreateMemfd("ringside-node-window", s.cfg.WindowSlots*int(s.stride), true)
	if err != nil {
		refuse(wire.Limit, "window: "+err.Error())
		return
	}
	defer c.win.Close()
	rep := wire.HelloReply{Status: wire.OK, WindowSlots: uint32(s.cfg.WindowSlots), SlotStride: s.stride, MaxPayload: s.cfg.SlotBytes,
		PoolBytes: uint64(s.pool.Len()), ShareBytes: uint64(s.idx.share) * s.stride, Epoch: s.epoch, MaxNamespaces: uint32(s.cfg.MaxNamespaces)}
	if err := c.reply(wire.TypeHello|wire.ReplyBit, h.ID, rep.Append, []int{c.win.FD()}); err != nil {
		return
	}
	s.met.Attaches.Add(1)
	s.clog.Info().Str("pod", c.pod).Str("identity", id).Int("pid", cred.PID).Uint32("uid", cred.UID).Msg("sidecar attached")
	defer s.clog.Info().Str("pod", c.pod).Msg("sidecar detached")
	sock.SetReadDeadline(time.Time{})
	donePending()
	for {
		n, fds, trunc, err := sys.ReadFDs(sock, buf, 1)
		sys.CloseFDs(fds)
		if err != nil || n == 0 {
			return // closed, or shut down (Shutdown)
		}
		if trunc || len(fds) > 0 {
			s.met.Dropped.Add(1)
			s.clog.Warn().Str("pod", c.pod).Msg("dropped: a request over 64 KiB or carrying descriptors")
			return
		}
		h, body, err := wire.DecodeHeader(buf[:n])
		if err != nil {
			s.met.Dropped.Add(1)
			s.clog.Warn().Str("pod", c.pod).Err(err).Msg("dropped: a bad header")
			return
		}
		if err := c.handle(h, body); err != nil {
			s.met.Dropped.Add(1)
			s.clog.Warn().Str("pod", c.pod).Err(err).Msg("dropped: its reply could not be written (it does not read)")
			return
		}
	}
}

// liveConns counts o's connections whose peer has not closed: one closed
// (a sidecar that restarted) whose goroutine has not yet seen the end does
// not hold a place. The caller holds s.mu.
func (s *Server) liveConns(o *owner) int {
	n := 0
	for c := range s.conns {
		if c.owner == o && !sys.PeerClosed(c.sock) {
			n++
		}
	}
	return n
}

// reply writes one message within the write deadline.
func (c *srvConn) reply(t wire.Type, id uint64, body func([]byte) []byte, fds []int) error {
	c.out = body(wire.Header{Type: t, ID: id}.Append(c.out[:0]))
	c.sock.SetWriteDeadline(time.Now().Add(c.s.cfg.IOTimeout))
	var oob []byte
	if len(fds) > 0 {
		oob = syscall.UnixRights(fds...)
	}
	_, _, err := c.sock.WriteMsgUnix(c.out, oob, nil)
	return err
}

func (c *srvConn) status(t wire.Type, id uint64, st wire.Status, v uint32) error {
	return c.reply(t|wire.ReplyBit, id, wire.StatusReply{Status: st, Value: v}.Append, nil)
}

// handle serves one request; an error means its reply could not be sent.
func (c *srvConn) handle(h wire.Header, body []byte) error {
	s := c.s
	switch h.Type {
	case wire.TypeRegister:
		ns, err := wire.DecodeNS(body)
		if err != nil {
			s.met.Malformed.Add(1)
			return c.status(h.Type, h.ID, wire.Malformed, 0)
		}
		if old, ok := c.ns[ns.FP]; ok {
			if old != ns {
				return c.status(h.Type, h.ID, wire.Mismatch, 0)
			}
			return c.status(h.Type, h.ID, wire.OK, 0)
		}
		if len(c.ns) >= s.cfg.MaxNamespaces {
			return c.status(h.Type, h.ID, wire.Limit, 0)
		}
		c.ns[ns.FP] = ns
		return c.status(h.Type, h.ID, wire.OK, 0)
	case wire.TypeLookup:
		lk, err := wire.DecodeLookup(body)
		if err != nil {
			s.met.Malformed.Add(1)
			return c.status(h.Type, h.ID, wire.Malformed, 0)
		}
		ns, ok := c.ns[lk.FP]
		if !ok {
			s.met.NotRegistered.Add(1)
			return c.status(h.Type, h.ID, wire.NotRegistered, 0)
		}
		if lk.Width != int(ns.Width) || len(lk.Digests)/lk.Width*int(ns.World) > wire.MaxLookupKeys {
			s.met.Malformed.Add(1)
			return c.status(h.Type, h.ID, wire.Malformed, 0)
		}
		found := c.lookup(ns, lk.Digests)
		s.met.Lookups.Add(1)
		s.met.LookupBlocks.Add(uint64(len(lk.Digests) / lk.Width))
		s.met.LookupHits.Add(uint64(found))
		return c.status(h.Type, h.ID, wire.OK, uint32(found))
	case wire.TypePut:
		m, err := wire.DecodeItems(body)
		var ns wire.NS
		st := wire.OK
		switch {
		case err != nil:
			st = wire.Malformed
		default:
			var ok bool
			if ns, ok = c.ns[m.FP]; !ok {
				st = wire.NotRegistered
			} else if !c.itemsValid(ns, m.Items) {
				st = wire.Malformed
			}
		}
		if st != wire.OK {
			c.refused(st)
			return c.reply(h.Type|wire.ReplyBit, h.ID, wire.ItemsReply{Status: st}.Append, nil)
		}
		res := make([]wire.ItemReply, len(m.Items))
		for i := range m.Items {
			res[i] = c.put(ns, &m.Items[i])
		}
		return c.reply(h.Type|wire.ReplyBit, h.ID, wire.ItemsReply{Status: wire.OK, Items: res}.Append, nil)
	case wire.TypeFetch:
		m, err := wire.DecodeFetch(body)
		var ns wire.NS
		st := wire.OK
		switch {
		case err != nil:
			st = wire.Malformed
		case c.podPool == nil:
			st = wire.Malformed // no pool to fetch into
		default:
			var ok bool
			if ns, ok = c.ns[m.FP]; !ok {
				st = wire.NotRegistered
			} else if !c.fetchValid(ns, m.Items) {
				st = wire.Malformed
			}
		}
		if st != wire.OK {
			c.refused(st)
			return c.reply(h.Type|wire.ReplyBit, h.ID, wire.FetchReply{Status: st}.Append, nil)
		}
		res := make([]wire.FetchReplyItem, len(m.Items))
		for i := range m.Items {
			res[i] = c.fetch(ns, &m.Items[i])
		}
		return c.reply(h.Type|wire.ReplyBit, h.ID, wire.FetchReply{Status: wire.OK, Items: res}.Append, nil)
	case wire.TypeDescribe:
		m, err := wire.DecodeDescribe(body)
		if err != nil {
			s.met.Malformed.Add(1)
			return c.reply(h.Type|wire.ReplyBit, h.ID, wire.ItemsReply{Status: wire.Malformed}.Append, nil)
		}
		ns, ok := c.ns[m.FP]
		if !ok {
			s.met.NotRegistered.Add(1)
			return c.reply(h.Type|wire.ReplyBit, h.ID, wire.ItemsReply{Status: wire.NotRegistered}.Append, nil)
		}
		return c.reply(h.Type|wire.ReplyBit, h.ID, wire.ItemsReply{Status: wire.OK, Items: c.describe(ns, m.Entries)}.Append, nil)
	case wire.TypeEvents:
		m, err := wire.DecodeEvents(body)
		if err != nil {
			s.met.Malformed.Add(1)
			return c.reply(h.Type|wire.ReplyBit, h.ID, wire.EventsReply{Status: wire.Malformed}.Append, nil)
		}
		ns, ok := c.ns[m.FP]
		if !ok {
			s.met.NotRegistered.Add(1)
			return c.reply(h.Type|wire.ReplyBit, h.ID, wire.EventsReply{Status: wire.NotRegistered}.Append, nil)
		}
		s.met.EventReads.Add(1)
		s.mu.Lock()
		rep := s.ev.read(ns.FP, int(ns.Width), m.Cursor, int(m.Max), wire.MaxMessage-wire.HeaderSize-16)
		s.mu.Unlock()
		return c.reply(h.Type|wire.ReplyBit, h.ID, rep.Append, nil)
	}
	s.met.Malformed.Add(1)
	return c.status(h.Type, h.ID, wire.Malformed, 0)
}

// refused counts a request refused whole: malformed, or naming a
// namespace the connection did not register.
func (c *srvConn) refused(st wire.Status) {
	if st == wire.Malformed {
		c.s.met.Malformed.Add(1)
	} else {
		c.s.met.NotRegistered.Add(1)
	}
}

// itemsValid checks items against the connection: the digest's padding,
// the rank, the window slot and a Put's length.
func (c *srvConn) itemsValid(ns wire.NS, items []wire.Item) bool {
	for _, it := range items {
		for _, b := range it.Digest[ns.Width:] {
			if b != 0 {
				return false
			}
		}
		if it.Rank >= ns.World || it.Slot >= uint32(c.s.cfg.WindowSlots) {
			return false
		}
		if it.Length <= l2.HeaderSize || it.Length > l2.HeaderSize+c.s.cfg.SlotBytes {
			return false
		}
	}
	return true
}

// fetchValid checks a Fetch's items against the connection: the digest's
// padding, the rank, and that each item's range lies in the pod's pool.
func (c *srvConn) fetchValid(ns wire.NS, items []wire.FetchItem) bool {
	size := uint64(c.podPool.Len())
	for _, it := range items {
		if !zero(it.Digest[ns.Width:]) || it.Rank >= ns.World || it.Max > size || it.Offset > size-it.Max {
			return false
		}
	}
	return true
}

// fetch copies a value's payload from the pool into the pod's pool at the
// item's offset, checksumming it in the same pass (the slot is pinned:
// nothing writes it meanwhile), and
// returns the value's header with that checksum: the sidecar checks the
// two. A payload larger than the item allows is not copied (NotFound:
// another block size); nor is one whose destination is not all in memory
// (a write there would allocate the pod's memory as the node's), and a
// fault under the copy (the pod truncated its pool) is answered Fault.
func (c *srvConn) fetch(ns wire.NS, it *wire.FetchItem) wire.FetchReplyItem {
	s := c.s
	s.met.GetItems.Add(1)
	k := c.key(ns, it.Digest[:ns.Width], it.Rank)
	s.mu.Lock()
	i, n, ok := s.idx.pin(k)
	s.mu.Unlock()
	if !ok {
		return wire.FetchReplyItem{Status: wire.NotFound}
	}
	defer func() {
		s.mu.Lock()
		s.idx.unpin(i)
		s.mu.Unlock()
	}()
	v := c.value(uint64(i), n)
	p := n - l2.HeaderSize
	if p > it.Max {
		return wire.FetchReplyItem{Status: wire.NotFound}
	}
	dst := c.podPool.Bytes()[it.Offset : it.Offset+p]
	var resident bool
	resident, c.vec, _ = shm.Resident(dst, c.vec)
	if !resident {
		s.met.FetchNotResident.Add(1)
		return wire.FetchReplyItem{Status: wire.NotResident}
	}
	if f := s.beforeCopy.Load(); f != nil {
		(*f)()
	}
	crc, ok := copyFaultSafe(dst, v[l2.HeaderSize:])
	if !ok {
		s.met.FetchFaults.Add(1)
		return wire.FetchReplyItem{Status: wire.Fault}
	}
	r := wire.FetchReplyItem{Status: wire.OK, CRC: crc, Length: p}
	copy(r.Header[:], v[:l2.HeaderSize])
	s.met.GetHits.Add(1)
	s.met.BytesOut.Add(p)
	return r
}

// copyFaultSafe is l2.CopyOutCRC (the node never reads a pod's pool
// back), false if dst faulted under it (a pod's pool truncated, or on a
// full mount).
func copyFaultSafe(dst, src []byte) (crc uint32, ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if _, fault := r.(interface{ Addr() uintptr }); !fault {
				panic(r)
			}
			ok = false
		}
	}()
	return l2.CopyOutCRC(dst, src), true
}

// key is the index's key of rank's value of digest in ns.
func (c *srvConn) key(ns wire.NS, digest []byte, rank uint16) string {
	b := append(c.keyBuf[:0], ns.FP[:]...)
	b = append(b, digest...)
	b = binary.LittleEndian.AppendUint16(b, rank)
	c.keyBuf = b
	return string(b)
}

func (c *srvConn) lookup(ns wire.NS, digests []byte) int {
	w := int(ns.Width)
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	found := 0
	for i := 0; i+w <= len(digests); i += w {
		for r := uint16(0); r < ns.World; r++ {
			c.keyBuf = append(append(append(c.keyBuf[:0], ns.FP[:]...), digests[i:i+w]...), byte(r), byte(r>>8))
			if j, ok := c.s.idx.byKey[string(c.keyBuf)]; !ok || c.s.idx.slots[j].state != slotPresent {
				return found
			}
		}
		found++
	}
	return found
}

func (c *srvConn) slot(pool []byte, i uint64) []byte {
	return pool[i*c.s.stride : (i+1)*c.s.stride]
}

// value is the n bytes of pool slot i's value: placed so that its payload
// starts on a page, as a pod pool's slot does (a fetch's copy then runs
// aligned on both sides).
func (c *srvConn) value(i, n uint64) []byte {
	off := i*c.s.stride + SlotHeadroom - l2.HeaderSize
	return c.s.pool.Bytes()[off : off+n]
}

// put takes the value in the item's window slot into a pool slot: copied
// first, then checked on the node's own copy (header against the item and
// the namespace, CRC32C of the payload as copied), so that what the pool
// holds is what was checked, whatever the window holds meanwhile.
func (c *srvConn) put(ns wire.NS, it *wire.Item) wire.ItemReply {
	s := c.s
	s.met.PutItems.Add(1)
	k := c.key(ns, it.Digest[:ns.Width], it.Rank)
	s.mu.Lock()
	i, res := s.idx.allocate(c.owner, k)
	s.mu.Unlock()
	switch res {
	case allocExists:
		s.met.PutExists.Add(1)
		return wire.ItemReply{Status: wire.Exists}
	case allocNoSpace:
		s.met.PutFull.Add(1)
		return wire.ItemReply{Status: wire.NoSpace}
	}
	dst := c.value(uint64(i), it.Length)
	src := c.slot(c.win.Bytes(), uint64(it.Slot))[:it.Length]
	copy(dst[:l2.HeaderSize], src[:l2.HeaderSize])
	crc := l2.CopyCRC(dst[l2.HeaderSize:], src[l2.HeaderSize:])
	lns := machine.L2Namespace{FP: ns.FP, Layout: ns.Layout, Width: int(ns.Width), World: int(ns.World)}
	_, want, why := l2.CheckHeader(dst, lns, it.Digest[:ns.Width], int(it.Rank), 0, s.cfg.SlotBytes)
	ok := why == "" && crc == want
	s.mu.Lock()
	s.idx.commit(i, ok, it.Length)
	s.mu.Unlock()
	if !ok {
		s.met.Rejected.Add(1)
		return wire.ItemReply{Status: wire.Rejected}
	}
	s.met.PutStored.Add(1)
	s.met.BytesIn.Add(it.Length)
	return wire.ItemReply{Status: wire.OK, Length: it.Length}
}

// describe attaches descriptions to blocks of ns whose every rank the pool
// holds (an item's status: OK, NotFound, Exists when described already,
// Limit past --pool.desc-bytes, Malformed for a digest's padding).
func (c *srvConn) describe(ns wire.NS, entries []wire.Entry) []wire.ItemReply {
	s, w := c.s, int(ns.Width)
	res := make([]wire.ItemReply, len(entries))
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range entries {
		e := &entries[i]
		if !zero(e.Digest[w:]) || !zero(e.Parent[w:]) || len(e.Tokens) == 0 {
			s.met.Malformed.Add(1)
			res[i].Status = wire.Malformed
			continue
		}
		all := true
		for r := uint16(0); r < ns.World && all; r++ {
			j, ok := s.idx.byKey[c.key(ns, e.Digest[:w], r)]
			all = ok && s.idx.slots[j].state == slotPresent
		}
		if !all {
			res[i].Status = wire.NotFound
			continue
		}
		res[i].Status = s.ev.describe(ns.FP, string(e.Digest[:w]), *e)
		switch res[i].Status {
		case wire.OK:
			s.met.Described.Add(1)
		case wire.Limit:
			s.met.DescribeRefused.Add(1)
		}
	}
	return res
}

func zero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
