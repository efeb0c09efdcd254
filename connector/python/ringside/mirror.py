"""A local copy of the digests present in a sidecar namespace.

The design (why, how fresh it is, read your own writes, memory) is in
docs/architecture.md, "The local index". This module is the copy itself: a
:class:`Mirror` copies the namespace's present digests once (Snapshot
pages, protocol.md section 11), then follows its change log (Changes), one
request a call of :meth:`Mirror.pump`, published without waking the sidecar
and collected the next call. Per-call work is proportional to what changed.

Callers check :meth:`Mirror.fresh` before trusting it; :meth:`Mirror.answer`
returns -1 when a request's first miss is one of the digests noted in
:meth:`Mirror.noting` (this engine's own recent stores): ask the sidecar.
A namespace larger than ``max_blocks`` turns the mirror off for the session.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from . import schema as _s

logger = logging.getLogger("ringside.mirror")

_monotonic = time.monotonic
# The ChangesReply layout (protocol.md 6.4): status, flags, epoch, next, count,
# width; then count entries of an 8-byte change header and the digest.
_CHANGES_REPLY = _s.CHANGES_REPLY
_HEAD = _CHANGES_REPLY.size
_clock_ns = time.perf_counter_ns

# Entries asked for per Changes poll. A reply with fewer means the mirror has
# caught up with the log's head as of the moment the sidecar read it.
CHANGES_PER_POLL = 1024


class Mirror:
    """The present digests of one session's namespace (see the module doc).

    States: OFF (not started, or turned off: the sidecar does not know
    Snapshot, or the namespace holds more than max_blocks), SYNC (snapshot
    pages in flight), CATCHUP (following the log from the first page's
    cursor), LIVE (caught up with the log at least once since the last sync).
    """

    OFF, SYNC, CATCHUP, LIVE = range(4)
    STATE_NAMES = ("off", "sync", "catchup", "live")

    def __init__(
        self,
        width: int = 32,
        max_blocks: int = 4_000_000,
        timeout: float = 2.0,
        max_lag: float = 1.0,
        page_max: int = 0,
    ):
        self.width = width
        self.page_max = page_max  # snapshot entries asked for per page (0: the sidecar's bound)
        self.max_blocks = max_blocks
        self.timeout = timeout
        self.max_lag = max_lag
        self.present: set = set()
        self.state = Mirror.OFF
        self.disabled = ""  # why the mirror is off for this session, if it is
        self._session = None
        self._pending = 0  # seq of the request in flight (0: none)
        self._pending_t = 0.0
        self._applied_t = 0.0  # when the request whose reply is being applied was sent
        self._from = 0  # next snapshot position
        self._c0: Optional[tuple[int, int]] = None  # cursor of the first page
        self._epoch = 0
        self._seq = 0
        self.fresh_t = -1e9  # when the poll that last caught up was sent
        self.sent_t = -1e9  # when the last request was sent
        # Digests this engine sent for storing lately: the caller adds them
        # to `mine` (through noting()); every max_lag it becomes `_mine_old` (so an entry lives
        # one to two max_lag, longer than a store takes to show in the index).
        self.mine: set = set()
        self._mine_old: set = set()
        self._mine_t = _monotonic()
        self.stats = {
            "syncs": 0,
            "resyncs": 0,
            "pages": 0,
            "polls": 0,
            "changes": 0,
            "lost_replies": 0,
            "own_misses": 0,
        }

    # ------------------------------------------------------------------

    def fresh(self, now: float, s=None) -> bool:
        """True if the mirror may answer lookups for session s: it was built
        on s (a copy of another session's sidecar, e.g. before a restart, is
        void), it is live, and a poll sent at most max_lag seconds ago was
        answered with the log's head (a sidecar that stopped answering makes
        it stale)."""
        return self.state == Mirror.LIVE and self._session is s and now - self.fresh_t <= self.max_lag

    def leading(self, hashes, n: int) -> int:
        """How many of hashes[:n] are present, from the first one on."""
        pres = self.present
        if n <= 0 or hashes[0] not in pres:
            return 0
        if pres.issuperset(hashes[:n]):  # one C loop (~15 ns a block): the common hit
            return n
        i = 1
        while hashes[i] in pres:
            i += 1
        return i

    def answer(self, hashes, n: int) -> int:
        """leading(hashes, n), or -1 when the first miss is a digest noted in
        `mine` lately: this engine stored it, the store may not be in the
        index yet, and the caller should ask the sidecar."""
        i = self.leading(hashes, n)
        if i < n:
            h = hashes[i]
            if h in self.mine or h in self._mine_old:
                self.stats["own_misses"] += 1
                return -1
        return i

    def noting(self, now: float) -> set:
        """The set in which to note the digests this engine sends for storing
        now (`mine`), after letting those noted more than max_lag ago go.
        Aging here, where digests are added, bounds the sets by what one to
        two max_lag of stores add, whether or not the index is being polled
        (a sidecar away for hours, an engine that never pumps)."""
        self.age(now)
        return self.mine

    def age(self, now: float) -> None:
        """Let the digests noted in `mine` more than max_lag ago go."""
        if now - self._mine_t >= self.max_lag:
            self._mine_t = now
            self._mine_old = self.mine
            self.mine = set()

    def reset(self) -> None:
        """Forget everything (a new session starts a new sync)."""
        self.present = set()
        self.mine = set()
        self._mine_old = set()
        self.state = Mirror.OFF
        self.disabled = ""
        self._session = None
        self._pending = 0
        self._c0 = None

    def _restart(self) -> None:
        self.present = set()
        self.state = Mirror.SYNC
        self._from = 0
        self._c0 = None
        self.stats["syncs"] += 1

    def _off(self, why: str) -> None:
        if not self.disabled:
            logger.warning("ringside: local index of the cache off for this session (%s); lookups ask the sidecar", why)
        self.disabled = why
        self.present = set()
        self.state = Mirror.OFF

    # ------------------------------------------------------------------

    def pump(self, s, budget_ns: int = 0, wake: bool = False) -> None:
        """Advance the mirror on session s: collect the reply of the request
        in flight if it has arrived (waiting for replies for at most budget_ns
        in all), apply it, and send the next request (the next snapshot page,
        or a Changes poll; at most one poll a call once live). Raises
        RingsideError / SchemaError like any session call."""
        if s is not self._session:
            self.reset()
            self._session = s
            self._restart()
        if self.disabled:
            return
        end = _clock_ns() + budget_ns
        polled = False
        while True:
            if self._pending:
                p = s.try_reply(self._pending)
                if p is None:
                    left = end - _clock_ns()
                    if left > 0:
                        p = s.await_reply(self._pending, timeout=left / 1e9, keep=True)
                    if p is None:
                        if _monotonic() - self._pending_t < self.timeout:
                            return
                        # No answer: ask again (pages and polls are cursor-based).
                        s.forget(self._pending)
                        self._pending = 0
                        self.stats["lost_replies"] += 1
                if p is not None:
                    self._pending = 0
                    self._applied_t = self._pending_t
                    polled = self._apply(p) or polled
                    if self.disabled:
                        return
            if self.state == Mirror.LIVE and polled:
                return  # one poll a call once live
            if self.state == Mirror.SYNC:
                typ, payload = _s.TYPE_SNAPSHOT, _s.encode_snapshot(self._from, self.page_max)
            else:
                typ, payload = _s.TYPE_CHANGES, _s.encode_changes(self._epoch, self._seq, CHANGES_PER_POLL)
                self.stats["polls"] += 1
            waiting = _clock_ns() < end
            self._pending = s.submit(typ, payload, wake=wake or waiting)
            self._pending_t = self.sent_t = _monotonic()
            if not waiting:
                return

    def _apply(self, p: bytes) -> bool:
        """Apply one reply; True if it was a poll that caught up."""
        status = _s.reply_status(p)
        if self.state == Mirror.SYNC:
            if status:
                # A sidecar without Snapshot (unknown type), or a namespace
                # error: no mirror on this session.
                self._off("snapshot refused, status %d" % status)
                return False
            rep = _s.decode_snapshot_reply(p)
            if rep.width != self.width:
                self._off("snapshot digests are %d bytes, want %d" % (rep.width, self.width))
                return False
            self.stats["pages"] += 1
            if self._c0 is None:
                self._c0 = (rep.epoch, rep.seq)
            e = rep.entries
            w = self.width
            if e:
                self.present.update([e[i : i + w] for i in range(0, len(e), w)])
                if len(self.present) > self.max_blocks:
                    self._off("the namespace holds more than %d blocks (mirror_max_blocks)" % self.max_blocks)
                    return False
            if rep.done:
                self._epoch, self._seq = self._c0
                self.state = Mirror.CATCHUP
            else:
                self._from = rep.next
            return False
        if status:
            raise _s.SchemaError("Changes refused: status %d" % status)
        # The ChangesReply, checked as schema.decode_changes_reply does,
        # without copying the entries out.
        if len(p) < _HEAD:
            raise _s.SchemaError("changes reply: %d bytes, want at least %d" % (len(p), _HEAD))
        _, flags, epoch, nxt, n, w = _CHANGES_REPLY.unpack_from(p, 0)
        if flags & _s.CHANGES_FLAG_RESYNC:
            # The log moved past our cursor (or the sidecar restarted): copy again.
            self.stats["resyncs"] += 1
            self._restart()
            return False
        es = _s.CHANGE_HEADER_SIZE + w
        if w != self.width or n > _s.MAX_CHANGES_PER_REPLY or len(p) != _HEAD + n * es:
            raise _s.SchemaError(
                "changes reply: %d entries of %d-byte digests in %d bytes (want %d-byte digests)"
                % (n, w, len(p), self.width)
            )
        if n:
            pres = self.present
            end = _HEAD + n * es
            stored, evicted, cleared, dig = _s.OP_STORED, _s.OP_EVICTED, _s.OP_CLEARED, _s.CHANGE_HEADER_SIZE
            for off in range(_HEAD, end, es):
                op = p[off]
                if op == stored:
                    pres.add(p[off + dig : off + es])
                elif op == evicted:
                    pres.discard(p[off + dig : off + es])
                elif op == cleared:
                    pres.clear()
            self.stats["changes"] += n
            if len(pres) > self.max_blocks:
                self._off("the namespace holds more than %d blocks (mirror_max_blocks)" % self.max_blocks)
                return False
        self._epoch, self._seq = epoch, nxt
        if n < CHANGES_PER_POLL:
            self.state = Mirror.LIVE
            self.fresh_t = self._applied_t
            return True
        return False
