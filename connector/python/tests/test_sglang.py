"""The SGLang HiCache storage backend (ringside.sglang) against a real
sidecar process, driven through SGLang's own pieces: the backend is made by
SGLang's StorageBackendFactory ("dynamic" backend, module path + class name)
and given real SGLang host pools (MHATokenToKVPoolHost) on CPU tensors.

Needs SGLang's modules: run with the venv of
connector/python/scripts/install-sglang.sh (`make sglang-venv`; `make
pytest` runs this file with it). Elsewhere the module is skipped.
"""

import ctypes
import hashlib
import os
import shutil
import signal
import threading
import time

import pytest

try:
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as e:  # noqa: BLE001 - ImportError, or a module that fails at import
    pytest.skip(
        "SGLang's HiCache modules are not importable here (%s: %s): run `make sglang-venv`, then "
        "this file with .venv-sglang/bin/python (make pytest does)" % (type(e).__name__, e),
        allow_module_level=True,
    )

from ringside import sglang as rs  # noqa: E402
from ringside.client import Session  # noqa: E402
from ringside.sidecar_process import stop_process  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None, reason="the Go toolchain (go) is not on PATH: cannot build the ringside sidecar"
)

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4  # a page: 2 x 3 x 4 x 2 x 8 bf16 = 768 bytes
DEVICE_TOKENS = 64


def chain(n, seed="s"):
    """SGLang-style page keys: hex sha256 digests chained page to page."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + ("%s/%d" % (seed, i)).encode()).digest()
        keys.append(prev.hex())
    return keys


def make_pool(layout="page_first", fill=True, heads=HEADS, seed=0):
    k = tuple(torch.zeros(DEVICE_TOKENS, heads, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, heads, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
        page_size=PAGE,
        head_num=heads,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )
    if fill:
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(torch.bfloat16))
    return pool


def make_backend(sock, pool, instance="engine-a", tp_rank=0, tp_size=1, **extra):
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name="tiny/llama",
        extra_config=dict(
            backend_name="ringside",
            module_path="ringside.sglang",
            class_name="RingsideHiCacheStorage",
            socket=sock,
            instance=instance,
            timeout=1.0,
            reattach_interval=0.2,
            **extra,
        ),
    )
    # What HiCacheController.attach_storage_backend does.
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    assert isinstance(b, rs.RingsideHiCacheStorage)
    return b, cfg


def page(pool, idx):
    return pool.get_data_page(int(idx), flat=True).view(torch.uint8).clone()


def pages_equal(pa, ia, pb, ib, n):
    return all(torch.equal(page(pa, ia[i * PAGE]), page(pb, ib[i * PAGE])) for i in range(n))


@pytest.fixture
def backends():
    made = []
    yield made
    for b in made:
        b.close()


# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_set_exists_get_second_instance(sidecar, backends, layout):
    pa = make_pool(layout, seed=1)
    a, cfg = make_backend(sidecar.sock, pa)
    backends.append(a)
    assert cfg.extra_config["interface_v1"] == 1  # SGLang's controller then picks the zero-copy methods
    keys = chain(8)
    ia = pa.alloc(6 * PAGE)
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys[:6], ia) == [True] * 6
    assert a.batch_exists(keys) == 6
    assert a.batch_exists(keys[:3]) == 3
    assert a.exists(keys[5]) and not a.exists(keys[6])
    assert a.stats["stored_pages"] == 6
    assert a.batch_set_v1(keys[:6], ia) == [True] * 6  # again: already present
    assert a.stats["present_pages"] == 6

    # A second engine instance (its own pool, empty) gets hits.
    pb = make_pool(layout, fill=False)
    b, _ = make_backend(sidecar.sock, pb, instance="engine-b")
    backends.append(b)
    ib = pb.alloc(8 * PAGE)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None)) == 6
    assert b.batch_get_v1(keys, ib) == [True] * 6 + [False] * 2
    assert pages_equal(pa, ia, pb, ib, 6)
    assert not page(pb, ib[6 * PAGE]).any()  # a miss leaves the page alone
    # The get reused the batch the exists registered: 8 keys sent, once.
    assert b._index.registered == 8 and len(b._index.batches) == 1
    # A shuffled page list lands where asked.
    ic = torch.cat([ib[3 * PAGE : 6 * PAGE], ib[: 3 * PAGE]])
    pb.kv_buffer.zero_()
    assert b.batch_get_v1(keys[:6], ic) == [True] * 6
    assert pages_equal(pa, ia, pb, ic, 6)


def test_chunks_with_prefix_keys_share_one_batch(sidecar, backends):
    pool = make_pool()
    a, _ = make_backend(sidecar.sock, pool)
    backends.append(a)
    keys = chain(12)
    idx = pool.alloc(12 * PAGE)
    # The cache controller writes and queries a chain in chunks, passing the
    # keys before each chunk as prefix_keys.
    assert a.batch_set_v1(keys[:5], idx[: 5 * PAGE], HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 5
    assert a.batch_set_v1(keys[5:], idx[5 * PAGE :], HiCacheStorageExtraInfo(prefix_keys=keys[:5])) == [True] * 7
    assert len(a._index.batches) == 1 and a._index.registered == 12
    assert a.batch_exists(keys[:5]) == 5
    assert a.batch_exists(keys[5:], HiCacheStorageExtraInfo(prefix_keys=keys[:5])) == 7
    assert a.batch_exists(keys[2:9]) == 7  # any run of a known chain: a view, nothing sent
    assert a._index.registered == 12
    # A new chain that shares nothing: a new batch.
    other = chain(3, seed="other")
    assert a.batch_exists(other) == 0
    assert len(a._index.batches) == 2 and a._index.registered == 15


def test_lru_bounds_batches(sidecar, backends):
    pool = make_pool()
    a, _ = make_backend(sidecar.sock, pool, max_batches=4)
    backends.append(a)
    for i in range(10):
        assert a.batch_exists(chain(3, seed="c%d" % i)) == 0
    assert len(a._index.batches) == 4
    assert len(a._index.where) == 12


def test_plain_methods_and_cross_path(sidecar, backends):
    """What SGLang calls with interface_v1 = 0: batch_set of flat data pages
    and batch_get into dummy flat pages; the bytes match the zero-copy path."""
    pa = make_pool(seed=3)
    a, cfg = make_backend(sidecar.sock, pa, interface_v1=0, staging_pages=3)
    backends.append(a)
    assert cfg.extra_config["interface_v1"] == 0  # an explicit choice is left alone
    keys = chain(7)
    ia = pa.alloc(7 * PAGE)
    data = [pa.get_data_page(ia[i * PAGE]) for i in range(7)]  # as _generic_page_set
    assert a.batch_set(keys[:5], data[:5]) is True
    assert a.set(keys[5], data[5]) is True
    assert a.exists(keys[5])

    pb = make_pool(fill=False)
    b, _ = make_backend(sidecar.sock, pb, instance="engine-b", interface_v1=0, staging_pages=3)
    backends.append(b)
    ib = pb.alloc(7 * PAGE)
    dst = [pb.get_dummy_flat_data_page() for _ in keys]  # as _generic_page_get
    got = b.batch_get(keys, dst)
    assert [g is not None for g in got] == [True] * 6 + [False]
    for i in range(6):
        pb.set_from_flat_data_page(ib[i * PAGE], got[i])
    assert pages_equal(pa, ia, pb, ib, 6)
    assert b.get(keys[6], pb.get_dummy_flat_data_page()) is None
    # Plain-stored pages load zero-copy, and the other way round.
    pc = make_pool(fill=False)
    c, _ = make_backend(sidecar.sock, pc, instance="engine-c")
    backends.append(c)
    ic = pc.alloc(7 * PAGE)
    assert c.batch_get_v1(keys, ic) == [True] * 6 + [False]
    assert pages_equal(pa, ia, pc, ic, 6)
    more = chain(2, seed="zc")
    assert c.batch_set_v1(more, ic[: 2 * PAGE]) == [True, True]
    out = b.batch_get(more)
    assert torch.equal(out[0].view(torch.uint8), page(pc, ic[0]))


def test_tensor_parallel_ranks_see_one_answer(sidecar, backends):
    """Two TP ranks of one instance: a page counts only once both stored
    their shard; a second 2-rank instance loads each rank's own shard."""
    keys = chain(5)
    pools = [make_pool(seed=10 + r) for r in range(2)]
    ranks = []
    for r in range(2):
        b, _ = make_backend(sidecar.sock, pools[r], instance="tp-a", tp_rank=r, tp_size=2)
        backends.append(b)
        ranks.append(b)
    idx = [p.alloc(5 * PAGE) for p in pools]
    assert ranks[0].batch_set_v1(keys, idx[0]) == [True] * 5
    assert [b.batch_exists(keys) for b in ranks] == [0, 0]  # rank 1 has not stored yet
    assert ranks[1].batch_set_v1(keys[:3], idx[1][: 3 * PAGE]) == [True] * 3
    assert [b.batch_exists(keys) for b in ranks] == [3, 3]
    assert ranks[1].batch_set_v1(keys, idx[1]) == [True] * 5
    assert [b.batch_exists(keys) for b in ranks] == [5, 5]

    dst_pools = [make_pool(fill=False) for _ in range(2)]
    readers = []
    for r in range(2):
        b, _ = make_backend(sidecar.sock, dst_pools[r], instance="tp-b", tp_rank=r, tp_size=2)
        backends.append(b)
        readers.append(b)
    didx = [p.alloc(5 * PAGE) for p in dst_pools]
    for r in range(2):
        assert readers[r].batch_exists(keys) == 5
        assert readers[r].batch_get_v1(keys, didx[r]) == [True] * 5
        assert pages_equal(pools[r], idx[r], dst_pools[r], didx[r], 5)
    # A single-rank engine is another namespace: it sees none of this.
    solo, _ = make_backend(sidecar.sock, make_pool(), instance="solo")
    backends.append(solo)
    assert solo.batch_exists(keys) == 0


def test_threads_get_their_own_sessions(sidecar, backends):
    pool = make_pool()
    a, _ = make_backend(sidecar.sock, pool)
    backends.append(a)
    keys = chain(6)
    idx = pool.alloc(6 * PAGE)
    assert a.batch_set_v1(keys, idx) == [True] * 6
    out = {}

    def worker(i):
        out[i] = [a.batch_exists(keys) for _ in range(20)]

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out == {i: [6] * 20 for i in range(3)}
    assert len(a._links) == 4


def test_sidecar_absent_means_misses(backends, tmp_path):
    sock = str(tmp_path / "ringside.sock")
    pool = make_pool()
    a, _ = make_backend(sock, pool)
    backends.append(a)
    keys = chain(4)
    idx = pool.alloc(4 * PAGE)
    t0 = time.monotonic()
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, idx) == [False] * 4
    assert a.batch_get_v1(keys, idx) == [False] * 4
    assert a.exists(keys[0]) is False
    assert a.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert a.set(keys[0], pool.get_data_page(idx[0])) is False
    assert a.batch_set(keys, [pool.get_data_page(idx[0])] * 4) is False
    assert time.monotonic() - t0 < 2


def test_sidecar_killed_means_misses_then_reattach(sidecar, backends):
    pool = make_pool()
    a, _ = make_backend(sidecar.sock, pool)
    backends.append(a)
    keys = chain(6)
    idx = pool.alloc(6 * PAGE)
    assert a.batch_set_v1(keys, idx) == [True] * 6
    sidecar.kill()
    assert a.batch_exists(keys) == 0
    assert a.batch_get_v1(keys, idx) == [False] * 6
    assert a.batch_set_v1(keys, idx) == [False] * 6
    # A new sidecar on the same socket: the backend re-attaches (new epoch:
    # its batches are re-registered) and works again; the old pages are gone.
    os.unlink(sidecar.sock) if os.path.exists(sidecar.sock) else None
    sidecar.start()
    time.sleep(0.3)
    deadline = time.monotonic() + 10
    while a.batch_set_v1(keys, idx) != [True] * 6:
        assert time.monotonic() < deadline, "no re-attach:\n" + sidecar.logs()
        time.sleep(0.1)
    assert a.batch_exists(keys) == 6


def test_sidecar_killed_mid_call(sidecar, backends):
    pool = make_pool()
    a, _ = make_backend(sidecar.sock, pool)
    backends.append(a)
    keys = chain(6)
    idx = pool.alloc(6 * PAGE)
    assert a.batch_set_v1(keys, idx) == [True] * 6
    res = {}
    ready, go = threading.Event(), threading.Event()

    def call():
        try:
            res["before"] = a.batch_exists(keys)  # this thread's session is attached
            ready.set()
            go.wait(10)
            res["get"] = a.batch_get_v1(keys, idx)
            res["exists"] = a.batch_exists(keys)
        except BaseException as e:  # noqa: BLE001
            res["error"] = e

    t = threading.Thread(target=call)
    t.start()
    assert ready.wait(30)
    stop_process(sidecar.proc.pid)  # the call is in flight when it dies
    go.set()
    time.sleep(0.3)
    sidecar.proc.send_signal(signal.SIGKILL)
    sidecar.proc.wait(10)
    t.join(15)
    assert not t.is_alive()
    assert res == {"before": 6, "get": [False] * 6, "exists": 0}
    assert a.stats["sidecar_errors"] >= 1


def test_page_larger_than_slot_is_a_miss(start_sidecar, backends):
    pool = make_pool(heads=64)  # 2 x 3 x 4 x 64 x 8 x 2 B = 24 KiB pages > 4 KiB slots
    s = start_sidecar()
    a, _ = make_backend(s.sock, pool)
    backends.append(a)
    idx = pool.alloc(2 * PAGE)
    assert a.batch_set_v1(chain(2), idx) == [False, False]
    assert a.batch_exists(chain(2)) == 0


def test_unsupported_methods_raise(backends):
    pool = make_pool()
    a, _ = make_backend("/nonexistent/ringside.sock", pool)
    backends.append(a)
    for call in (lambda: a.batch_exists_v2(chain(1)), lambda: a.batch_get_v2([]), lambda: a.batch_set_v2([]), a.clear):
        with pytest.raises(NotImplementedError):
            call()
    assert a.get_stats() is None


def test_key_digests():
    k = chain(1)[0]
    assert rs.key_digest(k) == bytes.fromhex(k)
    assert rs.key_digest(k.upper()) == bytes.fromhex(k)
    sfx = rs.key_digest(k + "_tenant-a")
    assert len(sfx) == 32 and sfx != bytes.fromhex(k) and sfx != rs.key_digest(k + "_tenant-b")
    assert sfx == hashlib.sha256(b"ringside-sglang-key-v1\x00" + (k + "_tenant-a").encode()).digest()
    assert rs._digests([k, k + "_x"]) == bytes.fromhex(k) + rs.key_digest(k + "_x")


def test_region_geometry_matches_data_pages():
    """Region page p, segment by segment, is exactly get_data_page(p) flat."""
    for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
        pool = make_pool(layout, seed=7)
        g = rs.describe_pool(pool).region
        raw = (ctypes.c_ubyte * g.length).from_address(g.base)
        for p in (0, 1, g.page_count - 1):
            got = b"".join(bytes(raw[o + p * st : o + p * st + n]) for o, st, n in g.page_segments())
            assert got == bytes(page(pool, p * PAGE).numpy()), layout
        assert g.page_size == 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2


def test_session_is_plain_client(sidecar):
    """Sanity: the sidecar the tests use takes a plain client session."""
    with Session.attach(sidecar.sock, instance="x", model="m", layout="l") as s:
        assert s.ping(7) == 7


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"max_batch": 4}, ["'max_batch'", "did you mean 'max_batches'"]),
        ({"lease_ttl": "30s"}, ["'lease_ttl'", '"30s"', "a number of seconds > 0"]),
        ({"staging_pages": 0}, ["'staging_pages'", "0", "an integer of pages >= 1"]),
        ({"mirror": False}, ["'mirror'", "read by the vLLM connector only"]),
    ],
)
def test_config_errors_name_the_key(sidecar, extra, words):
    """A misspelled, mistyped or other plugin's key in the extra config fails
    the backend's construction (through SGLang's factory) with an error that
    names it; SGLang's own keys (backend_name, interface_v1, ...) pass."""
    with pytest.raises(Exception) as e:  # noqa: B017 - SGLang's factory may wrap the ConfigError
        make_backend(sidecar.sock, make_pool(), **extra)
    msg = str(e.value) + "".join(str(c) for c in (e.value.__cause__, e.value.__context__) if c)
    for w in words:
        assert w in msg, (w, msg)
