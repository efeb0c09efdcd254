"""Prefill to decode through the sidecar (ringside.vllm.disagg), under
vLLM's own Scheduler (vllm_harness) against a real sidecar: a prefill
engine announces the blocks it stored in its kv_transfer_params; a decode
engine given them waits, step by step, until the sidecar holds them, and no
longer than its pd_wait_s; only where pd_wait_s is set, and no more
requests at once than pd_max_waiting."""

from __future__ import annotations

import logging
import time

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable

from ringside.plugin import callerlog
from ringside.vllm import disagg, retention

PROMPT = 4 * H.BLOCK + 1  # 4 full blocks a prompt (and one output token)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(autouse=True)
def _fresh_limit(monkeypatch):
    """A fresh rate limit for each test (the module's is process-wide)."""
    limited = callerlog.Limited(retention.logger)
    monkeypatch.setattr(retention, "warn", limited)
    monkeypatch.setattr(disagg, "warn", limited)


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


def test_every_bad_count_is_counted_and_logged_escaped(caplog):
    stats = {"pd_bad_blocks": 0}
    with caplog.at_level(logging.WARNING, logger="ringside.vllm"):
        assert disagg.expected({"ringside_pd_blocks": "x"}, 4, "r1", stats) == 0
        assert disagg.expected({"ringside_pd_blocks": "y\nERROR forged"}, 4, "r2\n", stats) == 0
    said = [r.getMessage() for r in caplog.records if "ringside_pd_blocks" in r.getMessage()]
    assert len(said) == 2 and all("\n" not in m for m in said), said
    assert stats["pd_bad_blocks"] == 2


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


@pytest.mark.parametrize("extra", [{}, {"pd_wait_s": 0}])
def test_without_pd_wait_nothing_waits(start_sidecar, extra):
    """An engine not configured as a decode engine (the default) ignores
    the key, however many blocks a caller claims a prefill stored."""
    sc = start_sidecar()
    d = H.Engine(sc.sock, extra=dict(extra, mirror=False))
    try:
        d.run([H.request("dec", H.prompt(6, PROMPT), 1, {"ringside_pd_blocks": 1_000_000})], max_steps=20)
        assert d.stats["pd_waits"] == 0 and d.stats["pd_polls"] == 0 and d.stats["pd_timeouts"] == 0, d.stats
    finally:
        d.shutdown()


def test_no_more_than_pd_max_waiting_wait(start_sidecar):
    """Three requests announce blocks that never come, on a decode engine
    that lets one wait: the first waits, the other two compute at once."""
    sc = start_sidecar()
    d = H.Engine(sc.sock, extra={"mirror": False, "pd_wait_s": 30, "pd_max_waiting": 1})
    try:
        for i in range(3):
            d.add(H.request("dec-%d" % i, H.prompt(20 + i, PROMPT), 1, {"ringside_pd_blocks": 4}))
        for _ in range(200):
            if {"dec-1", "dec-2"} <= d.finished:
                break
            if not d.step().total_num_scheduled_tokens:
                time.sleep(0.001)
        assert {"dec-1", "dec-2"} <= d.finished and "dec-0" not in d.finished, d.finished
        assert d.stats["pd_over_cap"] == 2, d.stats
        assert d.sside.admission.pd_waiting == {"dec-0"}
        # An aborted request frees its place.
        d.sched.finish_requests("dec-0", H.RequestStatus.FINISHED_ABORTED)
        assert d.sside.admission.pd_waiting == set()
    finally:
        d.shutdown()


def test_a_waiting_request_polls_less_and_less(start_sidecar):
    """A request waiting for blocks that never come: its lookups go out
    POLL_S apart at first, then twice as far apart up to POLL_MAX_S, so
    that in 0.6 s of steps it sends a handful, not one a step (an upper
    bound only: a slow machine sends fewer)."""
    sc = start_sidecar()
    d = H.Engine(sc.sock, extra={"mirror": False, "pd_wait_s": 30})
    try:
        d.add(H.request("dec", H.prompt(30, PROMPT), 1, {"ringside_pd_blocks": 4}))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.6:
            d.step()
            time.sleep(0.0005)
        steps, polls = d.steps, d.stats["pd_polls"]
        # 5, 10, 20, 40, 80 ms, then 100 ms apart: at most 11 in 0.6 s.
        assert 1 <= polls <= 12 and steps > 3 * polls, (steps, polls)
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
