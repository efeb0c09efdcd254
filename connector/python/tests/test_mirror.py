"""ringside.mirror.Mirror against the real sidecar: the local index equals
what the sidecar holds after a snapshot copied in pages while blocks are
stored and evicted, follows the change log, starts again after a resync, and
turns itself off where Snapshot is refused."""

import random
import time

from test_client import Region, digests

from ringside import schema as S
from ringside.mirror import Mirror

POOL_BLOCKS = 1024  # the test sidecar's pool: 4 MiB of 4 KiB slots


def store(c, region, batch, d, first, n):
    """Store blocks [first, first+n) of digest string d from region pages."""
    for a in range(0, n, 256):  # the test rings carry ~500 digests a record
        c.put_hashes(batch, d[(first + a) * 32 : (first + min(n, a + 256)) * 32], append=a > 0)
    for i in range(n):
        region.fill(i % region.pages, first + i)
    done = 0
    while done < n:
        k = min(n - done, region.pages)
        r = c.store(batch, done, k, region.id, list(range(k)))
        assert r.status == 0
        done += k
    c.drop_hashes(batch)


def present(c, d, n):
    """The set of d's first n digests the sidecar holds (one lookup each)."""
    for a in range(0, n, 256):
        c.put_hashes(99, d[a * 32 : min(n, a + 256) * 32], append=a > 0)
    out = {d[i * 32 : (i + 1) * 32] for i in range(n) if c.lookup(99, i, 1) == 1}
    c.drop_hashes(99)
    return out


def attached(sidecar, pages):
    """A client session with a registered region of pages."""
    c = sidecar.attach()
    reg = Region(1, pages)
    reg.register(c)
    return c, reg


def sync(m, c):
    for _ in range(1000):
        m.pump(c, budget_ns=50_000_000)
        if m.state == Mirror.LIVE:
            return
    raise AssertionError("mirror not live: state %s" % Mirror.STATE_NAMES[m.state])


def test_snapshot_then_log(sidecar):
    c, reg = attached(sidecar, 64)
    d = digests("mirror", 300)
    store(c, reg, 1, d, 0, 100)
    m = Mirror(page_max=7)  # 15 pages
    sync(m, c)
    assert m.present == present(c, d, 300) and len(m.present) == 100
    assert m.stats["pages"] >= 15
    assert m.leading([d[i * 32 : (i + 1) * 32] for i in range(300)], 300) == 100
    # Stores after the sync come through the change log.
    store(c, reg, 2, d, 100, 50)
    m.pump(c, budget_ns=50_000_000)
    assert m.state == Mirror.LIVE and len(m.present) == 150
    assert m.present == present(c, d, 300)


def test_changes_between_pages_and_evictions(sidecar):
    """Blocks stored (evicting the oldest: the pool holds 1024) while the
    snapshot is being copied page by page: the mirror ends up equal to the
    sidecar's contents."""
    c, reg = attached(sidecar, 64)
    n = POOL_BLOCKS + 400
    d = digests("evict", n)
    store(c, reg, 1, d, 0, POOL_BLOCKS)
    m = Mirror(page_max=64)
    rng = random.Random(5)
    nxt, step = POOL_BLOCKS, 0
    while m.state != Mirror.LIVE:
        step += 1
        m.pump(c, budget_ns=0 if step % 3 else 20_000_000, wake=True)
        if nxt < n and m.state == Mirror.SYNC:
            k = min(n - nxt, rng.randint(1, 40))
            store(c, reg, 2, d, nxt, k)
            nxt += k
        assert step < 10000
    want = present(c, d, n)
    assert len(want) == POOL_BLOCKS, "the test meant to evict"
    assert m.present == want
    assert m.stats["changes"] > 0


def test_resync_starts_over(sidecar):
    c, reg = attached(sidecar, 16)
    d = digests("resync", 40)
    store(c, reg, 1, d, 0, 20)
    m = Mirror()
    sync(m, c)
    syncs = m.stats["syncs"]
    # A cursor of another epoch (as after a sidecar restart): the sidecar
    # answers resync and the mirror copies the snapshot again.
    m._epoch += 1
    store(c, reg, 2, d, 20, 20)
    m.pump(c, budget_ns=50_000_000)  # the poll answers resync; the copy starts over
    sync(m, c)
    assert m.stats["resyncs"] == 1 and m.stats["syncs"] == syncs + 1
    assert m.present == present(c, d, 40) and len(m.present) == 40


def test_leading():
    m = Mirror()
    hs = [bytes([i]) * 32 for i in range(80)]
    m.present.update(hs[:70])
    m.present.add(hs[75])  # present after a miss: not leading
    for n, want in [(0, 0), (1, 1), (64, 64), (70, 70), (80, 70)]:
        assert m.leading(hs, n) == want, n
    m.present.discard(hs[10])  # a hole
    for n, want in [(10, 10), (11, 10), (70, 10)]:
        assert m.leading(hs, n) == want, n
    m.present.discard(hs[0])
    assert m.leading(hs, 70) == 0


def test_answer_reads_own_writes():
    """A first miss that this engine stored lately is answered -1 (ask the
    sidecar); any other miss, or a hit, is answered from the index. Noted
    digests go after one to two max_lag."""
    m = Mirror(max_lag=1.0)
    hs = [bytes([i]) * 32 for i in range(10)]
    m.present.update(hs[:4])
    m._mine_t = 0.0
    for mine, n, want in [
        (set(), 10, 4),  # a plain miss at 4
        ({hs[4]}, 10, -1),  # the first miss is ours: ask
        ({hs[4]}, 4, 4),  # all asked-for blocks hit
        ({hs[6]}, 10, 4),  # ours, but not the first miss
        ({hs[0]}, 10, 4),  # ours and present
    ]:
        m.mine, m._mine_old = set(mine), set()
        assert m.answer(hs, n) == want, (mine, n)
    m.mine, m._mine_old = {hs[4]}, set()
    m.age(0.5)  # under max_lag: kept
    assert m.answer(hs, 10) == -1
    m.age(1.0)  # one max_lag: moved to the old generation, still noted
    assert m.answer(hs, 10) == -1 and not m.mine
    m.age(1.5)
    assert m.answer(hs, 10) == -1
    m.age(2.0)  # two: gone
    assert m.answer(hs, 10) == 4
    assert m.stats["own_misses"] == 4


def test_noting_bounds_own_stores_without_polls():
    """Digests noted through noting() age out even if the index is never
    pumped (no session for hours): the sets hold one to two max_lag of
    stores, never the whole outage's."""
    m = Mirror(max_lag=1.0)
    m._mine_t = 0.0
    for t in range(100):  # 100 s of 10 stores a second, no pump
        for k in range(10):
            m.noting(t + k / 10).add(b"%d.%d" % (t, k) + bytes(28))
        assert len(m.mine) + len(m._mine_old) <= 20, t
    assert b"99.9" + bytes(28) in m.mine and b"97.0" + bytes(28) not in m._mine_old


def test_own_store_found_before_the_index_polls_it(sidecar):
    """A block stored on the sidecar after the index's last poll: the index
    misses it, answer() says ask, and the sidecar has it."""
    c, reg = attached(sidecar, 16)
    d = digests("ryw", 12)
    hs = [d[i * 32 : (i + 1) * 32] for i in range(12)]
    store(c, reg, 1, d, 0, 8)
    m = Mirror()
    sync(m, c)
    assert m.answer(hs, 12) == 8
    m.noting(time.monotonic()).update(hs[8:10])  # noted when the stores are planned
    store(c, reg, 2, d, 8, 2)
    assert m.answer(hs, 12) == -1
    assert present(c, d, 12) == set(hs[:10])  # what the caller then asks
    m.pump(c, budget_ns=50_000_000)  # polled in: answered from the index
    assert m.state == Mirror.LIVE and m.answer(hs, 12) == 10


def test_fresh_rules():
    s, other = object(), object()
    m = Mirror(max_lag=0.25)
    assert not m.fresh(0.0, s)  # not live
    m.state = Mirror.LIVE
    m.session = s
    m.fresh_t = 100.0
    for now, want in [(100.0, True), (100.25, True), (100.26, False), (200.0, False)]:
        assert m.fresh(now, s) is want, now
    assert not m.fresh(100.0, other)  # built on another session (a restarted sidecar)


def test_refused_snapshot_turns_it_off(sidecar):
    """A worker session may not read the index: the mirror turns itself off
    (the caller asks the sidecar) instead of failing."""
    w = sidecar.attach(role=S.ROLE_WORKER)
    m = Mirror()
    m.pump(w, budget_ns=1_000_000_000)
    assert m.state == Mirror.OFF and m.disabled
    m.pump(w, budget_ns=1_000_000_000)  # stays off, sends nothing
    assert m.pending == 0
    # A new session starts over.
    c = sidecar.attach()
    sync(m, c)
    assert m.state == Mirror.LIVE and not m.disabled


def test_over_max_blocks_turns_it_off(sidecar):
    c, reg = attached(sidecar, 16)
    store(c, reg, 1, digests("big", 30), 0, 30)
    m = Mirror(max_blocks=20, page_max=8)
    for _ in range(50):
        m.pump(c, budget_ns=20_000_000)
        if m.state == Mirror.OFF:
            break
    assert m.state == Mirror.OFF and "20" in m.disabled and not m.present
