"""CUDA virtual memory management (VMM) memory shared through POSIX file
descriptors, at the level of the driver calls, against the stand-in driver
(gpu/gputest/testdata/fakecuda.c), as an engine's worker will export its KV
cache and the sidecar import it: cuMemCreate with
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested, cuMemAddressReserve,
cuMemMap, cuMemSetAccess; cuMemRetainAllocationHandle from a mapped address
and cuMemExportToShareableHandle in the exporter; the descriptor passed with
SCM_RIGHTS to a second process, which imports it
(cuMemImportFromShareableHandle), maps it and moves bytes both ways.

The calls go through the library's plain exports, as vLLM 0.34's
vllm/utils/vmm_driver.py makes them (the VMM entry points have one ABI).
What each behaviour of the stand-in stands for, with its source in the CUDA
Driver API documentation and the device probe that checks it, is in
fakecuda.c and docs/architecture.md ("The copy path").
"""

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAKE_SRC = os.path.join(REPO, "gpu", "gputest", "testdata", "fakecuda.c")

GRAN = 2 << 20  # the stand-in's granularity
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
FABRIC = 8  # CU_MEM_HANDLE_TYPE_FABRIC
INVALID_VALUE = 1
NOT_PERMITTED = 800
ATTR_LEGACY_IPC = 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
ATTR_RANGE_START, ATTR_RANGE_SIZE, ATTR_MAPPED, ATTR_HANDLE_TYPES = 11, 12, 13, 14
ATTR_MAPPING_SIZE, ATTR_MAPPING_BASE = 18, 19

_u64, _sz, _vp, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int


class MemLocation(ctypes.Structure):
    _fields_ = [("type", _int), ("id", _int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", _int),
        ("requestedHandleTypes", _int),
        ("location", MemLocation),
        ("win32HandleMetaData", _vp),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", MemLocation), ("flags", _int)]


P = ctypes.POINTER
PROTOS = {
    "cuDevicePrimaryCtxRetain": [P(_vp), _int],
    "cuCtxSetCurrent": [_vp],
    "cuMemGetAllocationGranularity": [P(_sz), P(AllocProp), _int],
    "cuMemCreate": [P(_u64), _sz, P(AllocProp), ctypes.c_ulonglong],
    "cuMemRelease": [_u64],
    "cuMemAddressReserve": [P(_u64), _sz, _sz, _u64, ctypes.c_ulonglong],
    "cuMemAddressFree": [_u64, _sz],
    "cuMemMap": [_u64, _sz, _sz, _u64, ctypes.c_ulonglong],
    "cuMemUnmap": [_u64, _sz],
    "cuMemSetAccess": [_u64, _sz, P(AccessDesc), _sz],
    "cuMemRetainAllocationHandle": [P(_u64), _vp],
    "cuMemExportToShareableHandle": [_vp, _u64, _int, ctypes.c_ulonglong],
    "cuMemImportFromShareableHandle": [P(_u64), _vp, _int],
    "cuPointerGetAttribute": [_vp, _int, _u64],
    "cuMemGetAddressRange": [P(_u64), P(_sz), _u64],
    "cuIpcGetMemHandle": [ctypes.c_char_p, _u64],
    "cuMemcpyHtoD": [_u64, _vp, _sz],
    "cuMemcpyDtoH": [_vp, _u64, _sz],
}


class Vmm:
    """The stand-in's VMM entry points, with device 0's primary context
    current on this thread."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        for name, args in PROTOS.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = args, _int
        ctx = _vp()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert self.lib.cuCtxSetCurrent(ctx) == 0

    def rc(self, name, *args):
        return getattr(self.lib, name)(*args)

    def ok(self, name, *args):
        r = self.rc(name, *args)
        assert r == 0, f"{name}: CUresult {r}"

    def create(self, n, types):
        prop = AllocProp(type=1, requestedHandleTypes=types)
        prop.location.type, prop.location.id = 1, 0
        h = _u64()
        r = self.rc("cuMemCreate", ctypes.byref(h), n, ctypes.byref(prop), 0)
        return r, h.value

    def reserve(self, n):
        p = _u64()
        self.ok("cuMemAddressReserve", ctypes.byref(p), n, 0, 0, 0)
        return p.value

    def grant(self, p, n, flags=3):
        d = AccessDesc(flags=flags)
        d.location.type, d.location.id = 1, 0
        return self.rc("cuMemSetAccess", p, n, ctypes.byref(d), 1)

    def map_rw(self, h, n):
        """Reserve n bytes, map h there and grant read-write access."""
        p = self.reserve(n)
        self.ok("cuMemMap", p, n, 0, h, 0)
        self.ok("cuMemSetAccess", p, n, *self._rw())
        return p

    def _rw(self):
        d = AccessDesc(flags=3)
        d.location.type, d.location.id = 1, 0
        self._desc = d
        return ctypes.byref(d), 1

    def unmap_free(self, p, n):
        self.ok("cuMemUnmap", p, n)
        self.ok("cuMemAddressFree", p, n)

    def export_fd(self, h):
        fd = _int(-1)
        r = self.rc("cuMemExportToShareableHandle", ctypes.byref(fd), h, POSIX_FD, 0)
        return r, fd.value

    def import_fd(self, fd):
        h = _u64()
        r = self.rc("cuMemImportFromShareableHandle", ctypes.byref(h), _vp(fd), POSIX_FD)
        return r, h.value

    def fill(self, p, byte, n):
        buf = (ctypes.c_ubyte * n)(*([byte] * n))
        self.ok("cuMemcpyHtoD", p, buf, n)

    def read(self, p, n):
        buf = (ctypes.c_ubyte * n)()
        self.ok("cuMemcpyDtoH", buf, p, n)
        return bytes(buf)

    def attr(self, a, p):
        v = _u64(0)
        r = self.rc("cuPointerGetAttribute", ctypes.byref(v), a, p)
        return r, v.value


def fd_count():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler: cannot build the stand-in CUDA driver")
    out = str(tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1")
    subprocess.run([gcc, "-shared", "-fPIC", "-o", out, FAKE_SRC], check=True, capture_output=True)
    return out


@pytest.fixture
def vmm(libcuda, monkeypatch):
    monkeypatch.delenv("FAKECUDA_IMEX", raising=False)
    return Vmm(libcuda)


class Importer:
    """This file run as a second process (the sidecar's side): it receives
    a descriptor with SCM_RIGHTS, imports and maps it, and answers JSON
    lines on stdout to commands on stdin."""

    def __init__(self, libcuda):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "importer", libcuda, str(theirs.fileno())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()

    def send_fd(self, fd):
        socket.send_fds(self.sock, [b"f"], [fd])

    def ask(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"the importer exited ({self.p.wait()}) during {cmd}"
        return json.loads(line)

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(timeout=30)
        self.p.stdout.close()
        self.sock.close()


def importer_main(lib, sockfd):
    """The second process: commands `import`, `read`, `fill`, `unmap`, `fds`."""
    v = Vmm(lib)
    sock = socket.socket(fileno=sockfd)
    base = size = handle = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        out = {}
        op = cmd["op"]
        if op == "import":
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
            fd = fds[0]
            r, handle = v.import_fd(fd)
            os.close(fd)  # the import holds the memory; the descriptor is not needed
            out["import"] = r
            if r == 0:
                size = cmd["bytes"]
                base = v.map_rw(handle, size)
                out["legacy_ipc"] = v.attr(ATTR_LEGACY_IPC, base)
                out["handle_types"] = v.attr(ATTR_HANDLE_TYPES, base)
        elif op == "read":
            data = v.read(base + cmd["at"], cmd["n"])
            out["distinct"] = sorted(set(data))
        elif op == "fill":
            v.fill(base + cmd["at"], cmd["byte"], cmd["n"])
        elif op == "unmap":
            v.unmap_free(base, size)
            v.ok("cuMemRelease", handle)
        elif op == "fds":
            out["fds"] = fd_count()
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def test_export_import_in_a_second_process_moves_bytes_both_ways(vmm, libcuda):
    n = 2 * GRAN
    r, h = vmm.create(n, POSIX_FD)
    assert r == 0
    p = vmm.map_rw(h, n)
    imp = Importer(libcuda)
    try:
        vmm.fill(p, 0x3C, GRAN)
        vmm.fill(p + GRAN, 0x11, GRAN)
        # The worker's path: the handle from any mapped address, then the fd.
        rh = _u64()
        vmm.ok("cuMemRetainAllocationHandle", ctypes.byref(rh), _vp(p + GRAN + 4096))
        assert rh.value == h, "cuMemRetainAllocationHandle gives the handle that was mapped"
        r, fd = vmm.export_fd(rh.value)
        vmm.ok("cuMemRelease", rh.value)
        assert r == 0 and fd >= 0
        imp.send_fd(fd)
        os.close(fd)
        got = imp.ask(op="import", bytes=n)
        assert got["import"] == 0
        assert got["legacy_ipc"] == [0, 0], "an imported VMM mapping is not legacy-IPC capable"
        assert got["handle_types"] == [0, POSIX_FD]
        assert imp.ask(op="read", at=0, n=GRAN)["distinct"] == [0x3C], "the importer sees the exporter's bytes"
        imp.ask(op="fill", at=GRAN, byte=0xD2, n=GRAN)
        assert set(vmm.read(p + GRAN, GRAN)) == {0xD2}, "the exporter sees the importer's bytes"
        # The exporter writes again: the importer's mapping is the same memory.
        vmm.fill(p, 0x77, 4096)
        assert imp.ask(op="read", at=0, n=4096)["distinct"] == [0x77]
        imp.ask(op="unmap")
    finally:
        imp.close()
        vmm.unmap_free(p, n)
        vmm.ok("cuMemRelease", h)


def test_export_of_a_type_not_requested_is_refused(vmm, monkeypatch):
    r, h = vmm.create(GRAN, 0)  # CU_MEM_HANDLE_TYPE_NONE: no export
    assert r == 0
    try:
        assert vmm.export_fd(h)[0] == INVALID_VALUE
    finally:
        vmm.ok("cuMemRelease", h)
    # FABRIC needs an IMEX channel: without one, cuMemCreate refuses it.
    assert vmm.create(GRAN, FABRIC)[0] == NOT_PERMITTED
    monkeypatch.setenv("FAKECUDA_IMEX", "1")
    r, h = vmm.create(GRAN, FABRIC)  # what vLLM 0.34 asks for where FABRIC is available
    assert r == 0
    try:
        assert vmm.export_fd(h)[0] == INVALID_VALUE, "a FABRIC-only allocation has no POSIX descriptor"
    finally:
        vmm.ok("cuMemRelease", h)
    r, h = vmm.create(GRAN, POSIX_FD | FABRIC)
    assert r == 0
    try:
        r, fd = vmm.export_fd(h)
        assert r == 0
        os.close(fd)
    finally:
        vmm.ok("cuMemRelease", h)


def test_pointer_attributes_and_legacy_ipc(vmm):
    n = 2 * GRAN
    r, h = vmm.create(GRAN, POSIX_FD)
    assert r == 0
    base = vmm.reserve(n)  # two granules reserved, one mapped
    try:
        vmm.ok("cuMemMap", base, GRAN, 0, h, 0)
        assert vmm.grant(base, GRAN) == 0
        assert vmm.attr(ATTR_LEGACY_IPC, base + 100) == (0, 0)
        assert vmm.attr(ATTR_HANDLE_TYPES, base) == (0, POSIX_FD)
        assert vmm.attr(ATTR_MAPPED, base) == (0, 1)
        assert vmm.attr(ATTR_MAPPED, base + GRAN) == (0, 0), "reserved, not mapped"
        assert vmm.attr(ATTR_RANGE_START, base + 5) == (0, base)
        assert vmm.attr(ATTR_RANGE_SIZE, base + 5) == (0, n), "the reservation"
        assert vmm.attr(ATTR_MAPPING_BASE, base + 5) == (0, base)
        assert vmm.attr(ATTR_MAPPING_SIZE, base + 5) == (0, GRAN), "the mapping"
        b, s = _u64(), _sz()
        vmm.ok("cuMemGetAddressRange", ctypes.byref(b), ctypes.byref(s), base + 7)
        assert (b.value, s.value) == (base, GRAN), "cuMemGetAddressRange gives the mapping"
        buf = ctypes.create_string_buffer(64)
        assert vmm.rc("cuIpcGetMemHandle", buf, base) == INVALID_VALUE, "legacy IPC cannot export VMM memory"
        vmm.ok("cuMemUnmap", base, GRAN)
    finally:
        vmm.ok("cuMemAddressFree", base, n)
        vmm.ok("cuMemRelease", h)


def test_release_while_mapped_keeps_the_memory_until_unmapped(vmm, libcuda):
    n = GRAN
    before = fd_count()
    r, h = vmm.create(n, POSIX_FD)
    assert r == 0
    p = vmm.map_rw(h, n)
    vmm.fill(p, 0x5E, n)
    r, fd = vmm.export_fd(h)
    assert r == 0
    vmm.ok("cuMemRelease", h)  # the creator's handle goes; the mapping stays
    assert vmm.rc("cuMemRelease", h) == INVALID_VALUE, "no reference left to release"
    assert set(vmm.read(p, n)) == {0x5E}, "released while mapped: the memory lives"
    rh = _u64()
    vmm.ok("cuMemRetainAllocationHandle", ctypes.byref(rh), _vp(p))
    assert rh.value == h, "the mapped handle, retained again"
    vmm.ok("cuMemRelease", rh.value)
    vmm.unmap_free(p, n)
    assert fd_count() == before + 1, "unmapped and released: only the exported descriptor is left"
    # The descriptor alone keeps the memory: another process imports it
    # after the exporter unmapped and released everything.
    imp = Importer(libcuda)
    try:
        imp.send_fd(fd)
        os.close(fd)
        assert imp.ask(op="import", bytes=n)["import"] == 0
        assert imp.ask(op="read", at=0, n=n)["distinct"] == [0x5E]
        imp.ask(op="unmap")
    finally:
        imp.close()
    assert fd_count() == before


def test_map_rules(vmm):
    r, h = vmm.create(2 * GRAN, POSIX_FD)
    assert r == 0
    p = vmm.reserve(4 * GRAN)
    try:
        assert vmm.rc("cuMemMap", p, GRAN + 4096, 0, h, 0) == INVALID_VALUE, "size not a multiple of the granularity"
        assert vmm.rc("cuMemMap", p + 4096, GRAN, 0, h, 0) == INVALID_VALUE, "address not aligned"
        assert vmm.rc("cuMemMap", p, GRAN, GRAN, h, 0) == INVALID_VALUE, "offset: currently must be zero"
        assert vmm.rc("cuMemMap", p, 3 * GRAN, 0, h, 0) == INVALID_VALUE, "larger than the allocation"
        assert vmm.rc("cuMemMap", p + 3 * GRAN, 2 * GRAN, 0, h, 0) == INVALID_VALUE, "past the reservation"
        assert vmm.create(GRAN + 4096, POSIX_FD)[0] == INVALID_VALUE, "cuMemCreate of a size off the granularity"
        vmm.ok("cuMemMap", p, 2 * GRAN, 0, h, 0)
        assert vmm.rc("cuMemMap", p + GRAN, 2 * GRAN, 0, h, 0) == INVALID_VALUE, "over a mapped range"
        buf = (ctypes.c_ubyte * 16)()
        assert vmm.rc("cuMemcpyDtoH", buf, p, 16) == INVALID_VALUE, "mapped without access"
        assert vmm.grant(p, GRAN) == INVALID_VALUE, "access to part of a mapping"
        assert vmm.grant(p, 2 * GRAN, flags=1) == 0
        vmm.ok("cuMemcpyDtoH", buf, p, 16)
        assert vmm.rc("cuMemcpyHtoD", p, buf, 16) == INVALID_VALUE, "read-only access"
        assert vmm.rc("cuMemUnmap", p, GRAN) == INVALID_VALUE, "a sub-range of a mapping"
        assert vmm.rc("cuMemAddressFree", p, 4 * GRAN) == INVALID_VALUE, "a reservation still mapped"
        assert vmm.rc("cuMemAddressFree", p, 2 * GRAN) == INVALID_VALUE, "not the reserved size"
        rh = _u64()
        assert vmm.rc("cuMemRetainAllocationHandle", ctypes.byref(rh), _vp(p + 3 * GRAN)) == INVALID_VALUE
        vmm.ok("cuMemUnmap", p, 2 * GRAN)
    finally:
        vmm.ok("cuMemAddressFree", p, 4 * GRAN)
        vmm.ok("cuMemRelease", h)


def test_descriptor_hygiene_over_many_cycles(vmm, libcuda):
    """Every cycle (create, map, export, import in this process and in a
    second one, unmap, release, close) gives back every descriptor."""
    imp = Importer(libcuda)
    try:
        for i in range(3):  # warm up: the lazily opened ones
            cycle(vmm, imp, i)
        before, theirs = fd_count(), imp.ask(op="fds")["fds"]
        for i in range(40):
            cycle(vmm, imp, i)
        assert fd_count() == before, "descriptors leaked in the exporter"
        assert imp.ask(op="fds")["fds"] == theirs, "descriptors leaked in the importer"
    finally:
        imp.close()


def cycle(vmm, imp, i):
    n = GRAN
    r, h = vmm.create(n, POSIX_FD)
    assert r == 0
    p = vmm.map_rw(h, n)
    try:
        vmm.fill(p, i, 64)
        r, fd = vmm.export_fd(h)
        assert r == 0
        try:
            r, h2 = vmm.import_fd(fd)  # the same process may import it too
            assert r == 0 and h2 != h
            q = vmm.map_rw(h2, n)
            assert vmm.read(q, 64) == bytes([i]) * 64
            vmm.unmap_free(q, n)
            vmm.ok("cuMemRelease", h2)
            imp.send_fd(fd)
        finally:
            os.close(fd)
        assert imp.ask(op="import", bytes=n)["import"] == 0
        assert imp.ask(op="read", at=0, n=64)["distinct"] == [i]
        imp.ask(op="unmap")
    finally:
        vmm.unmap_free(p, n)
        vmm.ok("cuMemRelease", h)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "importer":
    importer_main(sys.argv[2], int(sys.argv[3]))
