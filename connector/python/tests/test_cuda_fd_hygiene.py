"""Descriptor hygiene of GPU memory shared by file descriptor, against a
real sidecar (``ringside serve --copy.backend=cuda`` on the stand-in
driver): the open descriptors of both processes, the engine side (this
test process) and the sidecar (/proc/PID/fd), across a hundred cycles of
register and detach, and around an engine SIGKILLed while a copy of its
memory runs in the sidecar, come back to where they started; the
sidecar's driver calls (FAKECUDA_COUNTERS) show every import unmapped,
its reservation freed and its handle released.
"""

import os
import struct
import subprocess
import sys
import time

import pytest
from conftest import child_env
from test_cuda_fd import VmmKV, digests
from test_cuda_region import Sim, libcuda  # noqa: F401 - libcuda: a fixture
from test_cuda_vmm import Vmm

from ringside.plugin.region import from_block_tensors

TESTS = os.path.dirname(os.path.abspath(__file__))

# fakecuda.c's counters (enum counter), by index.
C_BATCH, C_RANGE = 1, 2
C_VMM_ALLOC, C_VMM_FREE, C_VMM_MAP, C_VMM_UNMAP, C_VMM_RESERVE, C_VMM_ADDRFREE = 12, 13, 14, 15, 16, 17
C_VMM_IMPORT = 19


def counters(d, pid):
    try:
        with open(os.path.join(d, str(pid)), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return (0,) * 20
    return struct.unpack("<%dQ" % (len(raw) // 8), raw)


def fds_of(pid="self"):
    return len(os.listdir("/proc/%s/fd" % pid))


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


def settle(what, get, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while get() != want:
        assert time.monotonic() < deadline, "%s: %s, want %s" % (what, get(), want)
        time.sleep(0.01)


@pytest.fixture
def sim(libcuda, monkeypatch):  # noqa: F811 - the fixture of the same name
    monkeypatch.delenv("FAKECUDA_IMEX", raising=False)
    s = Sim(libcuda)
    s.vmm = Vmm(libcuda)
    yield s
    s.close()


@pytest.fixture
def hold(tmp_path):
    """FAKECUDA_COPY_HOLD's file (the sidecar's copies wait in the driver
    while it exists), removed at teardown, before the sidecar's stop."""
    h = tmp_path / "copy-hold"
    yield h
    if h.exists():
        h.unlink()


@pytest.fixture
def cuda_sidecar(start_sidecar, libcuda, monkeypatch, tmp_path, hold):  # noqa: F811
    d = tmp_path / "counters"
    d.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(libcuda))
    monkeypatch.setenv("FAKECUDA_COUNTERS", str(d))
    monkeypatch.setenv("FAKECUDA_COPY_HOLD", str(hold))
    sc = start_sidecar(pool="4MiB", slot="64KiB", args=["--copy.backend=cuda", "--copy.stall=30s"])
    for k in ("FAKECUDA_COUNTERS", "FAKECUDA_COPY_HOLD"):
        monkeypatch.delenv(k)
    sc.counters = lambda: counters(d, sc.proc.pid)
    return sc


def imports_released(c):
    """(imports, allocations made, freed, maps, unmaps, reservations, freed)
    of the sidecar: all paired once every import is released."""
    return (
        c[C_VMM_ALLOC] - c[C_VMM_FREE],
        c[C_VMM_MAP] - c[C_VMM_UNMAP],
        c[C_VMM_RESERVE] - c[C_VMM_ADDRFREE],
    )


def test_a_hundred_register_and_detach_cycles(cuda_sidecar, sim):
    sc = cuda_sidecar
    kv = VmmKV(sim.vmm, 4, 16)
    kv.commit(16)
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    kv.fill(5)
    stream = sim.stream()

    def cycle(i):
        s = sc.attach(instance="hygiene-%d" % i, timeout=10.0)
        r.register(s, 1)
        if i % 10 == 0:  # now and then a store, and a load of it
            s.put_hashes(1, digests(i % 251, 4))
            r.event.record(stream)
            rep = s.store(1, 0, 4, 1, [0, 1, 2, 3])
            assert rep.status == 0 and rep.stored + rep.present == 4, rep
            lease = s.acquire(1, 0, 4)
            assert s.load(lease.lease, 1, 0, [3, 2, 1, 0]) == 4
            s.release(lease.lease)
        s.close()

    for i in range(3):  # what the first cycles open for good (the pinned pool, the device's thread)
        cycle(i)
    pid = sc.proc.pid
    settle("sidecar imports after warm-up", lambda: imports_released(sc.counters()), (0, 0, 0))
    engine, sidecar = fds_of(), steady(pid)
    imported = sc.counters()[C_VMM_IMPORT]
    for i in range(100):
        cycle(i)
    assert fds_of() == engine, "the engine side's descriptors after 100 cycles"
    settle("the sidecar's descriptors after 100 cycles", lambda: fds_of(pid), sidecar)
    settle("the sidecar's imports after 100 cycles", lambda: imports_released(sc.counters()), (0, 0, 0))
    assert sc.counters()[C_VMM_IMPORT] - imported == 400
    kv.close()


ENGINE = r"""
import os, sys, time
sys.path[:0] = sys.argv[1:2]
from test_cuda_fd import VmmKV, digests
from test_cuda_region import Sim
from test_cuda_vmm import Vmm
from ringside import schema as S
from ringside.client import Session
from ringside.plugin.region import from_block_tensors

lib, sock = sys.argv[2:4]
sim = Sim(lib)
kv = VmmKV(Vmm(lib), 4, 16)
kv.commit(16)
kv.fill(9)
r = from_block_tensors(kv.tensors(), drv=sim.drv)
s = Session.attach(sock, instance="doomed", model="llama", layout="l", timeout=10.0)
r.register(s, 1)
s.put_hashes(1, digests(9, 16))
r.event.record(sim.stream())
s.submit(S.TYPE_STORE, S.encode_store(1, 0, 16, 1, list(range(16))))
print("stored", flush=True)
time.sleep(60)
"""


def test_an_engine_killed_mid_copy(cuda_sidecar, sim, hold):
    sc = cuda_sidecar
    pid = sc.proc.pid
    # A bystander, registered first (so that the device's thread and the
    # pinned pool are there before the count).
    kv = VmmKV(sim.vmm, 4, 16)
    kv.commit(16)
    r = from_block_tensors(kv.tensors(), drv=sim.drv)
    by = sc.attach(instance="bystander", timeout=10.0)
    r.register(by, 1)
    engine, sidecar = fds_of(), steady(pid)
    busy = imports_released(sc.counters())
    copies = sc.counters()[C_BATCH] + sc.counters()[C_RANGE]
    hold.write_bytes(b"")
    child = subprocess.Popen(
        [sys.executable, "-c", ENGINE, TESTS, sim.path, sc.sock], env=child_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "stored"
        # Its store is in a copy call of the sidecar's driver, held there.
        settle("the store's copy", lambda: sc.counters()[C_BATCH] + sc.counters()[C_RANGE] > copies, True)
        child.kill()
        child.wait(10)
    finally:
        child.stdout.close()
    hold.unlink()
    settle("the sidecar's descriptors after the kill", lambda: fds_of(pid), sidecar)
    settle("the sidecar's imports after the kill", lambda: imports_released(sc.counters()), busy)
    assert fds_of() == engine
    # The sidecar serves on: the bystander stores and loads.
    kv.fill(4)
    by.put_hashes(2, digests(4, 4))
    r.event.record(sim.stream())
    assert by.store(2, 0, 4, 1, [0, 1, 2, 3]).stored == 4
    lease = by.acquire(2, 0, 4)
    assert by.load(lease.lease, 1, 0, [4, 5, 6, 7]) == 4
    for i in range(4):
        for j in range(4):
            assert kv.page(i, 4 + j) == kv.page(i, j)
    by.close()
    settle("the sidecar's imports at the end", lambda: imports_released(sc.counters()), (0, 0, 0))
    kv.close()
