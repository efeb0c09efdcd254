"""Retention hints (ringside.vllm.retention) sent to a real sidecar by the
connector's scheduler side under vLLM's own Scheduler (vllm_harness), where
they change which blocks the sidecar evicts: from request bodies once the
operator grants them, from vLLM's KvHintsEnvelope, never past the request's
cap, and only their owner ends them. What is read from a hint, and what a
bad one logs, is tested in test_hints.py."""

from __future__ import annotations

import time

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

# Request bodies' hints are honoured only where the operator says so.
BODY = {"mirror": False, "hint_sources": "kv_transfer_params"}


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


def retained(sc, eng: H.Engine) -> int:
    """The sidecar's retained blocks once it has handled every record the
    engine's scheduler sent (a hint goes out without a reply: a ping on the
    same session comes back after it)."""
    eng.sside.link.session.ping()
    return sc.state()["pool"]["RetainedBlocks"]


def flood(eng: H.Engine, n: int) -> None:
    """n requests of 4 new blocks each, without hints, one after the other
    (so that the blocks being written never need the retained ones' slots:
    a store is never refused for a retention, it evicts them last)."""
    for i in range(n):
        run_and_settle(eng, [H.request("flood-%d" % i, H.prompt(100 + i, PROMPT), 1)])


def hits(sock: str, tokens) -> int:
    """Leading blocks of tokens a fresh engine finds in the sidecar."""
    eng = H.Engine(sock, extra=BODY)
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
    a = H.Engine(small.sock, extra=BODY)
    run_and_settle(a, [H.request("kept", kept, 1, {"ringside_retain_s": 600}), H.request("plain", plain, 1)])
    assert retained(small, a) == 4
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
    a = H.Engine(small.sock, extra=BODY)
    s1 = {"ringside_session": "conv-1"}
    run_and_settle(a, [H.request("t1", turn1, 1, dict(s1, ringside_retain_s=600, ringside_priority=3))])
    assert retained(small, a) == 4
    run_and_settle(a, [H.request("t2", turn1 + [7] * H.BLOCK, 1, dict(s1, ringside_session_end=True))])
    assert retained(small, a) == 0
    flood(a, 4)  # the flood that a retained prefix outlives (above): now it evicts it
    a.shutdown()
    assert hits(small.sock, turn1) == 0


def test_a_bad_hint_changes_nothing_and_fails_nothing(small):
    a = H.Engine(small.sock, extra=BODY)
    run_and_settle(a, [H.request("bad", H.prompt(4, PROMPT), 1, {"ringside_retain_s": "forever"})])
    assert a.finished == {"bad"}
    assert a.stats["sidecar_errors"] == 0 and a.wstats["store_errors"] == 0
    assert retained(small, a) == 0
    a.shutdown()


def test_only_the_owner_ends_a_retention(small):
    """Another caller that sends the same prompt with a session end (its
    own session, or none) ends nothing; the session that retained it does."""
    turn1 = H.prompt(5, PROMPT)
    a = H.Engine(small.sock, extra=BODY)
    mine = {"ringside_session": "victim"}
    run_and_settle(a, [H.request("v1", turn1, 1, dict(mine, ringside_retain_s=600))])
    assert retained(small, a) == 4
    run_and_settle(a, [H.request("x1", turn1, 1, {"ringside_session_end": True})])
    run_and_settle(a, [H.request("x2", turn1, 1, {"ringside_session_end": True, "ringside_session": "other"})])
    # Nor can another session re-prioritise it (its Retain leaves the blocks alone).
    run_and_settle(a, [H.request("x3", turn1, 1, {"ringside_retain_s": 1, "ringside_session": "other"})])
    assert retained(small, a) == 4
    flood(a, 4)
    assert hits(small.sock, turn1) == 4, "another caller ended or shortened the victim's retention"
    run_and_settle(a, [H.request("v2", turn1, 1, dict(mine, ringside_session_end=True))])
    assert retained(small, a) == 0
    a.shutdown()


def test_request_bodies_keep_nothing_by_default(small):
    a = H.Engine(small.sock, extra={"mirror": False})
    run_and_settle(a, [H.request("flood", H.prompt(6, PROMPT), 1, {"ringside_retain_s": 3600, "ringside_priority": 3})])
    assert retained(small, a) == 0
    assert a.stats["hints_not_honoured"] == 1
    a.shutdown()


def test_a_request_retains_at_most_retain_max_blocks(small):
    a = H.Engine(small.sock, extra=dict(BODY, retain_max_blocks=2))
    run_and_settle(a, [H.request("big", H.prompt(7, PROMPT), 1, {"ringside_retain_s": 600})])
    assert retained(small, a) == 2
    assert a.stats["hints_capped"] == 1
    a.shutdown()


def envelope(*actions) -> KvHintsEnvelope:
    return KvHintsEnvelope(
        protocol_version="1.0",
        message_id="m-1",
        actions=[KvHintAction(action_id="a%d" % i, action_type=t, action_version="1.0", payload=p)
                 for i, (t, p) in enumerate(actions)],
    )  # fmt: skip


def with_hints(req, env):
    req.kv_hints = env  # where vLLM's engine API puts it (Request.kv_hints)
    return req


def test_kv_hints_from_the_engine_api(small):
    """vLLM's KvHintsEnvelope (request.kv_hints, set through the engine's
    API): a retain action keeps the blocks, a demote of the same session
    ends that; honoured only where hint_sources names kv_hints."""
    turn1 = H.prompt(8, PROMPT)
    keep = envelope(("retain", {"ttl_s": 600, "priority": 2, "session_id": "agent-7"}))
    off = H.Engine(small.sock, extra={"mirror": False})
    run_and_settle(off, [with_hints(H.request("k0", turn1, 1), keep)])
    assert retained(small, off) == 0
    assert off.stats["hints_not_honoured"] == 1
    off.shutdown()
    a = H.Engine(small.sock, extra={"mirror": False, "hint_sources": "kv_hints"})
    run_and_settle(a, [with_hints(H.request("k1", turn1, 1), keep)])
    assert retained(small, a) == 4
    # Another kind of action, and a bad retain, change nothing.
    bad = envelope(("kv.fetch", {"x": 1}), ("retain", {"ttl_s": "long"}))
    run_and_settle(a, [with_hints(H.request("k2", turn1, 1), bad)])
    assert a.stats["hints_bad_kv_hints"] == 1
    assert retained(small, a) == 4
    run_and_settle(a, [with_hints(H.request("k3", turn1, 1), envelope(("demote", {"session_id": "agent-7"})))])
    assert retained(small, a) == 0
    a.shutdown()
