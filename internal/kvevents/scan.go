package kvevents

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds the nesting of a payload (a batch is 4 deep: batch,
// events, event, its lists).
const maxDepth = 32

// scan checks that p is exactly one msgpack value whose every length fits
// in the bytes that follow it, so that decoding it never allocates more
// than the payload can fill (a hostile array header claiming 2^32
// elements is refused here, not allocated).
func scan(p []byte) error {
	stack := make([]uint64, 0, 8) // values still to read at each open level
	pending := uint64(1)
	i := 0
	for pending > 0 || len(stack) > 0 {
		if pending == 0 {
			pending, stack = stack[len(stack)-1], stack[:len(stack)-1]
			continue
		}
		if i >= len(p) {
			return fmt.Errorf("%w: msgpack ends inside a value", ErrMalformed)
		}
		pending--
		c := p[i]
		i++
		var n uint64     // bytes of payload that follow
		var items uint64 // values of a container that follow
		container := false
		var lenBytes int
		switch {
		case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		case c >= 0x80 && c <= 0x8f:
			container, items = true, 2*uint64(c&0x0f)
		case c >= 0x90 && c <= 0x9f:
			container, items = true, uint64(c&0x0f)
		case c >= 0xa0 && c <= 0xbf:
			n = uint64(c & 0x1f)
		case c == 0xc4 || c == 0xd9:
			lenBytes = 1
		case c == 0xc5 || c == 0xda:
			lenBytes = 2
		case c == 0xc6 || c == 0xdb:
			lenBytes = 4
		case c == 0xc7:
			lenBytes, n = 1, 1
		case c == 0xc8:
			lenBytes, n = 2, 1
		case c == 0xc9:
			lenBytes, n = 4, 1
		case c == 0xca:
			n = 4
		case c == 0xcb:
			n = 8
		case c >= 0xcc && c <= 0xcf:
			n = 1 << (c - 0xcc)
		case c >= 0xd0 && c <= 0xd3:
			n = 1 << (c - 0xd0)
		case c >= 0xd4 && c <= 0xd8:
			n = 1 + 1<<(c-0xd4)
		case c == 0xdc || c == 0xde:
			container, lenBytes = true, 2
		case c == 0xdd || c == 0xdf:
			container, lenBytes = true, 4
		default: // 0xc1
			return fmt.Errorf("%w: msgpack code %#x", ErrMalformed, c)
		}
		if lenBytes > 0 {
			if len(p)-i < lenBytes {
				return fmt.Errorf("%w: msgpack ends inside a length", ErrMalformed)
			}
			var l uint64
			switch lenBytes {
			case 1:
				l = uint64(p[i])
			case 2:
				l = uint64(binary.BigEndian.Uint16(p[i:]))
			case 4:
				l = uint64(binary.BigEndian.Uint32(p[i:]))
			}
			i += lenBytes
			switch {
			case container && (c == 0xde || c == 0xdf):
				items = 2 * l
			case container:
				items = l
			default:
				n += l
			}
		}
		if container {
			if items > uint64(len(p)-i) { // every value takes a byte at least
				return fmt.Errorf("%w: a msgpack container of %d values in %d bytes", ErrMalformed, items, len(p)-i)
			}
			if len(stack) >= maxDepth {
				return fmt.Errorf("%w: msgpack nested deeper than %d", ErrMalformed, maxDepth)
			}
			stack = append(stack, pending)
			pending = items
			continue
		}
		if n > uint64(len(p)-i) {
			return fmt.Errorf("%w: a msgpack value of %d bytes in %d", ErrMalformed, n, len(p)-i)
		}
		i += int(n)
	}
	if i != len(p) {
		return fmt.Errorf("%w: %d bytes after the batch", ErrMalformed, len(p)-i)
	}
	return nil
}
