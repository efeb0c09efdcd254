"""What the connector tells vLLM 0.34 and later about how the sidecar
reaches the device KV cache (``KVConnectorBase_V1.kv_cache_access``).

vLLM 0.34 allocates a CUDA engine's KV cache with the driver's virtual
memory API by default (its "extensible" KV cache), which legacy CUDA IPC
cannot export, and asks each connector what it needs
(vllm/config/kv_transfer.py, ``KVCacheAccess``). The plugin key
``kv_cache_access`` chooses (docs/vllm.md, "GPU engines"):

- ``exports_fd`` (default): ``EXPORTS_FD``. vLLM keeps its extensible cache
  and allocates each segment exportable as a POSIX file descriptor, which
  the workers send to the sidecar (plugin/region.py, REGION_CUDA_FD). vLLM
  refuses to start with it where the extensible cache cannot be on (a
  cache sized by hand, elastic EP, the cache turned off): the connector
  says so first, naming the key.
- ``legacy_ipc``: ``LEGACY_IPC``. vLLM turns its extensible cache off and
  allocates as 0.33 did; the workers share it through CUDA IPC.

Only a CUDA engine has either to ask for: elsewhere (the CPU build, ROCm)
the connector declares ``IN_PROCESS``, as the sidecar's other copy paths
need nothing from vLLM's allocator (and vLLM refuses EXPORTS_FD where its
extensible cache is unsupported).

vLLM passes the connector's own transfer configuration only, so the
reasons a choice cannot work are read from the configuration vLLM is
resolving, found in the calling frames; where they cannot be found (a
later vLLM), vLLM's own message stands.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any, Optional

from ..plugin.config import VLLM, Config

logger = logging.getLogger("ringside.vllm")

EXPORTS_FD = "exports_fd"
LEGACY_IPC = "legacy_ipc"
KEY = "kv_cache_access"

# vLLM's method that asks the connectors and decides the extensible cache.
_RESOLVER = "_resolve_extensible_kv_cache"
_told: set = set()  # log lines said once a process


def declared(kv_transfer_config: Any) -> Any:
    """The KVCacheAccess to answer vLLM with (None on a vLLM without it,
    which never asks); raises ValueError, naming the key, where vLLM could
    not start with it."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # vLLM before 0.34
        return None
    if not _on_cuda():
        return KVCacheAccess.IN_PROCESS
    mode = mode_of(kv_transfer_config)
    why = conflict(mode, _resolving())
    if why is not None:
        raise ValueError(why)
    if mode == LEGACY_IPC:
        _once(
            "legacy_ipc",
            "ringside: kv_cache_access is legacy_ipc: vLLM allocates the KV cache without its extensible cache "
            "(gpu_memory_utilization's default is then 0.92, not 1.0), and the workers share it through CUDA IPC",
        )
        return KVCacheAccess.LEGACY_IPC
    return KVCacheAccess.EXPORTS_FD


def mode_of(kv_transfer_config: Any) -> str:
    """The plugin key's value in the connector's transfer configuration
    (ConfigError for a bad configuration, as at the connector's start)."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return Config.parse(extra, VLLM).kv_cache_access


def conflict(mode: str, vllm_config: Any) -> Optional[str]:
    """Why vLLM, resolving vllm_config (None: not known), cannot start
    with mode; None if nothing known stands against it."""
    if vllm_config is None:
        return None
    cc = getattr(vllm_config, "cache_config", None)
    requested = getattr(cc, "enable_extensible_kv_cache", None)
    if mode == LEGACY_IPC:
        if requested:
            return (
                "ringside: --enable-extensible-kv-cache asks for vLLM's extensible KV cache, but the plugin key "
                "kv_cache_access is legacy_ipc, which needs it off: drop the flag, or set kv_cache_access to "
                "exports_fd (docs/vllm.md, GPU engines)"
            )
        return None
    if requested is False:
        why = "the extensible KV cache is turned off (--no-enable-extensible-kv-cache)"
    elif getattr(cc, "kv_cache_memory_bytes", None) is not None:
        why = "the KV cache is sized by hand (kv_cache_memory_bytes), which the extensible KV cache does not allow"
    elif getattr(cc, "num_gpu_blocks_override", None) is not None:
        why = "the KV cache is sized by hand (num_gpu_blocks_override), which the extensible KV cache does not allow"
    elif getattr(getattr(vllm_config, "parallel_config", None), "enable_elastic_ep", False):
        why = "elastic EP is on, which the extensible KV cache does not allow"
    else:
        return None
    return (
        "ringside: the plugin key kv_cache_access is exports_fd (the default), which shares vLLM's extensible "
        "KV cache with the sidecar by file descriptor, but %s: set kv_cache_access to legacy_ipc in "
        "kv_connector_extra_config (docs/vllm.md, GPU engines)" % why
    )


# The block-outermost layout the connector asks vLLM for (get_required_kvcache_layout).
BLOCK_OUTERMOST = "BLNHC"
# The block size under which no attention backend of vLLM splits a block
# into kernel blocks (16 tokens is vLLM's default on CUDA, and the smallest
# kernel block there is): asking for a block-outermost layout, under which
# vLLM never splits, then cannot change the kernel blocks a backend gets.
NEVER_SPLIT = 16


def required_layout(vllm_config: Any) -> Optional[str]:
    """The KV cache layout the connector asks vLLM for
    (get_required_kvcache_layout), or None to leave vLLM its default.

    "BLNHC" (block-outermost: a block of every layer is one run of memory,
    so a page is one copy range instead of one a layer; the layers inside
    a block are [N, H, C] as vLLM's default LBNHC has them, so a page's
    bytes are the same under both) on CUDA engines whose block size is 16
    tokens, when the connector is the engine's only one. Not elsewhere:

    - on other platforms the backends declare their layouts (the CPU
      backend takes LBHNC only), and vLLM would warn and ignore the ask;
    - with another block size a backend may need kernel blocks (FlashInfer
      or FlashMLA at --block-size 128), which vLLM never makes under a
      block-outermost layout: the ask could hand a backend a block size it
      does not take;
    - under vLLM's MultiConnector, which refuses to start when two children
      ask for different layouts (NixlConnector asks for LBHNC): the
      children's answers cannot be seen from here, so none is given.

    vLLM takes the ask only where every attention backend of the engine
    supports the layout, and else warns and keeps its own choice (FlashInfer
    on Blackwell takes LBHNC and BLHNC only)."""
    if not _on_cuda():
        return None
    try:
        bs = int(vllm_config.cache_config.block_size)
    except Exception:  # noqa: BLE001 - no block size to read: ask for nothing
        return None
    if bs != NEVER_SPLIT or _inside_another_connector():
        return None
    return BLOCK_OUTERMOST


def _inside_another_connector(depth: int = 8) -> bool:
    """Whether this get_required_kvcache_layout call comes from another
    connector's (vLLM's MultiConnector asking its children)."""
    f: Optional[FrameType] = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name == "get_required_kvcache_layout":
            cls = f.f_locals.get("cls")
            if cls is not None and not getattr(cls, "_ringside", False):
                return True
        f = f.f_back
    return False


def _on_cuda() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # noqa: BLE001 - no platform to ask: not a CUDA engine
        return False


def _resolving(depth: int = 12) -> Any:
    """The VllmConfig whose extensible cache vLLM is deciding, from the
    calling frames; None if this call does not come from there."""
    f: Optional[FrameType] = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return None
        if f.f_code.co_name == _RESOLVER:
            return f.f_locals.get("self")
        f = f.f_back
    return None


def _once(tag: str, line: str) -> None:
    if tag not in _told:
        _told.add(tag)
        logger.info(line)
