"""One vLLM engine (CPU, single process) for the benchmarks: how worker.py
makes and times it, and how the drivers (bench_vllm.py, compare.py) run it.

The engine side (make_llm, settle, ConnTimer, timer_overhead_ns) imports
vLLM only inside its functions, so that a driver can import this module
under any interpreter. A worker answers each command with one line
``@@BENCH {json}`` on stdout (vLLM logs to the same streams; a driver reads
only those lines): emit writes it, Worker reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
PREFIX = "@@BENCH "

# The connectors a worker can load (--connector): none (no connector), null
# (null_connector.py: every hook returns at once), ringside
# (RingsideConnector, --socket), lmcache (vLLM's LMCacheMPConnector against an
# `lmcache server`, --lmcache-port), offloading (vLLM's OffloadingConnector
# with hostcopy_spec.py's HostCopySpec), example (vLLM's ExampleConnector,
# --store-dir).
ARMS = ("none", "null", "ringside", "lmcache", "offloading", "example")

# Scheduler-side methods vLLM 0.32's scheduler calls on a connector: the
# ones ringside implements, then the base class's hooks, timed too so that
# "time in the connector" misses no call. And the worker side's.
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

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;"

# Connector counters of a hit's loaded blocks with several KV cache groups:
# full-attention groups' and sliding windows' (the window's blocks only).
LOADED = ("load_blocks_full", "load_blocks_window")

_clock = time.perf_counter_ns


def emit(obj) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def pct(xs, q):
    """Nearest-rank percentile, None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))]


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def rand_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


# --------------------------------------------------------------------------
# the engine (worker side)


def connector_config() -> dict:
    """RINGSIDE_BENCH_CONNECTOR_CONFIG: keys merged into the ringside
    connector's kv_connector_extra_config (experiments, variant arms)."""
    return json.loads(os.environ.get("RINGSIDE_BENCH_CONNECTOR_CONFIG", "{}"))


def kv_transfer_dict(a):
    """The --kv-transfer-config of worker.py's options a (None: no
    connector), as plain keys: worker.py makes vLLM's KVTransferConfig of
    them, bench_trace.py passes them to vLLM's OpenAI server as JSON."""
    arm = a.connector
    if arm == "none":
        return None
    if arm == "null":
        return dict(kv_connector="NullConnector", kv_connector_module_path="null_connector", kv_role="kv_both")
    if arm == "ringside":
        extra = {"socket": a.socket, "timeout": 2.0, "reattach_interval": 1.0}
        if a.kv_events and not a.connector_events:
            extra["kv_events"] = False  # vLLM publishes its events, the connector none
        extra.update(connector_config())
        return dict(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if arm == "lmcache":
        return dict(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": a.lmcache_port,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        )
    if arm == "offloading":
        return dict(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "HostCopySpec",
                "spec_module_path": "hostcopy_spec",
                "cpu_bytes_to_use": a.cpu_bytes,
            },
        )
    if arm == "example":
        return dict(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": a.store_dir},
        )
    raise SystemExit("unknown connector %r" % arm)


def kv_transfer_config(a):
    kw = kv_transfer_dict(a)
    if kw is None:
        return None
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**kw)


def make_llm(a):
    """The engine for worker.py's options a. vLLM's KV event publisher (ZMQ
    on IPC sockets nobody reads) is on with --kv-events, or for a ringside
    arm whose connector configuration names kv_events."""
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
    if a.kv_events or (a.connector == "ringside" and "kv_events" in connector_config()):
        import tempfile

        from vllm.config import KVEventsConfig

        d = tempfile.mkdtemp(prefix="rs-bench-events-")
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


class ConnTimer:
    """Wall time inside a connector's methods: instance attributes shadow the
    class's while installed, and the connector is otherwise unchanged. A
    method called from inside another timed one is counted once, in the
    outer call. Installed with cpu=True, the thread's CPU time inside the
    calls is counted too (two more clock reads a call). Between start_steps
    and stop_steps, every end of a call of step_end closes a sample of the
    step: see _end_step."""

    def __init__(self, conn, names, sched=None, step_end=None):
        self.conn, self.sched = conn, sched
        self.ns = self.calls = self.cpu_ns = 0
        self.by: dict[str, int] = {}
        self.depth = 0
        self.samples = None  # a list between start_steps and stop_steps
        self._mark = (0, 0, 0, {})
        self._own = {}  # the connector's own instance attributes of those names
        self._timed = {}  # name: (wall-time wrapper, wall- and CPU-time wrapper)
        for name in names:
            fn = getattr(conn, name, None)
            if fn is None or not callable(fn):
                continue
            if name in getattr(conn, "__dict__", {}):
                self._own[name] = conn.__dict__[name]
            self._timed[name] = (
                self._wrap(name, fn, False, name == step_end),
                self._wrap(name, fn, True, name == step_end),
            )
        self.install()

    def install(self, on=True, cpu=False) -> None:
        """Timers in (on) or out: out, the connector's own methods are called
        directly (no timer cost at all)."""
        for name, w in self._timed.items():
            if on:
                setattr(self.conn, name, w[cpu])
            elif name in self._own:
                setattr(self.conn, name, self._own[name])
            else:
                self.conn.__dict__.pop(name, None)

    def _wrap(self, name, fn, cpu, ends_step):
        by, tcpu = self.by, time.thread_time_ns

        def timed(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            self.depth = 1
            c0 = tcpu() if cpu else 0
            t0 = _clock()
            try:
                return fn(*args, **kw)
            finally:
                dt = _clock() - t0
                if cpu:
                    self.cpu_ns += tcpu() - c0
                self.depth = 0
                self.ns += dt
                self.calls += 1
                by[name] = by.get(name, 0) + dt
                if ends_step and self.samples is not None:
                    self._end_step(args[0] if args else kw.get("scheduler_output"))

        timed.__wrapped__ = fn
        return timed

    def snap(self):
        return (self.ns, self.calls, dict(self.by))

    def start_steps(self) -> None:
        self.samples = []
        self._mark = (self.ns, self.calls, self.cpu_ns, dict(self.by))

    def stop_steps(self) -> list:
        s, self.samples = self.samples, None
        return s

    def _end_step(self, so) -> None:
        """A step's sample: (ns, calls, scheduled requests, requests in the
        scheduler, {method: ns}, CPU ns) of every timed call since the
        previous step ended (or since start_steps)."""
        ns, calls, cpu_ns, by = self._mark
        n_sched = len(getattr(so, "num_scheduled_tokens", {}) or {})
        per = {m: v - by.get(m, 0) for m, v in self.by.items() if v != by.get(m, 0)}
        self.samples.append(
            (self.ns - ns, self.calls - calls, n_sched, len(self.sched.requests), per, self.cpu_ns - cpu_ns)
        )
        self._mark = (self.ns, self.calls, self.cpu_ns, dict(self.by))


def timer_overhead_ns(cpu=False) -> float:
    """What one timed call costs more than a plain one (best of three)."""

    class T:
        def noop(self, x=None):
            return x

    t = T()
    ConnTimer(t, ["noop"]).install(True, cpu)
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
# the driver side


class Worker:
    """A worker.py engine in a process of its own, driven over stdin/stdout:
    run sends one command and returns its answer."""

    def __init__(self, name, python, env, args, logpath):
        self.name = name
        self.log = open(logpath, "w")
        self.p = subprocess.Popen(
            [python, WORKER] + list(args),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        self.ready = self._read()

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("%s: engine exited (rc %s): see %s" % (self.name, self.p.poll(), self.log.name))
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
            self.log.write(line)  # vLLM's own lines on stdout

    def run(self, timeout=None, **cmd) -> dict:
        """Sends cmd and returns the answer; past timeout seconds the engine
        is killed (and this raises)."""
        kill = threading.Timer(timeout, self.p.kill) if timeout else None
        if kill:
            kill.start()
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
            r = self._read()
        finally:
            if kill:
                kill.cancel()
        if "error" in r:
            raise RuntimeError("%s: %s" % (self.name, r["error"]))
        return r

    def close(self) -> None:
        try:
            self.p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.p.stdin.close()
            self.p.wait(120)
        except Exception:  # noqa: BLE001
            self.p.kill()
            self.p.wait(10)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
