package ringbench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/ring"
)

// Server modes: what the re-executed server process does.
const (
	ModeRing       = "ring"       // echo every request record on the response ring
	ModeUDS        = "uds"        // echo every framed message on a Unix socket
	ModePingPong   = "pingpong"   // answer every odd value of a shared word with the next even one
	ModeThroughput = "throughput" // consume records, then acknowledge on the response ring
)

// ServerConfig is the command line of the server process (the hidden
// `ringside-bench ring-server`).
type ServerConfig struct {
	Mode    string
	Req     string // request ring (ring, throughput)
	Resp    string // response ring (ring, throughput)
	Socket  string // socket path (uds)
	File    string // shared word file (pingpong)
	Wait    string // spin or park (ring, throughput)
	Count   int    // requests (or records) to serve, warm-up included
	Batch   int    // throughput: records per Commit
	Timeout time.Duration
	Ready   io.Writer // gets "ready\n" once the server can be used
}

// WaitConfig returns the ring wait strategy of a wait mode.
func WaitConfig(mode string) (ring.WaitConfig, error) {
	switch mode {
	case "spin":
		return ring.WaitConfig{Spin: 5 * time.Millisecond, Park: 10 * time.Millisecond}, nil
	case "park":
		return ring.ParkWait, nil
	}
	return ring.WaitConfig{}, fmt.Errorf("wait mode %q: want spin or park", mode)
}

// Serve runs one server: it attaches, writes "ready", serves Count requests
// and returns. Every wait is bounded by Timeout.
func Serve(sc ServerConfig) error {
	if sc.Timeout <= 0 {
		sc.Timeout = time.Minute
	}
	if sc.Ready == nil {
		sc.Ready = io.Discard
	}
	deadline := time.Now().Add(sc.Timeout)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	switch sc.Mode {
	case ModeRing:
		return serveRing(sc, deadline)
	case ModeThroughput:
		return serveThroughput(sc, deadline)
	case ModeUDS:
		return serveUDS(sc, deadline)
	case ModePingPong:
		return servePingPong(sc, deadline)
	}
	return fmt.Errorf("ring-server: unknown mode %q", sc.Mode)
}

// attach opens the request ring as consumer and the response ring as
// producer.
func attach(sc ServerConfig) (c *ring.Consumer, p *ring.Producer, closeAll func(), err error) {
	wc, err := WaitConfig(sc.Wait)
	if err != nil {
		return nil, nil, nil, err
	}
	req, err := ring.Open(sc.Req, 0)
	if err != nil {
		return nil, nil, nil, err
	}
	resp, err := ring.Open(sc.Resp, 0)
	if err != nil {
		req.Close()
		return nil, nil, nil, err
	}
	if c, err = ring.NewConsumer(req.Ring, wc); err == nil {
		p, err = ring.NewProducer(resp.Ring, wc)
	}
	if err != nil {
		req.Close()
		resp.Close()
		return nil, nil, nil, err
	}
	return c, p, func() { p.Close(); c.Close(); req.Close(); resp.Close() }, nil
}

// next waits for the next record.
func next(c *ring.Consumer, deadline time.Time) (ring.Record, error) {
	for {
		rec, err := c.Next()
		if err != ring.ErrEmpty {
			return rec, err
		}
		if err := c.Wait(deadline); err != nil {
			return rec, err
		}
	}
}

// claim reserves a record, waiting for space.
func claim(p *ring.Producer, typ, flags uint16, seq uint64, n int, deadline time.Time) ([]byte, error) {
	for {
		b, err := p.Claim(typ, flags, seq, n)
		if err != ring.ErrFull {
			return b, err
		}
		p.Publish()
		if err := p.WaitSpace(ring.RecordSize(n), deadline); err != nil {
			return nil, err
		}
	}
}

func serveRing(sc ServerConfig, deadline time.Time) error {
	c, p, closeAll, err := attach(sc)
	if err != nil {
		return err
	}
	defer closeAll()
	harness.SayReady(sc.Ready)
	for i := 0; i < sc.Count; i++ {
		rec, err := next(c, deadline)
		if err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
		b, err := claim(p, rec.Type, rec.Flags, rec.Seq, len(rec.Payload), deadline)
		if err != nil {
			return fmt.Errorf("response %d: %w", i, err)
		}
		copy(b, rec.Payload)
		p.Publish()
		c.Commit()
	}
	return nil
}

func serveThroughput(sc ServerConfig, deadline time.Time) error {
	c, p, closeAll, err := attach(sc)
	if err != nil {
		return err
	}
	defer closeAll()
	batch := max(sc.Batch, 1)
	harness.SayReady(sc.Ready)
	var sum byte
	for got := 0; got < sc.Count; {
		rec, err := c.Next()
		if err == ring.ErrEmpty {
			c.Commit()
			if err := c.Wait(deadline); err != nil {
				return fmt.Errorf("after %d records: %w", got, err)
			}
			continue
		}
		if err != nil {
			return err
		}
		if rec.Seq != uint64(got) {
			return fmt.Errorf("record seq %d, want %d", rec.Seq, got)
		}
		if len(rec.Payload) > 0 {
			sum += rec.Payload[0] // touch the payload, as a real consumer would
		}
		got++
		if got%batch == 0 {
			c.Commit()
		}
	}
	c.Commit()
	b, err := claim(p, 1, 0, uint64(sc.Count), 1, deadline)
	if err != nil {
		return err
	}
	b[0] = sum
	p.Publish()
	return nil
}

// frame is the socket framing: a 16-byte header laid out like a ring record
// header (u32 length, u16 type, u16 flags, u64 seq) and exactly length bytes.
const frameHeader = ring.RecordHeaderSize

func serveUDS(sc ServerConfig, deadline time.Time) error {
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sc.Socket, Net: "unix"})
	if err != nil {
		return err
	}
	defer l.Close()
	if err := l.SetDeadline(deadline); err != nil {
		return err
	}
	harness.SayReady(sc.Ready)
	conn, err := l.AcceptUnix()
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := conn.SetDeadline(deadline); err != nil {
		return err
	}
	buf := make([]byte, frameHeader+64<<10)
	for i := 0; i < sc.Count; i++ {
		if _, err := io.ReadFull(conn, buf[:frameHeader]); err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
		n := int(binary.LittleEndian.Uint32(buf))
		if frameHeader+n > len(buf) {
			return fmt.Errorf("request %d: %d-byte payload too large", i, n)
		}
		if _, err := io.ReadFull(conn, buf[frameHeader:frameHeader+n]); err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
		if _, err := conn.Write(buf[:frameHeader+n]); err != nil {
			return fmt.Errorf("response %d: %w", i, err)
		}
	}
	return nil
}

// spinCheck is how many polls of the shared word pass between deadline
// checks.
const spinCheck = 1 << 14

var errDeadline = os.ErrDeadlineExceeded

func servePingPong(sc ServerConfig, deadline time.Time) error {
	m, err := shm.Open(sc.File, 8)
	if err != nil {
		return err
	}
	defer m.Close()
	w := shm.U64(m.Bytes(), 0)
	harness.SayReady(sc.Ready)
	for i := 0; i < sc.Count; i++ {
		want := uint64(2*i + 1)
		for spins := 1; w.Load() != want; spins++ {
			if spins%spinCheck == 0 && time.Now().After(deadline) {
				return fmt.Errorf("ping %d: %w", i, errDeadline)
			}
		}
		w.Store(want + 1)
	}
	return nil
}

// errSkipped marks a row that could not run for a reason outside the
// benchmark (no Python).
var errSkipped = errors.New("skipped")
