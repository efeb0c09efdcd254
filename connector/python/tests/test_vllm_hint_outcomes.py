"""The outcome of each action of vLLM's KvHintsEnvelope (ringside.vllm.
retention) as the connector's scheduler side counts it under vLLM's own
Scheduler (vllm_harness), from a real sidecar's answers: accepted, clipped
by the uid's retain share, rejected, superseded, and missing (no retention
to end, no sidecar). What is read from an envelope, and each outcome from
each answer, is tested without an engine in test_hints.py."""

from __future__ import annotations

import time

import vllm_harness as H  # skips this module where vLLM is not importable
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

KV = {"mirror": False, "hint_sources": "kv_hints"}
PROMPT = 4 * H.BLOCK + 1  # 4 full blocks a prompt (and one output token)


def envelope(*actions) -> KvHintsEnvelope:
    return KvHintsEnvelope(
        protocol_version="1.0",
        message_id="m-1",
        actions=[KvHintAction(action_id="a%d" % i, action_type=t, action_version="1.0", payload=p)
                 for i, (t, p) in enumerate(actions)],
    )  # fmt: skip


def hinted(rid: str, tokens, env: KvHintsEnvelope):
    req = H.request(rid, tokens, 1)
    req.kv_hints = env  # where vLLM's engine API puts it (Request.kv_hints)
    return req


def settle(eng: H.Engine, reqs) -> dict:
    """Run reqs, then step until the connector holds no finished request's
    blocks and awaits no answer to a hint; the outcome counters that moved."""
    before = dict(eng.stats)
    eng.run(reqs)
    for _ in range(500):
        if not eng.sside.holding and not eng.sside.hints.awaited:
            break
        eng.step()
        time.sleep(0.002)  # the sidecar's answer arrives between steps
    else:
        raise AssertionError("not settled: %s %s" % (eng.sside.holding, eng.sside.hints.awaited))
    return {
        k[len("hints_outcome_") :]: v - before.get(k, 0)
        for k, v in eng.stats.items()
        if k.startswith("hints_outcome_") and v != before.get(k, 0)
    }


def test_outcomes_from_a_real_sidecar(start_sidecar):
    """A pool of 16 blocks: the uid may retain 4 (--limits.retain-share
    0.25). The first retention takes them all; a pin of another prompt
    finds the share full (clipped, nothing kept); a demote of a session that
    retained nothing has nothing to end (missing); share and prefetch are
    rejected; of a retain and a pin in one envelope the pin is applied."""
    sc = start_sidecar(metrics=True, pool="64KiB")
    a = H.Engine(sc.sock, extra=KV)
    try:
        first, second = H.prompt(1, PROMPT), H.prompt(2, PROMPT)
        got = settle(a, [hinted("r1", first, envelope(("retain", {"ttl_s": 600, "session_id": "s1"})))])
        assert got == {"retain_accepted": 1}
        assert sc.state()["pool"]["RetainedBlocks"] == 4
        got = settle(a, [hinted("r2", second, envelope(("PIN", {"ttl_s": 600, "session_id": "s2"})))])
        assert got == {"pin_clipped": 1}
        assert sc.state()["pool"]["RetainedBlocks"] == 4
        got = settle(a, [hinted("r3", second, envelope(("kv.demote", {"session_id": "nobody"})))])
        assert got == {"demote_missing": 1}
        env = envelope(("share", {}), ("prefetch", {}), ("retain", {"ttl_s": 60}), ("pin", {"session_id": "s1"}))
        got = settle(a, [hinted("r4", first, env)])
        # The pin renews s1's retention of the first prompt (its blocks; no
        # TTL: an hour, clipped).
        assert got == {"share_rejected": 1, "prefetch_rejected": 1, "retain_rejected": 1, "pin_clipped": 1}
        got = settle(a, [hinted("r5", first, envelope(("demote", {"session_id": "s1"})))])
        assert got == {"demote_accepted": 1}
        assert sc.state()["pool"]["RetainedBlocks"] == 0
        assert a.stats["sidecar_errors"] == 0
    finally:
        a.shutdown()


def test_without_a_sidecar_every_action_is_missing(start_sidecar):
    """The sidecar is gone before the request finishes: its retain has
    nothing to act on, and the request completes."""
    sc = start_sidecar(metrics=True, pool="64KiB")
    a = H.Engine(sc.sock, extra=KV)
    try:
        sc.stop()
        got = settle(a, [hinted("r1", H.prompt(3, PROMPT), envelope(("retain", {"ttl_s": 60})))])
        assert got == {"retain_missing": 1}
        assert "r1" in a.finished
    finally:
        a.shutdown()
