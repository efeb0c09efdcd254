package ring

import (
	"fmt"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
)

// Producer is the writing side of a ring. It is not safe for concurrent use:
// a ring has exactly one producer.
type Producer struct {
	r         *Ring
	tail      uint64 // local position: written but maybe not published
	published uint64
	headCache uint64
	wait      WaitConfig
	stats     WaitStats
	alive     aliveCheck
}

// NewProducer takes the producer role of r for this process: it records this
// process's pid and start time in the header and resumes from the published
// tail.
func NewProducer(r *Ring, wait WaitConfig) (*Producer, error) {
	t, h := r.tail.Load(), r.head.Load()
	if err := r.checkPositions(t, h); err != nil {
		return nil, err
	}
	pid, start := shm.Self()
	r.prodStart.Store(start)
	r.prodPID.Store(uint32(pid))
	r.prodState.Store(0)
	return &Producer{r: r, tail: t, published: t, headCache: h, wait: wait.withDefaults()}, nil
}

// Ring returns the ring this producer writes.
func (p *Producer) Ring() *Ring { return p.r }

// Stats returns the time this producer spent waiting for space.
func (p *Producer) Stats() WaitStats { return p.stats }

// free reports whether need bytes fit, refreshing the cached head at most
// once.
func (p *Producer) free(need uint64) (bool, error) {
	if p.tail+need-p.headCache <= p.r.cap {
		return true, nil
	}
	h := p.r.head.Load()
	if h < p.headCache || h > p.published {
		return false, fmt.Errorf("%w: consumer head %d outside [%d, %d]", ErrCorrupt, h, p.headCache, p.published)
	}
	p.headCache = h
	return p.tail+need-h <= p.r.cap, nil
}

// Claim reserves a record with an n-byte payload and returns the payload
// bytes to fill in place. The record becomes visible to the consumer at the
// next Publish. It returns ErrFull when the ring has no room now and
// ErrTooLarge when the record could never fit.
func (p *Producer) Claim(typ, flags uint16, seq uint64, n int) ([]byte, error) {
	if typ == 0 || typ == TypePad {
		return nil, fmt.Errorf("%w: %#x", ErrBadType, typ)
	}
	if n < 0 || RecordSize(n) > int(p.r.max) {
		return nil, fmt.Errorf("%w: payload of %d bytes, at most %d", ErrTooLarge, n, p.r.max-RecordHeaderSize)
	}
	size := uint64(RecordSize(n))
	off := p.tail & p.r.mask
	contig := p.r.cap - off
	need := size
	if contig < size {
		need += contig
	}
	ok, err := p.free(need)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, ErrFull
	}
	if contig < size {
		if contig >= RecordHeaderSize {
			PutRecordHeader(p.r.data[off:], RecordHeader{Len: uint32(contig - RecordHeaderSize), Type: TypePad})
		}
		p.tail += contig
		off = 0
	}
	rec := p.r.data[off : off+size]
	PutRecordHeader(rec, RecordHeader{Len: uint32(n), Type: typ, Flags: flags, Seq: seq})
	clear(rec[RecordHeaderSize+n:]) // zero the alignment padding
	p.tail += size
	return rec[RecordHeaderSize : RecordHeaderSize+n], nil
}

// Append copies payload into a new record; see Claim.
func (p *Producer) Append(typ, flags uint16, seq uint64, payload []byte) error {
	b, err := p.Claim(typ, flags, seq, len(payload))
	if err != nil {
		return err
	}
	copy(b, payload)
	return nil
}

// Publish makes every record claimed so far visible with one store of tail,
// and wakes the consumer only if it is parked.
func (p *Producer) Publish() {
	if p.tail == p.published {
		return
	}
	// The store is sequentially consistent (XCHG on amd64, STLR on arm64):
	// the records written above are visible before tail, and the load of the
	// parked flag below cannot move before the store (Dekker handshake with
	// the consumer's park).
	p.r.tail.Store(p.tail)
	p.published = p.tail
	if p.r.consParked.Load() != 0 {
		p.r.consFutex.Add(1)
		shm.FutexWake(p.r.consFutex, 1)
	}
}

// Pending reports how many bytes are claimed but not yet published.
func (p *Producer) Pending() int { return int(p.tail - p.published) }

// Write appends one record and publishes it, waiting for space until
// deadline (zero deadline: wait as long as the consumer lives). It returns
// ErrPeerDead or ErrPeerClosed when the consumer is gone, and
// os.ErrDeadlineExceeded when the deadline passes first.
func (p *Producer) Write(typ, flags uint16, seq uint64, payload []byte, deadline time.Time) error {
	for {
		err := p.Append(typ, flags, seq, payload)
		if err == nil {
			p.Publish()
			return nil
		}
		if err != ErrFull {
			return err
		}
		p.Publish()
		if err := p.WaitSpace(RecordSize(len(payload)), deadline); err != nil {
			return err
		}
	}
}

// WaitSpace waits until a record of size bytes (header included) could be
// claimed, the consumer is gone, or deadline passes.
func (p *Producer) WaitSpace(size int, deadline time.Time) error {
	need := uint64(size)
	if off := p.tail & p.r.mask; p.r.cap-off < need {
		need += p.r.cap - off
	}
	var werr error
	cond := func() bool {
		ok, err := p.free(need)
		if err != nil {
			werr = err
			return true
		}
		return ok
	}
	peer := func() error {
		if p.r.consState.Load() != 0 {
			return ErrPeerClosed
		}
		if !p.alive.ok(p.r.ConsumerAlive) {
			return ErrPeerDead
		}
		return nil
	}
	err := p.wait.wait(cond, peer, p.r.prodParked, p.r.prodFutex, deadline, p.r.check, &p.stats)
	if werr != nil {
		return werr
	}
	return err
}

// Close marks the producer side closed and wakes the consumer, which drains
// what was published and then gets ErrPeerClosed.
func (p *Producer) Close() {
	p.Publish()
	p.r.prodState.Store(1)
	p.r.consFutex.Add(1)
	shm.FutexWake(p.r.consFutex, 1)
}

// TryWrite appends one record and publishes it without waiting: ErrFull
// when the ring has no room now.
func (p *Producer) TryWrite(typ, flags uint16, seq uint64, payload []byte) error {
	if err := p.Append(typ, flags, seq, payload); err != nil {
		return err
	}
	p.Publish()
	return nil
}

// SpaceWaiter returns a wait for room for a record of size bytes (header
// included) at the producer's current position. The wait reads only the
// ring's shared words (the consumer's head and state, the producer's park
// flag and futex) and none of the Producer's own fields, so its owner may
// release whatever lock guards the Producer while it waits, provided
// nothing writes through the Producer until the wait returns. It returns
// nil when the room is there, ErrPeerClosed or ErrPeerDead when the
// consumer is gone, and os.ErrDeadlineExceeded when deadline passes first.
//
// stop, when not nil, is read whenever the wait wakes: once it returns
// true the wait ends with ErrClosed (Interrupt wakes a parked wait).
func (p *Producer) SpaceWaiter(size int, stop func() bool) func(deadline time.Time) error {
	need := uint64(size)
	if off := p.tail & p.r.mask; p.r.cap-off < need {
		need += p.r.cap - off
	}
	// Room for need bytes at tail: tail + need - head <= cap.
	target := int64(p.tail) + int64(need) - int64(p.r.cap)
	r, w := p.r, p.wait
	return func(deadline time.Time) error {
		var alive aliveCheck
		var st WaitStats
		cond := func() bool { return int64(r.head.Load()) >= target }
		peer := func() error {
			if stop != nil && stop() {
				return ErrClosed
			}
			if r.consState.Load() != 0 {
				return ErrPeerClosed
			}
			if !alive.ok(r.ConsumerAlive) {
				return ErrPeerDead
			}
			return nil
		}
		return w.wait(cond, peer, r.prodParked, r.prodFutex, deadline, r.check, &st)
	}
}

// Interrupt wakes a parked SpaceWaiter wait (which then reads its stop
// function); safe from any goroutine.
func (p *Producer) Interrupt() {
	p.r.prodFutex.Add(1)
	shm.FutexWake(p.r.prodFutex, 1)
}
