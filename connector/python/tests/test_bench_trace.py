"""The trace conversion of `make bench-trace` (bench/vllm/timed_trace.py):
shared hash ids give identical token prefixes, distinct ones differ, time is
compressed, blocks are scaled to the chunk; and, where vLLM is importable,
vLLM's own TimedTrace expands the converted trace into the same tokens."""

import json
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "vllm"))
import timed_trace as tt  # noqa: E402

VOCAB = list(range(4, 260))  # the tiny model's byte tokens (ids 0..3 are specials)

# Three turns of one conversation (each prompt the previous one's and more)
# and an unrelated request, as the Mooncake trace writes them.
TRACE = [
    {"timestamp": 1000, "input_length": 1500, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 700, "output_length": 1, "hash_ids": [0, 7]},
    {"timestamp": 4000, "input_length": 2600, "output_length": 513, "hash_ids": [0, 1, 3, 4, 5, 6]},
    {"timestamp": 9000, "input_length": 3100, "output_length": 40, "hash_ids": [0, 1, 3, 4, 5, 8, 9]},
]


def tokens(recs, chunk):
    sample = tt.sampler(VOCAB)
    return [tt.expand_prompt(r["hash_ids"], r["input_length"], chunk, sample) for r in recs]


@pytest.mark.parametrize("chunk", [32, 64])
def test_shared_hash_ids_share_a_prefix(chunk):
    conv = tt.convert(TRACE, chunk, 4)
    toks = tokens(conv, chunk)
    for i in range(len(conv)):
        for j in range(i + 1, len(conv)):
            shared = tt.shared_blocks(conv[i]["hash_ids"], conv[j]["hash_ids"])
            a, b = toks[i], toks[j]
            full = min(shared, len(a) // chunk, len(b) // chunk)
            assert a[: full * chunk] == b[: full * chunk], (i, j)
            # The first block they do not share differs.
            k = full * chunk
            if shared < min(len(a), len(b)) // chunk:
                assert a[k : k + chunk] != b[k : k + chunk], (i, j)
    assert all(len(t) == r["input_length"] for t, r in zip(toks, conv))


def test_chunk_scaling_keeps_full_blocks():
    for chunk in (32, 64, 128):
        conv = tt.convert(TRACE, chunk, 1)
        for r, c in zip(TRACE, conv):
            assert c["input_length"] // chunk == r["input_length"] // tt.TRACE_BLOCK
            assert c["input_length"] == r["input_length"] * chunk // tt.TRACE_BLOCK
            assert c["output_length"] == max(1, -(-r["output_length"] * chunk // tt.TRACE_BLOCK))
            assert c["hash_ids"] == r["hash_ids"]
    conv = tt.convert(TRACE, 32, 1)
    assert [c["output_length"] for c in conv] == [7, 1, 33, 3]
    with pytest.raises(ValueError):
        tt.convert(TRACE, 1024, 1)


def test_time_is_compressed_from_the_first_request():
    conv = tt.convert(TRACE, 32, 4)
    assert [c["timestamp"] for c in conv] == [0, 0, 750, 2000]
    assert [c["timestamp"] for c in tt.convert(TRACE, 32, 1)] == [0, 0, 3000, 8000]
    assert all(isinstance(c["timestamp"], int) for c in conv)  # milliseconds, as ringside-bench reads them


def test_load_head(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in TRACE) + "\n")
    assert tt.load_head(str(p), 2) == TRACE[:2]
    assert tt.load_head(str(p), 0) == TRACE


def test_vllm_timed_trace_expands_the_same(tmp_path):
    """vLLM's TimedTrace (vllm bench serve --dataset-name timed_trace) on the
    converted file: the same tokens as expand_prompt, so the same prefixes."""
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    conv = tt.convert(TRACE, 32, 4)
    p = tmp_path / "head.jsonl"
    tt.write_jsonl(str(p), conv)

    class Tok:
        all_special_ids = [0, 1, 2, 3]

        def get_vocab(self):
            return {"t%d" % i: i for i in range(260)}

    ds = datasets.TimedTrace(
        dataset_path=str(p),
        random_seed=0,
        timed_trace_chunk_hash_size=32,
        timed_trace_sec_multiplier=0.001,
        timed_trace_label_timestamp="timestamp",
        timed_trace_label_input_length="input_length",
        timed_trace_label_output_length="output_length",
        timed_trace_label_hash_ids="hash_ids",
    )
    reqs = ds.sample(tokenizer=Tok(), num_requests=len(conv))
    assert [r.prompt for r in reqs] == tokens(conv, 32)
    assert [r.timestamp for r in reqs] == [c["timestamp"] / 1000.0 for c in conv]
    assert [r.expected_output_len for r in reqs] == [c["output_length"] for c in conv]
