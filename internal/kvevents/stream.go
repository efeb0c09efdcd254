package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Sequencer follows a stream's sequence numbers and says what is missing.
// vLLM numbers batches from 0 per publisher process: a number lower than
// expected means the publisher restarted (its earlier blocks are void).
type Sequencer struct {
	next    uint64
	started bool
}

// NewSequencer expects from first, or takes the first number seen when
// from is nil.
func NewSequencer(from *uint64) *Sequencer {
	s := &Sequencer{}
	if from != nil {
		s.next, s.started = *from, true
	}
	return s
}

// Step is what Observe found before a message.
type Step struct {
	Restart  bool   // the publisher started again: forget what it said before
	GapFrom  uint64 // sequence numbers [GapFrom, GapTo) are missing
	GapTo    uint64
	Expected uint64 // the number that was expected
}

// Gap reports whether numbers are missing.
func (s Step) Gap() bool { return s.GapTo > s.GapFrom }

// Observe takes message number seq.
func (q *Sequencer) Observe(seq uint64) Step {
	st := Step{Expected: q.next}
	switch {
	case !q.started:
		q.started = true
	case seq == q.next:
	case seq > q.next:
		st.GapFrom, st.GapTo = q.next, seq
	default: // lower: a new publisher, whose first seq numbers are missing if seq > 0
		st.Restart = true
		st.GapFrom, st.GapTo = 0, seq
	}
	q.next = seq + 1
	return st
}

var replays atomic.Uint64

// Replay asks the replay socket at endpoint (vLLM's ROUTER) for the batches
// numbered from start on, and returns them, in order, until its end marker;
// within timeout.
func Replay(ctx context.Context, endpoint string, start uint64, timeout time.Duration) ([]Message, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// A fresh identity for each request: a ROUTER routes replies by
	// identity, and one it still knows from a closed connection would get them.
	id := zmq4.SocketIdentity(fmt.Sprintf("ringside-events-%d-%d", os.Getpid(), replays.Add(1)))
	d := zmq4.NewDealer(ctx, zmq4.WithID(id), zmq4.WithDialerTimeout(timeout), zmq4.WithDialerMaxRetries(0))
	defer d.Close()
	if err := d.Dial(endpoint); err != nil {
		return nil, fmt.Errorf("kvevents: replay %s: %w", endpoint, err)
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], start)
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, sb[:])); err != nil {
		return nil, fmt.Errorf("kvevents: replay %s: %w", endpoint, err)
	}
	var out []Message
	for {
		m, err := d.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return out, fmt.Errorf("kvevents: replay %s: no end marker within %v (%d batches): %w", endpoint, timeout, len(out), ctx.Err())
			}
			return out, fmt.Errorf("kvevents: replay %s: %w", endpoint, err)
		}
		f := m.Frames
		if len(f) > 0 && len(f[0]) == 0 { // the DEALER's empty delimiter
			f = f[1:]
		}
		if len(f) == 3 && len(f[1]) == 8 && binary.BigEndian.Uint64(f[1]) == EndSeq {
			return out, nil
		}
		msg, err := DecodeFrames(f)
		if err != nil {
			return out, fmt.Errorf("kvevents: replay %s: %w", endpoint, err)
		}
		out = append(out, msg)
	}
}

// Options configure a Stream.
type Options struct {
	Endpoint string // the publisher's PUB endpoint, e.g. tcp://10.0.0.5:5557
	Replay   string // its replay (ROUTER) endpoint; empty: gaps are reported, not filled
	Topic    string // subscription prefix ("" : every topic)
	// From, if set, is the first sequence number wanted: the batches
	// before the first one received are asked of the replay socket.
	From          *uint64
	ReplayTimeout time.Duration // default 5 s
	// DropNth drops the n-th live message received (0: none), as if the
	// network had lost it: fault injection for tests of the gap fill.
	DropNth uint64
}

// Item is one thing the stream yields: a message (received live, or
// replayed to fill a gap), or a gap that replay could not fill.
type Item struct {
	Msg      *Message
	Replayed bool
	Restart  bool   // Msg is the first of a restarted publisher
	Missing  uint64 // a gap: this many batches are lost (not in the replay buffer)
	GapFrom  uint64 // ... from this sequence number
	Err      error  // why a gap could not be filled (replay failed), with Missing
}

// Stream is a subscription to one publisher that fills gaps from its
// replay socket.
type Stream struct {
	sub     zmq4.Socket
	opts    Options
	seq     *Sequencer
	stats   StreamStats
	pending []Item            // the start's replay, not yet returned
	dup     map[uint64]string // batches the start's replay gave: their live copies are skipped
	dupMax  uint64
	recv    uint64 // live messages received
}

// StreamStats counts what a Stream saw.
type StreamStats struct {
	Live, Replayed, Restarts, Gaps, Lost uint64
	ReplayRetries                        uint64 // replay requests asked again after one got nothing (replay)
}

// Subscribe connects to the publisher, waiting for it to listen as long as
// ctx lasts (an engine that is still starting); ctx bounds the
// subscription (cancel it to end Next).
func Subscribe(ctx context.Context, o Options) (*Stream, error) {
	if o.ReplayTimeout <= 0 {
		o.ReplayTimeout = 5 * time.Second
	}
	sub := zmq4.NewSub(ctx, zmq4.WithDialerRetry(200*time.Millisecond), zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(true))
	if err := sub.Dial(o.Endpoint); err != nil {
		sub.Close()
		return nil, fmt.Errorf("kvevents: subscribe %s: %w", o.Endpoint, err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, o.Topic); err != nil {
		sub.Close()
		return nil, fmt.Errorf("kvevents: subscribe %s: %w", o.Endpoint, err)
	}
	s := &Stream{sub: sub, opts: o, seq: NewSequencer(o.From)}
	if o.From != nil && o.Replay != "" {
		s.start(ctx, *o.From)
	}
	return s, nil
}

// start replays what the publisher holds from seq from on, now (the
// subscription is up already, so that nothing published meanwhile is
// lost: a batch received both ways is returned once).
func (s *Stream) start(ctx context.Context, from uint64) {
	got, err := s.replay(ctx, from)
	if err != nil {
		s.pending = append(s.pending, Item{GapFrom: from, Err: err})
	}
	s.dup = map[uint64]string{}
	if len(got) > 0 {
		s.stats.Gaps++ // what was published before the subscription
	}
	for i := range got {
		m := got[i]
		if m.Seq < from {
			continue
		}
		st := s.seq.Observe(m.Seq)
		if st.Restart { // the buffer is in order: cannot happen
			continue
		}
		if st.Gap() {
			s.pending = append(s.pending, Item{Missing: st.GapTo - st.GapFrom, GapFrom: st.GapFrom})
			s.stats.Gaps++
			s.stats.Lost += st.GapTo - st.GapFrom
		}
		s.pending = append(s.pending, Item{Msg: &m, Replayed: true})
		s.stats.Replayed++
		s.dup[m.Seq] = m.raw
		s.dupMax = m.Seq
	}
}

// Close ends the subscription.
func (s *Stream) Close() error { return s.sub.Close() }

// Stats returns the counts so far.
func (s *Stream) Stats() StreamStats { return s.stats }

// Next waits for the next live message and returns it, preceded by the
// batches that fill a gap before it (replayed) or by an item reporting
// those that could not be. A malformed message is an error (the stream
// goes on).
func (s *Stream) Next(ctx context.Context) ([]Item, error) {
	if p := s.pending; p != nil {
		s.pending = nil
		return p, nil
	}
	var msg Message
	for {
		m, err := s.sub.Recv()
		if err != nil {
			return nil, err
		}
		if s.recv++; s.recv == s.opts.DropNth {
			continue // fault injection: lost on the way
		}
		msg, err = DecodeFrames(m.Frames)
		if err != nil {
			return nil, err
		}
		if s.dup == nil {
			break
		}
		if raw, ok := s.dup[msg.Seq]; ok && raw == msg.raw {
			continue // the start's replay gave it
		}
		if msg.Seq > s.dupMax {
			s.dup = nil
		}
		break
	}
	s.stats.Live++
	st := s.seq.Observe(msg.Seq)
	var items []Item
	if st.Restart {
		s.stats.Restarts++
	}
	if st.Gap() {
		s.stats.Gaps++
		items = s.fill(ctx, st.GapFrom, st.GapTo, st.Restart)
	}
	items = append(items, Item{Msg: &msg, Restart: st.Restart && len(items) == 0})
	return items, nil
}

// replay asks the replay endpoint for the batches from seq from on; a
// request that got nothing and failed is asked once more on a fresh
// connection (a reply can be lost on the way: go-zeromq's ROUTER has been
// seen to drop the answer to a connection it had just accepted, on a loaded
// machine), so a gap waits at most twice ReplayTimeout.
func (s *Stream) replay(ctx context.Context, from uint64) ([]Message, error) {
	got, err := Replay(ctx, s.opts.Replay, from, s.opts.ReplayTimeout)
	if err != nil && len(got) == 0 && ctx.Err() == nil {
		s.stats.ReplayRetries++
		got, err = Replay(ctx, s.opts.Replay, from, s.opts.ReplayTimeout)
	}
	return got, err
}

func (s *Stream) fill(ctx context.Context, from, to uint64, restart bool) []Item {
	if s.opts.Replay == "" {
		s.stats.Lost += to - from
		return []Item{{Missing: to - from, GapFrom: from, Err: errors.New("no replay endpoint"), Restart: restart}}
	}
	got, err := s.replay(ctx, from)
	var items []Item
	next := from
	for i := range got {
		m := got[i]
		if m.Seq < next || m.Seq >= to {
			continue
		}
		if m.Seq > next { // lost from the replay buffer too
			items = append(items, Item{Missing: m.Seq - next, GapFrom: next, Restart: restart && len(items) == 0})
			s.stats.Lost += m.Seq - next
		}
		items = append(items, Item{Msg: &m, Replayed: true, Restart: restart && len(items) == 0})
		s.stats.Replayed++
		next = m.Seq + 1
	}
	if next < to {
		items = append(items, Item{Missing: to - next, GapFrom: next, Err: err, Restart: restart && len(items) == 0})
		s.stats.Lost += to - next
	}
	return items
}
