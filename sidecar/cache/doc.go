// Package cache is the in-memory state machine of the sidecar's KV block
// pool: which pool slots hold which blocks, who is writing or reading
// them, what to evict, and the change log that routers consume.
//
// The pool bytes live elsewhere (a shared-memory file); slot i maps to
// byte offset i*blockBytes there, computed by the caller. This package is
// pure Go: no unsafe, no syscalls, no I/O, no clock and no randomness.
// Time is a caller-supplied monotonic nanosecond value (now int64).
//
// A Cache is NOT safe for concurrent use; the sidecar's protocol state
// machine (sidecar/machine) owns it, under the sidecar's one mutex.
//
// # Namespaces and keys
//
// A namespace is identified by NamespaceKey (model, layout fingerprint,
// tenant salt, digest width 8|16|32, TP world size W). AddNamespace is
// idempotent. The index key is (namespace, full digest): blocks with the
// same digest in two namespaces are distinct, and a digest only matches
// when all width bytes are equal (the hash mixes every 8-byte word).
//
// # Slot model for tensor parallelism
//
// Each rank's shard is stored in its own slot (slot size = per-rank shard
// size). A logical block of a namespace with world size W owns W slots,
// linked in a ring in rank order; the rank-0 slot is the head and carries
// the digest, the recency links and the pin count. The first BeginStore of
// a logical block (by any rank) reserves all W slots at once, so a TP
// group never ends up half-allocated (NoSpace is all-or-nothing). Each
// rank then writes its own slot (Reserved -> Writing -> Stored). The block
// is present only when all W ranks have committed; Lookup and Acquire look
// only at the head's committed count, so every rank gets the same answer.
// Eviction, Clear and expiry act on whole logical blocks.
//
// Slot states: Free -> Reserved -> Writing -> Stored. AbortStore returns
// a Writing slot to Reserved (the rank may retry); if no rank of the block
// has committed or is writing, the block is freed immediately. An
// incomplete block carries one deadline, WriteTimeout after its latest
// BeginStore; Reap then drops it. A block no rank is writing is freed at
// once. A block with writes in flight is *doomed*: it leaves the index (a
// new store of the digest starts afresh) and its deadline, but keeps its
// slots until the last of those writes ends, whose CommitStore then
// returns ErrDoomed and frees them. The caller issues a ticket only for a
// copy it is about to start, so a slot is never handed to another block
// while a copy may still write it. Tickets carry a never-reused writer ID,
// so a commit or abort of an ended write returns ErrStaleTicket.
// Incomplete and doomed blocks are invisible and not evictable.
//
// BeginStoreCharged charges the W slots a new incomplete block reserves to
// a caller-chosen key, refusing (OverQuota) a block that would take the
// key past its limit; the charge ends when the block becomes present or is
// dropped. The sidecar keys it by uid, so that no client can hold the pool
// in half-written blocks.
//
// # Memory layout (per slot, struct of arrays, preallocated by capacity)
//
//	digest  [32]byte  32  full digest (head only; zero padded)
//	prev    uint32     4  list prev (head) | head slot (member) | free: unused
//	next    uint32     4  list next (present head) | timer index (pending
//	                      head) | free-list link (free slot)
//	ring    uint32     4  next slot of the logical block, rank order
//	aux     uint32     4  pin count (present head) | writer record (Writing)
//	ns      uint16     2  namespace id
//	meta    uint8      1  rank<<2 | state
//	done    uint8      1  committed ranks (head); bit 7 marks a doomed block
//	                 ---
//	                  52  bytes per slot
//	index   uint32  4*3/2 open addressing, head slot+1 (0 = empty), load
//	                      factor <= 2/3 even when every slot is a block
//	tags    uint8   1*3/2 8-bit hash tag per index entry: a probe reads a
//	                      slot's digest only when its tag matches
//	                 ~59.6 bytes per slot in total (MemoryBytes/BytesPerBlock:
//	                      59.56 at 10M slots; bench delta's heap growth, the
//	                      delta log included, 60.00)
//
// PolicyMQP adds (mqp.go):
//
//	pol     uint8      1  count (bits 0-3) and level (bits 4-5) (head)
//	tip     uint16     2  tip table: capacity entries, fp12<<4 | count4
//	tipHand 2 bits  0.06  round-robin hand per 4-entry bucket
//	sfp/sep uint16  0.25  distance sampler: capacity/16 entries (fp, epoch)
//	hint    uint32 0.125  hints: capacity/32 entries (at least 4096),
//	                      fp28<<4 | count4, and their hands
//	prev/next       ~0    3 queue sentinels and 96 marker nodes, fixed
//	                 ---
//	                3.45 bytes per slot: 63.01 in total at 10M slots
//	                      (bench delta's heap growth 63.44), within the
//	                      64-byte budget
//
// PolicyMQP2 (mqp2.go) has MQP's arrays, with these sizes changed and one
// fixed table added:
//
//	sfp/sep uint16  0.25  distance sampler: max(1024, capacity/16) entries
//	hint    uint32  0.25  hints: max(4096, capacity/64) buckets of 4
//	                      (MQP: capacity/128), and their hands
//	learner          ~0   the tip offset's and the fresh lookups' records:
//	                      1,024 entries of fp16 and a tag byte, fixed
//	                      (3.3 KB)
//	                 ---
//	                3.57 bytes per slot: 63.13 in total at 10M slots
//	                      (bench delta's heap growth 63.57)
//
// The index uses linear probing with backward-shift deletion (no
// tombstones) and a multiply-shift range reduction, so its size need not
// be a power of two. Side tables scale with in-flight work, not with
// capacity: writer records (one per Writing slot), lease records (one per
// live lease plus its pinned heads), retention records (one per retained
// block), a deadline min-heap and an owner map. prev and next hold
// RetainPriorities+1 list sentinels past the slots (the LRU's at index
// capacity, then one per retention priority); under PolicyMQP the
// sentinels of queues 1-3 and the marker nodes follow.
//
// # Recency and eviction
//
// The LRU list holds only present, unpinned blocks, so its tail is always
// evictable (O(1) per eviction). Pinning (first lease) removes a block from
// the list; the last release puts it back as most recent. Lookup touches
// hits in reverse order so the first block of a prefix is the most recent
// and eviction takes prefix tails first. A counter of evictable slots lets
// BeginStore answer NoSpace without evicting anything in vain.
//
// # Eviction policy (Config.Policy)
//
// PolicyLRU (the zero Config.Policy) is the list above. PolicyMQP (and
// PolicyMQP2, below) keeps present,
// unpinned, unretained heads in four LRU queues by a per-block count
// (level 0: count 1, 1: 2-3, 2: 4-7, 3: 8+; queue 0 is the LRU list's
// sentinel) and evicts from the LRU end of queue 0, then 1, 2, 3; the
// retained lists follow as under LRU. The count comes from reuse and from
// history (mqp.go has the details):
//
//   - Lookup is the per-request step, because it is the call the engine
//     makes once per request with the request's full digest list (the
//     vLLM connector looks up each new request once; Acquire covers only
//     the hits and BeginStore one block; SGLang's HiCache asks only about
//     the pages past its own host cache, so there the request is that
//     suffix; a client that looks a request up twice counts its history
//     twice). Before touching the hits it
//     probes a tip table keyed by (namespace, digest) from the last digest
//     back: each digest inherits the largest count of a recorded tip at or
//     after it (inf), tips found count up, and the request's own last
//     digest becomes a tip. It also updates the namespace's scan guard and
//     the lifetime sampler, and leaves inf for the digests it missed in a
//     hint table, where their stores find it. A lookup that hits some but
//     not all of its digests extends a chain: its tip is marked (count 0
//     until found), and while more than half of the recent marked tips
//     were found again, its missed digests get inf at least 1 (outside
//     cold namespaces), so a session's new tail is stored at count 2, in
//     the queue of the chain it extends (two fixed counters; no bytes per
//     slot).
//   - Lookup touches hits in reverse: count = max(count+1, inf+1), to the
//     front of its level's queue. A store that finds its block present
//     (rank 0's) does the same with its hint. A commit places a new
//     block at count hint+1; when its namespace is cold (its lookups hit
//     under a tenth of the pool's ratio) a brand-new block goes to the LRU
//     end of queue 0 instead, except every 32nd.
//   - Each placement is a tick of a logical clock; every life/8 ticks a
//     marker stamped with the tick enters queues 1-3 (at most 32 per
//     queue); blocks behind a marker older than life/q move to queue q-1,
//     two per queue per tick; eviction drops markers it finds at a queue's
//     LRU end (O(1) amortized). life is the median reuse distance (ticks)
//     of 1/16 of the tips, those at least capacity/4, in a 64-bin
//     log histogram.
//   - A pin unlinks the block (count and level kept); the last unpin puts
//     it at the front of its level's queue. A hit on a pinned or retained
//     block counts; a retained one moves to the front of its retained
//     list. Expiry and EndRetain, and a PinBlock's end, put the block at
//     the LRU end of queue 0 (level 0), the policy's coldest position.
//   - TP: count and level live on the head; a victim is a head and all W
//     slots go. Incomplete and doomed blocks are in no queue.
//   - The guard state lives in the namespace record, so a removed
//     namespace's id starts afresh; tip entries are history and stay.
//
// The tables are lossy (4-way buckets, round-robin replacement): a lost
// tip or hint only means a lower count. The tests replay a synthetic
// agentic workload and the Mooncake trace through the cache's calls and
// get the research simulator's hits block for block.
//
// PolicyMQP2 is MQP with seven changes, each of which stops the policy
// depending on how many pages a prompt is cut into (mqp2.go has the
// details): the tip is the digest at a learned offset from a lookup's end
// (MQP's, the last digest, lay in the part of a prompt the next request
// does not send at 16- and 32-token pages); only anchor digests (one in
// (offset+1)/2 by their hash) are tips and are looked up in the tip table,
// the tip the nearest anchor at or before the offset, so a lookup checks
// the table about as often at any page size; the lifetime's histogram
// counts distances relative to the capacity; the distance sampler takes
// one tip in 4 into at least 1,024 entries; a fresh lookup (no hit, no tip
// found) leaves a cold mark for its blocks when fresh lookups rarely come
// back (a scan inside one namespace); a lookup repeating one of its
// namespace's last 16 is a probe and changes nothing; and every digest
// past the hits gets a hint, zero included, a store finding none taking
// its namespace's last one (a lost hint no longer cuts a long chain). The
// probe ring and the last hint live in the namespace record.
//
// Under PolicyMQP2 retention is evidence for the policy, not an order of
// its own: a retained block stays in the policy's queues, a block read
// once raised to count 2 (a retention counts as a second read; never
// above the prefixes many requests read), the retained lists stay empty;
// it ages as any other; expiry
// moves nothing; EndRetain sends the blocks whose retention it ended and
// that are read by at most 3 requests (a session's own tail) to the LRU
// end of queue 0. Records, owners, charges and deadlines are as below.
//
// # Retention
//
// Retain(ns, digests, charge, owner, ttl, prio, now) keeps the leading
// present blocks of digests for ttl at a priority 0..3: each leaves the
// LRU list for the list of its priority (same prev/next arrays, one
// sentinel per priority). Eviction takes the LRU's tail first and, only
// when the LRU is empty, the tail of the lowest-priority non-empty
// retained list: retained blocks stay evictable (counted in evictable), so
// retention never makes a store fail; it only orders eviction. A hit moves
// a retained block to the front of its own list; a pin takes it out of its
// list and the last unpin puts it back there. A block carries one
// retention, that of the key and owner that set it (owner: a caller's
// identity within the key, 0 for none; a side table from head slot to
// {owner, key, priority, timer index}; the deadline is in the timer heap):
// a Retain of another key, or of the same key with another owner, leaves
// it alone and is not charged, the same key and owner renew it (deadline
// now+ttl, new priority), and EndRetain ends only the retentions of its
// key and owner. A retention charges its key on a counter of its own
// (retainByKey, RetainedCharged: the slots of the blocks the key retains,
// whatever their owners), apart from the leases' pins (pinKey, pinByKey,
// PinnedCharged), so Retain stops at the key's retention limit (short) and
// never takes room from the key's leases. Expiry (Reap) and EndRetain end
// it and put the block at the LRU's tail; eviction and Clear drop it with
// the block. Cost: O(1) per block plus O(log n) for its deadline.
//
// # Leases
//
// Acquire(ns, rank, digests, owner, ttl, now) pins the leading present
// blocks and returns Lease{ID, Blocks, Slots} (Slots are the rank's
// slots). Lease IDs count up from 1 and are never reused; ID 0 means
// nothing was present and Release(0) is a no-op. Release of an unknown or
// already released ID returns ErrUnknownLease. Renew moves the expiry.
// ReleaseOwner(owner) releases all of a session's leases and aborts its
// writes (intrusive per-owner lists: cost proportional to what it held).
// Reap(now) pops a min-heap of deadlines (leases and incomplete blocks,
// with back-pointers for O(log n) removal), so its cost is proportional to
// what expired. Pinned blocks are never evicted nor cleared. Lookup and
// Acquire stop at the first repeated digest (a chain of block hashes never
// repeats one), so a lease pins distinct blocks and never more than the
// pool holds.
//
// BeginLoad(lease, rank, first, n) pins blocks of a lease for one copy out
// of the pool, with a pin of its own: releasing the lease, its expiry or
// its owner's end leave the blocks pinned until EndLoad, so a slot is
// never freed or reused while a copy reads it.
//
// # Delta log
//
// Each namespace has a ring of 48-byte entries {seq uint64, head slot
// uint32, op uint8, digest [32]byte}. It starts at Config.InitialLogSize
// entries and doubles, up to Config.DeltaLogSize (powers of two), when an
// append would overwrite its oldest entry and the logs of all namespaces
// together stay within Config.MaxLogBytes; past either bound it overwrites.
// Each namespace's sequence numbers start at incarnation<<40, where the
// incarnation counts AddNamespace calls, so a cursor into a removed
// namespace never validates against a later one (RemoveNamespace frees an
// empty namespace and lets a later AddNamespace reuse its id).
// The digest is copied into the entry, so a consumer gets the right digest
// even after the slot is reused. Ops: Stored (block became present),
// Evicted (evicted for space), Cleared (Clear dropped the namespace;
// survivors that were pinned follow as Stored). A Cursor is {Epoch, Seq};
// the epoch is Config.Epoch, which the sidecar draws per process, so a
// cursor from an earlier process never validates. ChangesSince returns
// ErrResync when the epoch differs, the seq is ahead of the log, or the
// ring has overwritten it (gap); the consumer then rebuilds from Snapshot,
// which returns the cursor to continue from. SnapshotPage reads the same
// in pages of bounded scan length, each with the log's head cursor at the
// time: all pages, followed by the log from the first page's cursor,
// rebuild the namespace exactly. ChangesSince costs O(changes);
// Snapshot and Clear cost O(capacity), a SnapshotPage O(slots scanned).
//
// # Sizing
//
// Lookup and the commit that makes a block present also feed a bounded
// hash sample of block keys (sizing.go), from which Sizing estimates what
// a pool of unbounded size would have hit and how many distinct blocks it
// would hold: at most SizingSamples keys, whatever the capacity.
//
// # Accounting
//
// Stats reports slot counts (Free+Used == Capacity, Used ==
// Reserved+Writing+Stored), blocks, pins, leases and counters.
// CheckInvariants verifies every structural invariant in O(capacity).
package cache
