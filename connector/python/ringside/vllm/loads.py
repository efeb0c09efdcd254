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
(vLLM recomputes them). A request that finishes while its acquire is
unanswered leaves an orphan whose lease is released once the reply comes;
and since vLLM keeps the blocks (and the request) of a request that finished
while waiting for its load until the workers report the load finished, such
a request still gets a LoadSpec, an empty one, that the workers report
finished at once.

:class:`Loads` does the I/O: it sends acquires and polls without waking the
sidecar, collects replies within the step's wait budget, and releases.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional

from .. import schema as _s
from ..client import RingsideError, RingsideTimeout
from ..plugin.faults import SIDECAR_ERRORS
from .metadata import LoadSpec, RingsideConnectorMetadata
from .state import ReqState, StepBudget

_monotonic = time.monotonic
_GRANTED = (_s.State.READY, _s.State.LOADED, _s.State.LOADING)


class LoadState(enum.IntEnum):
    UNSENT = 0  # no acquire sent (no session, or it failed to send)
    ACQUIRING = 1  # acquire sent, reply not collected
    WAITING = 2  # the lease waits for the sidecar's load budget (a poll in flight)
    READY = 3  # the lease covers `blocks` blocks: send the load
    FAILED = 4  # no lease: every block is a load error


class Load:
    """One request's load (see the module doc). Pure: the methods take
    decoded replies and say what comes next."""

    __slots__ = ("block_ids", "state", "lease", "blocks", "seq", "gen", "t")

    def __init__(self, block_ids: list[int]):
        self.block_ids = block_ids  # engine blocks the hit promised
        self.state = LoadState.UNSENT
        self.lease = 0
        self.blocks = 0  # blocks the lease covers
        self.seq = 0  # the acquire or poll in flight (0: none)
        self.gen = -1  # link generation the acquire was sent in
        self.t = 0.0  # when that record was sent

    def acquiring(self, seq: int, gen: int, now: float) -> None:
        self.state, self.seq, self.gen, self.t = LoadState.ACQUIRING, seq, gen, now

    def polling(self, seq: int, now: float) -> None:
        self.seq, self.t = seq, now

    def on_reply(self, lr: Optional[_s.LeaseReply]) -> None:
        """The acquire's or a poll's reply (None: none, or not decodable)."""
        self.seq = 0
        if lr is None or lr.status != _s.Status.OK:
            self.state = LoadState.FAILED
            return
        if self.state == LoadState.ACQUIRING:
            self.lease, self.blocks = lr.lease, lr.blocks
        if lr.state == _s.State.WAITING:
            self.state = LoadState.WAITING
        elif lr.state in _GRANTED:
            self.state = LoadState.READY
        else:
            self.state = LoadState.FAILED

    def fail(self) -> None:
        self.seq = 0
        self.state = LoadState.FAILED

    def spec(self, req_id: str) -> LoadSpec:
        """The LoadSpec of a READY or FAILED load."""
        ids = self.block_ids
        n = min(self.blocks, len(ids)) if self.state == LoadState.READY else 0
        return LoadSpec(req_id, self.lease if n else 0, ids[:n], ids[n:])


class Loads:
    """The scheduler side's loads: acquire, collect, release (module doc)."""

    def __init__(self, link: Any, faults: Any, budget: StepBudget, timeout: float, ttl_ms: int):
        self.link = link
        self.faults = faults
        self.budget = budget
        self.timeout = timeout
        self.ttl_ms = ttl_ms
        self.waiting: dict[str, ReqState] = {}  # requests whose load is not in a step's metadata yet
        self.orphans: list[tuple[int, float]] = []  # acquires of finished requests, unanswered
        self.abandoned: list[str] = []  # finished while waiting: an empty LoadSpec frees their blocks

    def acquire(self, r: ReqState, rid: str, start: int, count: int, block_ids: list[int], put_hashes) -> None:
        """A hit was allocated: acquire a lease on blocks [start, start+count)
        of the request's batch (submitted now, collected when the step's
        metadata is built). put_hashes(r, s, upto) registers what the local
        index looked up without the sidecar."""
        ld = r.load = Load(block_ids)
        link = self.link
        s = link.session
        if s is not None and r.generation == link.generation:
            try:
                if r.registered < start + count:
                    put_hashes(r, s, start + count)
                seq = s.submit(_s.TYPE_ACQUIRE, _s.encode_acquire(r.batch, start, count, self.ttl_ms), wake=False)
                ld.acquiring(seq, link.generation, _monotonic())
            except RingsideError as e:
                self.faults.fail(e)
        self.waiting[rid] = r

    def collect(self, meta: RingsideConnectorMetadata, s: Optional[Any]) -> None:
        """Put every waiting load whose lease is ready, or failed, into the
        step's metadata; poll those that wait for the load budget."""
        if self.abandoned:
            for rid in self.abandoned:
                meta.loads.append(LoadSpec(rid, 0, [], []))
            self.abandoned = []
        gen = self.link.generation
        waiting = self.waiting
        for rid in list(waiting):
            ld = waiting[rid].load
            if ld is None:
                del waiting[rid]
                continue
            live = s is not None and ld.gen == gen
            try:
                if ld.seq:
                    # The acquire's reply, or the poll's sent last step.
                    if not live:
                        p = b""
                    elif ld.state == LoadState.ACQUIRING:
                        p = self.budget.reply(s, ld.seq)
                    else:
                        p = s.try_reply(ld.seq)
                    if p is None:
                        if _monotonic() - ld.t < self.timeout:
                            if ld.state == LoadState.WAITING:
                                s.kick()
                            continue  # collected next step; the request keeps waiting for its load
                        s.forget(ld.seq)
                        p = b""
                        what = "acquire" if ld.state == LoadState.ACQUIRING else "poll"
                        self.faults.fail(RingsideTimeout("%s for %s got no reply in %.1fs" % (what, rid, self.timeout)))
                        s = self.link.session
                    ld.on_reply(_s.decode_lease_reply(p) if p else None)
                elif ld.state != LoadState.WAITING:
                    ld.fail()  # never sent
                if ld.state == LoadState.WAITING:
                    if live and s is not None:
                        ld.polling(s.submit(_s.TYPE_POLL, _s.encode_poll(ld.lease), wake=False), _monotonic())
                        continue
                    ld.fail()
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)
                s = None
                ld.fail()
            meta.loads.append(ld.spec(rid))
            del waiting[rid]

    def release_orphans(self, s: Optional[Any]) -> None:
        """Release the leases of acquires whose requests finished before the
        reply came (a lease left alone would pin its blocks until its TTL)."""
        keep = []
        for seq, t in self.orphans:
            if s is None:
                break  # the session is gone: the sidecar dropped its leases
            try:
                p = s.try_reply(seq)
                if p is None:
                    if _monotonic() - t < self.timeout:
                        keep.append((seq, t))
                    else:
                        s.forget(seq)
                    continue
                lr = _s.decode_lease_reply(p)
                if lr.status == _s.Status.OK and lr.lease:
                    s.send(_s.TYPE_RELEASE, _s.encode_release(lr.lease), wake=False)
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)
                break
        self.orphans = keep

    def loaded(self, r: ReqState, s: Optional[Any]) -> None:
        """The workers finished the request's load: release its lease."""
        ld, r.load = r.load, None
        if ld is not None and ld.lease and s is not None and r.generation == self.link.generation:
            try:
                s.send(_s.TYPE_RELEASE, _s.encode_release(ld.lease), wake=False)
            except RingsideError as e:
                self.faults.fail(e)

    def finished(self, rid: str, r: ReqState, s: Any) -> None:
        """The request finished (s: its live session) with a load pending:
        release what it holds, or will hold once the acquire is answered.
        Raises like a session call."""
        ld = r.load
        if ld.seq and ld.state == LoadState.ACQUIRING:  # acquired, never collected: release it once answered
            self.orphans.append((ld.seq, _monotonic()))
        if ld.lease:
            s.send(_s.TYPE_RELEASE, _s.encode_release(ld.lease), wake=False)
