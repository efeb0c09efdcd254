#!/usr/bin/env python3
"""Hit rate and stores of the vLLM connector's store policies on the
Mooncake conversation trace (../shared/traces/conversation_trace.jsonl):
what storing the blocks that decoding fills buys, against what it costs.

    python3 bench/vllm/trace_policy.py [--trace PATH] [--page 32] [--every 16]

The trace gives each request's prompt as 512-token block ids (shared ids =
shared prefix) and its output length, not the output's tokens. A later
request q is taken as the next turn of an earlier request r when r's full
prompt blocks are q's prefix, q's longest run of known blocks ends exactly
there, and q is at least as long as r's prompt and output together: then q's
prompt goes on with r's output, and the pages of r that decoding filled are
hits for q if they were stored. Every other hit is a run of known 512-token
blocks (16 pages of 32 tokens each). The cache is unbounded (an upper bound
for every policy alike).

Policies (`store_decode_every`, docs/architecture.md):

  all       every full page, decode included, in the step that fills it (1)
  batched   decode pages in steps that are multiples of K (K = --every): a
            page that fills within K - 1 steps of its request's end is lost
            (the worst phase)
  prompt    prompt pages only (0)

Prints one JSON row per policy: hit tokens / prompt tokens, pages stored
and, of those, decode pages. What a policy costs inside the engine is not
the bytes but the steps that carry stores (measured by `make bench-vllm
--connectors ringside,ringside:store_decode_every=K,...`).
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "..", "shared", "traces", "conversation_trace.jsonl")
TRACE_BLOCK = 512


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def decode_pages(prompt: int, output: int, page: int) -> list[int]:
    """The decode step (1 = the first) in which each page past the prompt's
    last full page fills: a page is full once its last token has KV (the
    last sampled token never gets any)."""
    kv_end = prompt + output - 1  # tokens with KV when the request finishes
    first = prompt // page  # the first page that decoding completes
    out = []
    for j in range(first, kv_end // page):
        out.append((j + 1) * page - prompt)  # computed tokens reach (j + 1) * page after that many steps
    return out


def stored_decode(prompt: int, output: int, page: int, policy: str, every: int) -> list[int]:
    steps = decode_pages(prompt, output, page)
    if policy == "all":
        return steps
    if policy == "prompt":
        return []
    end = output - 1  # the last decode step
    return [s for s in steps if end - s >= every - 1]


def simulate(reqs, policy: str, page: int, every: int) -> dict:
    per = TRACE_BLOCK // page
    seen: set = set()
    lastfull: dict = {}  # id of a request's last full prompt block -> [request index]
    stored_pages_of: dict[int, int] = {}  # request -> pages of it stored (its prompt's and decode's)
    prompt_tokens = hit_tokens = stored = decode = 0
    for j, q in enumerate(reqs):
        h, L, n_out = q["hash_ids"], q["input_length"], q["output_length"]
        prompt_tokens += L
        k = 0
        while k < len(h) and h[k] in seen:
            k += 1
        hit_pages = per * k
        # The next turn of an earlier request?
        if k:
            for i in reversed(lastfull.get(h[k - 1], ())):
                r = reqs[i]
                if r["input_length"] // TRACE_BLOCK == k and L >= r["input_length"] + r["output_length"]:
                    hit_pages = max(hit_pages, stored_pages_of[i])
                    break
        hit_pages = min(hit_pages, (L - 1) // page)  # vLLM computes the prompt's last token at least
        hit_tokens += hit_pages * page
        prompt_pages = L // page
        dec = stored_decode(L, n_out, page, policy, every)
        mine = max(prompt_pages, hit_pages) + (len(dec) if prompt_pages >= hit_pages else 0)
        stored += max(0, prompt_pages - hit_pages) + len(dec)
        decode += len(dec)
        stored_pages_of[j] = mine
        nf = L // TRACE_BLOCK
        for x in h[:nf]:
            seen.add(x)
        if nf:
            lastfull.setdefault(h[nf - 1], []).append(j)
    return {
        "bench": "trace_store_policy",
        "policy": policy,
        "every": every if policy == "batched" else (1 if policy == "all" else 0),
        "page_tokens": page,
        "requests": len(reqs),
        "hit_rate_pct": round(100.0 * hit_tokens / prompt_tokens, 2),
        "pages_stored": stored,
        "decode_pages_stored": decode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--page", type=int, default=32, help="tokens a KV page (vLLM block)")
    ap.add_argument("--every", type=int, nargs="*", default=[4, 16, 64], help="batched: K")
    a = ap.parse_args()
    reqs = load(a.trace)
    rows = [simulate(reqs, "all", a.page, 1)]
    rows += [simulate(reqs, "batched", a.page, k) for k in a.every]
    rows.append(simulate(reqs, "prompt", a.page, 0))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
