#!/usr/bin/env python3
"""The CPU wait per engine step that waiting for stores costs a GPU engine,
on the CUDA simulator: vLLM 0.32's scheduler and the connector's two sides
(connector/python/tests/vllm_harness.py), the KV cache in the stand-in
driver's device memory (gpu/gputest/testdata/fakecuda.c) and a real
`ringside serve --copy.backend=cuda`.

A GPU's forward pass runs after the CPU has launched it, so a store's copies
can only start once it ends; that is what the worker's waits for stores cost
the CPU (the settle at a step's end, the wait in handle_preemptions). Here
each step's "forward pass" takes --gpu-ms of emulated GPU time: the store
event recorded in the step (wait_for_save) completes only when it ends
(FAKECUDA_EVENT_HOLD, a file per step removed at that time), and the CPU
waits for it before the next step (GPU.pace). What the connector's hooks
take is timed (a settle at the step's end waits for the rest of the forward
pass and the copies), and the steps on which a hook blocked on stores are
counted (handle_preemptions or a settle waiting for every store sent): with
vLLM's asynchronous scheduling, where the CPU runs a step ahead, each such
wait costs up to the rest of a forward pass as well.

Scenarios: a full-attention model and a sliding-window one (two KV cache
groups: full attention and a 32-token window), with plenty of KV cache
blocks and with too few (the scheduler preempts), in each runner's order:
V1 (handle_preemptions before any write of the step) and Model Runner V2
(writes_first: blocks zeroed and copied before handle_preemptions).

Run with the vLLM venv's interpreter (it needs vLLM 0.32, gcc and Go):

    .venv-vllm/bin/python bench/vllm/settle_wait.py [--gpu-ms 10] [--quick] [--out FILE]

It prints a table and, with --out, the rows as JSON Lines. --quick runs a
small workload (connector/python/tests/test_settle_wait.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TESTS = os.path.join(REPO, "connector", "python", "tests")
sys.path[:0] = [os.path.join(REPO, "connector", "python"), TESTS]


def build(tmp: str) -> tuple[str, str]:
    """(the stand-in libcuda.so.1, the ringside binary), built into tmp
    (RINGSIDE_TEST_BIN: a binary to use instead)."""
    lib = os.path.join(tmp, "libcuda.so.1")
    src = os.path.join(REPO, "gpu", "gputest", "testdata", "fakecuda.c")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
    binary = os.environ.get("RINGSIDE_TEST_BIN")
    if not binary:
        binary = os.path.join(tmp, "ringside")
        subprocess.run(["go", "build", "-o", binary, "./cmd/ringside"], cwd=REPO, check=True)
    return lib, binary


class GPU:
    """The emulated GPU: each step's forward pass takes `ms`, one after
    another; a step's store event completes when its pass ends."""

    def __init__(self, ms: float, tmp: str):
        self.t, self.tmp = ms / 1000.0, tmp
        self.free = 0.0
        self.ends: list[float] = []
        self.timers: list[threading.Timer] = []

    def launch(self) -> None:
        """Launch the step's forward pass: the store event recorded next
        (wait_for_save) completes when it ends."""
        now = time.monotonic()
        end = max(now, self.free) + self.t
        self.free = end
        self.ends.append(end)
        path = os.path.join(self.tmp, "hold-%d" % len(self.ends))
        open(path, "wb").close()
        os.environ["FAKECUDA_EVENT_HOLD"] = path  # read by the stand-in at cuEventRecord
        t = threading.Timer(end - now, os.unlink, (path,))
        t.daemon = True
        t.start()
        self.timers.append(t)

    def pace(self) -> None:
        """The CPU waits for the step's output (the end of its forward
        pass) before it schedules the next one. (With asynchronous
        scheduling it would run a step ahead; the stand-in keeps one hold a
        event, so a record made while the one before is still held would
        hold that one too: the steps do not overlap here.)"""
        if self.ends:
            left = self.ends[-1] - time.monotonic()
            if left > 0:
                time.sleep(left)

    def drain(self) -> None:
        for t in self.timers:
            t.join()
        self.timers = []


def run(sc, sim, tmp: str, seed: int, model: str, memory: str, runner: str, gpu_ms: float, quick: bool) -> dict:
    import vllm_harness as H
    from test_cuda_vllm import cuda_engine

    groups = None if model == "full" else ["full", 32]
    n, prompt, decode = (4, 64, 8) if quick else (8, 96, 24)
    # Blocks a request needs at its end, in every group; "tight" leaves room
    # for about two thirds of the requests at once (the scheduler preempts).
    need = (prompt + decode) // H.BLOCK + 1
    blocks = 512 if memory == "ample" else (2 * n * need) // 3 + 1
    gpu = GPU(gpu_ms, tmp)
    eng = cuda_engine(sim, sc.sock, sim.stream(), num_blocks=blocks, groups=groups, max_num_batched_tokens=64)
    ws = eng.worker.connector_worker
    ws.writes_first = runner == "v2"
    w = eng.worker
    waited = [0.0]

    def timed(fn, before=None):
        def call(*a, **k):
            if before is not None:
                before()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                waited[0] += time.perf_counter() - t0

        return call

    blocked = [0]
    fin = ws._finish_saves

    def finish_saves(how=0):  # worker._ALL: every store waited for
        if how == 0 and ws._saving:
            blocked[0] = 1
        return fin(how)

    ws._finish_saves = finish_saves
    w.handle_preemptions = timed(w.handle_preemptions)
    w.wait_for_save = timed(w.wait_for_save, before=gpu.launch)
    w.get_transfer_results = timed(w.get_transfer_results)
    step = eng.step
    per_step: list[float] = []
    stores: list[int] = []

    waits: list[int] = []

    def paced(on_meta=None):
        waited[0], blocked[0] = 0.0, 0
        so = step(on_meta)
        per_step.append(waited[0])
        waits.append(blocked[0])
        stores.append(len(eng.metas[-1].store_block_ids))
        gpu.pace()
        return so

    eng.step = paced
    reqs = [
        H.request("%s-%s-%d" % (model, memory, i), H.prompt(seed * 10 + i, prompt), max_tokens=decode) for i in range(n)
    ]
    eng.run(reqs)
    gpu.drain()
    st = dict(eng.wstats)
    eng.shutdown()
    steps = len(per_step)
    with_stores = sum(1 for s in stores if s)
    t = gpu_ms / 1000.0
    return {
        "model": model,
        "memory": memory,
        "runner": runner,
        "blocks": blocks,
        "steps": steps,
        "steps_with_stores": with_stores,
        "stored_blocks": st["stored_blocks"],
        "gpu_ms": gpu_ms,
        "wait_ms_per_step": 1000.0 * sum(per_step) / max(1, steps),
        "wait_of_gpu_step": sum(per_step) / max(1, steps) / t,
        "steps_waiting": sum(1 for x in per_step if x >= t / 2),
        "store_waits": sum(waits),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-ms", type=float, default=10.0, help="emulated GPU time of a step's forward pass")
    ap.add_argument("--quick", action="store_true", help="a small workload, 2 ms steps (the test's)")
    ap.add_argument("--out", help="also write the rows here (JSON Lines)")
    a = ap.parse_args()
    if a.quick:
        a.gpu_ms = 2.0
    import logging

    logging.getLogger("ringside").setLevel(logging.ERROR)
    from test_cuda_region import Sim

    from ringside.plugin import cudaipc
    from ringside.sidecar_process import SidecarProcess

    rows = []
    with tempfile.TemporaryDirectory(prefix="settle-wait-") as tmp:
        lib, binary = build(tmp)
        os.environ[cudaipc.LIB_ENV] = lib
        os.environ["LD_LIBRARY_PATH"] = tmp
        sc = SidecarProcess(binary, pool="64MiB", slot="4KiB", args=["--copy.backend=cuda", "--copy.stall=30s"])
        sim = Sim(lib)
        try:
            scenarios = [(m, mem, r) for m in ("full", "sliding") for mem in ("ample", "tight") for r in ("v1", "v2")]
            for seed, (model, memory, runner) in enumerate(scenarios):
                if True:  # every scenario's prompts its own: no hit from another's stores
                    if True:
                        r = run(sc, sim, tmp, seed + 1, model, memory, runner, a.gpu_ms, a.quick)
                        rows.append(r)
                        print(
                            "%-8s %-6s %-3s steps %4d (stores in %4d)  wait %7.3f ms/step = %.2f of a GPU step; "
                            "%d steps blocked on stores, %d waited over half a GPU step"
                            % (
                                model,
                                memory,
                                runner,
                                r["steps"],
                                r["steps_with_stores"],
                                r["wait_ms_per_step"],
                                r["wait_of_gpu_step"],
                                r["store_waits"],
                                r["steps_waiting"],
                            ),
                            flush=True,
                        )
        finally:
            os.environ.pop("FAKECUDA_EVENT_HOLD", None)
            sim.close()
            sc.stop()
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
