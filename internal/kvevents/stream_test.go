package kvevents

import (
	"context"
	"encoding/binary"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// publisher is vLLM's ZmqEventPublisher, in Go: a PUB socket that sends
// [topic, seq, payload] and a ROUTER that answers a replay request
// [id, "", start] with [id, "", topic, seq, payload] for every buffered
// batch from start on and the end marker [id, "", "", -1, ""]. Its payloads
// are the captured real vLLM ones.
type publisher struct {
	t        *testing.T
	pub, rtr zmq4.Socket
	pubEP    string
	rtrEP    string
	mu       sync.Mutex
	buf      [][2][]byte // (seq, payload)
	keep     int         // buffer_steps
	ignore   int         // replay requests left unanswered, from the next one on
}

func freeEndpoint(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

func newPublisher(t *testing.T, ctx context.Context) *publisher {
	t.Helper()
	p := &publisher{t: t, pub: zmq4.NewPub(ctx), rtr: zmq4.NewRouter(ctx, zmq4.WithID(zmq4.SocketIdentity("router"))), keep: 1000}
	p.pubEP, p.rtrEP = freeEndpoint(t), freeEndpoint(t)
	if err := p.pub.Listen(p.pubEP); err != nil {
		t.Fatal(err)
	}
	if err := p.rtr.Listen(p.rtrEP); err != nil {
		t.Fatal(err)
	}
	go p.serveReplay()
	t.Cleanup(func() { p.pub.Close(); p.rtr.Close() })
	return p
}

func be(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// send buffers batch seq and publishes it unless lost.
func (p *publisher) send(seq uint64, payload []byte, lost bool) {
	p.mu.Lock()
	p.buf = append(p.buf, [2][]byte{be(seq), payload})
	if len(p.buf) > p.keep {
		p.buf = p.buf[len(p.buf)-p.keep:]
	}
	p.mu.Unlock()
	if !lost {
		if err := p.pub.Send(zmq4.NewMsgFrom([]byte("kv@t@m"), be(seq), payload)); err != nil {
			p.t.Error(err)
		}
	}
}

func (p *publisher) restart() {
	p.mu.Lock()
	p.buf = nil
	p.mu.Unlock()
}

func (p *publisher) serveReplay() {
	for {
		m, err := p.rtr.Recv()
		if err != nil {
			return
		}
		if len(m.Frames) != 3 || len(m.Frames[2]) != 8 {
			continue
		}
		id, start := m.Frames[0], binary.BigEndian.Uint64(m.Frames[2])
		p.mu.Lock()
		buf := append([][2][]byte(nil), p.buf...)
		drop := p.ignore > 0
		if drop {
			p.ignore--
		}
		p.mu.Unlock()
		if drop {
			continue
		}
		for _, b := range buf {
			if binary.BigEndian.Uint64(b[0]) >= start {
				if p.rtr.Send(zmq4.NewMsgFrom(id, []byte{}, []byte("kv@t@m"), b[0], b[1])) != nil {
					return
				}
			}
		}
		if p.rtr.Send(zmq4.NewMsgFrom(id, []byte{}, []byte{}, be(EndSeq), []byte{})) != nil {
			return
		}
	}
}

type seen struct {
	seq               uint64
	replayed, restart bool
	missing           uint64
}

func collect(t *testing.T, ctx context.Context, s *Stream, until func([]seen) bool) []seen {
	t.Helper()
	var out []seen
	for !until(out) {
		items, err := s.Next(ctx)
		if err != nil {
			t.Fatalf("after %+v: %v", out, err)
		}
		for _, it := range items {
			x := seen{replayed: it.Replayed, restart: it.Restart, missing: it.Missing}
			if it.Msg != nil {
				x.seq = it.Msg.Seq
			} else {
				x.seq = it.GapFrom
			}
			out = append(out, x)
		}
	}
	return out
}

func payloads(t *testing.T) [][]byte {
	cs, _ := loadCapture(t)
	var ps [][]byte
	for _, c := range cs {
		ps = append(ps, frames(c)[2])
	}
	return ps
}

// A stream joined late, a batch lost on the way, a batch also lost from the
// replay buffer, and a publisher that restarts: every batch the replay
// socket holds is delivered once, in order; the rest is reported.
func TestStreamFillsGapsFromReplay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ps := payloads(t)
	p := newPublisher(t, ctx)
	for seq := uint64(0); seq < 3; seq++ { // before anyone subscribes
		p.send(seq, ps[seq%uint64(len(ps))], false)
	}
	from := uint64(0)
	s, err := Subscribe(ctx, Options{Endpoint: p.pubEP, Replay: p.rtrEP, From: &from, ReplayTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got := collect(t, ctx, s, func(x []seen) bool { return len(x) >= 3 })
	for i, x := range got {
		if x.seq != uint64(i) || !x.replayed {
			t.Fatalf("start: %+v", got)
		}
	}
	time.Sleep(300 * time.Millisecond) // the subscription reaches the publisher
	p.send(3, ps[3%len(ps)], false)
	p.send(4, ps[4%len(ps)], true) // lost live, in the replay buffer
	p.send(5, ps[5%len(ps)], false)
	got = collect(t, ctx, s, func(x []seen) bool { return len(x) > 0 && x[len(x)-1].seq == 5 })
	var seqs []uint64
	replayed4 := false
	for _, x := range got {
		seqs = append(seqs, x.seq)
		if x.seq == 4 {
			replayed4 = x.replayed
		}
	}
	if len(seqs) != 3 || seqs[0] != 3 || seqs[1] != 4 || seqs[2] != 5 || !replayed4 {
		t.Fatalf("after a lost batch: %+v", got)
	}
	// Lost live and from the replay buffer too (it keeps 2 batches): 6..8
	// are reported lost, 9 is replayed.
	p.keep = 2
	for seq := uint64(6); seq < 10; seq++ {
		p.send(seq, ps[seq%uint64(len(ps))], true)
	}
	p.send(10, ps[0], false)
	got = collect(t, ctx, s, func(x []seen) bool { return len(x) > 0 && x[len(x)-1].seq == 10 })
	if len(got) != 3 || got[0].missing != 3 || got[0].seq != 6 || got[1].seq != 9 || !got[1].replayed || got[2].replayed {
		t.Fatalf("a gap partly lost from the replay buffer: %+v", got)
	}
	// The publisher restarts: seq 0 lost, 1 received.
	p.restart()
	p.keep = 1000
	p.send(0, ps[0], true)
	p.send(1, ps[1], false)
	got = collect(t, ctx, s, func(x []seen) bool { return len(x) > 0 && x[len(x)-1].seq == 1 && !x[len(x)-1].replayed })
	if len(got) != 2 || !got[0].restart || got[0].seq != 0 || !got[0].replayed || got[1].seq != 1 {
		t.Fatalf("after a restart: %+v", got)
	}
	st := s.Stats()
	if st.Restarts != 1 || st.Replayed < 5 {
		t.Fatalf("stats %+v", st)
	}
}

// Without a replay endpoint a gap is reported as lost.
func TestStreamWithoutReplay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ps := payloads(t)
	p := newPublisher(t, ctx)
	s, err := Subscribe(ctx, Options{Endpoint: p.pubEP})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	time.Sleep(300 * time.Millisecond) // the subscription reaches the publisher
	for seq := uint64(0); seq < 30; seq++ {
		p.send(seq, ps[0], seq%2 == 1) // one in two lost
	}
	got := collect(t, ctx, s, func(x []seen) bool { return len(x) > 0 && x[len(x)-1].seq == 28 && x[len(x)-1].missing == 0 })
	lost := false
	for _, x := range got {
		lost = lost || x.missing > 0
	}
	if !lost || s.Stats().Lost == 0 {
		t.Fatalf("no gap reported: %+v", got)
	}
}

func TestSequencer(t *testing.T) {
	q := NewSequencer(nil)
	for i, c := range []struct {
		seq     uint64
		restart bool
		from    uint64
		to      uint64
	}{
		{5, false, 0, 0}, {6, false, 0, 0}, {9, false, 7, 9}, {10, false, 0, 0}, {3, true, 0, 3}, {4, false, 0, 0}, {0, true, 0, 0},
	} {
		st := q.Observe(c.seq)
		if st.Restart != c.restart || st.GapFrom != c.from || st.GapTo != c.to {
			t.Fatalf("step %d (seq %d): %+v", i, c.seq, st)
		}
	}
	from := uint64(2)
	q = NewSequencer(&from)
	if st := q.Observe(4); !st.Gap() || st.GapFrom != 2 || st.GapTo != 4 {
		t.Fatalf("from 2, first 4: %+v", st)
	}
}

// A replay request whose answer never comes (a reply lost on the way) is
// asked once more on a fresh connection: the gap is filled, not reported.
func TestStreamAsksAReplayAgain(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ps := payloads(t)
	p := newPublisher(t, ctx)
	from := uint64(0)
	s, err := Subscribe(ctx, Options{Endpoint: p.pubEP, Replay: p.rtrEP, From: &from, ReplayTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	time.Sleep(300 * time.Millisecond) // the subscription reaches the publisher
	p.mu.Lock()
	p.ignore = 1
	p.mu.Unlock()
	p.send(0, ps[0], false)
	p.send(1, ps[1%len(ps)], true) // lost live, in the replay buffer
	p.send(2, ps[2%len(ps)], false)
	got := collect(t, ctx, s, func(x []seen) bool { return len(x) > 0 && x[len(x)-1].seq == 2 })
	if len(got) != 3 || got[1].seq != 1 || !got[1].replayed || got[1].missing != 0 {
		t.Fatalf("a replay asked once and left unanswered: %+v", got)
	}
	if st := s.Stats(); st.ReplayRetries != 1 {
		t.Fatalf("stats %+v, want one replay asked again", st)
	}
}
