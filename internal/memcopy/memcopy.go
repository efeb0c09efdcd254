// Package memcopy copies into memory that the copying process will not read
// again: a block landing in another process's pool. On amd64 with AVX it
// writes with non-temporal stores, which skip reading each destination
// line into the cache before overwriting it (a plain copy's stores do, and
// so move the destination's bytes twice); elsewhere it is copy().
//
// The assembly is fenced here: Stream's callers pass slices, and Stream
// checks bounds and alignment before the stores.
package memcopy

// minStream is the shortest copy worth streaming: below it the fence and
// the uncached stores cost more than the lines they save.
const minStream = 4096

// Stream copies src into dst as copy() does (min(len(dst), len(src))
// bytes, returned), with non-temporal stores where the CPU has them: the
// copied bytes are in memory, not in this CPU's caches, when it returns
// (a store fence orders them before any later store, such as the reply
// that tells another process they are there). dst and src must not
// overlap.
func Stream(dst, src []byte) int {
	n := min(len(dst), len(src))
	if !useStream || n < minStream {
		return copy(dst, src)
	}
	// Head: up to the first 32-byte boundary of dst, which the
	// non-temporal stores need; body: whole 128-byte steps; tail: the rest.
	head := int(-uintptrOf(dst) & 31)
	body := (n - head) &^ 127
	copy(dst[:head], src[:head])
	stream(dst[head:head+body], src[head:head+body])
	copy(dst[head+body:n], src[head+body:n])
	return n
}
