"""The sidecar's tier in vLLM's own KV event stream (docs/architecture.md,
"KV events for routers").

Both halves run on the scheduler side, in a thread of their own (the
events thread) with a session of their own, so that the engine's step pays
only for noting its stores and for taking the events made meanwhile:

- :meth:`KVEvents.note` (the engine's thread, from build_connector_meta)
  queues the step's planned store runs. The events thread sends them, once
  a poll interval, as a Describe record of their blocks: each run's parent
  digest (the block before it in the request's chain), the token ids, and
  the LoRA adapter. The sidecar keeps them as long as the blocks
  (protocol.md, section 5.11).
- The events thread follows the sidecar's event log with a
  :class:`ringside.events.EventFeed` (a poll every kv_events_poll_ms, its
  reply awaited parked, without the GIL) and makes vLLM's own
  ``BlockStored`` / ``BlockRemoved`` objects for the CPU tier.
  :meth:`KVEvents.take_events` (the connector's take_events hook, called by
  vLLM once a step after its output) hands over those made so far, which
  vLLM publishes in the same batch, ZMQ stream and replay buffer as its GPU
  events. Never ``AllBlocksCleared``: that clears every tier of the pod.

No lock is held across a ring wait: the events thread builds a round's
events apart and publishes them under a lock held only to extend a list.

The events are filled the way vLLM's own offloading connector fills
self-describing CPU-tier events (vllm/distributed/kv_transfer/kv_connector/
v1/offloading/events.py): hashes converted with ``maybe_convert_block_hash``
(so a router sees the block of the GPU event move between tiers, not a
second block), the parent hash, the block's token ids, ``block_size``,
``lora_id`` / ``lora_name``, ``extra_keys=None``, the group's index and
cache-spec kind and sliding window, ``medium="CPU"``, ``locality`` and
``ownership`` None. They cover every block the sidecar holds in this
namespace, whichever engine stored it; an engine that starts (again)
announces them all.

The extra bytes of a description are vLLM's: empty without a LoRA adapter,
else the adapter id (i64, little-endian) and its name (UTF-8).
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from array import array
from typing import Any, Optional

from .. import schema as _s
from ..events import EventFeed
from ..plugin.faults import SIDECAR_ERRORS, Faults

logger = logging.getLogger("ringside.vllm")

_monotonic = time.monotonic
_I64 = struct.Struct("<q")
_RUN = _s._DESCRIBE_RUN
_DESC = _s._DESCRIBE
_PARENT = _s.DESCRIBE_FLAG_PARENT
_TYPE_DESCRIBE = _s.TYPE_DESCRIBE
_NATIVE = _s._NATIVE_U32
# Blocks noted that wake the events thread before its poll interval ends.
MAX_NOTED = 2048
# Polls one round of the events thread reads at most while the log has more.
MAX_POLLS_A_ROUND = 16
# While the engine does not step, the thread checks every IDLE_S whether it
# did, and runs a round at least every IDLE_ROUND_S (its session stays used).
IDLE_S = 0.05
IDLE_ROUND_S = 5.0
# How long a described block is not described again (note()).
RECENT_S = 10.0


def enabled(cfg: Any, vllm_config: Any) -> bool:
    """Whether the connector announces the sidecar's tier: kv_events true,
    or "auto" and vLLM publishes KV cache events."""
    if cfg.kv_events is True or cfg.kv_events is False:
        return bool(cfg.kv_events)
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))


def group_spec(kv_cache_config: Any, gid: int = 0) -> tuple[Optional[str], Optional[int]]:
    """(kv_cache_spec_kind, kv_cache_spec_sliding_window) of KV cache group
    gid, as vLLM annotates its GPU events of that group."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
    except Exception:  # noqa: BLE001 - an older vLLM, or no config: vLLM leaves them None too
        return None, None


def lead_group(layout: Any) -> Any:
    """The KV cache group whose blocks the events announce: the lead group
    (full attention, vLLM's hashes as they are, one hash a block), or None
    when the layout has none (nothing is announced). With several groups
    only the lead group's blocks are described and announced, under its
    group_idx: they carry the prefix a router matches (docs/architecture.md,
    "KV events")."""
    if layout is None:
        return None
    for g in layout.groups:
        if g.kind == "full" and not g.mask and g.ratio == 1:
            return g
    return None


def lora_extra(request: Any) -> bytes:
    """The extra bytes of a request's descriptions (its LoRA adapter)."""
    lr = getattr(request, "lora_request", None)
    if lr is None:
        return b""
    return (_I64.pack(int(lr.adapter_id)) + str(lr.name).encode("utf-8"))[: _s.MAX_DESCRIBE_EXTRA]


class KVEvents:
    """Describes the step's stores and turns the sidecar's event log into
    vLLM events (see the module doc)."""

    def __init__(self, cfg: Any, block_size: int, kv_cache_config: Any, layout: Any = None):
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_cls, self._removed_cls, self._medium = BlockStored, BlockRemoved, MEDIUM_CPU
        self._conv = external_hash(maybe_convert_block_hash)
        self._fast = getattr(self._conv, "fast", False)  # the low 64 bits, big-endian (vLLM's default)
        self._last: Any = None  # the last BlockStored of self._staged (a chain to extend)
        self._last_digest: Any = None  # the digest of its last block
        self._last_removed: Any = None  # the last BlockRemoved of self._staged (withdrawals to extend)
        lead = lead_group(layout) if layout is not None and not layout.plain else None
        self.gid = lead.gid if lead is not None else 0
        self.block_size = lead.block_size if lead is not None else block_size
        self.kind, self.window = group_spec(kv_cache_config, self.gid)
        self.stats: dict = {"described_blocks": 0}  # the scheduler side's counters, once bound
        self.poll_s = cfg.kv_events_poll_ms / 1000.0
        self.timeout = cfg.timeout
        self.out: list = []  # events published for the next take_events (under _lock)
        self._staged: list = []  # the events of the events thread's round in progress
        self._lock = threading.Lock()
        # Store runs (request, first, end) not described yet: the engine's
        # thread appends, the events thread pops (deque operations are atomic).
        self.noted: collections.deque = collections.deque()
        self._since_wake = 0  # blocks noted since the events thread was last woken (the engine's thread's)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._forget = False  # set by the engine's thread on AllBlocksCleared
        self._stepped = True  # the engine stepped (took events) since the last round
        self._link: Any = None
        self.faults: Any = None
        self.thread: Optional[threading.Thread] = None
        self._idle_rounds = 0
        # The events thread's own counters (the scheduler side reports them
        # as events_*): rounds, its CPU time, the failures of its session.
        self.thread_stats: dict = {"rounds": 0, "cpu_ns": 0, "sidecar_errors": 0}
        self.recent: set = set()  # the last blocks of runs described lately (see note)
        self.recent_old: set = set()
        self.recent_t = _monotonic()
        self.feed = EventFeed(self._stored, self._removed, 32, cfg.mirror_max_blocks, cfg.timeout)
        self._lora: dict = {}  # extra bytes -> (lora_id, lora_name)

    # -- the step's stores ------------------------------------------------------

    def note(self, runs: list) -> None:
        """Queue a step's planned store runs, described by the events
        thread's next round: one Describe record for the steps of a poll
        interval. A run holds its request (block hashes and token ids only
        grow), for about one interval; MAX_NOTED blocks wake the thread
        early."""
        # A run whose last block this engine described lately is skipped:
        # the sidecar keeps the first description of a block, and every
        # request that shares a prefix stores (and would describe) its
        # blocks again. "Lately" is one to two RECENT_S (the two sets below),
        # well within the sidecar's wait for a description's block
        # (--write-timeout), and a block withdrawn (evicted) is forgotten at
        # once: stored again, it is described again.
        now = _monotonic()
        if now - self.recent_t >= RECENT_S:
            self.recent_old, self.recent, self.recent_t = self.recent, set(), now
        recent, old = self.recent, self.recent_old
        noted = self.noted
        n = 0
        for run in runs:
            last = run[0].block_hashes[run[2] - 1]
            if last in recent or last in old:
                continue
            recent.add(last)
            noted.append(run)
            n += run[2] - run[1]
        self._since_wake += n
        if self._since_wake >= MAX_NOTED:
            self._since_wake = 0
            self._wake.set()

    def describe(self, s: Any, runs: list, max_payload: int) -> None:
        """Send the descriptions of runs, (request, first, end) block ranges
        the planner sent for storing this step, without waking the sidecar
        (fire and forget: a refusal, e.g. over the metadata bound, only
        leaves those blocks unannounced). Raises like Session.send."""
        bs = self.block_size
        parts: list = []
        nruns = blocks = 0
        size = 8
        send = s.send
        for req, a, b in runs:
            hashes = req.block_hashes
            toks = getattr(req, "_all_token_ids", None)
            if toks is None:
                toks = req.all_token_ids
            n = b - a
            extra = lora_extra(req) if req.lora_request is not None else b""
            rsize = 16 + 32 * (n + (a > 0)) + 4 * bs * n + len(extra)
            if nruns and (size + rsize > max_payload or blocks + n > _s.MAX_DESCRIBE_BLOCKS):
                parts[0] = _DESC.pack(nruns, 0)
                send(_TYPE_DESCRIBE, b"".join(parts), wake=False)
                parts, nruns, blocks, size = [], 0, 0, 8
            if not parts:
                parts.append(b"")
            tk = toks[a * bs : b * bs]
            tb = array("I", tk).tobytes() if _NATIVE else struct.pack("<%dI" % len(tk), *tk)
            if a > 0:
                parts.append(_RUN.pack(n, bs, len(extra), _PARENT))
                parts.append(hashes[a - 1])
            else:
                parts.append(_RUN.pack(n, bs, len(extra), 0))
            parts.append(hashes[a] if n == 1 else b"".join(hashes[a:b]))
            parts.append(tb)
            if extra:
                parts.append(extra)
            nruns += 1
            blocks += n
            size += rsize
        if nruns:
            parts[0] = _DESC.pack(nruns, 0)
            send(_TYPE_DESCRIBE, b"".join(parts), wake=False)
            self.stats["described_blocks"] += blocks

    # -- the stream -------------------------------------------------------------

    def watch(self, kv_cache_manager: Any) -> None:
        """Watch the engine's own events: vLLM publishes AllBlocksCleared when
        its prefix cache is reset, and routers apply it to every tier of the
        pod (llm-d, Dynamo), so the sidecar's blocks are then announced again.
        The manager's take_events is wrapped (vLLM takes them just before the
        connector's, in the same batch)."""
        from vllm.distributed.kv_events import AllBlocksCleared

        orig = getattr(kv_cache_manager, "take_events", None)
        if orig is None or getattr(orig, "_ringside", False):
            return

        def take_events():
            evs = orig()
            if evs:
                for e in evs:
                    if type(e) is AllBlocksCleared:
                        self._forget = True  # the events thread's next round starts over
                        self._wake.set()
                        break
            return evs

        take_events._ringside = True  # type: ignore[attr-defined]
        kv_cache_manager.take_events = take_events

    def start(self, link: Any) -> None:
        """Start the events thread on link, a re-attaching session of its
        own (a session is not shared between threads). Its first round
        reads the sidecar's described blocks at once (bounded by the
        session timeout, 2 s at most): the first steps publish them."""
        if link is None or self.thread is not None:
            return
        self._link = link
        self.faults = Faults(link, self.thread_stats, logger)
        t = threading.Thread(target=self._run, name="ringside-kv-events", daemon=True)
        self.thread = t
        t.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the events thread and close its session."""
        self._stop.set()
        self._wake.set()
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():  # a round still waiting (bounded by its budget): its daemon thread ends with us
                logger.warning("ringside: the KV events thread did not stop within %.0fs", timeout)
                return
        if self._link is not None:
            self._link.close()

    def _run(self) -> None:
        budget = int(min(self.timeout, 2.0) * 1e9)
        st = self.thread_stats
        clock = time.thread_time_ns
        while not self._stop.is_set():
            self._wake.clear()  # before the round: a wake during it brings the next one at once
            if not (self._stepped or self.noted or self._forget):
                # An idle engine publishes nothing (vLLM takes events only in
                # a step): no round until it steps, or at most IDLE_S apart.
                self._wake.wait(IDLE_S)
                if not (self._stepped or self.noted or self._forget or self._stop.is_set()):
                    self._idle_rounds += 1
                    if self._idle_rounds * IDLE_S < IDLE_ROUND_S:
                        continue
            self._idle_rounds = 0
            self._stepped = False
            c0 = clock()
            try:
                self.round(budget)
            except Exception as e:  # noqa: BLE001 - never let the thread die: the tier is left unannounced
                self.faults.warn_once("events-thread", "ringside: KV events round failed: %r" % (e,))
            st["rounds"] += 1
            st["cpu_ns"] += clock() - c0
            self._wake.wait(max(self.poll_s, 0.001))

    def round(self, budget_ns: int) -> None:
        """One round of the events thread: describe the runs noted since the
        last, read the event log (the snapshot's pages first, on a new
        session; then polls while the log has more), and publish the
        events made. Its waits together are bounded by budget_ns; a failure
        drops the session (Faults) and the next round attaches again."""
        feed = self.feed
        if self._forget:
            self._forget = False
            feed.forget_all()
        s = self._link.get()
        if s is None:
            return
        try:
            self.flush(s)
            end = time.perf_counter_ns() + budget_ns  # the whole round's waits
            for _ in range(MAX_POLLS_A_ROUND):
                left = end - time.perf_counter_ns()
                if left <= 0 or self._stop.is_set() or (feed.disabled and feed._session is s):
                    break
                feed.pump(s, left, wake=True)
                self._publish()
                if feed.state == EventFeed.LIVE and feed.caught_up and not feed._pending:
                    break
        except SIDECAR_ERRORS as e:
            self.faults.fail(e, "KV events")
        finally:
            self._publish()

    def flush(self, s: Any) -> None:
        """Describe the runs noted since the last flush (raises like
        Session.send)."""
        q = self.noted
        runs = []
        while q:
            runs.append(q.popleft())
        if runs:
            self.describe(s, runs, s.max_payload)

    def _publish(self) -> None:
        # Hand the round's events over; they are not touched again (vLLM may
        # be encoding them in its publisher's thread).
        st = self._staged
        if st:
            self._staged = []
            self._last = self._last_removed = None
            with self._lock:
                self.out.extend(st)

    def take_events(self) -> list:
        """The events the events thread made since the last call (the
        connector's take_events hook: no sidecar call, no wait)."""
        self._stepped = True
        if not self.out:
            return []
        with self._lock:
            out, self.out = self.out, []
        return out

    def _lora_of(self, extra) -> tuple:
        extra = bytes(extra)
        got = self._lora.get(extra)
        if got is None:
            if len(extra) >= 8:
                got = (_I64.unpack_from(extra, 0)[0], extra[8:].decode("utf-8", "replace"))
            else:
                got = (None, None)
            if len(self._lora) < 1024:
                self._lora[extra] = got
        return got

    def _stored(self, digests: list, parent, tokens, extra) -> None:
        # A run of the feed (EventFeed: a chain of blocks of one size and
        # one adapter): one BlockStored, or the continuation of the chain
        # just announced (a prefill's blocks read over two polls), as
        # vLLM's GPU events of a request's blocks.
        fast = self._fast
        if len(digests) == 1:  # a decode block (the common run): no comprehension
            hs = [int.from_bytes(digests[0][-8:], "big") if fast else self._conv(digests[0])]
        elif fast:
            frm = int.from_bytes
            hs = [frm(d[-8:], "big") for d in digests]
        else:
            conv = self._conv
            hs = [conv(d) for d in digests]
        if _NATIVE:
            ids = memoryview(tokens).cast("I").tolist()
        else:
            ids = list(struct.unpack("<%dI" % (len(tokens) // 4), tokens))
        bs = len(ids) // len(hs)
        lora_id, lora_name = self._lora_of(extra) if extra else (None, None)
        last = self._last
        if (
            last is not None
            and parent is not None
            and parent == self._last_digest
            and self._staged[-1] is last
            and last.block_size == bs
            and last.lora_name == lora_name
        ):
            last.block_hashes.extend(hs)
            last.token_ids.extend(ids)
        else:
            # BlockStored's fields in order: block_hashes, parent_block_hash,
            # token_ids, block_size, lora_id, medium, lora_name, extra_keys,
            # group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
            # locality, ownership.
            if parent is None:
                p = None
            else:
                p = int.from_bytes(parent[-8:], "big") if fast else self._conv(parent)
            last = self._stored_cls(
                hs, p, ids, bs, lora_id, self._medium, lora_name, None, self.gid, self.kind, self.window, None, None
            )
            self._staged.append(last)
            self._last = last
        self._last_digest = digests[-1]

    def _removed(self, digest: bytes) -> None:
        # Withdrawals in a row: one BlockRemoved of their hashes.
        self.recent.discard(digest)
        self.recent_old.discard(digest)
        h = self._conv(digest)
        out = self._staged
        if out and out[-1] is self._last_removed:
            self._last_removed.block_hashes.append(h)
        else:
            ev = self._removed_cls(block_hashes=[h], medium=self._medium, group_idx=self.gid)
            out.append(ev)
            self._last_removed = ev
        self._last = None


def external_hash(maybe_convert: Any) -> Any:
    """A fast equivalent of vLLM's maybe_convert_block_hash for digests (bytes
    or memoryviews), checked against it: with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    (vLLM's default) the low 64 bits, big-endian, read from the last 8 bytes
    (vLLM reads the environment on every call, ~5 us); else vLLM's own."""
    sample = bytes(range(1, 33))
    want = maybe_convert(sample)
    if not isinstance(want, int):
        return lambda d: maybe_convert(bytes(d))

    def conv(d: Any) -> int:
        return int.from_bytes(d[-8:], "big")

    if conv(sample) != want or conv(memoryview(sample)) != want:  # pragma: no cover - a vLLM that converts otherwise
        return lambda d: maybe_convert(bytes(d))
    conv.fast = True  # type: ignore[attr-defined] - KVEvents inlines it
    return conv
