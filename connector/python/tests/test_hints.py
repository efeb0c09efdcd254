"""What a request body's kv_transfer_params can make the vLLM connector do
(ringside.vllm.retention, ringside.plugin.callerlog): hints only from the
sources the operator honours, an identity for every retention, every bad
value counted by reason, and the log safe from what a caller sends (escaped,
cut, rate-limited, bounded memory). Pure: no engine, no sidecar."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ringside import schema
from ringside.plugin import callerlog
from ringside.plugin.config import Config, ConfigError
from ringside.vllm import retention
from ringside.vllm.retention import Hint, Hints, owner_of

BODY = frozenset({retention.KV_TRANSFER_PARAMS})


@pytest.fixture(autouse=True)
def _fresh_limit(monkeypatch):
    """A fresh rate limit for each test (the module's is process-wide)."""
    monkeypatch.setattr(retention, "warn", callerlog.Limited(retention.logger))
    monkeypatch.setattr(retention, "told", callerlog.Limited(retention.logger))


def req(params=None, rid="req-1", kv_hints=None):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, kv_hints=kv_hints)


def hints(sources=BODY, max_blocks=1024) -> Hints:
    return Hints(sources, max_blocks, {})


def owner(rid="req-1", session=None) -> int:
    return owner_of(session, rid)


@pytest.mark.parametrize(
    "params, want",
    [
        (None, None),
        ({}, None),
        ({"remote_engine_id": "x"}, None),  # another connector's keys
        ({"ringside_retain_s": 600}, Hint(600_000, 0, False, owner())),
        ({"ringside_retain_s": 1.5, "ringside_priority": 3}, Hint(1500, 3, False, owner())),
        ({"ringside_retain_s": 0.0001}, Hint(1, 0, False, owner())),  # at least 1 ms
        ({"ringside_retain_s": 10**9}, Hint(int(retention.MAX_RETAIN_S * 1000), 0, False, owner())),  # shortened
        ({"ringside_session_end": True}, Hint(0, 0, True, owner())),
        ({"ringside_session_end": True, "ringside_retain_s": 60}, Hint(0, 0, True, owner())),  # the end wins
        ({"ringside_session_end": False, "ringside_retain_s": 60}, Hint(60_000, 0, False, owner())),
        ({"ringside_retain_s": 60, "ringside_session": "s-1"}, Hint(60_000, 0, False, owner(session="s-1"))),
        ({"ringside_session_end": True, "ringside_session": "s-1"}, Hint(0, 0, True, owner(session="s-1"))),
    ],
)
def test_hints_of_request_bodies(params, want):
    h = hints()
    assert h.of(req(params)) == want
    assert not any(v for k, v in h.stats.items() if k.startswith("hints_bad_"))


def test_owners():
    """A retention's owner is its session's, shared by every request of the
    session; without one, the request's own (then no other request can end
    or change it); never 0 (the wire's 'no owner')."""
    assert owner_of("s", "a") == owner_of("s", "b") != 0
    assert owner_of(None, "a") != owner_of(None, "b")
    assert owner_of("a", "x") != owner_of(None, "a")  # a session named like a request id is another identity
    assert owner_of("\ud800", "x") != 0  # a lone surrogate from JSON: still an identity


@pytest.mark.parametrize("sources", [frozenset(), frozenset({retention.KV_HINTS})])
def test_request_bodies_are_not_honoured_unless_granted(sources):
    h = hints(sources)
    for params in (
        {"ringside_retain_s": 3600, "ringside_priority": 3},
        {"ringside_session_end": True},
        {"ringside_retain_s": "x"},
    ):
        assert h.of(req(params)) is None
    assert h.stats["hints_not_honoured"] == 3
    assert not any(v for k, v in h.stats.items() if k.startswith("hints_bad_"))


@pytest.mark.parametrize(
    "params, reason",
    [
        ({"ringside_retain_s": 0}, "retain_s"),
        ({"ringside_retain_s": -5}, "retain_s"),
        ({"ringside_retain_s": "600"}, "retain_s"),
        ({"ringside_retain_s": True}, "retain_s"),
        ({"ringside_retain_s": None, "ringside_priority": 1}, "priority"),
        ({"ringside_retain_s": float("nan")}, "retain_s"),
        ({"ringside_retain_s": float("inf")}, "retain_s"),
        ({"ringside_retain_s": [60]}, "retain_s"),
        ({"ringside_retain_s": {"s": 60}}, "retain_s"),
        ({"ringside_retain_s": 60, "ringside_priority": 4}, "priority"),
        ({"ringside_retain_s": 60, "ringside_priority": -1}, "priority"),
        ({"ringside_retain_s": 60, "ringside_priority": 1.0}, "priority"),
        ({"ringside_retain_s": 60, "ringside_priority": "3"}, "priority"),
        ({"ringside_priority": 2}, "priority"),
        ({"ringside_session_end": "yes"}, "session_end"),
        ({"ringside_session_end": 1}, "session_end"),
        ({"ringside_retain_s": 60, "ringside_session": ""}, "session"),
        ({"ringside_retain_s": 60, "ringside_session": 7}, "session"),
        ({"ringside_retain_s": 60, "ringside_session": "x" * 257}, "session"),
        ({"ringside_session_end": True, "ringside_session": ["a"]}, "session"),
        ({"ringside_retain": 60}, "unknown_key"),
    ],
)
def test_bad_hints_are_counted_by_reason_and_ignored(params, reason, caplog):
    h = hints()
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        for i in range(3):
            assert h.of(req(params, rid="r%d" % i)) is None
    assert h.stats["hints_bad_" + reason] == 3  # every request, not only the first
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and all("r%d" % i in said[i] for i in range(3)), said


def test_a_misspelt_key_is_named(caplog):
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        assert hints().of(req({"ringside_retain": 60})) is None
    assert any("'ringside_retain'" in r.getMessage() and "ringside_retain_s" in r.getMessage() for r in caplog.records)


def test_a_key_name_cannot_forge_a_log_line(caplog):
    """A key name with a newline and a forged line reaches the log escaped,
    on the warning's own line, and cut."""
    forged = "ringside_x\n2026-12-06 12:00:00 ERROR engine: forged line " + "A" * 500
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        hints().of(req({forged: 1, "ringside_retain_s": 5}))
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "\n" not in msg and "\\n2026-12-06" in msg
    assert "A" * 100 not in msg and len(msg) < 400


def test_values_and_ids_are_escaped_too(caplog):
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        hints().of(req({"ringside_retain_s": "1\r\nERROR x" * 100}, rid="id\nERROR forged"))
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "\n" not in msg and "\r" not in msg and len(msg) < 400


def test_many_unknown_keys_make_one_line_a_request(caplog):
    params = {"ringside_k%04d" % i: i for i in range(2000)}
    h = hints()
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        h.of(req(params))
    (rec,) = caplog.records
    assert "and 1997 more" in rec.getMessage()
    assert h.stats["hints_bad_unknown_key"] == 1


def test_warnings_are_rate_limited_and_say_what_they_dropped(caplog):
    """A flood of bad hints: a burst of lines, then one every EVERY_S
    seconds carrying the count of those dropped; the counters see all."""
    t = [0.0]
    lim = callerlog.Limited(logging.getLogger("ringside.vllm"), burst=5, every=10.0, clock=lambda: t[0])
    retention.warn = lim
    h = hints()
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        for i in range(1000):
            h.of(req({"ringside_retain_s": "bad"}, rid="r%d" % i))
        assert len(caplog.records) == 5
        t[0] += 10.0
        h.of(req({"ringside_retain_s": "bad"}, rid="late"))
    assert len(caplog.records) == 6
    assert "995 similar warnings suppressed" in caplog.records[-1].getMessage()
    assert h.stats["hints_bad_retain_s"] == 1001
    assert lim.suppressed == 0


def test_shown():
    assert callerlog.shown("a\nb") == "'a\\nb'"
    long = callerlog.shown("x" * 1000)
    assert long.endswith("...(1002 chars)") and len(long) < 100

    class Bad:
        def __repr__(self):
            raise RuntimeError("no")

    assert callerlog.shown(Bad()) == "<Bad>"


@pytest.mark.parametrize(
    "value, want",
    [
        ("none", "none"),
        ("kv_hints", "kv_hints"),
        ("kv_transfer_params", "kv_transfer_params"),
        (" kv_hints , kv_transfer_params ", "kv_hints,kv_transfer_params"),
    ],
)
def test_hint_sources_key(value, want):
    cfg = Config.parse({"hint_sources": value}, "vllm")
    assert cfg.hint_sources == want
    assert retention.sources_of(cfg.hint_sources) == (frozenset() if want == "none" else frozenset(want.split(",")))


@pytest.mark.parametrize("value", ["", "all", "kv_hints,kv_hints", "none,kv_hints", 1, ["kv_hints"]])
def test_hint_sources_key_refuses(value):
    with pytest.raises(ConfigError, match="hint_sources"):
        Config.parse({"hint_sources": value}, "vllm")


def test_defaults_honour_no_request_body():
    cfg = Config.parse({}, "vllm")
    assert retention.sources_of(cfg.hint_sources) == frozenset()
    assert cfg.pd_wait_s == 0
    assert cfg.pd_max_waiting > 0 and cfg.retain_max_blocks > 0


# -- vLLM's KvHintsEnvelope: its actions and their outcomes -------------------

KV = frozenset({retention.KV_HINTS})
HOUR_MS = int(retention.MAX_RETAIN_S * 1000)


def action(kind, payload=None, version="1.0", aid=None):
    return SimpleNamespace(action_id=aid or kind, action_type=kind, action_version=version, payload=payload or {})


def envelope(*actions):
    """What vLLM's KvHintsEnvelope looks like to the connector (the same
    attributes; test_vllm_retention.py uses vLLM's own)."""
    return SimpleNamespace(protocol_version="1.0", message_id="m-1", actions=list(actions))


def outcomes(h: Hints) -> dict:
    """The outcome counters that are not 0, without their prefix."""
    return {k[len("hints_outcome_") :]: v for k, v in h.stats.items() if k.startswith("hints_outcome_") and v}


def test_every_outcome_counter_starts_at_zero():
    h = hints(KV)
    assert set(retention.OUTCOME_COUNTERS) <= set(h.stats)
    assert "hints_outcome_retain_clipped" in h.stats and "hints_outcome_share_rejected" in h.stats
    assert not outcomes(h)


@pytest.mark.parametrize(
    "acts, want, counted",
    [
        (
            [action("retain", {"ttl_s": 600, "priority": 2, "session_id": "agent-7"})],
            Hint(600_000, 2, False, owner(session="agent-7"), "retain", "retain"),
            {},
        ),
        # Spellings: any case, with or without the kv. prefix.
        ([action("KV.Retain", {"ttl_s": 5})], Hint(5000, 0, False, owner(), "retain", "KV.Retain"), {}),
        # A pin is a retention at the top priority.
        ([action("Pin", {"ttl_s": 60})], Hint(60_000, 3, False, owner(), "pin", "Pin"), {}),
        # Whatever priority a pin names, it is kept at the top one.
        ([action("pin", {"ttl_s": 60, "priority": 0})], Hint(60_000, 3, False, owner(), "pin", "pin"), {}),
        ([action("pin", {"ttl_s": 60, "priority": 10})], Hint(60_000, 3, False, owner(), "pin", "pin"), {}),
        # No ttl_s: kept for the longest a retention may last (clipped).
        (
            [action("pin", {"session_id": "s"})],
            Hint(HOUR_MS, 3, False, owner(session="s"), "pin", "pin", "no ttl_s: kept for 3600 s"),
            {},
        ),
        (
            [action("retain", {"ttl_s": 10**6})],
            Hint(HOUR_MS, 0, False, owner(), "retain", "retain", "ttl_s 1000000 shortened to 3600 s"),
            {},
        ),
        ([action("kv.demote", {"session_id": "s"})], Hint(0, 0, True, owner(session="s"), "demote", "kv.demote"), {}),
        # Actions ringside does not carry out, and unknown ones: rejected.
        (
            [action("share", {"destination": "w-2"}), action("Prefetch"), action("kv.fetch"), action(7)],
            None,
            {"share_rejected": 1, "prefetch_rejected": 1, "other_rejected": 2},
        ),
        # The last retain, pin or demote wins; the ones before it are superseded.
        (
            [action("retain", {"ttl_s": 60}), action("share"), action("pin", {"ttl_s": 30}, aid="p")],
            Hint(30_000, 3, False, owner(), "pin", "p"),
            {"retain_rejected": 1, "share_rejected": 1},
        ),
        (
            [action("pin", {"ttl_s": 30}), action("demote")],
            Hint(0, 0, True, owner(), "demote", "demote"),
            {"pin_rejected": 1},
        ),
        # A bad action does not supersede a good one.
        (
            [action("retain", {"ttl_s": 60}), action("retain", {"ttl_s": "long"})],
            Hint(60_000, 0, False, owner(), "retain", "retain"),
            {"retain_rejected": 1},
        ),
    ],
)
def test_envelope_actions(acts, want, counted):
    """The hint an envelope's actions make, and the outcomes known before
    the sidecar answers (those of the actions not applied)."""
    h = hints(KV)
    assert h.of(req(kv_hints=envelope(*acts))) == want
    assert outcomes(h) == counted


@pytest.mark.parametrize(
    "act",
    [
        action("retain", {"ttl_s": 60}, version="2.0"),
        action("retain", {"ttl_s": 60}, version=1),
        action("pin", None),  # payload {}: fine; see below for None
        action("retain", {"ttl_s": 0}),
        action("retain", {"ttl_s": float("nan")}),
        action("retain", {"ttl_s": True}),
        action("retain", {"ttl_s": 60, "priority": 4}),
        action("retain", {"ttl_s": 60, "priority": "high"}),
        action("demote", {"session_id": ""}),
        action("pin", {"ttl_s": 60, "session_id": "x" * 257}),
    ],
)
def test_bad_actions_are_rejected(act, caplog):
    if act.action_type == "pin" and act.payload == {}:
        act.payload = None  # not a mapping
    h = hints(KV)
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        assert h.of(req(kv_hints=envelope(act), rid="r\nforged")) is None
    assert outcomes(h) == {act.action_type + "_rejected": 1}
    assert h.stats["hints_bad_kv_hints"] == 1
    (rec,) = caplog.records  # one warning, escaped
    assert "\n" not in rec.getMessage() and "'r\\nforged'" in rec.getMessage()


def test_an_action_id_is_kept_short():
    h = hints(KV)
    hint = h.of(req(kv_hints=envelope(action("retain", {"ttl_s": 1}, aid="x" * 10**6))))
    assert hint is not None and hint.action_id == "x" * retention.MAX_ACTION_ID


def test_an_envelope_without_actions_is_bad():
    h = hints(KV)
    assert h.of(req(kv_hints=SimpleNamespace(actions="retain"))) is None
    assert h.stats["hints_bad_kv_hints"] == 1 and not outcomes(h)


@pytest.mark.parametrize("sources", [frozenset(), BODY])
def test_an_envelope_not_honoured_is_rejected_action_by_action(sources):
    h = hints(sources)
    env = envelope(action("retain", {"ttl_s": 60}), action("pin", {"ttl_s": 60}), action("share"))
    assert h.of(req(kv_hints=env)) is None
    assert h.stats["hints_not_honoured"] == 1
    assert outcomes(h) == {"retain_rejected": 1, "pin_rejected": 1, "share_rejected": 1}


def test_an_envelope_on_a_model_whose_hints_are_ignored():
    """Models with several KV cache groups ignore hints: every action is
    rejected, and a request body's hint is not read."""
    h = hints(KV | BODY)
    r = req({"ringside_retain_s": 60}, kv_hints=envelope(action("retain", {"ttl_s": 60}), action("demote")))
    assert h.of(r, usable=False) is None
    assert outcomes(h) == {"retain_rejected": 1, "demote_rejected": 1}


def test_the_envelope_wins_over_the_body():
    h = hints(KV | BODY)
    r = req({"ringside_retain_s": 5}, kv_hints=envelope(action("pin", {"ttl_s": 60})))
    assert h.of(r) == Hint(60_000, 3, False, owner(), "pin", "pin")
    r = req({"ringside_retain_s": 5}, kv_hints=envelope(action("share")))
    assert h.of(r) == Hint(5000, 0, False, owner())  # no retention action in the envelope: the body's


class FakeSession:
    """A sidecar session as Hints.send and collect use it: Retains are
    recorded, and answered with what the test says."""

    def __init__(self):
        self.retain_supported = True
        self.sent: list = []  # (seq or 0 for fire and forget, args)
        self.replies: dict = {}
        self.seq = 0

    def retain_submit(self, batch, start, count, ttl_ms, priority=0, end=False, *, owner=0):
        if not self.retain_supported:
            return 0
        self.seq += 1
        self.sent.append((self.seq, (batch, start, count, ttl_ms, priority, end, owner)))
        return self.seq

    def retain(self, batch, start, count, ttl_ms, priority=0, end=False, wait=True, *, owner=0):
        self.sent.append((0, (batch, start, count, ttl_ms, priority, end, owner)))

    def answer(self, seq, status=0, value=0, msg=b""):
        self.replies[seq] = schema.REPLY.pack(status, 0, value) + msg

    def try_reply(self, seq):
        return self.replies.pop(seq, None)


class FakeAdmission:
    def __init__(self):
        self.put: list = []

    def put_hashes(self, r, s, n):
        self.put.append(n)


def finished(blocks=4, stored=None, rid="req-1"):
    """A finished request's state: blocks full blocks, stored of them sent
    for storing (default all)."""
    return SimpleNamespace(
        request=SimpleNamespace(request_id=rid, block_hashes=[b"h%d" % i for i in range(blocks)]),
        batch=9,
        stored=blocks if stored is None else stored,
    )


def sent_and_answered(hint, status=0, value=4, blocks=4, stored=None, max_blocks=1024, msg=b""):
    h = hints(KV, max_blocks)
    s, adm = FakeSession(), FakeAdmission()
    h.send(adm, s, finished(blocks, stored), hint)
    assert not outcomes(h), "an outcome before the sidecar answered"
    ((seq, args),) = s.sent
    h.collect(s)
    assert h.awaited, "no answer yet: still awaited"
    s.answer(seq, status, value, msg)
    h.collect(s)
    assert not h.awaited
    return h, s, args


RETAIN_H = Hint(60_000, 1, False, 77, "retain", "a1")
PIN_H = Hint(60_000, 3, False, 77, "pin", "a2")
DEMOTE_H = Hint(0, 0, True, 77, "demote", "a3")


@pytest.mark.parametrize(
    "hint, answer, want",
    [
        (RETAIN_H, dict(value=4), "retain_accepted"),
        (PIN_H, dict(value=4), "pin_accepted"),
        # The sidecar kept fewer than the request stored: the retain share, or others' retentions.
        (RETAIN_H, dict(value=3), "retain_clipped"),
        # Its last block was never stored (its last token's KV is never computed): not clipped.
        (RETAIN_H, dict(value=3, stored=3), "retain_accepted"),
        # The uid's retain share was full: nothing kept.
        (PIN_H, dict(status=7, value=0, msg=b"--limits.retain-share"), "pin_clipped"),
        # None of its blocks in the sidecar any more, or its batch gone.
        (RETAIN_H, dict(value=0), "retain_missing"),
        (RETAIN_H, dict(status=3), "retain_missing"),
        (RETAIN_H, dict(status=1, msg=b"malformed"), "retain_rejected"),
        # The connector's own bounds make it clipped even if every block is kept.
        (Hint(HOUR_MS, 0, False, 77, "retain", "a4", "no ttl_s: kept for 3600 s"), dict(value=4), "retain_clipped"),
        (RETAIN_H, dict(value=2, max_blocks=2), "retain_clipped"),
        (DEMOTE_H, dict(value=2), "demote_accepted"),
        # Nothing of the session's to end (never retained, expired, another caller's).
        (DEMOTE_H, dict(value=0), "demote_missing"),
    ],
)
def test_outcomes_from_the_sidecars_answer(hint, answer, want, caplog):
    with caplog.at_level(logging.INFO, logger="ringside.vllm"):
        h, s, args = sent_and_answered(hint, **answer)
    assert outcomes(h) == {want: 1}
    assert args == (9, 0, min(4, answer.get("max_blocks", 1024)), hint.ttl_ms, hint.priority, hint.end, 77)
    logged = [r.getMessage() for r in caplog.records]
    if want.endswith("_accepted"):
        assert not logged
    else:
        (line,) = logged
        assert want.split("_")[1] in line and "'req-1'" in line


def test_a_sidecar_without_retain():
    h, s, _ = sent_and_answered(RETAIN_H, status=2)
    assert outcomes(h) == {"retain_rejected": 1} and not s.retain_supported
    # From then on nothing is sent, and the outcome is known at once.
    adm = FakeAdmission()
    h.send(adm, s, finished(), PIN_H)
    assert outcomes(h) == {"retain_rejected": 1, "pin_rejected": 1} and not h.awaited


def test_answers_of_a_session_that_ended_are_missing():
    h, s, adm = hints(KV), FakeSession(), FakeAdmission()
    h.send(adm, s, finished(), RETAIN_H)
    h.send(adm, s, finished(), DEMOTE_H)
    h.collect(FakeSession())  # the sidecar restarted
    assert outcomes(h) == {"retain_missing": 1, "demote_missing": 1} and not h.awaited
    h.send(adm, s, finished(), PIN_H)
    h.collect(None)  # no sidecar
    assert outcomes(h)["pin_missing"] == 1


def test_a_request_without_a_full_block():
    h, s = hints(KV), FakeSession()
    h.send(FakeAdmission(), s, finished(0), RETAIN_H)
    assert outcomes(h) == {"retain_missing": 1} and not s.sent


def test_request_body_hints_are_fire_and_forget():
    h, s = hints(BODY), FakeSession()
    h.send(FakeAdmission(), s, finished(), Hint(60_000, 1, False, 77))
    assert s.sent == [(0, (9, 0, 4, 60_000, 1, False, 77))] and not h.awaited and not outcomes(h)


def test_answers_awaited_are_bounded(monkeypatch):
    monkeypatch.setattr(retention, "MAX_AWAITED", 3)
    h, s, adm = hints(KV), FakeSession(), FakeAdmission()
    for _ in range(5):
        h.send(adm, s, finished(), RETAIN_H)
    assert len(h.awaited) == 3
    assert outcomes(h) == {"retain_accepted": 2}  # the connector's own word
    assert [seq for seq, _ in s.sent].count(0) == 2


def test_outcome_lines_are_escaped_and_rate_limited_apart_from_warnings(caplog):
    """A stream of rejected actions logs a burst, then one line every
    EVERY_S seconds, at INFO, and leaves the warnings' own budget alone."""
    t = [0.0]
    retention.told = callerlog.Limited(retention.logger, burst=3, every=10.0, clock=lambda: t[0])
    h = hints(KV)
    with caplog.at_level(logging.INFO, logger="ringside.vllm"):
        for i in range(100):
            h.of(req(kv_hints=envelope(action("share", aid="id\nERROR forged %d" % i)), rid="r%d" % i))
        h.of(req({"ringside_retain_s": 1}, kv_hints=envelope(action("retain", {"ttl_s": "x"}))))
    assert h.stats["hints_outcome_share_rejected"] == 100
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 3 and len(warns) == 1
    assert all("\n" not in r.getMessage() and "'id\\nERROR forged" in r.getMessage() for r in infos)
    t[0] += 10.0
    with caplog.at_level(logging.INFO, logger="ringside.vllm"):
        h.of(req(kv_hints=envelope(action("prefetch"))))
    assert "97 similar lines suppressed" in caplog.records[-1].getMessage()
