#!/usr/bin/env python3
"""One vLLM engine (CPU, single process) for bench_vllm.py.

Runs under the .venv-vllm interpreter with PYTHONPATH including
connector/python. Results are printed as lines starting with ``@@BENCH ``
followed by JSON (vLLM logs to the same streams; the orchestrator reads only
those lines).

RINGSIDE_BENCH_CONNECTOR_CONFIG (JSON) is merged into the connector's
kv_connector_extra_config, for experiments with its settings.

Modes:

  step   connector time per scheduler step (all requests arriving together,
         then the sustained rows: n requests kept in flight, each finished
         one replaced at once). The scheduler-side connector
         instance (llm.llm_engine.engine_core.engine_core.scheduler.connector
         in single-process mode, vLLM 0.32) gets its methods wrapped with
         timers; a step's sample is the sum of every wrapped call since the
         previous step ended, a step ending when build_connector_meta returns.
  ttft   time to first token of one prompt whose 2048-token prefix is a
         sidecar hit, against the same prompt recomputed.
  serve  paced load for the connector tax: reads JSON commands on stdin
         ({"rate": r, "n": n, "seed": s, ...}), drives LLMEngine.add_request /
         step() itself, answers TTFT/TPOT per request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def reset_prefix_cache(llm) -> bool:
    """vLLM's reset once it can succeed: ringside holds a finished request's
    blocks for its stores until one more engine step (ringside.vllm's)."""
    from ringside.vllm import reset_prefix_cache as reset

    return reset(llm)


# Scheduler-side connector methods the scheduler calls (vLLM 0.32). The first
# five are the ones ringside implements; the rest are base-class hooks, timed
# too so that "time in the connector" misses no call.
NAMED = [
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
]
HOOKS = [
    "request_finished_all_groups",
    "on_new_request",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "register_finished_partial_tail",
]


def emit(obj) -> None:
    sys.stdout.write("@@BENCH " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_llm(a):
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
    if getattr(a, "kv_events", False):
        import tempfile

        from vllm.config import KVEventsConfig

        d = tempfile.mkdtemp(prefix="rs-bench-events-")
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint="ipc://%s/pub" % d,
            replay_endpoint="ipc://%s/replay" % d,
        )
    if getattr(a, "connector", "ringside") == "null":
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector", kv_connector_module_path="null_connector", kv_role="kv_both"
        )
    elif a.socket:
        from vllm.config import KVTransferConfig

        extra = {"socket": a.socket, "timeout": 2.0, "reattach_interval": 1.0}
        if getattr(a, "kv_events", False) and not getattr(a, "connector_events", True):
            extra["kv_events"] = False  # vLLM publishes its GPU events, the connector none
        extra.update(json.loads(os.environ.get("RINGSIDE_BENCH_CONNECTOR_CONFIG", "{}")))
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    return LLM(**kw)


def scheduler_of(llm):
    core = llm.llm_engine.engine_core  # InprocClient (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    return core.engine_core.scheduler  # EngineCore.scheduler


def pct(xs, q):
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


# --------------------------------------------------------------------------
# step


class StepTimer:
    """Wraps the live connector's bound methods (instance attributes shadow
    the class's); accumulates wall and thread CPU time per step."""

    def __init__(self, sched, conn, names=None, end_name="build_connector_meta"):
        self.sched = sched
        self.cur = self.cur_cpu = 0
        self.total = 0  # every wrapped call, recording or not
        self.cur_by = {}
        self.calls = 0
        self.samples = []  # (ns, calls, scheduled reqs, requests in the scheduler, {method: ns}, cpu ns)
        self.recording = False
        self.conn = conn
        self.wrapped = {}
        for name in names or NAMED + HOOKS:
            fn = getattr(conn, name, None)
            if fn is None:
                continue
            self.wrapped[name] = self._wrap(name, fn, name == end_name)
        self.install(True)

    def install(self, on: bool) -> None:
        """Timers in (on) or out: out, the connector's own methods are called
        directly (no timer cost at all; the instance attributes go)."""
        for name, w in self.wrapped.items():
            if on:
                setattr(self.conn, name, w)
            else:
                self.conn.__dict__.pop(name, None)

    def _wrap(self, name, fn, ends_step):
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def timed(*args, **kw):
            c0 = cpu()
            t0 = clock()
            try:
                return fn(*args, **kw)
            finally:
                dt = clock() - t0
                self.cur_cpu += cpu() - c0
                self.cur += dt
                self.total += dt
                self.calls += 1
                self.cur_by[name] = self.cur_by.get(name, 0) + dt
                if ends_step:
                    self._end_step(args[0] if args else kw.get("scheduler_output"))

        timed.__wrapped__ = fn
        return timed

    def _end_step(self, so):
        if self.recording:
            n_sched = len(getattr(so, "num_scheduled_tokens", {}) or {})
            self.samples.append((self.cur, self.calls, n_sched, len(self.sched.requests), self.cur_by, self.cur_cpu))
        self.cur, self.cur_cpu, self.calls, self.cur_by = 0, 0, 0, {}


def timer_overhead_ns() -> float:
    """Cost of the wrapper itself per call (two clock reads and a frame)."""

    class T:
        def noop(self, x=None):
            return x

    t = T()
    st = StepTimer(None, t, names=[])
    wrapped = st._wrap("noop", t.noop, False)
    n = 200000
    best = None
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            t.noop(1)
        raw = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        for _ in range(n):
            wrapped(1)
        w = time.perf_counter_ns() - t0
        d = (w - raw) / n
        best = d if best is None else min(best, d)
    return best


def step_prompts(n, round_no, prefix_bytes):
    # One shared prefix (prefix_bytes + <s> = whole blocks: sidecar hits) and
    # a unique tail per request and round, 0-31 tokens longer from one
    # request to the next (one token a byte) as prompt lengths vary in
    # serving: the requests' block boundaries fall in different steps
    # instead of all in the same one every 32 steps.
    base = "Shared system prompt of the ringside step benchmark; every request starts with it. "
    prefix = (base * (prefix_bytes // len(base) + 1))[:prefix_bytes]
    return [prefix + " r%d q%05d" % (round_no, i) + "." * (i * 7 % 32) for i in range(n)]


def run_step(a):
    from vllm import SamplingParams

    llm = make_llm(a)
    sched = scheduler_of(llm)
    conn = sched.connector
    want = {"null": "NullConnector"}.get(a.connector, "RingsideConnector")
    if conn is None or type(conn).__name__ != want:
        raise SystemExit("step: no %s on the scheduler (got %r)" % (want, conn))
    timer = StepTimer(sched, conn)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # Warm-up: stores the shared prefix in the sidecar, warms the engine.
    llm.generate(step_prompts(8, -1, a.prefix_bytes), sp, use_tqdm=False)
    overhead = timer_overhead_ns()
    for n in a.inflight:
        # A round gives ~max_tokens steps: ~min_steps samples at 10 in flight,
        # fewer rounds as rounds get longer (8, 3, 1 for 10, 100, 1000).
        rounds = max(1, min(a.max_rounds, round(a.min_steps / (a.max_tokens + 4) * (10.0 / n) ** 0.5)))
        samples = []
        st0 = dict(conn.stats)
        for r in range(rounds):
            if not reset_prefix_cache(llm):
                raise SystemExit("step: reset_prefix_cache failed")
            timer.samples = []
            timer.recording = True
            llm.generate(step_prompts(n, r, a.prefix_bytes), sp, use_tqdm=False)
            timer.recording = False
            # Steps with all n requests in flight (admitted or waiting in the
            # scheduler, none finished yet).
            samples += [s for s in timer.samples if s[3] >= n]
        st1 = conn.stats
        us = [s[0] / 1000.0 for s in samples]
        cpu_us = [s[5] / 1000.0 for s in samples]
        by = {}
        for s in samples:
            for k, v in s[4].items():
                by[k] = by.get(k, 0) + v
        steady = [
            s[0] / 1000.0
            for s in samples
            if not any(k in s[4] for k in ("get_num_new_matched_tokens", "request_finished"))
        ]
        emit(
            {
                "bench": "vllm_step",
                "connector": a.connector,
                "kv_events": ("on" if a.connector_events else "vllm") if a.kv_events else "off",
                "requests_in_flight": n,
                "cached_blocks": a.cached_blocks,
                "connector_step_us_mean": round(sum(us) / len(us), 2) if us else None,
                "connector_step_us_p99": round(pct(us, 99), 2) if us else None,
                "connector_step_us_p50": round(pct(us, 50), 2) if us else None,
                # Thread CPU time inside the same calls: the rest is waiting
                # (sidecar replies, or this thread descheduled).
                "connector_step_cpu_us_mean": round(sum(cpu_us) / len(cpu_us), 2) if us else None,
                "connector_step_cpu_us_p99": round(pct(cpu_us, 99), 2) if us else None,
                "connector_step_us_max": round(max(us), 2) if us else None,
                "steps": len(us),
                "rounds": rounds,
                # Steps that admit and finish no request (decode only).
                "steady_steps": len(steady),
                "steady_us_mean": round(sum(steady) / len(steady), 2) if steady else None,
                "steady_us_p99": round(pct(steady, 99), 2) if steady else None,
                "scheduled_reqs_mean": round(sum(s[2] for s in samples) / len(samples), 1) if samples else None,
                "calls_per_step_mean": round(sum(s[1] for s in samples) / len(samples), 2) if samples else None,
                "timer_overhead_us_per_call": round(overhead / 1000.0, 3),
                "breakdown_us_per_step": {k: round(v / 1000.0 / len(samples), 2) for k, v in sorted(by.items())},
                "lookups": st1["lookups"] - st0["lookups"],
                "hit_blocks": st1["hit_blocks"] - st0["hit_blocks"],
                "sidecar_errors": st1["sidecar_errors"] - st0["sidecar_errors"],
            }
        )
    if a.sustained_steps > 0:
        for n in a.inflight:
            emit(run_sustained(llm, timer, conn, a, n))
    del llm


def run_sustained(llm, timer, conn, a, n):
    """n requests kept in flight: each finished request is replaced at once
    by a new one; output lengths are uniform in [1, 2 * life - 1] (mean
    life), so requests arrive, fill blocks and finish in every step, as in
    serving, instead of all together. Measures `sustained_steps` steps after
    `life // 2` warm-up steps."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    rng = random.Random(1000 + n)
    base = "Shared system prompt of the ringside step benchmark; every request starts with it. "
    prefix = (base * (a.prefix_bytes // len(base) + 1))[: a.prefix_bytes]
    live = set()
    k = 0

    def add():
        nonlocal k
        rid = "s%d-%d" % (n, k)
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 2 * a.sustained_life - 1), ignore_eos=True)
        eng.add_request(rid, prefix + " s%d q%06d" % (n, k) + "." * rng.randrange(32), sp)
        live.add(rid)
        k += 1

    for _ in range(n):
        add()
    warm = a.sustained_life // 2
    timer.recording = False
    st0, k0 = None, 0
    for step in range(warm + a.sustained_steps):
        if step == warm:
            timer.samples, timer.recording = [], True
            st0, k0 = dict(conn.stats), k
        for o in eng.step():
            if o.finished:
                live.discard(o.request_id)
                add()
    timer.recording = False
    samples = timer.samples
    eng.abort_request(list(live))
    while eng.has_unfinished_requests():
        eng.step()
    st1 = conn.stats
    us = [s[0] / 1000.0 for s in samples]
    by = {}
    for s in samples:
        for m, v in s[4].items():
            by[m] = by.get(m, 0) + v
    return {
        "kv_events": ("on" if a.connector_events else "vllm") if a.kv_events else "off",
        "bench": "vllm_step_sustained",
        "connector": a.connector,
        "requests_in_flight": n,
        "cached_blocks": a.cached_blocks,
        "connector_step_us_mean": round(sum(us) / len(us), 2) if us else None,
        "connector_step_us_p99": round(pct(us, 99), 2) if us else None,
        "connector_step_us_p50": round(pct(us, 50), 2) if us else None,
        "steps": len(us),
        "mean_output_tokens": a.sustained_life,
        "admitted_per_step": round((k - k0) / max(len(us), 1), 2),
        "stores_per_step": round((st1["planned_stores"] - st0["planned_stores"]) / max(len(us), 1), 2),
        "scheduled_reqs_mean": round(sum(s[2] for s in samples) / len(samples), 1) if samples else None,
        "breakdown_us_per_step": {m: round(v / 1000.0 / len(samples), 2) for m, v in sorted(by.items())},
        "hit_blocks": st1["hit_blocks"] - st0["hit_blocks"],
        "sidecar_errors": st1["sidecar_errors"] - st0["sidecar_errors"],
    }


# --------------------------------------------------------------------------
# ttft


# Scheduler counters of a hit's loaded blocks with several KV cache groups:
# full-attention groups' and sliding windows' (the window's blocks only).
LOADED = ("load_blocks_full", "load_blocks_window")


def run_ttft(a):
    from vllm import SamplingParams

    llm = make_llm(a)
    sched = scheduler_of(llm)
    conn = sched.connector
    if conn is None:
        raise SystemExit("ttft: the engine has no connector")
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.;"

    def prompt():
        # <s> + prefix_tokens-1 bytes = prefix_tokens tokens (whole blocks),
        # then a 16-byte question that the hit still computes.
        pre = "".join(rng.choice(alphabet) for _ in range(a.prefix_tokens - 1))
        return pre + "".join(rng.choice(alphabet) for _ in range(16))

    # Engine steps of each timed request (how a hit spends its time).
    eng = llm.llm_engine
    step_fn, steps = eng.step, []

    def step():
        t = time.perf_counter()
        try:
            return step_fn()
        finally:
            steps.append(round((time.perf_counter() - t) * 1000.0, 1))

    eng.step = step

    def timed(p):
        steps.clear()
        t0 = time.perf_counter()
        out = llm.generate([p], sp, use_tqdm=False)  # noqa: F821 - called before the del at the end
        dt = time.perf_counter() - t0
        assert len(out[0].outputs[0].token_ids) == 1
        return dt * 1000.0, len(out[0].prompt_token_ids), out[0].outputs[0].token_ids[0], list(steps)

    res = {"recompute": [], "hit": []}
    loaded = []  # per hit: the blocks it loaded, by kind of KV cache group (several groups only)
    ntok = None
    same = True
    for i in range(a.samples + 1):  # sample 0 warms the engine up (both paths)
        p = prompt()
        if not reset_prefix_cache(llm):
            raise SystemExit("ttft: reset_prefix_cache failed")
        h0 = conn.stats["hit_blocks"]
        rec, ntok, tok_rec, rec_steps = timed(p)  # a sidecar miss: the whole prompt is computed, its blocks stored
        miss_hits = conn.stats["hit_blocks"] - h0
        # The engine's own prefix cache now holds the prompt: drop it so the
        # only copy of the prefix is the sidecar's. The prefix's stores were
        # sent at the end of the last step and a block is visible only once
        # copied (a lookup before that is a miss): give the copies time, as
        # the next turn of a conversation would.
        if not reset_prefix_cache(llm):
            raise SystemExit("ttft: reset_prefix_cache failed")
        time.sleep(0.2)
        h0 = conn.stats["hit_blocks"]
        l0 = {k: conn.stats.get(k, 0) for k in LOADED}
        hit, _, tok_hit, hit_steps = timed(p)
        hit_blocks = conn.stats["hit_blocks"] - h0
        same = same and tok_hit == tok_rec
        if i == 0:
            continue
        res["recompute"].append((rec, miss_hits, rec_steps))
        res["hit"].append((hit, hit_blocks, hit_steps))
        loaded.append({k: conn.stats.get(k, 0) - l0[k] for k in LOADED})
    for mode in ("recompute", "hit"):
        xs = sorted(v for v, _, _ in res[mode])
        med = sorted(res[mode])[len(xs) // 2]
        emit(
            {
                "bench": "vllm_ttft",
                "mode": mode,
                "prefix_tokens": a.prefix_tokens,
                "ttft_ms": round(xs[len(xs) // 2], 1),
                "ttft_ms_min": round(xs[0], 1),
                "ttft_ms_max": round(xs[-1], 1),
                "samples": len(xs),
                "prompt_tokens": ntok,
                "sidecar_hit_blocks": [b for _, b, _ in res[mode]],
                "same_first_token": same,
                "median_sample_step_ms": med[2],
            }
        )
        if mode == "hit" and loaded and any(loaded[0].values()):
            row = {"bench": "vllm_ttft_loaded", "prefix_tokens": a.prefix_tokens}
            row.update({k: [d[k] for d in loaded] for k in LOADED})
            emit(row)
    del llm


# --------------------------------------------------------------------------
# serve (tax)


def tax_prompts(n, seed, nbytes):
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.;"
    return ["%d-%d " % (seed, i) + "".join(rng.choice(alphabet) for _ in range(nbytes)) for i in range(n)]


def paced_run(llm, rate, n, seed, prompt_bytes, max_tokens, poisson=True):
    """Submit n requests at `rate` per second (Poisson arrivals, fixed seed)
    and step the engine ourselves. TTFT = first token seen - scheduled
    arrival; TPOT = (last - first) / (tokens - 1)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = tax_prompts(n, seed, prompt_bytes)
    rng = random.Random(seed * 7919 + 1)
    gaps = [rng.expovariate(rate) if poisson else 1.0 / rate for _ in range(n)]
    clock = time.perf_counter
    t0 = clock() + 0.05
    arrivals, t = [], t0
    for g in gaps:
        arrivals.append(t)
        t += g
    first, last, ntok = {}, {}, {}
    nxt = 0
    steps = step_ns = 0
    while nxt < n or eng.has_unfinished_requests():
        now = clock()
        while nxt < n and arrivals[nxt] <= now:
            eng.add_request("r%d-%d" % (seed, nxt), prompts[nxt], sp)
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - clock()))
            continue
        ts = clock()
        outs = eng.step()
        steps += 1
        t = clock()
        step_ns += int((t - ts) * 1e9)
        for o in outs:
            i = int(o.request_id.split("-")[1])
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if k and i not in first:
                first[i] = t
            if o.finished:
                last[i], ntok[i] = t, k
    end = clock()
    ttft = [(first[i] - arrivals[i]) * 1000.0 for i in range(n)]
    tpot = [(last[i] - first[i]) * 1000.0 / (ntok[i] - 1) for i in range(n) if ntok.get(i, 0) > 1]
    return {
        "ttft_ms": [round(x, 3) for x in ttft],
        "tpot_ms": [round(x, 4) for x in tpot],
        "throughput_rps": round(n / (end - t0), 3),
        "seconds": round(end - t0, 3),
        "steps": steps,
        "n": n,
        "step_ns": step_ns,
    }


WORKER_METHODS = [
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "finish_forward",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]


def run_serve(a):
    llm = make_llm(a)
    sched = scheduler_of(llm)
    conn = sched.connector
    timers = []
    if conn is not None:
        # Time every connector call, scheduler and worker side (the worker's
        # instance is vLLM's kv_transfer group in this single process).
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        timers = [StepTimer(sched, conn), StepTimer(sched, get_kv_transfer_group(), names=WORKER_METHODS, end_name="")]
    emit({"ready": True, "connector": conn is not None})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        h0 = conn.stats["hit_blocks"] if conn is not None else 0
        # Timed runs give the time inside connector calls; the latency runs
        # are untimed (the timers cost ~3 us a call, which the plain engine
        # does not pay).
        timed = bool(cmd.get("timers", True))
        for t in timers:
            t.install(timed)
        c0 = [t.total for t in timers]
        w0 = dict(timers[1].cur_by) if len(timers) > 1 else {}  # the worker timer never ends a step: totals
        r = paced_run(
            llm, cmd["rate"], cmd["n"], cmd["seed"], cmd["prompt_bytes"], cmd["max_tokens"], cmd.get("poisson", True)
        )
        r["hit_blocks"] = (conn.stats["hit_blocks"] - h0) if conn is not None else 0
        r["sidecar_errors"] = conn.stats["sidecar_errors"] if conn is not None else 0
        r["connector_ns"] = [t.total - c for t, c in zip(timers, c0)] if timed else None  # [scheduler, worker]
        if timed and len(timers) > 1:
            r["worker_ns_by_method"] = {k: v - w0.get(k, 0) for k, v in timers[1].cur_by.items() if v > w0.get(k, 0)}
        emit(r)
    del llm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["step", "ttft", "serve"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket")
    ap.add_argument(
        "--connector",
        choices=["ringside", "null"],
        default="ringside",
        help="step: null = a connector that does nothing (the floor of vLLM's calls into one)",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--cached-blocks", type=int, default=0, help="step: recorded in the output")
    ap.add_argument("--inflight", type=lambda s: [int(x) for x in s.split(",")], default=[10, 100, 1000])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-bytes", type=int, default=95)
    ap.add_argument("--min-steps", type=int, default=300)
    ap.add_argument("--max-rounds", type=int, default=10)
    ap.add_argument("--sustained-steps", type=int, default=200, help="step: sustained rows (0: none)")
    ap.add_argument("--sustained-life", type=int, default=128, help="step: mean output tokens, sustained rows")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument(
        "--kv-events",
        action="store_true",
        help="step: vLLM publishes KV cache events (ZMQ, an ipc endpoint nobody reads): "
        "the connector then announces the sidecar's tier",
    )
    ap.add_argument(
        "--connector-events",
        type=int,
        default=1,
        help="with --kv-events: the connector announces the sidecar's tier (1) or not (0: vLLM's events alone)",
    )
    a = ap.parse_args()
    {"step": run_step, "ttft": run_ttft, "serve": run_serve}[a.mode](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
