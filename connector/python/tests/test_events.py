"""KV events against the real sidecar: Session.describe/events/
event_snapshot and ringside.events.EventFeed. A feed announces each block
the sidecar holds, described, exactly once (its own and another engine's),
withdraws evicted ones, starts over on a new session (a restarted sidecar:
every block it announced is withdrawn) and keeps the sidecar's metadata
bound."""

import hashlib
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
        self.runs = []

    def on_stored(self, digests, parent, tokens, extra):
        # A run: a chain of blocks of one size and one extra, in order.
        tokens = bytes(tokens)
        assert digests and len(tokens) % (4 * len(digests)) == 0, "tokens of a run's blocks"
        per = len(tokens) // len(digests)
        self.runs.append(len(digests))
        for i, digest in enumerate(digests):
            assert digest not in self.stored, "announced twice"
            self.stored[digest] = (parent if i == 0 else digests[i - 1], tokens[i * per : (i + 1) * per], bytes(extra))
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
        if feed.state == EventFeed.LIVE and feed.caught_up and not feed.pending:
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


def _entry(op, d, parent=None, tokens=b"", extra=b""):
    return (
        S.EVENT_HEADER.pack(op, 1 if parent else 0, len(tokens) // 4, len(extra)) + d + (parent or b"") + tokens + extra
    )


def _live_feed(rec):
    feed = rec.feed()
    feed.state = EventFeed.LIVE
    return feed


def test_runs_are_chains_in_the_logs_order():
    # One reply, read in one pass: a prefill's chain is one run; a chain
    # breaks at another size, another extra, a block announced before, a
    # parent that is not the block before, and at a withdrawal (which keeps
    # its place between the announcements).
    d = [hashlib.sha256(bytes([i])).digest() for i in range(12)]
    st, rm = S.EVENT_STORED, S.EVENT_REMOVED
    es = [
        _entry(st, d[0], None, toks(0)),
        _entry(st, d[1], d[0], toks(1)),
        _entry(st, d[2], d[1], toks(2)),  # run [0, 1, 2]
        _entry(st, d[3], d[2], toks(3, 8)),  # another size: [3]
        _entry(st, d[4], d[3], toks(4, 8), b"lora"),  # another extra: [4]
        _entry(st, d[5], d[4], toks(5, 8), b"lora"),  # [4, 5]
        _entry(rm, d[1]),
        _entry(st, d[6], d[5], toks(6, 8), b"lora"),  # after a withdrawal: [6]
        _entry(st, d[0], None, toks(0)),  # announced already: left out
        _entry(st, d[7], d[0], toks(7)),  # parent is not the run's last: [7]
        _entry(st, d[8], d[9], toks(8)),  # nor here: [8]
    ]
    rec = Recorder()
    feed = _live_feed(rec)
    reply = S.encode_events_reply(0, False, False, 1, len(es), 0, 32, len(es), b"".join(es))
    feed._apply(reply)
    assert rec.runs == [3, 1, 2, 1, 1, 1]
    order = [d[i] for i in (0, 1, 2, 3, 4, 5)] + [d[1]] + [d[6], d[7], d[8]]
    assert [x for _, x in rec.log] == order and rec.log[6] == ("removed", d[1])
    assert rec.stored[d[5]] == (d[4], toks(5, 8), b"lora") and rec.stored[d[7]] == (d[0], toks(7), b"")
    assert rec.stored[d[3]] == (d[2], toks(3, 8), b"") and rec.stored[d[2]] == (d[1], toks(2), b"")
    assert feed.announced == set(d[:9]) - {d[1]} and feed.stats["stored"] == 9 and feed.stats["removed"] == 1


def test_a_malformed_entry_emits_the_run_before_it():
    # The entries before a malformed one are applied, their run emitted
    # (announced is never ahead of what the engine was told); the cursor
    # stays, and the next poll reads them again without a second event.
    d = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    good = _entry(S.EVENT_STORED, d[0], None, toks(0)) + _entry(S.EVENT_STORED, d[1], d[0], toks(1))
    bad = S.EVENT_HEADER.pack(S.EVENT_STORED, 2, 0, 0) + d[2]
    rec = Recorder()
    feed = _live_feed(rec)
    try:
        feed._apply(S.encode_events_reply(0, False, False, 1, 3, 0, 32, 3, good + bad))
        raise AssertionError("a malformed entry was accepted")
    except S.SchemaError:
        pass
    assert rec.runs == [2] and feed.announced == {d[0], d[1]} and feed._seq == 0
    feed._apply(S.encode_events_reply(0, False, False, 1, 2, 0, 32, 2, good))
    assert rec.runs == [2] and feed._seq == 2
