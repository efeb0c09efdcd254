"""A KV connector that does nothing: the floor for bench_vllm.py's step rows.

vLLM calls the same scheduler hooks on it as on RingsideConnector; each does
the least a valid connector can (no external hits, empty metadata), so its
per-step time is what vLLM's calls into any Python connector cost, plus the
benchmark's own timers. Loaded by worker.py --connector null with
kv_connector_module_path="null_connector" (bench/vllm is on sys.path as the
worker's script directory). It supports vLLM's hybrid memory allocator
(SupportsHMA), as RingsideConnector does, so that a model with several KV
cache groups runs with the same groups under both.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.stats = {"lookups": 0, "hit_blocks": 0, "sidecar_errors": 0, "planned_stores": 0}

    # Scheduler side.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        return False, None

    # Worker side.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        return None
