"""Go-free smoke test of the benchmark peer: the real CLI in a child process,
an echo thread in this process on the other side."""

import json
import socket
import subprocess
import sys
import threading

import pytest
from conftest import child_env

from ringside import _benchpeer
from ringside import ring as R


def run_peer(args):
    out = subprocess.run(
        [sys.executable, "-m", "ringside._benchpeer", *args], capture_output=True, env=child_env(), timeout=60
    )
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


@pytest.mark.parametrize("wait", ["spin", "park"])
def test_ring_mode(shm_path, wait):
    req = R.create(shm_path("req"), 16384)
    resp = R.create(shm_path("resp"), 16384)
    count, warmup = 200, 10
    done = []
    th = threading.Thread(target=lambda: done.append(_benchpeer.serve_ring_echo(req, resp, count + warmup, 30)))
    th.start()
    res = run_peer(
        [
            "ring",
            req.path,
            resp.path,
            "--size",
            "64",
            "--count",
            str(count),
            "--wait",
            wait,
            "--warmup",
            str(warmup),
            "--req-epoch",
            hex(req.epoch),
            "--resp-epoch",
            hex(resp.epoch),
        ]
    )
    th.join(30)
    assert done == [count + warmup]
    assert res["n"] == count and res["mode"] == "ring-" + wait
    assert 0 < res["min_ns"] <= res["p50_ns"] <= res["p99_ns"] <= res["max_ns"]
    req.close()
    resp.close()


def test_uds_mode(tmp_path):
    path = str(tmp_path / "bench.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    count, warmup = 200, 10
    done = []

    def serve():
        conn, _ = srv.accept()
        done.append(_benchpeer.serve_uds_echo(conn, count + warmup))

    th = threading.Thread(target=serve)
    th.start()
    res = run_peer(["uds", path, "--size", "100", "--count", str(count), "--warmup", str(warmup)])
    th.join(30)
    srv.close()
    assert done == [count + warmup]
    assert res["n"] == count and res["mode"] == "uds" and 0 < res["p50_ns"] <= res["p99_ns"]


def test_summarize():
    s = _benchpeer.summarize(list(range(1, 101)), "x")
    assert (s["p50_ns"], s["p99_ns"], s["n"], s["min_ns"], s["max_ns"]) == (50, 99, 100, 1, 100)


def test_bad_args_exit_nonzero(shm_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringside._benchpeer",
            "ring",
            shm_path("nope"),
            shm_path("nope2"),
            "--size",
            "8",
            "--count",
            "1",
        ],
        capture_output=True,
        env=child_env(),
        timeout=30,
    )
    assert out.returncode == 1 and b"benchpeer:" in out.stderr
