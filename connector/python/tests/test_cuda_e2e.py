"""GPU KV caches through a real sidecar running its CUDA copy backend
(--copy.backend=cuda) on the stand-in driver (gpu/gputest/testdata/fakecuda.c,
found through LD_LIBRARY_PATH): the regions are what from_block_tensors
makes of simulator memory (test_cuda_region.py), registered, stored and
loaded with the client as the vLLM worker does it, and the bytes compared;
and an engine process SIGKILLed while its copies wait in the sidecar.
"""

import ctypes
import os
import struct
import subprocess
import sys
import time

import pytest
from conftest import child_env
from test_cuda_region import BLOCK, BS, D, H, Sim, T, libcuda  # noqa: F401 - libcuda: a fixture

from ringside import schema as S
from ringside.plugin.region import from_block_tensors

NB = 8
LAYERS = 32
PAGE = LAYERS * 2 * BLOCK  # 8 KiB
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def sim(libcuda):  # noqa: F811 - the fixture of the same name
    s = Sim(libcuda)
    yield s
    s.close()


@pytest.fixture
def cuda_sidecar(start_sidecar, libcuda, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    return start_sidecar(pool="4MiB", slot="16KiB", args=["--copy.backend=cuda"])


def kv_cache(sim, fill=None):
    """32 layers, one allocation each, FlashAttention's [2, blocks, bs, h, d]."""
    layers, ptrs = {}, []
    for i in range(LAYERS):
        p = sim.alloc(2 * NB * BLOCK)
        if fill is not None:
            data = bytes((fill * 131 + i * 17 + k * 7) % 251 for k in range(2 * NB * BLOCK))
        else:
            data = bytes(2 * NB * BLOCK)
        ctypes.memmove(p, data, len(data))
        layers["model.layers.%d.self_attn.attn" % i] = T(p, (2, NB, BS, H, D))
        ptrs.append(p)
    return layers, ptrs


def block(ptr, kv, b):
    return ctypes.string_at(ptr + (kv * NB + b) * BLOCK, BLOCK)


def test_32_allocations_store_and_load_byte_exact(cuda_sidecar, sim):
    src_layers, src = kv_cache(sim, fill=1)
    dst_layers, dst = kv_cache(sim)
    r_src = from_block_tensors(src_layers, drv=sim.drv)
    r_dst = from_block_tensors(dst_layers, drv=sim.drv)
    assert len(S.decode_cuda_extra(r_src.extra).allocations) == LAYERS
    s = cuda_sidecar.attach(instance="cuda-e2e")
    r_src.register(s, 1)
    r_dst.register(s, 2)
    digests = [bytes([b + 1]) * 32 for b in range(NB)]
    assert s.put_hashes(1, b"".join(digests)) == NB
    stream = sim.stream()
    r_src.event.record(stream)  # what wait_for_save does before its Store
    pages = [3, 0, 7, 1, 2, 6, 5, 4]  # blocks 0.. of the batch from these engine blocks
    rep = s.store(1, 0, NB, 1, pages)
    assert rep.status == 0 and rep.stored == NB, rep
    lease = s.acquire(1, 0, NB)
    assert lease.blocks == NB, lease
    into = [5, 6, 7, 0, 1, 2, 3, 4]
    assert s.load(lease.lease, 2, 0, into) == NB
    s.release(lease.lease)
    for i in range(LAYERS):
        for j in range(NB):
            for kv in range(2):
                assert block(dst[i], kv, into[j]) == block(src[i], kv, pages[j]), (i, j, kv)


def test_a_store_waits_for_the_event(cuda_sidecar, sim, tmp_path, monkeypatch):
    # While the work before the event's record "still runs" (the stand-in
    # keeps the event incomplete while a file exists) the store does not
    # copy; once it completes, the store copies the blocks.
    layers, _ = kv_cache(sim, fill=2)
    r = from_block_tensors(layers, drv=sim.drv)
    s = cuda_sidecar.attach(instance="cuda-event")
    r.register(s, 1)
    s.put_hashes(1, b"".join(bytes([0x40 + b]) * 32 for b in range(NB)))
    hold = tmp_path / "hold"
    hold.write_bytes(b"")
    monkeypatch.setenv("FAKECUDA_EVENT_HOLD", str(hold))
    r.event.record(sim.stream())
    seq = s.submit(S.TYPE_STORE, S.encode_store(1, 0, NB, 1, list(range(NB))))
    time.sleep(0.3)
    assert s.try_reply(seq) is None, "the store finished before the event completed"
    hold.unlink()
    rep = S.decode_store_reply(s.await_reply(seq, timeout=10))
    assert rep.status == 0 and rep.stored == NB, rep


def test_a_region_past_its_allocations_is_refused(cuda_sidecar, sim):
    # The sidecar bounds every segment by its allocation: a region whose
    # extra names a smaller allocation than its pages need is refused.
    layers, _ = kv_cache(sim, fill=3)
    r = from_block_tensors(layers, drv=sim.drv)
    x = S.decode_cuda_extra(r.extra)
    a = x.allocations[0]
    small = [(a.handle, a.base, BLOCK)] + [tuple(b) for b in x.allocations[1:]]
    bad = S.encode_cuda_extra(x.gpu, small, event=x.event)
    s = cuda_sidecar.attach(instance="cuda-bounds")
    with pytest.raises(S.RingsideError) as e:
        s.register_region(1, r.base, r.length, r.page_size, r.page_count, r.segments, kind=r.kind, extra=bad)
    assert e.value.status == S.Status.OUT_OF_RANGE, e.value


# An engine process: a Session and a registered simulator KV cache
# (registered before the copies are held: a registration waits for the
# device's thread). Told to, it queues a Store (or a Load of blocks already
# in the sidecar) and waits to be killed.
DOOMED = r"""
import sys, time
sys.path[:0] = sys.argv[1:2]
from test_cuda_e2e import NB, kv_cache, digests
from test_cuda_region import Sim
from ringside import schema as S
from ringside.client import Session
from ringside.plugin.region import from_block_tensors

lib, sock, what = sys.argv[2:5]
sim = Sim(lib)
layers, _ = kv_cache(sim, fill=9)
r = from_block_tensors(layers, drv=sim.drv)
s = Session.attach(sock, instance="cuda-e2e", model="llama", layout="bf16/16/HND", timeout=5.0)
s.allow_sidecar_ptrace()
r.register(s, 1)
print("registered", flush=True)
sys.stdin.readline()
if what == "store":
    s.put_hashes(7, digests(0x70))
    r.event.record(sim.stream())
    s.submit(S.TYPE_STORE, S.encode_store(7, 0, NB, 1, list(range(NB))))
else:
    s.put_hashes(7, digests(0x10))
    lease = s.acquire(7, 0, NB)
    assert lease.blocks == NB, lease
    s.submit(S.TYPE_LOAD, S.encode_load(lease.lease, 1, 0, list(range(NB))))
print(s.info.session, flush=True)
time.sleep(30)
"""


def digests(tag):
    return b"".join(bytes([tag + b]) * 32 for b in range(NB))


def copy_calls(d, pid):
    """The stand-in driver's counters in process pid (FAKECUDA_COUNTERS):
    (copy calls, calls refused on a poisoned context)."""
    try:
        with open(os.path.join(d, str(pid)), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return 0, 0
    c = struct.unpack("<%dQ" % (len(raw) // 8), raw)
    return c[1] + c[2], c[11]


def wait_for(cond, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.fixture
def copy_hold(tmp_path):
    """FAKECUDA_COPY_HOLD's file, removed at teardown (before the sidecar's
    stop, which would wait for the held copy)."""
    hold = tmp_path / "copy-hold"
    yield hold
    if hold.exists():
        hold.unlink()


@pytest.mark.parametrize("what", ["store", "load"])
def test_an_engine_killed_with_copies_queued(start_sidecar, copy_hold, libcuda, sim, monkeypatch, tmp_path, what):  # noqa: F811
    # The sidecar's copies are held in the driver (FAKECUDA_COPY_HOLD): a
    # live engine's store is in a copy call, a second engine's Store or Load
    # is queued behind it, and that engine is SIGKILLed. Its queued copies
    # are never issued (the stand-in would fail a copy into or out of a dead
    # exporter's memory with a sticky error), the sidecar serves on, and the
    # live engine's store completes and loads back byte-exact.
    counters, hold = tmp_path / "counters", copy_hold
    counters.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    monkeypatch.setenv("FAKECUDA_COUNTERS", str(counters))
    monkeypatch.setenv("FAKECUDA_COPY_HOLD", str(hold))
    # --copy.stall above the hold: the live engine's held copy is not stuck.
    sc = start_sidecar(pool="4MiB", slot="16KiB", args=["--copy.backend=cuda", "--copy.stall=10s"], metrics=True)
    for k in ("FAKECUDA_COUNTERS", "FAKECUDA_COPY_HOLD"):
        monkeypatch.delenv(k)
    pid = sc.proc.pid
    src_layers, src = kv_cache(sim, fill=4)
    dst_layers, dst = kv_cache(sim)
    r_src = from_block_tensors(src_layers, drv=sim.drv)
    r_dst = from_block_tensors(dst_layers, drv=sim.drv)
    s = cuda_sidecar_session(sc)
    r_src.register(s, 1)
    r_dst.register(s, 2)
    stream = sim.stream()
    # A first store, unheld: what one store of NB pages costs in copy calls.
    s.put_hashes(1, digests(0x10))
    r_src.event.record(stream)
    c0 = copy_calls(counters, pid)[0]
    rep = s.store(1, 0, NB, 1, list(range(NB)))
    assert rep.status == 0 and rep.stored == NB, rep
    one = copy_calls(counters, pid)[0] - c0
    assert one > 0
    child = subprocess.Popen(
        [sys.executable, "-c", DOOMED, TESTS, libcuda, sc.sock, what],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line == "registered\n", "the engine process failed:\n" + line + child.stderr.read()
        # The held store: it is in a copy call until the hold goes.
        hold.write_bytes(b"")
        s.put_hashes(2, digests(0x40))
        r_src.event.record(stream)
        pages = [7, 6, 5, 4, 3, 2, 1, 0]
        seq = s.submit(S.TYPE_STORE, S.encode_store(2, 0, NB, 1, pages))
        wait_for(lambda: copy_calls(counters, pid)[0] == c0 + one + 1, "the store's copy call did not start")
        before = sc.requests("Store" if what == "store" else "Load")
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()  # after its request was sent
        assert line.strip().isdigit(), "the engine process failed:\n" + line + child.stderr.read()
        dead = int(line)
        wait_for(
            lambda: sc.requests("Store" if what == "store" else "Load") > before,
            "the sidecar did not receive the engine's %s" % what,
        )
        time.sleep(0.1)  # its chunk goes to the device queue, behind the held copy
        assert s.try_reply(seq) is None and copy_calls(counters, pid)[0] == c0 + one + 1
    finally:
        child.kill()
        child.wait(10)
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()
    wait_for(
        lambda: dead not in [x["id"] for x in sc.state()["sessions"]],
        "the killed engine's session did not end: %s" % sc.state()["sessions"],
    )
    hold.unlink()
    rep = S.decode_store_reply(s.await_reply(seq, timeout=10))
    assert rep.status == 0 and rep.stored == NB, rep
    assert sc.proc.poll() is None, "the sidecar exited:\n" + sc.logs()
    copies, refused = copy_calls(counters, pid)
    assert refused == 0, "a copy touched the dead engine's memory and poisoned the context:\n" + sc.logs()
    assert copies == c0 + 2 * one, "the dead engine's copies were issued (%d copy calls, want %d)" % (
        copies,
        c0 + 2 * one,
    )
    # The live engine goes on: both stores load back byte-exact.
    for batch, order in ((1, list(range(NB))), (2, pages)):
        lease = s.acquire(batch, 0, NB)
        assert lease.blocks == NB, lease
        into = [(j + 3) % NB for j in range(NB)]
        assert s.load(lease.lease, 2, 0, into) == NB
        s.release(lease.lease)
        for i in range(LAYERS):
            for j in range(NB):
                for kv in range(2):
                    assert block(dst[i], kv, into[j]) == block(src[i], kv, order[j]), (batch, i, j, kv)
    assert copy_calls(counters, pid)[1] == 0 and sc.proc.poll() is None


def cuda_sidecar_session(sc):
    s = sc.attach(instance="cuda-e2e")
    s.allow_sidecar_ptrace()
    return s
