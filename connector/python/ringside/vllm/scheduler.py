"""The scheduler side of the vLLM connector (the EngineCore process).

It attaches to the sidecar as the scheduler of this engine instance and
composes the parts that answer vLLM's scheduler hooks:

- admission.py: lookups of arriving requests (local index or sidecar);
- index.py: the local index of the cache and when to trust it;
- loads.py: acquires of leases on hit blocks and their collection;
- store_plan.py: the blocks that become full in each step (pure).

Cost model: the scheduler never waits for the sidecar except for a reply it
needs in the same call (a lookup's hit count, an acquire's lease when the
step's loads are sent), and then for at most ``max_wait_us`` a step in all.
Everything else is published without waking the sidecar (Session.submit/send
with wake=False) and handled in order when the next wait wakes it. Stores
need no scheduler round trip at all: the step's metadata carries the digests
of the blocks to store, and each worker registers them in its own batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from .. import schema as _s
from ..client import RingsideError
from ..events import EventFeed
from ..plugin.config import Config
from ..plugin.faults import SIDECAR_ERRORS, Faults, make_link
from ..plugin.stats import StatsFile, counters
from . import disagg, retention
from .admission import Admission
from .engine import full_attention_only, new_blocks, writes_before_preemptions
from .events import KVEvents
from .groups import Layout
from .hybrid import HybridAdmission
from .index import LocalIndex
from .loads import Loads
from .metadata import RingsideConnectorMetadata
from .state import ReqState, StepBudget
from .store_plan import StorePlanner

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("ringside.vllm")


COUNTERS = (
    "lookups",
    "lookup_blocks",
    "hit_blocks",
    "loads",
    "loaded_blocks",
    "load_error_blocks",
    "stores",
    "stored_blocks",
    "present_blocks",
    "store_errors",
    "sidecar_errors",
    "steps",
    "resumed",
    "deferred_lookups",
    "batches_reused",
    "saves_unwaited",
    "stores_skipped",
    "store_waits",
    "planned_stores",
    "planned_blocks",
    "step_ns_total",
    "step_ns_max",
    "mirror_lookups",
    "mirror_hit_blocks",
    "mirror_catchups",
    "window_probes",
    "group_cut_hits",
    "load_blocks_full",
    "load_blocks_window",
    "described_blocks",
    "pd_waits",
    "pd_polls",
    "pd_timeouts",
    "pd_announced_blocks",
    "pd_over_cap",
    "pd_bad_blocks",
    "deferred_external_blocks",
    "load_refusals",
    "load_refused_share",
    "load_refused_short",
    "load_refused_timeout",
    "load_refused_error",
) + retention.COUNTERS


class EngineLimits:
    """The engine's scheduling limits the scheduler side reasons with (how
    many blocks a schedule can allocate, how many steps are in flight)."""

    __slots__ = ("max_tokens", "max_seqs", "lookahead", "concurrent_batches")

    def __init__(self, max_tokens: int = 0, max_seqs: int = 0, lookahead: int = 0, concurrent_batches: int = 1):
        self.max_tokens = max_tokens  # max_num_batched_tokens (0: not known)
        self.max_seqs = max_seqs  # max_num_seqs
        self.lookahead = lookahead  # speculative tokens a request
        self.concurrent_batches = max(1, concurrent_batches)  # vLLM's max_concurrent_batches

    @classmethod
    def of(cls, vllm_config: Any) -> "EngineLimits":
        """From vLLM's config; what it lacks stays unknown (max_tokens 0:
        every step counts as one a preemption may follow)."""
        sc = getattr(vllm_config, "scheduler_config", None)
        spec = getattr(vllm_config, "speculative_config", None)
        try:
            batches = int(vllm_config.max_concurrent_batches)
        except Exception:  # noqa: BLE001 - a vLLM without it: PP or async scheduling may overlap 2
            batches = 2
        return cls(
            int(getattr(sc, "max_num_batched_tokens", 0) or 0),
            int(getattr(sc, "max_num_seqs", 0) or 0),
            int(getattr(spec, "num_speculative_tokens", 0) or 0),
            batches,
        )


class SchedulerSide:
    """Implementation of the scheduler-side connector methods."""

    def __init__(
        self,
        cfg: Config,
        attach: dict,
        block_size: int,
        speculative: bool,
        layout: Optional[Layout] = None,
        events: Optional[KVEvents] = None,
        limits: Optional["EngineLimits"] = None,
    ):
        self.cfg = cfg
        self.block_size = block_size
        self.layout = layout = layout or Layout.single(block_size)
        self.stats = counters(COUNTERS, role="SCHEDULER")
        self.link = make_link(cfg, dict(attach, role=_s.ROLE_SCHEDULER, rank=0))
        self.faults = Faults(self.link, self.stats, logger)
        self.budget = StepBudget(int(cfg.max_wait_us * 1000))
        self.index = LocalIndex(cfg, self.link, self.faults, self.budget) if cfg.mirror else None
        self.mirror = self.index.mirror if self.index is not None else None
        self.admission = Admission(
            self.link,
            self.faults,
            self.budget,
            self.index,
            block_size,
            cfg.timeout,
            len(layout.groups),
            cfg.pd_wait_s,
            cfg.pd_max_waiting,
        )
        # Retention hints, from the sources the operator honours (retention.py).
        self.hints = retention.Hints(retention.sources_of(cfg.hint_sources), cfg.retain_max_blocks, self.stats)
        self.reqs = self.admission.reqs
        # Several KV cache groups: their lookups and acquires (hybrid.py).
        self.hybrid = HybridAdmission(self.admission, layout) if not layout.plain else None
        # Who answers the lookup hooks: chosen once for the layout.
        self.lookups: Admission | HybridAdmission = self.hybrid or self.admission
        self.loads = Loads(
            self.link, self.faults, self.budget, cfg.timeout, max(1, int(cfg.lease_ttl * 1000)), block_size
        )
        if self.mirror is not None:
            self.loads.withhold = self.mirror.withhold
        # Speculative decoding schedules several tokens a step: check every
        # scheduled request every step instead.
        self.planner = StorePlanner(
            self.reqs, block_size, speculative, self.stats, layout, cfg.store_decode_every, describe=events is not None
        )
        self.stats_file = StatsFile(cfg.stats_path, cfg.stats_every, "scheduler", self._add_stats)
        self.kv_cache_manager: Any = None  # bound by vLLM after construction
        # Only full attention keeps every block of a live request until it
        # finishes or is preempted (sliding windows free old blocks).
        self._full_attention: Optional[bool] = None
        # Whether Model Runner V2 writes blocks before handle_preemptions for
        # this model (engine.writes_before_preemptions; None: not known yet).
        self._writes_first: Optional[bool] = None
        # The engine blocks the last step's stores read (None: no stores).
        self._last_stored: Optional[set[int]] = None
        # Finished requests whose blocks vLLM keeps for the workers' stores
        # (request_finished returned True): to tell the workers (the next
        # metadata), and those not reported back in finished_sending yet.
        self._held: list[str] = []
        self.holding: set[str] = set()
        # Held requests with a retention hint (retention.py): the hint is
        # sent, and the batch recycled, once their stores are answered.
        self._retain_later: dict[str, tuple[ReqState, retention.Hint]] = {}
        lim = limits or EngineLimits()
        # A store planned in step k is answered, or waited for, by the time
        # the workers start the forward pass of step k + 2 (handle_preemptions
        # waits for all but the latest step's); with overlapping batches
        # (async scheduling, pipeline parallelism) vLLM schedules up to
        # max_concurrent_batches - 1 steps more before it processes a step's
        # output. One step of margin.
        self.hold_steps = lim.concurrent_batches + 2
        self.planner.ext_defer = lim.concurrent_batches
        # The most blocks one schedule can allocate to running requests (the
        # only ones vLLM preempts for): the token budget and every request's
        # lookahead, a block more a request for the one it has begun, in
        # every KV cache group. 0: not known (every step is exposed).
        n = len(layout.groups)
        lim_tokens = lim.max_tokens + lim.max_seqs * lim.lookahead
        self.alloc_bound = n * (lim_tokens // block_size + lim.max_seqs) if lim.max_tokens else 0
        if self.index is not None:
            self.index.start(self.link.get(), cfg.timeout)
        # The sidecar's tier in vLLM's KV event stream (events.py), or None.
        self.events = events
        if events is not None:
            events.stats = self.stats
            events.start(self.link.get(), self.faults)
        self._bind_hooks()

    def _bind_hooks(self) -> None:
        """Bind the hooks whose work is another object's method, once, over
        the forwarding methods below (a performance idiom, ringside/
        hot_paths.py): the lookup hooks to the admission chosen for the
        layout, and, without KV events, take_events to the local index's
        after_step, the only work after a step."""
        bound: list[tuple[str, Any]] = [
            ("on_new_request", self.lookups.on_new_request),
            ("get_num_new_matched_tokens", self.lookups.get_num_new_matched_tokens),
        ]
        if self.events is None and self.index is not None:
            bound.append(("take_events", self.index.after_step))
        for name, hook in bound:
            setattr(self, name, hook)

    # -- admission ---------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        self.lookups.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self.lookups.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        adm = self.admission
        r = self.reqs.get(request.request_id)
        if r is None:
            r = adm.req(request)  # tracked for its stores even without a sidecar
        r.allocated = True
        if num_external_tokens <= 0:
            return
        r.load_from = r.hit_tokens - num_external_tokens
        if self.hybrid is not None:
            parts, flags = self.hybrid.alloc(r, request, blocks, num_external_tokens)
            self.loads.acquire_parts(r, request.request_id, parts, flags)
            return
        start = (r.hit_tokens - num_external_tokens) // self.block_size
        count = num_external_tokens // self.block_size
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        want = ids[start : start + count]  # vLLM passes all of the request's blocks
        # Blocks that come from the sidecar need no storing back.
        r.stored = max(r.stored, start + count)
        self.loads.acquire(r, request.request_id, start, count, want, adm.put_hashes)

    # -- the step's metadata ---------------------------------------------------

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> RingsideConnectorMetadata:
        t0 = time.perf_counter_ns()
        meta = RingsideConnectorMetadata()
        planner = self.planner
        loads = self.loads
        s = self.link.session
        if s is not None:
            try:
                # Let the sidecar answer this step's acquires while the
                # stores are planned (releases and drops alone need no
                # prompt wake). Every reply the scheduler waits for is read
                # (with whatever arrived before it) when it is collected;
                # stray ones (failed fire-and-forget sends) are consumed
                # every 32 steps, so that the completion ring never fills.
                if loads.waiting:
                    s.kick()
                if not planner.step & 31:
                    s.drain()
            except RingsideError as e:
                self.faults.fail(e)
                s = None
        # The stores planned last step may still be copying (the workers
        # waited for the older ones): they must be waited for before this
        # step writes only if it writes a block they read, i.e. if this
        # schedule handed one of those blocks on (vLLM freed it since: a
        # preemption, a sliding window) as a new block of a request.
        if self._full_attention is None:
            kvm = self.kv_cache_manager
            self._full_attention = full_attention_only(kvm)
            self._writes_first = writes_before_preemptions(kvm, self.layout.hash_block)
        pre = getattr(scheduler_output, "preempted_req_ids", None)
        full = self._full_attention
        last = self._last_stored
        if pre is None:
            meta.wait_saves = True
        elif last:
            meta.wait_saves = not last.isdisjoint(new_blocks(scheduler_output))
            if meta.wait_saves:
                self.stats["store_waits"] += 1
        else:
            meta.wait_saves = False
        if pre:
            self.admission.preempted(pre)
            self.planner.preempted(pre)
            reqs = self.reqs
            for rid in pre:  # its blocks went with the preemption (wait_saves, settle_saves)
                r = reqs.get(rid)
                if r is not None:
                    r.store_step = 0
        # Model Runner V2 writes the step's new blocks before it calls
        # handle_preemptions (zeroing, copy-on-write) where the model needs
        # it (writes_before_preemptions): there the stores the next schedule
        # may expose are waited for at this step's end.
        kvm = self.kv_cache_manager
        bound = self.alloc_bound
        meta.settle_saves = self._writes_first is not False and (
            not full or not bound or kvm is None or kvm.block_pool.get_num_free_blocks() < bound
        )
        if self._held:
            meta.held_req_ids, self._held = self._held, []
        # The planned stores' digests are noted as the engine's own (read your writes).
        m = self.mirror
        planner.begin_step(kvm, m.noting(time.monotonic()) if m is not None and not m.disabled else None)
        planner.plan(meta, scheduler_output)
        self._last_stored = set(meta.store_block_ids) if meta.store_block_ids else None
        if s is not None and s is not self.link.session:
            s = None
        if self.events is not None:  # the runs are described with the next poll of the event log (events.py)
            runs = planner.take_runs()
            if runs:
                self.events.note(runs)
        if loads.waiting or loads.abandoned:
            loads.collect(meta, s)
        if loads.orphans:
            loads.release_orphans(s)
        if self.hints.awaited:  # the sidecar's answers to kv_hints' Retains (retention.py)
            try:
                self.hints.collect(s)
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)
        self.budget.reset()  # the next step's
        self.admission.woke = False
        dt = time.perf_counter_ns() - t0
        st = self.stats
        st["steps"] += 1
        st["step_ns_total"] += dt
        st["step_ns_max"] = max(st["step_ns_max"], dt)
        if self.stats_file.path:
            self.stats_file.tick(st)
        return meta

    # -- after the step ----------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv_cache_manager = kv_cache_manager
        if self.events is not None:  # re-announce after the engine's AllBlocksCleared
            self.events.watch(kv_cache_manager)

    def take_events(self) -> Any:
        # vLLM calls this once a step, after the step's output.
        if self.index is not None:
            self.index.after_step()
        if self.events is not None:
            return self.events.take_events(self.link.session, self.faults)
        return ()

    def update_connector_output(self, connector_output: Any) -> None:
        if self.index is not None:
            self.index.out_t = time.monotonic()
        if self.holding:
            sent = getattr(connector_output, "finished_sending", None)
            if sent:
                self.holding.difference_update(sent)
                if self._retain_later:
                    self._retain_sent(sent)
        rec = getattr(connector_output, "finished_recving", None) or ()
        if not rec:
            return
        s = self.link.session
        reqs = self.reqs
        loads = self.loads
        recving = loads.recving
        bad = getattr(connector_output, "invalid_block_ids", None)
        failed = getattr(connector_output, "failed_recving", None) or ()
        for rid in rec:
            r = reqs.get(rid)
            if r is None and recving:
                r = recving.pop(rid, None)  # finished while its load was in flight
            if r is not None and r.load is not None:
                if bad or failed:
                    loads.failed_in_workers(r, bad or set(), failed, rid)
                loads.loaded(r, s)

    def request_finished(
        self, request: "Request", block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        self.planner.forget(rid)
        r = self.reqs.pop(rid, None)
        if r is None:
            return False, None
        # Stores planned in its last steps may still be reading its blocks:
        # vLLM keeps them until the workers report the request in
        # finished_sending (each once no store of its that read them is
        # unanswered). A preempted request's stores went with its blocks
        # (store_step 0), and a request waiting for its load is held by
        # vLLM itself until finished_recving.
        hold = bool(r.store_step) and r.store_step + self.hold_steps > self.planner.step
        self.admission.pd_waiting.discard(rid)
        params = getattr(request, "kv_transfer_params", None)
        hint = self.hints.of(request, self.hybrid is None)  # several groups: ignored (counted)
        out = None
        if self.cfg.pd_producer and r.stored and self.hybrid is None and disagg.wants_remote_decode(params):
            out = disagg.produced(r.stored)  # the decode waits for these (disagg.py)
            self.stats["pd_announced_blocks"] += r.stored
        if hold:
            self._held.append(rid)
            self.holding.add(rid)
        sent = r.load is not None and self.loads.waiting.pop(rid, None) is None
        if r.load is not None and not sent:
            self.loads.abandoned.append(rid)
        s = self.link.session
        if s is not None and r.generation == self.link.generation:
            try:
                if r.lookup_seq:  # looked up ahead, never asked for
                    s.forget(r.lookup_seq)
                for _, seq in r.gseq:  # the same, of several KV cache groups
                    s.forget(seq)
                if r.load is not None:
                    self.loads.finished(rid, r, s, sent)
                if hint is not None and hold:
                    self._retain_later[rid] = (r, hint)  # sent once its stores are answered
                else:
                    if hint is not None:
                        self.hints.send(self.admission, s, r, hint)
                    if r.registered:
                        self.admission.recycle(r, s)
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)
        elif hint is not None and hint.action:  # no sidecar: nothing of the request's is there
            self.hints.outcome(rid, hint.action, hint.action_id, retention.MISSING, "no sidecar session")
        return hold, out

    def _retain_sent(self, sent: Any) -> None:
        """Held requests whose stores were all answered (finished_sending):
        send their retention hints, then recycle their batches."""
        s = self.link.session
        for rid in sent:
            later = self._retain_later.pop(rid, None)
            if later is None:
                continue
            r, hint = later
            if s is None or r.generation != self.link.generation:
                if hint.action:  # a new sidecar session: its batches are gone, and the blocks
                    self.hints.outcome(rid, hint.action, hint.action_id, retention.MISSING, "the sidecar restarted")
                continue
            try:
                self.hints.send(self.admission, s, r, hint)
                self.admission.recycle(r, s)
            except SIDECAR_ERRORS as e:
                self.faults.fail(e)

    def has_pending_block_frees(self) -> bool:
        """vLLM asks before it preempts a request for blocks: held blocks
        come back within a step or two (save_timeout at most), so it waits
        for them instead."""
        return bool(self.holding)

    def shutdown(self) -> None:
        self.stats_file.write(self.stats)
        self.link.close()

    def _add_stats(self, stats: dict) -> None:
        if self.index is not None:
            self.index.add_stats(stats)
        if self.events is not None:
            for k, v in self.events.feed.stats.items():
                stats["events_" + k] = v
            stats["events_state"] = EventFeed.STATE_NAMES[self.events.feed.state]
