#!/usr/bin/env python3
"""Run a real vLLM engine (CPU) on a prompt set and write the greedy tokens.

Used by test_vllm_e2e.py and by `make bench-vllm`; runs under the
.venv-vllm interpreter with PYTHONPATH including connector/python.

    run_engine.py --model DIR --prompts FILE.json --out OUT.json
                  [--socket SOCK] [--stats-path P] [--rounds N] [--max-tokens N]
                  [--ready-file F] [--max-num-batched-tokens N]
                  [--num-blocks N] [--continue]

With --socket the engine loads the ringside connector; between rounds the
engine's own prefix cache is reset, so every reuse must come from ringside.
--max-num-batched-tokens below the prompt length makes vLLM prefill in
chunks; --num-blocks caps the engine's KV blocks so that running requests get
preempted; --continue makes each round after the first a conversation turn
(its prompts are the previous round's prompt and output tokens); --stagger
makes each round after the first arrive while the engine is busy: a long
request runs first (30 steps: the connector's local index of the cache is
live by then) and the round's prompts are added one a step, as in serving;
--disable-hma turns vLLM's hybrid memory allocator off (every layer in one
KV cache group); --no-prefix-caching turns vLLM's prefix cache off. The
output records the engine's KV cache groups (their spec kinds), whether
the hybrid allocator was on, and why the connector refused the model, if
it did.
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
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--num-blocks", type=int)
    ap.add_argument("--continue", dest="cont", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (worker processes)")
    ap.add_argument("--connector-config", default="{}", help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--stagger", action="store_true", help="rounds after the first arrive while the engine is busy")
    ap.add_argument("--disable-hma", action="store_true", help="vLLM's hybrid memory allocator off")
    ap.add_argument("--no-prefix-caching", action="store_true", help="vLLM's prefix cache off")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    from ringside.vllm import reset_prefix_cache

    kw = dict(
        model=a.model,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=not a.no_prefix_caching,
    )
    if a.disable_hma:
        kw["disable_hybrid_kv_cache_manager"] = True
    if a.max_num_batched_tokens:
        kw.update(max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=True)
    if a.num_blocks:
        kw["num_gpu_blocks_override"] = a.num_blocks
    if a.tp > 1:
        kw.update(tensor_parallel_size=a.tp, distributed_executor_backend="mp")
    if a.socket:
        from vllm.config import KVTransferConfig

        extra = {"socket": a.socket, "timeout": 2.0, "reattach_interval": 1.0}
        if a.stats_path:
            extra.update(stats_path=a.stats_path, stats_every=1)
        extra.update(json.loads(a.connector_config))
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    engine_info = {
        "kv_cache_groups": [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups],
        "hybrid_kv_cache_manager": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "refused": getattr(sched.connector, "refused", None),
    }
    prompts = json.load(open(a.prompts))
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    rounds = []
    inputs = prompts
    for r in range(a.rounds):
        if r > 0:
            # The connector may still hold the last requests' blocks for
            # their stores until one more engine step.
            assert reset_prefix_cache(llm), "the prefix cache could not be reset"
        if a.ready_file and r == a.rounds - 1:
            open(a.ready_file, "w").write("generating\n")
        t = time.time()
        if a.stagger and r > 0:
            outs = staggered(llm, inputs, sp, r)
        else:
            outs = llm.generate(inputs, sp, use_tqdm=False)
        rounds.append(
            {
                "seconds": time.time() - t,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
                "cached_tokens": [o.num_cached_tokens for o in outs],
            }
        )
        if a.cont:
            inputs = [{"prompt_token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids)} for o in outs]
    json.dump(dict(engine_info, start_seconds=start_s, rounds=rounds), open(a.out, "w"))
    # Shut the engine down so the connector writes its final counters.
    del llm
    return 0


def staggered(llm, inputs, sp, r):
    """Generate inputs while a long request keeps the engine busy: the
    keeper runs 30 steps (by then the scheduler-side connector's mirror
    must be live), then one input is added a step. Returns the
    inputs' outputs in order (the keeper's is not)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    conn = eng.engine_core.engine_core.scheduler.connector
    keeper = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    eng.add_request("keeper-%d" % r, "A long unrelated request keeps the engine stepping. %d" % r, keeper)
    for _ in range(30):  # the same steps with and without the connector
        eng.step()
    mirror = getattr(conn, "mirror", None)
    if mirror is not None and mirror.state != mirror.LIVE:
        raise SystemExit("stagger: the connector's mirror is not live after 30 steps: %r" % mirror.stats)
    done, want = {}, ["r%d-%d" % (r, i) for i in range(len(inputs))]
    pending = list(zip(want, inputs))
    while len(done) < len(want):
        if pending:
            rid, prompt = pending.pop(0)
            eng.add_request(rid, prompt, sp)
        for o in eng.step():
            if o.finished and o.request_id in want:
                done[o.request_id] = o
    eng.abort_request(["keeper-%d" % r])
    while eng.has_unfinished_requests():
        eng.step()
    return [done[rid] for rid in want]


if __name__ == "__main__":
    sys.exit(main())
