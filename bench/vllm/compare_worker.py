#!/usr/bin/env python3
"""One arm of bench_vllm.py's same-run comparison: a vLLM engine (CPU, single
process) with one KV connector, driven over stdin/stdout.

Arms (--connector): none (no connector), null (bench/vllm/null_connector.py:
every hook returns at once), ringside (RingsideConnector, --socket), lmcache
(vLLM's LMCacheMPConnector against an `lmcache server`, --lmcache-port),
offloading (vLLM's OffloadingConnector with bench/vllm/hostcopy_spec.py's
HostCopySpec), example (vLLM's ExampleConnector, --store-dir).

Reads one JSON command a line on stdin, answers one ``@@BENCH {json}`` line
on stdout (vLLM logs to the same streams; the orchestrator reads only those):

  {"cmd": "gate", ...}   correctness: unique prompts generated greedily twice
                         with vLLM's own prefix cache reset in between; the
                         token ids of both rounds and the tokens each request
                         found cached (RequestOutput.num_cached_tokens: after
                         a reset, only the connector's hits count).
  {"cmd": "load", ...}   n requests kept in flight (each finished one replaced
                         at once); warm-up until every request is admitted,
                         then `steps` engine steps measured: step time, the
                         connector's scheduler-side and worker-side time, the
                         step's phases, Python GC, output tokens.
  {"cmd": "ttft", ...}   time to first token of one long prompt recomputed,
                         then (after a prefix-cache reset) of the same prompt
                         again: a hit if the connector kept it.
  {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ARMS = ("none", "null", "ringside", "lmcache", "offloading", "example")

# Scheduler-side methods vLLM 0.32's scheduler calls on a connector (the
# connector's own and the base class's hooks), and the worker side's.
SCHED_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "register_finished_partial_tail",
    "update_state_after_free",
    "get_finished_count",
)
WORKER_METHODS = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "finish_forward",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)

_clock = time.perf_counter_ns


def emit(obj) -> None:
    sys.stdout.write("@@BENCH " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def pct(xs, q):
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))]


def mean(xs):
    return sum(xs) / len(xs) if xs else None


# --------------------------------------------------------------------------
# the engine


def kv_transfer_config(a):
    from vllm.config import KVTransferConfig

    arm = a.connector
    if arm == "none":
        return None
    if arm == "null":
        return KVTransferConfig(
            kv_connector="NullConnector", kv_connector_module_path="null_connector", kv_role="kv_both"
        )
    if arm == "ringside":
        extra = {"socket": a.socket, "timeout": 2.0, "reattach_interval": 1.0}
        extra.update(json.loads(os.environ.get("RINGSIDE_BENCH_CONNECTOR_CONFIG", "{}")))
        return KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if arm == "lmcache":
        return KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": a.lmcache_port,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        )
    if arm == "offloading":
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "HostCopySpec",
                "spec_module_path": "hostcopy_spec",
                "cpu_bytes_to_use": a.cpu_bytes,
            },
        )
    if arm == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": a.store_dir},
        )
    raise SystemExit("unknown connector %r" % arm)


def make_llm(a):
    if a.connector == "lmcache":
        # vLLM 0.32 on CPU with LMCache 0.5.6: without this the engine's start
        # fails with "'_lib_fn_wrapper' object has no attribute 'get'".
        import llvmlite.binding.ffi as ffi

        ffi.lib._fntab.setdefault("__dict__", {})
    from vllm import LLM

    kw = dict(
        model=a.model,
        dtype="float32",
        max_model_len=a.max_model_len,
        block_size=32,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
    )
    kvt = kv_transfer_config(a)
    if kvt is not None:
        kw["kv_transfer_config"] = kvt
    rcfg = json.loads(os.environ.get("RINGSIDE_BENCH_CONNECTOR_CONFIG", "{}"))
    if a.connector == "ringside" and "kv_events" in rcfg:
        # The arms "ringside:kv_events=true" and "ringside:kv_events=false":
        # vLLM's KV event publisher on (ZMQ on IPC sockets, nobody
        # subscribed), with the connector's events or without them.
        import tempfile

        from vllm.config import KVEventsConfig

        d = tempfile.mkdtemp(prefix="rs-cmp-events-")
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint="ipc://%s/pub" % d,
            replay_endpoint="ipc://%s/replay" % d,
        )
    return LLM(**kw)


def core_of(llm):
    return llm.llm_engine.engine_core.engine_core  # EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)


def settle(llm, timeout=30.0) -> None:
    """Step the engine until nothing is left in its scheduler (stores that
    hold blocks after their request finished included), then reset vLLM's
    own prefix cache: from here only a connector can supply cached tokens."""
    eng, sched = llm.llm_engine, core_of(llm).scheduler
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sched.has_requests():
            eng.step()
            continue
        if llm.reset_prefix_cache():
            return
        time.sleep(0.01)
    raise SystemExit("settle: the prefix cache could not be reset in %.0fs" % timeout)


# --------------------------------------------------------------------------
# timers


class ConnTimer:
    """Wall time inside a connector's methods (instance attributes shadow the
    class's; the connector is not changed). A method called from inside
    another wrapped one is counted once, in the outer call."""

    def __init__(self, conn, names):
        self.ns = self.calls = 0
        self.by: dict[str, int] = {}
        self.depth = 0
        for name in names:
            fn = getattr(conn, name, None)
            if fn is not None and callable(fn):
                setattr(conn, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        by = self.by

        def timed(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            self.depth = 1
            t0 = _clock()
            try:
                return fn(*args, **kw)
            finally:
                dt = _clock() - t0
                self.depth = 0
                self.ns += dt
                self.calls += 1
                by[name] = by.get(name, 0) + dt

        timed.__wrapped__ = fn
        return timed

    def snap(self):
        return (self.ns, self.calls, dict(self.by))


class PhaseTimer:
    """Wall time of the engine step's phases: the scheduler's schedule() and
    update_from_output(), the executor's execute_model() and sample_tokens()
    (the forward pass and sampling, worker-side connector hooks included),
    the output processor; and Python's garbage collections."""

    PHASES = ("schedule", "execute_model", "sample_tokens", "update_from_output", "process_outputs")

    def __init__(self, llm):
        core = core_of(llm)
        self.ns = dict.fromkeys(self.PHASES, 0)
        self.gc_ns = 0
        self.gc_count = [0, 0, 0]
        for obj, name in (
            (core.scheduler, "schedule"),
            (core.model_executor, "execute_model"),
            (core.model_executor, "sample_tokens"),
            (core.scheduler, "update_from_output"),
            (llm.llm_engine.output_processor, "process_outputs"),
        ):
            setattr(obj, name, self._wrap(name, getattr(obj, name)))
        self._gc_t = 0
        gc.callbacks.append(self._gc)

    def _wrap(self, name, fn):
        ns = self.ns

        def timed(*args, **kw):
            t0 = _clock()
            try:
                return fn(*args, **kw)
            finally:
                ns[name] += _clock() - t0

        return timed

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t = _clock()
        else:
            self.gc_ns += _clock() - self._gc_t
            self.gc_count[info["generation"]] += 1

    def snap(self):
        return dict(self.ns), self.gc_ns, list(self.gc_count)


def timer_overhead_ns() -> float:
    """What one wrapped call costs more than a plain one (best of three)."""

    class T:
        def noop(self, x=None):
            return x

    t = T()
    ConnTimer(t, ["noop"])
    raw = T().noop
    best = None
    for _ in range(3):
        t0 = _clock()
        for _ in range(100000):
            raw(1)
        t1 = _clock()
        for _ in range(100000):
            t.noop(1)
        d = ((_clock() - t1) - (t1 - t0)) / 100000
        best = d if best is None else min(best, d)
    return best


# --------------------------------------------------------------------------
# workloads

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;"


def rand_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def ctx_switches() -> tuple[int, int]:
    """Voluntary and involuntary context switches of this process's threads."""
    vol = inv = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/status" % t) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        inv += int(line.split()[1])
        except OSError:
            continue
    return vol, inv


def run_gate(llm, cmd):
    from vllm import SamplingParams

    rng = random.Random(cmd["seed"])
    prompts = [rand_text(rng, cmd["prompt_bytes"]) for _ in range(cmd["n"])]
    sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
    rounds = []
    for r in range(2):
        settle(llm)
        if r:
            time.sleep(cmd.get("pause_s", 0.5))  # asynchronous stores land (a conversation's next turn)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        rounds.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
                "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            }
        )
    settle(llm)
    return {"rounds": rounds}


def run_load(llm, conn_timers, phases, cmd, overhead_ns):
    """n requests in flight (see the module doc)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    n, steps, life = cmd["n"], cmd["steps"], cmd["life"]
    eng = llm.llm_engine
    sched = core_of(llm).scheduler
    rng = random.Random(cmd["seed"])
    # One shared prefix (the same text in every arm and run: vLLM's own
    # prefix cache holds it) and a unique tail per request.
    prefix = ("Shared system prompt of the ringside comparison; every request starts with it. " * 64)[
        : cmd["prefix_bytes"]
    ]
    tag = "%d-%d" % (cmd["seed"], n)
    k = 0
    live = set()

    def add():
        nonlocal k
        rid = "%s-%d" % (tag, k)
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 2 * life - 1),
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        eng.add_request(
            rid, prefix + " %s q%06d " % (tag, k) + rand_text(rng, rng.randint(cmd["tail_min"], cmd["tail_max"])), sp
        )
        live.add(rid)
        k += 1

    def step():
        toks = 0
        for o in eng.step():
            if o.outputs:
                toks += len(o.outputs[0].token_ids)
            if o.finished:
                live.discard(o.request_id)
                add()
        return toks

    settle(llm)
    gc.collect()
    t0 = _clock()
    for _ in range(n):
        add()
    warm = 0
    while True:
        step()
        warm += 1
        if len(sched.running) >= n and not sched.waiting:
            break
        if warm > 100000:
            raise SystemExit("load: requests never all admitted")
    admitted_ms = (_clock() - t0) / 1e6
    c0 = [t.snap() for t in conn_timers]
    p0 = phases.snap()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    cs0 = ctx_switches()
    rec = []
    prev = [t.ns for t in conn_timers]
    w0 = _clock()
    for _ in range(steps):
        s0 = _clock()
        toks = step()
        s1 = _clock()
        cur = [t.ns for t in conn_timers]
        rec.append((s1 - s0, [c - p for c, p in zip(cur, prev)], toks, len(sched.running)))
        prev = cur
    window_ns = _clock() - w0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cs1 = ctx_switches()
    c1 = [t.snap() for t in conn_timers]
    p1 = phases.snap()
    eng.abort_request(list(live))
    settle(llm)
    step_ms = [r[0] / 1e6 for r in rec]
    tokens = sum(r[2] for r in rec)
    side = {}
    for label, a0, a1 in zip(("scheduler", "worker"), c0, c1):
        per = [r[1][0 if label == "scheduler" else 1] / 1e3 for r in rec]
        calls = (a1[1] - a0[1]) / len(rec)
        side[label] = {
            "us_per_step": round((a1[0] - a0[0]) / 1e3 / len(rec), 2),
            "us_p50": round(pct(per, 50), 2),
            "us_p99": round(pct(per, 99), 2),
            "calls_per_step": round(calls, 2),
            "timer_us_per_step": round(calls * overhead_ns / 1e3, 2),  # the timers' own cost, included
            "by_method_us": {
                m: round((v - a0[2].get(m, 0)) / 1e3 / len(rec), 2)
                for m, v in sorted(a1[2].items())
                if v > a0[2].get(m, 0)
            },
        }
    ph = {k2: round((p1[0][k2] - p0[0][k2]) / 1e3 / len(rec), 1) for k2 in PhaseTimer.PHASES}
    cpu_s = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return {
        "requests_in_flight": n,
        "steps": len(rec),
        "warmup_steps": warm,
        "admitted_ms": round(admitted_ms, 1),
        "step_ms_mean": round(mean(step_ms), 3),
        "step_ms_p50": round(pct(step_ms, 50), 3),
        "step_ms_p99": round(pct(step_ms, 99), 3),
        "window_s": round(window_ns / 1e9, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / (window_ns / 1e9), 1),
        "running_mean": round(mean([r[3] for r in rec]), 1),
        "connector": side if conn_timers else None,
        "phases_us_per_step": ph,
        "gc_us_per_step": round((p1[1] - p0[1]) / 1e3 / len(rec), 1),
        "gc_collections": [b - a for a, b in zip(p0[2], p1[2])],
        "engine_cpu_pct": round(100.0 * cpu_s / (window_ns / 1e9), 1),
        # Context switches of the engine's threads per step: voluntary (a
        # thread blocked: a wait, a futex) and involuntary (preempted: another
        # runnable thread, e.g. a sidecar or server, took its CPU).
        "ctx_voluntary_per_step": round((cs1[0] - cs0[0]) / len(rec), 2),
        "ctx_involuntary_per_step": round((cs1[1] - cs0[1]) / len(rec), 2),
    }


def run_ttft(llm, cmd):
    from vllm import SamplingParams

    rng = random.Random(cmd["seed"])
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # <s> + prefix_tokens - 1 bytes: whole 256-token chunks (LMCache's unit,
    # 8 of ringside's and vLLM's 32-token blocks), then a short question.
    p = rand_text(rng, cmd["prefix_tokens"] - 1) + rand_text(rng, 16)
    res = {}
    for mode in ("recompute", "hit"):
        settle(llm)
        if mode == "hit":
            time.sleep(cmd.get("pause_s", 0.5))
        t0 = _clock()
        out = llm.generate([p], sp, use_tqdm=False)
        dt = (_clock() - t0) / 1e6
        o = out[0]
        res[mode] = {
            "ttft_ms": round(dt, 2),
            "cached_tokens": o.num_cached_tokens or 0,
            "token": o.outputs[0].token_ids[0],
        }
    res["prompt_tokens"] = len(out[0].prompt_token_ids)
    settle(llm)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connector", choices=ARMS, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket")
    ap.add_argument("--lmcache-port", type=int)
    ap.add_argument("--store-dir")
    ap.add_argument("--cpu-bytes", type=int, default=1 << 30)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    a = ap.parse_args()
    llm = make_llm(a)
    core = core_of(llm)
    conn = core.scheduler.connector
    timers = []
    if conn is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        timers = [ConnTimer(conn, SCHED_METHODS), ConnTimer(get_kv_transfer_group(), WORKER_METHODS)]
    phases = PhaseTimer(llm)
    overhead = timer_overhead_ns()
    import torch
    import vllm

    emit(
        {
            "ready": True,
            "connector": a.connector,
            "class": type(conn).__name__ if conn is not None else None,
            "vllm": vllm.__version__,
            "step_fn": getattr(core.step_fn, "__name__", "?"),
            "timer_overhead_ns": round(overhead, 1),
            "torch_threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd.get("cmd")
        if c == "quit":
            break
        t0 = time.time()
        if c == "gate":
            r = run_gate(llm, cmd)
        elif c == "load":
            r = run_load(llm, timers, phases, cmd, overhead)
        elif c == "ttft":
            r = run_ttft(llm, cmd)
        else:
            r = {"error": "unknown command %r" % c}
        r["seconds"] = round(time.time() - t0, 2)
        stats = getattr(conn, "stats", None)
        if isinstance(stats, dict):
            r["connector_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        emit(r)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
