"""The sidecar's tier as KV events: what an engine's event stream must say.

A :class:`EventFeed` follows one namespace's event log in the sidecar
(docs/protocol.md, sections 5.12, 5.13 and 11.1): it copies the present,
described blocks once (EventSnapshot pages), then reads the log (Events)
from the first page's cursor, one request a call of :meth:`EventFeed.pump`,
published without waking the sidecar and collected the next call, as
:class:`ringside.mirror.Mirror` follows the change log.

It keeps the set of blocks it has announced, so that the stream it feeds
says each block once: a block is announced (``stored``) when the sidecar
holds it, described, and the feed has not announced it; it is withdrawn
(``removed``) when the sidecar drops it, or when a new session (a sidecar
restart, a re-attach) finds the sidecar without it. An engine that starts
(or starts again) with an empty set announces every described block the
sidecar holds. What the engine makes of these (vLLM's BlockStored and
BlockRemoved with medium CPU) is the engine plugin's (ringside.vllm.events).

Costs: one request in flight at most; per call, work proportional to the
events read. Memory: the announced digests (one bytes object each).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import schema as _s
from .follow import LogFollower

if TYPE_CHECKING:  # pragma: no cover
    from .client import Session

logger = logging.getLogger("ringside.events")

# Entries asked for per Events poll; a reply with fewer has caught up.
EVENTS_PER_POLL = 1024


class EventFeed(LogFollower):
    """The announced blocks of one namespace (see the module doc), kept by
    following its event log (ringside.follow).

    ``emit_stored(digests, parent, tokens, extra)`` is called for each run
    of blocks to announce: digests, a list of bytes, is a chain (each
    block's parent is the one before it) of blocks read one after another
    with the same number of tokens and the same extra bytes; parent (bytes)
    is the first block's parent, None for a chain's first block; tokens,
    bytes-like, holds every block's u32 token ids, little-endian, in order
    (valid only during the call); extra is bytes-like. Runs keep the log's
    order: a block's announcement is never batched past a withdrawal that
    follows it. ``emit_removed(digest)`` is called for each block to
    withdraw. Both from inside :meth:`pump`.

    States: OFF (not started, or turned off: the sidecar does not know the
    event records, or the namespace holds more than max_blocks), SYNC
    (snapshot pages in flight), LIVE (following the log).
    """

    OFF, SYNC, LIVE = range(3)
    STATE_NAMES = ("off", "sync", "live")

    def __init__(
        self,
        emit_stored: Callable[[list[bytes], Optional[bytes], Any, bytes], None],
        emit_removed: Callable[[bytes], None],
        width: int = 32,
        max_blocks: int = 4_000_000,
        timeout: float = 2.0,
        page_max: int = 0,
    ):
        super().__init__(
            timeout,
            {
                "syncs": 0,
                "resyncs": 0,
                "pages": 0,
                "polls": 0,
                "stored": 0,
                "removed": 0,
                "lost_replies": 0,
            },
        )
        self.emit_stored = emit_stored
        self.emit_removed = emit_removed
        self.width = width
        self.max_blocks = max_blocks
        self.page_max = page_max
        self.announced: set[bytes] = set()
        self.state = EventFeed.OFF
        self._from = 0
        self._c0: Optional[tuple[int, int]] = None
        self._seen: set[bytes] = set()  # digests the snapshot found (SYNC)
        self._epoch = 0
        self._seq = 0
        self.caught_up = False  # the last poll read the log's head

    # ------------------------------------------------------------------

    def _restart(self) -> None:
        self.state = EventFeed.SYNC
        self._from = 0
        self._c0 = None
        self._seen = set()
        self.pending = 0
        self.caught_up = False
        self.stats["syncs"] += 1

    def _off(self, why: str) -> None:
        if not self.disabled:
            logger.warning("ringside: KV events of the sidecar's tier off for this session (%s)", why)
        self.disabled = why
        self.state = EventFeed.OFF

    # -- the follower's steps (ringside.follow) ----------------------------------

    def _begin(self, s: Session) -> None:
        self.session = s
        self.disabled = ""
        self._restart()

    def _request(self) -> tuple[int, bytes]:
        if self.state == EventFeed.SYNC:
            return _s.TYPE_EVENT_SNAPSHOT, _s.encode_snapshot(self._from, self.page_max)
        self.stats["polls"] += 1
        return _s.TYPE_EVENTS, _s.encode_changes(self._epoch, self._seq, EVENTS_PER_POLL)

    def forget_all(self) -> None:
        """The stream's consumers forgot every block (the engine published
        AllBlocksCleared, which routers apply to every tier of the pod):
        announce the sidecar's blocks again, from a new snapshot."""
        if self.pending and self.session is not None:
            self.session.forget(self.pending)
        self.announced = set()
        if self.state != EventFeed.OFF or self.disabled:
            self._restart()

    def withdraw_all(self) -> None:
        """Withdraw every announced block (the engine shuts its tier off)."""
        for d in self.announced:
            self.emit_removed(d)
        self.stats["removed"] += len(self.announced)
        self.announced = set()

    # ------------------------------------------------------------------

    def _apply(self, p: bytes, sent_t: float = 0.0) -> bool:
        """Apply one reply; True if it was a poll (live: one poll a call)."""
        status = _s.reply_status(p)
        if status:
            if status == _s.Status.UNKNOWN_TYPE:
                self._off("the sidecar does not know the event records")
                return False
            if self.state == EventFeed.SYNC:
                self._off("event snapshot refused, status %d" % status)
                return False
            raise _s.SchemaError("Events refused: status %d" % status)
        head = _s.EVENTS_REPLY
        if len(p) < head.size:
            raise _s.SchemaError("events reply of %d bytes" % len(p))
        _, flags, epoch, seq, nxt, n, w = head.unpack_from(p, 0)
        if w != self.width or n > _s.MAX_EVENTS_PER_REPLY:
            raise _s.SchemaError("events reply: %d entries of %d-byte digests (want %d)" % (n, w, self.width))
        if self.state == EventFeed.SYNC:
            self.stats["pages"] += 1
            if self._c0 is None:
                self._c0 = (epoch, seq)
            self._read(p, n, w, sync=True)
            if flags & _s.EVENTS_FLAG_DONE:
                self._finish_sync()
            else:
                self._from = nxt
            return False
        if flags & _s.EVENTS_FLAG_RESYNC:
            self.stats["resyncs"] += 1
            self._restart()
            return False
        self._read(p, n, w, sync=False)
        self._epoch, self._seq = epoch, seq
        self.caught_up = n < EVENTS_PER_POLL
        return True

    def _read(self, p: bytes, n: int, w: int, sync: bool) -> None:
        # One pass over the entries (schema.iter_events reads and checks
        # them) that applies each, gathering the blocks to announce into
        # runs: one call of emit_stored a chain, the per-block work kept to
        # the announced set. A block announced before is left out and breaks
        # its run; a withdrawal of an announced block is emitted in its
        # place, after the run gathered before it. An entry found malformed
        # raises after the ones before it were applied (their run is emitted
        # first): the cursor is not advanced, and the next poll reads them
        # again, which changes nothing (announced once).
        if not isinstance(p, bytes):
            p = bytes(p)
        ann = self.announced
        seen = self._seen
        emit_stored, emit_removed = self.emit_stored, self.emit_removed
        stored_op = _s.EVENT_STORED
        max_blocks = self.max_blocks
        stored = removed = 0
        # The run being gathered: its first block (r_d, its tokens r_mv) and,
        # once a second block joins it, the lists of all (r_ds, r_tks).
        r_d = b""  # (b"": none; a digest is never empty)
        r_mv: Any = None
        r_ds: Optional[list[bytes]] = None
        r_tks: list = []
        r_parent: Optional[bytes] = None
        r_extra = b""
        r_t = -1
        prev = None  # the run's last digest (a parent that continues it)
        try:
            for op, d, parent, tokens, extra, t in _s.iter_events(p, n, w):
                if op == stored_op:
                    if sync:
                        seen.add(d)
                    if d in ann:
                        prev = None  # an announced block breaks the run's chain
                    elif len(ann) >= max_blocks:
                        self._off("the namespace holds more than %d described blocks" % max_blocks)
                        return
                    else:
                        ann.add(d)
                        if prev is not None and parent == prev and t == r_t and extra == r_extra:
                            if r_ds is None:
                                r_ds, r_tks = [r_d], [r_mv]
                            r_ds.append(d)
                            r_tks.append(tokens)
                        else:
                            if r_d:
                                _emit_run(emit_stored, r_d, r_ds, r_parent, r_mv, r_tks, r_extra)
                            r_d, r_mv, r_ds, r_parent, r_t, r_extra = d, tokens, None, parent, t, extra
                        prev = d
                        stored += 1
                elif d in ann:  # a withdrawal
                    if r_d:
                        _emit_run(emit_stored, r_d, r_ds, r_parent, r_mv, r_tks, r_extra)
                        r_d, r_ds, prev = b"", None, None
                    ann.discard(d)
                    emit_removed(d)
                    removed += 1
        finally:
            if r_d:
                _emit_run(emit_stored, r_d, r_ds, r_parent, r_mv, r_tks, r_extra)
            self.stats["stored"] += stored
            self.stats["removed"] += removed

    def _finish_sync(self) -> None:
        # Blocks announced before (an earlier session's) that the sidecar no
        # longer holds are withdrawn; the log from the first page's cursor
        # then corrects whatever changed while the pages were read.
        gone = self.announced - self._seen
        for d in gone:
            self.emit_removed(d)
        self.stats["removed"] += len(gone)
        self.announced -= gone
        self._seen = set()
        self._epoch, self._seq = self._c0 if self._c0 is not None else (0, 0)
        self.state = EventFeed.LIVE


def _emit_run(
    emit_stored: Callable[[list[bytes], Optional[bytes], Any, bytes], None],
    d: bytes,
    ds: Optional[list[bytes]],
    parent: Optional[bytes],
    mv: Any,
    tks: list,
    extra: bytes,
) -> None:
    # A gathered run (EventFeed._read): its first block alone (d, its tokens
    # mv), or all of them (ds, tks) once a second joined. A plain function,
    # not a closure, so that the read loop's variables stay locals.
    if ds is None:
        emit_stored([d], parent, mv, extra)
    else:
        emit_stored(ds, parent, b"".join(tks), extra)
