// Package machine is the sidecar's protocol state machine: everything the
// sidecar decides about a session's requests, and nothing it does.
//
// It owns the block pool's index (sidecar/cache) and the protocol state
// around it: sessions and the engine instances they form, hash batches and
// the views into them, queries (leases as the protocol sees them) with
// their states and the load budget's waiting FIFO, registered regions,
// copies in flight, and the quotas that keep one client from taking what
// the others need. It has no I/O, no clock, no goroutines and no locks of
// its own. Like etcd's raft, it takes inputs and returns what to do:
//
//	out := new(machine.Output)
//	m.Handle(now, session, typ, seq, payload, out) // a request record
//	m.CopyDone(now, copy, result, out)              // a copy ended
//	m.RegisterDone(now, session, region, h, err, out)
//	m.Tick(now, out)                                // deadlines
//	m.Detach(now, session, out)                     // a session ended
//
// and the caller then sends out.Replies, submits out.Copies, registers
// out.Registers with the copy engine and unregisters out.Unregister. The
// caller serialises calls (one mutex in the sidecar) and holds that mutex
// only for the call, never while it writes a reply to a ring, waits on a
// ring or copies: the machine's state is never held hostage by a client
// that stops reading.
//
// # Slot lifecycle
//
// A slot is reused only after every copy that touches it has ended. A
// Load's blocks are pinned by the copy itself (cache.BeginLoad) until
// CopyDone, whatever happens to the lease meanwhile (Release, expiry, the
// end of the acquiring session). A Store's slots are write tickets that
// only CopyDone ends; a block whose write deadline passes while its copy
// runs is doomed in the cache and its slots freed when that copy ends. A
// session's end releases its leases but not its copies: they complete,
// and their results are applied (a store committed or discarded) without
// anyone to reply to.
//
// # Geometry
//
// A namespace's first Store fixes its block size (the page size of the
// region it copies from) for as long as the namespace lives; a Load or
// Store through a region of another page size is refused with status 17.
// Copies therefore always move exactly one stored block: a load never
// returns bytes a store did not write (a slot's tail, a previous occupant).
//
// # Quotas
//
// Metadata memory (hash batches, queries, regions, copies in flight,
// sessions, instances, namespaces), pinned slots, slots held by incomplete
// blocks, ring memory and sessions are counted per session, per uid (from
// SO_PEERCRED, which a client cannot forge) and in total, and each request
// that would take any of them past its limit is refused with status 7
// (Acquire instead pins fewer blocks, or none). Namespaces are bounded in
// total; an idle namespace (no session) is reclaimed when a new one is
// needed and the bound is reached. Inventing instances, salts or models
// therefore gains a client nothing. Config documents each limit.
package machine
