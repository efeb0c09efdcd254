"""Admission: how many leading blocks of an arriving request the cache holds.

A request's lookup goes out as it arrives (``on_new_request``): either it is
answered by the local index (index.py) when vLLM asks, or its block hashes
(vLLM's digests, joined once) are registered as a hash batch and looked up in
the sidecar in the same record, without waiting; ``get_num_new_matched_tokens``
collects the answer within the step's wait budget, and an answer not there
yet makes vLLM ask again next step. A request that waits for KV blocks is
asked about every step: the first answer serves (counted once) until it is
allocated. A preempted request is looked up afresh when asked again.

Hash batches: one per request and link generation; a finished request's id
is kept registered and reused by the next request (FlagReplace), so
finishing a request sends no DropHashes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Optional

from .. import schema as _s
from ..client import Link, RingsideError, RingsideTimeout, Session
from ..mirror import Mirror
from ..plugin.faults import SIDECAR_ERRORS, Faults
from . import disagg
from .index import LocalIndex
from .state import ReqState, StepBudget

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.request import Request

# A PutHashes that registers a batch in place of what its id held and looks
# it up in the same record (the reply is the number of leading hits).
LOOKUP_REPLACE = _s.FLAG_LOOKUP | _s.FLAG_REPLACE
# Finished requests' batch ids kept for reuse (FlagReplace) at most; more are
# dropped.
MAX_FREE_BATCHES = 4096


class Admission:
    """Lookups of arriving requests, and the request table (module doc)."""

    def __init__(
        self,
        link: Link,
        faults: Faults,
        budget: StepBudget,
        index: Optional[LocalIndex],
        block_size: int,
        timeout: float,
        groups: int = 1,
        pd_wait: float = 0.0,
        pd_max: int = 0,
    ):
        self.link = link
        self.faults = faults
        self.stats = faults.stats
        self.budget = budget
        self.index = index
        self.block_size = block_size
        self.timeout = timeout
        self.reqs: dict[str, ReqState] = {}
        self._next_batch = 0
        self._free_batches: list[int] = []  # ids of finished requests' batches (see batch_id)
        self._free_gen = -1  # the link generation they belong to
        self.woke = False  # an arrival woke the sidecar in this step
        self.groups = groups  # KV cache groups: each uses a batch of its own (hybrid.py)
        self.pd_wait = pd_wait  # most a request waits for a prefill's blocks (disagg.py)
        self.pd_max = pd_max  # most requests that wait for them at once
        self.pd_waiting: set[str] = set()  # the requests waiting for them

    # A request may load at most min(len(block_hashes), (num_tokens - 1) //
    # block_size) blocks: at least one token is left to compute (vLLM needs
    # a forward pass). Inlined in the hooks below.

    def req(self, request: "Request") -> ReqState:
        """The request's state in the current link generation."""
        rid = request.request_id
        r = self.reqs.get(rid)
        gen = self.link.generation
        if r is None or r.generation != gen:
            old = r
            r = ReqState(request, self.batch_id(gen), gen)
            if old is not None:  # a new sidecar session: keep the cursors
                r.stored = old.stored
                r.gstored = old.gstored
                r.claim_cap = old.claim_cap
            self.reqs[rid] = r
        return r

    def batch_id(self, gen: int) -> int:
        """A batch id for a request: one a finished request left in this
        session (re-registered with FlagReplace), else a new one."""
        free = self._free_batches
        if free and self._free_gen == gen:
            self.stats["batches_reused"] += 1
            return free.pop()
        self._next_batch += 1
        return self._next_batch

    def recycle(self, r: ReqState, s: Session) -> None:
        """A finished request's batch: kept registered for the next request
        (up to MAX_FREE_BATCHES), else dropped."""
        free = self._free_batches
        if self._free_gen != r.generation:
            free.clear()
            self._free_gen = r.generation
        if len(free) < MAX_FREE_BATCHES:
            free.append(r.batch)
        else:
            n = self.groups
            for j in range(n):
                s.send(_s.TYPE_DROP_HASHES, _s.encode_drop_hashes(r.batch * n + j), wake=False)

    def put_hashes(self, r: ReqState, s: Session, upto: int, first_flags: int = _s.FLAG_REPLACE) -> None:
        """Register the request's hashes [registered, upto) in its batch,
        without waiting (the lookup or acquire that follows on this session is
        handled after it; a failed put shows up as a miss there)."""
        if upto <= r.registered:
            return
        hashes = r.request.block_hashes
        for a in range(r.registered, upto, _s.MAX_HASHES_PER_RECORD):
            new = b"".join(hashes[a : min(upto, a + _s.MAX_HASHES_PER_RECORD)])
            s.send(
                _s.TYPE_PUT_HASHES,
                _s.encode_put_hashes(r.batch, new, 32, _s.FLAG_APPEND if a else first_flags),
                wake=False,
            )
        r.registered = upto

    # -- vLLM hooks ------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        # Pipelined admission: the lookup goes out as the request arrives and
        # the sidecar answers while vLLM finishes adding requests and starts
        # the step; get_num_new_matched_tokens collects the answer.
        hashes = request.block_hashes
        usable = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        if usable <= 0 or usable > _s.MAX_HASHES_PER_RECORD:
            return  # nothing to load, or looked up when vLLM asks
        s = self.link.get()
        if s is None:
            return
        ix = self.index
        if ix is not None and ix.mirror.state == Mirror.LIVE:
            try:
                if ix.usable(s, bool(self.reqs)):
                    return  # looked up in the local index when vLLM asks
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)
                return
        try:
            r = self.req(request)
            if r.registered == 0:
                # One record: register the blocks it may load and look them
                # up (FlagLookup: the reply is the number of leading hits;
                # FlagReplace: the id may be a finished request's).
                # The record layout packed without schema.py's argument
                # checks: the values are built here.
                p = _s.PUT_HASHES.pack(r.batch, usable, LOOKUP_REPLACE) + b"".join(hashes[:usable])
                # The first arrival of a step wakes the sidecar (if parked),
                # so that it answers while vLLM goes on to schedule; later
                # ones in the same step do not (a futex wake is a system
                # call, 25-40 us on a VM): the sidecar, once up, handles
                # every record published meanwhile in the same pass, and a
                # wait for a reply wakes it if it parked again.
                wake = not self.woke
                r.lookup_seq = s.submit(_s.TYPE_PUT_HASHES, p, wake=wake)
                self.woke = True
                r.lookup_t = time.monotonic()
                r.registered = r.lookup_count = usable
        except SIDECAR_ERRORS as e:
            self.faults.fail(e)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        hashes = request.block_hashes
        usable = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        if usable <= 0:
            return 0, False
        s = self.link.get()
        if s is None:
            return 0, False
        again = False
        try:
            r = self.req(request)
            r.local = num_computed_tokens
            seq = r.lookup_seq
            if not seq and r.pd_want > 0:  # waiting for a prefill's blocks: polled (disagg.py)
                now = time.monotonic()
                if now < r.pd_poll_at:
                    return None, False
                self.put_hashes(r, s, usable)
                self.stats["pd_polls"] += 1
                seq = r.lookup_seq = s.submit(_s.TYPE_LOOKUP, _s.LOOKUP.pack(r.batch, 0, usable))
                r.lookup_t, r.lookup_count = now, usable
            value = -1
            if seq:
                payload = self.budget.reply(s, seq)
                if payload is None:
                    if time.monotonic() - r.lookup_t < self.timeout:
                        self.stats["deferred_lookups"] += 1
                        return None, False  # not answered yet: vLLM asks again next step
                    r.lookup_seq = 0
                    s.forget(seq)
                    raise RingsideTimeout("lookup of %s got no reply in %.1fs" % (request.request_id, self.timeout))
                r.lookup_seq = 0
                if len(payload) < 16:
                    raise _s.SchemaError("Reply: %d bytes, want at least 16" % len(payload))
                status, _, value = _s.REPLY.unpack_from(payload, 0)
                if status:
                    rep = _s.decode_reply(payload)
                    raise RingsideError(rep.status, rep.message)
            if value >= 0 and r.lookup_count == usable:
                hits = value
            elif value < 0 and not r.allocated and r.looked == usable:
                # Asked again while it waits for KV blocks (vLLM asks every
                # step): the answer of the last lookup (counted once). The
                # acquire checks it.
                hits = r.hits
                again = True
            else:  # not looked up ahead (busy engine, resumed, re-attached, or grown)
                ix = self.index
                hits = ix.answer(s, hashes, usable) if ix is not None else -1
                if hits < 0:
                    self.put_hashes(r, s, usable)
                    hits = s.lookup(r.batch, 0, usable)
        except SIDECAR_ERRORS as e:
            self.faults.fail(e)
            return 0, False
        if not again and r.pd_want:
            now = time.monotonic()
            if r.pd_want < 0:  # its first answer: does it wait for a prefill's blocks?
                params = getattr(request, "kv_transfer_params", None) if self.pd_wait > 0 else None
                want = disagg.expected(params, usable, request.request_id, self.stats) if params else 0
                if want > hits and len(self.pd_waiting) >= self.pd_max:
                    self.stats["pd_over_cap"] += 1
                    want = 0  # loads what is there now
                r.pd_want = want
                r.pd_until = now + self.pd_wait
                r.pd_every = disagg.POLL_S
            if hits < r.pd_want:
                if now < r.pd_until:
                    self.pd_waiting.add(request.request_id)
                    self.stats["pd_waits"] += 1
                    r.pd_poll_at = now + r.pd_every
                    r.pd_every = min(2 * r.pd_every, disagg.POLL_MAX_S)
                    return None, False  # vLLM asks again next step; looked up again
                self.stats["pd_timeouts"] += 1
            r.pd_want = 0
            self.pd_waiting.discard(request.request_id)
        if hits * self.block_size > r.claim_cap:
            # A load of these blocks failed for this request: never claimed again.
            hits = r.claim_cap // self.block_size
        r.looked, r.hits = usable, hits
        if not again:
            st = self.stats
            st["lookups"] += 1
            st["lookup_blocks"] += usable
            st["hit_blocks"] += hits
        ext = hits * self.block_size - num_computed_tokens
        if ext <= 0:
            return 0, False
        r.hit_tokens = hits * self.block_size
        return ext, True

    def preempted(self, rids: Iterable[str]) -> None:
        """Preempted requests lost their blocks: when vLLM asks about one
        again it is looked up afresh (its own blocks stored meanwhile are
        hits), and that answer serves while it waits for blocks."""
        reqs = self.reqs
        for rid in rids:
            r = reqs.get(rid)
            if r is not None:
                r.allocated, r.looked = False, 0
