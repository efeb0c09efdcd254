import os
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
from conftest import child_env

from ringside import _xproc
from ringside import ring as R

CAP = 4096


def mem_ring(capacity=CAP, max_record=0, epoch=7):
    mem = bytearray(R.HEADER_SIZE + capacity)
    return mem, R.Ring.format(mem, capacity, max_record, epoch)


def pl(seq, n):
    return _xproc.payload_for(seq, n)


def set_pos(mem, tail=None, head=None):
    if tail is not None:
        struct.pack_into("<Q", mem, R.OFF_TAIL, tail)
    if head is not None:
        struct.pack_into("<Q", mem, R.OFF_HEAD, head)


def put_rec(mem, off, length, typ, flags=0, seq=0):
    struct.pack_into("<IHHQ", mem, R.HEADER_SIZE + off, length, typ, flags, seq)


# --- basic behaviour -------------------------------------------------------


def test_round_trip():
    mem, r = mem_ring()
    p, c = r.producer(), r.consumer()
    assert c.next() is None
    p.append(b"hello", typ=3, flags=0x8001, seq=42)
    assert c.next() is None, "not visible before publish"
    p.publish()
    rec = c.next()
    assert (rec.type, rec.flags, rec.seq, bytes(rec.payload)) == (3, 0x8001, 42, b"hello")
    assert rec.payload.readonly
    del rec
    c.commit()
    assert r.positions() == (24, 24)
    # claim fills in place; memoryview / bytearray / array payloads
    buf = p.claim(4, seq=1)
    buf[:] = b"abcd"
    import array

    p.append(array.array("Q", [1, 2]), seq=2)
    p.append(bytearray(b"xy"), seq=3)
    p.append(b"", seq=4)
    p.publish()
    got = [c.read() for _ in range(4)]
    assert [(g.seq, g.payload) for g in got] == [(1, b"abcd"), (2, struct.pack("<QQ", 1, 2)), (3, b"xy"), (4, b"")]
    assert c.read() is None
    r.close()


def test_wrap_around_many():
    mem, r = mem_ring()
    p, c = r.producer(), r.consumer()
    sizes = [(i * 37) % 301 for i in range(3000)]
    i_out = 0
    for i, n in enumerate(sizes):
        while True:
            try:
                p.append(pl(i, n), seq=i)
                break
            except R.RingFull:
                p.publish()
                while (rec := c.next()) is not None:
                    assert rec.seq == i_out and rec.payload == pl(i_out, sizes[i_out])
                    i_out += 1
                    del rec
                c.commit()
    p.publish()
    while (rec := c.read()) is not None:
        assert rec.seq == i_out and rec.payload == pl(i_out, sizes[i_out])
        i_out += 1
    assert i_out == len(sizes)
    tail, head = r.positions()
    assert tail == head and tail > 40 * CAP  # wrapped many times


def test_pad_and_gap():
    mem, r = mem_ring()
    p, c = r.producer(), r.consumer()
    # Fill to offset 3120, consume, then a 1016-byte record must pad 976 bytes.
    p.append(pl(99, 56), seq=99)
    for s in range(3):
        p.append(pl(s, 1000), seq=s)
    p.publish()
    for _ in range(4):
        c.read()
    p.append(pl(3, 1000), seq=3)
    p.publish()
    assert struct.unpack_from("<IHHQ", mem, R.HEADER_SIZE + 3120) == (976 - 16, R.TYPE_PAD, 0, 0)
    assert struct.unpack_from("<IHHQ", mem, R.HEADER_SIZE + 0) == (1000, 1, 0, 3)
    assert r.positions()[0] == 4096 + 1016
    rec = c.read()
    assert rec.seq == 3 and rec.payload == pl(3, 1000)
    # Now to offset 4088: 3*1016 + 24, then an 8-byte gap is skipped.
    for s in range(4, 7):
        p.append(pl(s, 1000), seq=s)
    p.append(pl(7, 8), seq=7)
    p.publish()
    for s in range(4, 8):
        assert c.read().seq == s
    before = bytes(mem[R.HEADER_SIZE + 4088 :])
    p.append(pl(8, 1), seq=8)
    p.publish()
    assert bytes(mem[R.HEADER_SIZE + 4088 :]) == before, "gap bytes are not written"
    assert r.positions()[0] == 2 * 4096 + 24
    rec = c.read()
    assert rec.seq == 8 and rec.payload == pl(8, 1)
    assert r.positions() == (2 * 4096 + 24,) * 2


def test_batching_one_publish():
    mem, r = mem_ring()
    p, c = r.producer(), r.consumer()
    for s in range(10):
        p.append(pl(s, s * 3), seq=s)
    assert p.pending == sum(R.record_size(s * 3) for s in range(10))
    assert r.positions() == (0, 0) and c.next() is None
    p.publish()
    assert p.pending == 0
    recs = [c.next() for _ in range(10)]
    assert [x.seq for x in recs] == list(range(10))
    assert r.positions()[1] == 0, "head moves only at commit"
    assert all(x.payload == pl(x.seq, x.seq * 3) for x in recs)
    del recs
    c.commit()
    assert r.positions()[1] == r.positions()[0]


def test_full_ring_and_timeout():
    mem, r = mem_ring()
    p, c = r.producer(), r.consumer()
    n = 0
    with pytest.raises(R.RingFull):
        while True:
            p.append(pl(n, 1000), seq=n)
            n += 1
    assert n == 4  # 4 * 1016 = 4064; a fifth needs 1016 more
    t0 = time.monotonic()
    with pytest.raises(R.RingTimeout):
        p.write(pl(9, 1000), seq=9, timeout=0.05)
    assert time.monotonic() - t0 < 2
    c.read()
    p.write(pl(9, 1000), seq=9, timeout=1)


def test_too_large_and_bad_type():
    mem, r = mem_ring()
    p = r.producer()
    assert r.max_record == 1024 and r.max_payload == 1008
    p.append(bytes(1008))
    with pytest.raises(R.RingTooLarge):
        p.append(bytes(1009))
    with pytest.raises(R.RingTooLarge):
        p.claim(1 << 20)
    for t in (0, R.TYPE_PAD, 0x10000, -1):
        with pytest.raises(R.RingBadType):
            p.append(b"x", typ=t)
    with pytest.raises(R.RingBadType):
        p.append(b"x", flags=0x10000)
    with pytest.raises(R.RingBadType):
        p.append(b"x", seq=1 << 64)


def test_peer_closed_drains_first():
    mem, r = mem_ring()
    p, c = r.producer(), r.consumer()
    p.append(b"last")
    p.close()
    c.wait(timeout=1)
    assert c.read().payload == b"last"
    with pytest.raises(R.RingPeerClosed):
        c.wait(timeout=1)


def test_park_and_wake_across_threads():
    mem, r = mem_ring()
    c = r.consumer(R.PARK_WAIT)
    p = r.producer()
    got = []

    def consume():
        for _ in range(50):
            got.append(c.recv(timeout=5))

    th = threading.Thread(target=consume)
    th.start()
    for s in range(50):
        time.sleep(0.001)
        p.write(pl(s, s), seq=s, timeout=5)
    th.join(10)
    assert [g.seq for g in got] == list(range(50))
    assert c.parks > 0


# --- header validation -------------------------------------------------------


def _hdr(**kw):
    h = R.Header(R.MAGIC, 1, 4096, CAP, 8, 1024, 1, 0, 0, 0, 0, 0)
    return h._replace(**kw)


@pytest.mark.parametrize(
    "fields,size,msg",
    [
        (dict(magic=0), None, "magic 0x0"),
        (dict(magic=0x3130474952535352), None, "not a ring"),
        (dict(version=2), None, "layout version 2"),
        (dict(header_size=8192), None, "header size 8192"),
        (dict(align=16), None, "record alignment 16"),
        (dict(capacity=3000), 4096 + 3000, "capacity 3000 is not a power of two"),
        (dict(capacity=2048), 4096 + 2048, "capacity 2048"),
        (dict(capacity=1 << 31), -1, "capacity 2147483648"),
        (dict(max_record=16), None, "max record 16"),
        (dict(max_record=4096), None, "max record 4096"),
        (dict(max_record=1020), None, "unaligned"),
        ({}, 4096 + 8192, "file is 12288 bytes, header says 8192"),
    ],
)
def test_bad_header(fields, size, msg):
    h = _hdr(**fields)
    size = 4096 + CAP if size is None else size
    b = bytearray(max(size, 4096))
    R.encode_header(b, h)
    with pytest.raises(R.RingBadHeader, match=msg):
        R.decode_header(b, size)
    if size == len(b) and size >= 8192:
        with pytest.raises(R.RingBadHeader):
            R.Ring(b)


def test_bad_header_short_buffer():
    with pytest.raises(R.RingBadHeader, match="want at least 4096"):
        R.decode_header(bytes(100))


def test_open_validates(shm_path):
    path = shm_path()
    r = R.create(path, CAP, epoch=99)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        R.create(path, CAP)
    with pytest.raises(R.RingBadHeader, match="stale ring"):
        R.open_ring(path, epoch=100)
    R.open_ring(path, epoch=99).close()
    r.close()
    # Truncate the file: size no longer matches the header.
    os.truncate(path, 4096 + 2 * CAP)
    with pytest.raises(R.RingBadHeader, match="header says"):
        R.open_ring(path)
    os.truncate(path, 100)
    with pytest.raises(R.RingBadHeader, match="size 100"):
        R.open_ring(path)
    # Not initialised yet (magic written last): refused.
    other = shm_path()
    with open(other, "wb") as f:
        f.write(bytes(4096 + CAP))
    with pytest.raises(R.RingBadHeader, match="not initialised"):
        R.open_ring(other)


def test_symlink_refused(shm_path):
    real = shm_path("real")
    link = shm_path("link")
    R.create(real, CAP).close()
    os.symlink(real, link)
    with pytest.raises(R.RingError, match="symbolic link"):
        R.open_ring(link)
    with pytest.raises(FileExistsError):
        R.create(link, CAP)
    os.unlink(link)
    os.symlink(real + "-missing", link)  # dangling: O_EXCL still refuses it
    with pytest.raises(FileExistsError):
        R.create(link, CAP)
    assert not os.path.exists(real + "-missing")


# --- corrupt positions and records ---------------------------------------------


def _c_tail_behind(mem, r):
    set_pos(mem, tail=64, head=64)
    c = r.consumer()
    set_pos(mem, tail=32)
    return c.next


def _c_tail_past_capacity(mem, r):
    c = r.consumer()
    set_pos(mem, tail=CAP + 8)
    return c.next


def _c_tail_unaligned(mem, r):
    c = r.consumer()
    set_pos(mem, tail=20)
    return c.next


def _c_len_past_published(mem, r):
    c = r.consumer()
    put_rec(mem, 0, 100, 1)
    set_pos(mem, tail=32)
    return c.next


def _c_len_past_max(mem, r):
    c = r.consumer()
    put_rec(mem, 0, 2000, 1)
    set_pos(mem, tail=2048)
    return c.next


def _c_len_huge(mem, r):
    c = r.consumer()
    put_rec(mem, 0, 0xFFFFFFFF, 1)
    set_pos(mem, tail=CAP)
    return c.next


def _c_type_zero(mem, r):
    c = r.consumer()
    put_rec(mem, 0, 0, 0)
    set_pos(mem, tail=16)
    return c.next


def _c_pad_short(mem, r):
    c = r.consumer()
    put_rec(mem, 0, 16, R.TYPE_PAD)
    set_pos(mem, tail=64)
    return c.next


def _c_pad_past_end(mem, r):
    set_pos(mem, tail=CAP - 64, head=CAP - 64)
    c = r.consumer()
    put_rec(mem, CAP - 64, 200, R.TYPE_PAD)
    set_pos(mem, tail=CAP + 64)
    return c.next


def _c_less_than_header(mem, r):
    c = r.consumer()
    set_pos(mem, tail=8)
    return c.next


def _c_open_bad_positions(mem, r):
    set_pos(mem, tail=8, head=16)
    return r.consumer


def _c_open_unaligned_head(mem, r):
    set_pos(mem, tail=12, head=4)
    return r.producer


def _p_head_past_published(mem, r):
    p = r.producer()
    for _ in range(4):
        p.append(bytes(1000))
    p.publish()
    set_pos(mem, head=CAP * 4)
    return lambda: p.append(bytes(1000))


def _p_head_backwards(mem, r):
    set_pos(mem, tail=1024, head=1024)
    p = r.producer()
    for _ in range(4):
        p.append(bytes(1000))
    set_pos(mem, head=0)
    return lambda: p.append(bytes(1000))


@pytest.mark.parametrize(
    "setup,msg",
    [
        (_c_tail_behind, "producer tail 32"),
        (_c_tail_past_capacity, "producer tail 4104"),
        (_c_tail_unaligned, "producer tail 20"),
        (_c_len_past_published, "runs past the 32 published bytes"),
        (_c_len_past_max, "exceeds the maximum 1024"),
        (_c_len_huge, "exceeds the maximum"),
        (_c_type_zero, "record type 0"),
        (_c_pad_short, "does not reach the end"),
        (_c_pad_past_end, "runs past the 64 published bytes"),
        (_c_less_than_header, "less than a record header"),
        (_c_open_bad_positions, "positions tail=8 head=16"),
        (_c_open_unaligned_head, "positions tail=12 head=4"),
        (_p_head_past_published, "consumer head 16384 outside"),
        (_p_head_backwards, "consumer head 0 outside"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_corrupt(setup, msg):
    mem, r = mem_ring()
    fn = setup(mem, r)
    with pytest.raises(R.RingCorrupt, match=msg):
        fn()


def test_corrupt_random_never_crashes():
    """Random garbage in the data area and positions: only RingCorrupt (or
    plausible records), never IndexError / struct.error / OverflowError."""
    import random

    rnd = random.Random(1)
    for _ in range(2000):
        mem, r = mem_ring()
        head = rnd.randrange(0, 4 * CAP, 8)
        set_pos(mem, tail=head, head=head)
        c = r.consumer()
        mem[R.HEADER_SIZE :] = rnd.randbytes(CAP)
        if rnd.random() < 0.5:  # small plausible headers
            for off in range(0, CAP, 16):
                hdr = (rnd.randrange(0, 1200), rnd.choice([0, 1, 0xFFFF]), 0)
                struct.pack_into("<IHH", mem, R.HEADER_SIZE + off, *hdr)
        set_pos(mem, tail=head + rnd.choice([rnd.randrange(0, CAP + 64), rnd.randrange(0, CAP, 8)]))
        try:
            for _ in range(100):
                if c.next() is None:
                    break
        except R.RingCorrupt:
            pass


# --- processes --------------------------------------------------------------


def test_dead_producer(shm_path):
    path = shm_path()
    r = R.create(path, 16384)
    c = r.consumer(R.PARK_WAIT)
    child = subprocess.Popen(
        [sys.executable, "-m", "ringside._xproc", "produce-forever", path, "--interval-ms", "2"],
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    try:
        assert child.stdout.readline().strip() == b"ready"
        got = 0
        while got < 20:
            c.wait(timeout=5)
            while c.read() is not None:
                got += 1
        assert r.producer_alive()
        child.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        child.wait(5)
        with pytest.raises(R.RingPeerDead):
            while True:
                c.wait(timeout=5)
                while c.read() is not None:
                    pass
        assert time.monotonic() - t_kill < 1.0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        r.close()


def test_dead_consumer(shm_path):
    path = shm_path()
    r = R.create(path, CAP)
    code = (
        "import sys, time; from ringside import ring as R; r = R.open_ring(sys.argv[1]); "
        "c = r.consumer(); print('ready', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, env=child_env())
    try:
        assert child.stdout.readline().strip() == b"ready"
        p = r.producer()
        for s in range(4):
            p.write(bytes(1000), seq=s, timeout=1)
        child.kill()
        child.wait(5)
        t0 = time.monotonic()
        with pytest.raises(R.RingPeerDead):
            p.write(bytes(1000), timeout=5)
        assert time.monotonic() - t0 < 1.0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        r.close()


def test_cross_process_checksums(shm_path):
    """Python producer process -> Python consumer process, wrapping many times."""
    import json

    path = shm_path()
    r = R.create(path, 16384)
    n = 3000
    cons = subprocess.Popen(
        [sys.executable, "-m", "ringside._xproc", "consume", path, str(n), "--epoch", hex(r.epoch)],
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    prod = subprocess.Popen(
        [sys.executable, "-m", "ringside._xproc", "produce", path, str(n)], stdout=subprocess.PIPE, env=child_env()
    )
    out_p, _ = prod.communicate(timeout=60)
    out_c, _ = cons.communicate(timeout=60)
    assert prod.returncode == 0 and cons.returncode == 0
    jp, jc = json.loads(out_p), json.loads(out_c)
    assert jp == jc and jc["n"] == n and jc["bytes"] > 20 * 16384
    r.close()
