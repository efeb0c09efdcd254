// Package ring is ringside's transport: a lock-free single-producer
// single-consumer ring of variable-length records in one shared-memory file.
//
// # File layout
//
// A ring file is one header page followed by a power-of-two data area:
//
//	0        4096                                   4096+capacity
//	+--------+---------------------------------------+
//	| header | data: records, 8-byte aligned, wrapping |
//	+--------+---------------------------------------+
//
// Header page (all integers little-endian, every word naturally aligned and
// inside one cache line; the positions each own a 128-byte block so that
// the hot path of the two sides never writes the same pair of cache lines;
// the parked flags and futex words share a block per direction, which only
// the slow path touches):
//
//	off  size  field
//	  0     8  magic "RSRING01" (0x3130474e49525352), written last at creation
//	  8     4  layout version (1)
//	 12     4  header size (4096)
//	 16     8  data capacity in bytes (power of two, 4 KiB .. 1 GiB)
//	 24     4  record alignment (8)
//	 28     4  maximum record size in bytes, header included (<= capacity/2)
//	 32     8  epoch: a random boot token chosen by the creator
//	 40     4  flags (bit 0: creator is the producer)
//	 44     4  reserved, zero
//	 48     4  producer pid (0 = unknown)
//	 52     4  reserved, zero
//	 56     8  producer start time (clock ticks since boot, /proc/PID/stat)
//	 64     4  consumer pid (0 = unknown)
//	 68     4  reserved, zero
//	 72     8  consumer start time
//	128     8  tail: producer position (bytes ever written), written by the producer
//	256     8  head: consumer position (bytes ever consumed), written by the consumer
//	384     4  consumer parked flag (1 while the consumer may sleep on the data futex)
//	388     4  data futex sequence (bumped by the producer before a wake)
//	512     4  producer parked flag (1 while the producer waits for space)
//	516     4  space futex sequence (bumped by the consumer before a wake)
//	640     4  producer state (0 open, 1 closed)
//	768     4  consumer state (0 open, 1 closed)
//
// Positions only grow; the offset of a position in the data area is
// position & (capacity-1). The producer owns tail, the consumer owns head.
//
// # Records
//
//	0      4      6      8             16
//	+------+------+------+-------------+------------------------+
//	| len  | type | flags| seq         | payload (len bytes),   |
//	| u32  | u16  | u16  | u64         | zero-padded to 8 bytes |
//	+------+------+------+-------------+------------------------+
//
// A record occupies 16 + align8(len) bytes and never wraps: when it does not
// fit before the end of the data area the producer first writes a pad record
// (type 0xFFFF) covering the rest of the area, or, when fewer than 16 bytes
// remain, leaves them: both sides skip a tail gap shorter than a record
// header. Type 0 is invalid. The producer writes payload and header first and
// publishes them with one store of tail (several records may share one
// store), so a reader never sees a partial record.
package ring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
)

// Layout constants. These are frozen for layout version 1: changing any of
// them changes the wire format and needs a new Version.
const (
	Magic            uint64 = 0x3130474e49525352 // "RSRING01" little-endian
	Version          uint32 = 1
	HeaderSize              = 4096
	Align                   = 8
	RecordHeaderSize        = 16

	MinCapacity = 4 << 10
	MaxCapacity = 1 << 30

	// TypePad marks padding at the end of the data area.
	TypePad uint16 = 0xFFFF

	FlagCreatorProducer uint32 = 1 << 0
)

// Header field offsets.
const (
	offMagic         = 0
	offVersion       = 8
	offHeaderSize    = 12
	offCapacity      = 16
	offAlign         = 24
	offMaxRecord     = 28
	offEpoch         = 32
	offFlags         = 40
	offProducerPID   = 48
	offProducerStart = 56
	offConsumerPID   = 64
	offConsumerStart = 72
	offTail          = 128
	offHead          = 256
	offConsParked    = 384
	offConsFutex     = 388
	offProdParked    = 512
	offProdFutex     = 516
	offProdState     = 640
	offConsState     = 768
)

// Header is the static part of a ring header: offsets 0 to 80 of the
// header page (the package doc's table), reserved words included.
//
//wire:struct Header "<QIIQIIQIIIIQIIQ" magic version header_size capacity align max_record epoch flags _ producer_pid _ producer_start consumer_pid _ consumer_start
type Header struct {
	Magic         uint64
	Version       uint32
	HeaderSize    uint32
	Capacity      uint64
	Align         uint32
	MaxRecord     uint32
	Epoch         uint64
	Flags         uint32
	ProducerPID   uint32
	ProducerStart uint64
	ConsumerPID   uint32
	ConsumerStart uint64
}

// Errors. Structural damage is reported as ErrCorrupt, wrapped with the
// detail; a ring that returned ErrCorrupt is unusable and must be replaced.
var (
	ErrBadHeader  = errors.New("ring: bad header")
	ErrCorrupt    = errors.New("ring: corrupt")
	ErrTooLarge   = errors.New("ring: record too large")
	ErrFull       = errors.New("ring: full")
	ErrEmpty      = errors.New("ring: empty")
	ErrPeerDead   = errors.New("ring: peer is gone")
	ErrPeerClosed = errors.New("ring: peer closed the ring")
	ErrClosed     = errors.New("ring: closed")
	ErrBadType    = errors.New("ring: invalid record type")
)

// RecordSize is the number of ring bytes a record with an n-byte payload
// occupies.
func RecordSize(n int) int { return RecordHeaderSize + alignUp(n) }

func alignUp(n int) int { return (n + Align - 1) &^ (Align - 1) }

// DefaultMaxRecord is the largest record allowed in a ring of the given
// capacity when the creator does not choose one.
func DefaultMaxRecord(capacity uint64) uint32 {
	m := capacity / 4
	if m > 1<<24 {
		m = 1 << 24
	}
	return uint32(m)
}

// EncodeHeader writes h into the first HeaderSize bytes of b, magic included.
// Creators use it for golden vectors and tests; a live ring writes the magic
// last (see Create).
func EncodeHeader(b []byte, h *Header) {
	_ = b[HeaderSize-1]
	le := binary.LittleEndian
	le.PutUint64(b[offMagic:], h.Magic)
	le.PutUint32(b[offVersion:], h.Version)
	le.PutUint32(b[offHeaderSize:], h.HeaderSize)
	le.PutUint64(b[offCapacity:], h.Capacity)
	le.PutUint32(b[offAlign:], h.Align)
	le.PutUint32(b[offMaxRecord:], h.MaxRecord)
	le.PutUint64(b[offEpoch:], h.Epoch)
	le.PutUint32(b[offFlags:], h.Flags)
	le.PutUint32(b[offProducerPID:], h.ProducerPID)
	le.PutUint64(b[offProducerStart:], h.ProducerStart)
	le.PutUint32(b[offConsumerPID:], h.ConsumerPID)
	le.PutUint64(b[offConsumerStart:], h.ConsumerStart)
}

// DecodeHeader reads and validates the static header fields from b. fileSize
// is the size of the whole ring file (header page plus data area); it must
// match the capacity the header claims. Any mismatch is an error wrapping
// ErrBadHeader; DecodeHeader never panics, whatever b holds.
func DecodeHeader(b []byte, fileSize int64) (Header, error) {
	var h Header
	if len(b) < HeaderSize {
		return h, fmt.Errorf("%w: %d bytes, want at least %d", ErrBadHeader, len(b), HeaderSize)
	}
	le := binary.LittleEndian
	h = Header{
		Magic:         le.Uint64(b[offMagic:]),
		Version:       le.Uint32(b[offVersion:]),
		HeaderSize:    le.Uint32(b[offHeaderSize:]),
		Capacity:      le.Uint64(b[offCapacity:]),
		Align:         le.Uint32(b[offAlign:]),
		MaxRecord:     le.Uint32(b[offMaxRecord:]),
		Epoch:         le.Uint64(b[offEpoch:]),
		Flags:         le.Uint32(b[offFlags:]),
		ProducerPID:   le.Uint32(b[offProducerPID:]),
		ProducerStart: le.Uint64(b[offProducerStart:]),
		ConsumerPID:   le.Uint32(b[offConsumerPID:]),
		ConsumerStart: le.Uint64(b[offConsumerStart:]),
	}
	return h, h.Validate(fileSize)
}

// Validate checks the static fields of a header against the file size.
func (h *Header) Validate(fileSize int64) error {
	switch {
	case h.Magic != Magic:
		return fmt.Errorf("%w: magic %#x, want %#x (not a ring, or not initialised yet)", ErrBadHeader, h.Magic, Magic)
	case h.Version != Version:
		return fmt.Errorf("%w: layout version %d, this build speaks %d", ErrBadHeader, h.Version, Version)
	case h.HeaderSize != HeaderSize:
		return fmt.Errorf("%w: header size %d, want %d", ErrBadHeader, h.HeaderSize, HeaderSize)
	case h.Align != Align:
		return fmt.Errorf("%w: record alignment %d, want %d", ErrBadHeader, h.Align, Align)
	case h.Capacity < MinCapacity || h.Capacity > MaxCapacity || bits.OnesCount64(h.Capacity) != 1:
		return fmt.Errorf("%w: capacity %d is not a power of two in [%d, %d]", ErrBadHeader, h.Capacity, MinCapacity, MaxCapacity)
	case h.MaxRecord < 2*RecordHeaderSize || uint64(h.MaxRecord) > h.Capacity/2 || h.MaxRecord%Align != 0:
		return fmt.Errorf("%w: max record %d outside [%d, capacity/2=%d] or unaligned", ErrBadHeader, h.MaxRecord, 2*RecordHeaderSize, h.Capacity/2)
	case fileSize >= 0 && uint64(fileSize) != HeaderSize+h.Capacity:
		return fmt.Errorf("%w: file is %d bytes, header says %d", ErrBadHeader, fileSize, HeaderSize+h.Capacity)
	}
	return nil
}

// RecordHeader is the 16-byte frame in front of every record: u32 len,
// u16 type, u16 flags, u64 seq (the package doc's diagram).
//
//wire:struct RecordHeader "<IHHQ" len type flags seq size=RecordHeaderSize
type RecordHeader struct {
	Len   uint32
	Type  uint16
	Flags uint16
	Seq   uint64
}

// PutRecordHeader encodes rh into b[:16].
func PutRecordHeader(b []byte, rh RecordHeader) {
	_ = b[RecordHeaderSize-1]
	binary.LittleEndian.PutUint32(b[0:], rh.Len)
	binary.LittleEndian.PutUint16(b[4:], rh.Type)
	binary.LittleEndian.PutUint16(b[6:], rh.Flags)
	binary.LittleEndian.PutUint64(b[8:], rh.Seq)
}

// DecodeRecordHeader decodes the frame at the start of b and checks it
// against the space the reader knows to be published (avail bytes from the
// start of b, which the caller has bounded by both the published tail and
// the end of the data area) and the ring's maximum record size. It never
// panics.
func DecodeRecordHeader(b []byte, avail int, maxRecord uint32) (RecordHeader, error) {
	var rh RecordHeader
	if len(b) < RecordHeaderSize || avail < RecordHeaderSize {
		return rh, fmt.Errorf("%w: %d bytes published, less than a record header", ErrCorrupt, min(len(b), avail))
	}
	rh = RecordHeader{
		Len:   binary.LittleEndian.Uint32(b[0:]),
		Type:  binary.LittleEndian.Uint16(b[4:]),
		Flags: binary.LittleEndian.Uint16(b[6:]),
		Seq:   binary.LittleEndian.Uint64(b[8:]),
	}
	if rh.Type == 0 {
		return rh, fmt.Errorf("%w: record type 0", ErrCorrupt)
	}
	total := uint64(RecordHeaderSize) + (uint64(rh.Len)+Align-1)&^(Align-1)
	if rh.Type != TypePad && total > uint64(maxRecord) {
		return rh, fmt.Errorf("%w: record of %d bytes exceeds the maximum %d", ErrCorrupt, total, maxRecord)
	}
	if total > uint64(avail) || total > uint64(len(b)) {
		return rh, fmt.Errorf("%w: record of %d bytes runs past the %d published bytes", ErrCorrupt, total, min(avail, len(b)))
	}
	return rh, nil
}
