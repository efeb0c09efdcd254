"""The sidecar's tier in vLLM's own KV event stream (docs/architecture.md,
"KV events for routers").

Two halves, both on the scheduler side:

- :meth:`KVEvents.describe` sends, with the step's planned stores, a
  Describe record of their blocks: each run's parent digest (the block
  before it in the request's chain), the token ids, and the LoRA adapter.
  The sidecar keeps them as long as the blocks (protocol.md, section 5.11).
- :meth:`KVEvents.take_events` (the connector's take_events hook, called by
  vLLM once a step after its output) follows the sidecar's event log with a
  :class:`ringside.events.EventFeed` and returns vLLM's own
  ``BlockStored`` / ``BlockRemoved`` objects for the CPU tier, which vLLM
  publishes in the same batch, ZMQ stream and replay buffer as its GPU
  events. Never ``AllBlocksCleared``: that clears every tier of the pod.

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

import logging
import struct
import time
from array import array
from typing import Any, Callable, Optional

from .. import schema as _s
from ..client import Session
from ..events import EventFeed
from ..plugin.faults import SIDECAR_ERRORS, Faults
from ..schema import DESCRIBE, DESCRIBE_FLAG_PARENT, DESCRIBE_RUN, NATIVE_U32, TYPE_DESCRIBE

logger = logging.getLogger("ringside.vllm")

_I64 = struct.Struct("<q")
# Store runs noted before a Describe is sent at once (else once a poll).
MAX_NOTED = 2048
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
        # _fast: the conversion is the low 64 bits, big-endian (vLLM's default), inlined in _stored.
        self._conv, self._fast = external_hash(maybe_convert_block_hash)
        self._last: Any = None  # the last BlockStored of self.out (a chain to extend)
        self._last_digest: Any = None  # the digest of its last block
        self._last_removed: Any = None  # the last BlockRemoved of self.out (withdrawals to extend)
        lead = lead_group(layout) if layout is not None and not layout.plain else None
        self.gid = lead.gid if lead is not None else 0
        self.block_size = lead.block_size if lead is not None else block_size
        self.kind, self.window = group_spec(kv_cache_config, self.gid)
        self.stats: dict = {"described_blocks": 0}  # the scheduler side's counters, once bound
        self.poll_s = cfg.kv_events_poll_ms / 1000.0
        self.timeout = cfg.timeout
        self.out: list = []  # events for the next take_events
        self.noted: list = []  # store runs (request, first, end) not described yet
        self.noted_blocks = 0
        self.due = False
        self.flush_t = 0.0
        self.recent: set = set()  # the last blocks of runs described lately (see note)
        self.recent_old: set = set()
        self.recent_t = time.monotonic()
        self.feed = EventFeed(self._stored, self._removed, 32, cfg.mirror_max_blocks, cfg.timeout)
        self._lora: dict = {}  # extra bytes -> (lora_id, lora_name)

    # -- the step's stores ------------------------------------------------------

    def note(self, runs: list) -> None:
        """Keep a step's planned store runs, described at the next poll
        (take_events): one Describe record for the steps of a poll interval.
        A run holds its request (block hashes and token ids only grow), for
        at most one interval; past MAX_NOTED blocks they are sent at once."""
        # A run whose last block this engine described lately is skipped:
        # the sidecar keeps the first description of a block, and every
        # request that shares a prefix stores (and would describe) its
        # blocks again. "Lately" is one to two RECENT_S (the two sets below),
        # well within the sidecar's wait for a description's block
        # (--write-timeout), and a block withdrawn (evicted) is forgotten at
        # once: stored again, it is described again.
        recent, old = self.recent, self.recent_old
        noted = self.noted
        for run in runs:
            last = run[0].block_hashes[run[2] - 1]
            if last in recent or last in old:
                continue
            recent.add(last)
            noted.append(run)
            self.noted_blocks += run[2] - run[1]
        if self.noted_blocks >= MAX_NOTED:
            self.due = True

    def describe(self, s: Session, runs: list[tuple[Any, int, int]], max_payload: int) -> None:
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
                parts[0] = DESCRIBE.pack(nruns, 0)
                send(TYPE_DESCRIBE, b"".join(parts), wake=False)
                parts, nruns, blocks, size = [], 0, 0, 8
            if not parts:
                parts.append(b"")
            tk = toks[a * bs : b * bs]
            tb = array("I", tk).tobytes() if NATIVE_U32 else struct.pack("<%dI" % len(tk), *tk)
            if a > 0:
                parts.append(DESCRIBE_RUN.pack(n, bs, len(extra), DESCRIBE_FLAG_PARENT))
                parts.append(hashes[a - 1])
            else:
                parts.append(DESCRIBE_RUN.pack(n, bs, len(extra), 0))
            parts.append(hashes[a] if n == 1 else b"".join(hashes[a:b]))
            parts.append(tb)
            if extra:
                parts.append(extra)
            nruns += 1
            blocks += n
            size += rsize
        if nruns:
            parts[0] = DESCRIBE.pack(nruns, 0)
            send(TYPE_DESCRIBE, b"".join(parts), wake=False)
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
        feed = self.feed

        def take_events():
            evs = orig()
            if evs:
                for e in evs:
                    if type(e) is AllBlocksCleared:
                        feed.forget_all()
                        break
            return evs

        take_events._ringside = True  # type: ignore[attr-defined]
        kv_cache_manager.take_events = take_events

    def start(self, s: Optional[Session], faults: Faults) -> None:
        """Read the sidecar's described blocks now, while the engine starts
        (bounded by the session timeout, 2 s at most): the first step then
        publishes them."""
        if s is not None:
            try:
                self.feed.pump(s, int(min(self.timeout, 2.0) * 1e9))
            except SIDECAR_ERRORS as e:
                faults.fail(e, "KV events")

    def flush(self, s: Optional[Session], faults: Faults) -> None:
        """Describe the runs noted since the last flush."""
        runs, self.noted, self.noted_blocks, self.due = self.noted, [], 0, False
        if runs and s is not None:
            try:
                self.describe(s, runs, s.max_payload)
            except SIDECAR_ERRORS as e:
                faults.fail(e, "describe")

    def take_events(self, s: Optional[Session], faults: Faults) -> list:
        """The events of the sidecar's tier since the last call: collect the
        last request's reply and send the next one, never waiting: a poll of
        its event log at most every kv_events_poll_ms, or, while a snapshot
        is read (a new session, after AllBlocksCleared), its next page."""
        feed = self.feed
        now = time.monotonic()
        if now - self.recent_t >= RECENT_S:
            self.recent_old, self.recent, self.recent_t = self.recent, set(), now
        if self.noted and (self.due or now - self.flush_t >= self.poll_s):
            self.flush_t = now
            self.flush(s, faults)
        if s is not None and not (feed.disabled and feed.session is s):
            try:
                if feed.state != EventFeed.LIVE or feed.session is not s:
                    feed.pump(s)
                elif feed.pending or not feed.caught_up or now - feed.sent_t >= self.poll_s:
                    feed.pump(s)
            except SIDECAR_ERRORS as e:
                faults.fail(e, "KV events")
        out = self.out
        if out:
            self.out = []
            self._last = self._last_removed = None
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
        if NATIVE_U32:
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
            and self.out[-1] is last
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
            self.out.append(last)
            self._last = last
        self._last_digest = digests[-1]

    def _removed(self, digest: bytes) -> None:
        # Withdrawals in a row: one BlockRemoved of their hashes.
        self.recent.discard(digest)
        self.recent_old.discard(digest)
        h = self._conv(digest)
        out = self.out
        if out and out[-1] is self._last_removed:
            self._last_removed.block_hashes.append(h)
        else:
            ev = self._removed_cls(block_hashes=[h], medium=self._medium, group_idx=self.gid)
            out.append(ev)
            self._last_removed = ev
        self._last = None


def external_hash(maybe_convert: Callable[[bytes], Any]) -> tuple[Callable[[Any], Any], bool]:
    """A fast equivalent of vLLM's maybe_convert_block_hash for digests (bytes
    or memoryviews), checked against it, and whether it is the fast one:
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (vLLM's default) the low 64
    bits, big-endian, read from the last 8 bytes (vLLM reads the environment
    on every call, ~5 us); else vLLM's own."""
    sample = bytes(range(1, 33))

    def slow(d: Any) -> Any:
        return maybe_convert(bytes(d))

    want = maybe_convert(sample)
    if not isinstance(want, int):
        return slow, False

    def conv(d: Any) -> int:
        return int.from_bytes(d[-8:], "big")

    if conv(sample) != want or conv(memoryview(sample)) != want:  # pragma: no cover - a vLLM that converts otherwise
        return slow, False
    return conv, True
