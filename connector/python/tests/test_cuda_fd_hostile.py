"""Hostile descriptors against a real sidecar (``ringside serve
--copy.backend=cuda`` on the stand-in driver): a descriptor that is not a
CUDA allocation (a memfd, a socket, /dev/zero), a thousand descriptors,
descriptors without the message that names them, a message naming
descriptors it did not send, and a sender that is not the session's
process. Each gets a refusal whose status and message name the cause; the
sidecar closes every descriptor it received (its /proc/PID/fd count comes
back to where it was), and a bystander session, with GPU memory registered
by descriptor, stores and loads byte-exact before and after each one.
"""

import os
import socket
import struct
import subprocess
import sys
import time

import pytest
from conftest import child_env
from test_cuda_fd import VmmKV, digests
from test_cuda_region import Sim, libcuda  # noqa: F401 - libcuda: a fixture
from test_cuda_vmm import Vmm

from ringside import schema as S
from ringside.plugin.region import from_block_tensors

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def sim(libcuda, monkeypatch):  # noqa: F811 - the fixture of the same name
    monkeypatch.delenv("FAKECUDA_IMEX", raising=False)
    s = Sim(libcuda)
    s.vmm = Vmm(libcuda)
    s.kvs = []
    yield s
    for kv in s.kvs:
        kv.close()
    s.close()


def kv_of(sim, layers=4, blocks=16):
    kv = VmmKV(sim.vmm, layers, blocks)
    sim.kvs.append(kv)
    kv.commit(blocks)
    return kv


@pytest.fixture
def cuda_sidecar(start_sidecar, libcuda, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    return start_sidecar(pool="4MiB", slot="64KiB", args=["--copy.backend=cuda"])


def fds_of(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def steady(pid):
    """The descriptor count of pid once it stopped moving (a connection the
    sidecar answered is closed a moment after the answer)."""
    prev = None
    while True:
        n = fds_of(pid)
        if n == prev:
            return n
        prev = n
        time.sleep(0.2)


def settle(pid, want, what):
    """Wait (bounded) for pid to hold want descriptors."""
    deadline = time.monotonic() + 5
    while fds_of(pid) != want:
        assert time.monotonic() < deadline, "%s: the sidecar holds %d descriptors, %d before" % (
            what,
            fds_of(pid),
            want,
        )
        time.sleep(0.005)


def exchange(path, data, fds=(), more=()):
    """One connection to the attach socket: data with fds (SCM_RIGHTS),
    then each (data, fds) of more on the same connection; the answer."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        c.settimeout(10)
        c.connect(path)
        socket.send_fds(c, [data], list(fds))
        for d, f in more:
            socket.send_fds(c, [d], list(f))
        return c.recv(65536)
    finally:
        c.close()


def refusal(b):
    """(magic, status, message) of an answer: a RegionDescriptorsReply, or an
    AttachReply (a message that was no RegionDescriptors)."""
    magic = struct.unpack_from("<I", b)[0]
    if magic == S.ATTACH_REPLY_MAGIC:
        r = S.decode_attach_reply(b)
        return "attach", r.status, r.message
    r = S.decode_region_descriptors_reply(b)
    return "descriptors", r.status, r.message


class Bystander:
    """A session in the same sidecar with GPU memory registered by
    descriptor: check() stores and loads byte-exact through it."""

    def __init__(self, sc, sim):
        self.src, self.dst = kv_of(sim), kv_of(sim)
        self.s = sc.attach(instance="bystander", timeout=10.0)
        self.rs = [from_block_tensors(kv.tensors(), drv=sim.drv) for kv in (self.src, self.dst)]
        self.rs[0].register(self.s, 1)
        self.rs[1].register(self.s, 2)
        self.stream = sim.stream()
        self.n = 0

    def check(self):
        self.n += 1
        self.src.fill(self.n)
        batch = 100 + self.n
        assert self.s.put_hashes(batch, digests(self.n, 16)) == 16
        self.rs[0].event.record(self.stream)
        rep = self.s.store(batch, 0, 16, 1, list(range(16)))
        assert rep.status == 0 and rep.stored == 16, rep
        lease = self.s.acquire(batch, 0, 16)
        into = list(reversed(range(16)))
        assert self.s.load(lease.lease, 2, 0, into) == 16
        self.s.release(lease.lease)
        for i in range(self.src.layers):
            for j in range(16):
                assert self.dst.page(i, into[j]) == self.src.page(i, j)


def region_message(sim, s, kv, region_id=1, session=None, epoch=None, allocations=None):
    """A RegionDescriptors for kv in session s, and the exported
    descriptors it names (the caller closes them)."""
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    exp = r.exporter.export()
    payload = S.encode_register_region(
        region_id, S.REGION_CUDA_FD, os.getpid(), r.base, r.length, r.page_size, r.page_count, r.segments, r.extra
    )
    msg = S.encode_region_descriptors(
        S.VERSION, s.info.session if session is None else session, s.info.epoch if epoch is None else epoch, payload
    )
    return msg, exp


@pytest.fixture
def arena(cuda_sidecar, sim):
    """(sidecar, sim, bystander, a hostile session, the sidecar's descriptor
    count at rest)."""
    by = Bystander(cuda_sidecar, sim)
    by.check()
    hostile = cuda_sidecar.attach(instance="hostile", timeout=10.0)
    pid = cuda_sidecar.proc.pid
    yield cuda_sidecar, sim, by, hostile, steady(pid)
    by.check()
    hostile.close()
    by.s.close()


def after(arena, what):
    sc, _, by, _, rest = arena
    settle(sc.proc.pid, rest, what)
    by.check()


def memfd(n=2 << 20):
    fd = os.memfd_create("not-cuda")
    os.ftruncate(fd, n)
    return fd


@pytest.mark.parametrize("what", ["memfd", "socket", "/dev/zero"])
def test_a_descriptor_that_is_no_cuda_allocation(arena, what):
    sc, sim, by, hostile, rest = arena
    kv = kv_of(sim)
    msg, exp = region_message(sim, hostile, kv)
    try:
        fds = list(exp.fds)
        if what == "memfd":
            bad = memfd()
        elif what == "socket":
            bad, other = socket.socketpair()
            bad = bad.detach()
            other.close()
        else:
            bad = os.open("/dev/zero", os.O_RDWR)
        fds[2] = bad
        kind, st, message = refusal(exchange(sc.sock, msg, fds))
        os.close(bad)
    finally:
        exp.close()
    assert kind == "descriptors" and st == S.Status.NOT_PERMITTED, (kind, st, message)
    if what == "socket":
        assert "descriptor 2 is a socket" in message, message
    else:  # the driver refuses it
        assert "cuMemImportFromShareableHandle" in message and "not a CUDA allocation" in message, message
    after(arena, what)
    # The session that sent it goes on, and registers the real thing.
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    r.register(hostile, 1)
    assert hostile.ping(3) == 3


def test_a_thousand_descriptors(arena):
    sc, sim, by, hostile, rest = arena
    kv = kv_of(sim, layers=1)
    msg, exp = region_message(sim, hostile, kv)
    pool = [memfd(4096) for _ in range(1000)]
    try:
        # The kernel passes at most 253 (SCM_MAX_FD) in one message.
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.connect(sc.sock)
        with pytest.raises(OSError):
            socket.send_fds(c, [msg], pool)
        c.close()
        # A thousand, 250 at a time, each with a message that names 1.
        for i in range(0, 1000, 250):
            kind, st, message = refusal(exchange(sc.sock, msg, pool[i : i + 250]))
            assert kind == "descriptors" and st == S.Status.MALFORMED, (kind, st, message)
            assert "names 1 descriptors and carries 250" in message, message
        after(arena, "a thousand descriptors")
        # As many as one message may carry, no message naming them.
        kind, st, message = refusal(exchange(sc.sock, b"\x00" * 64, pool[:253]))
        assert kind == "attach" and st == S.Status.MALFORMED and "carries 253 descriptors" in message, message
        after(arena, "253 descriptors")
        # 750 more queued behind a message on its connection: the sidecar
        # reads the first, and drains and closes the others (a client that
        # keeps sending may lose the answer to a reset; the descriptors are
        # closed either way).
        try:
            b = exchange(sc.sock, msg, pool[:250], more=[(b"x", pool[i : i + 250]) for i in range(250, 1000, 250)])
            assert refusal(b)[1] == S.Status.MALFORMED
        except (ConnectionResetError, BrokenPipeError):
            pass
        after(arena, "descriptors queued behind a message")
    finally:
        for fd in pool:
            os.close(fd)
        exp.close()


def test_descriptors_without_the_message_that_names_them(arena):
    sc, sim, by, hostile, rest = arena
    kv = kv_of(sim)
    _, exp = region_message(sim, hostile, kv)
    try:
        # Real CUDA descriptors, with an empty message, with garbage, and
        # with an attach request.
        for data in (b"\x00", os.urandom(200), S.encode_attach_request(instance="i", model="m", layout="l")):
            kind, st, message = refusal(exchange(sc.sock, data, exp.fds))
            assert kind == "attach" and st == S.Status.MALFORMED and "carries 4 descriptors" in message, message
            after(arena, "descriptors without a message")
        # A RegionDescriptors whose body is cut short of its region.
        head = S.encode_region_descriptors(S.VERSION, hostile.info.session, hostile.info.epoch, b"")
        kind, st, message = refusal(exchange(sc.sock, head, exp.fds))
        assert kind == "descriptors" and st == S.Status.MALFORMED and "4 descriptors closed" in message, message
        after(arena, "a message without its region")
        # On a session's own attach socket, after the handshake: the
        # session ends (the protocol's rule for anything written there),
        # and the kernel drops the descriptors with the message.
        doomed = sc.attach(instance="doomed", timeout=2.0)
        socket.send_fds(doomed._sock, [b"fds"], exp.fds)
        deadline = time.monotonic() + 5
        while True:
            try:
                doomed.ping(1)
            except S.RingsideError:
                break
            assert time.monotonic() < deadline, "the session survived a write on its attach socket"
            time.sleep(0.01)
        doomed.close()
        after(arena, "descriptors on a session's socket")
    finally:
        exp.close()


def test_a_message_naming_descriptors_it_did_not_send(arena):
    sc, sim, by, hostile, rest = arena
    kv = kv_of(sim)
    msg, exp = region_message(sim, hostile, kv)
    try:
        for fds in ([], exp.fds[:2]):
            kind, st, message = refusal(exchange(sc.sock, msg, fds))
            assert kind == "descriptors" and st == S.Status.MALFORMED, (kind, st, message)
            assert "names 4 descriptors and carries %d" % len(fds) in message, message
            after(arena, "%d of 4 descriptors" % len(fds))
        # Every descriptor sent, but the extra names one twice.
        x = S.decode_fd_extra(S.decode_region_descriptors(msg).region.extra)
        raw = bytearray(msg)
        off = len(msg) - len(x.allocations) * S.FD_ALLOCATION_SIZE
        struct.pack_into("<I", raw, off + S.FD_ALLOCATION_SIZE, x.allocations[0].index)
        kind, st, message = refusal(exchange(sc.sock, bytes(raw), exp.fds))
        assert kind == "descriptors" and st == S.Status.MALFORMED and "named twice" in message, message
        after(arena, "an index named twice")
    finally:
        exp.close()


SPOOF = r"""
import socket, sys
sys.path[:0] = sys.argv[1:2]
from ringside import schema as S
path, hexmsg = sys.argv[2:4]
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(path)
f = open("/dev/null", "rb")
socket.send_fds(c, [bytes.fromhex(hexmsg)], [f.fileno()] * 4)
r = S.decode_region_descriptors_reply(c.recv(65536))
print(r.status, r.message)
"""


def test_only_the_sessions_process_may_register(arena):
    sc, sim, by, hostile, rest = arena
    kv = kv_of(sim)
    msg, exp = region_message(sim, by.s, kv, region_id=9)  # into the bystander's session
    exp.close()
    # From another process.
    r = subprocess.run(
        [sys.executable, "-c", SPOOF, TESTS, sc.sock, msg.hex()],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    st, _, message = r.stdout.strip().partition(" ")
    assert int(st) == S.Status.NOT_PERMITTED and "only the process that attached session" in message, r.stdout
    after(arena, "another process")
    # Another run of the sidecar, and a session that does not exist.
    for session, epoch, text in (
        (None, hostile.info.epoch ^ 1, "is not this sidecar's"),
        (1 << 40, None, "is not attached"),
    ):
        msg, exp = region_message(sim, hostile, kv, session=session, epoch=epoch)
        try:
            kind, st, message = refusal(exchange(sc.sock, msg, exp.fds))
        finally:
            exp.close()
        assert kind == "descriptors" and st == S.Status.NOT_PERMITTED and text in message, message
        after(arena, text)
