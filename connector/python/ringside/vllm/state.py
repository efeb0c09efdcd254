"""Scheduler-side state shared by its parts: one request's record, and the
step's budget for waiting on the sidecar."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ..client import Session
    from .loads import Load


# claim_cap of a request whose loads never failed.
NO_CAP = 1 << 62


class ReqState:
    """Scheduler-side state of one request in one link generation."""

    __slots__ = (
        "request",
        "batch",
        "generation",
        "registered",
        "stored",
        "lookup_seq",
        "lookup_count",
        "load",
        "hit_tokens",
        "due",
        "looked",
        "hits",
        "allocated",
        "lookup_t",
        "store_step",
        "gstored",
        "gwin",
        "gseq",
        "more",
        "whole",
        "pd_want",
        "pd_until",
        "pd_poll_at",
        "local",
        "ext_from",
        "ext_step",
        "load_from",
        "claim_cap",
        "pd_every",
    )

    def __init__(self, request: Any, batch: int, generation: int):
        self.request = request  # vLLM's Request (block_hashes, num_tokens, num_computed_tokens)
        self.batch = batch  # hash batch for lookups and acquires (this link generation)
        self.generation = generation  # link generation the batch was registered in
        self.registered = 0  # hashes registered in the batch
        self.stored = 0  # cursor: blocks [0, stored) were sent for storing (or loaded)
        self.lookup_seq = 0  # a lookup submitted ahead (on_new_request), not yet collected
        self.lookup_count = 0  # blocks that lookup asked about
        self.load: Optional[Load] = None  # its pending load
        self.hit_tokens = 0
        self.due = 0  # scheduler step of its next store check (0: none planned)
        self.looked = 0  # blocks the last collected lookup asked about
        self.hits = 0  # and its answer
        self.allocated = False  # vLLM allocated blocks for it (update_state_after_alloc)
        self.lookup_t = 0.0  # when the lookup was sent (time.monotonic)
        self.store_step = 0  # the last step that planned a store of its blocks
        # Several KV cache groups (hybrid.py; unused with one group):
        self.gstored: Optional[list[int]] = None  # a `stored` cursor per group
        # Per group, what its batch holds: [lo, hi, leading hits] (-1: not answered), or None.
        self.gwin: Optional[list[Optional[list[int]]]] = None
        self.gseq: Sequence[tuple[int, int]] = ()  # lookups submitted ahead: (group, seq)
        self.more: tuple[Load, ...] = ()  # the loads of the other groups' blocks, with `load`
        self.whole = False  # its load covers several groups: all of them or none
        # Prefill to decode (disagg.py): leading blocks it waits for (-1: not
        # read yet, 0: none), and until when (time.monotonic).
        self.pd_want = -1
        self.pd_until = 0.0
        self.pd_poll_at = 0.0  # its next poll
        self.pd_every = 0.0  # the time from this poll to the next (doubles up to disagg.POLL_MAX_S)
        # Tokens vLLM had computed when it last asked for the request's hit
        # (its own prefix cache), -1 once the planner has used it; blocks
        # another connector loaded past them wait for vLLM's verdict on the
        # load: not stored from ext_from on before step ext_step (store_plan.py).
        self.local = -1
        self.ext_from = 0
        self.ext_step = 0
        # Its load: the tokens before its first loaded block; and the most
        # tokens it may claim from the sidecar, cut at the first block of a
        # load the sidecar refused or failed (a refused load is a miss once:
        # loads.py, Loads.refused).
        self.load_from = 0
        self.claim_cap = NO_CAP


class StepBudget:
    """The most the scheduler waits for sidecar replies in one step, in
    total (max_wait_us). Past it an unanswered lookup makes vLLM ask again
    next step and an unanswered acquire is collected next step: a slow
    sidecar delays a hit by a step, never the whole engine."""

    __slots__ = ("max_ns", "left_ns")

    def __init__(self, max_ns: int):
        self.max_ns = max_ns
        self.left_ns = max_ns

    def reset(self) -> None:
        """The next step's budget."""
        self.left_ns = self.max_ns

    def reply(self, s: Session, seq: int) -> Optional[bytes]:
        """The reply to seq if it is there or arrives within what is left of
        this step's budget, else None (seq stays collectable)."""
        p = s.try_reply(seq)
        if p is not None:
            return p
        left = self.left_ns
        if left <= 0:
            s.kick()
            return None
        t0 = time.perf_counter_ns()
        p = s.await_reply(seq, timeout=left / 1e9, keep=True)
        self.left_ns = left - (time.perf_counter_ns() - t0)
        return p
