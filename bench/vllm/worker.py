#!/usr/bin/env python3
"""One vLLM engine (CPU, single process) with one KV connector, driven over
stdin/stdout by bench_vllm.py and compare.py (engine.Worker).

Runs under the vLLM venv's interpreter with PYTHONPATH including
connector/python. Starts the engine (--connector: engine.ARMS), answers
``@@BENCH {"ready": ...}``, then reads one JSON command a line on stdin and
answers each with one ``@@BENCH {json}`` line:

  {"cmd": "step", ...}   connector time per scheduler step: all requests
                         arriving together, then the sustained rows (n
                         requests kept in flight, each finished one replaced
                         at once). The scheduler-side connector's methods are
                         timed (wall and thread CPU time); a step's sample is
                         every timed call since the previous step ended, a
                         step ending when build_connector_meta returns.
                         Answers {"rows": [vllm_step..., vllm_step_sustained...]}.
  {"cmd": "ttft", ...}   time to first token of one long prompt recomputed,
                         then (after a prefix-cache reset and a pause for the
                         stores) of the same prompt again: a hit if the
                         connector kept it.
  {"cmd": "paced", ...}  n requests at a rate (Poisson arrivals), the engine
                         stepped here: TTFT and TPOT per request, time inside
                         connector calls (the connector tax).
  {"cmd": "gate", ...}   correctness: unique prompts generated greedily twice
                         with vLLM's own prefix cache reset in between; the
                         token ids of both rounds and the tokens each request
                         found cached (RequestOutput.num_cached_tokens: after
                         a reset, only the connector's hits count).
  {"cmd": "load", ...}   n requests kept in flight; warm-up until every
                         request is admitted, then `steps` engine steps
                         measured: step time, the connector's scheduler-side
                         and worker-side time, the step's phases, Python GC,
                         output tokens.
  {"cmd": "quit"}

The connector's calls are timed, scheduler and worker side (in a step
command the scheduler side alone, with CPU time); "timers": false runs a
ttft or paced command untimed.

RINGSIDE_BENCH_CONNECTOR_CONFIG (JSON) is merged into the ringside
connector's kv_connector_extra_config.
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

from engine import (  # noqa: E402 - after the environment vLLM reads
    ARMS,
    LOADED,
    SCHED_METHODS,
    WORKER_METHODS,
    ConnTimer,
    core_of,
    emit,
    make_llm,
    mean,
    pct,
    rand_text,
    settle,
    timer_overhead_ns,
)

_clock = time.perf_counter_ns


class Engine:
    """The engine, its connector (None for the "none" arm) and the timers on
    the connector's scheduler side and worker side."""

    def __init__(self, a):
        self.a = a
        self.llm = make_llm(a)
        self.core = core_of(self.llm)
        self.sched = self.core.scheduler
        self.conn = self.sched.connector
        self.timers: list[ConnTimer] = []
        if self.conn is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            self.timers = [
                ConnTimer(self.conn, SCHED_METHODS, sched=self.sched, step_end="build_connector_meta"),
                ConnTimer(get_kv_transfer_group(), WORKER_METHODS),
            ]
        self.phases = None  # a PhaseTimer from the first load command on
        self.overhead_ns = timer_overhead_ns()

    def stats(self) -> dict:
        s = getattr(self.conn, "stats", None)
        return dict(s) if isinstance(s, dict) else {}

    def time_calls(self, on: bool) -> None:
        """The connector's calls timed (on, the default) or not: untimed
        runs pay no timer cost at all."""
        for t in self.timers:
            t.install(on)


# --------------------------------------------------------------------------
# step


def step_prompts(n, round_no, prefix_bytes):
    # One shared prefix (prefix_bytes + <s> = whole blocks: sidecar hits) and
    # a unique tail per request and round, 0-31 tokens longer from one
    # request to the next (one token a byte) as prompt lengths vary in
    # serving: the requests' block boundaries fall in different steps
    # instead of all in the same one every 32 steps.
    base = "Shared system prompt of the ringside step benchmark; every request starts with it. "
    prefix = (base * (prefix_bytes // len(base) + 1))[:prefix_bytes]
    return [prefix + " r%d q%05d" % (round_no, i) + "." * (i * 7 % 32) for i in range(n)]


def events_mode(a) -> str:
    return ("on" if a.connector_events else "vllm") if a.kv_events else "off"


def run_step(e, cmd):
    from vllm import SamplingParams

    a, llm, conn = e.a, e.llm, e.conn
    want = {"null": "NullConnector"}.get(a.connector, "RingsideConnector")
    if conn is None or type(conn).__name__ != want:
        raise SystemExit("step: no %s on the scheduler (got %r)" % (want, conn))
    timer = e.timers[0]
    e.time_calls(False)
    timer.install(True, cpu=True)  # the scheduler side alone, CPU time too
    sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
    # Warm-up: stores the shared prefix in the sidecar, warms the engine.
    llm.generate(step_prompts(8, -1, cmd["prefix_bytes"]), sp, use_tqdm=False)
    overhead = timer_overhead_ns(cpu=True)
    rows = []
    for n in cmd["inflight"]:
        # A round gives ~max_tokens steps: ~min_steps samples at 10 in flight,
        # fewer rounds as rounds get longer (8, 3, 1 for 10, 100, 1000).
        rounds = max(1, min(cmd["max_rounds"], round(cmd["min_steps"] / (cmd["max_tokens"] + 4) * (10.0 / n) ** 0.5)))
        samples = []
        st0 = e.stats()
        for r in range(rounds):
            settle(llm)
            timer.start_steps()
            llm.generate(step_prompts(n, r, cmd["prefix_bytes"]), sp, use_tqdm=False)
            # Steps with all n requests in flight (admitted or waiting in the
            # scheduler, none finished yet).
            samples += [s for s in timer.stop_steps() if s[3] >= n]
        st1 = e.stats()
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
        rows.append(
            {
                "bench": "vllm_step",
                "connector": a.connector,
                "kv_events": events_mode(a),
                "requests_in_flight": n,
                "cached_blocks": cmd["cached_blocks"],
                "connector_step_us_mean": round(mean(us), 2) if us else None,
                "connector_step_us_p99": round(pct(us, 99), 2) if us else None,
                "connector_step_us_p50": round(pct(us, 50), 2) if us else None,
                # Thread CPU time inside the same calls: the rest is waiting
                # (sidecar replies, or this thread descheduled).
                "connector_step_cpu_us_mean": round(mean(cpu_us), 2) if us else None,
                "connector_step_cpu_us_p99": round(pct(cpu_us, 99), 2) if us else None,
                "connector_step_us_max": round(max(us), 2) if us else None,
                "steps": len(us),
                "rounds": rounds,
                # Steps that admit and finish no request (decode only).
                "steady_steps": len(steady),
                "steady_us_mean": round(mean(steady), 2) if steady else None,
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
    if cmd["sustained_steps"] > 0:
        for n in cmd["inflight"]:
            rows.append(run_sustained(e, cmd, n))
    e.time_calls(True)
    return {"rows": rows}


def run_sustained(e, cmd, n):
    """n requests kept in flight: each finished request is replaced at once
    by a new one; output lengths are uniform in [1, 2 * life - 1] (mean
    life), so requests arrive, fill blocks and finish in every step, as in
    serving, instead of all together. Measures `sustained_steps` steps after
    `life // 2` warm-up steps."""
    from vllm import SamplingParams

    eng, timer, life = e.llm.llm_engine, e.timers[0], cmd["sustained_life"]
    rng = random.Random(1000 + n)
    base = "Shared system prompt of the ringside step benchmark; every request starts with it. "
    prefix = (base * (cmd["prefix_bytes"] // len(base) + 1))[: cmd["prefix_bytes"]]
    live = set()
    k = 0

    def add():
        nonlocal k
        rid = "s%d-%d" % (n, k)
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 2 * life - 1), ignore_eos=True)
        eng.add_request(rid, prefix + " s%d q%06d" % (n, k) + "." * rng.randrange(32), sp)
        live.add(rid)
        k += 1

    for _ in range(n):
        add()
    warm = life // 2
    st0, k0 = None, 0
    for step in range(warm + cmd["sustained_steps"]):
        if step == warm:
            timer.start_steps()
            st0, k0 = e.stats(), k
        for o in eng.step():
            if o.finished:
                live.discard(o.request_id)
                add()
    samples = timer.stop_steps()
    eng.abort_request(list(live))
    while eng.has_unfinished_requests():
        eng.step()
    st1 = e.stats()
    us = [s[0] / 1000.0 for s in samples]
    by = {}
    for s in samples:
        for m, v in s[4].items():
            by[m] = by.get(m, 0) + v
    return {
        "kv_events": events_mode(e.a),
        "bench": "vllm_step_sustained",
        "connector": e.a.connector,
        "requests_in_flight": n,
        "cached_blocks": cmd["cached_blocks"],
        "connector_step_us_mean": round(mean(us), 2) if us else None,
        "connector_step_us_p99": round(pct(us, 99), 2) if us else None,
        "connector_step_us_p50": round(pct(us, 50), 2) if us else None,
        "steps": len(us),
        "mean_output_tokens": life,
        "admitted_per_step": round((k - k0) / max(len(us), 1), 2),
        "stores_per_step": round((st1["planned_stores"] - st0["planned_stores"]) / max(len(us), 1), 2),
        "scheduled_reqs_mean": round(sum(s[2] for s in samples) / len(samples), 1) if samples else None,
        "breakdown_us_per_step": {m: round(v / 1000.0 / len(samples), 2) for m, v in sorted(by.items())},
        "hit_blocks": st1["hit_blocks"] - st0["hit_blocks"],
        "sidecar_errors": st1["sidecar_errors"] - st0["sidecar_errors"],
    }


# --------------------------------------------------------------------------
# ttft


def run_ttft(e, cmd):
    from vllm import SamplingParams

    llm = e.llm
    rng = random.Random(cmd["seed"])
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # <s> + prefix_tokens - 1 bytes: whole blocks (and whole 256-token
    # chunks, LMCache's unit, 8 of ringside's and vLLM's 32-token blocks),
    # then a 16-byte question that a hit still computes.
    p = rand_text(rng, cmd["prefix_tokens"] - 1) + rand_text(rng, 16)
    # The engine steps of each request (how a hit spends its time).
    eng = llm.llm_engine
    step_fn, steps = eng.step, []

    def step():
        t = _clock()
        try:
            return step_fn()
        finally:
            steps.append(round((_clock() - t) / 1e6, 1))

    eng.step = step
    e.time_calls(bool(cmd.get("timers", True)))
    res = {}
    try:
        for mode in ("recompute", "hit"):
            # Before the hit, vLLM's own prefix cache (which now holds the
            # prompt) is dropped, so that the only copy of the prefix is the
            # connector's; the prefix's stores were sent at the end of the
            # last step and a block is visible only once copied: give the
            # copies time, as the next turn of a conversation would.
            settle(llm)
            if mode == "hit":
                time.sleep(cmd.get("pause_s", 0.5))
            st0 = e.stats()
            steps.clear()
            t0 = _clock()
            out = llm.generate([p], sp, use_tqdm=False)
            dt = (_clock() - t0) / 1e6
            o = out[0]
            assert len(o.outputs[0].token_ids) == 1
            st1 = e.stats()
            res[mode] = {
                "ttft_ms": round(dt, 2),
                "cached_tokens": o.num_cached_tokens or 0,
                "token": o.outputs[0].token_ids[0],
                "steps_ms": list(steps),
                "hit_blocks": st1.get("hit_blocks", 0) - st0.get("hit_blocks", 0),
                "loaded": {k: st1.get(k, 0) - st0.get(k, 0) for k in LOADED},
            }
    finally:
        eng.step = step_fn
        e.time_calls(True)
    res["prompt_tokens"] = len(out[0].prompt_token_ids)
    settle(llm)
    return res


# --------------------------------------------------------------------------
# paced (tax)


def tax_prompts(n, seed, nbytes):
    rng = random.Random(seed)
    return ["%d-%d " % (seed, i) + rand_text(rng, nbytes) for i in range(n)]


def run_paced(e, cmd):
    """Submit n requests at `rate` per second (Poisson arrivals, fixed seed)
    and step the engine here. TTFT = first token seen - scheduled arrival;
    TPOT = (last - first) / (tokens - 1). With "timers" (the default) every
    connector call is timed, scheduler and worker side; untimed runs pay no
    timer cost at all (the latency runs: the plain engine pays none)."""
    from vllm import SamplingParams

    timed = bool(cmd.get("timers", True))
    e.time_calls(timed)
    c0 = [t.ns for t in e.timers]
    w0 = dict(e.timers[1].by) if e.timers else {}
    st0 = e.stats()
    rate, n, seed = cmd["rate"], cmd["n"], cmd["seed"]
    eng = e.llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
    prompts = tax_prompts(n, seed, cmd["prompt_bytes"])
    rng = random.Random(seed * 7919 + 1)
    poisson = cmd.get("poisson", True)
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
    e.time_calls(True)
    st1 = e.stats()
    ttft = [(first[i] - arrivals[i]) * 1000.0 for i in range(n)]
    tpot = [(last[i] - first[i]) * 1000.0 / (ntok[i] - 1) for i in range(n) if ntok.get(i, 0) > 1]
    r = {
        "ttft_ms": [round(x, 3) for x in ttft],
        "tpot_ms": [round(x, 4) for x in tpot],
        "throughput_rps": round(n / (end - t0), 3),
        "seconds": round(end - t0, 3),
        "steps": steps,
        "n": n,
        "step_ns": step_ns,
        "hit_blocks": st1.get("hit_blocks", 0) - st0.get("hit_blocks", 0),
        "sidecar_errors": st1.get("sidecar_errors", 0),
        "connector_ns": [t.ns - c for t, c in zip(e.timers, c0)] if timed and e.timers else None,  # [scheduler, worker]
    }
    if timed and e.timers:
        r["worker_ns_by_method"] = {k: v - w0.get(k, 0) for k, v in e.timers[1].by.items() if v > w0.get(k, 0)}
    return r


# --------------------------------------------------------------------------
# gate and load


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


def run_gate(e, cmd):
    from vllm import SamplingParams

    llm = e.llm
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


def run_load(e, cmd):
    """n requests in flight (see the module doc)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if e.phases is None:
        e.phases = PhaseTimer(e.llm)
    llm, phases, conn_timers = e.llm, e.phases, e.timers
    n, steps, life = cmd["n"], cmd["steps"], cmd["life"]
    eng = llm.llm_engine
    sched = e.sched
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
            "timer_us_per_step": round(calls * e.overhead_ns / 1e3, 2),  # the timers' own cost, included
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


COMMANDS = {"step": run_step, "ttft": run_ttft, "paced": run_paced, "gate": run_gate, "load": run_load}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connector", choices=ARMS, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", help="ringside: the sidecar's socket")
    ap.add_argument("--lmcache-port", type=int)
    ap.add_argument("--store-dir", help="example: its storage directory")
    ap.add_argument("--cpu-bytes", type=int, default=1 << 30, help="offloading: its host memory")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--kv-events",
        action="store_true",
        help="vLLM publishes KV cache events (ZMQ, an ipc endpoint nobody reads): "
        "the ringside connector then announces the sidecar's tier",
    )
    ap.add_argument(
        "--connector-events",
        type=int,
        default=1,
        help="with --kv-events: the connector announces the sidecar's tier (1) or not (0: vLLM's events alone)",
    )
    a = ap.parse_args()
    e = Engine(a)
    import torch
    import vllm

    emit(
        {
            "ready": True,
            "connector": a.connector,
            "class": type(e.conn).__name__ if e.conn is not None else None,
            "vllm": vllm.__version__,
            "step_fn": getattr(e.core.step_fn, "__name__", "?"),
            "timer_overhead_ns": round(e.overhead_ns, 1),
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
        run = COMMANDS.get(c)
        r = run(e, cmd) if run else {"error": "unknown command %r" % c}
        r.setdefault("seconds", round(time.time() - t0, 2))
        stats = e.stats()
        if stats:
            r["connector_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        emit(r)
    del e
    return 0


if __name__ == "__main__":
    sys.exit(main())
