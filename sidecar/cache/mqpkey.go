package cache

// MQPHistoryKey is the 64-bit key under which PolicyMQP's tip table,
// distance sampler and hint table hash digest d of namespace ns (the
// first word of d, XORed with a mix of the other words and of ns). The
// replay (bench/replay) builds its digests with it, so that its offline
// model of MQP, which hashes page ids, hashes the very values the live
// sidecar does.
func MQPHistoryKey(ns NamespaceID, d []byte) uint64 { return tipKey(uint16(ns), d) }
