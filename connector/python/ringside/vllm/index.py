"""The scheduler's use of the local index of the cache (ringside.mirror).

When the index answers, when it is brought up to date and when the sidecar
is asked instead is described in docs/architecture.md ("The local index").
This class holds the clocks that decide it: when vLLM last took a step's
output (the engine is idle after ``mirror_idle_ms`` without one and no
request in flight), whether arrivals were looked up in it this step (then
the change log is polled after the step), and when the index last polled.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from ..client import Link, Session
from ..mirror import Mirror
from ..plugin.config import Config
from ..plugin.faults import SIDECAR_ERRORS, Faults
from .state import StepBudget


class LocalIndex:
    """The mirror, and when to trust and poll it (see the module doc)."""

    def __init__(self, cfg: Config, link: Link, faults: Faults, budget: StepBudget):
        self.mirror = Mirror(32, cfg.mirror_max_blocks, cfg.timeout, cfg.mirror_max_lag_ms / 1000.0)
        self.link = link  # the scheduler side's (its session is polled after each step)
        self.faults = faults
        self.budget = budget
        self.stats = faults.stats
        self.idle_s = cfg.mirror_idle_ms / 1000.0
        # The change log is polled in a step that follows arrivals (the
        # index is used), else every mirror_poll_ms while the engine runs.
        self.poll_s = cfg.mirror_poll_ms / 1000.0
        self.sync_budget_ns = int(cfg.mirror_sync_us * 1000)
        self.arrived = False  # arrivals were looked up in the index since the last poll
        self.out_t = 0.0  # when vLLM last took a step's output (take_events, update_connector_output)

    def start(self, s: Optional[Session], timeout: float) -> None:
        """Copy the index now, while the engine starts (bounded)."""
        if s is None:
            return
        try:
            self.mirror.pump(s, int(min(timeout, 2.0) * 1e9))
        except SIDECAR_ERRORS as e:
            self.faults.fail(e)

    def usable(self, s: Session, busy: bool) -> bool:
        """Whether an arrival may be looked up in the index now: busy (a
        request in flight) and fresh, or after an idle gap once caught up.
        Raises like a session call."""
        m = self.mirror
        now = time.monotonic()
        if m.fresh(now, s) if busy or now - self.out_t < self.idle_s else self.caught_up(s, now):
            self.arrived = True
            return True
        return False

    def caught_up(self, s: Session, now: float) -> bool:
        """After an idle gap (no request in flight, no step for mirror_idle_ms)
        the index may lag: whether a Changes poll sent since the engine went
        idle (or in the last mirror_idle_ms) has been answered with the log's
        head. If not, one is sent (waking the sidecar) and waited for within
        the step's max_wait_us budget. The first arrival of a burst pays that
        one round trip; the others are looked up in the index."""
        m = self.mirror
        since = max(self.out_t, now - self.idle_s)
        if m.fresh_t >= since and m.fresh(now, s):
            return True
        budget = self.budget
        for _ in range(2):  # collect a poll sent before the gap, then send one
            left = budget.left_ns
            t0 = time.perf_counter_ns()
            m.pump(s, max(left, 0), wake=True)
            if left > 0:
                budget.left_ns = left - (time.perf_counter_ns() - t0)
            if m.fresh_t >= since and m.fresh(time.monotonic(), s):
                self.stats["mirror_catchups"] += 1
                return True
        return False

    def answer(self, s: Session, hashes: Sequence[bytes], usable: int) -> int:
        """Leading hits of a request in the index, or -1: ask the sidecar
        (the index is not fresh, or the first miss is one of this engine's
        own recent stores, perhaps not in the index yet)."""
        m = self.mirror
        if not m.fresh(time.monotonic(), s):
            return -1
        self.arrived = True
        hits = m.answer(hashes, usable)
        if hits >= 0:
            st = self.stats
            st["mirror_lookups"] += 1
            st["mirror_hit_blocks"] += hits
        return hits

    def after_step(self) -> tuple:
        """vLLM took a step's output (take_events): collect the last poll of
        the change log and send the next one (no wait, no wake), in a step
        that followed arrivals looked up in the index or mirror_poll_ms after
        the last poll; while the snapshot is copied, wait up to
        mirror_sync_us. Returns no events (): without KV events this is the
        scheduler side's take_events hook itself (scheduler.py)."""
        now = self.out_t = time.monotonic()
        m = self.mirror
        s = self.link.session
        if m.disabled or s is None:
            return ()
        try:
            if m.state != Mirror.LIVE:
                m.pump(s, self.sync_budget_ns)
            elif self.arrived or now - m.sent_t >= self.poll_s:
                self.arrived = False
                m.pump(s)
        except SIDECAR_ERRORS as e:
            self.faults.fail(e)
        return ()

    def add_stats(self, stats: dict) -> None:
        """The index's counters, for the stats file."""
        m = self.mirror
        stats["mirror_state"] = Mirror.STATE_NAMES[m.state]
        stats["mirror_blocks"] = len(m.present)
        for k, v in m.stats.items():
            stats["mirror_" + k] = v
