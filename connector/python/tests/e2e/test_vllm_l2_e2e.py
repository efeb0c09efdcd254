"""Two nodes sharing a tier, end to end: two ringside sidecars on one
machine stand for two nodes (separate --dir, separate pools) and share a
real redis-server as their shared tier (--l2.redis.addrs). A real vLLM
engine on sidecar A serves the prompts (its blocks are written through to
the tier); a second real vLLM engine on sidecar B, whose pool holds
nothing, then gets hits for them from the tier, loaded through B's pool,
with tokens identical to an engine without any connector.

Needs the vLLM venv (`make vllm-venv`) and redis-server (Debian's
redis-server package); without them the module is skipped, except under
CI=true, where a missing one is a failure.
"""

import os
import shutil
import socket
import subprocess
import time

import pytest

# The engine runner and the fixtures of the one-node tests (this directory
# is on sys.path: pytest's default import mode, no __init__.py).
from test_vllm_e2e import VENV_PY, connector_stats, model_dir, prompts_file, run_engine  # noqa: F401

from ringside.sidecar_process import SidecarProcess
from ringside.sidecar_process import free_port as _free_port

REDIS = shutil.which("redis-server")
if REDIS is None or not os.path.exists(VENV_PY):
    if os.environ.get("CI"):
        raise RuntimeError("CI: redis-server or the vLLM venv is missing")
    pytest.skip("needs redis-server and the vLLM venv", allow_module_level=True)


@pytest.fixture(scope="module")
def baseline(model_dir, prompts_file, tmp_path_factory):  # noqa: F811
    """The engine alone, one round."""
    tmp = str(tmp_path_factory.mktemp("l2-baseline"))
    res, _ = run_engine(model_dir, prompts_file, tmp, "baseline")
    return res


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a loopback port, for this test only."""
    port = _free_port()
    d = str(tmp_path / "redis")
    os.makedirs(d)
    p = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert p.poll() is None and time.time() < deadline, "redis-server did not start"
        time.sleep(0.02)
    yield "127.0.0.1:%d" % port
    p.terminate()
    p.wait(10)


def _sidecar(binary, tmp, name, addr, prefix):
    return SidecarProcess(
        binary,
        pool="64MiB",
        slot="32KiB",
        metrics=True,
        log_level="warn",
        args=["--l2.redis.addrs", addr, "--l2.redis.prefix", prefix],
        log=os.path.join(tmp, name + ".log"),
        prefix="rs-l2e2e-",
    )


def _wait(what, cond, timeout=30.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def test_second_node_hits_from_the_tier(model_dir, prompts_file, baseline, ringside_bin, redis_server, tmp_path):  # noqa: F811
    tmp = str(tmp_path)
    prefix = "e2e-%d-%d:" % (os.getpid(), int(time.time() * 1000))
    a = _sidecar(ringside_bin, tmp, "sidecar-a", redis_server, prefix)
    b = None
    try:
        _wait("sidecar A never connected to the tier", lambda: a.state()["l2"]["connected"])
        # The local index off: every lookup asks the sidecar, which asks the
        # tier (the index only knows the node's own pool).
        cfg = '{"mirror": false}'
        res_a, stats_a = run_engine(
            model_dir, prompts_file, tmp, "node-a", socket_path=a.sock, extra=["--connector-config", cfg]
        )
        assert res_a["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"], "node A differs from the engine alone"
        stored = connector_stats(stats_a, "worker")["stored_blocks"]
        assert stored > 0

        # Write-through is asynchronous: wait until A's tier has written
        # every block it was handed.
        def written():
            l2 = a.state()["l2"]
            return l2["client"]["writes"]["ok"] >= l2["machine"]["Writes"] >= stored

        _wait("node A's blocks did not reach the tier: %s" % a.state()["l2"], written)
        assert a.state()["l2"]["machine"]["WritesSkipped"] == 0

        # Node B: a fresh sidecar with an empty pool.
        b = _sidecar(ringside_bin, tmp, "sidecar-b", redis_server, prefix)
        _wait("sidecar B never connected to the tier", lambda: b.state()["l2"]["connected"])
        assert b.state()["pool"]["Blocks"] == 0
        res_b, stats_b = run_engine(
            model_dir, prompts_file, tmp, "node-b", socket_path=b.sock, extra=["--connector-config", cfg]
        )
        assert res_b["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"], "node B differs from the engine alone"
        sched, work = connector_stats(stats_b, "scheduler"), connector_stats(stats_b, "worker")
        assert sched["hit_blocks"] > 0, sched
        assert work["loaded_blocks"] > 0 and work["load_error_blocks"] == 0, work
        l2 = b.state()["l2"]
        assert l2["machine"]["FetchedBlocks"] > 0 and l2["machine"]["LookupHitBlocks"] > 0, l2
        assert l2["client"]["rejected_values"] == {k: 0 for k in l2["client"]["rejected_values"]}, l2
        # vLLM's own prefix cache saw the hits: cached tokens on B's first
        # round, which an engine alone never has on its first.
        assert sum(res_b["rounds"][0]["cached_tokens"]) > sum(baseline["rounds"][0]["cached_tokens"])
        assert b.state()["pool"]["Leases"] == 0
    finally:
        if b is not None:
            b.stop()
        a.stop()
