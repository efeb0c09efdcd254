"""A local copy of the digests present in a sidecar namespace.

The design (why, how fresh it is, read your own writes, memory) is in
docs/architecture.md, "The local index". This module is the copy itself: a
:class:`Mirror` copies the namespace's present digests once (Snapshot
pages, protocol.md section 11), then follows its change log (Changes), one
request a call of :meth:`Mirror.pump`, published without waking the sidecar
and collected the next call. Per-call work is proportional to what changed.

Callers check :meth:`Mirror.fresh` before trusting it; :meth:`Mirror.answer`
returns -1 when a request's first miss is one of the digests noted in
:meth:`Mirror.noting` (this engine's own recent stores), or when its hit
runs through a digest :meth:`Mirror.withhold` holds back (a load of it was
refused or failed): ask the sidecar.
A namespace larger than ``max_blocks`` turns the mirror off for the session.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from . import schema as _s
from .follow import LogFollower

if TYPE_CHECKING:  # pragma: no cover
    from .client import Session

logger = logging.getLogger("ringside.mirror")

# Entries asked for per Changes poll. A reply with fewer means the mirror has
# caught up with the log's head as of the moment the sidecar read it.
CHANGES_PER_POLL = 1024
# A digest whose load was refused is withheld (answer asks the sidecar)
# until the change log next names it, a resync, or this long at most; the
# most digests withheld at once (the oldest go first).
WITHHOLD_S = 10.0
MAX_WITHHELD = 65536


class Mirror(LogFollower):
    """The present digests of one session's namespace (see the module doc),
    kept by following its change log (ringside.follow).

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
        super().__init__(
            timeout,
            {
                "syncs": 0,
                "resyncs": 0,
                "pages": 0,
                "polls": 0,
                "changes": 0,
                "lost_replies": 0,
                "own_misses": 0,
                "withheld": 0,
            },
        )
        self.width = width
        self.page_max = page_max  # snapshot entries asked for per page (0: the sidecar's bound)
        self.max_blocks = max_blocks
        self.max_lag = max_lag
        self.present: set[bytes] = set()
        self.state = Mirror.OFF
        self._from = 0  # next snapshot position
        self._c0: Optional[tuple[int, int]] = None  # cursor of the first page
        self._epoch = 0
        self._seq = 0
        self.fresh_t = -1e9  # when the poll that last caught up was sent
        # Digests this engine sent for storing lately: the caller adds them
        # to `mine` (through noting()); every max_lag it becomes `_mine_old` (so an entry lives
        # one to two max_lag, longer than a store takes to show in the index).
        self.mine: set[bytes] = set()
        self._mine_old: set[bytes] = set()
        self._mine_t = time.monotonic()
        self.withheld: dict[bytes, float] = {}  # digest -> until when (time.monotonic)

    # ------------------------------------------------------------------

    def fresh(self, now: float, s: Optional[Session] = None) -> bool:
        """True if the mirror may answer lookups for session s: it was built
        on s (a copy of another session's sidecar, e.g. before a restart, is
        void), it is live, and a poll sent at most max_lag seconds ago was
        answered with the log's head (a sidecar that stopped answering makes
        it stale)."""
        return self.state == Mirror.LIVE and self.session is s and now - self.fresh_t <= self.max_lag

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
        w = self.withheld
        if w and i and not w.keys().isdisjoint(hashes[:i]):
            now = time.monotonic()
            for h in hashes[:i]:
                until = w.get(h)
                if until is not None:
                    if until > now:
                        self.stats["withheld"] += 1
                        return -1
                    del w[h]
        if i < n:
            h = hashes[i]
            if h in self.mine or h in self._mine_old:
                self.stats["own_misses"] += 1
                return -1
        return i

    def noting(self, now: float) -> set[bytes]:
        """The set in which to note the digests this engine sends for storing
        now (`mine`), after letting those noted more than max_lag ago go.
        Aging here, where digests are added, bounds the sets by what one to
        two max_lag of stores add, whether or not the index is being polled
        (a sidecar away for hours, an engine that never pumps)."""
        self.age(now)
        return self.mine

    def withhold(self, digests) -> None:
        """Stop offering digests (their load was refused or failed) until
        the change log next names them, a resync, or WITHHOLD_S: a lookup
        that reaches one asks the sidecar."""
        w = self.withheld
        until = time.monotonic() + WITHHOLD_S
        for d in digests:
            w.pop(d, None)
            w[d] = until
        while len(w) > MAX_WITHHELD:
            del w[next(iter(w))]

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
        self.withheld = {}
        self.state = Mirror.OFF
        self.disabled = ""
        self.session = None
        self.pending = 0
        self._c0 = None

    def _restart(self) -> None:
        self.present = set()
        self.withheld = {}
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

    # -- the follower's steps (ringside.follow) ----------------------------------

    def _begin(self, s: Session) -> None:
        self.reset()
        self.session = s
        self._restart()

    def _request(self) -> tuple[int, bytes]:
        if self.state == Mirror.SYNC:
            return _s.TYPE_SNAPSHOT, _s.encode_snapshot(self._from, self.page_max)
        self.stats["polls"] += 1
        return _s.TYPE_CHANGES, _s.encode_changes(self._epoch, self._seq, CHANGES_PER_POLL)

    def _apply(self, p: bytes, sent_t: float) -> bool:
        """Apply one reply; True if it was a poll that caught up (one poll a
        call once live)."""
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
        # its entries read without decoding it whole.
        head = _s.CHANGES_REPLY
        if len(p) < head.size:
            raise _s.SchemaError("changes reply: %d bytes, want at least %d" % (len(p), head.size))
        _, flags, epoch, nxt, n, w = head.unpack_from(p, 0)
        if flags & _s.CHANGES_FLAG_RESYNC:
            # The log moved past our cursor (or the sidecar restarted): copy again.
            self.stats["resyncs"] += 1
            self._restart()
            return False
        if w != self.width:
            raise _s.SchemaError("changes reply: %d-byte digests, want %d" % (w, self.width))
        changes = _s.iter_changes(p, n, w)
        if n:
            pres = self.present
            stored, evicted, cleared = _s.OP_STORED, _s.OP_EVICTED, _s.OP_CLEARED
            wh = self.withheld
            for op, digest in changes:
                if op == stored:
                    pres.add(digest)
                elif op == evicted:
                    pres.discard(digest)
                elif op == cleared:
                    pres.clear()
                    wh.clear()
                if wh:
                    wh.pop(digest, None)
            self.stats["changes"] += n
            if len(pres) > self.max_blocks:
                self._off("the namespace holds more than %d blocks (mirror_max_blocks)" % self.max_blocks)
                return False
        self._epoch, self._seq = epoch, nxt
        if n < CHANGES_PER_POLL:
            self.state = Mirror.LIVE
            self.fresh_t = sent_t
            return True
        return False
