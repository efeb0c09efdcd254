"""The worker side of the vLLM connector (each rank).

It attaches as a worker of the same instance and registers the KV cache
tensors as one region (host memory by pid and address; CUDA IPC for GPU
tensors). Loads start before the forward pass (``start_load_kv``; the request
waits in WAITING_FOR_REMOTE_KVS meanwhile) and are collected in
``get_finished``. A step's newly full blocks are stored in ``wait_for_save``,
after the forward pass that wrote them: the step's digests are registered as
a batch of this worker's own and stored from it. No block is handed to
another request while a store may read it: a request that finishes with a
store unanswered is held by vLLM (request_finished returned True) until this
worker reports it in finished_sending, once every store of its own that read
its blocks has ended (answered OK or not; past save_timeout, once the
sidecar ended the session, which discards its stores still copying); blocks
freed without request_finished (preemption, sliding windows) are covered by
waiting for the stores before the first write that can reach them:
``handle_preemptions`` when the scheduler says a step may reuse them (the V1
runner writes no block before it), or the end of the step before (Model
Runner V2 zeroes and copies into new blocks before it calls
handle_preemptions). Otherwise the copies overlap with vLLM's output
processing and scheduling, and with ``overlap_saves`` with the next forward
pass too.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from .. import schema as _s
from ..client import RingsideError, RingsideTimeout, Session
from ..plugin.config import Config
from ..plugin.faults import SIDECAR_ERRORS, Faults, make_link
from ..plugin.region import Region, RegionError, from_block_tensors
from ..plugin.stats import StatsFile, counters
from .metadata import RingsideConnectorMetadata
from .scheduler import COUNTERS

logger = logging.getLogger("ringside.vllm")

REGION_ID = 1
# The sidecar's default --write-timeout: it discards a shard not committed
# that long after the block's latest store. A worker that could not end a
# session whose stores timed out (no Detach reply: a stuck sidecar) keeps
# their blocks that long; it must be at least the sidecar's write timeout.
SIDECAR_WRITE_TIMEOUT = 30.0
_ALL, _LAST, _POLL = 0, 1, 2  # how _finish_saves collects the stores' replies
_CUDA_KINDS = (_s.REGION_CUDA_IPC, _s.REGION_CUDA_FD)  # GPU memory: by IPC handle, or by file descriptor


class WorkerSide:
    """Implementation of the worker-side connector methods."""

    def __init__(self, cfg: Config, attach: dict, rank: int, deferred_saves: bool, num_blocks: Optional[int] = None):
        self.cfg = cfg
        # The engine's block count (KVCacheConfig.num_blocks): block ids are
        # the scheduler's, whatever kernel blocks vLLM splits them into in the
        # tensors it registers; a region of another page count is refused.
        self.num_blocks = num_blocks
        self.rank = rank
        self.stats = counters(COUNTERS, role="WORKER")
        self.link = make_link(cfg, dict(attach, role=_s.ROLE_WORKER, rank=rank))
        self.faults = Faults(self.link, self.stats, logger)
        self.stats_file = StatsFile(cfg.stats_path, cfg.stats_every, "worker")
        self.load_timeout = cfg.load_timeout
        self.save_timeout = cfg.save_timeout
        self.write_timeout = SIDECAR_WRITE_TIMEOUT
        self.region: Optional[Region] = None
        self._region_gen = -1
        self._kv_caches: Optional[dict] = None  # the tensors registered (register_kv_caches)
        self._asleep = False  # sleep mode dropped the registration (unregister_kv_caches)
        # A CUDA region's interprocess event (cudaipc.IpcEvent; None for host
        # memory): recorded on the engine's stream before a Store, the
        # sidecar's store copies wait for it.
        self.store_event: Any = None
        self._dead_event: Any = None  # a store event given up (a failed record), destroyed with the region
        self._wbatch = 0
        # Stores sent by wait_for_save, awaited at the start of the next step
        # (handle_preemptions) instead of blocking the step that sent them;
        # synchronous where vLLM has no such hook, or with sync_saves.
        # The stores sent: (session, seqs, deadline, request ids, engine block ids, step sent).
        self._saving: list[tuple[Session, list[int], float, list[str], list[int], int]] = []
        self._step = 0  # steps begun (handle_preemptions): a store is let run on through one step, not more
        self._store_reqs: dict[str, int] = {}  # req id -> stores in _saving or _ending that read its blocks
        # Sessions given up on with stores unanswered: [session, Detach seq
        # or None, hold-until time, request ids of those stores, whether the
        # sidecar has ended the session]. Their
        # requests are released once the sidecar has ended the session (no
        # store of it can commit any more), or at the hold-until time.
        self._ending: list = []
        # Store events of sessions the sidecar did not confirm ended: never
        # destroyed while it may have them open (_release_region).
        self._kept_events: list = []
        self._held: set[str] = set()  # finished requests vLLM keeps the blocks of, until reported
        self._sent: set[str] = set()  # held requests whose stores all ended: finished_sending
        self._noted: Any = None  # the last metadata whose held requests were noted
        # The runner writes blocks before handle_preemptions (Model Runner V2;
        # the connector sets it): stores exposed by the next schedule
        # (settle_saves) are waited for at the end of the step.
        self.writes_first = True
        self._deferred_saves = deferred_saves and not cfg.sync_saves
        self._overlap = cfg.overlap_saves  # "auto" (GPU memory only), True or False: see overlap_saves()
        self._inflight: dict[str, list] = {}  # req_id -> [(session, seq, engine block ids, whole, deadline)]
        # Requests with loads on a session given up on (a load past
        # load_timeout, a failed session): the number of such loads, each
        # waiting in the session's _ending record until the sidecar has ended
        # the session; the request is reported finished loading only then.
        self._fencing: dict[str, int] = {}
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()  # requests whose load of several KV cache groups failed

    # -- registration ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._kv_caches, self._asleep = kv_caches, False
        if self.region is not None:
            self._release_region()
        try:
            region = from_block_tensors(kv_caches, self.num_blocks)
        except RegionError as e:
            logger.warning("ringside: %s; serving without the cache", e)
            return
        except Exception as e:  # noqa: BLE001 - never fail the engine's start over the cache
            logger.warning("ringside: cannot describe the KV cache (%r); serving without the cache", e)
            return
        self.region, self.store_event = region, region.event
        self._register()

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM 0.33 and later) is about to release or remap the
        KV cache memory: the registration is dropped (_release_region: the
        stores and loads still copying are waited for first), so that no
        copy can reach that memory until restore_kv_caches. Idempotent."""
        if self.region is not None:
            self._release_region()
            self._asleep = True

    def restore_kv_caches(self) -> None:
        """After wake-up: the tensors that unregister_kv_caches dropped are
        registered again (the same addresses, new memory behind them).
        Idempotent."""
        if self._asleep and self._kv_caches is not None:
            self.register_kv_caches(self._kv_caches)

    def _release_region(self) -> None:
        """Forget the registered KV cache before another is registered (vLLM
        re-initialising it). The protocol cannot unregister a region, so the
        session that registered it is closed (detach) and the next one
        registers the new memory under the same REGION_ID: the sidecar drops
        the old region and its mappings of the old allocations with that
        session, so no copy can reach them again. (A new region id in the
        same session would keep the old allocations mapped, and open, in
        the sidecar until the session ends; and a session registers at most
        64 regions.) Stores and loads still copying into or out of the old
        memory are waited for first (bounded by their timeouts)."""
        if self._saving:
            self._finish_saves()
        while self._inflight:
            self._collect_loads()
            if self._inflight:
                time.sleep(0.001)
        ended = True
        if self.link.session is not None and self._region_gen == self.link.generation:
            ended = self.link.close()
            # A detach of our own, not a lost sidecar: attach again at once
            # (the link's reattach interval paces attempts after failures).
            self.link._next_try = 0.0
        self._region_gen = -1
        evs = (self.store_event, self._dead_event)
        self.store_event = self._dead_event = self.region = None
        if not ended:
            # The sidecar did not say it ended the session: it may still have
            # the event open (a store's gate waiting on it), and destroying an
            # event another process has open is undefined behaviour (CUDA's
            # cuIpcOpenEventHandle). Kept until this process exits.
            kept = [ev for ev in evs if ev is not None]
            if kept:
                self._kept_events.extend(kept)
                logger.warning(
                    "ringside: the sidecar did not confirm the end of the old KV cache's session; its store "
                    "event is kept until the engine exits"
                )
            return
        for ev in evs:
            if ev is None:
                continue
            try:
                ev.close()
            except Exception as e:  # noqa: BLE001 - a leaked event is no reason to stop
                logger.debug("ringside: destroying the old store event: %r", e)

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
            g.register(s, REGION_ID)
        except RingsideError as e:
            logger.warning("ringside: registering the KV cache failed (%s); serving without the cache", e)
            self.faults.fail(e)
            if e.status is not None:  # refused (not a lost sidecar): it would be refused again
                self.region = None
            return None
        except RegionError as e:
            # Memory shared by file descriptor is exported at each
            # registration: the driver refused it.
            logger.warning("ringside: %s; serving without the cache", e)
            self.region = None
            return None
        self._region_gen = self.link.generation
        logger.info(
            "ringside: registered %d KV pages of %d bytes (%d segments)", g.page_count, g.page_size, len(g.segments)
        )
        return s

    # -- loads -------------------------------------------------------------------

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, RingsideConnectorMetadata) or not meta.loads:
            return
        s = self._register() if self.region is not None else None
        st = self.stats
        for spec in meta.loads:
            rid = spec.req_id
            if spec.whole and (spec.error_block_ids or s is None):
                # A load of several KV cache groups that cannot cover all of
                # them: none of it (vLLM recomputes the request).
                self._failed.add(rid)
                st["load_error_blocks"] += len(spec.error_block_ids) or len(spec.block_ids)
                self._finished_recving.add(rid)
                continue
            self._load_errors.update(spec.error_block_ids)
            st["load_error_blocks"] += len(spec.error_block_ids)
            parts = [(spec.lease, spec.block_ids)] + list(spec.more)
            sent = 0
            for lease, ids in parts:
                if not ids:
                    continue
                if s is None:
                    self._load_error(rid, ids, spec.whole)
                    continue
                try:
                    seq = s.submit(_s.TYPE_LOAD, _s.encode_load(lease, REGION_ID, 0, ids), wake=False)
                    deadline = time.monotonic() + self.load_timeout
                    self._inflight.setdefault(rid, []).append((s, seq, ids, spec.whole, deadline))
                    st["loads"] += 1
                    sent += 1
                except (RingsideError, ValueError) as e:
                    self._load_error(rid, ids, spec.whole)
                    if isinstance(e, RingsideError):
                        self.faults.fail(e)
                        s = self.link.session
            if not sent and rid not in self._inflight and rid not in self._fencing:
                self._finished_recving.add(rid)
        if s is not None and s is self.link.session:
            try:
                s.kick()  # one wake for the step's loads
            except RingsideError as e:
                self.faults.fail(e)

    def _load_error(self, rid: str, ids: list, whole: bool) -> None:
        """Blocks that could not be loaded: load errors (one group), or the
        whole request's load failed (several groups)."""
        if whole:
            self._failed.add(rid)
        else:
            self._load_errors.update(ids)
        self.stats["load_error_blocks"] += len(ids)

    def get_finished(
        self, finished_req_ids: set[str], meta: Any = None
    ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self._inflight:
            self._collect_loads()
        if isinstance(meta, RingsideConnectorMetadata):
            sending = self._settle(meta)
        else:
            sending = None
            if self._ending:
                self._poll_ending()
        self.stats_file.tick(self.stats)
        if not self._finished_recving:
            return sending, None
        done, self._finished_recving = self._finished_recving, set()
        return sending, done

    def take_failed(self, recving: set) -> set:
        """The requests among recving (finished loading) whose load of several
        KV cache groups failed (vLLM's failed_recving: it recomputes them)."""
        if not self._failed:
            return set()
        failed = self._failed & recving
        self._failed -= failed
        return failed

    def _collect_loads(self) -> None:
        """Collect the loads' replies. A load past load_timeout gives its
        session up (a stuck or slow sidecar; the link attaches a new one) and
        ends it with a Detach. The loads of a session given up on (that one,
        or one that failed) are reported, as load errors, only once the
        sidecar has ended the session (_ending, _poll_ending): until then a
        copy it has not issued yet could still land in the blocks, which
        vLLM hands on once it sees the request in finished_recving."""
        cur = self.link.session
        st = self.stats
        for rid in list(self._inflight):
            still = []
            for entry in self._inflight[rid]:
                s, seq, ids, whole, deadline = entry
                payload = None
                if s is cur and s is not None:
                    try:
                        payload = s.try_reply(seq)
                    except RingsideError as e:
                        self.faults.fail(e)
                        cur = self.link.session
                    if payload is None and s is cur and time.monotonic() > deadline:
                        err = RingsideTimeout("load of %s got no reply in %.1fs" % (rid, self.load_timeout))
                        st["sidecar_errors"] += 1
                        self.link.retire(err)
                        cur = self.link.session
                if payload is not None:
                    rep = _s.decode_reply(payload)
                    if rep.status == _s.Status.OK and rep.value == len(ids):
                        st["loaded_blocks"] += len(ids)
                    else:
                        self._load_error(rid, ids, whole)
                elif s is cur:
                    still.append(entry)
                else:
                    # The session was given up on: the load waits for its end.
                    self._ending_of(s)[5].append((rid, ids, whole))
                    self._fencing[rid] = self._fencing.get(rid, 0) + 1
            if still:
                self._inflight[rid] = still
            else:
                del self._inflight[rid]
                if rid not in self._fencing:
                    self._finished_recving.add(rid)
        if self._ending:
            self._poll_ending()

    def _loads_ended(self, loads: list) -> None:
        """Loads of a session the sidecar has ended (or whose hold ran out):
        load errors, their requests finished loading once nothing else of
        theirs is in flight."""
        for rid, ids, whole in loads:
            self._load_error(rid, ids, whole)
            n = self._fencing.get(rid, 0) - 1
            if n > 0:
                self._fencing[rid] = n
                continue
            self._fencing.pop(rid, None)
            if rid not in self._inflight:
                self._finished_recving.add(rid)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._load_errors:
            return set()
        errs, self._load_errors = self._load_errors, set()
        return errs

    # -- stores ------------------------------------------------------------------

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, RingsideConnectorMetadata) or not meta.store_block_ids or self.region is None:
            return
        s = self._register()
        if s is None:
            return
        # The sidecar's device-to-host copies run on its own streams: they
        # must not start before the forward pass that wrote these blocks.
        if not self._stores_ordered(meta):
            return
        # The step's digests go into one batch of this worker's own (ids
        # with the top bit set, per rank: never the scheduler's), the stores
        # refer to it, and it is dropped after them: all pipelined, one wait.
        self._wbatch += 1
        batch = (1 << 63) | (self.rank << 40) | (self._wbatch & ((1 << 40) - 1))
        seqs = []
        ids = meta.store_block_ids
        try:
            digests = b"".join(meta.store_digests)
            step = _s.MAX_HASHES_PER_RECORD * 32
            for off in range(0, len(digests), step):
                s.send(
                    _s.TYPE_PUT_HASHES,
                    _s.encode_put_hashes(batch, digests[off : off + step], 32, _s.FLAG_APPEND if off else 0),
                    wake=False,
                )
            # The batch holds every run's digests in order, and the block ids
            # in the same order make one list: one Store record for the whole
            # step (8192 pages per record at most), not one a request.
            for first in range(0, len(ids), _s.MAX_PAGES_PER_RECORD):
                chunk = ids[first : first + _s.MAX_PAGES_PER_RECORD]
                seqs.append(
                    s.submit(_s.TYPE_STORE, _s.encode_store(batch, first, len(chunk), REGION_ID, chunk), wake=False)
                )
            # The last record wakes the sidecar: the copies start now.
            s.send(_s.TYPE_DROP_HASHES, _s.encode_drop_hashes(batch), wake=True)
        except SIDECAR_ERRORS as e:
            failed: Optional[Exception] = e
        else:
            failed = None
        # The requests whose blocks these stores read: a held one is reported
        # in finished_sending once every such store of this worker ended.
        rids = meta.store_req_ids
        sr = self._store_reqs
        for rid in rids:
            sr[rid] = sr.get(rid, 0) + 1
        self._saving.append((s, seqs, time.monotonic() + self.save_timeout, rids, ids, self._step))
        if failed is not None:
            # Stores already sent may be copying: they end with the session.
            self._save_failed(failed, s)
            self._finish_saves(_POLL)
        elif not self._deferred_saves:
            self._finish_saves(_ALL)
        elif self.writes_first and meta is self._noted and meta.settle_saves:
            # get_finished saw this step's metadata before these stores were
            # sent (Model Runner V2 with a speculator stores after it): they
            # are settled here, as _settle does for the stores before them.
            self._finish_saves(_ALL)

    def _stores_ordered(self, meta: RingsideConnectorMetadata) -> bool:
        """Order the step's stores after the forward pass that wrote their
        blocks: record the store event on the engine's current stream (the
        sidecar issues the copies once it has completed: it waits for it on a
        gate stream of its own and polls that from the host), or, for GPU memory without
        one, wait for that stream here. A record that fails (no context on
        this thread, an error of the engine's context) never fails the step:
        the event is given up (the sidecar's waits on its earlier records are
        over) and the stream is waited for instead, now and in later steps;
        if that fails too, the step's stores are skipped (False): a future
        miss, never a copy of pages still being written."""
        ev = self.store_event
        if ev is not None:
            try:
                ev.record()  # on the current stream; the sidecar's copies wait for it (gated on the host)
                return True
            except Exception as e:  # noqa: BLE001 - a store is never worth the engine's step
                logger.warning(
                    "ringside: recording the store event failed (%s); the stores wait for the engine's stream "
                    "from now on",
                    e,
                )
                self.store_event, self._dead_event = None, ev
        if self.region is None or self.region.kind not in _CUDA_KINDS:
            return True
        try:
            import torch

            torch.cuda.current_stream().synchronize()
            return True
        except Exception as e:  # noqa: BLE001
            n = len(meta.store_block_ids)
            st = self.stats
            if not st["stores_skipped"]:
                logger.warning(
                    "ringside: waiting for the engine's stream failed (%s); %d blocks not stored (skipped), "
                    "and so every step's blocks while it fails (counter stores_skipped)",
                    e,
                    n,
                )
            st["stores_skipped"] += n
            return False

    def handle_preemptions(self, meta: Any) -> None:
        # vLLM calls this at the start of every step, before the step's
        # forward pass. A store's blocks are full and belong to a live
        # request, so nothing writes them again until they are freed, and a
        # finished request's are held until its stores ended (request_finished,
        # finished_sending). Blocks freed without request_finished (a
        # preempted request's, those a sliding window drops) may be handed
        # to another request by this step's schedule: the scheduler says so
        # (wait_saves) and only then does this wait for every store. That is
        # in time for the V1 runner, which writes no block before this call;
        # Model Runner V2 zeroes and copies into the step's new blocks before
        # it (update_requests), so there the stores the next schedule may
        # expose were waited for at the end of the step before (_settle,
        # settle_saves). Otherwise the copies go on through this step's
        # forward pass (overlap_saves) and are waited for at the next step at
        # the latest.
        self._step += 1
        if self._saving:
            self._finish_saves(_ALL if not self.overlap_saves() or getattr(meta, "wait_saves", True) else _LAST)

    def overlap_saves(self) -> bool:
        """Whether stores may run on through the next forward pass (when the
        scheduler allows it). Default: only for GPU memory, where the copies
        use the GPU's copy engines; host copies take the CPU cores a CPU
        forward pass needs (measured: the engine's steps got up to 2x longer
        on the project's 2-vCPU VM), so they are waited for before it."""
        o = self._overlap
        if o == "auto":
            return self.region is not None and self.region.kind in _CUDA_KINDS
        return bool(o)

    def _settle(self, meta: RingsideConnectorMetadata) -> Optional[set[str]]:
        """finished_sending (get_finished): the held requests whose stores
        all ended. The step's held requests are noted once; where the runner
        writes blocks before handle_preemptions, the stores the next schedule
        may expose (settle_saves) are waited for now; else, with requests
        held, the answered stores are collected (no wait)."""
        if meta is not self._noted:
            self._noted = meta
            for rid in meta.held_req_ids:
                if rid in self._store_reqs:
                    self._held.add(rid)
                else:  # no store of this worker read its blocks, or all ended
                    self._sent.add(rid)
        if self._saving:
            if self.writes_first and meta.settle_saves:
                self._finish_saves(_ALL)
            elif self._held:
                self._finish_saves(_POLL)
        if self._ending:
            self._poll_ending()
        if not self._sent:
            return None
        done, self._sent = self._sent, set()
        return done

    def _finish_saves(self, how: int = _ALL) -> None:
        """Collect the replies of the stores sent by wait_for_save. _ALL
        waits (bounded by save_timeout) for every one; _LAST the same, but
        the latest step's stores are only collected if answered (the rest
        stay pending one more step: the next call waits for them, as for
        everything older); _POLL waits for none (a store past its deadline
        times out). "The latest step" is the step before the one that
        calls this (handle_preemptions): a store sent earlier is waited for
        even when no newer store followed it, since the scheduler holds a
        finished request's blocks only while its last store is that recent
        (hold_steps), unless every request it read is already held. A store that ended answered (OK or not) releases the
        requests whose blocks it read; one that timed out, or whose session
        failed, releases them only once that session has ended on the
        sidecar (_ending)."""
        pending, self._saving = self._saving, []
        latest, held = self._step - 1, self._held
        for entry in pending:
            # _LAST: polled if sent in the latest step, or if every request
            # whose blocks it read is held by vLLM (request_finished): those
            # blocks stay until finished_sending, however long it takes.
            unwaited = how == _LAST and (entry[5] >= latest or all(rid in held for rid in entry[3]))
            s, seqs, deadline = entry[0], entry[1], entry[2]
            left: list = []
            ended = False
            try:
                if s is not self.link.session:
                    ended = True  # that session was given up on (_save_failed) or dropped
                elif how == _POLL or unwaited:
                    if how == _LAST:
                        self.stats["saves_unwaited"] += 1
                    for seq in seqs:
                        p = s.try_reply(seq)
                        if p is None:
                            left.append(seq)
                        else:
                            self._store_done(p)
                    if left and how == _POLL and time.monotonic() > deadline:
                        left = []
                        raise RingsideTimeout("a store got no reply in %.1fs" % self.save_timeout)
                else:
                    # The last part of the wait is kept for the Detach that
                    # ends the session if a store does not answer in time.
                    until = deadline - self._detach_share()
                    for seq in seqs:
                        left_s = max(until - time.monotonic(), 0.001)
                        self._store_done(s.await_reply(seq, timeout=left_s))
            except SIDECAR_ERRORS as e:
                self._save_failed(e, s)
                left, ended = [], True
                if how == _ALL or (how == _LAST and not unwaited):
                    self._await_detach(s, deadline)
            if left:
                self._saving.append((s, left) + entry[2:])
            elif ended:
                self._ending_of(s)[3].extend(entry[3])
            elif entry[3]:
                self._release(entry[3])
        if self._ending:
            self._poll_ending()

    def _release(self, rids: list) -> None:
        """One store that read the blocks of rids ended."""
        sr = self._store_reqs
        for rid in rids:
            n = sr.get(rid, 0) - 1
            if n > 0:
                sr[rid] = n
                continue
            sr.pop(rid, None)
            if rid in self._held:
                self._held.discard(rid)
                self._sent.add(rid)

    def _store_done(self, payload: bytes) -> None:
        rep = _s.decode_store_reply(payload)
        st = self.stats
        st["stores"] += 1
        if rep.status == _s.Status.OK:
            st["stored_blocks"] += rep.stored
            st["present_blocks"] += rep.present
        else:
            st["store_errors"] += 1

    def _save_failed(self, e: Exception, s: Optional[Session]) -> None:
        """No reply came in time, or none can come: the session s is given
        up on (the link attaches a new one) and ended with a Detach that is
        not waited for. Its stores' requests stay held until the sidecar has
        ended it (the Detach reply, or its rings closed), after which none of
        its stores can commit (docs/architecture.md, ordering rule 1), or,
        if it never answers, for write_timeout: the sidecar discards a store
        not committed by then."""
        self.stats["store_errors"] += 1
        self.stats["sidecar_errors"] += 1
        if s is not None and s is self.link.session:
            self.link.retire(e)
            self._ending_of(s)

    def _detach_share(self) -> float:
        """The part of save_timeout a waiting step keeps for the Detach."""
        return min(1.0, 0.25 * self.save_timeout)

    def _await_detach(self, s: Session, deadline: float) -> None:
        """Wait, until deadline, for the sidecar to answer the Detach of
        session s (sent by _save_failed). A step that waits for its stores
        (wait_saves, settle_saves) does so because the next writes may reach
        blocks vLLM freed without holding them (preemption, a sliding
        window): once the reply came, no store of s can commit them."""
        rec = self._ending_of(s)
        if rec[4] or rec[1] is None:
            return
        try:
            s.await_reply(rec[1], timeout=max(deadline - time.monotonic(), 0.001))
            rec[4] = True
        except SIDECAR_ERRORS:
            rec[4] = s.peer_gone

    def _ending_of(self, s: Session) -> list:
        """The _ending record of session s, made (and its Detach sent) if
        there is none: [session, Detach seq or None, hold-until time, ids of
        the requests of its stores, whether the sidecar ended it, its loads
        (request id, engine block ids, whole)]. A session dropped elsewhere
        (closed on this side) can only be held until write_timeout, unless
        the sidecar was seen gone."""
        for rec in self._ending:
            if rec[0] is s:
                return rec
        seq = s.begin_detach() if not s.closed else None
        rec = [s, seq, time.monotonic() + self.write_timeout, [], s.peer_gone, []]
        self._ending.append(rec)
        return rec

    def _poll_ending(self) -> None:
        """Release what waits for the sessions given up on, never waiting:
        the requests of their stores once the sidecar has ended the session
        (its Detach reply, or its rings closed), the requests of their loads
        once it has closed the rings (it withdraws the copies not yet issued
        before that, and sends the Detach reply before it), or both once the
        hold ran out."""
        now = time.monotonic()
        still = []
        saving = {id(e[0]) for e in self._saving}  # their stores join the record first (_finish_saves)
        for rec in self._ending:
            s, seq, until, rids, done, loads = rec
            done = rec[4] = done or s.detached(seq)
            late = now >= until
            if rids and id(s) not in saving and (done or late):
                rec[3] = []
                self._release(rids)
            if loads and (s.gone() or late):
                rec[5] = []
                self._loads_ended(loads)
            if id(s) in saving or rec[3] or rec[5] or not (done or late):
                still.append(rec)
                continue
            if not done:
                logger.warning("ringside: a session given up on was not ended in %.0fs", self.write_timeout)
            try:
                s.abandon()
            except Exception:  # noqa: BLE001 (closing must never raise)
                pass
        self._ending = still

    def shutdown(self) -> None:
        if self._saving:
            self._finish_saves()
        for rec in self._ending:
            rec[0].abandon()
        self._ending = []
        self.stats_file.write(self.stats)
        self.link.close()
