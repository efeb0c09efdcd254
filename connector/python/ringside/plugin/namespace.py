"""The layout fingerprint of a namespace.

The sidecar keeps blocks per namespace: (model, layout fingerprint, tenant
salt). Two engines share blocks only when everything that changes a block's
bytes is the same for both, so each plugin lists those things (dtype, block
size, layers, heads, parallel shard, ...) and :func:`fingerprint` joins them
in one canonical order. Changing how a plugin builds its parts changes every
namespace it attaches to (old blocks become unreachable): keep the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def fingerprint(parts: Mapping[str, Any]) -> str:
    """``key=value`` pairs joined with ``;`` in key order."""
    return ";".join("%s=%s" % kv for kv in sorted(parts.items()))


def safe(fn: Callable[[], Any]) -> Any:
    """fn(), or "?" when the engine cannot say (the part is then left vague,
    never the engine's start failed)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a fingerprint part that cannot be read is left out
        return "?"
