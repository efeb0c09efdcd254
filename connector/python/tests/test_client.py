"""End-to-end tests of ringside.client against the real sidecar binary.

The Python twin of sidecar/sidecar_test.go: each test starts `ringside serve`
on a fresh directory under /dev/shm, attaches real sessions, and checks on
teardown that the sidecar removed its rings, pool and socket.
"""

import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import child_env

from ringside import schema as S
from ringside.client import RingsideError, RingsideTimeout, RingsideUnavailable, Session
from ringside.schema import State, Status
from ringside.sidecar_process import stop_process

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None, reason="the Go toolchain (go) is not on PATH: cannot build the ringside sidecar"
)

SLOT = 4096


def digests(seed, n):
    """n chained 32-byte digests, as vLLM's sha256 block hashes (same as the Go test)."""
    out = []
    prev = hashlib.sha256(seed.encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i & 0xFF])).digest()  # byte(i) in Go: wraps past 255
        out.append(prev)
    return b"".join(out)


class Region:
    """Engine memory of this process: pages of SLOT bytes in a ctypes buffer."""

    def __init__(self, rid, pages):
        self.id = rid
        self.pages = pages
        self.buf = ctypes.create_string_buffer(pages * SLOT)
        self.base = ctypes.addressof(self.buf)

    def register(self, s, **kw):
        s.register_region(self.id, self.base, self.pages * SLOT, SLOT, self.pages, **kw)

    def fill(self, page, seed):
        data = bytes((seed + i * 7) & 0xFF for i in range(256)) * (SLOT // 256)
        ctypes.memmove(self.base + page * SLOT, data, SLOT)

    def page(self, i):
        return ctypes.string_at(self.base + i * SLOT, SLOT)

    def raw(self, a, b):
        return ctypes.string_at(self.base + a * SLOT, (b - a) * SLOT)


def status_of(excinfo):
    return excinfo.value.status


def test_bad_input(sidecar):
    c = sidecar.attach()
    src = Region(1, 4)
    src.register(c)
    assert c.put_hashes(1, digests("x", 4)) == 4
    # The statuses of bad records are the scenarios' (testdata/scenarios/malformed.txt);
    # here, the typed API: refusals raise RingsideError with the status.
    api = [
        (lambda: c.lookup(99, 0, 1), Status.UNKNOWN_BATCH),
        (lambda: c.lookup(1, 3, 2), Status.OUT_OF_RANGE),
        (lambda: c.put_hashes(1, digests("y", 1)), Status.DUPLICATE),
        (lambda: c.poll(12345), Status.UNKNOWN_LEASE),
        (lambda: c.load(12345, 1, 0, [0]), Status.UNKNOWN_LEASE),
        (lambda: c.store(1, 0, 1, 42, [0]), Status.UNKNOWN_REGION),
        (lambda: c.store(1, 0, 1, 1, [4]), Status.OUT_OF_RANGE),
        (lambda: c.register_region(9, src.base, 4 * SLOT, SLOT, 4, pid=1), Status.NOT_PERMITTED),
        (lambda: c.acquire(99, 0, 1), Status.UNKNOWN_BATCH),
    ]
    for fn, want in api:
        with pytest.raises(RingsideError) as e:
            fn()
        assert not isinstance(e.value, (RingsideTimeout, RingsideUnavailable))
        assert e.value.status == want, str(e.value)
        assert e.value.message
    # Arguments that cannot be encoded never reach the sidecar.
    with pytest.raises(S.SchemaError):
        c.put_hashes(7, b"\x01" * 33)
    with pytest.raises(S.SchemaError):
        c.store(1, 0, 2, 1, [0])
    # The session still serves after all of that; nothing leaked.
    assert c.ping(7) == 7
    src.fill(0, 5)
    assert c.store(1, 0, 1, 1, [0]).stored == 1
    assert c.lookup(1, 0, 4) == 1


def test_out_of_order_replies(sidecar):
    c = sidecar.attach()
    src = Region(1, 8)
    src.register(c)
    c.put_hashes(1, digests("ooo", 8))
    for i in range(8):
        src.fill(i, 3 * i + 1)
    stores = [c.submit(S.TYPE_STORE, S.encode_store(1, i, 1, 1, [i])) for i in range(8)]
    pings = [c.submit(S.TYPE_PING, S.encode_id(100 + i)) for i in range(8)]
    for i, seq in reversed(list(enumerate(pings))):
        assert S.decode_reply(c.await_reply(seq)).value == 100 + i
    for seq in reversed(stores):
        assert S.decode_store_reply(c.await_reply(seq)).stored == 1
    assert c.lookup(1, 0, 8) == 8
    with pytest.raises(ValueError):
        c.await_reply(10**6)


def test_quiet_sends(sidecar):
    """send() is fire and forget (seq 0): thousands of sends that succeed
    leave no reply in the completion ring."""
    c = sidecar.attach()
    # Which sends fail, and that they are handled in order, is the scenarios'
    # (testdata/scenarios/quiet.txt).
    # Many sends, no reply piles up in the completion ring.
    for i in range(5000):
        c.send(S.TYPE_PING, S.encode_id(i), wake=False)
    assert c.ping(6) == 6 and c.quiet_failures == 0
    c.close()


def test_pipelined_without_wake(sidecar):
    """Records published with wake=False are handled in order once a wait
    (await_reply, kick, a synchronous call) wakes the sidecar; FlagLookup
    registers and looks up in one record; drain() consumes the replies of
    fire-and-forget sends so that they never pile up."""
    c = sidecar.attach()
    src = Region(1, 4)
    src.register(c)
    d = digests("nowake", 4)
    c.put_hashes(1, d)
    for i in range(4):
        src.fill(i, i)
    assert c.store(1, 0, 2, 1, [0, 1]).stored == 2
    # The sidecar parks when idle: give it time to, then pipeline without waking.
    time.sleep(0.05)
    seqs = [
        c.submit(S.TYPE_PUT_HASHES, S.encode_put_hashes(10 + i, d[: (i + 1) * 32], 32, S.FLAG_LOOKUP), wake=False)
        for i in range(4)
    ]
    for i in range(100):
        c.send(S.TYPE_PING, S.encode_id(i), wake=False)
    assert c._unwoken
    assert [S.decode_reply(c.await_reply(q)).value for q in seqs] == [1, 2, 2, 2]  # hits, not batch lengths
    assert not c._unwoken
    c.kick()  # nothing left to wake: a no-op
    # Fire-and-forget replies are consumed by drain, without waiting.
    last = c.submit(S.TYPE_PING, S.encode_id(7), wake=False)
    c.kick()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        c.drain()
        if last in c._pending:
            break
        time.sleep(0.001)
    assert S.decode_reply(c.await_reply(last)).value == 7
    assert not c._abandoned and not c._pending
    assert c.lookup(10, 0, 1) == 1  # in order: the pipelined batches exist
    q = c.submit(S.TYPE_PUT_HASHES, S.encode_put_hashes(10, d[:32], 32, S.FLAG_LOOKUP))
    assert S.decode_reply(c.await_reply(q)).status == S.Status.DUPLICATE  # batch 10 is registered
    c.close()


def test_budget_waiting_and_expiry(start_sidecar):
    # Budget of 4 slots: a lease of 4 blocks fills it; the next waits.
    sc = start_sidecar(budget="16KiB", metrics=True)
    c = sc.attach()
    src = Region(1, 8)
    src.register(c)
    c.put_hashes(1, digests("b", 8))
    assert c.store(1, 0, 8, 1, list(range(8))).stored == 8
    l1 = c.acquire(1, 0, 4, ttl=60)
    assert l1.state == State.READY
    l2 = c.acquire(1, 4, 2, ttl=60)
    assert l2.state == State.WAITING
    with pytest.raises(RingsideError) as e:
        c.load(l2.lease, 1, 0, [0])
    assert status_of(e) == Status.BAD_STATE
    # A short-lived third query waits, then resolves as a miss.
    l3 = c.acquire(1, 6, 2, ttl=0.03)
    assert l3.state == State.WAITING
    deadline = time.monotonic() + 5
    while c.poll(l3.lease).state != State.MISS:
        assert time.monotonic() < deadline, "waiting query never resolved"
        time.sleep(0.005)
    with pytest.raises(RingsideError) as e:
        c.load(l3.lease, 1, 0, [0])
    assert status_of(e) == Status.EXPIRED
    c.release(l1.lease)
    assert c.poll(l2.lease).state == State.READY
    assert c.load(l2.lease, 1, 0, [0]) == 1
    c.release(l2.lease)
    c.release(l3.lease)
    pool = sc.state()["pool"]
    assert pool["Leases"] == 0 and pool["PinnedBlocks"] == 0 and pool["Free"] + pool["Used"] == pool["Capacity"]


def test_snapshot(start_sidecar):
    """Snapshot pages, then Changes from the first page's cursor, equal what
    Lookup answers, also when blocks are stored (and, the pool being full,
    evicted) between pages (docs/protocol.md section 11)."""
    sc = start_sidecar(pool="256KiB")  # 64 slots
    c = sc.attach()
    slots = c.info.pool_slots
    assert slots == 64
    reg = Region(1, 64)
    reg.register(c)
    # Empty: one page, done, at the log's head.
    head = c.changes()
    r = c.snapshot()
    assert r.done and r.count == 0 and r.digests() == [] and r.width == 32 and r.next == slots
    assert (r.epoch, r.seq) == (head.epoch, head.next) and r.epoch == c.info.epoch
    d = digests("snap", 40)
    more = digests("more", 250)
    c.put_hashes(1, d)
    for off in range(0, 250, 125):
        c.put_hashes(2, more[off * 32 : (off + 125) * 32], append=off > 0)
    assert c.store(1, 0, 10, 1, list(range(10))).stored == 10
    # Each block once, in pages of at most 3.
    seen, pos, pages = [], 0, 0
    while True:
        r = c.snapshot(pos, 3)
        pages += 1
        assert r.count <= 3 and all(isinstance(x, bytes) and len(x) == 32 for x in r.digests())
        seen += r.digests()
        if r.done:
            break
        assert r.next > pos
        pos = r.next
    assert sorted(seen) == sorted(d[i * 32 : (i + 1) * 32] for i in range(10)) and pages >= 4
    # Past the end; max 1.
    for pos in (slots, 1 << 40, (1 << 64) - 1):
        r = c.snapshot(pos)
        assert r.done and r.count == 0 and r.next == pos
    assert c.snapshot(0, 1).count == 1
    stored = [0]

    def between():  # store the next few blocks of batch 2, round and round
        start = stored[0] % 250
        k = min(1 + stored[0] % 7, 250 - start)
        c.store(2, start, k, 1, [(start + i) % 64 for i in range(k)])
        stored[0] += k

    def truth():
        out = set()
        for batch, all_ in ((1, d), (2, more)):
            for i in range(len(all_) // 32):
                if c.lookup(batch, i, 1):
                    out.add(all_[i * 32 : (i + 1) * 32])
        return out

    for rnd in range(5):
        mirror, c0, pos = set(), None, 0
        while True:
            r = c.snapshot(pos, 1 + rnd)
            if c0 is None:
                c0 = (r.epoch, r.seq)
            mirror.update(r.digests())
            if r.done:
                break
            pos = r.next
            between()
        between()  # and after the last page
        epoch, seq = c0
        while True:
            ch = c.changes(epoch, seq, 7)
            assert not ch.resync
            if ch.n_entries == 0:
                break
            for op, dg in ch.changes():
                if op == S.OP_STORED:
                    mirror.add(dg)
                elif op == S.OP_EVICTED:
                    mirror.discard(dg)
                else:
                    assert op == S.OP_CLEARED
                    mirror.clear()
            epoch, seq = ch.epoch, ch.next
        want = truth()
        assert want and mirror == want, "round %d: mirror %d blocks, Lookup %d" % (rnd, len(mirror), len(want))
    assert stored[0] > 250, "too few blocks stored between pages"
    # A scheduler may read it; a worker is refused with NOT_PERMITTED.
    assert sc.attach(role=S.ROLE_SCHEDULER).snapshot().count > 0
    w = sc.attach(role=S.ROLE_WORKER)
    with pytest.raises(RingsideError) as e:
        w.snapshot()
    assert not isinstance(e.value, (RingsideTimeout, RingsideUnavailable))
    assert status_of(e) == Status.NOT_PERMITTED
    # Refusals come in the SnapshotReply layout, with the session's width.
    for s, payload, want in ((w, S.encode_snapshot(0), Status.NOT_PERMITTED), (c, b"\x01", Status.MALFORMED)):
        rep = S.decode_snapshot_reply(s.await_reply(s.submit(S.TYPE_SNAPSHOT, payload)))
        got = (rep.status, rep.done, rep.epoch, rep.seq, rep.next, rep.width, rep.entries)
        assert got == (want, False, 0, 0, 0, 32, b"")
    # Another namespace with 8-byte digests sees nothing of it.
    o = sc.attach(model="other", digest_width=8)
    r = o.snapshot()
    assert r.done and r.count == 0 and r.width == 8
    assert c.ping(5) == 5


def test_snapshot_error_reply_shapes():
    """A refused Snapshot raises RingsideError whether the status comes in a
    SnapshotReply or in a bare common Reply (a sidecar without Snapshot
    answers UNKNOWN_TYPE that way)."""
    from ringside import client as C

    with pytest.raises(RingsideError) as e:
        C._dec_snapshot(memoryview(S.encode_reply(Status.UNKNOWN_TYPE, 0, "record type 0xd")))
    assert (e.value.status, e.value.message) == (Status.UNKNOWN_TYPE, "record type 0xd")
    with pytest.raises(RingsideError) as e:
        C._dec_snapshot(memoryview(S.encode_snapshot_reply(Status.NOT_PERMITTED, False, 0, 0, 0, 32)))
    assert (e.value.status, e.value.message) == (Status.NOT_PERMITTED, "")
    with pytest.raises(RingsideError) as e:
        C._dec_snapshot(memoryview(b"\x00" * 12))
    assert e.value.status == Status.MALFORMED
    r = C._dec_snapshot(memoryview(S.encode_snapshot_reply(0, True, 1, 2, 3, 8, bytes(range(16)))))
    assert r.done and r.digests() == [bytes(range(8)), bytes(range(8, 16))]


CHILD = r"""
import sys, time
from ringside.client import Session
s = Session.attach(sys.argv[1], instance="engine-a", model="llama", layout="bf16/16/HND")
l = s.acquire(1, 0, 4, ttl=3600)
print(l.lease, l.state, l.blocks, flush=True)
time.sleep(60)
"""


def test_dead_session_lease_reclaimed(start_sidecar):
    sc = start_sidecar(budget="16KiB", metrics=True)
    c = sc.attach()
    src = Region(1, 8)
    src.register(c)
    c.put_hashes(1, digests("dead", 8))
    assert c.store(1, 0, 8, 1, list(range(8))).stored == 8
    child = subprocess.Popen([sys.executable, "-c", CHILD, sc.sock], stdout=subprocess.PIPE, env=child_env(), text=True)
    try:
        line = child.stdout.readline().split()
        assert len(line) == 3, "child failed"
        lease, state, blocks = map(int, line)
        assert state == State.READY and blocks == 4
        st = sc.state()
        assert st["pool"]["Leases"] == 1 and len(st["sessions"]) == 2
        # The child holds the whole budget: our query waits behind it.
        mine = c.acquire(1, 4, 4, ttl=60)
        assert mine.state == State.WAITING
        child.send_signal(signal.SIGKILL)  # dies without detaching
        child.wait(5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    deadline = time.monotonic() + 5
    while c.poll(mine.lease).state != State.READY:
        assert time.monotonic() < deadline, "the dead session's budget was not reclaimed"
        time.sleep(0.005)
    deadline = time.monotonic() + 5
    while True:
        st = sc.state()
        if st["pool"]["Leases"] == 1 and len(st["sessions"]) == 1:
            break
        assert time.monotonic() < deadline, "dead session not reclaimed: %r" % st
        time.sleep(0.005)
    with pytest.raises(RingsideError) as e:
        c.poll(lease)  # the dead session's lease is gone
    assert status_of(e) == Status.UNKNOWN_LEASE
    c.release(mine.lease)
    assert sc.state()["pool"]["Leases"] == 0


def test_sidecar_killed_mid_session(sidecar):
    c = sidecar.attach(timeout=2.0)
    c.put_hashes(1, digests("k", 2))
    assert c.lookup(1, 0, 2) == 0
    sidecar.kill()
    t = time.monotonic()
    with pytest.raises((RingsideUnavailable, RingsideTimeout)):
        c.lookup(1, 0, 2)
    assert time.monotonic() - t < 2.5
    # The session is dead now: every call fails at once, close never raises.
    t = time.monotonic()
    with pytest.raises(RingsideError):
        c.ping(1)
    assert time.monotonic() - t < 2.5
    c.close()
    c.close()
    with pytest.raises(RingsideUnavailable):
        c.ping(1)


def test_sidecar_stopped_then_continued(sidecar):
    c = sidecar.attach(timeout=0.3)
    assert c.ping(1) == 1
    stop_process(sidecar.proc.pid)
    try:
        t = time.monotonic()
        with pytest.raises(RingsideTimeout):
            c.ping(2)
        assert time.monotonic() - t < 1.0
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    # The session survives a timeout; the late reply is discarded.
    assert c.ping(3) == 3
    assert c.ping(4) == 4
    assert not c._pending, "the late reply was kept"


def test_sidecar_shutdown_mid_session(sidecar):
    c = sidecar.attach(timeout=2.0)
    assert c.ping(1) == 1
    sidecar.proc.send_signal(signal.SIGTERM)
    assert sidecar.proc.wait(10) == 0
    t = time.monotonic()
    with pytest.raises((RingsideUnavailable, RingsideTimeout)):
        c.ping(2)
    assert time.monotonic() - t < 2.5
    c.close()


def test_attach_errors(sidecar, tmp_path):
    with pytest.raises(RingsideUnavailable):
        Session.attach(str(tmp_path / "nothing.sock"), instance="a", model="m", layout="l", timeout=1)
    # Refused by the sidecar: the status and message come back.
    with pytest.raises(RingsideError) as e:
        sidecar.attach(ring_capacity=12345)
    assert e.value.status == Status.TOO_LARGE and "ring capacity" in e.value.message
    with pytest.raises(S.SchemaError):
        sidecar.attach(instance="")
    with pytest.raises(S.SchemaError):
        sidecar.attach(rank=2, world_size=2)
    # A good attach with a narrower digest width and context-manager use.
    with Session.attach(sidecar.sock, instance="w8", model="m", layout="l", digest_width=8) as s:
        assert s.info.session > 0 and s.info.slot_bytes == SLOT
        assert s.put_hashes(1, b"\x01" * 8 * 3) == 3
        assert s.lookup(1, 0, 3) == 0
    assert s.closed
