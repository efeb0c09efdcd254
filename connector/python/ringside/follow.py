"""Following a log of the sidecar: a copy of a namespace's state made once
(snapshot pages), then kept by reading the namespace's log from the first
page's cursor (docs/protocol.md, section 11).

:class:`LogFollower` is the loop both followers share: one request in
flight at most, published without waking the sidecar and collected at the
next call of :meth:`LogFollower.pump` (or waited for within a budget), asked
again when no reply comes within ``timeout`` (pages and polls are
cursor-based, so asking again is safe). What the requests are and what a
reply changes are the subclass's: the local index of the cache
(ringside.mirror.Mirror) follows the change log, the KV events feed
(ringside.events.EventFeed) the event log.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from .client import Session


class LogFollower:
    """One request in flight to the sidecar's log (see the module doc).

    A subclass gives the three steps of its state machine:

    - :meth:`_begin`: a new session (the first, or one after a sidecar
      restart or re-attach); the state starts over, and a sync begins
      unless the follower turned itself off;
    - :meth:`_request`: the next request, (record type, payload): a
      snapshot page while syncing, else a poll of the log;
    - :meth:`_apply`: a reply; True ends the call (a poll was applied
      that the follower counts as its one poll of the call).

    ``disabled`` (a reason) turns the follower off for the session:
    :meth:`pump` then does nothing until another session comes.
    """

    def __init__(self, timeout: float, stats: dict[str, Any]):
        self.timeout = timeout  # seconds a request may stay unanswered before it is asked again
        self.stats = stats  # the subclass's counters; "lost_replies" counts requests asked again
        self.disabled = ""  # why the follower is off for this session, if it is
        self.session: Optional[Session] = None  # the session followed
        self.pending = 0  # seq of the request in flight (0: none)
        self.pending_t = 0.0  # when it was sent (time.monotonic)
        self.sent_t = -1e9  # when the last request was sent

    def pump(self, s: Session, budget_ns: int = 0, wake: bool = False) -> None:
        """Advance on session s: collect the reply of the request in flight
        if it has arrived (waiting for replies for at most budget_ns in
        all), apply it, and send the next request, as long as the budget
        lasts and no reply ended the call. Raises RingsideError /
        SchemaError like any session call."""
        if s is not self.session:
            self._begin(s)
        if self.disabled:
            return
        end = time.perf_counter_ns() + budget_ns
        while True:
            if self.pending:
                p = s.try_reply(self.pending)
                if p is None:
                    left = end - time.perf_counter_ns()
                    if left > 0:
                        p = s.await_reply(self.pending, timeout=left / 1e9, keep=True)
                    if p is None:
                        if time.monotonic() - self.pending_t < self.timeout:
                            return
                        # No answer: ask again (pages and polls are cursor-based).
                        s.forget(self.pending)
                        self.pending = 0
                        self.stats["lost_replies"] += 1
                if p is not None:
                    self.pending = 0
                    if self._apply(p, self.pending_t) or self.disabled:
                        return
            typ, payload = self._request()
            waiting = time.perf_counter_ns() < end
            self.pending = s.submit(typ, payload, wake=wake or waiting)
            self.pending_t = self.sent_t = time.monotonic()
            if not waiting:
                return

    # -- the subclass's steps ----------------------------------------------------

    def _begin(self, s: Session) -> None:
        """Session s is new: follow it from a new sync."""
        raise NotImplementedError

    def _request(self) -> tuple[int, bytes]:
        """The next request: (record type, payload)."""
        raise NotImplementedError

    def _apply(self, p: bytes, sent_t: float) -> bool:
        """Apply reply p of a request sent at sent_t (time.monotonic); True
        ends this call of pump."""
        raise NotImplementedError
