#!/usr/bin/env python3
"""Run a real SGLang engine (offline sglang.Engine) on a prompt list, with or
without the ringside HiCache storage backend, and write the greedy token ids
and per-request cached-token counts as JSON.

Usage: run_sglang.py --model DIR --prompts FILE --out FILE [--socket PATH]
                     [--device cpu|cuda] [--max-tokens N] [--page-size N]

Used by test_sglang_e2e.py; run it by hand to see how far SGLang gets on this
machine (the error, if any, is what the test reports).
"""

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--socket")
    ap.add_argument("--instance", default="sglang-e2e")
    ap.add_argument("--device", default=os.environ.get("RINGSIDE_SGLANG_DEVICE", "cpu"))
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--page-size", type=int, default=16)
    a = ap.parse_args()

    import sglang as sgl

    kw = dict(
        model_path=a.model,
        device=a.device,
        page_size=a.page_size,
        random_seed=0,
        log_level="warning",
        mem_fraction_static=0.5,
        max_total_tokens=4096,
        disable_cuda_graph=True,
        tp_size=1,
    )
    if a.device == "cpu":
        kw["attention_backend"] = "torch_native"
    if a.socket:
        kw.update(
            enable_hierarchical_cache=True,
            hicache_ratio=2.0,
            hicache_write_policy="write_through",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(
                {
                    "backend_name": "ringside",
                    "module_path": "ringside.sglang",
                    "class_name": "RingsideHiCacheStorage",
                    "socket": a.socket,
                    "instance": a.instance,
                }
            ),
        )
    prompts = json.load(open(a.prompts))
    engine = sgl.Engine(**kw)
    try:
        params = {"temperature": 0.0, "max_new_tokens": a.max_tokens, "ignore_eos": True}
        outs = engine.generate(prompts, params)
        res = [
            {
                "text": o["text"],
                "output_ids": o.get("output_ids"),
                "cached_tokens": o["meta_info"].get("cached_tokens", 0),
            }
            for o in outs
        ]
    finally:
        engine.shutdown()
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
