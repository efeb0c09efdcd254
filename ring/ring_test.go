package ring

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/internal/shm"
)

// newHeapRing formats a ring over Go heap memory: the same layout code as a
// shared mapping, testable with the race detector.
func newHeapRing(t testing.TB, capacity uint64, maxRecord uint32) (*Ring, *Producer, *Consumer) {
	t.Helper()
	return newHeapRingWait(t, capacity, maxRecord, DefaultWait)
}

// newHeapRingWait is newHeapRing with both sides waiting as w says.
func newHeapRingWait(t testing.TB, capacity uint64, maxRecord uint32, w WaitConfig) (*Ring, *Producer, *Consumer) {
	t.Helper()
	mem := shm.Aligned(HeaderSize + int(capacity))
	r, err := Format(mem, capacity, maxRecord, 42, 0)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewProducer(r, w)
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewConsumer(r, w)
	if err != nil {
		t.Fatal(err)
	}
	return r, p, c
}

func payloadOf(i, n int) []byte {
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i*31 + j)
	}
	return b
}

func TestRoundTripAndWrap(t *testing.T) {
	tests := []struct {
		name  string
		sizes []int
		batch int
	}{
		{"empty payloads", []int{0, 0, 0}, 1},
		{"odd sizes", []int{1, 5, 7, 9, 13, 100, 333}, 1},
		{"exact header fits", []int{8, 16, 24}, 2},
		{"large wraps", []int{900, 1000, 700, 1010, 2000}, 1},
		{"batched", []int{3, 64, 128, 512, 8, 1, 0, 1000}, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, p, c := newHeapRing(t, 4096, 2048)
			seq := uint64(0)
			for round := 0; round < 50; round++ { // many laps of the ring
				var want [][]byte
				for i, n := range tt.sizes {
					b := payloadOf(round+i, n)
					want = append(want, b)
					if err := p.Append(uint16(1+i%7), uint16(i), seq, b); err != nil {
						if errors.Is(err, ErrFull) { // drain and retry
							p.Publish()
							want = want[:len(want)-1]
							break
						}
						t.Fatal(err)
					}
					seq++
					if (i+1)%tt.batch == 0 {
						p.Publish()
					}
				}
				p.Publish()
				for i, w := range want {
					rec, err := c.Next()
					if err != nil {
						t.Fatalf("round %d record %d: %v", round, i, err)
					}
					if !bytes.Equal(rec.Payload, w) || rec.Type != uint16(1+i%7) || rec.Flags != uint16(i) {
						t.Fatalf("round %d record %d: got type %d flags %d %x, want %x", round, i, rec.Type, rec.Flags, rec.Payload, w)
					}
				}
				if _, err := c.Next(); !errors.Is(err, ErrEmpty) {
					t.Fatalf("after draining: %v, want ErrEmpty", err)
				}
				c.Commit()
			}
		})
	}
}

func TestTailGapAndPad(t *testing.T) {
	// capacity 4096: fill so that exactly 8 bytes remain before the end.
	r, p, c := newHeapRing(t, 4096, 2048)
	// 2 records of 2048-16-? bytes: RecordSize(2024)=2040, twice = 4080; 16 left.
	for i := 0; i < 2; i++ {
		if err := p.Append(1, 0, 0, make([]byte, 2024)); err != nil {
			t.Fatal(err)
		}
	}
	// a record of RecordSize(0)=16 leaves 0; use 8 bytes to leave a gap: need
	// 4096-4080=16 -> put an 8-byte gap by appending size 8 payload? Check
	// both gap shapes explicitly by positions.
	p.Publish()
	for i := 0; i < 2; i++ {
		if _, err := c.Next(); err != nil {
			t.Fatal(err)
		}
	}
	c.Commit()
	// 16 bytes remain before the end: a 24-byte record pads them.
	if err := p.Append(2, 0, 7, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	p.Publish()
	tail, _ := r.Positions()
	if tail != 4096+24 {
		t.Fatalf("tail %d, want %d (16-byte pad then a 24-byte record)", tail, 4096+24)
	}
	rec, err := c.Next()
	if err != nil || rec.Seq != 7 || len(rec.Payload) != 8 {
		t.Fatalf("after pad: %+v %v", rec, err)
	}
	c.Commit()
	// Now at offset 24. Fill to leave exactly 8 bytes: 4096-24-8 = 4064 = 2 records of 2032.
	for i := 0; i < 2; i++ {
		if err := p.Append(1, 0, 0, make([]byte, 2016)); err != nil {
			t.Fatal(err)
		}
	}
	p.Publish()
	for i := 0; i < 2; i++ {
		if _, err := c.Next(); err != nil {
			t.Fatal(err)
		}
	}
	c.Commit()
	if tail, _ := r.Positions(); tail&4095 != 4088 {
		t.Fatalf("offset %d, want 4088", tail&4095)
	}
	if err := p.Append(3, 0, 9, []byte("gap")); err != nil {
		t.Fatal(err)
	}
	p.Publish()
	rec, err = c.Next()
	if err != nil || rec.Seq != 9 || string(rec.Payload) != "gap" {
		t.Fatalf("after 8-byte gap: %+v %v", rec, err)
	}
	if tail, _ := r.Positions(); tail != 2*4096+24 {
		t.Fatalf("tail %d, want %d", tail, 2*4096+24)
	}
}

func TestFullAndTooLarge(t *testing.T) {
	_, p, c := newHeapRing(t, 4096, 1024)
	if err := p.Append(1, 0, 0, make([]byte, 1024)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("oversized: %v", err)
	}
	if err := p.Append(0, 0, 0, nil); !errors.Is(err, ErrBadType) {
		t.Fatalf("type 0: %v", err)
	}
	if err := p.Append(TypePad, 0, 0, nil); !errors.Is(err, ErrBadType) {
		t.Fatalf("pad type: %v", err)
	}
	n := 0
	for {
		err := p.Append(1, 0, 0, make([]byte, 1000))
		if errors.Is(err, ErrFull) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n != 4 {
		t.Fatalf("fit %d records of 1016 bytes in 4096, want 4", n)
	}
	// Not published: the consumer sees nothing.
	if _, err := c.Next(); !errors.Is(err, ErrEmpty) {
		t.Fatalf("unpublished: %v", err)
	}
	p.Publish()
	if _, err := c.Next(); err != nil {
		t.Fatal(err)
	}
	// Borrowed but not committed: still full for the producer.
	if err := p.Append(1, 0, 0, make([]byte, 1000)); !errors.Is(err, ErrFull) {
		t.Fatalf("before commit: %v", err)
	}
	c.Commit()
	if err := p.Append(1, 0, 0, make([]byte, 1000)); err != nil {
		t.Fatalf("after commit: %v", err)
	}
}

func TestCorruptPositionsAndRecords(t *testing.T) {
	le := binary.LittleEndian
	tests := []struct {
		name    string
		mangle  func(r *Ring)
		wantErr error
	}{
		{"tail runs backwards", func(r *Ring) { r.tail.Store(8) }, ErrCorrupt},
		{"tail past capacity", func(r *Ring) { r.tail.Store(r.head.Load() + 8192) }, ErrCorrupt},
		{"tail unaligned", func(r *Ring) { r.tail.Store(r.tail.Load() + 3) }, ErrCorrupt},
		{"length past tail", func(r *Ring) { le.PutUint32(r.data[r.head.Load()&r.mask:], 500) }, ErrCorrupt},
		{"length past maximum", func(r *Ring) { le.PutUint32(r.data[r.head.Load()&r.mask:], 1<<30) }, ErrCorrupt},
		{"type zero", func(r *Ring) { le.PutUint16(r.data[(r.head.Load()&r.mask)+4:], 0) }, ErrCorrupt},
		{"short pad", func(r *Ring) { le.PutUint16(r.data[(r.head.Load()&r.mask)+4:], TypePad) }, ErrCorrupt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, p, c := newHeapRing(t, 4096, 1024)
			// advance both positions a little so "backwards" is possible
			for i := 0; i < 3; i++ {
				p.Append(1, 0, 0, make([]byte, 40))
			}
			p.Publish()
			for i := 0; i < 3; i++ {
				c.Next()
			}
			c.Commit()
			p.Append(1, 0, 0, make([]byte, 40))
			p.Publish()
			tt.mangle(r)
			_, err := c.Next()
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got %v, want %v", err, tt.wantErr)
			}
		})
	}
	t.Run("head past producer", func(t *testing.T) {
		r, p, _ := newHeapRing(t, 4096, 1024)
		for i := 0; i < 3; i++ {
			if err := p.Append(1, 0, 0, make([]byte, 1000)); err != nil {
				t.Fatal(err)
			}
		}
		p.Publish()
		r.head.Store(1 << 40)
		p.Append(1, 0, 0, make([]byte, 1000)) // still fits by the cached head
		if err := p.Append(1, 0, 0, make([]byte, 1000)); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("got %v, want ErrCorrupt", err)
		}
	})
}

func TestBadHeaders(t *testing.T) {
	good := Header{Magic: Magic, Version: Version, HeaderSize: HeaderSize, Capacity: 4096, Align: Align, MaxRecord: 1024, Epoch: 1}
	size := int64(HeaderSize + 4096)
	tests := []struct {
		name string
		mod  func(h *Header)
		size int64
		want string
	}{
		{"good", func(h *Header) {}, size, ""},
		{"magic", func(h *Header) { h.Magic = 0 }, size, "magic"},
		{"version", func(h *Header) { h.Version = 2 }, size, "version"},
		{"header size", func(h *Header) { h.HeaderSize = 64 }, size, "header size"},
		{"align", func(h *Header) { h.Align = 16 }, size, "alignment"},
		{"capacity not power of two", func(h *Header) { h.Capacity = 5000 }, size, "capacity"},
		{"capacity too small", func(h *Header) { h.Capacity = 1024 }, size, "capacity"},
		{"capacity huge", func(h *Header) { h.Capacity = 1 << 40 }, size, "capacity"},
		{"max record over half", func(h *Header) { h.MaxRecord = 4096 }, size, "max record"},
		{"max record tiny", func(h *Header) { h.MaxRecord = 8 }, size, "max record"},
		{"file too short", func(h *Header) {}, size - 4096, "file is"},
		{"file too long", func(h *Header) {}, size + 8, "file is"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := good
			tt.mod(&h)
			b := make([]byte, HeaderSize)
			EncodeHeader(b, &h)
			got, err := DecodeHeader(b, tt.size)
			if tt.want == "" {
				if err != nil || got != h {
					t.Fatalf("got %+v, %v", got, err)
				}
				return
			}
			if !errors.Is(err, ErrBadHeader) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want ErrBadHeader mentioning %q", err, tt.want)
			}
		})
	}
	if _, err := DecodeHeader(make([]byte, 10), -1); !errors.Is(err, ErrBadHeader) {
		t.Fatalf("short buffer: %v", err)
	}
}

// TestConcurrent runs a producer and a consumer goroutine over heap memory
// under the race detector, with blocking waits in both directions.
func TestConcurrent(t *testing.T) {
	for _, wait := range []struct {
		name string
		cfg  WaitConfig
	}{{"spin", DefaultWait}, {"park", ParkWait}} {
		t.Run(wait.name, func(t *testing.T) {
			mem := shm.Aligned(HeaderSize + 8192)
			r, err := Format(mem, 8192, 0, 1, 0)
			if err != nil {
				t.Fatal(err)
			}
			p, _ := NewProducer(r, wait.cfg)
			c, _ := NewConsumer(r, wait.cfg)
			const n = 20000
			deadline := time.Now().Add(time.Minute)
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(1, 2))
				for i := 0; i < n; i++ {
					if err := p.Write(1, 0, uint64(i), payloadOf(i, rng.IntN(700)), deadline); err != nil {
						t.Error(err)
						return
					}
				}
				p.Close()
			}()
			rng := rand.New(rand.NewPCG(1, 2))
			for i := 0; i < n; i++ {
				if err := c.Wait(deadline); err != nil {
					t.Fatalf("record %d: %v", i, err)
				}
				rec, err := c.Next()
				if err != nil {
					t.Fatal(err)
				}
				if rec.Seq != uint64(i) || !bytes.Equal(rec.Payload, payloadOf(i, rng.IntN(700))) {
					t.Fatalf("record %d: seq %d, payload mismatch", i, rec.Seq)
				}
				if i%3 == 0 {
					c.Commit()
				}
			}
			c.Commit()
			wg.Wait()
			if err := c.Wait(deadline); !errors.Is(err, ErrPeerClosed) {
				t.Fatalf("after close: %v, want ErrPeerClosed", err)
			}
		})
	}
}

func TestWaitDeadline(t *testing.T) {
	_, _, c := newHeapRing(t, 4096, 0)
	err := c.Wait(time.Now().Add(20 * time.Millisecond))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("got %v, want os.ErrDeadlineExceeded", err)
	}
}

func TestFileCreateOpen(t *testing.T) {
	dir := shmDir(t)
	path := dir + "/r1"
	f, err := Create(path, Options{Capacity: 8192})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, %v", fi.Mode(), err)
	}
	g, err := Open(path, f.Epoch())
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if _, err := Open(path, f.Epoch()+1); !errors.Is(err, ErrBadHeader) {
		t.Fatalf("wrong epoch: %v", err)
	}
	// Create again: the creator is alive (this process is its producer).
	p, _ := NewProducer(f.Ring, DefaultWait)
	_ = p
	if _, err := Create(path, Options{Capacity: 8192}); !errors.Is(err, ErrInUse) {
		t.Fatalf("live ring replaced: %v", err)
	}
	// A planted symlink is never followed.
	target := dir + "/target"
	os.WriteFile(target, []byte("precious"), 0o600)
	link := dir + "/link"
	os.Symlink(target, link)
	if _, err := Open(link, 0); err == nil {
		t.Fatal("opened through a symlink")
	}
	// Create replaces garbage (not a ring) but never writes through a link:
	// the link itself is removed and the target keeps its bytes.
	if h, err := Create(link, Options{Capacity: 4096}); err != nil {
		t.Fatalf("create over planted link: %v", err)
	} else {
		h.Close()
	}
	if b, _ := os.ReadFile(target); string(b) != "precious" {
		t.Fatalf("symlink target modified: %q", b)
	}
	// Garbage file at a path: Open refuses, Create replaces.
	os.WriteFile(dir+"/junk", bytes.Repeat([]byte{0xAB}, HeaderSize+4096), 0o600)
	if _, err := Open(dir+"/junk", 0); !errors.Is(err, ErrBadHeader) {
		t.Fatalf("garbage opened: %v", err)
	}
	if h, err := Create(dir+"/junk", Options{Capacity: 4096}); err != nil {
		t.Fatal(err)
	} else {
		h.Close()
	}
	// Truncated file: Check reports it.
	os.Truncate(path, HeaderSize)
	if err := f.Check(); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("truncation not detected: %v", err)
	}
}

func shmDir(t testing.TB) string {
	t.Helper()
	base := "/dev/shm"
	if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "ringside-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func ExampleProducer() {
	mem := shm.Aligned(HeaderSize + 4096)
	r, _ := Format(mem, 4096, 0, 1, 0)
	p, _ := NewProducer(r, DefaultWait)
	c, _ := NewConsumer(r, DefaultWait)
	p.Append(1, 0, 100, []byte("hello"))
	p.Append(1, 0, 101, []byte("world"))
	p.Publish() // one store publishes both
	for {
		rec, err := c.Next()
		if err != nil {
			break
		}
		fmt.Println(rec.Seq, string(rec.Payload))
	}
	c.Commit()
	// Output:
	// 100 hello
	// 101 world
}

func TestInterrupt(t *testing.T) {
	_, _, c := newHeapRing(t, 4096, 0)
	done := make(chan error, 1)
	go func() { done <- c.Wait(time.Now().Add(time.Minute)) }()
	time.Sleep(20 * time.Millisecond)
	c.Interrupt()
	select {
	case err := <-done:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("got %v, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Interrupt did not end the wait")
	}
}
