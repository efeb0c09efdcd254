package ring

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/ringside-kv/ringside/internal/shm"
)

// FuzzDecodeHeader: any bytes and any file size either decode to a header
// that passes Validate, or give an error wrapping ErrBadHeader; never a panic.
func FuzzDecodeHeader(f *testing.F) {
	good := make([]byte, HeaderSize)
	EncodeHeader(good, &Header{Magic: Magic, Version: Version, HeaderSize: HeaderSize, Capacity: 4096, Align: Align, MaxRecord: 1024, Epoch: 7})
	f.Add(good[:128], int64(HeaderSize+4096))
	f.Add(good[:128], int64(0))
	f.Add([]byte{}, int64(-1))
	f.Fuzz(func(t *testing.T, head []byte, size int64) {
		b := make([]byte, HeaderSize)
		copy(b, head)
		h, err := DecodeHeader(b, size)
		if err != nil {
			if !errors.Is(err, ErrBadHeader) {
				t.Fatalf("error %v does not wrap ErrBadHeader", err)
			}
			return
		}
		if h.Validate(size) != nil || h.Capacity&(h.Capacity-1) != 0 || uint64(h.MaxRecord) > h.Capacity/2 {
			t.Fatalf("accepted an invalid header %+v", h)
		}
	})
}

// FuzzConsumer fills a ring with arbitrary bytes and arbitrary positions and
// reads it: every record handed out lies inside the data area and within the
// published range; everything else is ErrCorrupt or ErrEmpty. Never a panic.
func FuzzConsumer(f *testing.F) {
	// A valid ring image with a few records as a seed.
	mem := shm.Aligned(HeaderSize + 4096)
	r, _ := Format(mem, 4096, 1024, 1, 0)
	p, _ := NewProducer(r, DefaultWait)
	for i := 0; i < 5; i++ {
		p.Append(uint16(i+1), 0, uint64(i), make([]byte, i*37))
	}
	p.Publish()
	tail, head := r.Positions()
	f.Add(append([]byte(nil), mem[HeaderSize:HeaderSize+512]...), tail, head)
	f.Add([]byte{16, 0, 0, 0, 0xff, 0xff}, uint64(4096), uint64(0))
	f.Add([]byte{}, uint64(8), uint64(16))
	f.Fuzz(func(t *testing.T, data []byte, tail, head uint64) {
		mem := shm.Aligned(HeaderSize + 4096)
		r, err := Format(mem, 4096, 1024, 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		copy(mem[HeaderSize:], data)
		// Positions as a hostile peer could leave them (head is set before
		// NewConsumer reads it; tail is the producer's word).
		head &^= 7
		binary.LittleEndian.PutUint64(mem[offHead:], head)
		binary.LittleEndian.PutUint64(mem[offTail:], tail)
		c, err := NewConsumer(r, DefaultWait)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("NewConsumer: %v", err)
			}
			return
		}
		for i := 0; i < 600; i++ {
			rec, err := c.Next()
			if err != nil {
				if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrEmpty) {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if rec.Type == 0 || rec.Type == TypePad || len(rec.Payload) > 1024 {
				t.Fatalf("bad record handed out: %+v", rec)
			}
			if c.head > c.tailCache {
				t.Fatalf("read past the published tail: head %d tail %d", c.head, c.tailCache)
			}
		}
	})
}
