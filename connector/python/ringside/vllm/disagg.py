"""Prefill to decode through the sidecars (disaggregated serving without a
transfer connector).

vLLM's P/D proxy sends a request to a prefill engine first, with
``kv_transfer_params`` ``{"do_remote_decode": true, ...}`` and one output
token, then the same prompt to a decode engine with the ``kv_transfer_params``
of the prefill's response. With ringside on both engines (one node's sidecar
shared by both, or two sidecars sharing a tier), the prefill stores the
prompt's blocks as usual; what the decode needs is to wait for them: its
lookup can come before the prefill's stores are answered, or before the
tier holds them.

- On the prefill engine (plugin key ``pd_producer``), a finished request that
  asked for a remote decode answers with ``{"ringside_pd_blocks": N}``: the N
  leading blocks of the prompt it sent for storing.
- On the decode engine (plugin key ``pd_wait_s``, 0 by default: an engine
  not configured as a decode engine ignores the key), a request whose
  ``kv_transfer_params`` carry ``ringside_pd_blocks`` is looked up again
  and vLLM told to ask again (``None``) while the sidecar holds fewer than
  that many of its leading blocks, for at most ``pd_wait_s`` seconds from
  its first answer; then it loads what is there and computes the rest.
  Other requests are scheduled meanwhile. Its lookups are sent without
  waiting and collected in a later step, :data:`POLL_S` apart at first and
  twice as far apart each time up to :data:`POLL_MAX_S`; in the steps
  between, the hook only compares a time. At most ``pd_max_waiting``
  requests wait at once: one more loads what is there at once.
  The wait is the decode engine's own setting: a request cannot ask for a
  longer one, and a bad value is ignored (counted and logged under the
  callers' rate limit, retention.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from ..plugin.callerlog import shown
from .retention import warn

BLOCKS = "ringside_pd_blocks"
# The key vLLM's P/D proxy sets on the prefill request (NixlConnector's).
REMOTE_DECODE = "do_remote_decode"

# A waiting decode request's lookups are POLL_S apart at first (each may
# ask the tier), then twice as far apart each time, up to POLL_MAX_S; sent
# without waiting and collected in a later step.
POLL_S = 0.005
POLL_MAX_S = 0.1


def wants_remote_decode(params: Any) -> bool:
    """Whether a request's kv_transfer_params ask for a remote decode."""
    return isinstance(params, Mapping) and params.get(REMOTE_DECODE) is True


def produced(blocks: int) -> dict:
    """The kv_transfer_params a prefill engine returns for a request whose
    first ``blocks`` blocks it sent for storing."""
    return {BLOCKS: blocks}


def expected(params: Any, usable: int, rid: str = "", stats: Optional[dict] = None) -> int:
    """How many leading blocks a decode request waits for: the prefill's
    count, at most ``usable`` (the blocks it may load); 0 when its
    kv_transfer_params announce none (or a bad count: counted in stats'
    pd_bad_blocks and logged under the rate limit)."""
    if not isinstance(params, Mapping):
        return 0
    n = params.get(BLOCKS)
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        if stats is not None:
            stats["pd_bad_blocks"] += 1
        warn.warning("ringside: request %s: ignoring %s: %s is not a count of blocks", shown(rid), BLOCKS, shown(n))
        return 0
    return min(n, usable)
