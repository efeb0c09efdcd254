"""The Mooncake conversation trace as vLLM's `timed_trace` dataset takes it
(`vllm bench serve --dataset-name timed_trace`), scaled to a small model.

A trace record is {timestamp (ms), input_length, output_length, hash_ids}:
each hash id stands for one 512-token block of the prompt, and requests that
share leading hash ids share that prefix. vLLM's TimedTrace dataset reads
the same keys and expands each hash id into --timed-trace-chunk-hash-size
tokens drawn from a generator seeded by the id (and the chunk's length), so
shared hash ids give identical token prefixes and distinct ones different
tokens (the prompt goes to the server as token ids, not text).

convert() scales a trace head to a small model's context: every 512-token
block becomes `chunk` tokens (input and output lengths scaled by chunk/512,
so a prompt keeps its number of full blocks and its partial last one), and
the time between requests is divided by `compress`. The result is still a
trace in the same format (integer milliseconds), so `ringside-bench replay
--block-tokens CHUNK` reads it as well: the offline prediction and the live
replay see the same blocks.

expand_prompt() is TimedTrace._expand_prompt of vLLM 0.32 without its
tokenizer, for the tests. Python's str hash seeds it: the client needs a
fixed PYTHONHASHSEED for the same tokens in every run.
"""

from __future__ import annotations

import json
import random
from typing import Callable, Iterable

TRACE_BLOCK = 512  # tokens a hash id of the Mooncake trace stands for


def load_head(path: str, limit: int) -> list[dict]:
    """The first limit records of a JSON Lines trace (all with limit 0)."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            out.append(json.loads(line))
            if limit and len(out) >= limit:
                break
    return out


def convert(records: Iterable[dict], chunk: int, compress: float, block: int = TRACE_BLOCK) -> list[dict]:
    """records with each block scaled to chunk tokens and the time from the
    first request divided by compress. The hash ids are kept as they are."""
    if chunk <= 0 or chunk > block or compress <= 0:
        raise ValueError("chunk must be in 1..%d and compress > 0" % block)
    out = []
    t0 = None
    for r in records:
        ts = int(r["timestamp"])
        t0 = ts if t0 is None else t0
        out.append(
            {
                "timestamp": int(round((ts - t0) / compress)),
                # Floor: a prompt of k full blocks and a partial one keeps k
                # full chunks and a shorter partial one (or none).
                "input_length": max(1, int(r["input_length"]) * chunk // block),
                "output_length": max(1, -(-int(r["output_length"]) * chunk // block)),
                "hash_ids": [int(h) for h in r["hash_ids"]],
            }
        )
    return out


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def sampler(vocab: list[int]) -> Callable[[int, str], list[int]]:
    """TimedTrace._sample_token: n tokens of vocab (sorted, no specials)
    from a generator seeded by the chunk's key."""
    values = sorted(vocab)

    def sample(n: int, key: str) -> list[int]:
        return random.Random(hash(key) & 0xFFFFFFFF).choices(values, k=n)

    return sample


def expand_prompt(hash_ids: list[int], input_length: int, chunk: int, sample: Callable[[int, str], list[int]]):
    """TimedTrace._expand_prompt: the prompt's token ids, chunk tokens a hash
    id (fewer for the last), cut at input_length."""
    tokens: list[int] = []
    left = input_length
    for h in hash_ids:
        n = chunk if left >= chunk else left
        tokens.extend(sample(n, "%s:%s" % (h, n)))
        left -= n
        if left <= 0:
            break
    return tokens


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Leading hash ids two records share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
