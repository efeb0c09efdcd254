"""`make demo`'s verdict (connector/python/scripts/demo.py): it passes only
on a hit with identical tokens. The demo itself runs a real engine (`make
demo`); these check its report on made-up results, without one."""

import copy
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "demo.py")
spec = importlib.util.spec_from_file_location("ringside_demo", SCRIPT)
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

N = demo.PREFIX_BLOCKS * demo.BLOCK + demo.QUESTION_TOKENS
GOOD = {
    "vllm": "0.32.0",
    "start_s": 4.0,
    "check": {
        "prompt_tokens": N,
        "recompute_tokens": list(range(10, 10 + demo.CHECK_TOKENS)),
        "hit_tokens": list(range(10, 10 + demo.CHECK_TOKENS)),
        "recompute_hit_blocks": 0,
        "hit_blocks": 64,
        "hit_cached_tokens": 2048,
    },
    "ttft": [
        {
            "prompt_tokens": N,
            "recompute_ms": 600.0 + i,
            "hit_ms": 30.0,
            "recompute_token": [7 + i],
            "hit_token": [7 + i],
            "recompute_hit_blocks": 0,
            "hit_blocks": 64,
            "recompute_cached_tokens": 0,
            "hit_cached_tokens": 2048,
        }
        for i in (1, 0, -1)
    ],
}
LINES = [
    "ringside_stores_total 129",
    "ringside_hit_blocks_total 128",
    "ringside_lookup_blocks_total 192",
    'ringside_copy_bytes_total{direction="load"} %.7e' % (256 * demo.PAGE_BYTES),
    'ringside_copy_bytes_total{direction="store"} %.7e' % (257 * demo.PAGE_BYTES),
]


def verdict(change, capsys, lines=LINES):
    res = copy.deepcopy(GOOD)
    change(res)
    rc = demo.report(res, lines, "sidecar epoch 1\n", "bin/ringside", "127.0.0.1:1")
    return rc, capsys.readouterr().out


def test_hit_with_identical_tokens_passes(capsys):
    rc, out = verdict(lambda r: None, capsys)
    assert rc == 0, out
    assert "20.0x sooner" in out and "identical" in out and "PASS" in out  # the median: 600 / 30
    assert "256 loaded" in out  # bytes loaded / bytes of a block


@pytest.mark.parametrize(
    "what,change",
    [
        ("no hit in the token check", lambda r: r["check"].update(hit_blocks=0)),
        ("no hit in one TTFT pair", lambda r: r["ttft"][1].update(hit_blocks=0)),
        ("different tokens", lambda r: r["check"]["hit_tokens"].__setitem__(5, 3)),
        ("different first token", lambda r: r["ttft"][2].update(hit_token=[8])),
        ("a first request that hit", lambda r: r["ttft"][0].update(recompute_hit_blocks=2)),
    ],
)
def test_fails(what, change, capsys):
    rc, out = verdict(change, capsys)
    assert rc == 1, what
    assert "FAIL" in out and "PASS" not in out, what


def test_fails_when_the_sidecar_copied_fewer_blocks_than_the_hits(capsys):
    """A failed load: vLLM recomputes (the same tokens), the sidecar copied less."""
    lines = [line for line in LINES if "load" not in line]
    lines.append('ringside_copy_bytes_total{direction="load"} %.7e' % (255 * demo.PAGE_BYTES))
    rc, out = verdict(lambda r: None, capsys, lines)
    assert rc == 1 and "copied 255 blocks into the engine, which counted 256 hits" in out, out


def test_metric_reads_prometheus_lines():
    assert demo.metric(LINES, 'ringside_copy_bytes_total{direction="load"}') == 256 * demo.PAGE_BYTES
    assert demo.metric(LINES, "ringside_absent") == 0.0
