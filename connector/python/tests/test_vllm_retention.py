"""Retention hints in a request's kv_transfer_params (ringside.vllm.retention):
read and checked, then sent to a real sidecar by the connector's scheduler
side under vLLM's own Scheduler (vllm_harness), where they change which
blocks the sidecar evicts."""

from __future__ import annotations

import logging
import time

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable

from ringside.vllm import retention
from ringside.vllm.retention import Hint, hint_of


@pytest.fixture(autouse=True)
def _fresh_warnings():
    retention._warned.clear()
    yield
    retention._warned.clear()


@pytest.mark.parametrize(
    "params, want",
    [
        (None, None),
        ({}, None),
        ({"remote_engine_id": "x"}, None),  # another connector's keys
        ({"ringside_retain_s": 600}, Hint(600_000, 0, False)),
        ({"ringside_retain_s": 1.5, "ringside_priority": 3}, Hint(1500, 3, False)),
        ({"ringside_retain_s": 0.0001}, Hint(1, 0, False)),  # at least 1 ms
        ({"ringside_retain_s": 10**9}, Hint(int(retention.MAX_RETAIN_S * 1000), 0, False)),  # shortened
        ({"ringside_session_end": True}, Hint(0, 0, True)),
        ({"ringside_session_end": True, "ringside_retain_s": 60}, Hint(0, 0, True)),  # the end wins
        ({"ringside_session_end": False, "ringside_retain_s": 60}, Hint(60_000, 0, False)),
    ],
)
def test_hints(params, want):
    assert hint_of(params) == want


@pytest.mark.parametrize(
    "params, key",
    [
        ({"ringside_retain_s": 0}, "ringside_retain_s"),
        ({"ringside_retain_s": -5}, "ringside_retain_s"),
        ({"ringside_retain_s": "600"}, "ringside_retain_s"),
        ({"ringside_retain_s": True}, "ringside_retain_s"),
        ({"ringside_retain_s": float("nan")}, "ringside_retain_s"),
        ({"ringside_retain_s": float("inf")}, "ringside_retain_s"),
        ({"ringside_retain_s": 60, "ringside_priority": 4}, "ringside_priority"),
        ({"ringside_retain_s": 60, "ringside_priority": -1}, "ringside_priority"),
        ({"ringside_retain_s": 60, "ringside_priority": 1.0}, "ringside_priority"),
        ({"ringside_priority": 2}, "ringside_priority"),
        ({"ringside_session_end": "yes"}, "ringside_session_end"),
    ],
)
def test_bad_hints_are_ignored_and_logged_once(params, key, caplog):
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        assert hint_of(params) is None
        assert hint_of(params) is None
    said = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(said) == 1, said


def test_a_misspelt_key_is_named(caplog):
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        assert hint_of({"ringside_retain": 60}) is None
    assert any("ringside_retain" in r.getMessage() and "not a ringside key" in r.getMessage() for r in caplog.records)


# -- through vLLM's scheduler, against a real sidecar ----------------------------

PROMPT = 4 * H.BLOCK + 1  # 4 full blocks a prompt (and one output token)


def run_and_settle(eng: H.Engine, reqs) -> None:
    """Run reqs, then step until vLLM holds no finished request's blocks
    for the workers' stores (their hints are sent by then)."""
    eng.run(reqs)
    for _ in range(200):
        if not eng.sside.holding:
            return
        eng.step()
        time.sleep(0.002)
    raise AssertionError("held requests never released: %s" % eng.sside.holding)


def flood(eng: H.Engine, n: int) -> None:
    """n requests of 4 new blocks each, without hints, one after the other
    (so that the blocks being written never need the retained ones' slots:
    a store is never refused for a retention, it evicts them last)."""
    for i in range(n):
        run_and_settle(eng, [H.request("flood-%d" % i, H.prompt(100 + i, PROMPT), 1)])


def hits(sock: str, tokens) -> int:
    """Leading blocks of tokens a fresh engine finds in the sidecar."""
    eng = H.Engine(sock, extra={"mirror": False})
    try:
        eng.run([H.request("probe", tokens, 1)])
        return eng.stats["hit_blocks"]
    finally:
        eng.shutdown()


@pytest.fixture
def small(start_sidecar):
    return start_sidecar(metrics=True, pool="64KiB")  # 16 slots: 16 blocks


def test_a_retained_prefix_outlives_a_flood(small):
    """Two requests store 4 blocks each, one asking to be kept; 16 new
    blocks then pass through a pool of 16. The unhinted request's blocks
    are evicted, the retained ones stay and are loaded by the next engine
    (without the hint, both would go: they are the oldest)."""
    kept, plain = H.prompt(1, PROMPT), H.prompt(2, PROMPT)
    a = H.Engine(small.sock, extra={"mirror": False})
    run_and_settle(a, [H.request("kept", kept, 1, {"ringside_retain_s": 600}), H.request("plain", plain, 1)])
    assert small.state()["pool"]["RetainedBlocks"] == 4
    flood(a, 4)
    assert a.stats["sidecar_errors"] == 0 and a.wstats["store_errors"] == 0
    a.shutdown()
    assert small.state()["pool"]["Evictions"] >= 8
    assert hits(small.sock, kept) == 4
    assert hits(small.sock, plain) == 0


def test_a_session_end_gives_the_blocks_up_first(small):
    """A conversation kept for 10 minutes ends (its next turn says so): its
    blocks lose their retention and are the first a flood evicts."""
    turn1 = H.prompt(3, PROMPT)
    a = H.Engine(small.sock, extra={"mirror": False})
    run_and_settle(a, [H.request("t1", turn1, 1, {"ringside_retain_s": 600, "ringside_priority": 3})])
    assert small.state()["pool"]["RetainedBlocks"] == 4
    run_and_settle(a, [H.request("t2", turn1 + [7] * H.BLOCK, 1, {"ringside_session_end": True})])
    assert small.state()["pool"]["RetainedBlocks"] == 0
    flood(a, 4)  # the flood that a retained prefix outlives (above): now it evicts it
    a.shutdown()
    assert hits(small.sock, turn1) == 0


def test_a_bad_hint_changes_nothing_and_fails_nothing(small):
    a = H.Engine(small.sock, extra={"mirror": False})
    run_and_settle(a, [H.request("bad", H.prompt(4, PROMPT), 1, {"ringside_retain_s": "forever"})])
    assert a.finished == {"bad"}
    assert a.stats["sidecar_errors"] == 0 and a.wstats["store_errors"] == 0
    assert small.state()["pool"]["RetainedBlocks"] == 0
    a.shutdown()
