"""ringside.vllm.events with vLLM's own classes (runs in the vLLM venv): the
Describe records of a step's stores, and the events built from the
sidecar's log, field by field as vLLM's offloading connector fills its
self-describing CPU events."""

import hashlib
import struct
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from ringside import schema as S  # noqa: E402
from ringside.plugin.config import VLLM, Config  # noqa: E402
from ringside.vllm import events as E  # noqa: E402

BS = 4


def request(n_blocks, lora=None, seed="r"):
    hashes, prev = [], hashlib.sha256(seed.encode()).digest()
    for i in range(n_blocks):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        hashes.append(prev)
    toks = list(range(1000, 1000 + n_blocks * BS + 2))
    return SimpleNamespace(block_hashes=hashes, _all_token_ids=toks, all_token_ids=toks, lora_request=lora)


class Sent:
    max_payload = 1 << 20

    def __init__(self):
        self.records = []

    def send(self, typ, payload, wake=True):
        assert typ == S.TYPE_DESCRIBE and wake is False
        self.records.append(payload)


def kv_events():
    return E.KVEvents(Config.parse({}, VLLM), BS, None)


def test_describe_runs_of_a_step():
    ev = kv_events()
    a, b = request(5), request(3, lora=SimpleNamespace(adapter_id=7, name="sql"), seed="b")
    s = Sent()
    ev.describe(s, [(a, 0, 2), (a, 2, 5), (b, 1, 2)], 1 << 20)
    assert len(s.records) == 1 and ev.stats["described_blocks"] == 6
    runs = S.decode_describe(s.records[0], 32)
    assert [len(r.digests) // 32 for r in runs] == [2, 3, 1]
    assert runs[0].parent is None and runs[1].parent == a.block_hashes[1] and runs[2].parent == b.block_hashes[0]
    assert runs[1].digests == b"".join(a.block_hashes[2:5])
    assert list(struct.unpack("<%dI" % (3 * BS), runs[1].tokens)) == a._all_token_ids[2 * BS : 5 * BS]
    assert runs[0].extra == b"" and runs[2].extra == struct.pack("<q", 7) + b"sql"
    # A small ring: split into records that fit, none larger than the payload bound.
    s = Sent()
    ev.describe(s, [(a, 0, 5)] * 3, 16 + 8 + 32 * 5 + 4 * BS * 5)
    assert len(s.records) == 3 and all(len(r) <= 16 + 8 + 32 * 5 + 4 * BS * 5 for r in s.records)


def test_shared_prefixes_are_described_once():
    ev = kv_events()
    a = request(5)
    b = SimpleNamespace(
        block_hashes=a.block_hashes[:3] + [b"y" * 32], _all_token_ids=a._all_token_ids, lora_request=None
    )
    ev.note([(a, 0, 3)])
    ev.note([(b, 0, 3), (b, 3, 4)])  # b's first 3 blocks are a's: not again
    assert [(r[1], r[2]) for r in ev.noted] == [(0, 3), (3, 4)] and ev.noted_blocks == 4
    s = Sent()
    ev.flush(s, None)
    assert len(s.records) == 1 and ev.noted == [] and ev.stats["described_blocks"] == 4
    ev._removed(a.block_hashes[2])  # evicted: described again when stored again
    ev.note([(b, 0, 3)])
    assert len(ev.noted) == 1


def test_events_are_vllms_own():
    ev = kv_events()
    d, p = hashlib.sha256(b"d").digest(), hashlib.sha256(b"p").digest()
    tk = memoryview(struct.pack("<4I", 1, 2, 3, 4))
    ev._stored([d], p, tk, struct.pack("<q", 3) + b"lora-x")
    ev._stored([d], None, tk, b"")
    ev._removed(d)
    a, b, c = ev.out
    assert type(a) is BlockStored and type(c) is BlockRemoved
    assert a.block_hashes == [maybe_convert_block_hash(d)] and a.parent_block_hash == maybe_convert_block_hash(p)
    assert a.token_ids == [1, 2, 3, 4] and a.block_size == 4 and a.medium == "CPU"
    assert (a.lora_id, a.lora_name) == (3, "lora-x") and (b.lora_id, b.lora_name, b.parent_block_hash) == (None,) * 3
    assert a.extra_keys is None and a.group_idx == 0 and a.locality is None and a.ownership is None
    assert c.block_hashes == [maybe_convert_block_hash(d)] and c.medium == "CPU" and c.group_idx == 0


def test_a_chain_is_one_event():
    # A run of the feed is one event, and a run that continues the chain
    # just announced (the next poll's part of a prefill) extends it.
    ev = kv_events()
    ds = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    tk = [struct.pack("<4I", *range(4 * i, 4 * i + 4)) for i in range(6)]
    ev._stored(ds[0:2], None, b"".join(tk[0:2]), b"")
    ev._stored(ds[2:3], memoryview(ds[1]), memoryview(tk[2]), b"")
    ev._removed(ds[0])
    ev._removed(ds[1])  # withdrawals in a row: one event
    ev._stored(ds[3:5], memoryview(ds[2]), b"".join(tk[3:5]), b"")  # after a removal: an event of its own
    ev._stored(ds[5:6], memoryview(ds[0]), tk[5], b"")  # another parent: another event
    a, r, b, c = ev.take_events(None, None)
    conv = maybe_convert_block_hash
    assert a.block_hashes == [conv(d) for d in ds[:3]] and a.parent_block_hash is None
    assert a.token_ids == list(range(12)) and a.block_size == 4 and type(r) is BlockRemoved
    assert r.block_hashes == [conv(ds[0]), conv(ds[1])]
    assert b.block_hashes == [conv(ds[3]), conv(ds[4])] and b.parent_block_hash == conv(ds[2])
    assert b.token_ids == list(range(12, 20)) and c.parent_block_hash == conv(ds[0]) and c.token_ids == [20, 21, 22, 23]
    assert ev.take_events(None, None) == []


def test_all_blocks_cleared_announces_again():
    ev = kv_events()
    ev.feed.announced = {b"x" * 32}
    ev.feed.state = ev.feed.LIVE
    kvm = SimpleNamespace(take_events=lambda: [AllBlocksCleared()])
    ev.watch(kvm)
    ev.watch(kvm)  # once
    assert [type(e) for e in kvm.take_events()] == [AllBlocksCleared]
    assert ev.feed.announced == set() and ev.feed.state == ev.feed.SYNC


def test_enabled():
    on = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
    off = SimpleNamespace(kv_events_config=None)
    auto = Config.parse({}, VLLM)
    assert E.enabled(auto, on) and not E.enabled(auto, off)
    assert not E.enabled(Config.parse({"kv_events": False}, VLLM), on)
    assert E.enabled(Config.parse({"kv_events": True}, VLLM), off)
