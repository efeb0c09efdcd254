"""The vLLM connector class: a thin KVConnectorBase_V1 that dispatches, by
role, to the scheduler side (scheduler.py) or the worker side (worker.py),
as vLLM's own NixlConnector does.

It implements SupportsHMA, so vLLM keeps its hybrid memory allocator on:
models with several KV cache groups (sliding windows beside full attention)
are served group by group (groups.py). A model with a group kind the
connector cannot serve (mamba, ...) is refused: the connector logs why and
stays out of the way (:class:`Unserved`), the engine serves it uncached."""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # vLLM before the hybrid memory allocator's connector API

    class SupportsHMA:  # type: ignore[no-redef]
        pass


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM without failed_recving
    KVConnectorTransferResults = None

from ..plugin.config import VLLM, Config
from ..plugin.stats import counters
from . import access, versions
from . import events as kv_events
from .engine import hash_seed_warning, namespace, tp_rank
from .groups import layout_of
from .metadata import RingsideConnectorMetadata
from .scheduler import COUNTERS, EngineLimits, SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("ringside.vllm")


class RingsideConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector whose cache lives in a ringside sidecar."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is only a future miss

    _ringside = True  # access.required_layout: a call of its own, not another connector's

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """A block-outermost layout ("BLNHC": a page is one run of memory)
        on CUDA engines with 16-token blocks, as the only connector; None
        (vLLM's choice) elsewhere (access.required_layout says why)."""
        return access.required_layout(vllm_config)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34 and later: how the sidecar reaches the device KV cache,
        as the plugin key kv_cache_access chooses: by file descriptor from
        vLLM's extensible KV cache, or through legacy CUDA IPC with that
        cache off (access.py; docs/vllm.md, GPU engines)."""
        return access.declared(kv_transfer_config)

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        # Another vLLM release than those supported stops the engine's start here.
        versions.check(str(getattr(vllm, "__version__", "")))
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM versions whose base class takes (vllm_config, role)
            super().__init__(vllm_config, role)
        kvt = vllm_config.kv_transfer_config
        # A misspelled or mistyped key fails the engine's start here.
        cfg = Config.parse(kvt.kv_connector_extra_config, VLLM)
        self.config = cfg
        # The model's KV cache groups as the connector serves them.
        self.layout = groups = layout_of(vllm_config, kv_cache_config)
        model, layout, world = namespace(vllm_config, groups, kv_cache_config)
        self.instance = str(getattr(kvt, "engine_id", None) or cfg.instance or "vllm-%d" % os.getppid())
        attach = dict(
            instance=self.instance, model=model, layout=layout, salt=cfg.tenant, world_size=world, digest_width=32
        )
        # A cache failure must never fail a request: recompute instead. Inside
        # vLLM's MultiConnector the engine reads the policy from the
        # MultiConnector's own configuration, not from this child's copy.
        recompute_on_failure(kvt, "")
        for outer in enclosing_transfer_configs():
            recompute_on_failure(outer, " (of the MultiConnector around this connector)")
        self.connector_scheduler: Optional[SchedulerSide | Unserved] = None
        self.connector_worker: Optional[WorkerSide | Unserved] = None
        self._group_ids: Optional[tuple] = None
        self.refused = groups.refusal
        if self.refused:
            # Never a wrong hit: a group that cannot be served makes every
            # hit of the model wrong, so the connector serves none.
            side = Unserved(role)
            if role == KVConnectorRole.SCHEDULER:
                logger.warning(
                    "ringside: this model is served without the cache: %s. "
                    "Served kinds: full attention and sliding windows (see docs/vllm.md, Model families)",
                    self.refused,
                )
                self.connector_scheduler = side
            else:
                self.connector_worker = side
            return
        if role == KVConnectorRole.SCHEDULER:
            warn = hash_seed_warning(vllm_config)
            if warn:
                logger.warning("ringside: %s", warn)
            speculative = getattr(vllm_config, "speculative_config", None) is not None
            bs = int(vllm_config.cache_config.block_size)
            events = None
            if kv_events.enabled(cfg, vllm_config):  # the sidecar's tier in vLLM's KV event stream
                events = kv_events.KVEvents(cfg, bs, kv_cache_config, groups)
            limits = EngineLimits.of(vllm_config)
            self.connector_scheduler = SchedulerSide(cfg, attach, bs, speculative, groups, events, limits)
            self._bind_hooks()
        else:
            deferred = "handle_preemptions" in vars(KVConnectorBase_V1)
            self.connector_worker = WorkerSide(cfg, attach, tp_rank(), deferred, engine_blocks(kv_cache_config))
            self.connector_worker.writes_first = writes_before_hook(vllm_config)
        logger.info("ringside: %s connector for instance %s (%s, %s)", role.name.lower(), self.instance, model, layout)
        if not groups.plain and role == KVConnectorRole.SCHEDULER:
            logger.info("ringside: KV cache groups served: %s", ", ".join(map(repr, groups.groups)))

    # The scheduler hooks that the connector forwards to its scheduler side
    # unchanged: _bind_hooks binds them over the forwarding methods below.
    SCHEDULER_HOOKS = (
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "take_events",
        "update_connector_output",
        "request_finished",
        "has_pending_block_frees",
    )

    def _bind_hooks(self) -> None:
        """Bind each scheduler hook, once, to the scheduler side's own
        method (a performance idiom, ringside/hot_paths.py: the methods below
        do the same through one more call, and the step benchmark measured
        the forwarding at 1.1-1.3x the connector's time per step on the
        project's 2-vCPU machine). vLLM with the hybrid allocator calls
        request_finished_all_groups instead of request_finished: the same."""
        side = self.connector_scheduler
        assert side is not None
        bound = [(name, getattr(side, name)) for name in self.SCHEDULER_HOOKS]
        bound.append(("request_finished_all_groups", side.request_finished))
        for name, hook in bound:
            setattr(self, name, hook)

    # The running side's state, for tests, benchmarks and operators.

    @property
    def side(self) -> Any:
        return self.connector_scheduler if self.connector_scheduler is not None else self.connector_worker

    @property
    def stats(self) -> dict:
        return self.side.stats

    @property
    def link(self) -> Any:
        return self.side.link

    @property
    def mirror(self) -> Any:
        """The local index (ringside.mirror.Mirror) of the scheduler side, or None."""
        sc = self.connector_scheduler
        return sc.mirror if sc is not None else None

    # -- scheduler side ----------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: "Request") -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # vLLM asks for every request with a hit; the answer never changes.
        g = self._group_ids
        if g is None:
            g = self._group_ids = tuple(super().get_loaded_kv_cache_group_ids(request))
        return g

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def take_events(self):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.take_events()

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict]]:
        # vLLM with the hybrid allocator calls this instead of request_finished:
        # the same (True holds every group's blocks until finished_sending).
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.has_pending_block_frees()

    # -- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33 and later, before sleep mode releases the KV cache memory.
        assert self.connector_worker is not None
        self.connector_worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        # vLLM 0.33 and later, after wake-up: the same tensors, their memory remapped.
        assert self.connector_worker is not None
        self.connector_worker.restore_kv_caches()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are stored whole in wait_for_save, after the forward pass

    def wait_for_save(self):
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        # With the step's metadata (still bound: both runners clear it after
        # this call), whose held requests the workers report when released.
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids, getattr(self, "_connector_metadata", None))

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # Block ids are unique only within a KV cache group: a load of several
        # groups that failed is reported as the request's (failed_recving),
        # never as block ids (which vLLM refuses for such models).
        sending, recving = self.get_finished(finished_req_ids)
        recving = set(recving or ())
        w = self.connector_worker
        failed = w.take_failed(recving) if w is not None else set()
        if KVConnectorTransferResults is None:  # pragma: no cover - older vLLM calls get_finished
            return sending, recving
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=recving, failed_recving=failed
        )

    # -- both --------------------------------------------------------------------

    def shutdown(self):
        self.side.shutdown()


def recompute_on_failure(kvt: Any, where: str) -> None:
    """Set kv_load_failure_policy to recompute in the KV transfer configuration kvt."""
    if getattr(kvt, "kv_load_failure_policy", "recompute") == "recompute":
        return
    try:
        kvt.kv_load_failure_policy = "recompute"
        logger.info("ringside: kv_load_failure_policy%s set to 'recompute'", where)
    except Exception:  # noqa: BLE001
        logger.warning(
            "ringside: could not set kv_load_failure_policy%s to recompute; set it in "
            "--kv-transfer-config so that a cache failure never fails a request",
            where,
        )


def enclosing_transfer_configs(depth: int = 8) -> list:
    """The KV transfer configurations of the connectors whose constructors
    are constructing this one: vLLM's MultiConnector builds its children in
    its __init__, each with a copy of the configuration, and the engine's
    scheduler reads kv_load_failure_policy from the MultiConnector's own.
    Found in the calling frames (at most depth of them); [] outside one."""
    out: list = []
    f: Optional[FrameType] = sys._getframe(2)  # the caller of RingsideConnector.__init__
    for _ in range(depth):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if isinstance(obj, KVConnectorBase_V1) and not isinstance(obj, RingsideConnector):
            kvt = getattr(obj, "_kv_transfer_config", None)
            if kvt is not None and all(kvt is not k for k in out):
                out.append(kvt)
        f = f.f_back
    return out


def engine_blocks(kv_cache_config: Any) -> Optional[int]:
    """The engine's block count (the scheduler's block ids are below it),
    None where vLLM gives the connector no KV cache configuration."""
    n = getattr(kv_cache_config, "num_blocks", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def writes_before_hook(vllm_config: Any) -> bool:
    """Whether the engine's model runner writes blocks (zeroes new ones,
    copies into them) before it calls handle_preemptions: Model Runner V2
    does (update_requests comes first), the V1 runner does not. vLLM 0.32
    and 0.33 say which runner runs (use_v2_model_runner); 0.34 has only
    Model Runner V2 (on CPU too) and no such property. Unknown counts as
    yes (the workers then settle exposed stores at the step's end)."""
    try:
        return bool(vllm_config.use_v2_model_runner)
    except Exception:  # noqa: BLE001 - no property (vLLM 0.34 and later): V2 is the only runner
        return True


class Unserved:
    """Both sides of the connector for a model it refuses (groups.py): no
    sidecar, no lookups, no stores; vLLM serves the model on its own."""

    def __init__(self, role: KVConnectorRole):
        self.stats = counters(COUNTERS, role=role.name)
        self.link = None
        self.mirror = None
        self.kv_cache_manager: Any = None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> RingsideConnectorMetadata:
        return RingsideConnectorMetadata()

    def take_events(self):
        return ()

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict]]:
        return False, None

    def has_pending_block_frees(self) -> bool:
        return False

    def register_kv_caches(self, kv_caches: dict) -> None:
        return

    def unregister_kv_caches(self) -> None:
        return

    def restore_kv_caches(self) -> None:
        return

    def start_load_kv(self, meta: Any) -> None:
        return

    def wait_for_save(self, meta: Any) -> None:
        return

    def handle_preemptions(self, meta: Any) -> None:
        return

    def get_finished(self, finished_req_ids: set, meta: Any = None) -> tuple[None, None]:
        return None, None

    def take_failed(self, recving: set) -> set:
        return set()

    def get_block_ids_with_load_errors(self) -> set:
        return set()

    def shutdown(self) -> None:
        return
