"""Prefill to decode through the sidecar (ringside.vllm.disagg), under
vLLM's own Scheduler (vllm_harness) against a real sidecar: a prefill
engine announces the blocks it stored in its kv_transfer_params; a decode
engine given them waits, step by step, until the sidecar holds them, and no
longer than its pd_wait_s."""

from __future__ import annotations

import logging
import time

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable

from ringside.vllm import disagg

PROMPT = 4 * H.BLOCK + 1  # 4 full blocks a prompt (and one output token)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    disagg._warned.clear()
    yield
    disagg._warned.clear()


@pytest.mark.parametrize(
    "params, usable, want",
    [
        (None, 4, 0),
        ({}, 4, 0),
        ({"remote_engine_id": "x"}, 4, 0),  # another connector's keys
        ({"ringside_pd_blocks": 3}, 4, 3),
        ({"ringside_pd_blocks": 9}, 4, 4),  # no more than the request may load
        ({"ringside_pd_blocks": 0}, 4, 0),
        ({"ringside_pd_blocks": -1}, 4, 0),
        ({"ringside_pd_blocks": "3"}, 4, 0),
        ({"ringside_pd_blocks": True}, 4, 0),
        ({"ringside_pd_blocks": 2.0}, 4, 0),
    ],
)
def test_expected(params, usable, want):
    assert disagg.expected(params, usable) == want


def test_a_bad_count_is_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        assert disagg.expected({"ringside_pd_blocks": "x"}, 4) == 0
        assert disagg.expected({"ringside_pd_blocks": "y"}, 4) == 0
    said = [r.getMessage() for r in caplog.records if "ringside_pd_blocks" in r.getMessage()]
    assert len(said) == 1, said


def test_the_prefill_announces_the_blocks_it_stored(start_sidecar):
    sc = start_sidecar()
    p = H.Engine(sc.sock, extra={"mirror": False, "pd_producer": True})
    try:
        p.run(
            [
                H.request("pd", H.prompt(1, PROMPT), 1, dict(REMOTE_DECODE)),
                H.request("plain", H.prompt(2, PROMPT), 1),
            ]
        )
        assert p.params.get("pd") == {"ringside_pd_blocks": 4}
        assert "plain" not in p.params  # no remote decode asked: nothing of ringside's
        assert p.stats["pd_announced_blocks"] == 4
    finally:
        p.shutdown()
    # Not configured as a producer: no kv_transfer_params of its own (the
    # transfer connector beside it may be the one that produces them).
    q = H.Engine(sc.sock, extra={"mirror": False})
    try:
        q.run([H.request("pd2", H.prompt(3, PROMPT), 1, dict(REMOTE_DECODE))])
        assert "pd2" not in q.params
    finally:
        q.shutdown()


def test_the_decode_waits_for_the_prefills_blocks(start_sidecar):
    """The decode request arrives before the prefill has stored anything:
    vLLM is told to ask again every step (the request is not scheduled)
    until the blocks are there, then it loads all four."""
    sc = start_sidecar()
    tokens = H.prompt(4, PROMPT)
    d = H.Engine(sc.sock, extra={"mirror": False, "pd_wait_s": 30})
    p = H.Engine(sc.sock, extra={"mirror": False, "pd_producer": True})
    try:
        d.add(H.request("dec", tokens, 4, {"ringside_pd_blocks": 4}))
        for _ in range(10):
            so = d.step()
            assert not so.total_num_scheduled_tokens  # waiting, not computing
            time.sleep(0.01)  # polls are disagg.POLL_S apart at least
        assert d.stats["pd_waits"] >= 3
        p.run([H.request("pre", tokens, 1, dict(REMOTE_DECODE))])
        assert p.params["pre"] == {"ringside_pd_blocks": 4}
        deadline = time.time() + 20
        while "dec" not in d.finished:
            assert time.time() < deadline and d.steps < 2000, d.stats
            so = d.step()
            if not so.total_num_scheduled_tokens:
                time.sleep(0.001)
        assert d.stats["hit_blocks"] == 4 and d.stats["pd_timeouts"] == 0, d.stats
        assert d.wstats["loaded_blocks"] == 4 and d.wstats["load_error_blocks"] == 0, d.wstats
        assert d.checked_blocks >= 4  # the loaded blocks hold the prompt's bytes
    finally:
        p.shutdown()
        d.shutdown()


def test_the_decode_waits_no_longer_than_its_deadline(start_sidecar):
    """Announced blocks that never come: after pd_wait_s the request is
    computed from what the sidecar holds (here: nothing). A request cannot
    ask for a longer wait: the count is all it carries."""
    sc = start_sidecar()
    d = H.Engine(sc.sock, extra={"mirror": False, "pd_wait_s": 0.3})
    try:
        t0 = time.monotonic()
        d.add(H.request("dec", H.prompt(5, PROMPT), 2, {"ringside_pd_blocks": 4, "ringside_pd_wait_s": 1e9}))
        while "dec" not in d.finished:
            assert time.monotonic() - t0 < 20, d.stats
            so = d.step()
            if not so.total_num_scheduled_tokens:
                time.sleep(0.005)
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 10, waited
        assert d.stats["pd_timeouts"] == 1 and d.stats["hit_blocks"] == 0, d.stats
        assert len(d.outputs["dec"]) == 2
    finally:
        d.shutdown()


def test_without_pd_wait_nothing_waits(start_sidecar):
    sc = start_sidecar()
    d = H.Engine(sc.sock, extra={"mirror": False, "pd_wait_s": 0})
    try:
        d.run([H.request("dec", H.prompt(6, PROMPT), 1, {"ringside_pd_blocks": 4})])
        assert d.stats["pd_waits"] == 0 and d.stats["pd_timeouts"] == 0, d.stats
    finally:
        d.shutdown()


def test_a_partial_prefix_is_waited_for_in_full(start_sidecar):
    """Two of the four announced blocks are there (an earlier request shared
    them): the decode still waits for the other two."""
    sc = start_sidecar()
    tokens = H.prompt(7, PROMPT)
    d = H.Engine(sc.sock, extra={"mirror": False, "pd_wait_s": 30})
    p = H.Engine(sc.sock, extra={"mirror": False, "pd_producer": True})
    try:
        p.run([H.request("half", tokens[: 2 * H.BLOCK + 1], 1)])
        d.add(H.request("dec", tokens, 2, {"ringside_pd_blocks": 4}))
        for _ in range(3):
            assert not d.step().total_num_scheduled_tokens
        p.run([H.request("pre", tokens, 1, dict(REMOTE_DECODE))])
        deadline = time.time() + 20
        while "dec" not in d.finished:
            assert time.time() < deadline, d.stats
            if not d.step().total_num_scheduled_tokens:
                time.sleep(0.001)
        assert d.stats["hit_blocks"] == 4 and d.stats["pd_timeouts"] == 0, d.stats
    finally:
        p.shutdown()
        d.shutdown()
