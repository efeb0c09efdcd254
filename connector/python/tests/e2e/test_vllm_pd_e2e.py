"""Prefill to decode through the sidecars, end to end: vLLM's P/D proxy flow
with the ringside connector alone on both engines. Two sidecars stand for
two nodes (separate pools) and share a real redis-server as their tier. A
prefill engine on sidecar A (plugin key pd_producer) runs each prompt with
one output token, as vLLM's proxy asks (kv_transfer_params
do_remote_decode), and answers with the blocks it stored; the decode
engine on sidecar B (pd_wait_s) gets the prompt with those
kv_transfer_params, waits until B's tier lookup finds the blocks A wrote
through, loads them and decodes: tokens identical to an engine alone, and
every prompt block a hit on B.

With RINGSIDE_PD_FIGURES=<file>, test_pd_ttft_figures writes the decode's
time to first token through the tier and through NIXL against recomputing
the prompt, on a model whose prefill costs something (`make bench-pd`;
docs/benchmarks.md).

Needs the vLLM venv and redis-server, like test_vllm_l2_e2e.py.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import pytest
from test_vllm_e2e import HERE, VENV_PY, model_dir  # noqa: F401 - model_dir: a fixture
from test_vllm_l2_e2e import _sidecar, _wait, redis_server  # noqa: F401 - redis_server: a fixture
from vllm_server import BLOCK, Server, free_port, metric, ringside_config

from ringside.sidecar_process import SidecarProcess

# The proxy's prefill request (vLLM's toy_proxy_server.py sends these keys).
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_TOKENS = 8


def prompt(i: int, nblocks: int = 12) -> str:
    text = "Conversation %d. " % i + "".join("turn %d line %03d says something new; " % (i, j) for j in range(60))
    return text[: nblocks * BLOCK - 1]  # nblocks full blocks with the BOS token


def pd(pre: Server, dec: Server, text: str, max_tokens: int) -> tuple[dict, dict, float]:
    """What vLLM's P/D proxy does: the prompt to the prefill engine with one
    output token, its kv_transfer_params to the decode engine with the
    prompt. Returns both responses and the decode's latency."""
    first = pre.complete(text, dict(REMOTE_DECODE), max_tokens=1)
    t0 = time.perf_counter()
    out = dec.complete(text, first.get("kv_transfer_params"), max_tokens=max_tokens)
    return first, out, time.perf_counter() - t0


def test_prefill_to_decode_through_the_tier(model_dir, ringside_bin, redis_server, tmp_path):  # noqa: F811
    tmp = str(tmp_path)
    prompts = [prompt(i) for i in range(3)]
    nblocks = (len(prompts[0]) + 1) // BLOCK
    alone = Server(model_dir, tmp, None, name="alone")
    try:
        want = [alone.complete(p, max_tokens=MAX_TOKENS)["choices"][0]["text"] for p in prompts]
    finally:
        alone.stop()

    key = "pd-%d-%d:" % (os.getpid(), int(time.time() * 1000))
    a = _sidecar(ringside_bin, tmp, "sidecar-a", redis_server, key)
    b = _sidecar(ringside_bin, tmp, "sidecar-b", redis_server, key)
    pre = dec = None
    try:
        _wait(
            "a sidecar never connected to the tier",
            lambda: a.state()["l2"]["connected"] and b.state()["l2"]["connected"],
        )
        pre = Server(model_dir, tmp, ringside_config(a.sock, pd_producer=True), name="prefill")
        dec = Server(model_dir, tmp, ringside_config(b.sock, pd_wait_s=30), name="decode")
        for text, expect in zip(prompts, want):
            fetched0 = b.state()["l2"]["machine"]["FetchedBlocks"]
            first, out, _ = pd(pre, dec, text, MAX_TOKENS)
            assert first["kv_transfer_params"] == {"ringside_pd_blocks": nblocks}, first
            assert out["choices"][0]["text"] == expect, "the decode differs from the engine alone"
            # Every block it may load (all but the one of its last token)
            # came to B from A's writes to the tier, and was loaded.
            assert b.state()["l2"]["machine"]["FetchedBlocks"] - fetched0 == nblocks - 1
        l2 = b.state()["l2"]
        assert l2["machine"]["LookupHitBlocks"] >= 3 * (nblocks - 1), l2
        assert l2["client"]["rejected_values"] == {k: 0 for k in l2["client"]["rejected_values"]}, l2
        assert b.state()["pool"]["Leases"] == 0

    finally:
        for s in (dec, pre):
            if s is not None:
                s.stop()
        b.stop()
        a.stop()


# -- beside NixlConnector ------------------------------------------------------


def nixl_config(sock: str, **extra) -> dict:
    """MultiConnector[NixlConnector on host buffers, RingsideConnector]."""
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"connectors": [nixl, ringside_config(sock, **extra)]},
    }


def _has_nixl() -> bool:
    r = subprocess.run([VENV_PY, "-c", "import nixl._api"], capture_output=True, timeout=120)
    return r.returncode == 0


@pytest.mark.skipif(not os.environ.get("RINGSIDE_TEST_NIXL"), reason="opt-in: make test-pd-nixl (installs NIXL)")
def test_prefill_to_decode_with_nixl_beside_ringside(model_dir, ringside_bin, tmp_path):  # noqa: F811
    """vLLM's P/D with NIXL moving the KV (on host buffers, UCX over
    loopback) and ringside beside it under MultiConnector on both engines,
    each on its own sidecar: the decode's tokens are the engine alone's,
    its prompt came from NIXL (its sidecar had none of it), both sidecars
    stored the prompt, and a later turn hits in either engine's sidecar."""
    assert _has_nixl(), "NIXL is not importable in the vLLM venv: run make test-pd-nixl"
    tmp = str(tmp_path)
    prompts = [prompt(i) for i in range(3)]
    nblocks = (len(prompts[0]) + 1) // BLOCK
    alone = Server(model_dir, tmp, None, name="alone")
    try:
        want = [alone.complete(p, max_tokens=MAX_TOKENS)["choices"][0]["text"] for p in prompts]
        want_next = [alone.complete(p + " And then?", max_tokens=MAX_TOKENS)["choices"][0]["text"] for p in prompts]
    finally:
        alone.stop()
    a = _sidecar_plain(ringside_bin, tmp, "sidecar-a")
    b = _sidecar_plain(ringside_bin, tmp, "sidecar-b")
    pre = dec = None
    try:
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
        pre = Server(
            model_dir, tmp, nixl_config(a.sock), name="prefill",
            env=dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
        )  # fmt: skip
        dec = Server(
            model_dir, tmp, nixl_config(b.sock), name="decode",
            env=dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
        )  # fmt: skip
        for text, expect in zip(prompts, want):
            first, out, _ = pd(pre, dec, text, MAX_TOKENS)
            params = first.get("kv_transfer_params") or {}
            assert params.get("remote_block_ids"), "NIXL gave the prefill no transfer params: %s" % first
            assert not any(k.startswith("ringside_") for k in params), params  # NIXL's alone
            assert out["choices"][0]["text"] == expect, "the decode differs from the engine alone"
        # NIXL moved the prompts' KV to the decode engine, and none failed.
        _wait("NIXL transferred nothing", lambda: dec.prom("vllm:nixl_bytes_transferred_sum") > 0, timeout=30)
        assert dec.prom("vllm:nixl_num_failed_transfers_total") == 0
        # The decode's sidecar never served those prompts.
        assert metric(b.metrics, "ringside_hit_blocks_total") == 0
        # Both sidecars stored the prompts (the decode's from the blocks NIXL loaded).
        for sc in (a, b):
            _wait("a sidecar lacks the prompts", lambda sc=sc: sc.state()["pool"]["Blocks"] >= 3 * (nblocks - 1))
        # A later turn hits in either engine.
        for srv, sc in ((pre, a), (dec, b)):
            hits0 = metric(sc.metrics, "ringside_hit_blocks_total")
            got = [srv.complete(p + " And then?", max_tokens=MAX_TOKENS)["choices"][0]["text"] for p in prompts]
            assert got == want_next
            assert metric(sc.metrics, "ringside_hit_blocks_total") - hits0 >= 3 * (nblocks - 1)

    finally:
        for s in (dec, pre):
            if s is not None:
                s.stop()
        b.stop()
        a.stop()


def _sidecar_plain(binary, tmp, name):
    return SidecarProcess(
        binary, pool="64MiB", slot="32KiB", metrics=True, log_level="warn",
        log=os.path.join(tmp, name + ".log"), prefix="rs-pde2e-",
    )  # fmt: skip


# -- figures ---------------------------------------------------------------------

# bench/vllm's TTFT model (make_tiny_model.py options): 256 KiB KV pages of 32
# tokens, about 0.8 s to prefill 2048 tokens on a 2-vCPU VM.
FIG_MODEL = ["--hidden", "256", "--intermediate", "688", "--layers", "8", "--heads", "4",
             "--kv-heads", "2", "--head-dim", "64", "--max-pos", "4096"]  # fmt: skip
FIG_BLOCKS = 63  # a prompt of 63 blocks (2016 tokens)


def _fig_sidecar(binary, tmp, name, *args):
    return SidecarProcess(
        binary, pool="1GiB", slot="256KiB", metrics=True, log_level="warn", args=list(args),
        log=os.path.join(tmp, name + ".log"), prefix="rs-pdfig-",
    )  # fmt: skip


@pytest.mark.skipif(not os.environ.get("RINGSIDE_PD_FIGURES"), reason="a benchmark: make bench-pd")
def test_pd_ttft_figures(ringside_bin, redis_server, tmp_path):  # noqa: F811
    """The decode engine's time to first token (a request for one token) on
    fresh prompts of FIG_BLOCKS blocks, in one run, alternating: recomputed
    on the decode engine of the tier pair; through the sidecars' tier
    (prefill on sidecar A, decode on sidecar B, one Redis); through NIXL
    (MultiConnector[NixlConnector, ringside] on both engines), when NIXL is
    installed. The latency is the decode request's; the prefill request
    before it is not counted."""
    tmp = str(tmp_path)
    model = os.path.join(tmp, "model")
    subprocess.run([VENV_PY, os.path.join(HERE, "make_tiny_model.py"), model, *FIG_MODEL], check=True, timeout=600)
    key = "pdfig-%d-%d:" % (os.getpid(), int(time.time() * 1000))
    tier = ["--l2.redis.addrs", redis_server, "--l2.redis.prefix", key]
    cars = [_fig_sidecar(ringside_bin, tmp, "sidecar-%s" % n, *(tier if n in "ab" else [])) for n in "abcd"]
    servers: list = []
    nixl = _has_nixl()
    try:
        for sc in cars[:2]:
            _wait("a sidecar never connected to the tier", lambda sc=sc: sc.state()["l2"]["connected"])
        env = {"VLLM_CPU_KVCACHE_SPACE": "2"}

        def server(cfg, name, extra_env=None):
            srv = Server(model, tmp, cfg, name=name, env=dict(env, **(extra_env or {})), max_model_len=4096)
            servers.append(srv)
            return srv

        pre = server(ringside_config(cars[0].sock, pd_producer=True), "prefill-tier")
        dec = server(ringside_config(cars[1].sock, pd_wait_s=30), "decode-tier")
        paths = {"recompute": None, "tier": (pre, dec)}
        if nixl:
            ucx = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
            np_ = server(
                nixl_config(cars[2].sock), "prefill-nixl", dict(ucx, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            )
            nd = server(
                nixl_config(cars[3].sock), "decode-nixl", dict(ucx, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            )
            paths["nixl"] = (np_, nd)
        # One warm-up request per path (first-request costs: compilation, allocation).
        times: dict = {k: [] for k in paths}
        for i in range(-1, 8):
            for j, (name, pair) in enumerate(paths.items()):
                text = fig_prompt(10_000 + 100 * i + j)
                if pair is None:
                    t0 = time.perf_counter()
                    dec.complete(text, None, max_tokens=1)
                    dt = time.perf_counter() - t0
                else:
                    _, _, dt = pd(pair[0], pair[1], text, 1)
                if i >= 0:
                    times[name].append(dt)
        out = {
            "model": " ".join(FIG_MODEL),
            "prompt_blocks": FIG_BLOCKS,
            "block_tokens": BLOCK,
            "ttft_s": times,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "loadavg": os.getloadavg(),
            "nixl": nixl,
        }
        with open(os.environ["RINGSIDE_PD_FIGURES"], "w") as f:
            json.dump(out, f, indent=1)
    finally:
        for srv in servers:
            srv.stop()
        for sc in cars:
            sc.stop()


def fig_prompt(i: int) -> str:
    text = "Request %d. " % i + "".join("line %d.%04d of a long shared document; " % (i, j) for j in range(200))
    return text[: FIG_BLOCKS * BLOCK - 1]
