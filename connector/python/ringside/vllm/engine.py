"""What the connector reads from vLLM: the namespace of its blocks, the
worker's shard, and facts about the KV cache manager."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from ..plugin.namespace import fingerprint, safe
from .groups import Layout

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


def namespace(
    vllm_config: "VllmConfig", layout: Optional[Layout] = None, kv_cache_config: Any = None
) -> tuple[str, str, int]:
    """(model, layout fingerprint, world size): everything that changes the
    bytes of a block, so that two engines share blocks only when the bytes
    mean the same thing. A layout of several KV cache groups (groups.py)
    adds their structure; the plain one leaves the fingerprint as it was."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
    model = str(getattr(mc, "model", "")) + "@" + str(getattr(mc, "revision", None) or "")
    parts = {
        "dtype": str(getattr(mc, "dtype", "")),
        "kv_dtype": str(getattr(cc, "cache_dtype", "")),
        "block": int(cc.block_size),
        "hash": algo,
        "layers": safe(lambda: mc.get_num_layers(pc)),
        "kv_heads": safe(lambda: mc.get_num_kv_heads(pc)),
        "head": safe(lambda: mc.get_head_size()),
        "tp": int(pc.tensor_parallel_size),
        "pp": int(pc.pipeline_parallel_size),
        "device": str(getattr(vllm_config.device_config, "device_type", "")),
        # A page is every layer's block in layer-index order (plugin/region.py,
        # layer_order): another order would be other bytes under one name.
        "page": "layer-index",
        # The order within a layer's block (tokens, heads, channels: NHC or
        # HNC), which the attention backend decides (vLLM's resolved
        # KVCacheLayout): the same block in another order is other bytes.
        "within": within_block(vllm_config, kv_cache_config),
    }
    part = layout.fingerprint_part() if layout is not None else None
    if part is not None:
        parts["groups"] = part
    # Every tensor- and pipeline-parallel worker holds its own shard of a
    # block: a block is present only when all of them stored theirs.
    return model, fingerprint(parts), int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def within_block(vllm_config: Any, kv_cache_config: Any) -> str:
    """The order of a layer's block in vLLM's resolved KV cache layout (its
    name without the layer and block axes, L and B: "NHC", "HNC"); "" when
    vLLM has not resolved one (releases or engines without the layout)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        getattr(vllm_config, "cache_config", None), "kv_cache_layout", None
    )
    if not isinstance(name, str):
        name = getattr(name, "name", None) or ""
    return "".join(c for c in name if c not in "LB")


def hash_seed_warning(vllm_config: "VllmConfig") -> Optional[str]:
    """The setting that makes vLLM's block hashes differ across restarts."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        return (
            "prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM seeds its block hashes "
            "randomly per process, so blocks stored by one engine process are never hits for "
            "another (or after a restart). Set PYTHONHASHSEED to the same value on every engine, "
            "or use sha256 / sha256_cbor." % algo
        )
    return None


def tp_rank() -> int:
    """This worker's shard index: pp_rank * tp_size + tp_rank."""
    try:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        rank, tp = int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
        try:
            pp_rank = int(get_pp_group().rank_in_group)
        except Exception:  # noqa: BLE001 - no pipeline group
            pp_rank = 0
        return pp_rank * tp + rank
    except Exception:  # noqa: BLE001 - not initialised: a single worker
        return 0


def single_group_blocks(kvm: Any) -> Optional[dict]:
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


def full_attention_only(kvm: Any) -> bool:
    """Whether every KV cache group is plain full attention: then a full
    block of a live request is never freed before the request finishes or
    is preempted (other kinds, e.g. sliding windows, free blocks earlier)."""
    try:
        managers = kvm.coordinator.single_type_managers
        return len(managers) > 0 and all(type(m).__name__ == "FullAttentionManager" for m in managers)
    except AttributeError:
        return False


def writes_before_preemptions(kvm: Any, hash_block: int) -> bool:
    """Whether Model Runner V2 may write blocks of a step before it calls
    handle_preemptions (update_requests): zeroing its new blocks (a manager
    records them for the worker: mamba layers, a mixed-precision KV cache;
    vLLM's needs_kv_cache_zeroing), or a copy-on-write of a prefix hit that
    ends inside a block (a group whose blocks are larger than a hash block).
    Neither: every write of a step comes after handle_preemptions, as with
    the V1 runner. True where the manager cannot tell."""
    try:
        managers = kvm.coordinator.single_type_managers
        return any(bool(m.records_new_block_ids) or int(m.block_size) > hash_block for m in managers)
    except (AttributeError, TypeError, ValueError):
        return True


def new_blocks(so: Any) -> Any:
    """The block ids a schedule allocated (every KV cache group): a new
    request's blocks (those of its prefix-cache hit too), and the blocks
    added to a scheduled one (all of a resumed one's). Only these can be
    written by the step: a stored block is full, so nothing writes it again
    while its request holds it."""
    for nr in so.scheduled_new_reqs:
        for ids in nr.block_ids or ():
            yield from ids
    for nb in so.scheduled_cached_reqs.new_block_ids:
        if nb:
            for ids in nb:
                yield from ids


def group_tables(kvm: Any, gids: list) -> Optional[list]:
    """The KV cache manager's request -> blocks tables of the KV cache
    groups gids (in that order), for the store planner of a model with
    several groups; None (use SchedulerOutput.kv_connector_block_state)
    where the manager does not have them."""
    try:
        managers = kvm.coordinator.single_type_managers
        tables = [managers[g].req_to_blocks for g in gids]
    except (AttributeError, IndexError):
        return None
    return tables if all(isinstance(t, dict) for t in tables) else None


def null_block_id(kvm: Any) -> int:
    """The id of vLLM's null block (block tables hold it for blocks a
    sliding window does not need)."""
    try:
        return int(kvm.block_pool.null_block.block_id)
    except AttributeError:
        return 0
