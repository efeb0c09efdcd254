"""vLLM KV connector backed by the ringside sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "RingsideConnector",
                           "kv_connector_module_path": "ringside.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/dev/shm/ringside/ringside.sock"}}'

or, once the package is installed, through its ``vllm.general_plugins`` entry
point, which registers the name ``RingsideConnector`` with vLLM's connector
factory (then ``kv_connector_module_path`` can be left out).

How it works
------------
Scheduler (EngineCore process): attaches to the sidecar as the scheduler of
this engine instance and keeps a local index of the digests the sidecar holds
for its namespace (``mirror.py``: a snapshot copied once, then the change log,
polled once a step without waking the sidecar). A request that arrives while
the engine is busy is looked up in that index (a set probe a block, no round
trip), unless its first miss is a block this engine sent for storing lately
(the index may not have polled it in yet: the sidecar is asked). After an
idle gap the first arrival brings the index up to date with one Changes poll
(waited for within the step's ``max_wait_us``) and the burst is looked up
there. If that poll is not answered in time, or while the index is not live, the request's own
block hashes (``request.block_hashes``: vLLM's digests, joined once, never
converted one by one) are registered as a hash batch and looked up in the
sidecar as they arrive (``on_new_request``, without waiting);
``get_num_new_matched_tokens`` collects the answer. Either way a hit is
answered with an asynchronous load. After allocation it sends
an acquire of a lease on those blocks, collected when the step's metadata is
built; while the lease waits for the sidecar's load budget it polls (a few
bytes a step, collected the next step). Each step it sends the workers the
loads that are ready and the blocks that become full during the step, with
their digests (a cursor per request; a decoding request is looked at only in
the step in which its next block can fill: no walk over all requests or the
cache). Records whose answer is not needed at once are published without
waking the sidecar (a futex wake is a system call); the next wait wakes it.

Worker (each rank): attaches as a worker of the same instance, registers the
KV cache tensors (host memory by pid and address; CUDA IPC for GPU tensors),
starts loads before the forward pass (the request waits in
WAITING_FOR_REMOTE_KVS meanwhile), and stores the step's newly full blocks in
``wait_for_save``, i.e. after the forward pass that wrote them has finished:
it registers the step's digests as a batch of its own and stores from it,
then waits for the copies (bounded) at the start of the next step
(``handle_preemptions``, before vLLM can write any block), so that no block
is rewritten while it is being copied and the copies overlap with vLLM's
output processing and scheduling.

Nothing here may fail or hang a request: every sidecar call has a deadline,
every error is a miss (0 matched tokens) or a load error that vLLM recomputes
(the connector sets ``kv_load_failure_policy`` to ``recompute``). Without a
sidecar, or after it dies, the engine keeps serving and the connector
re-attaches in the background (at most once per ``reattach_interval``).

Extra config keys (``kv_connector_extra_config``): ``socket``, ``timeout``
(seconds per call, default 2), ``lease_ttl`` (seconds, default 30),
``save_timeout`` and ``load_timeout`` (seconds, default 5), ``reattach_interval`` (default 5),
``tenant`` (tenant salt), ``max_wait_us`` (the most the scheduler waits for
the sidecar in one step, default 100), ``sync_saves`` (wait for stores in
``wait_for_save``), ``overlap_saves`` (let a step's stores run on through
the next forward pass when no block they read can have been handed to
another request: "auto", the default, for GPU memory only; true; false),
``mirror`` (the local index, default true), ``mirror_max_blocks`` (default
4,000,000, ~110 bytes a block; a larger namespace turns the index off),
``mirror_idle_ms`` (default 5: an arrival when no request is in flight and
no step ended for longer asks the sidecar), ``mirror_poll_ms`` (default 50: the change log is polled in a step
that follows arrivals, else this often), ``mirror_max_lag_ms`` (default 1000:
an index whose last answered poll is older is not used), ``mirror_sync_us`` (time a step may wait while the snapshot is
copied, default 500), ``stats_path`` (write connector counters as JSON at
shutdown and every ``stats_every`` steps, for tests and operators).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import schema as _s
from .client import Link, RingsideError, RingsideTimeout, Session
from .mirror import Mirror

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("ringside.vllm")

DEFAULT_SOCKET = "/dev/shm/ringside/ringside.sock"
# Hot-path record layouts (schema.py's, without its argument checks: the
# values here are built by this module).
_PUT_HASHES = struct.Struct("<QII")  # batch, count, flags; the digests follow
_REPLY = struct.Struct("<IIQ")  # status, zero, value; a message may follow
_LOOKUP_REPLACE = _s.FLAG_LOOKUP | _s.FLAG_REPLACE
# Finished requests' batch ids kept for reuse (FlagReplace) at most; more are
# dropped.
_MAX_FREE_BATCHES = 4096
_monotonic = time.monotonic
REGION_ID = 1
_NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


# --------------------------------------------------------------------------
# Metadata: what the scheduler tells the workers each step.


@dataclass
class LoadSpec:
    req_id: str
    lease: int
    block_ids: list[int]  # engine blocks to fill from the lease's blocks 0..n-1
    error_block_ids: list[int]  # promised blocks the lease could not cover


@dataclass
class RingsideConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # The blocks that become full in this step, of every request together:
    # store_digests[i] holds vLLM's hashes (joined) of a run of blocks whose
    # engine block ids come next in store_block_ids, in the same order.
    store_digests: list[bytes] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    # The previous step's stores must be complete before this step's forward
    # pass: a request whose blocks they read finished or was preempted since,
    # so those blocks may be handed to another request now. Otherwise the
    # workers leave them running one more step (never longer).
    wait_saves: bool = True


# --------------------------------------------------------------------------
# Shared helpers.


def _namespace(vllm_config: "VllmConfig") -> tuple[str, str, int]:
    """(model, layout fingerprint, world size): everything that changes the
    bytes of a block, so that two engines share blocks only when the bytes
    mean the same thing."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
    model = str(getattr(mc, "model", "")) + "@" + str(getattr(mc, "revision", None) or "")
    parts = {
        "dtype": str(getattr(mc, "dtype", "")),
        "kv_dtype": str(getattr(cc, "cache_dtype", "")),
        "block": int(cc.block_size),
        "hash": algo,
        "layers": _safe(lambda: mc.get_num_layers(pc)),
        "kv_heads": _safe(lambda: mc.get_num_kv_heads(pc)),
        "head": _safe(lambda: mc.get_head_size()),
        "tp": int(pc.tensor_parallel_size),
        "pp": int(pc.pipeline_parallel_size),
        "device": str(getattr(vllm_config.device_config, "device_type", "")),
    }
    layout = ";".join("%s=%s" % kv for kv in sorted(parts.items()))
    # Every tensor- and pipeline-parallel worker holds its own shard of a
    # block: a block is present only when all of them stored theirs.
    return model, layout, int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def _safe(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a fingerprint part that cannot be read is left out
        return "?"


def _hash_seed_warning(vllm_config: "VllmConfig") -> Optional[str]:
    """The setting that makes vLLM's block hashes differ across restarts."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in _NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        return ("prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM seeds its block hashes "
                "randomly per process, so blocks stored by one engine process are never hits for "
                "another (or after a restart). Set PYTHONHASHSEED to the same value on every engine, "
                "or use sha256 / sha256_cbor." % algo)
    return None


# --------------------------------------------------------------------------
# The connector.


class _Req:
    """Scheduler-side state of one request."""

    __slots__ = ("request", "batch", "generation", "registered", "stored", "lookup_seq", "lookup_count",
                 "load", "hit_tokens", "due", "looked", "hits", "allocated", "lookup_t", "store_step")

    def __init__(self, request: Any, batch: int, generation: int):
        self.request = request
        self.batch = batch  # hash batch for lookups and acquires (this link generation)
        self.generation = generation  # link generation the batch was registered in
        self.registered = 0  # hashes registered in the batch
        self.stored = 0  # cursor: blocks [0, stored) were sent for storing (or loaded)
        self.lookup_seq = 0  # a lookup submitted ahead (on_new_request), not yet collected
        self.lookup_count = 0
        self.load: Optional[dict] = None  # pending load: lease, state, ids
        self.hit_tokens = 0
        self.due = 0  # scheduler step of its next store check (0: none planned)
        self.looked = 0  # blocks the last collected lookup asked about
        self.hits = 0  # and its answer
        self.allocated = False  # vLLM allocated blocks for it (update_state_after_alloc)
        self.lookup_t = 0.0  # when the lookup was sent (time.monotonic)
        self.store_step = 0  # the last step that planned a store of its blocks


class RingsideConnector(KVConnectorBase_V1):
    """KV connector whose cache lives in a ringside sidecar."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is only a future miss

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM versions whose base class takes (vllm_config, role)
            super().__init__(vllm_config, role)  # type: ignore[call-arg]
        kvt = vllm_config.kv_transfer_config
        extra = dict(kvt.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.socket = str(extra.get("socket", os.environ.get("RINGSIDE_SOCKET", DEFAULT_SOCKET)))
        self.timeout = float(extra.get("timeout", 2.0))
        self.lease_ttl = float(extra.get("lease_ttl", 30.0))
        self.save_timeout = float(extra.get("save_timeout", 5.0))
        self.load_timeout = float(extra.get("load_timeout", 5.0))
        self.stats_path = extra.get("stats_path")
        self.stats_every = int(extra.get("stats_every", 50))
        model, layout, world = _namespace(vllm_config)
        self.instance = str(getattr(kvt, "engine_id", None) or extra.get("instance") or "vllm-%d" % os.getppid())
        attach = dict(instance=self.instance, model=model, layout=layout, salt=str(extra.get("tenant", "")),
                      world_size=world, digest_width=32)
        self.stats = {"role": role.name, "lookups": 0, "lookup_blocks": 0, "hit_blocks": 0, "loads": 0,
                      "loaded_blocks": 0, "load_error_blocks": 0, "stores": 0, "stored_blocks": 0,
                      "present_blocks": 0, "store_errors": 0, "sidecar_errors": 0, "steps": 0, "resumed": 0,
                      "deferred_lookups": 0, "batches_reused": 0, "saves_unwaited": 0, "planned_stores": 0, "planned_blocks": 0,
                      "step_ns_total": 0, "step_ns_max": 0, "mirror_lookups": 0, "mirror_hit_blocks": 0,
                      "mirror_catchups": 0}
        self._steps_since_stats = 0
        if getattr(kvt, "kv_load_failure_policy", "recompute") != "recompute":
            # A cache failure must never fail a request: recompute instead.
            try:
                kvt.kv_load_failure_policy = "recompute"
                logger.info("ringside: kv_load_failure_policy set to 'recompute'")
            except Exception:  # noqa: BLE001
                logger.warning("ringside: could not set kv_load_failure_policy=recompute; set it in "
                               "--kv-transfer-config so that a cache failure never fails a request")
        if role == KVConnectorRole.SCHEDULER:
            warn = _hash_seed_warning(vllm_config)
            if warn:
                logger.warning("ringside: %s", warn)
            self.link = Link(self.socket, self.timeout, float(extra.get("reattach_interval", 5.0)),
                             dict(attach, role=_s.ROLE_SCHEDULER, rank=0))
            self._reqs: dict[str, _Req] = {}
            self._next_batch = 0
            self._free_batches: list[int] = []  # ids of finished requests' batches (see _batch_id)
            self._free_gen = -1  # the link generation they belong to
            self._waiting_loads: dict[str, _Req] = {}
            # Store planning (build_connector_meta): requests that may advance
            # by more than one token a step (prefill chunks, resumed after a
            # preemption) are checked every step they are scheduled; decoding
            # ones advance one token a step and are checked only in the step
            # in which their next block can fill (a calendar of steps).
            self._step = 0
            self._watch: set[str] = set()
            self._due: dict[int, list[str]] = {}
            # Speculative decoding schedules several tokens a step: check
            # every scheduled request every step instead.
            self._every_step = getattr(vllm_config, "speculative_config", None) is not None
            self._ttl_ms = max(1, int(self.lease_ttl * 1000))
            # The most the scheduler waits for sidecar replies in one step, in
            # total. Past it an unanswered lookup makes vLLM ask again next
            # step (None) and an unanswered acquire is collected next step: a
            # slow sidecar delays a hit by a step, never the whole engine.
            self.max_wait_ns = int(float(extra.get("max_wait_us", 100)) * 1000)
            self._wait_left_ns = self.max_wait_ns
            self._woke = False  # an arrival woke the sidecar in this step (on_new_request)
            self._saves_exposed = False  # a request with stores in flight finished (see wait_saves)
            self._orphans: list[tuple[int, float]] = []  # acquires of finished requests, unanswered
            self._req_to_blocks: Any = False  # resolved at the first step (see _single_group_blocks)
            # Only full attention keeps every block of a live request until
            # it finishes or is preempted (sliding windows free old blocks).
            self._full_attention: Optional[bool] = None
            self._group_ids: Optional[tuple] = None
            self._legacy: dict[str, list[int]] = {}  # block ids, for vLLM without kv_connector_block_state
            # The local index of the cache (mirror.py): lookups are answered
            # from it, with no sidecar round trip, while the engine is busy
            # (requests in flight, or a step ended in the last
            # mirror_idle_ms), and after an idle gap once one poll has
            # brought it up to date (_caught_up). The sidecar is asked when
            # that poll is late, when a request's first miss is one of this
            # engine's own recent stores, and while the index is off or not
            # synced yet.
            self.mirror: Optional[Mirror] = None
            self._mine: Optional[set] = None  # the mirror's `mine` while planning stores
            if _truthy(extra.get("mirror", True)):
                self.mirror = Mirror(32, int(extra.get("mirror_max_blocks", 4_000_000)), self.timeout,
                                     float(extra.get("mirror_max_lag_ms", 1000)) / 1000.0)
            self._idle_s = float(extra.get("mirror_idle_ms", 5)) / 1000.0
            # The change log is polled in a step that follows arrivals (the
            # index is used), else every mirror_poll_ms while the engine runs.
            self._poll_s = float(extra.get("mirror_poll_ms", 50)) / 1000.0
            self._arrived = False
            self._sync_budget_ns = int(float(extra.get("mirror_sync_us", 500)) * 1000)
            self._out_t = 0.0  # when vLLM last took a step's output (take_events, update_connector_output)
            if self.mirror is not None:
                # Copy the index now, while the engine starts (bounded).
                s = self.link.get()
                if s is not None:
                    try:
                        self.mirror.pump(s, int(min(self.timeout, 2.0) * 1e9))
                    except (RingsideError, _s.SchemaError) as e:
                        self._fail(e)
        else:
            rank = _tp_rank()
            self._rank = rank
            self._wbatch = 0
            # Stores sent by wait_for_save, awaited at the start of the next
            # step (handle_preemptions) instead of blocking the step that
            # sent them; synchronous where vLLM has no such hook.
            self._saving: list = []
            self._deferred_saves = "handle_preemptions" in vars(KVConnectorBase_V1) and \
                not extra.get("sync_saves", False)
            # Stores running on through the next forward pass: "auto" (GPU
            # memory only), true or false. See _overlap_saves.
            self._overlap = extra.get("overlap_saves", "auto")
            self.link = Link(self.socket, self.timeout, float(extra.get("reattach_interval", 5.0)),
                             dict(attach, role=_s.ROLE_WORKER, rank=rank))
            self.mirror = None
            self.region: Optional[dict] = None
            self._region_gen = -1
            self._inflight: dict[str, list] = {}  # req_id -> [(seq, spec)]
            self._finished_recving: set[str] = set()
            self._load_errors: set[int] = set()
        logger.info("ringside: %s connector for instance %s (%s, %s)", role.name.lower(), self.instance, model, layout)

    # ------------------------------------------------------------------
    # Scheduler side
    #
    # Cost model: the scheduler never waits for the sidecar except for a
    # reply it needs in the same call (a lookup's hit count, an acquire's
    # lease when the step's loads are sent). Everything else is published
    # without waking the sidecar (Session.submit/send with wake=False) and
    # handled in order when the next wait wakes it. Stores need no scheduler
    # round trip at all: the step's metadata carries the digests of the blocks
    # to store, and each worker registers them in its own batch.

    def _session(self) -> Optional[Session]:
        return self.link.get()

    def _fail(self, err: Exception) -> None:
        self.stats["sidecar_errors"] += 1
        from .client import RingsideTimeout, RingsideUnavailable

        if isinstance(err, (RingsideUnavailable, RingsideTimeout)):
            self.link.drop(err)
        else:
            logger.debug("ringside: %s", err)

    # A request may load at most min(len(block_hashes), (num_tokens - 1) //
    # block_size) blocks: at least one token is left to compute (vLLM needs
    # a forward pass). Inlined in the hooks below.

    def _req(self, request: "Request") -> _Req:
        """The request's state in the current link generation."""
        rid = request.request_id
        r = self._reqs.get(rid)
        gen = self.link.generation
        if r is None or r.generation != gen:
            old = r
            r = _Req(request, self._batch_id(gen), gen)
            if old is not None:  # a new sidecar session: keep the cursor
                r.stored = old.stored
            self._reqs[rid] = r
        return r

    def _batch_id(self, gen: int) -> int:
        """A batch id for a request: one a finished request left in this
        session (re-registered with FlagReplace, so finishing a request
        sends no DropHashes), else a new one."""
        free = self._free_batches
        if free and self._free_gen == gen:
            self.stats["batches_reused"] += 1
            return free.pop()
        self._next_batch += 1
        return self._next_batch

    def _recycle(self, r: _Req, s: Session) -> None:
        """A finished request's batch: kept registered for the next request
        (up to _MAX_FREE_BATCHES), else dropped."""
        free = self._free_batches
        if self._free_gen != r.generation:
            free.clear()
            self._free_gen = r.generation
        if len(free) < _MAX_FREE_BATCHES:
            free.append(r.batch)
        else:
            s.send(_s.TYPE_DROP_HASHES, _s.encode_drop_hashes(r.batch), wake=False)

    def _put_hashes(self, r: _Req, s: Session, upto: int, first_flags: int = _s.FLAG_REPLACE) -> None:
        """Register the request's hashes [registered, upto) in its batch,
        without waiting (the lookup or acquire that follows on this session is
        handled after it; a failed put shows up as a miss there)."""
        if upto <= r.registered:
            return
        hashes = r.request.block_hashes
        for a in range(r.registered, upto, _s.MAX_HASHES_PER_RECORD):
            new = b"".join(hashes[a:min(upto, a + _s.MAX_HASHES_PER_RECORD)])
            s.send(_s.TYPE_PUT_HASHES, _s.encode_put_hashes(r.batch, new, 32, _s.FLAG_APPEND if a else first_flags),
                   wake=False)
        r.registered = upto

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
        m = self.mirror
        if m is not None and m.state == Mirror.LIVE:
            now = _monotonic()
            try:
                if (m.fresh(now, s) if self._reqs or now - self._out_t < self._idle_s
                        else self._caught_up(m, s, now)):
                    self._arrived = True
                    return  # looked up in the local index when vLLM asks
            except (RingsideError, _s.SchemaError) as e:
                self._fail(e)
                return
        try:
            r = self._req(request)
            if r.registered == 0:
                # One record: register the blocks it may load and look them
                # up (FlagLookup: the reply is the number of leading hits;
                # FlagReplace: the id may be a finished request's).
                p = _PUT_HASHES.pack(r.batch, usable, _LOOKUP_REPLACE) + b"".join(hashes[:usable])
                # The first arrival of a step wakes the sidecar (if parked),
                # so that it answers while vLLM goes on to schedule; later
                # ones in the same step do not (a futex wake is a system
                # call, 25-40 us on a VM): the sidecar, once up, handles
                # every record published meanwhile in the same pass, and a
                # wait for a reply wakes it if it parked again.
                wake = not self._woke
                r.lookup_seq = s.submit(_s.TYPE_PUT_HASHES, p, wake=wake)
                self._woke = True
                r.lookup_t = _monotonic()
                r.registered = r.lookup_count = usable
        except (RingsideError, _s.SchemaError) as e:
            self._fail(e)

    def _caught_up(self, m: Mirror, s: Session, now: float) -> bool:
        """After an idle gap (no request in flight, no step for mirror_idle_ms)
        the index may lag: whether a Changes poll sent since the engine went
        idle (or in the last mirror_idle_ms) has been answered with the log's
        head. If not, one is sent (waking the sidecar) and waited for within
        the step's max_wait_us budget. The first arrival of a burst pays that
        one round trip; the others are looked up in the index."""
        since = max(self._out_t, now - self._idle_s)
        if m.fresh_t >= since and m.fresh(now, s):
            return True
        for _ in range(2):  # collect a poll sent before the gap, then send one
            left = self._wait_left_ns
            t0 = time.perf_counter_ns()
            m.pump(s, max(left, 0), wake=True)
            if left > 0:
                self._wait_left_ns = left - (time.perf_counter_ns() - t0)
            if m.fresh_t >= since and m.fresh(_monotonic(), s):
                self.stats["mirror_catchups"] += 1
                return True
        return False

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
            r = self._req(request)
            seq = r.lookup_seq
            value = -1
            if seq:
                payload = self._reply(s, seq)
                if payload is None:
                    if _monotonic() - r.lookup_t < self.timeout:
                        self.stats["deferred_lookups"] += 1
                        return None, False  # not answered yet: vLLM asks again next step
                    r.lookup_seq = 0
                    s.forget(seq)
                    raise RingsideTimeout("lookup of %s got no reply in %.1fs" % (request.request_id, self.timeout))
                r.lookup_seq = 0
                if len(payload) < 16:
                    raise _s.SchemaError("Reply: %d bytes, want at least 16" % len(payload))
                status, _, value = _REPLY.unpack_from(payload, 0)
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
                m = self.mirror
                hits = -1
                if m is not None and m.fresh(_monotonic(), s):
                    self._arrived = True
                    # -1: the first miss is a block this engine stored
                    # lately, perhaps not in the index yet: ask the sidecar.
                    hits = m.answer(hashes, usable)
                    if hits >= 0:
                        st = self.stats
                        st["mirror_lookups"] += 1
                        st["mirror_hit_blocks"] += hits
                if hits < 0:
                    self._put_hashes(r, s, usable)
                    hits = s.lookup(r.batch, 0, usable)
        except (RingsideError, _s.SchemaError) as e:
            self._fail(e)
            return 0, False
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

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        r = self._reqs.get(request.request_id)
        if r is None:
            r = self._req(request)  # tracked for its stores even without a sidecar
        r.allocated = True
        if num_external_tokens <= 0:
            return
        start = (r.hit_tokens - num_external_tokens) // self.block_size
        count = num_external_tokens // self.block_size
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        want = ids[start:start + count]  # vLLM passes all of the request's blocks
        # Blocks that come from the sidecar need no storing back.
        r.stored = max(r.stored, start + count)
        load = {"lease": 0, "state": _s.State.MISS, "block_ids": want, "seq": 0, "poll": 0}
        r.load = load
        s = self.link.session
        if s is not None and r.generation == self.link.generation:
            # Submitted now, collected in build_connector_meta: the step's
            # acquires are answered together, while the scheduler works.
            try:
                if r.registered < start + count:
                    # Looked up in the local index: register the blocks to
                    # acquire (with FlagLookup, so that the sidecar's lookup
                    # and hit counters see the hit; its reply is dropped).
                    self._put_hashes(r, s, start + count, _LOOKUP_REPLACE)
                load["seq"] = s.submit(_s.TYPE_ACQUIRE, _s.encode_acquire(r.batch, start, count, self._ttl_ms),
                                       wake=False)
                load["gen"] = self.link.generation
                load["t"] = time.monotonic()
            except RingsideError as e:
                self._fail(e)
        self._waiting_loads[request.request_id] = r

    def _reply(self, s: Session, seq: int) -> Optional[bytes]:
        """The reply to seq if it is there or arrives within what is left of
        this step's wait budget, else None (seq stays collectable)."""
        p = s.try_reply(seq)
        if p is not None:
            return p
        left = self._wait_left_ns
        if left <= 0:
            s.kick()
            return None
        t0 = time.perf_counter_ns()
        p = s.await_reply(seq, timeout=left / 1e9, keep=True)
        self._wait_left_ns = left - (time.perf_counter_ns() - t0)
        return p

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # vLLM asks for every request with a hit; the answer never changes.
        g = self._group_ids
        if g is None:
            g = self._group_ids = tuple(super().get_loaded_kv_cache_group_ids(request))
        return g

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        t0 = time.perf_counter_ns()
        meta = RingsideConnectorMetadata()
        s = self.link.session
        if s is not None:
            try:
                # Let the sidecar answer this step's acquires while the
                # stores are planned (releases and drops alone need no
                # prompt wake). Every reply the scheduler waits for is read
                # (with whatever arrived before it) when it is collected;
                # stray ones (failed fire-and-forget sends) are consumed
                # every 32 steps, so that the completion ring never fills.
                if self._waiting_loads:
                    s.kick()
                if not self._step & 31:
                    s.drain()
            except RingsideError as e:
                self._fail(e)
                s = None
        # The stores planned last step may still be copying: the workers
        # must wait for them only if their blocks can be reused now.
        if self._full_attention is None:
            self._full_attention = _full_attention_only(getattr(self, "_kv_cache_manager", None))
        pre = getattr(scheduler_output, "preempted_req_ids", None)
        meta.wait_saves = self._saves_exposed or pre is None or bool(pre) or not self._full_attention
        if pre:
            # A preempted request lost its blocks: when vLLM asks about it
            # again it is looked up afresh (its own blocks stored meanwhile
            # are hits), and that answer serves while it waits for blocks.
            reqs = self._reqs
            for rid in pre:
                r = reqs.get(rid)
                if r is not None:
                    r.allocated, r.looked = False, 0
        self._saves_exposed = False
        self._step += 1
        m = self.mirror  # the planned stores' digests are noted as the engine's own (read your writes)
        self._mine = m.noting(_monotonic()) if m is not None and not m.disabled else None
        self._plan_stores(meta, scheduler_output)
        if s is not None and s is not self.link.session:
            s = None
        if self._waiting_loads:
            self._collect_loads(meta, s)
        if self._orphans:
            self._release_orphans(s)
        self._wait_left_ns = self.max_wait_ns  # the next step's budget
        self._woke = False
        dt = time.perf_counter_ns() - t0
        st = self.stats
        st["steps"] += 1
        st["step_ns_total"] += dt
        st["step_ns_max"] = max(st["step_ns_max"], dt)
        if self.stats_path:
            self._maybe_write_stats()
        return meta

    def _collect_loads(self, meta: RingsideConnectorMetadata, s: Optional[Session]) -> None:
        """Send every waiting load whose lease is ready (or failed: the worker
        reports its blocks as load errors and vLLM recomputes them)."""
        gen = self.link.generation
        for rid in list(self._waiting_loads):
            r = self._waiting_loads[rid]
            ld = r.load
            if ld is None:
                del self._waiting_loads[rid]
                continue
            live = s is not None and ld.get("gen") == gen
            try:
                if ld["seq"]:
                    payload = self._reply(s, ld["seq"]) if live else b""
                    if payload is None:
                        if time.monotonic() - ld["t"] < self.timeout:
                            continue  # collected next step; the request keeps waiting for its load
                        s.forget(ld["seq"])
                        payload = b""
                        self._fail(RingsideTimeout("acquire for %s got no reply in %.1fs" % (rid, self.timeout)))
                        s = self.link.session
                    ld["seq"] = 0
                    ld["state"] = _s.State.MISS
                    lr = _s.decode_lease_reply(payload) if payload else None
                    if lr is not None and lr.status == _s.Status.OK:
                        ld["lease"], ld["state"], ld["blocks"] = lr.lease, lr.state, lr.blocks
                elif ld["poll"]:
                    # Waiting for the load budget: the poll sent last step.
                    payload = s.try_reply(ld["poll"]) if live else b""
                    if payload is None:
                        if time.monotonic() - ld["t"] < self.timeout:
                            s.kick()
                            continue
                        s.forget(ld["poll"])  # a sidecar that stopped answering: a miss
                        payload = b""
                        self._fail(RingsideTimeout("poll for %s got no reply in %.1fs" % (rid, self.timeout)))
                        s = self.link.session
                    ld["poll"] = 0
                    lr = _s.decode_lease_reply(payload) if payload else None
                    ld["state"] = lr.state if lr is not None and lr.status == _s.Status.OK else _s.State.MISS
                if ld["state"] == _s.State.WAITING:
                    if live and s is not None:
                        ld["poll"] = s.submit(_s.TYPE_POLL, _s.encode_poll(ld["lease"]), wake=False)
                        ld["t"] = time.monotonic()
                        continue
                    ld["state"] = _s.State.MISS
            except (RingsideError, _s.SchemaError) as e:
                self._fail(e)
                s = None
                ld["state"] = _s.State.MISS
            ids = ld["block_ids"]
            ok = ld["state"] in (_s.State.READY, _s.State.LOADED, _s.State.LOADING)
            n = min(ld.get("blocks", 0), len(ids)) if ok else 0
            meta.loads.append(LoadSpec(rid, ld["lease"] if n else 0, ids[:n], ids[n:]))
            del self._waiting_loads[rid]

    def _release_orphans(self, s: Optional[Session]) -> None:
        """Release the leases of acquires whose requests finished before the
        reply came (a lease left alone would pin its blocks until its TTL)."""
        keep = []
        for seq, t in self._orphans:
            if s is None:
                break  # the session is gone: the sidecar dropped its leases
            try:
                p = s.try_reply(seq)
                if p is None:
                    if time.monotonic() - t < self.timeout:
                        keep.append((seq, t))
                    else:
                        s.forget(seq)
                    continue
                lr = _s.decode_lease_reply(p)
                if lr.status == _s.Status.OK and lr.lease:
                    s.send(_s.TYPE_RELEASE, _s.encode_release(lr.lease), wake=False)
            except (RingsideError, _s.SchemaError) as e:
                self._fail(e)
                break
        self._orphans = keep

    def _plan_stores(self, meta: RingsideConnectorMetadata, so: "SchedulerOutput") -> None:
        """Per scheduled request, the blocks that become full in this step.

        Cost follows the requests that can fill a block this step, not all
        scheduled ones: new and resumed requests and prefill chunks are
        checked every step; a decoding request (one token a step) is checked
        again only in the step in which its next block can fill, or later if
        it was not scheduled (then it is checked and re-planned)."""
        state = getattr(so, "kv_connector_block_state", None)
        resolve = getattr(state, "resolve_block_ids", None)
        if self._req_to_blocks is False:
            self._req_to_blocks = _single_group_blocks(getattr(self, "_kv_cache_manager", None))
        nst = so.num_scheduled_tokens
        check = self._check_store
        if resolve is None or self._every_step:
            # vLLM without per-request block resolution, or speculative
            # decoding: check every scheduled request.
            if resolve is None:
                resolve = self._legacy_blocks(so)
            for rid in nst:
                check(rid, nst, resolve, meta)
        else:
            watch = self._watch
            for nr in so.scheduled_new_reqs:
                watch.add(nr.req_id)
            resumed = getattr(so.scheduled_cached_reqs, "resumed_req_ids", None)
            if resumed:
                watch.update(resumed)
                self.stats["resumed"] += len(resumed)
            step = self._step
            due = self._due.pop(step, None)
            if due:
                reqs = self._reqs
                for rid in due:
                    r = reqs.get(rid)
                    if r is not None and r.due == step and rid not in watch:
                        check(rid, nst, resolve, meta)
            if watch:
                for rid in list(watch):
                    check(rid, nst, resolve, meta)
        if meta.store_digests:
            st = self.stats
            st["planned_stores"] += len(meta.store_digests)
            st["planned_blocks"] += len(meta.store_block_ids)

    def _check_store(self, rid: str, nst: dict, resolve, meta: RingsideConnectorMetadata) -> None:
        r = self._reqs.get(rid)
        if r is None:
            self._watch.discard(rid)
            return
        req = r.request
        n = nst.get(rid, 0)
        done = req.num_computed_tokens + n  # tokens whose KV exists after this step
        bs = self.block_size
        hashes = req.block_hashes
        full = done // bs
        if full > len(hashes):
            full = len(hashes)
        a = r.stored
        if full > a:
            rtb = self._req_to_blocks
            if rtb is not None:  # the manager's own block list: no copy of the whole table
                blks = rtb.get(rid) or ()
                if full > len(blks):
                    full = len(blks)
                if full == a + 1:  # the common case: one block filled (decoding)
                    meta.store_block_ids.append(blks[a].block_id)
                elif full > a:
                    meta.store_block_ids.extend([b.block_id for b in blks[a:full]])
            else:
                try:
                    got = resolve(rid)
                except (KeyError, IndexError, AttributeError):  # no blocks (freed): nothing to store
                    got = None
                blocks = got[0] if got else ()
                if full > len(blocks):
                    full = len(blocks)
                if full > a:
                    meta.store_block_ids.extend(blocks[a:full])
            if full > a:
                if full == a + 1:
                    meta.store_digests.append(hashes[a])
                    if self._mine is not None:
                        self._mine.add(hashes[a])
                else:
                    meta.store_digests.append(b"".join(hashes[a:full]))
                    if self._mine is not None:
                        self._mine.update(hashes[a:full])
                r.stored = full
                r.store_step = self._step
        if self._every_step:
            return
        if n == 0 or done < req.num_tokens:
            # Not scheduled (preempted or skipped), or a prefill chunk: watch
            # it while it is scheduled; a preempted one comes back as resumed.
            if n == 0 and done < req.num_tokens:
                self._watch.discard(rid)
                r.due = 0
            else:
                self._watch.add(rid)
            return
        # Decoding: one token a step from here on. Its next block fills in the
        # step in which `done` reaches the block's end.
        self._watch.discard(rid)
        step = self._step + max(1, (r.stored + 1) * bs - done) if full >= done // bs else self._step + 1
        r.due = step
        d = self._due.get(step)
        if d is None:
            self._due[step] = [rid]
        else:
            d.append(rid)

    def _legacy_blocks(self, so: "SchedulerOutput"):
        """Block ids from the scheduler output's block lists, for vLLM
        versions without SchedulerOutput.kv_connector_block_state."""
        blocks = self._legacy
        for nr in so.scheduled_new_reqs:
            if nr.block_ids:
                blocks[nr.req_id] = list(nr.block_ids[0])
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if nb:
                if rid in resumed or rid not in blocks:
                    blocks[rid] = list(nb[0])
                else:
                    blocks[rid].extend(nb[0])
        return lambda rid: (blocks.get(rid, []),)

    def take_events(self):
        # vLLM calls this once a step, after the step's output: the local
        # index collects its last poll of the change log and sends the next
        # one (no wait, no wake), in a step that followed arrivals looked up
        # in it or mirror_poll_ms after the last poll; while it copies the
        # snapshot it may wait up to mirror_sync_us a step.
        now = self._out_t = _monotonic()
        m = self.mirror
        if m is not None and not m.disabled:
            s = self.link.session
            if s is not None:
                try:
                    if m.state != Mirror.LIVE:
                        m.pump(s, self._sync_budget_ns)
                    elif self._arrived or now - m.sent_t >= self._poll_s:
                        self._arrived = False
                        m.pump(s)
                except (RingsideError, _s.SchemaError) as e:
                    self._fail(e)
        return ()

    def update_connector_output(self, connector_output) -> None:
        self._out_t = _monotonic()
        rec = getattr(connector_output, "finished_recving", None) or ()
        if not rec:
            return
        s = self.link.session
        for rid in rec:
            r = self._reqs.get(rid)
            if r is None or r.load is None:
                continue
            lease = r.load.get("lease", 0)
            r.load = None
            if lease and s is not None and r.generation == self.link.generation:
                try:
                    s.send(_s.TYPE_RELEASE, _s.encode_release(lease), wake=False)
                except RingsideError as e:
                    self._fail(e)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        if self._legacy:
            self._legacy.pop(rid, None)
        r = self._reqs.pop(rid, None)
        if r is None:
            return False, None
        if r.store_step and r.store_step >= self._step:
            # Its blocks are freed now, and the last step's stores may still
            # be reading some of them.
            self._saves_exposed = True
        if r.load is not None:
            self._waiting_loads.pop(rid, None)
        self._watch.discard(rid)  # an entry in the calendar is skipped (no state)
        s = self.link.session
        if s is not None and r.generation == self.link.generation:
            try:
                if r.lookup_seq:  # looked up ahead, never asked for
                    s.forget(r.lookup_seq)
                ld = r.load
                if ld is not None:
                    if ld.get("seq"):  # acquired, never collected: release it once answered
                        self._orphans.append((ld["seq"], _monotonic()))
                    if ld.get("lease"):
                        s.send(_s.TYPE_RELEASE, _s.encode_release(ld["lease"]), wake=False)
                if r.registered:
                    self._recycle(r, s)
            except (RingsideError, _s.SchemaError) as e:
                self._fail(e)
        return False, None

    # ------------------------------------------------------------------
    # Worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.region = _describe_region(kv_caches)
        if self.region is None:
            return
        self._register()

    def _register(self) -> Optional[Session]:
        s = self.link.get()
        if s is None or self.region is None:
            return None
        if self._region_gen == self.link.generation:
            return s
        g = self.region
        # The sidecar copies this process's KV memory itself: allow it under
        # Yama ptrace_scope 1 (no capability needed in the sidecar).
        s.allow_sidecar_ptrace()
        try:
            s.register_region(REGION_ID, g["base"], g["length"], g["page_size"], g["page_count"], g["segments"],
                              kind=g["kind"], extra=g["extra"])
        except RingsideError as e:
            logger.warning("ringside: registering the KV cache failed (%s); serving without the cache", e)
            self._fail(e)
            self.region = None if getattr(e, "status", None) not in (None,) else self.region
            return None
        self._region_gen = self.link.generation
        logger.info("ringside: registered %d KV pages of %d bytes (%d segments)", g["page_count"],
                    g["page_size"], len(g["segments"]))
        return s

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RingsideConnectorMetadata) or not meta.loads:
            return
        s = self._register() if self.region is not None else None
        for spec in meta.loads:
            self._load_errors.update(spec.error_block_ids)
            self.stats["load_error_blocks"] += len(spec.error_block_ids)
            if not spec.block_ids:
                self._finished_recving.add(spec.req_id)
                continue
            if s is None:
                self._load_errors.update(spec.block_ids)
                self.stats["load_error_blocks"] += len(spec.block_ids)
                self._finished_recving.add(spec.req_id)
                continue
            try:
                seq = s.submit(_s.TYPE_LOAD, _s.encode_load(spec.lease, REGION_ID, 0, spec.block_ids), wake=False)
                deadline = time.monotonic() + self.load_timeout
                self._inflight.setdefault(spec.req_id, []).append((seq, spec, deadline))
                self.stats["loads"] += 1
            except (RingsideError, ValueError) as e:
                self._load_errors.update(spec.block_ids)
                self.stats["load_error_blocks"] += len(spec.block_ids)
                self._finished_recving.add(spec.req_id)
                if isinstance(e, RingsideError):
                    self._fail(e)
        if s is not None and s is self.link.session:
            try:
                s.kick()  # one wake for the step's loads
            except RingsideError as e:
                self._fail(e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are stored whole in wait_for_save, after the forward pass

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, RingsideConnectorMetadata) or not meta.store_block_ids or self.region is None:
            return
        s = self._register()
        if s is None:
            return
        if self.region.get("kind") == _s.REGION_CUDA_IPC:
            # The sidecar's device-to-host copies run on its own streams: the
            # forward pass that wrote these blocks must be finished first.
            torch.cuda.current_stream().synchronize()
        # The step's digests go into one batch of this worker's own (ids
        # with the top bit set, per rank: never the scheduler's), the stores
        # refer to it, and it is dropped after them: all pipelined, one wait.
        self._wbatch += 1
        batch = (1 << 63) | (self._rank << 40) | (self._wbatch & ((1 << 40) - 1))
        seqs = []
        try:
            digests = b"".join(meta.store_digests)
            step = _s.MAX_HASHES_PER_RECORD * 32
            for off in range(0, len(digests), step):
                s.send(_s.TYPE_PUT_HASHES, _s.encode_put_hashes(batch, digests[off:off + step], 32,
                                                               _s.FLAG_APPEND if off else 0), wake=False)
            # The batch holds every spec's digests in order, and the block
            # ids in the same order make one list: one Store record for the
            # whole step (8192 pages per record at most), not one a request.
            ids = meta.store_block_ids
            for first in range(0, len(ids), _s.MAX_PAGES_PER_RECORD):
                chunk = ids[first:first + _s.MAX_PAGES_PER_RECORD]
                seqs.append(s.submit(_s.TYPE_STORE, _s.encode_store(batch, first, len(chunk), REGION_ID, chunk),
                                     wake=False))
            # The last record wakes the sidecar: the copies start now.
            s.send(_s.TYPE_DROP_HASHES, _s.encode_drop_hashes(batch), wake=True)
        except (RingsideError, _s.SchemaError) as e:
            self._save_failed(e)
            return
        self._saving.append((s, seqs, time.monotonic() + self.save_timeout))
        if not self._deferred_saves:
            self._finish_saves(True)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # vLLM calls this at the start of every step, before anything can
        # write a block (zeroing, block copies, the forward pass). A store's
        # blocks are full and belong to a live request, so nothing writes
        # them again until they are freed: the scheduler marks the steps in
        # which stores still copying may have lost their blocks (a request
        # finished or was preempted, wait_saves) and only then does this
        # wait; otherwise the copies go on through this step's forward pass
        # and are waited for at the next step at the latest.
        if getattr(self, "_saving", None):
            self._finish_saves(not self._overlap_saves() or getattr(kv_connector_metadata, "wait_saves", True))

    def _overlap_saves(self) -> bool:
        """Whether stores may run on through the next forward pass (when the
        scheduler allows it). Default: only for GPU memory, where the copies
        use the GPU's copy engines; host copies take the CPU cores a CPU
        forward pass needs (measured: the engine's steps got up to 2x longer
        on the project's 2-vCPU VM), so they are waited for before it."""
        o = self._overlap
        if o == "auto":
            return self.region is not None and self.region.get("kind") == _s.REGION_CUDA_IPC
        return bool(o)

    def _finish_saves(self, wait_all: bool = True) -> None:
        """Wait (bounded by save_timeout) for the replies of the stores sent
        by wait_for_save. With wait_all False the latest step's stores are
        only collected if answered; the rest stay pending one more step (the
        next call waits for them, as for everything older)."""
        pending, self._saving = self._saving, []
        last = len(pending) - 1
        for i, (s, seqs, deadline) in enumerate(pending):
            try:
                if not wait_all and i == last and s is self.link.session:
                    self.stats["saves_unwaited"] += 1
                    left = []
                    for seq in seqs:
                        p = s.try_reply(seq)
                        if p is None:
                            left.append(seq)
                        else:
                            self._store_done(p)
                    if left:
                        self._saving.append((s, left, deadline))
                    continue
                for seq in seqs:
                    if s is not self.link.session:
                        break  # that session was dropped: the sidecar discarded its writes
                    left_s = max(deadline - time.monotonic(), 0.001)
                    self._store_done(s.await_reply(seq, timeout=left_s))
            except (RingsideError, _s.SchemaError) as e:
                self._save_failed(e)

    def _store_done(self, payload: bytes) -> None:
        rep = _s.decode_store_reply(payload)
        st = self.stats
        st["stores"] += 1
        if rep.status == _s.Status.OK:
            st["stored_blocks"] += rep.stored
            st["present_blocks"] += rep.present
        else:
            st["store_errors"] += 1

    def _save_failed(self, e: Exception) -> None:
        # The engine may reuse the blocks once we return: drop the session so
        # the sidecar stops and discards whatever it holds (a write of a dead
        # session never becomes visible).
        self.stats["store_errors"] += 1
        self._fail(e)
        if self.link.session is not None:
            self.link.drop(e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        s = self.link.session
        if self._inflight:
            for rid in list(self._inflight):
                pending = self._inflight[rid]
                still = []
                for seq, spec, deadline in pending:
                    payload = None
                    failed = s is None
                    if s is not None:
                        try:
                            payload = s.try_reply(seq)
                        except RingsideError as e:
                            self._fail(e)
                            s, failed = None, True
                    if payload is None and not failed and time.monotonic() > deadline:
                        # No answer in time: a stuck or dead sidecar. The
                        # request recomputes; the session is dropped so that
                        # a late copy cannot land in reused blocks.
                        failed = True
                        err = RingsideTimeout("load of %s got no reply in %.1fs" % (spec.req_id, self.load_timeout))
                        self.stats["sidecar_errors"] += 1
                        self.link.drop(err)
                        s = None
                    if failed:
                        self._load_errors.update(spec.block_ids)
                        self.stats["load_error_blocks"] += len(spec.block_ids)
                        continue
                    if payload is None:
                        still.append((seq, spec, deadline))
                        continue
                    rep = _s.decode_reply(payload)
                    if rep.status == _s.Status.OK and rep.value == len(spec.block_ids):
                        self.stats["loaded_blocks"] += len(spec.block_ids)
                    else:
                        self._load_errors.update(spec.block_ids)
                        self.stats["load_error_blocks"] += len(spec.block_ids)
                if still:
                    self._inflight[rid] = still
                else:
                    del self._inflight[rid]
                    self._finished_recving.add(rid)
        self._maybe_write_stats()
        if not self._finished_recving:
            return None, None
        done, self._finished_recving = self._finished_recving, set()
        return None, done

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._load_errors:
            return set()
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self):
        if getattr(self, "_saving", None):
            self._finish_saves()
        self._write_stats()
        self.link.close()

    # ------------------------------------------------------------------

    def _maybe_write_stats(self) -> None:
        if not self.stats_path:
            return
        self._steps_since_stats += 1
        if self._steps_since_stats >= self.stats_every:
            self._write_stats()

    def _write_stats(self) -> None:
        self._steps_since_stats = 0
        if not self.stats_path:
            return
        m = getattr(self, "mirror", None)
        if m is not None:
            self.stats["mirror_state"] = Mirror.STATE_NAMES[m.state]
            self.stats["mirror_blocks"] = len(m.present)
            for k, v in m.stats.items():
                self.stats["mirror_" + k] = v
        path = "%s.%s.%d.json" % (self.stats_path, self.stats["role"].lower(), os.getpid())
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.stats, f)
            os.replace(tmp, path)
        except OSError as e:
            logger.debug("ringside: stats: %s", e)


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)


def _single_group_blocks(kvm: Any) -> Optional[dict]:
    """The KV cache manager's request -> blocks table when the model has one
    KV cache group (every attention layer alike): the store planner slices a
    request's new blocks from it instead of asking for the whole block table.
    None (use SchedulerOutput.kv_connector_block_state) otherwise."""
    try:
        managers = kvm.coordinator.single_type_managers
        if len(managers) == 1 and isinstance(managers[0].req_to_blocks, dict):
            return managers[0].req_to_blocks
    except AttributeError:
        pass
    return None


def _full_attention_only(kvm: Any) -> bool:
    """Whether every KV cache group is plain full attention: then a full
    block of a live request is never freed before the request finishes or
    is preempted (other kinds, e.g. sliding windows, free blocks earlier)."""
    try:
        managers = kvm.coordinator.single_type_managers
        return len(managers) > 0 and all(type(m).__name__ == "FullAttentionManager" for m in managers)
    except AttributeError:
        return False


def _tp_rank() -> int:
    """This worker's shard index: pp_rank * tp_size + tp_rank."""
    try:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        tp_rank, tp = int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
        try:
            pp_rank = int(get_pp_group().rank_in_group)
        except Exception:  # noqa: BLE001 - no pipeline group
            pp_rank = 0
        return pp_rank * tp + tp_rank
    except Exception:  # noqa: BLE001 - not initialised: a single worker
        return 0


def _describe_region(kv_caches: dict[str, torch.Tensor]) -> Optional[dict]:
    """Describe the KV cache as one region of pages: page i is block i of
    every layer (K and V), each a segment at base + offset + i * stride."""
    if not kv_caches:
        return None
    tensors = []
    seen = set()
    for name in sorted(kv_caches):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            t = t[0]
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # layers sharing one tensor are stored once
            continue
        seen.add(key)
        tensors.append((name, t))
    devices = {t.device.type for _, t in tensors}
    if len(devices) != 1 or devices - {"cpu", "cuda"}:
        logger.warning("ringside: KV caches on %s are not supported; serving without the cache", sorted(devices))
        return None
    segments = []
    num_blocks = None
    for name, t in tensors:
        es = t.element_size()
        shape, stride = tuple(t.shape), tuple(t.stride())
        # The block dimension: CPU layouts put it first; some layouts put K/V first.
        if len(shape) >= 2 and shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks) and shape[1] != 2:
            nb = shape[1]
            per = _contiguous_bytes(shape[2:], stride[2:], es)
            for kv in range(2):
                segments.append((t.data_ptr() + kv * stride[0] * es, stride[1] * es, per))
        else:
            nb = shape[0]
            per = _contiguous_bytes(shape[1:], stride[1:], es)
            segments.append((t.data_ptr(), stride[0] * es, per))
        if per is None:
            logger.warning("ringside: layer %s has a non-contiguous block layout %s/%s; serving without the cache",
                           name, shape, stride)
            return None
        if num_blocks is not None and nb != num_blocks:
            logger.warning("ringside: layers disagree on the number of blocks; serving without the cache")
            return None
        num_blocks = nb
    base = min(seg[0] for seg in segments)
    end = max(seg[0] + seg[1] * (num_blocks - 1) + seg[2] for seg in segments)
    region = {
        "base": base,
        "length": end - base,
        "page_count": num_blocks,
        "page_size": sum(seg[2] for seg in segments),
        "segments": [(seg[0] - base, seg[1], seg[2]) for seg in segments],
        "kind": _s.REGION_HOST_PROCESS,
        "extra": b"",
    }
    if "cuda" in devices:
        try:
            region["extra"] = _cuda_ipc_extra([t for _, t in tensors], base)
        except Exception as e:  # noqa: BLE001 - never fail the engine's start over the cache
            logger.warning("ringside: cannot share the GPU KV cache with the sidecar (%s); serving without the cache", e)
            return None
        region["kind"] = _s.REGION_CUDA_IPC
    return region


def _cuda_ipc_extra(tensors, base: int) -> bytes:
    """The RegisterRegion extra bytes of a GPU KV cache: the CUDA IPC handle
    of the one allocation holding every layer (deduplicated by allocation),
    the GPU's UUID and the offset of ``base`` in that allocation.

    Not verified on a GPU yet (none was available to the project so far).
    Memory that CUDA IPC cannot share (PyTorch expandable segments, vLLM's
    sleep-mode allocator) makes _share_cuda_ fail, and the engine then runs
    without the cache."""
    allocs = {}
    device = None
    for t in tensors:
        st = t.untyped_storage()
        dev, handle, _size, offset = st._share_cuda_()[:4]
        alloc_base = st.data_ptr() - int(offset)
        allocs.setdefault(alloc_base, bytes(handle))
        device = dev
    if len(allocs) != 1:
        raise ValueError("the KV cache spans %d allocations; ringside needs all layers of a rank in one "
                         "allocation (vLLM's default single KV buffer)" % len(allocs))
    (alloc_base, handle), = allocs.items()
    if len(handle) != 64:
        raise ValueError("CUDA IPC handle of %d bytes, want 64" % len(handle))
    uuid = torch.cuda.get_device_properties(device).uuid
    raw = getattr(uuid, "bytes", None) or bytes(uuid)
    if len(raw) != 16:
        raise ValueError("GPU UUID of %d bytes, want 16" % len(raw))
    return _s.encode_cuda_ipc_extra(handle, raw, base - alloc_base)


def _contiguous_bytes(shape, stride, es) -> Optional[int]:
    """Bytes of one block if its elements are contiguous, else None."""
    n, expect = 1, 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expect:
            return None
        expect *= size
        n *= size
    return n * es


def register_plugin() -> None:
    """``vllm.general_plugins`` entry point: register RingsideConnector with
    vLLM's connector factory, so the name alone selects it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if "RingsideConnector" not in getattr(KVConnectorFactory, "_registry", {}):
            KVConnectorFactory.register_connector("RingsideConnector", "ringside.vllm", "RingsideConnector")
    except Exception as e:  # noqa: BLE001 - a plugin must never break vLLM's start
        logger.warning("ringside: could not register the vLLM connector: %s", e)

