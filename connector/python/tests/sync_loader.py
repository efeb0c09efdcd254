"""A synchronous loader whose loads fail: a vLLM KV connector (the
KVConnectorBase_V1 interface, as vLLM's own ExampleConnector loads: in
start_load_kv, inside the step) that claims the first LOAD_BLOCKS blocks of
every new request as an external hit, loads nothing into them, and reports
them in get_block_ids_with_load_errors after the step, as a synchronous
loader does when its load failed. It is the fault the MultiConnector tests
inject: vLLM's scheduler then truncates the request's computed tokens and
recomputes the blocks; a connector beside it must not have stored them in
between (their bytes are whatever the blocks held)."""

from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

LOAD_BLOCKS = 2


class FailedLoads(KVConnectorMetadata):
    def __init__(self, block_ids: list[int]):
        self.block_ids = block_ids


class NoHMASyncLoader(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._claimed: set[str] = set()
        self._pending: list[int] = []
        self._failed: set[int] = set()
        self.failed_blocks = 0  # worker side: blocks reported failed

    # -- scheduler side --
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        want = LOAD_BLOCKS * self.block_size
        if request.request_id in self._claimed or num_computed_tokens >= want or request.num_tokens <= want:
            return 0, False
        return want - num_computed_tokens, False  # a synchronous load

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self._claimed.add(request.request_id)
        ids = blocks.get_block_ids()[0]
        self._pending.extend(ids[:LOAD_BLOCKS])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._pending = FailedLoads(self._pending), []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        return False, None

    # -- worker side --
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FailedLoads)
        self._failed.update(meta.block_ids)  # loaded nothing: failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        self.failed_blocks += len(failed)
        return failed


class FailingSyncLoader(NoHMASyncLoader, SupportsHMA):
    """The loader, with vLLM's hybrid memory allocator supported (vLLM's
    MultiConnector refuses to start under it unless every child does)."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict]]:
        return False, None
