"""Loads on the scheduler side: a lease on a request's hit blocks, from the
acquire to the LoadSpec the workers carry out.

The state machine (:class:`Load`, pure)::

    UNSENT ──acquire sent──▶ ACQUIRING ──reply: lease ready──▶ READY ──▶ spec sent (the workers load)
       │                        │  ▲                                        │
       │                        │  └─ reply: budget busy ─▶ WAITING ─┐      └─ finished_recving: released
       │                        │        (poll sent each step) ◀─────┘
       └────────────────────────┴──── no session, error, refusal, no answer in time ──▶ FAILED

A READY or FAILED load becomes a LoadSpec in the step's metadata: the
blocks the lease covers are loaded, the rest are reported as load errors
(vLLM recomputes them). A refused load is a miss, once: whatever the
sidecar refused or failed (its uid's share, the lease's blocks gone, no
answer in time, an error), and whatever the workers report failed, the
request never claims those blocks again (its ``claim_cap``: vLLM
reschedules it once, and it computes them), the local index stops offering
them until the change log reports them again (ringside.mirror), and the
refusal is counted by reason (``load_refused_*``: share, short, timeout,
error). A request that finishes while its acquire is
unanswered leaves an orphan whose lease is released once the reply comes;
and since vLLM keeps the blocks (and the request) of a request that finished
while waiting for its load until the workers report the load finished, such
a request still gets a LoadSpec, an empty one, that the workers report
finished at once. A request that finishes after its spec was sent keeps
its leases until finished_recving too: a release sent at once travels on
the scheduler's session and could reach the sidecar before the workers'
Load, and fail it.

:class:`Loads` does the I/O: it sends acquires and polls without waking the
sidecar, collects replies within the step's wait budget, and releases.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Callable, Optional

from .. import schema as _s
from ..client import Link, RingsideError, RingsideTimeout, Session
from ..plugin.faults import SIDECAR_ERRORS, Faults
from .admission import LOOKUP_REPLACE
from .hybrid import register
from .metadata import LoadSpec, RingsideConnectorMetadata
from .state import ReqState, StepBudget


class LoadState(enum.IntEnum):
    UNSENT = 0  # no acquire sent (no session, or it failed to send)
    ACQUIRING = 1  # acquire sent, reply not collected
    WAITING = 2  # the lease waits for the sidecar's load budget (a poll in flight)
    READY = 3  # the lease covers `blocks` blocks: send the load
    FAILED = 4  # no lease: every block is a load error


# The members as module globals, read by the per-load functions listed in
# ringside/hot_paths.py (and there only): an attribute of an IntEnum class
# (LoadState.READY, _s.Status.OK) costs CPython 3.11 some 0.1 us, a module
# global some 10 ns. The values are the same members.
_UNSENT, _ACQUIRING, _WAITING, _READY, _FAILED = (
    LoadState.UNSENT,
    LoadState.ACQUIRING,
    LoadState.WAITING,
    LoadState.READY,
    LoadState.FAILED,
)
_OK = _s.Status.OK
_LEASE_WAITING = _s.State.WAITING
_GRANTED = (_s.State.READY, _s.State.LOADED, _s.State.LOADING)


class Load:
    """One request's load (see the module doc). Pure: the methods take
    decoded replies and say what comes next."""

    __slots__ = ("block_ids", "state", "lease", "blocks", "seq", "gen", "t", "status")

    def __init__(self, block_ids: list[int], seq: int = 0, gen: int = -1, t: float = 0.0):
        self.block_ids = block_ids  # engine blocks the hit promised
        # ACQUIRING when made for an acquire already sent (as acquiring(seq, gen, t)).
        self.state = _ACQUIRING if seq else _UNSENT
        self.lease = 0
        self.blocks = 0  # blocks the lease covers
        self.seq = seq  # the acquire or poll in flight (0: none)
        self.gen = gen  # link generation the acquire was sent in
        self.t = t  # when that record was sent
        self.status = -1  # the status of the reply that failed it (-1: none came)

    def acquiring(self, seq: int, gen: int, now: float) -> None:
        self.state, self.seq, self.gen, self.t = _ACQUIRING, seq, gen, now

    def polling(self, seq: int, now: float) -> None:
        self.seq, self.t = seq, now

    def on_reply(self, lr: Optional[_s.LeaseReply]) -> None:
        """The acquire's or a poll's reply (None: none, or not decodable)."""
        self.seq = 0
        if lr is None or lr.status != _OK:
            self.state = _FAILED
            self.status = lr.status if lr is not None else -1
            return
        if self.state == _ACQUIRING:
            self.lease = lr.lease
        # Every reply says how many blocks the lease holds: a lease waiting
        # for the shared tier's fetch may end with fewer than its acquire's
        # reply promised (protocol.md section 16).
        self.blocks = lr.blocks
        if lr.state == _LEASE_WAITING:
            self.state = _WAITING
        elif lr.state in _GRANTED:
            self.state = _READY
        else:  # none of its blocks is there any more
            self.state = _FAILED
            self.status = _OK

    def fail(self) -> None:
        self.seq = 0
        self.state = _FAILED

    def spec(self, req_id: str) -> LoadSpec:
        """The LoadSpec of a READY or FAILED load."""
        ids = self.block_ids
        n = min(self.blocks, len(ids)) if self.state == _READY else 0
        return LoadSpec(req_id, self.lease if n else 0, ids[:n], ids[n:])


def whole_spec(rid: str, parts: tuple) -> LoadSpec:
    """The LoadSpec of a load of several KV cache groups' blocks (one lease
    a group): all of them, or, if any lease does not cover its blocks, none
    (every block a load error: the workers report the request's load
    failed and vLLM recomputes it; a hit must cover every group)."""
    if all(p.state == _READY and p.blocks >= len(p.block_ids) for p in parts):
        first = parts[0]
        more = [(p.lease, p.block_ids) for p in parts[1:]]
        return LoadSpec(rid, first.lease, first.block_ids, [], more, True)
    return LoadSpec(rid, 0, [], [b for p in parts for b in p.block_ids], [], True)


def _reason(parts: tuple) -> str:
    """Why a load's leases do not cover its blocks, as a counter's suffix:
    share (the uid's leases pin its share of the pool), short (the lease
    covers fewer blocks than the lookup found, or none: they left the pool,
    or the lease ended), timeout (no reply in time, or never sent), error
    (any other refusal)."""
    for p in parts:
        if p.state == LoadState.FAILED:
            st = p.status
            if st == _s.Status.TOO_LARGE:
                return "share"
            if st in (_s.Status.OK, _s.Status.EXPIRED, _s.Status.UNKNOWN_LEASE):
                return "short"
            return "timeout" if st < 0 else "error"
    return "short"  # granted, with fewer blocks than the lookup found


class Loads:
    """The scheduler side's loads: acquire, collect, release (module doc)."""

    def __init__(
        self, link: Link, faults: Faults, budget: StepBudget, timeout: float, ttl_ms: int, block_size: int = 1
    ):
        self.link = link
        self.block_size = block_size
        # The local index's Mirror.withhold (scheduler.py), or None.
        self.withhold: Optional[Callable[[list], None]] = None
        self.faults = faults
        self.budget = budget
        self.timeout = timeout
        self.ttl_ms = ttl_ms
        self.waiting: dict[str, ReqState] = {}  # requests whose load is not in a step's metadata yet
        self.orphans: list[tuple[int, float]] = []  # acquires of finished requests, unanswered
        self.abandoned: list[str] = []  # finished while waiting: an empty LoadSpec frees their blocks
        # Finished while the workers load: released at finished_recving (loaded()).
        self.recving: dict[str, ReqState] = {}

    def acquire(self, r: ReqState, rid: str, start: int, count: int, block_ids: list[int], put_hashes) -> None:
        """A hit was allocated: acquire a lease on blocks [start, start+count)
        of the request's batch (submitted now, collected when the step's
        metadata is built). put_hashes(r, s, upto, flags) registers what the
        local index looked up without the sidecar (FlagLookup: the sidecar's
        lookup and hit counters see the hit)."""
        link = self.link
        s = link.session
        seq = 0
        if s is not None and r.generation == link.generation:
            try:
                if r.registered < start + count:
                    put_hashes(r, s, start + count, LOOKUP_REPLACE)
                seq = s.submit(_s.TYPE_ACQUIRE, _s.encode_acquire(r.batch, start, count, self.ttl_ms), wake=False)
            except RingsideError as e:
                self.faults.fail(e)
        r.load = Load(block_ids, seq, link.generation, time.monotonic()) if seq else Load(block_ids)
        self.waiting[rid] = r

    def acquire_parts(self, r: ReqState, rid: str, parts: Optional[list], flags: int) -> None:
        """A hit of a model with several KV cache groups was allocated
        (hybrid.py): for each (batch, digests, block ids) of parts, register
        the digests as the batch (flags: FlagReplace, with FlagLookup when
        the local index looked them up) and acquire a lease on it. parts
        None: the hit cannot be loaded (every block is a load error)."""
        link = self.link
        s = link.session
        lds = []
        for batch, digests, ids in parts or ():
            ld = Load(ids)
            lds.append(ld)
            if s is not None and r.generation == link.generation:
                try:
                    register(s, batch, digests, flags)
                    seq = s.submit(_s.TYPE_ACQUIRE, _s.encode_acquire(batch, 0, len(ids), self.ttl_ms), wake=False)
                    ld.acquiring(seq, link.generation, time.monotonic())
                except RingsideError as e:
                    self.faults.fail(e)
                    s = link.session
        if not lds:
            ld = Load([])
            ld.fail()
            lds.append(ld)
        r.registered = r.registered or 1  # its batches are registered: recycled when it finishes
        r.load, r.more = lds[0], tuple(lds[1:])
        r.whole = True
        self.waiting[rid] = r

    def collect(self, meta: RingsideConnectorMetadata, s: Optional[Session]) -> None:
        """Put every waiting load whose leases are ready, or failed, into the
        step's metadata; poll those that wait for the load budget."""
        if self.abandoned:
            for rid in self.abandoned:
                meta.loads.append(LoadSpec(rid, 0, [], []))
            self.abandoned = []
        gen = self.link.generation
        waiting = self.waiting
        for rid in list(waiting):
            r = waiting[rid]
            ld = r.load
            if ld is None:
                del waiting[rid]
                continue
            settled, s = self._advance(ld, rid, s, gen)
            for part in r.more:
                done, s = self._advance(part, rid, s, gen)
                settled = settled and done
            if not settled:
                continue  # collected next step; the request keeps waiting for its load
            spec = whole_spec(rid, (ld,) + r.more) if r.whole else ld.spec(rid)
            if spec.error_block_ids:
                self.refused(r, len(spec.block_ids), _reason((ld,) + r.more))
            meta.loads.append(spec)
            del waiting[rid]

    def _advance(self, ld: Load, rid: str, s: Optional[Session], gen: int) -> tuple[bool, Optional[Session]]:
        """Collect a lease's acquire or poll reply, poll it again while it
        waits for the budget: (whether it is READY or FAILED, the session
        to go on with)."""
        if ld.state >= _READY:
            return True, s
        live = s is not None and ld.gen == gen
        try:
            if ld.seq:
                # The acquire's reply, or the poll's sent last step.
                p: Optional[bytes] = b""
                if s is not None and live:
                    p = self.budget.reply(s, ld.seq) if ld.state == _ACQUIRING else s.try_reply(ld.seq)
                    if p is None:
                        if time.monotonic() - ld.t < self.timeout:
                            if ld.state == _WAITING:
                                s.kick()
                            return False, s
                        s.forget(ld.seq)
                        p = b""
                        what = "acquire" if ld.state == _ACQUIRING else "poll"
                        self.faults.fail(RingsideTimeout("%s for %s got no reply in %.1fs" % (what, rid, self.timeout)))
                        s = self.link.session
                ld.on_reply(_s.decode_lease_reply(p) if p else None)
            elif ld.state != _WAITING:
                ld.fail()  # never sent
            if ld.state == _WAITING:
                if live and s is not None:
                    ld.polling(s.submit(_s.TYPE_POLL, _s.encode_poll(ld.lease), wake=False), time.monotonic())
                    return False, s
                ld.fail()
        except SIDECAR_ERRORS as e:
            self.faults.fail(e)
            s = None
            ld.fail()
        return True, s

    def refused(self, r: ReqState, loaded: int, reason: str) -> None:
        """The request's load covers only its first `loaded` blocks (the
        rest were refused, or failed): it never claims past them again, the
        local index stops offering the others, and the refusal is counted."""
        st = self.faults.stats
        st["load_refusals"] += 1
        st["load_refused_" + reason] += 1
        ld = r.load
        n = len(ld.block_ids) if ld is not None and not r.whole else 0
        cap = r.load_from + (loaded * self.block_size if not r.whole else 0)
        r.claim_cap = min(r.claim_cap, cap)
        if self.withhold is not None and n > loaded:
            first = r.load_from // self.block_size
            self.withhold(r.request.block_hashes[first + loaded : first + n])

    def failed_in_workers(self, r: ReqState, bad: Any, failed: Any, rid: str) -> None:
        """The workers reported the request's load finished with blocks that
        failed to load (bad: vLLM's invalid_block_ids; failed: requests whose
        whole load failed): a refusal like the sidecar's (refused)."""
        ld = r.load
        if ld is None or r.claim_cap <= r.load_from:
            return  # nothing of it was loaded (the sidecar's refusal, counted)
        if rid in failed:
            self.refused(r, 0, "error")
            return
        if bad and not r.whole:
            # The blocks the lease covered (the others are the refusal's, counted).
            covered = ld.block_ids[: (r.claim_cap - r.load_from) // self.block_size]
            for i, b in enumerate(covered):
                if b in bad:
                    self.refused(r, i, "error")
                    return

    def release_orphans(self, s: Optional[Session]) -> None:
        """Release the leases of acquires whose requests finished before the
        reply came (a lease left alone would pin its blocks until its TTL)."""
        keep = []
        for seq, t in self.orphans:
            if s is None:
                break  # the session is gone: the sidecar dropped its leases
            try:
                p = s.try_reply(seq)
                if p is None:
                    if time.monotonic() - t < self.timeout:
                        keep.append((seq, t))
                    else:
                        s.forget(seq)
                    continue
                lr = _s.decode_lease_reply(p)
                if lr.status == _OK and lr.lease:
                    s.send(_s.TYPE_RELEASE, _s.encode_release(lr.lease), wake=False)
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)
                break
        self.orphans = keep

    def loaded(self, r: ReqState, s: Optional[Session]) -> None:
        """The workers finished the request's load: release its leases."""
        ld, r.load = r.load, None
        parts, r.more = ((ld,) + r.more) if ld is not None else r.more, ()
        if s is None or r.generation != self.link.generation:
            return
        for part in parts:
            if part.lease:
                try:
                    s.send(_s.TYPE_RELEASE, _s.encode_release(part.lease), wake=False)
                except RingsideError as e:
                    self.faults.fail(e)
                    return

    def finished(self, rid: str, r: ReqState, s: Session, sent: bool) -> None:
        """The request finished (s: its live session) with a load pending:
        release what it holds, or will hold once the acquire is answered.
        A load sent to the workers (sent) keeps its leases until they report
        it in finished_recving (vLLM holds the request's blocks until then):
        a release sent now could reach the sidecar before the workers' Load,
        from another session, and fail it. Raises like a session call."""
        first = r.load
        assert first is not None  # called for a request with a load
        if sent:
            self.recving[rid] = r
            return
        for ld in (first,) + r.more:
            if ld.seq and ld.state == _ACQUIRING:  # acquired, never collected: release it once answered
                self.orphans.append((ld.seq, time.monotonic()))
            if ld.lease:
                s.send(_s.TYPE_RELEASE, _s.encode_release(ld.lease), wake=False)
