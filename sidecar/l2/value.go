package l2

import (
	"encoding/binary"
	"encoding/hex"
	"hash/crc32"
	"strconv"

	"github.com/ringside-kv/ringside/internal/memcopy"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

// One value per (namespace, block digest, rank): a header, then the
// rank's shard of the block (its payload). Never two keys per block: a
// store that evicts one key of a pair would leave the other meaning
// nothing. The header says whose bytes these are, so that a value written
// under the wrong key, truncated, or changed in place is rejected, never
// served:
//
//	off size field
//	  0    4 magic "RSL2"
//	  4    2 version (1)
//	  6    2 header size (96)
//	  8    2 rank
//	 10    2 world size
//	 12    1 digest width (8, 16 or 32)
//	 13    3 zero
//	 16    8 payload length
//	 24    8 layout fingerprint
//	 32   16 namespace fingerprint (model, layout, tenant salt, width, world)
//	 48   32 digest (zero padded)
//	 80    4 CRC32C of the payload
//	 84    4 CRC32C of bytes 0-83
//	 88    8 zero
//
// Reserved bytes must be zero (a reader rejects the value otherwise).
//
// All integers are little-endian.
const (
	HeaderSize   = 96
	valueMagic   = 0x324c5352 // "RSL2"
	valueVersion = 1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Key is the tier's key of rank's value of block digest in ns: the prefix,
// then a hash tag of the namespace fingerprint and the digest (so that
// every rank of a block lives on one cluster node), then the rank. Tenants
// never share a key: the tenant salt is in the fingerprint.
func Key(prefix string, ns machine.L2Namespace, digest []byte, rank int) string {
	b := make([]byte, 0, len(prefix)+2+2*len(ns.FP)+2*len(digest)+4)
	b = append(b, prefix...)
	b = append(b, '{')
	b = hex.AppendEncode(b, ns.FP[:])
	b = hex.AppendEncode(b, digest)
	b = append(b, '}', ':')
	b = strconv.AppendInt(b, int64(rank), 10)
	return string(b)
}

// HashTag is the part of a key that picks its cluster slot.
func HashTag(ns machine.L2Namespace, digest []byte) string {
	return hex.EncodeToString(ns.FP[:]) + hex.EncodeToString(digest)
}

// AppendValue appends the value of rank's shard payload of block digest.
// The payload is copied and checksummed in one pass (in pieces that stay
// in the CPU's cache).
func AppendValue(dst []byte, ns machine.L2Namespace, digest []byte, rank int, payload []byte) []byte {
	start := len(dst)
	dst = append(dst, make([]byte, HeaderSize+len(payload))...)
	PutValue(dst[start:], ns, digest, rank, payload)
	return dst
}

// PutValue writes the value of rank's shard payload of block digest at the
// start of dst (at least HeaderSize+len(payload) bytes: a node tier's
// window slot) and returns its length. The payload is copied and
// checksummed in one pass.
func PutValue(dst []byte, ns machine.L2Namespace, digest []byte, rank int, payload []byte) int {
	crc := CopyCRC(dst[HeaderSize:], payload)
	h := dst[:HeaderSize]
	clear(h)
	binary.LittleEndian.PutUint32(h[0:], valueMagic)
	binary.LittleEndian.PutUint16(h[4:], valueVersion)
	binary.LittleEndian.PutUint16(h[6:], HeaderSize)
	binary.LittleEndian.PutUint16(h[8:], uint16(rank))
	binary.LittleEndian.PutUint16(h[10:], uint16(ns.World))
	h[12] = byte(len(digest))
	binary.LittleEndian.PutUint64(h[16:], uint64(len(payload)))
	binary.LittleEndian.PutUint64(h[24:], ns.Layout)
	copy(h[32:48], ns.FP[:])
	copy(h[48:80], digest)
	binary.LittleEndian.PutUint32(h[80:], crc)
	binary.LittleEndian.PutUint32(h[84:], crc32.Update(0, castagnoli, h[:84]))
	return HeaderSize + len(payload)
}

// CopyCRC copies src into dst (len(dst) >= len(src)) and returns the
// CRC32C of src, in one pass of 16 KiB pieces: each piece is checksummed
// from dst while it is still in the first-level cache.
func CopyCRC(dst, src []byte) uint32 {
	const piece = 16 << 10
	var crc uint32
	for off := 0; off < len(src); off += piece {
		e := min(off+piece, len(src))
		copy(dst[off:e], src[off:e])
		crc = crc32.Update(crc, castagnoli, dst[off:e])
	}
	return crc
}

// CopyOutCRC copies src into dst (len(dst) >= len(src)) and returns the
// CRC32C of src, in one pass of 16 KiB pieces: each piece is streamed into
// dst (memcopy.Stream: the destination's lines are not read into the cache
// first, as a plain copy's stores read them) and then checksummed from
// src, which the copy has just brought into the first-level cache. For a
// destination whose next reader does not need it in this CPU's cache (a
// pool slot, which a load copies out later: BenchmarkCopyThenLoad) and a
// src nobody writes meanwhile (the node tier's pinned slot, a Redis
// reply); where another process may write src, CopyCRC checksums this
// process's copy.
func CopyOutCRC(dst, src []byte) uint32 {
	const piece = 16 << 10
	var crc uint32
	for off := 0; off < len(src); off += piece {
		e := min(off+piece, len(src))
		memcopy.Stream(dst[off:e], src[off:e])
		crc = crc32.Update(crc, castagnoli, src[off:e])
	}
	return crc
}

// CheckHeader checks v's header against the block it should be (as
// CheckValue does) and returns the payload, unchecked, and the CRC32C its
// header promises: a caller that copies the payload with CopyCRC compares
// the two and must not use the copy when they differ.
func CheckHeader(v []byte, ns machine.L2Namespace, digest []byte, rank int, want, maxLen uint64) ([]byte, uint32, string) {
	if len(v) < HeaderSize {
		return nil, 0, RejectShort
	}
	n, crc, why := CheckHead(v[:HeaderSize], ns, digest, rank, want, maxLen)
	if why != "" {
		return nil, 0, why
	}
	if uint64(len(v)-HeaderSize) < n {
		return nil, 0, RejectShort
	}
	if uint64(len(v)-HeaderSize) > n {
		return nil, 0, RejectTrailing
	}
	return v[HeaderSize:], crc, ""
}

// CheckHead checks a value's header alone (HeaderSize bytes) against the
// block it should be and returns the payload's length and the CRC32C the
// header promises for it, or the reason it is rejected.
func CheckHead(h []byte, ns machine.L2Namespace, digest []byte, rank int, want, maxLen uint64) (uint64, uint32, string) {
	if len(h) != HeaderSize {
		return 0, 0, RejectShort
	}
	if binary.LittleEndian.Uint32(h[0:]) != valueMagic || binary.LittleEndian.Uint16(h[4:]) != valueVersion ||
		binary.LittleEndian.Uint16(h[6:]) != HeaderSize || binary.LittleEndian.Uint32(h[84:]) != crc32.Update(0, castagnoli, h[:84]) ||
		h[13]|h[14]|h[15] != 0 || binary.LittleEndian.Uint64(h[88:]) != 0 {
		return 0, 0, RejectHeader
	}
	var d [32]byte
	copy(d[:], digest)
	var fp [16]byte
	copy(fp[:], h[32:48])
	if binary.LittleEndian.Uint16(h[8:]) != uint16(rank) || binary.LittleEndian.Uint16(h[10:]) != uint16(ns.World) ||
		int(h[12]) != len(digest) || binary.LittleEndian.Uint64(h[24:]) != ns.Layout || fp != ns.FP || [32]byte(h[48:80]) != d {
		return 0, 0, RejectIdentity
	}
	n := binary.LittleEndian.Uint64(h[16:])
	if n == 0 || n > maxLen || (want != 0 && n != want) {
		return 0, 0, RejectLength
	}
	return n, binary.LittleEndian.Uint32(h[80:]), ""
}

// Reasons a value is rejected (the rejected-values metric's label).
const (
	RejectShort    = "short"
	RejectHeader   = "header"   // magic, version, size or the header's own checksum
	RejectIdentity = "identity" // namespace, layout, digest, rank or world size of another block
	RejectLength   = "length"   // not the namespace's block size, or larger than a slot
	RejectChecksum = "checksum" // the payload's CRC32C
	RejectTrailing = "trailing" // bytes after the payload
)

// CheckValue checks that v is rank's value of block digest in ns, with a
// payload of want bytes (0: any up to max), and returns its payload (a
// slice of v) or the reason it is rejected.
func CheckValue(v []byte, ns machine.L2Namespace, digest []byte, rank int, want, maxLen uint64) ([]byte, string) {
	p, crc, why := CheckHeader(v, ns, digest, rank, want, maxLen)
	if why != "" {
		return nil, why
	}
	if crc32.Update(0, castagnoli, p) != crc {
		return nil, RejectChecksum
	}
	return p, ""
}
