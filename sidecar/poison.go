package sidecar

// poisonByte fills freed pool slots in invariants builds: a load that read
// a slot after it was freed (or before a store wrote it) would deliver
// 0xCC bytes, which every byte-checking test notices.
const poisonByte = 0xCC

// poison fills b. On a sparse pool over a full mount a touch may fault:
// that slot then stays as it was (poisoning is a check, not a duty).
func poison(b []byte) {
	faultSafe(func() {
		for i := range b {
			b[i] = poisonByte
		}
	})
}
