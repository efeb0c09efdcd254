package node

import (
	"errors"
	"fmt"
	"net"
	"runtime/debug"
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

// ClientConfig configures the sidecar's client of the node tier.
type ClientConfig struct {
	// Socket is the node process's socket (--node.socket).
	Socket string
	// Pod names the share this sidecar's writes are charged to
	// (default: the host name, a pod's name in Kubernetes).
	Pod string
	// LookupTimeout bounds a lookup; IOTimeout a fetch, a write and the
	// attach.
	LookupTimeout, IOTimeout time.Duration
	// Writers write; Queue writes may wait for one (past it a write is
	// refused at once).
	Writers, Queue int
	// Inflight bounds lookups and fetches running at once (past it they
	// miss at once).
	Inflight int
}

// Client defaults.
const (
	DefaultLookupTimeout = 50 * time.Millisecond
	DefaultClientIO      = time.Second
	DefaultWriters       = 2
	DefaultQueue         = 256
	DefaultInflight      = 32
)

// EnsureDefaults fills zero fields.
func (c *ClientConfig) EnsureDefaults() {
	if c.Pod == "" {
		c.Pod = defaultPod()
	}
	if c.LookupTimeout == 0 {
		c.LookupTimeout = DefaultLookupTimeout
	}
	if c.IOTimeout == 0 {
		c.IOTimeout = DefaultClientIO
	}
	if c.Writers == 0 {
		c.Writers = DefaultWriters
	}
	if c.Queue == 0 {
		c.Queue = DefaultQueue
	}
	if c.Inflight == 0 {
		c.Inflight = DefaultInflight
	}
}

// Validate reports every bad field, each naming its flag.
func (c *ClientConfig) Validate() error {
	var errs []error
	bad := func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--node.%s: %s", flag, fmt.Sprintf(format, args...)))
	}
	if c.Socket == "" {
		bad("socket", "the node tier's socket is needed")
	}
	if !wire.ValidPod(c.Pod) {
		bad("pod", "%q: 1 to 63 of [A-Za-z0-9._-]", c.Pod)
	}
	if c.LookupTimeout <= 0 || c.IOTimeout <= 0 {
		bad("io-timeout", "timeouts must be positive")
	}
	if c.Writers < 1 || c.Writers > 64 || c.Queue < 1 || c.Inflight < 1 {
		bad("writers", "writers 1..64, and the queue and the in-flight bound must be positive")
	}
	return errors.Join(errs...)
}

func defaultPod() string {
	h, err := osHostname()
	if err != nil || !wire.ValidPod(h) {
		return "pod"
	}
	return h
}

// ClientStats are the client's counts.
type ClientStats struct {
	Attaches                                       atomic.Uint64
	Lookups, LookupBlocks, LookupHits, LookupMiss  atomic.Uint64 // LookupMiss: lookups answered 0 unasked (not attached, busy) or failed
	FetchBlocks, FetchOK, FetchMiss, FetchRejected atomic.Uint64
	FetchUnready                                   atomic.Uint64 // fetches not asked: the pool's pages could not be made resident
	Writes, WritesOK, WritesExist, WritesRefused   atomic.Uint64 // WritesRefused: queue full, no window slot, not attached
	WritesFailed                                   atomic.Uint64 // the node answered otherwise, or not in time
	Promotions                                     atomic.Uint64 // blocks Redis gave, offered to the node tier
	Timeouts                                       atomic.Uint64
}

// Client is a sidecar's attachment to the node tier. It connects in the
// background and again whenever the connection ends; every operation has
// a deadline and never blocks its caller.
type Client struct {
	cfg       ClientConfig
	pool      []byte
	poolMap   *shm.Mapping
	populated []atomic.Bool // pool slots whose pages Populate has made resident
	log       zerolog.Logger
	met       ClientStats
	cur       atomic.Pointer[cliConn]
	epoch     atomic.Uint64
	lastErr   atomic.Pointer[string] // why the last attach failed (nil: it did not)
	writes    chan *writeJob
	inflight  chan struct{}
	stop      chan struct{}
	wg        sync.WaitGroup
	ops       sync.WaitGroup // lookups and fetches running (they may write the pool)
	opsMu     sync.RWMutex
	closed    atomic.Bool
	tooLarge  atomic.Bool // the node's slots are smaller than this sidecar's
	slotBytes uint64
	onStored  atomic.Pointer[func(ns [16]byte, digest []byte)]
}

// OnStored sets fn to be called, on a writer's goroutine, with each block
// a write put in the node tier or found there already (its namespace's
// fingerprint, its digest, zero padded to 32 bytes): the sidecar then
// describes it to the node (docs/kv-events.md, "The node tier"). fn must
// not wait.
func (c *Client) OnStored(fn func(ns [16]byte, digest []byte)) { c.onStored.Store(&fn) }

// writeJob is a write waiting for a writer: a block still in the pool
// (copied is called once the writer has read it), or a block copied into
// the window already (cc, slots and items set: Promote's).
type writeJob struct {
	w      machine.L2Write
	copied func(refused bool)
	cc     *cliConn
	slots  []uint32
	items  wire.Items
}

// refuse ends a job without writing it.
func (c *Client) refuse(j *writeJob) {
	c.met.WritesRefused.Add(1)
	if j.cc != nil {
		j.cc.freeSlots(j.slots)
		j.cc.users.Done()
		return
	}
	j.copied(true)
}

// NewClient starts a client over pool (the sidecar's pool, a shared
// mapping of a file in memory; offsets in requests index it), whose slots
// hold at most slotBytes. The pool's descriptor is passed to the node
// process with each attach: fetches land in it straight from the node's
// pool.
func NewClient(cfg ClientConfig, pool *shm.Mapping, slotBytes uint64, log zerolog.Logger) (*Client, error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if slotBytes == 0 || slotBytes%4096 != 0 {
		return nil, fmt.Errorf("node tier: slots of %d bytes: a multiple of 4 KiB", slotBytes)
	}
	c := &Client{cfg: cfg, pool: pool.Bytes(), poolMap: pool, slotBytes: slotBytes, log: log.With().Str("tier", "node").Logger(),
		populated: make([]atomic.Bool, uint64(pool.Len())/slotBytes),
		writes:    make(chan *writeJob, cfg.Queue), inflight: make(chan struct{}, cfg.Inflight), stop: make(chan struct{})}
	c.wg.Add(1 + cfg.Writers)
	go c.connector()
	for i := 0; i < cfg.Writers; i++ {
		go c.writer()
	}
	return c, nil
}

// Config returns the client's configuration, defaults filled in.
func (c *Client) Config() ClientConfig { return c.cfg }

// Stats returns the client's counts.
func (c *Client) Stats() *ClientStats { return &c.met }

// Connected reports whether the client is attached.
func (c *Client) Connected() bool {
	cc := c.cur.Load()
	return cc != nil && !cc.isDead()
}

// LastError is why the latest attempt to attach failed ("" once attached,
// and before any attempt): what an operator reads in /debug/state.
func (c *Client) LastError() string {
	if p := c.lastErr.Load(); p != nil {
		return *p
	}
	return ""
}

// Epoch is the attached node process's epoch (0: never attached).
func (c *Client) Epoch() uint64 { return c.epoch.Load() }

// WaitConnected waits until the client is attached or d passes.
func (c *Client) WaitConnected(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !c.Connected() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	return true
}

// Close stops the client; once it returns, nothing of it touches the pool,
// and the node process writes into it no more unless it was stopped in the
// middle of a fetch for longer than the fetch's deadline (then Close gives
// up on it: it is for a sidecar that stops).
func (c *Client) Close() {
	c.opsMu.Lock()
	if c.closed.Swap(true) {
		c.opsMu.Unlock()
		return
	}
	c.opsMu.Unlock()
	close(c.stop)
	if cc := c.cur.Load(); cc != nil {
		cc.fail()
		// A node stopped mid-fetch would keep the fetch, and so this
		// Close, waiting: past the deadline the socket is closed, the
		// fetch ends as a miss, and the sidecar, which is stopping,
		// serves nothing from its pool again.
		abort := time.AfterFunc(c.cfg.IOTimeout, func() { cc.sock.Close() })
		defer abort.Stop()
	}
	c.wg.Wait()
	c.ops.Wait()
	// A write queued after the writers stopped: refused, so that its pin
	// ends.
	for {
		select {
		case j := <-c.writes:
			c.refuse(j)
		default:
			return
		}
	}
}

// connector attaches, waits for the connection's end, and attaches again
// (backoff 50 ms to 5 s while the node does not answer).
func (c *Client) connector() {
	defer c.wg.Done()
	delay, warned := 50*time.Millisecond, false
	for {
		cc, err := c.dial()
		if err == nil {
			if old := c.epoch.Swap(cc.epoch); old != 0 && old != cc.epoch {
				c.log.Warn().Msg("the node tier restarted: its blocks are gone")
			}
			c.cur.Store(cc)
			c.lastErr.Store(nil)
			c.met.Attaches.Add(1)
			c.log.Info().Str("socket", c.cfg.Socket).Str("pod", c.cfg.Pod).Int("window_slots", cc.nslots).Msg("node tier attached")
			delay, warned = 50*time.Millisecond, false
			select {
			case <-cc.dead:
			case <-c.stop:
				cc.fail()
			}
			cc.wait()
			select {
			case <-c.stop:
				return
			default:
			}
			c.log.Warn().Msg("node tier connection ended: lookups miss and writes are refused until it is back")
			continue
		}
		why := err.Error()
		c.lastErr.Store(&why)
		if !warned {
			c.log.Warn().Err(err).Str("socket", c.cfg.Socket).Msg("node tier unreachable: lookups miss and writes are refused until it answers")
			warned = true
		}
		select {
		case <-c.stop:
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// cliConn is one attachment: the socket, the window and the calls in
// flight.
type cliConn struct {
	c          *Client
	sock       *net.UnixConn
	win        *shm.Mapping
	stride     uint64
	maxPayload uint64
	nslots     int
	epoch      uint64
	slots      chan uint32 // free window slots
	wmu        sync.Mutex  // socket writes

	mu       sync.Mutex
	calls    map[uint64]*call
	nextID   uint64
	held     int // window slots of calls given up on, freed when their reply comes
	ns       map[[16]byte]bool
	deadFlag bool
	dead     chan struct{}
	// drained is closed once the node's end of the socket has closed (or
	// Close gave up on it): the node process's copies into the pool, which
	// end before its connection closes, are over. Fetches wait for their
	// reply or for this, never for a timer alone.
	drained   chan struct{}
	users     sync.WaitGroup // users of win
	closeOnce sync.Once
}

type call struct {
	ch        chan []byte // the reply's body; nil: the connection ended
	slots     []uint32
	abandoned bool
	// fetch: the node copies into the pool for it; answered by its reply
	// or once the connection has drained, even after fail.
	fetch bool
}

var errDead = errors.New("node tier: not attached")
var errTimeout = errors.New("node tier: no reply in time")

func (c *Client) dial() (*cliConn, error) {
	sock, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: c.cfg.Socket, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*cliConn, error) {
		sock.Close()
		return nil, err
	}
	sock.SetDeadline(time.Now().Add(c.cfg.IOTimeout))
	if _, _, err := sock.WriteMsgUnix(wire.Message(wire.TypeHello, 1, wire.Hello{Pod: c.cfg.Pod}.Append), syscall.UnixRights(c.poolMap.FD()), nil); err != nil {
		return fail(err)
	}
	buf := make([]byte, wire.MaxMessage)
	n, fds, trunc, err := sys.ReadFDs(sock, buf, 1)
	if err != nil || trunc {
		sys.CloseFDs(fds)
		return fail(fmt.Errorf("reading the hello reply: %v (truncated %v)", err, trunc))
	}
	h, body, err := wire.DecodeHeader(buf[:n])
	var r wire.HelloReply
	if err == nil {
		r, err = wire.DecodeHelloReply(body)
	}
	if err == nil && h.Type != wire.TypeHello|wire.ReplyBit {
		err = fmt.Errorf("a reply of type %#x to a hello", h.Type)
	}
	if err == nil && r.Status == wire.Limit {
		err = errors.New("the node refused the attach: limit (its --max-pods connections, or this pod's --conns-per-pod: under the node's --pod-identity netns, pods in the node's network namespace, hostNetwork, count as one pod; the node's log says which)")
	} else if err == nil && r.Status != wire.OK {
		err = fmt.Errorf("the node refused the attach: %v", r.Status)
	}
	if err == nil && len(fds) != 1 {
		err = fmt.Errorf("the hello reply carries %d descriptors, not 1", len(fds))
	}
	if err != nil {
		sys.CloseFDs(fds)
		return fail(err)
	}
	if r.MaxPayload < c.slotBytes {
		sys.CloseFDs(fds)
		if !c.tooLarge.Swap(true) {
			c.log.Error().Uint64("node_slot_bytes", r.MaxPayload).Uint64("slot_bytes", c.slotBytes).
				Msg("the node tier's slots are smaller than this sidecar's (--pool.slot-bytes): blocks may not fit")
		}
		return fail(fmt.Errorf("the node's slots hold %d bytes, this sidecar's %d", r.MaxPayload, c.slotBytes))
	}
	if !shm.SealedAgainstResize(fds[0]) {
		sys.CloseFDs(fds)
		return fail(errors.New("the window is not sealed against resizing"))
	}
	win, err := shm.OpenFD(fds[0], "node-window", int(uint64(r.WindowSlots)*r.SlotStride))
	if err != nil {
		return fail(err)
	}
	if uint64(win.Len()) < uint64(r.WindowSlots)*r.SlotStride {
		win.Close()
		return fail(errors.New("the window is smaller than its slots"))
	}
	sock.SetDeadline(time.Time{})
	cc := &cliConn{c: c, sock: sock, win: win, stride: r.SlotStride, maxPayload: r.MaxPayload, nslots: int(r.WindowSlots), epoch: r.Epoch,
		slots: make(chan uint32, r.WindowSlots), calls: map[uint64]*call{}, nextID: 1, ns: map[[16]byte]bool{}, dead: make(chan struct{}), drained: make(chan struct{})}
	for i := uint32(0); i < r.WindowSlots; i++ {
		cc.slots <- i
	}
	go cc.reader()
	return cc, nil
}

func (cc *cliConn) isDead() bool {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return cc.deadFlag
}

// fail ends the connection: no new call starts, and every call waiting is
// answered nil except fetches, which the node may still be copying for:
// this side stops writing, the node ends the connection once it has
// answered what it read, and the reader answers them (drain).
func (cc *cliConn) fail() {
	cc.closeOnce.Do(func() {
		cc.mu.Lock()
		cc.deadFlag = true
		for id, k := range cc.calls {
			if k.fetch {
				continue
			}
			if !k.abandoned {
				close(k.ch)
			}
			delete(cc.calls, id)
		}
		cc.mu.Unlock()
		cc.sock.CloseWrite()
		close(cc.dead)
	})
}

// drain runs when the reader stops (the node's end closed, or Close gave
// up): the calls left are answered nil and the socket is closed.
func (cc *cliConn) drain() {
	cc.fail()
	cc.mu.Lock()
	for id, k := range cc.calls {
		if !k.abandoned {
			close(k.ch)
		}
		delete(cc.calls, id)
	}
	cc.mu.Unlock()
	close(cc.drained)
	cc.sock.Close()
}

// wait waits for the window's users, then unmaps it.
func (cc *cliConn) wait() {
	cc.users.Wait()
	cc.win.Close()
}

// use registers a user of the window; false: the connection is dead.
func (cc *cliConn) use() bool {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.deadFlag {
		return false
	}
	cc.users.Add(1)
	return true
}

// reader delivers replies until the node's end of the socket closes: after
// fail too, when fetches may still be answered (the node has copied for
// them).
func (cc *cliConn) reader() {
	defer cc.drain()
	buf := make([]byte, wire.MaxMessage+1)
	for {
		n, fds, trunc, err := sys.ReadFDs(cc.sock, buf, 1)
		sys.CloseFDs(fds)
		if err != nil || n == 0 {
			return
		}
		if trunc || len(fds) > 0 {
			cc.fail()
			continue
		}
		h, body, err := wire.DecodeHeader(buf[:n])
		if err != nil || h.Type&wire.ReplyBit == 0 {
			if !cc.isDead() {
				cc.c.log.Warn().Err(err).Msg("node tier: a bad reply; reconnecting")
			}
			cc.fail()
			continue
		}
		cc.mu.Lock()
		k := cc.calls[h.ID]
		delete(cc.calls, h.ID)
		if k != nil && k.abandoned {
			for _, s := range k.slots {
				cc.slots <- s // never blocks: the channel holds every slot
			}
			cc.held -= len(k.slots)
			k = nil
		}
		cc.mu.Unlock()
		if k != nil {
			k.ch <- append([]byte(nil), body...)
		}
	}
}

// call sends a request naming window slots and waits for its reply until
// deadline. On a timeout the slots are the reply's to free (the node may
// still be using them); on any other outcome they are the caller's.
func (cc *cliConn) call(t wire.Type, body func([]byte) []byte, slots []uint32, deadline time.Time) ([]byte, error) {
	k := &call{ch: make(chan []byte, 1), slots: slots}
	id, err := cc.send(k, t, body, deadline)
	if err != nil {
		return nil, err
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case b, ok := <-k.ch:
		if !ok {
			return nil, errDead
		}
		return b, nil
	case <-timer.C:
	}
	cc.mu.Lock()
	if _, ok := cc.calls[id]; ok {
		k.abandoned = true
		cc.held += len(slots)
		drop := cc.held > cc.nslots/2
		cc.mu.Unlock()
		cc.c.met.Timeouts.Add(1)
		if drop {
			cc.c.log.Warn().Msg("node tier: half the window held by requests not answered; reconnecting")
			cc.fail()
		}
		return nil, errTimeout
	}
	cc.mu.Unlock()
	b, ok := <-k.ch // answered meanwhile, or the connection ended
	if !ok {
		return nil, errDead
	}
	return b, nil
}

// startFetch sends a Fetch; its reply comes on the call's channel, nil
// once the connection has drained (never for a timer: the node may be
// copying into the pool until it answers or its end closes).
func (cc *cliConn) startFetch(body func([]byte) []byte, deadline time.Time) (*call, error) {
	k := &call{ch: make(chan []byte, 1), fetch: true}
	if _, err := cc.send(k, wire.TypeFetch, body, deadline); err != nil {
		return nil, err
	}
	return k, nil
}

// send registers k under a new id and sends its request; an error
// (errDead) means it was not sent: a datagram goes whole or not at all,
// and k is forgotten. A failed write ends the connection (the node not
// reading).
func (cc *cliConn) send(k *call, t wire.Type, body func([]byte) []byte, deadline time.Time) (uint64, error) {
	cc.mu.Lock()
	if cc.deadFlag {
		cc.mu.Unlock()
		return 0, errDead
	}
	id := cc.nextID
	cc.nextID++
	cc.calls[id] = k
	cc.mu.Unlock()
	msg := wire.Message(t, id, body)
	cc.wmu.Lock()
	cc.sock.SetWriteDeadline(deadline)
	_, err := cc.sock.Write(msg)
	cc.wmu.Unlock()
	if err != nil {
		cc.mu.Lock()
		delete(cc.calls, id)
		cc.mu.Unlock()
		cc.fail()
		return 0, errDead
	}
	return id, nil
}

// takeSlots takes n free window slots, waiting until deadline at most
// (zero deadline: not at all).
func (cc *cliConn) takeSlots(n int, deadline time.Time) ([]uint32, bool) {
	out := make([]uint32, 0, n)
	var timer *time.Timer
	for len(out) < n {
		select {
		case s := <-cc.slots:
			out = append(out, s)
			continue
		default:
		}
		if deadline.IsZero() {
			cc.freeSlots(out)
			return nil, false
		}
		if timer == nil {
			timer = time.NewTimer(time.Until(deadline))
			defer timer.Stop()
		}
		select {
		case s := <-cc.slots:
			out = append(out, s)
		case <-timer.C:
			cc.freeSlots(out)
			return nil, false
		case <-cc.dead:
			cc.freeSlots(out)
			return nil, false
		}
	}
	return out, true
}

func (cc *cliConn) freeSlots(s []uint32) {
	for _, x := range s {
		cc.slots <- x
	}
}

func wireNS(ns machine.L2Namespace) wire.NS {
	return wire.NS{FP: ns.FP, Layout: ns.Layout, Width: uint8(ns.Width), World: uint16(ns.World)}
}

// register declares ns on this connection, once.
func (cc *cliConn) register(ns machine.L2Namespace, deadline time.Time) bool {
	cc.mu.Lock()
	done := cc.ns[ns.FP]
	cc.mu.Unlock()
	if done {
		return true
	}
	b, err := cc.call(wire.TypeRegister, wireNS(ns).Append, nil, deadline)
	if err != nil {
		return false
	}
	r, err := wire.DecodeStatusReply(b)
	if err != nil || r.Status != wire.OK {
		cc.c.log.Warn().Err(err).Str("status", r.Status.String()).Msg("node tier: a namespace not registered")
		return false
	}
	cc.mu.Lock()
	cc.ns[ns.FP] = true
	cc.mu.Unlock()
	return true
}

// take reserves an operation's place (lookups and fetches); false:
// closed, or too many run.
func (c *Client) take() bool {
	c.opsMu.RLock()
	defer c.opsMu.RUnlock()
	if c.closed.Load() {
		return false
	}
	select {
	case c.inflight <- struct{}{}:
		c.ops.Add(1)
		return true
	default:
		return false
	}
}

func (c *Client) give() {
	<-c.inflight
	c.ops.Done()
}

// Lookup answers, through done (on another goroutine, or at once), how
// many leading blocks of l.Digests the node tier holds, every rank of each.
func (c *Client) Lookup(l machine.L2Lookup, done func(found int)) {
	cc := c.cur.Load()
	if cc == nil || !c.take() {
		c.met.LookupMiss.Add(1)
		done(0)
		return
	}
	if !cc.use() {
		c.give()
		c.met.LookupMiss.Add(1)
		done(0)
		return
	}
	go func() {
		defer c.give()
		defer cc.users.Done()
		done(c.lookup(cc, l))
	}()
}

func (c *Client) lookup(cc *cliConn, l machine.L2Lookup) int {
	c.met.Lookups.Add(1)
	deadline := time.Now().Add(c.cfg.LookupTimeout)
	w := l.NS.Width
	n := len(l.Digests) / max(w, 1)
	c.met.LookupBlocks.Add(uint64(n))
	if w == 0 || !cc.register(l.NS, deadline) {
		c.met.LookupMiss.Add(1)
		return 0
	}
	found, per := 0, max(1, min(wire.MaxLookup, wire.MaxLookupKeys/max(l.NS.World, 1)))
	for found < n {
		e := min(n, found+per)
		b, err := cc.call(wire.TypeLookup, wire.Lookup{FP: l.NS.FP, Width: w, Digests: l.Digests[found*w : e*w]}.Append, nil, deadline)
		if err != nil {
			break
		}
		r, err := wire.DecodeStatusReply(b)
		if err != nil || r.Status != wire.OK || int(r.Value) > e-found {
			break
		}
		found += int(r.Value)
		if found < e {
			break
		}
	}
	c.met.LookupHits.Add(uint64(found))
	return found
}

// Fetch reads f's blocks into their pool slots and answers, through done,
// how each ended. done is called after the last byte is written to the
// pool: the slots are the caller's again.
func (c *Client) Fetch(f machine.L2Fetch, done func([]machine.L2FetchResult)) {
	res := make([]machine.L2FetchResult, len(f.Blocks))
	cc := c.cur.Load()
	if cc == nil || !c.take() {
		c.met.FetchMiss.Add(uint64(len(f.Blocks)))
		done(res)
		return
	}
	if !cc.use() {
		c.give()
		c.met.FetchMiss.Add(uint64(len(f.Blocks)))
		done(res)
		return
	}
	go func() {
		defer c.give()
		c.fetch(cc, f, res)
		cc.users.Done()
		done(res)
	}()
}

func (c *Client) fetch(cc *cliConn, f machine.L2Fetch, res []machine.L2FetchResult) {
	deadline := time.Now().Add(c.cfg.IOTimeout)
	world := max(f.NS.World, 1)
	c.met.FetchBlocks.Add(uint64(len(f.Blocks)))
	defer func() {
		for _, r := range res {
			if !r.OK {
				c.met.FetchMiss.Add(1)
			} else {
				c.met.FetchOK.Add(1)
			}
		}
	}()
	if !cc.register(f.NS, deadline) {
		return
	}
	limit := f.MaxLength
	if f.Length != 0 {
		limit = f.Length
	}
	limit = min(limit, c.slotBytes)
	// Every batch is sent at once (the node copies one while this side
	// checks another); each is waited for until its reply comes or the
	// connection has drained: the node may be copying into its slots
	// until then.
	type batch struct {
		first, end int
		items      []wire.FetchItem
		k          *call
	}
	var batches []batch
	per := max(1, wire.MaxItems/world)
	for first := 0; first < len(f.Blocks); first += per {
		b := batch{first: first, end: min(first+per, len(f.Blocks))}
		for i := b.first; i < b.end; i++ {
			for r, off := range f.Blocks[i].PoolOffsets {
				if limit == 0 || off > uint64(len(c.pool)) || limit > uint64(len(c.pool))-off || !c.ready(off, limit) {
					b.items = nil
					break // the batch is not sent: its blocks miss
				}
				it := wire.FetchItem{Rank: uint16(r), Offset: off, Max: limit}
				copy(it.Digest[:], f.Blocks[i].Digest)
				b.items = append(b.items, it)
			}
			if b.items == nil {
				break
			}
		}
		if len(b.items) == 0 || len(b.items) != (b.end-b.first)*world {
			continue
		}
		k, err := cc.startFetch(wire.Fetch{FP: f.NS.FP, Items: b.items}.Append, deadline)
		if err != nil {
			break
		}
		b.k = k
		batches = append(batches, b)
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for _, b := range batches {
		var body []byte
		ok := true
		select {
		case body, ok = <-b.k.ch:
		case <-timer.C:
			c.met.Timeouts.Add(1)
			if !cc.isDead() {
				c.log.Warn().Msg("node tier: a fetch not answered in time; reconnecting once the node has let go of it")
			}
			cc.fail()
			body, ok = <-b.k.ch // the reply, or nil once the connection has drained
		}
		if ok {
			c.fetchResults(f, b.first, b.end, b.items, body, res)
		}
	}
}

// fetchResults checks a Fetch's reply against what was asked and marks
// the blocks of [first, end) whose every rank landed whole and checked.
func (c *Client) fetchResults(f machine.L2Fetch, first, end int, items []wire.FetchItem, body []byte, res []machine.L2FetchResult) {
	rep, err := wire.DecodeFetchReply(body)
	if err != nil || rep.Status != wire.OK || len(rep.Items) != len(items) {
		return
	}
	k := 0
	for i := first; i < end; i++ {
		b := f.Blocks[i]
		ok, length := true, f.Length
		for r := range b.PoolOffsets {
			ir, it := &rep.Items[k], &items[k]
			k++
			if ir.Status == wire.NotResident {
				c.unready(it.Offset) // swapped out since: populated again next time
			}
			if !ok || ir.Status != wire.OK {
				ok = false
				continue
			}
			// The header as the node holds it, against the block asked
			// for; the payload's length against what was allowed; the
			// checksum the node computed over what it copied against the
			// header's.
			n, crc, why := l2.CheckHead(ir.Header[:], f.NS, b.Digest, r, length, min(f.MaxLength, it.Max))
			switch {
			case why != "":
			case n != ir.Length:
				why = l2.RejectLength
			case crc != ir.CRC:
				why = l2.RejectChecksum
			}
			if why != "" {
				ok = false
				c.met.FetchRejected.Add(1)
				continue
			}
			length = ir.Length
		}
		if ok {
			res[i] = machine.L2FetchResult{OK: true, Length: length}
		}
	}
}

// ready makes sure the pages of the pool that a fetch of up to n bytes at
// off writes are allocated and in memory, charged to this process (the
// node never writes a page that is not): once per slot.
func (c *Client) ready(off, n uint64) bool {
	slot := off / c.slotBytes
	whole := off%c.slotBytes == 0 && n <= c.slotBytes && slot < uint64(len(c.populated))
	if whole {
		if c.populated[slot].Load() {
			return true
		}
		n = c.slotBytes
	}
	b := c.pool[off : off+n]
	err := shm.Populate(b)
	if errors.Is(err, shm.ErrReserveUnsupported) {
		err = touch(b)
	}
	if err != nil {
		c.met.FetchUnready.Add(1)
		return false
	}
	if whole {
		c.populated[slot].Store(true)
	}
	return true
}

// unready forgets that the slot at off was populated.
func (c *Client) unready(off uint64) {
	if slot := off / c.slotBytes; off%c.slotBytes == 0 && slot < uint64(len(c.populated)) {
		c.populated[slot].Store(false)
	}
}

// touch writes a zero into every page of b (before MADV_POPULATE_WRITE,
// Linux 5.14): the slot is the fetch's, about to be overwritten. A page
// that cannot be allocated (a full mount) faults: an error, not a crash.
func touch(b []byte) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			err = errors.New("node tier: the pool's pages cannot be allocated")
		}
	}()
	for i := 0; i < len(b); i += 4096 {
		b[i] = 0
	}
	return nil
}

// Write queues w: a writer copies every rank's bytes out of the pool into
// window slots, calls copied(false) (the pool slots are the caller's
// again), then asks the node to take them. A full queue, a tier not
// attached or no free window slot refuses: copied(true).
func (c *Client) Write(w machine.L2Write, copied func(refused bool)) {
	c.met.Writes.Add(1)
	c.opsMu.RLock() // not while Close drains the queue
	defer c.opsMu.RUnlock()
	if !c.Connected() || c.closed.Load() {
		c.met.WritesRefused.Add(1)
		copied(true)
		return
	}
	select {
	case c.writes <- &writeJob{w: w, copied: copied}:
	default:
		c.met.WritesRefused.Add(1)
		copied(true)
	}
}

func (c *Client) writer() {
	defer c.wg.Done()
	for {
		select {
		case <-c.stop:
			// Whatever is queued is refused: its pins must end.
			for {
				select {
				case j := <-c.writes:
					c.refuse(j)
				default:
					return
				}
			}
		case j := <-c.writes:
			c.write(j)
		}
	}
}

func (c *Client) write(j *writeJob) {
	deadline := time.Now().Add(c.cfg.IOTimeout)
	if j.cc != nil { // copied by Promote
		defer j.cc.users.Done()
		if !j.cc.register(j.w.NS, deadline) {
			c.met.WritesRefused.Add(1)
			j.cc.freeSlots(j.slots)
			return
		}
		c.put(j.cc, j.slots, j.items, deadline)
		return
	}
	w := j.w
	cc := c.cur.Load()
	if cc == nil || !cc.use() {
		c.met.WritesRefused.Add(1)
		j.copied(true)
		return
	}
	defer cc.users.Done()
	if !cc.register(w.NS, deadline) {
		c.met.WritesRefused.Add(1)
		j.copied(true)
		return
	}
	slots, items, ok := c.copyOut(cc, w)
	if !ok {
		c.met.WritesRefused.Add(1)
		j.copied(true)
		return
	}
	j.copied(false) // the pool is not read past this point
	c.put(cc, slots, items, deadline)
}

// copyOut takes window slots for every rank of w and copies its values
// into them; false: w does not fit, or no slots are free.
func (c *Client) copyOut(cc *cliConn, w machine.L2Write) ([]uint32, wire.Items, bool) {
	if w.Length == 0 || w.Length > cc.maxPayload || len(w.PoolOffsets) == 0 || len(w.PoolOffsets) > wire.MaxItems {
		return nil, wire.Items{}, false
	}
	slots, ok := cc.takeSlots(len(w.PoolOffsets), time.Time{})
	if !ok {
		return nil, wire.Items{}, false
	}
	win := cc.win.Bytes()
	items := wire.Items{FP: w.NS.FP, Items: make([]wire.Item, len(w.PoolOffsets))}
	for r, off := range w.PoolOffsets {
		s := uint64(slots[r])
		n := l2.PutValue(win[s*cc.stride:(s+1)*cc.stride], w.NS, w.Digest, r, c.pool[off:off+w.Length])
		it := wire.Item{Rank: uint16(r), Slot: slots[r], Length: uint64(n)}
		copy(it.Digest[:], w.Digest)
		items.Items[r] = it
	}
	return slots, items, true
}

// put asks the node to take the values in slots and frees the slots once
// it has answered.
func (c *Client) put(cc *cliConn, slots []uint32, items wire.Items, deadline time.Time) {
	body, err := cc.call(wire.TypePut, func(b []byte) []byte { return items.Append(b) }, slots, deadline)
	if !errors.Is(err, errTimeout) {
		defer cc.freeSlots(slots)
	}
	if err != nil {
		c.met.WritesFailed.Add(1)
		return
	}
	rep, err := wire.DecodeItemsReply(body)
	if err != nil || rep.Status != wire.OK || len(rep.Items) != len(items.Items) {
		c.met.WritesFailed.Add(1)
		return
	}
	exists := true
	for _, it := range rep.Items {
		switch it.Status {
		case wire.OK:
			exists = false
		case wire.Exists:
		default:
			c.met.WritesFailed.Add(1)
			return
		}
	}
	if exists {
		c.met.WritesExist.Add(1)
	} else {
		c.met.WritesOK.Add(1)
	}
	if fn := c.onStored.Load(); fn != nil && len(items.Items) > 0 {
		(*fn)(items.FP, items.Items[0].Digest[:])
	}
}

// Promote writes a block another tier (Redis) gave into the node tier, so
// that the node's other pods find it there: its values are copied out of
// the pool now, on the caller's goroutine (the caller's slots must hold
// the block until Promote returns), and the node is asked to take them
// later. It never waits: with the tier not attached, no window slot free or
// the queue full it does nothing (counted as a refused write).
func (c *Client) Promote(w machine.L2Write) {
	c.met.Writes.Add(1)
	c.met.Promotions.Add(1)
	c.opsMu.RLock()
	defer c.opsMu.RUnlock()
	cc := c.cur.Load()
	if c.closed.Load() || cc == nil || !cc.use() {
		c.met.WritesRefused.Add(1)
		return
	}
	slots, items, ok := c.copyOut(cc, w)
	if !ok {
		cc.users.Done()
		c.met.WritesRefused.Add(1)
		return
	}
	j := &writeJob{w: w, cc: cc, slots: slots, items: items}
	select {
	case c.writes <- j:
	default:
		c.refuse(j)
	}
}
