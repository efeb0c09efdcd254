"""Retention hints of a request, from its ``kv_transfer_params``.

A request to vLLM's OpenAI server may carry ``kv_transfer_params`` in its
body; vLLM hands them to the connector on the request (and, under
MultiConnector, to every sub-connector: hence the ``ringside_`` prefix).
ringside reads three keys:

- ``ringside_retain_s``: keep the request's blocks for this many seconds
  (a number, more than 0, at most :data:`MAX_RETAIN_S`);
- ``ringside_priority``: among retained blocks, which go last under
  pressure (0 to 3, higher kept longer; default 0; needs
  ``ringside_retain_s``);
- ``ringside_session_end``: ``true`` when this is the last turn of its
  session: the retention of the request's blocks ends, and they are the
  first to go.

When the request finishes, and its stores have been answered, the
scheduler side sends one Retain record for the request's hash batch
(docs/protocol.md, section 5.14): the sidecar applies it to the leading
blocks it holds, charges them to the engine's uid like pins, and ends it at
the deadline. A hint is advice: a bad value is logged once and ignored,
and nothing about a hint can fail the request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from ..client import Session
    from .admission import Admission
    from .state import ReqState

logger = logging.getLogger("ringside.vllm")

RETAIN_S = "ringside_retain_s"
PRIORITY = "ringside_priority"
SESSION_END = "ringside_session_end"
KEYS = (RETAIN_S, PRIORITY, SESSION_END)
# Other ringside keys of kv_transfer_params (disagg.py), not retention's.
OTHER_KEYS = ("ringside_pd_blocks",)

# The sidecar's default bound on a retention (`ringside serve
# --retain.max-ttl`, which refuses a longer one); a longer hint is shortened
# to it here.
MAX_RETAIN_S = 3600.0
MAX_PRIORITY = 3


@dataclass(frozen=True, slots=True)
class Hint:
    """What a request asked: keep its blocks ttl_ms at priority, or end
    their retention (end)."""

    ttl_ms: int
    priority: int
    end: bool


_warned: set[str] = set()


def _warn(key: str, why: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("ringside: ignoring the retention hint %s: %s", key, why)


def hint_of(params: Any) -> Optional[Hint]:
    """The retention hint in a request's kv_transfer_params, or None (no
    hint, or a bad one: logged once per key, never raised)."""
    if not isinstance(params, Mapping):
        return None
    for k in params:
        if isinstance(k, str) and k.startswith("ringside_") and k not in KEYS and k not in OTHER_KEYS:
            _warn(k, "not a ringside key (ringside_retain_s, ringside_priority, ringside_session_end)")
    end = params.get(SESSION_END)
    if end is not None and not isinstance(end, bool):
        _warn(SESSION_END, "%r is not true or false" % (end,))
        end = None
    if end:
        return Hint(0, 0, True)
    secs = params.get(RETAIN_S)
    if secs is None:
        if PRIORITY in params:
            _warn(PRIORITY, "given without ringside_retain_s")
        return None
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not math.isfinite(secs) or secs <= 0:
        _warn(RETAIN_S, "%r is not a number of seconds above 0" % (secs,))
        return None
    prio = params.get(PRIORITY, 0)
    if isinstance(prio, bool) or not isinstance(prio, int) or not 0 <= prio <= MAX_PRIORITY:
        _warn(PRIORITY, "%r is not an integer from 0 to %d" % (prio, MAX_PRIORITY))
        return None
    return Hint(max(1, int(min(float(secs), MAX_RETAIN_S) * 1000)), prio, False)


def send(adm: Admission, s: Session, r: ReqState, hint: Hint) -> None:
    """Send a finished request's hint: every block hash of the request
    (prompt and output) into its batch, then one Retain of the whole batch
    (fire and forget: the sidecar applies it to the leading blocks it holds).
    Raises like a session call."""
    n = len(r.request.block_hashes)
    if n == 0:
        return
    adm.put_hashes(r, s, n)
    s.retain(r.batch, 0, n, hint.ttl_ms, hint.priority, hint.end, wait=False)
