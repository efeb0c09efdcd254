"""Retention hints of a request, from the sources the operator honours.

A hint says how long a request's blocks are worth keeping. Hints are a
privilege the operator grants (plugin key ``hint_sources``; none by
default), because every caller of an engine shares its uid and so its share
of the sidecar's pool:

- ``kv_hints``: vLLM's ``KvHintsEnvelope`` on ``request.kv_hints``, which
  only the engine's API sets (``AsyncLLM.generate(..., kv_hints=)``; vLLM's
  OpenAI server in Python does not carry it). Its actions ``retain``
  (payload ``ttl_s``, ``priority``, ``session_id``) and ``demote`` (payload
  ``session_id``: end the session's retention) are read; versions 1.x.
- ``kv_transfer_params``: the request body's ``kv_transfer_params`` (vLLM's
  OpenAI server passes any caller's; under MultiConnector every
  sub-connector sees them, hence the prefix):

  - ``ringside_retain_s``: keep the request's blocks for this many seconds
    (a number, more than 0, at most :data:`MAX_RETAIN_S`);
  - ``ringside_priority``: among retained blocks, which go last under
    pressure (0 to 3, higher kept longer; default 0; needs
    ``ringside_retain_s``);
  - ``ringside_session``: the caller's session (a string of 1 to
    :data:`MAX_SESSION_CHARS` characters): the identity the retention is
    made under;
  - ``ringside_session_end``: ``true`` when this is the last turn of its
    session: the retention the session set on the request's blocks ends,
    and they are the first to go.

A retention belongs to whoever made it: its owner is a 64-bit hash of the
session, or without one, of the request's id (then nothing but its deadline
ends it). The sidecar lets only the same owner of the same uid renew, change
or end it (docs/protocol.md, section 5.14). At most ``retain_max_blocks``
leading blocks of a request are retained.

When the request finishes, and its stores have been answered, the
scheduler side sends one Retain record for the request's hash batch. A hint
is advice: a bad value is counted (the plugin's counters ``hints_bad_*``),
logged under a rate limit with the caller's strings escaped
(plugin/callerlog.py), and ignored; nothing about a hint can fail the
request.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..plugin.callerlog import Limited, shown

if TYPE_CHECKING:  # pragma: no cover
    from ..client import Session
    from .admission import Admission
    from .state import ReqState

logger = logging.getLogger("ringside.vllm")
# One rate limit for every warning about what callers sent (disagg.py too).
warn = Limited(logger)

RETAIN_S = "ringside_retain_s"
PRIORITY = "ringside_priority"
SESSION = "ringside_session"
SESSION_END = "ringside_session_end"
KEYS = (RETAIN_S, PRIORITY, SESSION, SESSION_END)
# Other ringside keys of kv_transfer_params (disagg.py), not retention's.
OTHER_KEYS = ("ringside_pd_blocks",)

# The sources of hint_sources.
KV_HINTS = "kv_hints"
KV_TRANSFER_PARAMS = "kv_transfer_params"

# The sidecar's default bound on a retention (`ringside serve
# --retain.max-ttl`, which refuses a longer one); a longer hint is shortened
# to it here.
MAX_RETAIN_S = 3600.0
MAX_PRIORITY = 3
MAX_SESSION_CHARS = 256
# Unknown ringside_* key names named in one warning at most.
NAMED_KEYS = 3

# The counters this module bumps (the scheduler side's stats), one a
# request at most each.
COUNTERS = (
    "hints_retained",  # requests whose retention (or its end) was sent
    "hints_capped",  # ... cut to retain_max_blocks
    "hints_not_honoured",  # requests that carried a hint from a source hint_sources leaves out
    "hints_bad_unknown_key",  # an unknown ringside_* key
    "hints_bad_retain_s",
    "hints_bad_priority",
    "hints_bad_session",
    "hints_bad_session_end",
    "hints_bad_kv_hints",  # a malformed envelope or retain/demote action
)


@dataclass(frozen=True, slots=True)
class Hint:
    """What a request asked: keep its blocks ttl_ms at priority, or end
    their retention (end), as owner."""

    ttl_ms: int
    priority: int
    end: bool
    owner: int


def owner_of(session: Optional[str], request_id: str) -> int:
    """The 64-bit owner of a retention: the session's, else the request's
    (never 0, which the wire reads as no owner)."""
    key = b"s\0" + session.encode("utf-8", "surrogatepass") if session is not None else b"r\0" + request_id.encode()
    v = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return v or 1


def sources_of(text: str) -> frozenset:
    """The sources a hint_sources value names ("none": none)."""
    if text == "none" or not text:
        return frozenset()
    return frozenset(text.split(","))


class Hints:
    """Reads requests' hints from the honoured sources, counting and logging
    what is wrong with them (see the module doc)."""

    def __init__(self, sources: frozenset, max_blocks: int, stats: dict):
        self.sources = sources
        self.max_blocks = max_blocks
        self.stats = stats
        for k in COUNTERS:
            stats.setdefault(k, 0)

    def bad(self, rid: str, reason: str, what: str, *args: Any) -> None:
        """Count a request's bad hint and log it (rate-limited); what's args
        must be shown() already."""
        self.stats["hints_bad_" + reason] += 1
        warn.warning("ringside: request %s: ignoring a retention hint: " + what, shown(rid), *args)

    def of(self, request: Any) -> Optional[Hint]:
        """The request's hint from the honoured sources, or None (no hint,
        not honoured, or a bad one: counted and logged, never raised). The
        engine's kv_hints come first."""
        rid = getattr(request, "request_id", "")
        params = getattr(request, "kv_transfer_params", None)
        envelope = getattr(request, "kv_hints", None)
        hint = None
        if envelope is not None:
            if KV_HINTS in self.sources:
                hint = self.from_envelope(rid, envelope)
            else:
                self.stats["hints_not_honoured"] += 1
        if params and isinstance(params, Mapping):
            if KV_TRANSFER_PARAMS in self.sources:
                body = self.from_params(rid, params)
                hint = hint or body
            elif any(k in params for k in KEYS):
                self.stats["hints_not_honoured"] += 1
        return hint

    # -- request bodies --------------------------------------------------------

    def from_params(self, rid: str, params: Mapping) -> Optional[Hint]:
        """The hint of a request body's kv_transfer_params."""
        unknown = [
            k
            for k in params
            if isinstance(k, str) and k.startswith("ringside_") and k not in KEYS and k not in OTHER_KEYS
        ]
        if unknown:
            names = ", ".join(shown(k, 40) for k in unknown[:NAMED_KEYS])
            more = " and %d more" % (len(unknown) - NAMED_KEYS) if len(unknown) > NAMED_KEYS else ""
            self.bad(rid, "unknown_key", "unknown keys %s%s (known: %s)", names, more, ", ".join(KEYS))
        session = params.get(SESSION)
        if session is not None and not _session_ok(session):
            self.bad(
                rid,
                "session",
                "%s %s is not a string of 1 to %d characters",
                SESSION,
                shown(session),
                MAX_SESSION_CHARS,
            )
            return None  # a hint of an unknown identity: none
        end = params.get(SESSION_END)
        if end is not None and not isinstance(end, bool):
            self.bad(rid, "session_end", "%s %s is not true or false", SESSION_END, shown(end))
            end = None
        owner = owner_of(session, rid)
        if end:
            return Hint(0, 0, True, owner)
        secs = params.get(RETAIN_S)
        if secs is None:
            if PRIORITY in params:
                self.bad(rid, "priority", "%s given without %s", PRIORITY, RETAIN_S)
            return None
        ttl = _ttl_ms(secs)
        if ttl is None:
            self.bad(rid, "retain_s", "%s %s is not a number of seconds above 0", RETAIN_S, shown(secs))
            return None
        prio = params.get(PRIORITY, 0)
        if not _prio_ok(prio):
            self.bad(rid, "priority", "%s %s is not an integer from 0 to %d", PRIORITY, shown(prio), MAX_PRIORITY)
            return None
        return Hint(ttl, prio, False, owner)

    # -- vLLM's KvHintsEnvelope ------------------------------------------------

    def from_envelope(self, rid: str, envelope: Any) -> Optional[Hint]:
        """The hint of a KvHintsEnvelope: its last retain or demote action
        (version 1.x); other actions are left to whoever reads them."""
        actions = getattr(envelope, "actions", None)
        if not isinstance(actions, (list, tuple)):
            self.bad(rid, "kv_hints", "kv_hints has no list of actions: %s", shown(envelope))
            return None
        hint = None
        for a in actions:
            kind = getattr(a, "action_type", None)
            kind = kind.lower().removeprefix("kv.") if isinstance(kind, str) else None
            if kind not in ("retain", "demote"):
                continue
            version = getattr(a, "action_version", None)
            payload = getattr(a, "payload", None)
            if not isinstance(version, str) or version.split(".")[0] != "1" or not isinstance(payload, Mapping):
                self.bad(rid, "kv_hints", "%s action version %s payload %s", kind, shown(version), shown(payload))
                continue
            session = payload.get("session_id")
            if session is not None and not _session_ok(session):
                self.bad(rid, "kv_hints", "%s session_id %s", kind, shown(session))
                continue
            owner = owner_of(session, rid)
            if kind == "demote":
                hint = Hint(0, 0, True, owner)
                continue
            ttl = _ttl_ms(payload.get("ttl_s"))
            prio = payload.get("priority", 0)
            if ttl is None or not _prio_ok(prio):
                self.bad(rid, "kv_hints", "retain ttl_s %s priority %s", shown(payload.get("ttl_s")), shown(prio))
                continue
            hint = Hint(ttl, prio, False, owner)
        return hint

    # -- sending ---------------------------------------------------------------

    def send(self, adm: Admission, s: Session, r: ReqState, hint: Hint) -> None:
        """Send a finished request's hint: its leading block hashes (prompt
        and output, at most max_blocks) into its batch, then one Retain of
        them (fire and forget: the sidecar applies it to the leading blocks
        it holds). Raises like a session call."""
        n = len(r.request.block_hashes)
        if n == 0:
            return
        st = self.stats
        st["hints_retained"] += 1
        if n > self.max_blocks:
            n = self.max_blocks
            st["hints_capped"] += 1
        adm.put_hashes(r, s, n)
        s.retain(r.batch, 0, n, hint.ttl_ms, hint.priority, hint.end, wait=False, owner=hint.owner)


def _session_ok(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_SESSION_CHARS


def _ttl_ms(secs: Any) -> Optional[int]:
    """A ttl in seconds as whole milliseconds (at least 1, at most
    MAX_RETAIN_S), or None if it is not a finite number above 0."""
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not math.isfinite(secs) or secs <= 0:
        return None
    return max(1, int(min(float(secs), MAX_RETAIN_S) * 1000))


def _prio_ok(p: Any) -> bool:
    return not isinstance(p, bool) and isinstance(p, int) and 0 <= p <= MAX_PRIORITY
