package sidecar_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// TestScenarios runs the protocol scenarios (testdata/scenarios) through
// connector.Client against real sidecars in this process: real rings in
// /dev/shm, real copies of this process's memory (process_vm_readv and
// writev) and, for a scenario whose sidecars have the shared tier, a real
// Redis (redistest) that they share.
func TestScenarios(t *testing.T) {
	scenario.RunAll(t, "../testdata/scenarios", func(t *testing.T) scenario.Driver { return &realDriver{t: t} })
}

type realDriver struct {
	t      *testing.T
	mem    [][]byte // keeps client memory reachable while regions point at it
	nodes  []*realNode
	redis  string // the shared tier's server, once a node has one
	prefix string // the scenario's keys in it
}

func (d *realDriver) Name() string { return scenario.Go }

func (d *realDriver) Start(c scenario.Config) (scenario.Node, error) {
	if c.Tier != nil && d.redis == "" {
		redistest.Require(d.t)
		d.redis = redistest.Single(d.t, redistest.Options{}).Addr
		d.prefix = fmt.Sprintf("scen%d:", time.Now().UnixNano())
	}
	h := newHarness(d.t, func(cfg *sidecar.Config) {
		cfg.PoolBytes = uint64(c.Slots) * c.SlotBytes
		cfg.RingCapacity = scenario.RingCapacity
		m := &cfg.Machine
		m.SlotBytes, m.Budget, m.ChunkBytes = c.SlotBytes, c.Budget, c.ChunkBytes
		m.PinShare, m.RetainShare, m.PendingShare, m.SessionShare, m.MetaBytes = c.PinShare, c.RetainShare, c.PendingShare, c.SessionShare, c.MetaBytes
		if t := c.Tier; t != nil {
			// A lookup timeout far above the product's: a scenario checks
			// what the tier holds, not how a slow one is bounded.
			cfg.L2 = &sidecar.L2Config{Redis: l2.Config{Addrs: []string{d.redis}, Prefix: d.prefix, LookupTimeout: 10 * time.Second, IOTimeout: 10 * time.Second},
				Tier: machine.L2Config{WriteSlots: t.WriteSlots, EvictAhead: t.EvictAhead}}
			if t.WriteOnEvict {
				cfg.L2.Tier.Policy = machine.WriteOnEvict
			}
		}
	})
	n := &realNode{d: d, h: h}
	if c.Tier != nil {
		deadline := time.Now().Add(20 * time.Second)
		for !h.srv.State().L2.Connected {
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("the tier did not connect")
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	d.nodes = append(d.nodes, n)
	return n, nil
}

func (d *realDriver) PID() int { return os.Getpid() }

type hostMem []byte

func (m hostMem) Bytes() []byte { return m }
func (m hostMem) Base() uint64  { return uint64(uintptr(unsafe.Pointer(&m[0]))) }

func (d *realDriver) Memory(n int) scenario.Memory {
	b := make([]byte, n)
	d.mem = append(d.mem, b)
	return hostMem(b)
}

// TierValues counts the scenario's keys in the Redis server.
func (d *realDriver) TierValues() (int, error) {
	if d.redis == "" {
		return 0, nil
	}
	c := redis.NewClient(&redis.Options{Addr: d.redis})
	defer c.Close()
	n := 0
	it := c.Scan(context.Background(), 0, d.prefix+"*", 1000).Iterator()
	for it.Next(context.Background()) {
		n++
	}
	return n, it.Err()
}

// Settle waits until every node's tier has ended the lookups, fetches and
// writes it was given: the pure driver carries them out before a command
// returns.
func (d *realDriver) Settle() error {
	for _, n := range d.nodes {
		deadline := time.Now().Add(20 * time.Second)
		for {
			st := n.h.srv.State().L2
			if st == nil {
				break
			}
			var taken float64
			for _, v := range st.Client.Writes {
				taken += v
			}
			m := st.Machine
			if m.PendingLookups == 0 && m.PendingFetches == 0 && m.WritingSlots == 0 && taken >= float64(m.Writes) {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the tier still works 20 s on: %+v, client writes %v", m, st.Client.Writes)
			}
			time.Sleep(time.Millisecond)
		}
	}
	return nil
}

// realNode is one sidecar in this process.
type realNode struct {
	d *realDriver
	h *harness
}

func (n *realNode) Pool() (scenario.Pool, error) {
	st := n.h.srv.State().Pool
	return scenario.Pool{Blocks: st.Blocks, Pending: st.PendingBlocks, Pinned: st.PinnedBlocks, Leases: st.Leases,
		Loads: st.Loads, Writers: st.Writers, Used: st.Used, Free: st.Free}, nil
}

func (n *realNode) Counters() (scenario.Counters, error) {
	s := n.h.srv.State()
	c := scenario.Counters{StoredSlots: s.Pool.Stored, Evictions: s.Pool.Evictions, EvictedUnwritten: s.Pool.EvictedUnmarked}
	if l := s.L2; l != nil {
		m := l.Machine
		c.Tier = &scenario.TierCounters{Lookups: m.Lookups, LookupBlocks: m.LookupBlocks, LookupHits: m.LookupHitBlocks,
			LookupTimeouts: m.LookupTimeouts, Fetches: m.Fetches, FetchBlocks: m.FetchBlocks, Fetched: m.FetchedBlocks,
			FetchMisses: m.FetchMisses, FetchTimeouts: m.FetchTimeouts, FetchNoSpace: m.FetchNoSpace, Writes: m.Writes,
			WritesSkipped: m.WritesSkipped, WritesRefused: m.WritesNotTaken, WritingSlots: m.WritingSlots,
			PendingLookups: m.PendingLookups, PendingFetches: m.PendingFetches}
	}
	return c, nil
}

func (n *realNode) Usage() (scenario.Usage, error) {
	u := n.h.srv.State().Usage
	return scenario.Usage{Sessions: u.Sessions, MetaBytes: u.MetaBytes}, nil
}

func (n *realNode) Attach(o scenario.AttachOptions) (scenario.Session, error) {
	if o.UID != "" {
		return nil, fmt.Errorf("uid=%s: a real sidecar sees this process's uid only", o.UID)
	}
	c, err := connector.Dial(connector.Options{Socket: n.h.cfg.Socket, Instance: o.Instance, Model: o.Model, Layout: o.Layout,
		Salt: o.Salt, Role: o.Role, Rank: o.Rank, WorldSize: o.WorldSize, DigestWidth: o.DigestWidth, Timeout: 5 * time.Second})
	if err != nil {
		return nil, err
	}
	n.d.t.Cleanup(func() { c.Close() })
	return &connSession{c: c, n: n}, nil
}

// connSession is a connector.Client over the rings of a real session.
type connSession struct {
	c *connector.Client
	n *realNode
}

func (s *connSession) Client() *connector.Client { return s.c }

func (s *connSession) Detach() error {
	if err := s.c.Close(); err != nil {
		return err
	}
	return s.gone()
}

func (s *connSession) Abandon() error {
	s.c.Abandon()
	return s.gone()
}

// gone waits until the sidecar has forgotten the session: its end is
// asynchronous (the session loop cleans up after it answered the Detach,
// or after it saw the socket close).
func (s *connSession) gone() error {
	id := s.c.Info().Session
	deadline := time.Now().Add(10 * time.Second)
	for {
		found := false
		for _, ss := range s.n.h.srv.State().Sessions {
			found = found || ss.ID == id
		}
		if !found {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("session %d still attached 10 s after it ended", id)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
