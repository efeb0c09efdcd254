#!/usr/bin/env python3
"""Run a real vLLM engine (CPU) on a prompt set and write the greedy tokens.

Used by test_vllm_e2e.py and by `make bench-vllm`; runs under the
.venv-vllm interpreter with PYTHONPATH including connector/python.

    run_engine.py --model DIR --prompts FILE.json --out OUT.json
                  [--socket SOCK] [--stats-path P] [--rounds N] [--max-tokens N]
                  [--ready-file F]

With --socket the engine loads the ringside connector; between rounds the
engine's own prefix cache is reset, so every reuse must come from ringside.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--socket")
    ap.add_argument("--stats-path")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ready-file")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, dtype="float32", max_model_len=1024, block_size=32, enforce_eager=True,
              seed=0, distributed_executor_backend="uni", enable_prefix_caching=True)
    if a.socket:
        from vllm.config import KVTransferConfig

        extra = {"socket": a.socket, "timeout": 2.0, "reattach_interval": 1.0}
        if a.stats_path:
            extra.update(stats_path=a.stats_path, stats_every=1)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RingsideConnector", kv_connector_module_path="ringside.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    prompts = json.load(open(a.prompts))
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    rounds = []
    for r in range(a.rounds):
        if r > 0:
            llm.reset_prefix_cache()
        if a.ready_file and r == a.rounds - 1:
            open(a.ready_file, "w").write("generating\n")
        t = time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        rounds.append({"seconds": time.time() - t, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    json.dump({"start_seconds": start_s, "rounds": rounds}, open(a.out, "w"))
    # Shut the engine down so the connector writes its final counters.
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
