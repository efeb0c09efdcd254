package sidecar_test

import (
	"fmt"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/scenario"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar"
)

// TestScenarios runs the protocol scenarios (testdata/scenarios) through
// connector.Client against a real sidecar in this process: real rings in
// /dev/shm, real copies of this process's memory (process_vm_readv and
// writev).
func TestScenarios(t *testing.T) {
	scenario.RunAll(t, "../testdata/scenarios", func(t *testing.T) scenario.Driver { return &realDriver{t: t} })
}

type realDriver struct {
	t   *testing.T
	h   *harness
	mem [][]byte // keeps client memory reachable while regions point at it
}

func (d *realDriver) Start(c scenario.Config) error {
	d.h = newHarness(d.t, func(cfg *sidecar.Config) {
		cfg.PoolBytes = uint64(c.Slots) * c.SlotBytes
		cfg.Machine.SlotBytes = c.SlotBytes
		cfg.Machine.Budget = c.Budget
		cfg.Machine.ChunkBytes = c.ChunkBytes
		cfg.RingCapacity = scenario.RingCapacity
	})
	return nil
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

func (d *realDriver) Pool() (scenario.Pool, error) {
	st := d.h.srv.State().Pool
	return scenario.Pool{Blocks: st.Blocks, Pending: st.PendingBlocks, Pinned: st.PinnedBlocks, Leases: st.Leases,
		Loads: st.Loads, Writers: st.Writers, Used: st.Used, Free: st.Free}, nil
}

func (d *realDriver) Attach(o scenario.AttachOptions) (scenario.Session, error) {
	c, err := connector.Dial(connector.Options{Socket: d.h.cfg.Socket, Instance: o.Instance, Model: o.Model, Layout: o.Layout,
		Salt: o.Salt, Role: o.Role, Rank: o.Rank, WorldSize: o.WorldSize, DigestWidth: o.DigestWidth, Timeout: 5 * time.Second})
	if err != nil {
		return nil, err
	}
	d.t.Cleanup(func() { c.Close() })
	return &connSession{Client: c, d: d}, nil
}

// connSession is a connector.Client with what the scenarios need besides
// its typed requests.
type connSession struct {
	*connector.Client
	d *realDriver
}

func (s *connSession) Call(typ uint16, payload []byte) ([]byte, error) {
	seq, err := s.Submit(typ, payload)
	if err != nil {
		return nil, err
	}
	b, err := s.Await(seq)
	return append([]byte(nil), b...), err
}

// Quiet sends with seq 0, then a Ping: records are handled in order, so by
// the Ping's reply the quiet one's reply, if any, has arrived.
func (s *connSession) Quiet(typ uint16, payload []byte) (schema.Status, bool, error) {
	n0, _ := s.QuietFailures()
	if err := s.Send(typ, payload); err != nil {
		return 0, false, err
	}
	if err := s.Ping(1); err != nil {
		return 0, false, err
	}
	switch n, st := s.QuietFailures(); n - n0 {
	case 0:
		return 0, false, nil
	case 1:
		return st, true, nil
	default:
		return 0, false, fmt.Errorf("%d replies to one quiet request", n-n0)
	}
}

func (s *connSession) Detach() error {
	if err := s.Close(); err != nil {
		return err
	}
	return s.gone()
}

func (s *connSession) Abandon() error {
	s.Client.Abandon()
	return s.gone()
}

// gone waits until the sidecar has forgotten the session: its end is
// asynchronous (the session loop cleans up after it answered the Detach,
// or after it saw the socket close).
func (s *connSession) gone() error {
	id := s.Info().Session
	deadline := time.Now().Add(10 * time.Second)
	for {
		found := false
		for _, ss := range s.d.h.srv.State().Sessions {
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
