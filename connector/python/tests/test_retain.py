"""Session.retain (docs/protocol.md section 5.14) against a real sidecar:
counts, END, fire and forget, bad arguments, owners, the retain share
apart from the pin share, and a sidecar that predates Retain (status
UNKNOWN_TYPE), which turns the hint off without raising. Eviction order is
covered by the scenarios (retain*.txt)."""

import pytest
from test_client import Region, digests

import ringside.client as C
from ringside import schema as S
from ringside.client import RingsideError
from ringside.schema import Status


def _stored(sc, n):
    c = sc.attach()
    reg = Region(1, n)
    reg.register(c)
    c.put_hashes(1, digests("retain", n))
    assert c.store(1, 0, n, 1, list(range(n))).stored == n
    return c


def test_retain_counts_and_end(start_sidecar):
    sc = start_sidecar(pool="256KiB")  # 64 slots: a uid may retain 16
    c = _stored(sc, 8)
    assert c.retain(1, 0, 8, 60_000, priority=3) == 8
    assert c.retain(1, 0, 8, 60_000, priority=1) == 8  # renewed
    assert c.retain(1, 2, 3, 0, end=True) == 3
    assert c.retain(1, 0, 8, 0, end=True) == 5
    assert c.retain(1, 0, 8, 0, end=True) == 0
    # Fire and forget: None, and no failure.
    assert c.retain(1, 0, 4, 1000, wait=False) is None
    c.ping(1)
    assert c.quiet_failures == 0
    assert c.retain(1, 0, 4, 0, end=True) == 4
    # A failure of a fire-and-forget retain is counted (batch 9 is unknown).
    assert c.retain(9, 0, 1, 1000, wait=False) is None
    c.ping(1)
    assert c.quiet_failures == 1 and c.last_quiet_failure[0] == Status.UNKNOWN_BATCH
    assert c.retain_supported


def test_retain_refusals(start_sidecar):
    sc = start_sidecar(pool="256KiB")
    c = _stored(sc, 2)
    with pytest.raises(RingsideError) as e:
        c.retain(1, 0, 2, 2 * 3600 * 1000)  # past --retain.max-ttl (1 h)
    assert e.value.status == Status.TOO_LARGE
    with pytest.raises(RingsideError) as e:
        c.retain(1, 1, 2, 1000)
    assert e.value.status == Status.OUT_OF_RANGE
    for kw in ({"priority": 4}, {"priority": -1}, {"ttl_ms": 0}):
        args = {"ttl_ms": 1000, **kw}
        with pytest.raises(ValueError):
            c.retain(1, 0, 2, **args)
    assert c.retain_supported and c.retain(1, 0, 2, 1000) == 2


def test_retain_owner(start_sidecar, monkeypatch):
    """A retention belongs to its uid and owner: another owner (0 included)
    can neither end, renew nor re-prioritise it, and its Retain goes on past
    those blocks; the owner ends its own. Owner 0 travels in the 24-byte
    form, any other owner in the 32-byte one."""
    sc = start_sidecar(pool="256KiB")
    c = _stored(sc, 8)
    a, b = 0xA11CE5E55104, (1 << 64) - 1
    assert c.retain(1, 0, 4, 60_000, 3, owner=a) == 4
    assert c.retain(1, 0, 4, 0, end=True, owner=b) == 0
    assert c.retain(1, 0, 4, 0, end=True) == 0  # owner 0 is someone else too
    assert c.retain(1, 0, 4, 1000, 0, owner=b) == 0  # neither renewed nor lowered
    assert c.retain(1, 0, 8, 1000, 0, owner=b) == 4  # past a's blocks: 4..7
    assert c.retain(1, 0, 8, 1000, 1) == 0  # all taken
    assert c.retain(1, 0, 4, 60_000, 2, owner=a) == 4  # a re-prioritises its own
    # The positional call of the vLLM connector, with and without an owner.
    assert c.retain(1, 0, 8, 60_000, 2, False, wait=False, owner=a) is None
    c.ping(1)
    assert c.quiet_failures == 0
    assert c.retain(1, 0, 8, 0, 0, True, wait=False) is None
    c.ping(1)
    assert c.quiet_failures == 0
    assert c.retain(1, 0, 8, 0, end=True, owner=b) == 4
    assert c.retain(1, 0, 8, 0, end=True, owner=a) == 4
    # What goes on the wire.
    sent = []
    monkeypatch.setattr(c, "send", lambda typ, p: sent.append((typ, bytes(p))))
    c.retain(1, 0, 8, 1000, 1, wait=False)
    c.retain(1, 0, 8, 1000, 1, wait=False, owner=a)
    c.retain(1, 0, 8, 0, end=True, wait=False, owner=a)
    assert [len(p) for _, p in sent] == [S.RETAIN_NO_OWNER_SIZE, S.RETAIN_SIZE, S.RETAIN_SIZE]
    assert [S.decode_retain(p).owner for _, p in sent] == [0, a, a]
    assert S.decode_retain(sent[2][1]).flags == S.RETAIN_FLAG_END
    monkeypatch.undo()
    # An owner outside the u64 range is refused before anything is sent.
    seq = c._seq
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError):
            c.retain(1, 0, 8, 1000, owner=bad)
    assert c._seq == seq
    with pytest.raises(TypeError):
        c.retain(1, 0, 8, 1000, 0, False, True, a)  # owner is keyword-only


def test_retain_share(start_sidecar):
    """The blocks a uid retains take at most --limits.retain-share of the
    pool (a quarter of 64 slots: 16), apart from what its leases pin
    (--limits.pin-share, half: 32): a uid at its retain share still gets
    leases of its whole pin share, and one past it is refused TOO_LARGE."""
    sc = start_sidecar(pool="256KiB")
    c = _stored(sc, 48)
    assert c.retain(1, 0, 32, 3_600_000, 3, owner=7) == 16
    with pytest.raises(RingsideError) as e:
        c.retain(1, 16, 4, 60_000, owner=8)
    assert e.value.status == Status.TOO_LARGE and "--limits.retain-share" in str(e.value)
    r = c.acquire(1, 16, 32)
    assert r.blocks == 32
    c.release(r.lease)
    assert c.retain(1, 0, 16, 0, end=True, owner=7) == 16
    assert c.retain(1, 16, 16, 60_000, owner=8) == 16


def test_retain_old_sidecar(start_sidecar, monkeypatch):
    """A sidecar that does not know the type answers status 2: retain()
    returns None, turns itself off for the session and sends nothing more."""
    sc = start_sidecar(pool="256KiB")
    c = _stored(sc, 2)
    unknown = 0x7E  # a type no sidecar knows stands in for an old sidecar's view of 0x11
    monkeypatch.setattr(S, "TYPE_RETAIN", unknown)
    monkeypatch.setattr(C, "_RETAIN_REPLY", unknown | S.REPLY_BIT)
    assert c.retain(1, 0, 2, 1000) is None
    assert not c.retain_supported
    sent = c._seq
    assert c.retain(1, 0, 2, 1000) is None and c.retain(1, 0, 2, 0, end=True) is None
    assert c._seq == sent  # nothing sent
    # Fire and forget: the status-2 reply turns it off too, and is no failure.
    c2 = sc.attach()
    assert c2.retain(1, 0, 2, 1000, wait=False) is None
    c2.ping(1)
    assert not c2.retain_supported and c2.quiet_failures == 0
    c2.close()
    c.close()
