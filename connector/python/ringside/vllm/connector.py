"""The vLLM connector class: a thin KVConnectorBase_V1 that dispatches, by
role, to the scheduler side (scheduler.py) or the worker side (worker.py),
as vLLM's own NixlConnector does."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..plugin.config import VLLM, Config
from .engine import hash_seed_warning, namespace, tp_rank
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("ringside.vllm")


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
        # A misspelled or mistyped key fails the engine's start here.
        cfg = Config.parse(kvt.kv_connector_extra_config, VLLM)
        self.config = cfg
        model, layout, world = namespace(vllm_config)
        self.instance = str(getattr(kvt, "engine_id", None) or cfg.instance or "vllm-%d" % os.getppid())
        attach = dict(
            instance=self.instance, model=model, layout=layout, salt=cfg.tenant, world_size=world, digest_width=32
        )
        if getattr(kvt, "kv_load_failure_policy", "recompute") != "recompute":
            # A cache failure must never fail a request: recompute instead.
            try:
                kvt.kv_load_failure_policy = "recompute"
                logger.info("ringside: kv_load_failure_policy set to 'recompute'")
            except Exception:  # noqa: BLE001
                logger.warning(
                    "ringside: could not set kv_load_failure_policy=recompute; set it in "
                    "--kv-transfer-config so that a cache failure never fails a request"
                )
        self.connector_scheduler: Optional[SchedulerSide] = None
        self.connector_worker: Optional[WorkerSide] = None
        self._group_ids: Optional[tuple] = None
        if role == KVConnectorRole.SCHEDULER:
            warn = hash_seed_warning(vllm_config)
            if warn:
                logger.warning("ringside: %s", warn)
            speculative = getattr(vllm_config, "speculative_config", None) is not None
            self.connector_scheduler = SchedulerSide(cfg, attach, int(vllm_config.cache_config.block_size), speculative)
        else:
            deferred = "handle_preemptions" in vars(KVConnectorBase_V1)
            self.connector_worker = WorkerSide(cfg, attach, tp_rank(), deferred)
        logger.info("ringside: %s connector for instance %s (%s, %s)", role.name.lower(), self.instance, model, layout)

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
            self.connector_scheduler.kv_cache_manager = kv_cache_manager

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

    # -- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

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
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    # -- both --------------------------------------------------------------------

    def shutdown(self):
        self.side.shutdown()
