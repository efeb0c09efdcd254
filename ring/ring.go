package ring

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
)

// Ring is a view of one ring's memory: the header page and the data area.
// It holds no state of either side; Producer and Consumer do. The memory may
// be a shared mapping (see Create and Open) or plain heap memory from
// shm.Aligned, which is how the ring logic is tested in one process.
type Ring struct {
	mem  []byte
	data []byte
	hdr  Header
	mask uint64
	cap  uint64
	max  uint32

	tail, head            *atomic.Uint64
	consParked, consFutex *atomic.Uint32
	prodParked, prodFutex *atomic.Uint32
	prodState, consState  *atomic.Uint32
	prodPID, consPID      *atomic.Uint32
	prodStart, consStart  *atomic.Uint64
	check                 func() error // extra liveness check while waiting (file size)
}

// Format initialises mem as a new ring: it zeroes the header, writes the
// static fields and publishes the magic last, so that a peer that maps the
// file early sees either no ring or a whole header. len(mem) must be
// HeaderSize+capacity.
func Format(mem []byte, capacity uint64, maxRecord uint32, epoch uint64, flags uint32) (*Ring, error) {
	if maxRecord == 0 {
		maxRecord = DefaultMaxRecord(capacity)
	}
	h := Header{
		Magic: Magic, Version: Version, HeaderSize: HeaderSize, Capacity: capacity,
		Align: Align, MaxRecord: maxRecord, Epoch: epoch, Flags: flags,
	}
	if err := h.Validate(int64(len(mem))); err != nil {
		return nil, err
	}
	clear(mem[:HeaderSize])
	h.Magic = 0
	EncodeHeader(mem, &h)
	shm.U64(mem, offMagic).Store(Magic)
	return Attach(mem)
}

// Attach validates the header in mem and returns a view of the ring. The
// whole of mem must be the ring file (its length is checked against the
// header's capacity).
func Attach(mem []byte) (*Ring, error) {
	h, err := DecodeHeader(mem, int64(len(mem)))
	if err != nil {
		return nil, err
	}
	r := &Ring{
		mem: mem, data: mem[HeaderSize:], hdr: h,
		cap: h.Capacity, mask: h.Capacity - 1, max: h.MaxRecord,
		tail:       shm.U64(mem, offTail),
		head:       shm.U64(mem, offHead),
		consParked: shm.U32(mem, offConsParked),
		consFutex:  shm.U32(mem, offConsFutex),
		prodParked: shm.U32(mem, offProdParked),
		prodFutex:  shm.U32(mem, offProdFutex),
		prodState:  shm.U32(mem, offProdState),
		consState:  shm.U32(mem, offConsState),
		prodPID:    shm.U32(mem, offProducerPID),
		consPID:    shm.U32(mem, offConsumerPID),
		prodStart:  shm.U64(mem, offProducerStart),
		consStart:  shm.U64(mem, offConsumerStart),
	}
	// Positions are checked once here, and again every time they are read
	// from the peer.
	t, hd := r.tail.Load(), r.head.Load()
	if err := r.checkPositions(t, hd); err != nil {
		return nil, err
	}
	return r, nil
}

// Header returns the static header fields as read at Attach.
func (r *Ring) Header() Header { return r.hdr }

// Capacity is the size of the data area in bytes.
func (r *Ring) Capacity() int { return int(r.cap) }

// MaxRecord is the largest record, header included, that the ring carries.
func (r *Ring) MaxRecord() int { return int(r.max) }

// MaxPayload is the largest payload one record can carry.
func (r *Ring) MaxPayload() int { return int(r.max) - RecordHeaderSize }

// Epoch is the boot token the creator wrote.
func (r *Ring) Epoch() uint64 { return r.hdr.Epoch }

// Positions returns the published tail and head, for inspection.
func (r *Ring) Positions() (tail, head uint64) { return r.tail.Load(), r.head.Load() }

// Peers returns the recorded producer and consumer pids.
func (r *Ring) Peers() (producer, consumer int) {
	return int(r.prodPID.Load()), int(r.consPID.Load())
}

func (r *Ring) checkPositions(tail, head uint64) error {
	if tail < head || tail-head > r.cap || tail%Align != 0 || head%Align != 0 {
		return fmt.Errorf("%w: positions tail=%d head=%d (capacity %d)", ErrCorrupt, tail, head, r.cap)
	}
	return nil
}

// AliveEvery is how often a waiting side looks at its peer's /proc entry:
// reading it is the most expensive thing an idle waiter does (perf: a third
// of an idle sidecar session's CPU when it ran on every 10 ms park), and a
// dead peer noticed 100 ms later costs nothing.
const AliveEvery = 100 * time.Millisecond

// aliveCheck rate-limits liveness checks of the peer process. Used by one
// goroutine at a time (the side's waiter).
type aliveCheck struct{ at time.Time }

// ok reports the peer alive without asking if it was asked less than
// AliveEvery ago.
func (a *aliveCheck) ok(alive func() bool) bool {
	now := time.Now()
	if !a.at.IsZero() && now.Sub(a.at) < AliveEvery {
		return true
	}
	if !alive() {
		return false
	}
	a.at = now
	return true
}

// ProducerAlive reports whether the process recorded as producer is alive.
func (r *Ring) ProducerAlive() bool {
	return shm.Alive(int(r.prodPID.Load()), r.prodStart.Load())
}

// ConsumerAlive reports whether the process recorded as consumer is alive.
func (r *Ring) ConsumerAlive() bool {
	return shm.Alive(int(r.consPID.Load()), r.consStart.Load())
}

// Record is a record read from a ring. Payload aliases ring memory when it
// came from Consumer.Next: it is valid only until the next Commit.
type Record struct {
	Type    uint16
	Flags   uint16
	Seq     uint64
	Payload []byte
}
