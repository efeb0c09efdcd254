"""The connector inside vLLM's own MultiConnector, beside a real second
connector, in both positions.

The second connector is vLLM's OffloadingConnector (its CPU tier, with the
device copy replaced by a host copy: bench/vllm/hostcopy_spec.py, as in the
peer benchmarks), or a second RingsideConnector on a second sidecar (a
connector that, like ringside, holds a finished request's blocks until its
stores end). The engine is vllm_harness's: vLLM's scheduler, the workers in
this process, real KV cache tensors, real sidecars.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable
from conftest import REPO_ROOT
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from ringside.vllm import RingsideConnector

# The offloading connector's spec (its spec_module_path), imported by vLLM.
sys.path.append(os.path.join(REPO_ROOT, "bench", "vllm"))


def ringside_child(sock: str, **extra: Any) -> dict:
    cfg = {"socket": sock, "timeout": 2.0, "reattach_interval": 0.05, "max_wait_us": 200000}
    cfg.update(extra)
    return dict(
        kv_connector="RingsideConnector",
        kv_connector_module_path="ringside.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=cfg,
    )


def offloading_child() -> dict:
    return dict(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "HostCopySpec",
            "spec_module_path": "hostcopy_spec",
            "cpu_bytes_to_use": 1 << 20,
        },
    )


class Adapter:
    """What H.Engine reads of its connector, for a MultiConnector; it keeps
    every event of the combined stream vLLM's scheduler takes (once a step,
    in update_from_output) in events."""

    def __init__(self, multi: MultiConnector):
        self.multi = multi
        self.events: list = []
        take = multi.take_events

        def take_events():
            evs = list(take())
            self.events += evs
            return evs

        multi.take_events = take_events

    def take_events(self):
        return self.multi.take_events()

    def shutdown(self):
        self.multi.shutdown()


class MultiEngine(H.Engine):
    """H.Engine with a MultiConnector of the given children."""

    def __init__(
        self,
        children: list,
        num_blocks: int = 64,
        policy: Optional[str] = None,
        groups: Optional[list] = None,
        **sched_kw: Any,
    ):
        import torch

        self.vc = H.vllm_config({}, **sched_kw)
        kw: dict = dict(
            kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": children}
        )
        if policy is not None:
            kw["kv_load_failure_policy"] = policy
        self.vc.kv_transfer_config = KVTransferConfig(**kw)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.kv_cache_config = kcc = H.kv_cache_config(num_blocks, groups)
        self.sched = Scheduler(
            vllm_config=self.vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=H.BLOCK,
        )
        multi = self.sched.connector
        assert isinstance(multi, MultiConnector), type(multi)
        self.conn: Any = Adapter(multi)
        self.worker = MultiConnector(self.vc, KVConnectorRole.WORKER, kcc)
        self.groups = kcc.kv_cache_groups
        # Blocks first (the offloading connector's worker views dimension 0
        # as the blocks); the harness writes through the (2, blocks, ...) view.
        base = [torch.zeros(num_blocks, 2, H.BLOCK, H.HEADS, H.HEAD, dtype=torch.float32) for _ in range(H.LAYERS)]
        self.tensors = [t.permute(1, 0, 2, 3, 4) for t in base]
        # As in H.Engine: the i-th layer of every group shares one tensor.
        self.kv = {name: self.tensors[i] for g in self.groups for i, name in enumerate(g.layer_names)}
        self.null_id = self.sched.kv_cache_manager.block_pool.null_block.block_id
        self.worker.register_kv_caches({name: base[i] for g in self.groups for i, name in enumerate(g.layer_names)})
        self.steps = 0
        self.metas: list = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.checked_blocks = 0
        self.params: dict = {}  # request id -> kv_transfer_params of its last output

    def step(self, on_meta: Optional[Any] = None) -> Any:
        """H.Engine.step, with the workers' own metadata for the scheduler
        (build_connector_worker_meta: the offloading connector reports its
        finished stores with it) and every output's kv_transfer_params kept."""
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        if on_meta is not None:
            on_meta(so, meta)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        sync = getattr(so, "has_sync_kv_loads", True)  # as vLLM's runners (vllm_harness.Engine.step)
        if sync:
            w.start_load_kv(None)
        toks = self._forward(so)
        if not sync:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        for t in self.tensors:
            assert not t[:, self.null_id].any(), "the null block was written"
        rids = list(so.num_scheduled_tokens)
        kvo = H.KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=wmeta,
        )
        mro = H.runner_output(rids, [toks[r] for r in rids], kvo)
        for out in self.sched.update_from_output(so, mro).values():
            for o in out.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.finished.add(o.request_id)
                    self.params[o.request_id] = o.kv_transfer_params
        self.conn.take_events()
        self.steps += 1
        return so

    def ringside(self, i: int = 0) -> tuple[RingsideConnector, RingsideConnector]:
        """The i-th RingsideConnector child: (scheduler side, worker side)."""
        s = [c for c in self.conn.multi._connectors if isinstance(c, RingsideConnector)]
        w = [c for c in self.worker._connectors if isinstance(c, RingsideConnector)]
        return s[i], w[i]

    @property
    def stats(self) -> dict:
        return self.ringside()[0].stats

    @property
    def wstats(self) -> dict:
        return self.ringside()[1].stats


def prompts(tag: str, n: int = 3) -> list:
    """n requests of 50-token prompts (3 full blocks), the same for every tag."""
    return [H.request("%s%d" % (tag, i), H.prompt(100 + i, 50)) for i in range(n)]


def children(sock: str, first: str, **extra: Any) -> list:
    kids = [ringside_child(sock, **extra), offloading_child()]
    return kids if first == "ringside" else kids[::-1]


def ringside_meta(eng: MultiEngine, meta: Any) -> Any:
    """Ringside's part of the step's MultiKVConnectorMetadata."""
    i = next(j for j, c in enumerate(eng.conn.multi._connectors) if isinstance(c, RingsideConnector))
    return meta.metadata[i]


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["ringside", "offloading"])
def test_hits_in_either_position(start_sidecar, first):
    """The first connector with a hit loads it (vLLM's rule); ringside adds
    no kv_transfer_params of its own, and never plans a store of a block
    while a connector is still loading into it."""
    sc = start_sidecar(metrics=True)
    eng = MultiEngine(children(sc.sock, first))
    eng.run(prompts("a"))
    assert eng.wstats["stored_blocks"] == 9, eng.wstats
    assert eng.sched.reset_prefix_cache()  # the second round hits the connectors, not vLLM's own cache
    loading: list = []

    def on_meta(so, meta):
        waiting: set = set()
        for rid, req in eng.sched.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                loading.append(rid)
                waiting.update(eng._block_ids(rid))
        bad = waiting & set(ringside_meta(eng, meta).store_block_ids)
        assert not bad, "stores planned into blocks still loading: %s" % sorted(bad)

    reqs = prompts("b")
    eng.run(reqs, on_meta=on_meta)
    eng.shutdown()
    assert loading, "no request waited for a load"
    assert eng.checked_blocks > 0
    want_loaded = 9 if first == "ringside" else 0
    assert eng.wstats["loaded_blocks"] == want_loaded and eng.wstats["load_error_blocks"] == 0, eng.wstats
    assert set(eng.params) == {r.request_id for r in prompts("a") + reqs}
    assert all(p is None for p in eng.params.values()), eng.params


@pytest.mark.parametrize("first", ["ringside", "offloading", "pair"])
def test_load_failure_is_recomputed(start_sidecar, first):
    """A ringside load that fails is recomputed, never a failed request, in
    a MultiConnector too: vLLM's scheduler reads kv_load_failure_policy
    from the MultiConnector's own configuration (default "fail"), so the
    connector sets it there. (pair: beside a second ringside connector on
    a sidecar without the blocks.)"""
    sc = start_sidecar(metrics=True)
    eng = MultiEngine([ringside_child(sc.sock)])  # stores only ringside's copy
    eng.run(prompts("a"))
    eng.shutdown()
    if first == "pair":
        eng = MultiEngine([ringside_child(sc.sock), ringside_child(start_sidecar().sock)])
    else:
        eng = MultiEngine(children(sc.sock, first))
    broken: list = []

    def break_loads(so, meta):
        for spec in ringside_meta(eng, meta).loads:
            if spec.req_id not in broken:  # each request's first load fails
                broken.append(spec.req_id)
                spec.error_block_ids, spec.block_ids = list(spec.block_ids), []

    reqs = prompts("b")
    eng.run(reqs, on_meta=break_loads)
    eng.shutdown()
    assert broken and eng.wstats["load_error_blocks"] > 0, eng.wstats
    assert not any(r.status == RequestStatus.FINISHED_ERROR for r in reqs), [r.status for r in reqs]
    assert all(len(eng.outputs[r.request_id]) == 8 for r in reqs), eng.outputs
    assert eng.conn.multi._kv_transfer_config.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("other", ["ringside", "offloading"])
def test_frees_wait_for_every_holding_connector(start_sidecar, other):
    """Beside a second connector that also holds a finished request's blocks
    until its own stores end (a second ringside, on a second sidecar), and
    beside one that holds none (the offloading connector): vLLM frees a
    finished request's blocks once every holder reported it in
    finished_sending (the MultiConnector counts them), and never while a
    store of ringside's may still read them."""
    sc = start_sidecar(metrics=True)
    if other == "ringside":
        second = start_sidecar(metrics=True)
        kids = [ringside_child(sc.sock), ringside_child(second.sock)]
    else:
        kids = [offloading_child(), ringside_child(sc.sock)]
    eng = MultiEngine(kids, num_blocks=24, max_num_batched_tokens=64)
    multi = eng.conn.multi
    pool = eng.sched.kv_cache_manager.block_pool
    workers = [w.connector_worker for w in eng.worker._connectors if isinstance(w, RingsideConnector)]
    seen = {"extra": 0, "held": 0}
    orig = multi._aggregate_request_finished

    def aggregate(request, fn):
        held, params = orig(request, fn)
        seen["held"] += held
        seen["extra"] += request.request_id in multi._extra_async_saves
        return held, params

    multi._aggregate_request_finished = aggregate

    def on_meta(so, meta):
        for cw in workers:
            free = {b for e in cw._saving for b in e[4] if pool.blocks[b].ref_cnt == 0}
            assert not free, "blocks %s are free while a store may read them" % sorted(free)

    reqs = [H.request("p%d" % i, H.prompt(10 + i, 47 + 3 * i), max_tokens=20) for i in range(5)]
    eng.run(reqs, on_meta=on_meta)
    for _ in range(5):  # the last finished_sending
        eng.step(on_meta)
    assert seen["held"] > 0
    if other == "ringside":
        assert seen["extra"] > 0, "no request was held by both connectors"
    assert not multi._extra_async_saves
    assert not multi.has_pending_block_frees()
    assert pool.get_num_free_blocks() == 23, "blocks never freed"
    eng.shutdown()


@pytest.mark.parametrize("first", ["ringside", "offloading"])
def test_events_in_the_combined_stream(start_sidecar, first):
    """The sidecar's tier (kv_events) reaches vLLM through the
    MultiConnector's take_events, in either position: a BlockStored of
    every block ringside stored (and none without kv_events)."""
    from vllm.distributed.kv_events import BlockStored

    sc = start_sidecar(metrics=True)
    got = {}
    for on in (False, True):
        eng = MultiEngine(children(sc.sock, first, kv_events=on, kv_events_poll_ms=1, mirror=False))
        reqs = [H.request("%s%d" % ("e" if on else "n", i), H.prompt(200 + 10 * on + i, 50)) for i in range(3)]
        eng.run(reqs)
        want = {int.from_bytes(h[-8:], "big") for r in reqs for h in r.block_hashes[:3]}
        deadline = time.monotonic() + 10  # the sidecar's event log is polled every kv_events_poll_ms
        while True:
            hs = {h for e in eng.conn.events if isinstance(e, BlockStored) for h in e.block_hashes}
            if not on or want <= hs or time.monotonic() > deadline:
                break
            eng.step()
            time.sleep(0.002)
        got[on] = (want, hs)
        eng.shutdown()
    assert not got[False][1], "events without kv_events"
    want, hs = got[True]
    assert want <= hs, "blocks stored but not announced: %d of %d" % (len(want - hs), len(want))


@pytest.mark.parametrize("groups", [None, ["full", "64"]], ids=["one-group", "hybrid"])
def test_no_store_of_blocks_a_failed_sync_load_left(start_sidecar, groups):
    """A synchronous loader ahead of ringside (tests/sync_loader.py) claims
    two blocks of each request and fails to load them: vLLM learns it from
    the step's output, after the workers stored what the step planned, and
    recomputes. Ringside stores those blocks only once vLLM has seen the
    failure, so what the sidecar holds are the recomputed bytes: a fresh
    engine loads the prompts from it and checks every loaded block's bytes
    (vllm_harness); before, it stored the never-loaded blocks (zeros)."""
    sc = start_sidecar(metrics=True)
    loader = dict(kv_connector="FailingSyncLoader", kv_connector_module_path="sync_loader", kv_role="kv_both")
    eng = FailedLoadEngine([loader, ringside_child(sc.sock, mirror=False)], policy="recompute", groups=groups)
    reqs = prompts("f")
    if groups is not None:
        # Several KV cache groups: vLLM accepts no block-level load failure
        # (a synchronous loader's), so no step runs on with blocks a failed
        # load left. Should vLLM start to, ringside's rule must cover the
        # groups' planner too (store_plan._check_groups).
        with pytest.raises(RuntimeError, match="not supported for models with multiple KV cache groups"):
            eng.run(reqs)
        eng.shutdown()
        return
    eng.run(reqs)
    eng.shutdown()
    failed = sum(c.failed_blocks for c in eng.worker._connectors if hasattr(c, "failed_blocks"))
    assert failed == 2 * len(reqs), failed  # every request's load failed ...
    assert eng.garbage, "no step read the blocks the loader left"  # ... and left other bytes
    assert eng.stats["deferred_external_blocks"] >= 2 * len(reqs), eng.stats
    assert eng.wstats["stored_blocks"] == 3 * len(reqs), eng.wstats
    probe = H.Engine(sc.sock, extra={"mirror": False})
    try:
        probe.run(prompts("f"))  # the same prompts: hits, every loaded block's bytes checked
        assert probe.wstats["loaded_blocks"] == 3 * len(reqs) and probe.checked_blocks >= 3 * len(reqs)
    finally:
        probe.shutdown()


class FailedLoadEngine(MultiEngine):
    """MultiEngine whose model stand-in notes, instead of failing on, the
    blocks a failed load left with other bytes (vLLM recomputes them)."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.garbage = 0

    def _check_prefix(self, req: Any, start: int) -> None:
        try:
            super()._check_prefix(req, start)
        except AssertionError:
            self.garbage += 1


def test_beside_a_connector_without_the_hybrid_allocator(start_sidecar):
    """With vLLM's hybrid memory allocator on, a MultiConnector whose other
    child does not implement SupportsHMA is refused at start, with the
    setting that turns the allocator off named; ringside (which does) is not
    the reason."""
    sc = start_sidecar()
    loader = dict(kv_connector="NoHMASyncLoader", kv_connector_module_path="sync_loader", kv_role="kv_both")
    with pytest.raises(ValueError, match="does not support HMA.*--disable-hybrid-kv-cache-manager"):
        MultiEngine([ringside_child(sc.sock), loader])
    MultiEngine([ringside_child(sc.sock), ringside_child(sc.sock)]).shutdown()  # both support it
