package cache

import (
	"bytes"
	"encoding/binary"
	"math/bits"
)

// hashKey hashes (namespace, full digest). Every 8-byte word of the digest
// is mixed in, so digests that differ only in their last byte land on
// unrelated buckets even when the caller's digests are not uniformly
// distributed.
func hashKey(ns uint16, d []byte) uint64 {
	h := uint64(ns)*0x9E3779B97F4A7C15 ^ uint64(len(d))<<56
	for len(d) >= 8 {
		h ^= binary.LittleEndian.Uint64(d)
		h *= 0xbf58476d1ce4e5b9
		h ^= h >> 31
		d = d[8:]
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// home maps a hash onto [0, len(table)) without a modulo (Lemire's
// multiply-shift reduction), so the table size need not be a power of two.
func (c *Cache) home(h uint64) uint32 {
	hi, _ := bits.Mul64(h, uint64(len(c.table)))
	return uint32(hi)
}

// tagOf is the 8-bit hash tag kept beside each index entry: a probe only
// dereferences a slot's digest when the tags match (1 in 256 otherwise).
func tagOf(h uint64) uint8 { return uint8(h) }

// find returns the head slot of (ns, d) or NoSlot. The digest comparison
// covers all len(d) bytes (the namespace's full width).
func (c *Cache) find(ns uint16, d []byte) uint32 { return c.findH(ns, d, hashKey(ns, d)) }

func (c *Cache) findH(ns uint16, d []byte, h uint64) uint32 {
	n := uint32(len(c.table))
	i := c.home(h)
	tag := tagOf(h)
	for {
		e := c.table[i]
		if e == 0 {
			return NoSlot
		}
		s := e - 1
		if c.tags[i] == tag && bytes.Equal(c.digest[s][:len(d)], d) && c.nsOf[s] == ns {
			return s
		}
		if i++; i == n {
			i = 0
		}
	}
}

// indexInsert adds head s (its ns and digest already set). The caller has
// checked the key is absent.
func (c *Cache) indexInsert(s uint32, h uint64) {
	n := uint32(len(c.table))
	i := c.home(h)
	for c.table[i] != 0 {
		if i++; i == n {
			i = 0
		}
	}
	c.table[i] = s + 1
	c.tags[i] = tagOf(h)
	c.entries++
}

// indexRemove deletes head s with backward-shift deletion (no tombstones).
func (c *Cache) indexRemove(s uint32) {
	w := c.nsList[c.nsOf[s]-1].width
	n := uint32(len(c.table))
	i := c.home(hashKey(c.nsOf[s], c.digest[s][:w]))
	for c.table[i] != s+1 {
		if c.table[i] == 0 {
			panic("cache: indexRemove of absent slot")
		}
		if i++; i == n {
			i = 0
		}
	}
	c.entries--
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		e := c.table[j]
		if e == 0 {
			break
		}
		t := e - 1
		tw := c.nsList[c.nsOf[t]-1].width
		k := c.home(hashKey(c.nsOf[t], c.digest[t][:tw]))
		// Move e into the hole at i unless its home k lies cyclically in (i, j].
		var stay bool
		if i <= j {
			stay = i < k && k <= j
		} else {
			stay = i < k || k <= j
		}
		if stay {
			continue
		}
		c.table[i] = e
		c.tags[i] = c.tags[j]
		i = j
	}
	c.table[i] = 0
	c.tags[i] = 0
}
