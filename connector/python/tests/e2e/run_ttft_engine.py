#!/usr/bin/env python3
"""Run a real vLLM engine (CPU, one process) with the ringside connector and
time each prompt's first token. Used by test_vllm_node_e2e.py; runs under
the .venv-vllm interpreter with PYTHONPATH including connector/python.

    run_ttft_engine.py --model DIR --socket SOCK --prompts FILE.json --out OUT.json
                       --warmup TEXT --ready-file F --go-file G
                       [--stats-path P] [--max-tokens N] [--rounds N] [--connector-config JSON]

The engine starts, computes --warmup (its first-request costs paid), writes
--ready-file, and waits for --go-file to exist (the test creates it: so
that what is timed does not share the CPUs with another engine's start).
Then each prompt runs alone, greedily, stepped here: its time to first
token runs from adding the request to the first step that returns a token.
With --rounds N the prompts run N times over. vLLM's own prefix cache is
off, so every cached token is the connector's. OUT.json has, per round,
each prompt's token ids, TTFT and cached tokens, and vLLM's own counters of
the connector's hits (vllm:external_prefix_cache_*) at the round's end.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

GO_TIMEOUT_S = 300.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", required=True)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--go-file", required=True)
    ap.add_argument("--stats-path")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="times the prompts run (counters: since the start)")
    ap.add_argument("--connector-config", default="{}", help="JSON merged into kv_connector_extra_config")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"socket": a.socket, "timeout": 10.0, "reattach_interval": 1.0, "mirror": False}
    if a.stats_path:
        extra.update(stats_path=a.stats_path, stats_every=1)
    extra.update(json.loads(a.connector_config))
    llm = LLM(
        model=a.model,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        disable_log_stats=False,  # vLLM's counters, read below
        kv_transfer_config=KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    warm = run(llm, "warmup", a.warmup, sp)

    open(a.ready_file, "w").write("ready\n")
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not os.path.exists(a.go_file):
        if time.monotonic() > deadline:
            raise SystemExit("no %s within %.0f s" % (a.go_file, GO_TIMEOUT_S))
        time.sleep(0.01)

    prompts = json.load(open(a.prompts))
    rounds = []
    for r in range(a.rounds):
        results = [run(llm, "r%d-p%d" % (r, i), p, sp) for i, p in enumerate(prompts)]
        counters = {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:external_prefix_cache_") and hasattr(m, "value")
        }
        rounds.append({"prompts": results, "counters": counters})
    json.dump({"warmup": warm, "rounds": rounds}, open(a.out, "w"))
    # Shut the engine down so the connector writes its final counters.
    del llm
    return 0


def run(llm, rid, prompt, sp):
    """One request alone, the engine stepped here until it finishes."""
    eng = llm.llm_engine
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, sp)
    ttft, out = None, None
    while out is None:
        for o in eng.step():
            if o.request_id != rid:
                continue
            if ttft is None and o.outputs and o.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                out = o
    # The connector may hold the request's blocks for its stores until
    # the engine steps once more.
    while eng.has_unfinished_requests():
        eng.step()
    return {
        "ttft_s": ttft,
        "tokens": list(out.outputs[0].token_ids),
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
    }


if __name__ == "__main__":
    sys.exit(main())
