"""Retention hints of a request, from the sources the operator honours.

A hint says how long a request's blocks are worth keeping. Hints are a
privilege the operator grants (plugin key ``hint_sources``; none by
default), because every caller of an engine shares its uid and so its share
of the sidecar's pool:

- ``kv_hints``: vLLM's ``KvHintsEnvelope`` on ``request.kv_hints``, which
  only the engine's API sets (``AsyncLLM.generate(..., kv_hints=)``; vLLM's
  OpenAI server in Python does not carry it). Its actions, versions 1.x
  (an action type in any case, with or without a ``kv.`` prefix):

  - ``retain`` (payload ``ttl_s``, ``priority``, ``session_id``): keep the
    request's blocks; without ``ttl_s``, for :data:`MAX_RETAIN_S`;
  - ``pin`` (payload ``ttl_s``, ``session_id``; a ``priority`` is
    ignored): ringside never pins a block for a hint, so a pin is a
    retention at the top priority (:data:`MAX_PRIORITY`), for ``ttl_s`` or
    :data:`MAX_RETAIN_S`;
  - ``demote`` (payload ``session_id``): end the session's retention of the
    request's blocks, which become the first to go;
  - ``share`` and ``prefetch``: rejected (:data:`UNSUPPORTED` says why).

  The last retain, pin or demote of an envelope is applied; those before
  it are rejected as superseded. Each action gets an outcome in the RFC's
  words (accepted, clipped, rejected, missing; never deferred: a hint is
  applied when its request finishes, or not at all), counted per action
  type as ``hints_outcome_<action>_<outcome>`` and, unless accepted,
  logged (rate-limited, :data:`told`). vLLM gives a connector no way to
  hand an outcome back to whoever set the envelope.
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
scheduler side sends one Retain record for the request's hash batch; for an
envelope's action it reads the sidecar's answer in a later step (collect)
to tell accepted from clipped or missing. A hint is advice: a bad value is
counted (the plugin's counters ``hints_bad_*``), logged under a rate limit
with the caller's strings escaped (plugin/callerlog.py), and ignored;
nothing about a hint can fail the request.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .. import schema as _s
from ..client import value_reply
from ..plugin.callerlog import Limited, shown

if TYPE_CHECKING:  # pragma: no cover
    from ..client import Session
    from .admission import Admission
    from .state import ReqState

logger = logging.getLogger("ringside.vllm")
# One rate limit for every warning about what callers sent (disagg.py too).
warn = Limited(logger)
# Another for the outcomes of kv_hints actions (info), so that a stream of
# them never silences the warnings.
told = Limited(logger)

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
# The characters of an action's action_id kept for its outcome's log line.
MAX_ACTION_ID = 128
# Unknown ringside_* key names named in one warning at most.
NAMED_KEYS = 3

# The counters this module bumps (the scheduler side's stats), one a
# request at most each.
COUNTERS: tuple[str, ...] = (
    "hints_retained",  # requests whose retention (or its end) was sent
    "hints_capped",  # ... cut to retain_max_blocks
    "hints_not_honoured",  # requests that carried a hint from a source hint_sources leaves out
    "hints_bad_unknown_key",  # an unknown ringside_* key
    "hints_bad_retain_s",
    "hints_bad_priority",
    "hints_bad_session",
    "hints_bad_session_end",
    "hints_bad_kv_hints",  # a malformed envelope or retain/pin/demote action
)

# The outcomes of a KvHintsEnvelope's actions (vLLM's RFC 51428): applied as
# asked; applied within a bound (a TTL, retain_max_blocks, the sidecar's
# retain share, fewer blocks present); refused; or nothing to act on (none
# of the request's blocks in the sidecar, no retention of the session to
# end). ringside never defers one.
ACCEPTED, CLIPPED, REJECTED, MISSING = "accepted", "clipped", "rejected", "missing"
RETAIN, PIN, DEMOTE, SHARE, PREFETCH, OTHER = "retain", "pin", "demote", "share", "prefetch", "other"
# Why ringside rejects the actions it does not carry out.
UNSUPPORTED = {
    SHARE: "the sidecar already serves its blocks to every engine attached to it (and, with a shared tier, to "
    "other nodes): there is no copy for a connector to move to a named worker",
    PREFETCH: "a request's prefix is looked up in the sidecar (and its shared tier) when the request is "
    "scheduled; ringside has nothing to load ahead of a request that has not arrived",
}
# The outcomes each action type can have here, as counters.
OUTCOME_COUNTERS = tuple(
    "hints_outcome_%s_%s" % (a, o)
    for a, outcomes in (
        (RETAIN, (ACCEPTED, CLIPPED, REJECTED, MISSING)),
        (PIN, (ACCEPTED, CLIPPED, REJECTED, MISSING)),
        (DEMOTE, (ACCEPTED, REJECTED, MISSING)),
        (SHARE, (REJECTED,)),
        (PREFETCH, (REJECTED,)),
        (OTHER, (REJECTED,)),
    )
    for o in outcomes
)
COUNTERS += OUTCOME_COUNTERS
# The most Retain answers awaited at once; past it a hint's outcome is the
# connector's own (accepted or clipped), without the sidecar's word.
MAX_AWAITED = 1024


@dataclass(frozen=True, slots=True)
class Hint:
    """What a request asked: keep its blocks ttl_ms at priority, or end
    their retention (end), as owner. From a KvHintsEnvelope: the action
    (its type and action_id) whose outcome is counted, and why the
    connector bounded it already (clipped, "" if it did not)."""

    ttl_ms: int
    priority: int
    end: bool
    owner: int
    action: str = ""
    action_id: str = ""
    clipped: str = ""


@dataclass(slots=True)
class Awaited:
    """A kv_hints action's Retain whose answer is awaited."""

    rid: str
    hint: Hint
    want: int  # blocks the request stored (or loaded) of those sent
    clipped: str
    session: Any


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
        # Retains of kv_hints actions whose answers are awaited, by seq.
        self.awaited: dict[int, Awaited] = {}

    def bad(self, rid: str, reason: str, what: str, *args: Any) -> None:
        """Count a request's bad hint and log it (rate-limited); what's args
        must be shown() already."""
        self.stats["hints_bad_" + reason] += 1
        warn.warning("ringside: request %s: ignoring a retention hint: " + what, shown(rid), *args)

    def outcome(self, rid: str, kind: str, action_id: Any, outcome: str, why: str = "", *args: Any) -> None:
        """Count an action's outcome, and log it unless accepted (why % args,
        args shown() already)."""
        self.stats["hints_outcome_%s_%s" % (kind, outcome)] += 1
        if why:
            if not args:
                why = why.replace("%", "%%")
            told.info(
                "ringside: request %s: kv_hints %s action %s " + outcome + ": " + why,
                shown(rid),
                kind,
                shown(action_id, 40),
                *args,
            )

    def reject_all(self, rid: str, envelope: Any, why: str) -> None:
        """Every action of an envelope the connector does not read: rejected."""
        actions = getattr(envelope, "actions", None)
        if isinstance(actions, (list, tuple)):
            for a in actions:
                self.outcome(rid, _kind(getattr(a, "action_type", None)), getattr(a, "action_id", None), REJECTED, why)

    def of(self, request: Any, usable: bool = True) -> Optional[Hint]:
        """The request's hint from the honoured sources, or None (no hint,
        not honoured, or a bad one: counted and logged, never raised). The
        engine's kv_hints come first. usable=False (a model whose hints are
        ignored): None, the envelope's actions counted as rejected."""
        rid = getattr(request, "request_id", "")
        envelope = getattr(request, "kv_hints", None)
        if not usable:
            if envelope is not None:
                self.reject_all(rid, envelope, "hints are ignored for models with several KV cache groups")
            return None
        params = getattr(request, "kv_transfer_params", None)
        hint = None
        if envelope is not None:
            if KV_HINTS in self.sources:
                hint = self.from_envelope(rid, envelope)
            else:
                self.stats["hints_not_honoured"] += 1
                self.reject_all(rid, envelope, "hint_sources does not name kv_hints")
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
        """The hint of a KvHintsEnvelope: its last valid retain, pin or
        demote action (version 1.x). Every other action gets its outcome
        here (rejected); the hint's own comes with the sidecar's answer."""
        actions = getattr(envelope, "actions", None)
        if not isinstance(actions, (list, tuple)):
            self.bad(rid, "kv_hints", "kv_hints has no list of actions: %s", shown(envelope))
            return None
        hint = None
        for a in actions:
            kind = _kind(getattr(a, "action_type", None))
            aid = getattr(a, "action_id", None)
            if kind not in (RETAIN, PIN, DEMOTE):
                why = UNSUPPORTED.get(kind)
                if why is None:
                    self.outcome(
                        rid, kind, aid, REJECTED, "unknown action type %s", shown(getattr(a, "action_type", None))
                    )
                else:
                    self.outcome(rid, kind, aid, REJECTED, "ringside does not carry it out: " + why)
                continue
            got = self._action(rid, kind, aid, a)
            if got is None:
                self.outcome(rid, kind, aid, REJECTED)  # bad(): logged
                continue
            if hint is not None:
                self.outcome(rid, hint.action, hint.action_id, REJECTED, "superseded by a later action of the envelope")
            hint = got
        return hint

    def _action(self, rid: str, kind: str, aid: Any, a: Any) -> Optional[Hint]:
        """The hint of one retain, pin or demote action, or None if it is
        bad (counted and logged)."""
        version = getattr(a, "action_version", None)
        payload = getattr(a, "payload", None)
        if not isinstance(version, str) or version.split(".")[0] != "1" or not isinstance(payload, Mapping):
            self.bad(rid, "kv_hints", "%s action version %s payload %s", kind, shown(version), shown(payload))
            return None
        session = payload.get("session_id")
        if session is not None and not _session_ok(session):
            self.bad(rid, "kv_hints", "%s session_id %s", kind, shown(session))
            return None
        owner = owner_of(session, rid)
        # Kept until the outcome: bounded (the log shows less).
        ident = aid[:MAX_ACTION_ID] if isinstance(aid, str) else shown(aid)
        if kind == DEMOTE:
            return Hint(0, 0, True, owner, kind, ident)
        secs = payload.get("ttl_s")
        if kind == PIN:
            prio = MAX_PRIORITY  # whatever priority it names: a pin is kept at the top one
        else:
            prio = payload.get("priority", 0)
            if not _prio_ok(prio):
                self.bad(
                    rid, "kv_hints", "retain priority %s is not an integer from 0 to %d", shown(prio), MAX_PRIORITY
                )
                return None
        if secs is None:
            return Hint(
                int(MAX_RETAIN_S * 1000), prio, False, owner, kind, ident, "no ttl_s: kept for %d s" % MAX_RETAIN_S
            )
        ttl = _ttl_ms(secs)
        if ttl is None:
            self.bad(rid, "kv_hints", "%s ttl_s %s is not a number of seconds above 0", kind, shown(secs))
            return None
        clip = "ttl_s %s shortened to %d s" % (shown(secs), MAX_RETAIN_S) if secs > MAX_RETAIN_S else ""
        return Hint(ttl, prio, False, owner, kind, ident, clip)

    # -- sending ---------------------------------------------------------------

    def send(self, adm: Admission, s: Session, r: ReqState, hint: Hint) -> None:
        """Send a finished request's hint: its leading block hashes (prompt
        and output, at most max_blocks) into its batch, then one Retain of
        them (the sidecar applies it to the leading blocks it holds). A
        request body's hint is fire and forget; a kv_hints action's answer
        is awaited (collect), for its outcome. Raises like a session call."""
        n = len(r.request.block_hashes)
        if n == 0:
            if hint.action:
                self.outcome(
                    r.request.request_id, hint.action, hint.action_id, MISSING, "the request has no full block"
                )
            return
        st = self.stats
        st["hints_retained"] += 1
        clipped = hint.clipped
        if n > self.max_blocks:
            n = self.max_blocks
            st["hints_capped"] += 1
            if not hint.end:
                clipped = (clipped + "; " if clipped else "") + "cut to retain_max_blocks (%d blocks)" % n
        adm.put_hashes(r, s, n)
        if not hint.action:
            s.retain(r.batch, 0, n, hint.ttl_ms, hint.priority, hint.end, wait=False, owner=hint.owner)
            return
        rid = r.request.request_id
        if len(self.awaited) >= MAX_AWAITED:
            # Too many answers outstanding: the connector's own word.
            s.retain(r.batch, 0, n, hint.ttl_ms, hint.priority, hint.end, wait=False, owner=hint.owner)
            self.outcome(rid, hint.action, hint.action_id, CLIPPED if clipped else ACCEPTED, clipped)
            return
        seq = s.retain_submit(r.batch, 0, n, hint.ttl_ms, hint.priority, hint.end, owner=hint.owner)
        if seq == 0:
            self.outcome(rid, hint.action, hint.action_id, REJECTED, "the sidecar does not know Retain")
            return
        self.awaited[seq] = Awaited(rid, hint, min(n, r.stored) or n, clipped, s)

    def collect(self, s: Optional[Session]) -> None:
        """The outcomes of the kv_hints actions whose Retains the sidecar
        has answered (each step while any is awaited; never waits). Those of
        an older session, or with none, are missing: the sidecar restarted
        or is away, and its blocks with it. Raises like a session call."""
        for seq in list(self.awaited):
            w = self.awaited[seq]
            if w.session is not s:
                del self.awaited[seq]
                self.outcome(
                    w.rid, w.hint.action, w.hint.action_id, MISSING, "the sidecar's session ended before it answered"
                )
                continue
            assert s is not None
            payload = s.try_reply(seq)
            if payload is None:
                continue
            del self.awaited[seq]
            self.answered(s, w, payload)

    def answered(self, s: Session, w: Awaited, payload: bytes) -> None:
        """An action's outcome from the sidecar's answer to its Retain."""
        h = w.hint
        try:
            status, value, msg = value_reply(payload)
        except Exception:  # noqa: BLE001 - counted as the sidecar's refusal
            status, value, msg = int(_s.Status.MALFORMED), 0, "malformed reply"
        if status == _s.Status.UNKNOWN_TYPE:
            s.retain_supported = False
            self.outcome(w.rid, h.action, h.action_id, REJECTED, "the sidecar does not know Retain")
        elif status == _s.Status.TOO_LARGE:
            # The uid's retain share is full, or the sidecar's --retain.max-ttl is shorter.
            self.outcome(w.rid, h.action, h.action_id, CLIPPED, "no block kept: %s", shown(msg, 120))
        elif status == _s.Status.UNKNOWN_BATCH:
            self.outcome(w.rid, h.action, h.action_id, MISSING, "the sidecar no longer has the request's batch")
        elif status:
            self.outcome(
                w.rid, h.action, h.action_id, REJECTED, "the sidecar answered status %d: %s", status, shown(msg, 120)
            )
        elif value == 0:
            why = (
                "no retention of its session on the request's blocks"
                if h.end
                else "none of the request's blocks in the sidecar"
            )
            self.outcome(w.rid, h.action, h.action_id, MISSING, why)
        elif not h.end and value < w.want:
            why = (
                w.clipped + "; " if w.clipped else ""
            ) + "%d of %d blocks kept (the retain share, or others' retentions)"
            self.outcome(w.rid, h.action, h.action_id, CLIPPED, why, value, w.want)
        else:
            self.outcome(w.rid, h.action, h.action_id, CLIPPED if w.clipped else ACCEPTED, w.clipped)


def _kind(t: Any) -> str:
    """An action type's name here (any case, with or without "kv."), OTHER
    for one ringside does not know."""
    if not isinstance(t, str):
        return OTHER
    k = t.lower().removeprefix("kv.")
    return k if k in (RETAIN, PIN, DEMOTE, SHARE, PREFETCH) else OTHER


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
