"""What a request body's kv_transfer_params can make the vLLM connector do
(ringside.vllm.retention, ringside.plugin.callerlog): hints only from the
sources the operator honours, an identity for every retention, every bad
value counted by reason, and the log safe from what a caller sends (escaped,
cut, rate-limited, bounded memory). Pure: no engine, no sidecar."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ringside.plugin import callerlog
from ringside.plugin.config import Config, ConfigError
from ringside.vllm import retention
from ringside.vllm.retention import Hint, Hints, owner_of

BODY = frozenset({retention.KV_TRANSFER_PARAMS})


@pytest.fixture(autouse=True)
def _fresh_limit(monkeypatch):
    """A fresh rate limit for each test (the module's is process-wide)."""
    monkeypatch.setattr(retention, "warn", callerlog.Limited(retention.logger))


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
