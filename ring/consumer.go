package ring

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ringside-kv/ringside/internal/invariants"
	"github.com/ringside-kv/ringside/internal/shm"
)

// Consumer is the reading side of a ring. It is not safe for concurrent use:
// a ring has exactly one consumer.
type Consumer struct {
	r         *Ring
	head      uint64 // local: records up to here were handed out
	committed uint64
	tailCache uint64
	wait      WaitConfig
	stats     WaitStats
	stop      atomic.Bool
	alive     aliveCheck
	poison    bool // with invariants.Enabled: poison released records (see Commit)
}

// NewConsumer takes the consumer role of r for this process and resumes
// from the published head.
func NewConsumer(r *Ring, wait WaitConfig) (*Consumer, error) {
	t, h := r.tail.Load(), r.head.Load()
	if err := r.checkPositions(t, h); err != nil {
		return nil, err
	}
	pid, start := shm.Self()
	r.consStart.Store(start)
	r.consPID.Store(uint32(pid))
	r.consState.Store(0)
	return &Consumer{r: r, head: h, committed: h, tailCache: h, wait: wait.withDefaults(), poison: true}, nil
}

// Ring returns the ring this consumer reads.
func (c *Consumer) Ring() *Ring { return c.r }

// Stats returns the time this consumer spent waiting for records.
func (c *Consumer) Stats() WaitStats { return c.stats }

// loadTail reads the producer's position once and validates it.
func (c *Consumer) loadTail() error {
	t := c.r.tail.Load()
	if t < c.tailCache || t < c.committed || t-c.committed > c.r.cap || t%Align != 0 {
		return fmt.Errorf("%w: producer tail %d, consumer at %d (capacity %d)", ErrCorrupt, t, c.committed, c.r.cap)
	}
	c.tailCache = t
	return nil
}

// Next borrows the next published record in place. The record's payload
// aliases ring memory and stays valid until Commit; several records may be
// borrowed before one Commit (batching). The producer's position is read at
// most once per call, and only when the records known to be published are
// used up. Next returns ErrEmpty when nothing is published and an error
// wrapping ErrCorrupt when the ring's contents are malformed; a corrupt ring
// is unusable.
func (c *Consumer) Next() (Record, error) {
	reloaded := false
	for {
		if c.head == c.tailCache {
			if reloaded {
				return Record{}, ErrEmpty
			}
			if err := c.loadTail(); err != nil {
				return Record{}, err
			}
			reloaded = true
			continue
		}
		off := c.head & c.r.mask
		contig := c.r.cap - off
		avail := c.tailCache - c.head
		if contig < RecordHeaderSize { // tail gap: skipped by both sides
			if avail < contig {
				return Record{}, fmt.Errorf("%w: tail ends inside the %d-byte gap at the end of the ring", ErrCorrupt, contig)
			}
			c.head += contig
			continue
		}
		rh, err := DecodeRecordHeader(c.r.data[off:], int(min(avail, contig)), c.r.max)
		if err != nil {
			return Record{}, fmt.Errorf("%w (at position %d)", err, c.head)
		}
		total := uint64(RecordSize(int(rh.Len)))
		if rh.Type == TypePad {
			if total != contig {
				return Record{}, fmt.Errorf("%w: pad record of %d bytes at position %d does not reach the end of the ring (%d bytes)", ErrCorrupt, total, c.head, contig)
			}
			c.head += total
			continue
		}
		start := off + RecordHeaderSize
		c.head += total
		return Record{Type: rh.Type, Flags: rh.Flags, Seq: rh.Seq, Payload: c.r.data[start : start+uint64(rh.Len) : start+uint64(rh.Len)]}, nil
	}
}

// Commit releases every record borrowed so far back to the producer with one
// store of head, and wakes the producer only if it waits for space. Payloads
// borrowed with Next are invalid from here on: in builds with invariants
// (internal/invariants) Commit overwrites the released bytes with poison
// first, so that code still holding an alias reads garbage and fails its
// tests.
func (c *Consumer) Commit() {
	if c.head == c.committed {
		return
	}
	if invariants.Enabled && c.poison {
		c.mangle(c.committed, c.head)
	}
	c.r.head.Store(c.head)
	c.committed = c.head
	if c.r.prodParked.Load() != 0 {
		c.r.prodFutex.Add(1)
		shm.FutexWake(c.r.prodFutex, 1)
	}
}

// mangle poisons the data-area bytes of positions [from, to), which this
// consumer has read and not yet released. It runs before the store of head:
// until then the producer never writes there, so the poison cannot land on a
// record the producer has started to write.
func (c *Consumer) mangle(from, to uint64) {
	for from < to {
		off := from & c.r.mask
		n := min(to-from, c.r.cap-off)
		invariants.Mangle(c.r.data[off : off+n])
		from += n
	}
}

// Read is the copying form of Next: it copies the payload into buf (grown if
// needed), commits, and returns the record with Payload pointing into buf.
func (c *Consumer) Read(buf []byte) (Record, error) {
	rec, err := c.Next()
	if err != nil {
		return rec, err
	}
	buf = append(buf[:0], rec.Payload...)
	rec.Payload = buf
	c.Commit()
	return rec, nil
}

// Available reports whether a record may be published past what this
// consumer has read, reading the producer's position.
func (c *Consumer) Available() bool { return c.r.tail.Load() != c.head }

// Wait blocks until a record is published, the producer is gone (ErrPeerDead,
// ErrPeerClosed), or deadline passes (os.ErrDeadlineExceeded). A zero
// deadline waits as long as the producer lives. Records published before the
// producer closed are always delivered first.
func (c *Consumer) Wait(deadline time.Time) error {
	cond := func() bool { return c.r.tail.Load() != c.head }
	peer := func() error {
		if c.stop.Load() {
			return ErrClosed
		}
		if c.r.prodState.Load() != 0 {
			if cond() {
				return nil
			}
			return ErrPeerClosed
		}
		if !c.alive.ok(c.r.ProducerAlive) {
			if cond() {
				return nil
			}
			return ErrPeerDead
		}
		return nil
	}
	return c.wait.wait(cond, peer, c.r.consParked, c.r.consFutex, deadline, c.r.check, &c.stats)
}

// Interrupt makes a Wait in progress (or the next one) return ErrClosed. It
// is the one method that may be called from another goroutine.
func (c *Consumer) Interrupt() {
	c.stop.Store(true)
	c.r.consFutex.Add(1)
	shm.FutexWake(c.r.consFutex, 1)
}

// Close marks the consumer side closed and wakes the producer if it waits.
func (c *Consumer) Close() {
	c.Commit()
	c.r.consState.Store(1)
	c.r.prodFutex.Add(1)
	shm.FutexWake(c.r.prodFutex, 1)
}
