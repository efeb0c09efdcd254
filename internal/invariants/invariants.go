// Package invariants holds the switch for ringside's expensive internal
// checks and the helpers they use, in the style of pebble's
// internal/invariants.
//
// Enabled is a constant: true in builds with the invariants or the race
// build tag (make test, the reliability suite's sidecar binary), false
// otherwise, so that code guarded by
//
//	if invariants.Enabled { ... }
//
// compiles away in release builds. Guarded code checks what must always hold
// (the cache's accounting, lease and reference counts) and poisons memory a
// component has handed back (released ring records, freed slots), so that a
// use after release reads garbage and fails a test instead of silently
// reading stale data.
package invariants

// Poison is the byte Mangle fills released memory with: 0xCC is int3 on
// x86, an implausible length, type, count or id in every ringside record,
// and easy to spot in a hex dump.
const Poison byte = 0xCC

// Mangle fills b with Poison when invariants are enabled, and does nothing
// otherwise. Callers mangle memory they have released and will not read
// again; anyone still holding an alias of it sees the poison.
func Mangle(b []byte) {
	if !Enabled || len(b) == 0 {
		return
	}
	// Doubling copies: a few memmoves instead of a byte loop (which the
	// race detector would instrument byte by byte).
	b[0] = Poison
	for n := 1; n < len(b); n *= 2 {
		copy(b[n:], b[:n])
	}
}

// Mangled reports whether every byte of b is Poison (and b is not empty):
// tests use it to check that released memory was poisoned.
func Mangled(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if c != Poison {
			return false
		}
	}
	return true
}
