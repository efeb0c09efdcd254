"""Session.retain (docs/protocol.md section 5.14) against a real sidecar:
counts, END, fire and forget, bad arguments, and a sidecar that predates
Retain (status UNKNOWN_TYPE), which turns the hint off without raising.
Eviction order and quotas are covered by the scenarios (retain*.txt)."""

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
    sc = start_sidecar(pool="256KiB")  # 64 slots: a uid may retain 32
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
