"""KV events against the real sidecar: Session.describe/events/
event_snapshot and ringside.events.EventFeed. A feed announces each block
the sidecar holds, described, exactly once (its own and another engine's),
withdraws evicted ones, starts over on a new session (a restarted sidecar:
every block it announced is withdrawn) and keeps the sidecar's metadata
bound."""

import struct

from test_client import digests
from test_mirror import attached, store

from ringside import schema as S
from ringside.events import EventFeed

POOL_BLOCKS = 1024


def toks(i, n=4):
    return struct.pack("<%dI" % n, *range(i * n, (i + 1) * n))


def run(d, first, n, per=4):
    """A DescribeRun of blocks [first, first+n) of digest string d."""
    parent = d[(first - 1) * 32 : first * 32] if first > 0 else None
    return S.DescribeRun(
        parent, d[first * 32 : (first + n) * 32], per, b"".join(toks(i, per) for i in range(first, first + n))
    )


class Recorder:
    def __init__(self):
        self.stored = {}
        self.removed = []
        self.log = []

    def on_stored(self, digest, parent, tokens, extra):
        assert digest not in self.stored, "announced twice"
        self.stored[digest] = (parent, bytes(tokens), extra)
        self.log.append(("stored", digest))

    def on_removed(self, digest):
        assert digest in self.stored, "withdrawn without an announcement"
        del self.stored[digest]
        self.removed.append(digest)
        self.log.append(("removed", digest))

    def feed(self, **kw):
        return EventFeed(self.on_stored, self.on_removed, **kw)


def settle(feed, c, rounds=50):
    for _ in range(rounds):
        feed.pump(c, budget_ns=50_000_000)
        if feed.state == EventFeed.LIVE and feed.caught_up and not feed._pending:
            return
    assert feed.state == EventFeed.LIVE, EventFeed.STATE_NAMES[feed.state]


def test_client_records(sidecar):
    c, reg = attached(sidecar, 16)
    d = digests("ev-client", 8)
    r0 = c.events()
    assert r0.resync and r0.count == 0
    assert c.describe([run(d, 0, 3)]) == 3
    assert c.describe([run(d, 0, 3)]) == 0  # the first description wins
    store(c, reg, 1, d, 0, 3)
    r = c.events(r0.epoch, r0.seq)
    es = list(r.events())
    assert [e.op for e in es] == [S.EVENT_STORED] * 3
    assert es[0].parent is None and es[1].parent == d[:32] and es[2].token_ids() == [8, 9, 10, 11]
    page = c.event_snapshot(0, 2)
    assert page.count == 2 and not page.done
    rest = c.event_snapshot(page.next)
    assert page.count + rest.count == 3 and rest.done
    w = sidecar.attach(role=S.ROLE_WORKER)
    try:
        w.event_snapshot()
        raise AssertionError("a worker read an event snapshot")
    except S.RingsideError as e:
        assert e.status == S.Status.NOT_PERMITTED


def test_feed_follows_every_engine_of_the_namespace(sidecar):
    a, reg = attached(sidecar, 64)
    b = sidecar.attach(instance="other-engine")
    d = digests("ev-feed", POOL_BLOCKS + 300)
    rec = Recorder()
    feed = rec.feed(page_max=5)
    # Engine a stores and describes 100 blocks before the feed of engine b starts.
    a.describe([run(d, 0, 100)])
    store(a, reg, 1, d, 0, 100)
    settle(feed, b)
    assert len(rec.stored) == 100 and feed.stats["pages"] >= 20
    assert rec.stored[d[32:64]] == (d[:32], toks(1), b"")
    # 100 more, described after their store (another order of arrival).
    store(a, reg, 2, d, 100, 100)
    a.describe([run(d, 100, 100)])
    settle(feed, b)
    assert len(rec.stored) == 200
    # Fill the pool: the oldest are evicted, and withdrawn.
    for k in range(200, POOL_BLOCKS + 300, 100):
        n = min(100, POOL_BLOCKS + 300 - k)
        a.describe([run(d, k, n)])
        store(a, reg, 3 + k, d, k, n)
        settle(feed, b)
    held = {d[i * 32 : (i + 1) * 32] for i in range(POOL_BLOCKS + 300) if _present(a, d, i)}
    assert set(rec.stored) == held and len(rec.removed) == POOL_BLOCKS + 300 - len(held) > 0
    assert feed.announced == held


def _present(c, d, i):
    c.put_hashes(999, d[i * 32 : (i + 1) * 32])
    try:
        return c.lookup(999, 0, 1) == 1
    finally:
        c.drop_hashes(999)


def test_a_new_sidecar_withdraws_what_it_lacks(start_sidecar):
    sc = start_sidecar()
    c, reg = attached(sc, 16)
    d = digests("ev-restart", 10)
    c.describe([run(d, 0, 10)])
    store(c, reg, 1, d, 0, 10)
    rec = Recorder()
    feed = rec.feed()
    settle(feed, c)
    assert len(rec.stored) == 10
    # The engine restarts (a new feed, nothing announced): everything again.
    rec2 = Recorder()
    feed2 = rec2.feed()
    settle(feed2, sc.attach())
    assert set(rec2.stored) == set(rec.stored)
    # The sidecar restarts: a new session finds it empty.
    sc.stop()
    sc2 = start_sidecar()
    c2, reg2 = attached(sc2, 16)
    c2.describe([run(d, 0, 4)])
    store(c2, reg2, 1, d, 0, 4)
    settle(feed, c2)
    assert set(rec.stored) == {d[i * 32 : (i + 1) * 32] for i in range(4)}
    assert len(rec.removed) == 6


def test_feed_off_on_an_old_sidecar_answer():
    rec = Recorder()
    feed = rec.feed()
    feed.state = EventFeed.SYNC
    feed._apply(S.encode_reply(S.Status.UNKNOWN_TYPE, 0, "type 0x10"))
    assert feed.disabled and feed.state == EventFeed.OFF


def test_descriptions_are_bounded(start_sidecar):
    # 4 MiB of metadata: a session may hold a quarter.
    sc = start_sidecar(args=["--limits.metadata-bytes=4MiB"])
    c = sc.attach()
    d = digests("ev-quota", 4096)
    refused = False
    for k in range(0, 4096, 8):
        try:
            c.describe([run(d, k, 8, per=256)])
        except S.RingsideError as e:
            assert e.status == S.Status.TOO_LARGE and "metadata" in e.message
            refused = True
            break
    assert refused
