"""Python client for ringside's shared-memory SPSC ring, layout version 1.

This module speaks exactly the byte layout documented in the Go package
github.com/ringside-kv/ringside/ring (ring/layout.go): one 4096-byte header
page followed by a power-of-two data area of 8-byte aligned, variable-length
records.  Golden vectors in testdata/golden/ring pin the encoding on both
sides.  Only the standard library is used (mmap, struct, ctypes for the futex
system call, os).

Roles: a ring has exactly one Producer and one Consumer, each owned by one
thread of one process.  Neither class is thread-safe.

Memory ordering (read this before changing the hot path)
-------------------------------------------------------
Every shared word is naturally aligned and inside one cache line, and is read
or written through ``memoryview.cast('Q')`` / ``cast('I')`` indexing, which
CPython compiles to one plain aligned MOV (PACK_SINGLE / UNPACK_SINGLE), so a
peer never sees a torn word.  No Python-level code can be reordered by the
interpreter, and every shared access is its own C function call, so the C
compiler cannot move accesses across them either.  What remains is the CPU:

x86-64 (TSO) gives us, for plain MOVs:
  * store -> store in program order: payload and record headers written before
    the tail store are visible before tail (producer publish = release), and
    the consumer's reads of a record complete before its head store (commit).
  * load -> load in program order: after the consumer loads tail it reads the
    record bytes behind it (acquire); after the producer loads head it may
    overwrite the space behind it (load -> store is also ordered).
  * store -> load is the ONE reordering x86 allows: a later load may complete
    while an earlier store still sits in the store buffer.  It matters in the
    sleep/wake-up (Dekker) handshake only: producer "store tail; load
    consumer-parked" against consumer "store parked=1; load tail" (and the
    mirror pair for space waits).  If both loads pass both stores, the producer
    skips the wake and the consumer sleeps on data that is already there.
    We cover it with a locked instruction on both sides: ``_full_fence()``
    is an uncontended threading.Lock acquire+release, which CPython/glibc
    implement with LOCK CMPXCHG (sem_trywait / sem_post on 3.10-3.12,
    PyMutex on 3.13+); any locked instruction drains the store buffer (a full
    barrier, like the XCHG that Go's atomic.Store compiles to).  The fence
    runs in both park paths (cheap: that side is about to sleep) and, by
    default, after every tail store (Producer.publish) and head store
    (Consumer.commit), ~0.3 us each.  ``fence=False`` drops the
    publish/commit fence; a lost wake-up then costs at most one futex timeout
    (WaitConfig.park_ns, <= 10 ms): every sleep is bounded and re-checks the
    condition, so correctness never depends on the wake, only latency.

arm64 (weakly ordered) would need, on top of that, real release/acquire
semantics: a release store of tail (STLR, or DMB ISH before the store), an
acquire load of tail/head (LDAR, or DMB ISHLD after the load), and a full
DMB ISH where the fence sits above.  Plain memoryview stores give none of
that, so payload bytes could become visible after tail.  That needs a small C
helper (ctypes-loaded .so, cffi or a C extension) providing store_release /
load_acquire / full_fence on a mapping address.  Until one exists this
module refuses to run on a non-TSO CPU (set RINGSIDE_UNSAFE_WEAK_ORDERING=1
to override, for experiments only).  The futex syscall number for aarch64
(98) is already wired up.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import mmap
import os
import platform
import stat as _stat
import sys
import threading
import time
from collections import namedtuple
from typing import Any, Optional

# The layout of the Go package ring, generated from it (internal/wiregen):
# every constant under its public name (MAGIC, OFF_TAIL, ...), and the
# static header (HEADER) and record header (RECORD_HEADER) as struct.Structs.
# tests/test_wire.py checks them against the Go golden vectors.
from ._wire_ring import *  # noqa: F403

# Indexes into the cast('Q') and cast('I') views of the whole mapping.
_Q_MAGIC = OFF_MAGIC // 8
_Q_PROD_START = OFF_PRODUCER_START // 8
_Q_CONS_START = OFF_CONSUMER_START // 8
_Q_TAIL = OFF_TAIL // 8
_Q_HEAD = OFF_HEAD // 8
_I_PROD_PID = OFF_PRODUCER_PID // 4
_I_CONS_PID = OFF_CONSUMER_PID // 4
_I_CONS_PARKED = OFF_CONS_PARKED // 4
_I_CONS_FUTEX = OFF_CONS_FUTEX // 4
_I_PROD_PARKED = OFF_PROD_PARKED // 4
_I_PROD_FUTEX = OFF_PROD_FUTEX // 4
_I_PROD_STATE = OFF_PROD_STATE // 4
_I_CONS_STATE = OFF_CONS_STATE // 4

_U64_MAX = (1 << 64) - 1

if sys.byteorder != "little":  # pragma: no cover - every supported target
    raise ImportError("ringside.ring needs a little-endian CPU (the layout is little-endian)")

# ---------------------------------------------------------------------------
# Errors (mirror ring.Err*).


class RingError(Exception):
    """Base class of every ring error."""


class RingBadHeader(RingError):
    """The file is not a ring this client speaks (or not initialised yet)."""


class RingCorrupt(RingError):
    """Structural damage in shared memory; the ring is unusable."""


class RingTooLarge(RingError, ValueError):
    """The record can never fit in this ring."""


class RingFull(RingError):
    """No room for the record now."""


class RingPeerDead(RingError):
    """The peer process is gone without closing the ring."""


class RingPeerClosed(RingError):
    """The peer closed its side of the ring."""


class RingClosed(RingError):
    """This side was closed."""


class RingBadType(RingError, ValueError):
    """Record type 0 or 0xFFFF (pad), or a field out of range."""


class RingTimeout(RingError, TimeoutError):
    """The deadline passed before the condition held."""


# ---------------------------------------------------------------------------
# Platform: futex, fence, process identity.

_MACHINE = platform.machine().lower()
SYS_FUTEX: Optional[int]  # the futex system call's number (None: not known for this CPU)
if _MACHINE in ("x86_64", "amd64"):
    SYS_FUTEX = 202
    _TSO = True
elif _MACHINE in ("aarch64", "arm64"):
    SYS_FUTEX = 98
    _TSO = False
else:  # pragma: no cover
    SYS_FUTEX = None
    _TSO = False

FUTEX_WAIT = 0
FUTEX_WAKE = 1  # never FUTEX_PRIVATE_FLAG (128): the word is shared between processes

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = (
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_uint,
)


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


def _futex_wait(addr: int, val: int, timeout_ns: int, ts: _Timespec, ts_addr: int) -> None:
    """Sleep while the u32 at addr == val, at most timeout_ns (always bounded).

    ctypes releases the GIL around the call.  Returns on wake, value mismatch
    (EAGAIN), timeout or signal; the caller re-checks its condition."""
    if timeout_ns <= 0:
        timeout_ns = 1_000_000
    ts.tv_sec, ts.tv_nsec = divmod(timeout_ns, 1_000_000_000)
    if _syscall(SYS_FUTEX, addr, FUTEX_WAIT, val, ts_addr, None, 0) < 0:
        e = ctypes.get_errno()
        if e not in (_errno.EAGAIN, _errno.ETIMEDOUT, _errno.EINTR):
            raise OSError(e, "futex wait: " + os.strerror(e))


def _futex_wake(addr: int, n: int = 1) -> int:
    r = _syscall(SYS_FUTEX, addr, FUTEX_WAKE, n, None, None, 0)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, "futex wake: " + os.strerror(e))
    return r


_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release


def _full_fence() -> None:
    """A full memory barrier on x86-64: an uncontended lock acquire+release
    executes LOCK CMPXCHG, which drains the store buffer (orders an earlier
    store before a later load).  Not a full barrier on arm64 (see module doc).
    """
    _fence_acquire()
    _fence_release()


def _parse_stat(b: bytes):
    """(state, starttime) from /proc/PID/stat contents, or None if malformed."""
    i = b.rfind(b")")
    if i < 0:
        return None
    fields = b[i + 1 :].split()
    # fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    if len(fields) < 20:
        return None
    try:
        return fields[0], int(fields[19])
    except ValueError:
        return None


def process_start_time(pid: int) -> int:
    """Start time of pid in clock ticks since boot (/proc/PID/stat field 22)."""
    if pid <= 0:
        raise ValueError(f"invalid pid {pid}")
    with open(f"/proc/{pid}/stat", "rb") as f:
        st = _parse_stat(f.read())
    if st is None:
        raise OSError(f"malformed /proc/{pid}/stat")
    return st[1]


_self_cache = [0, 0]  # pid, start; recomputed after fork


def _self() -> tuple:
    """This process's (pid, start time), exactly like Go's shm.Self."""
    pid = os.getpid()
    if _self_cache[0] != pid:
        try:
            start = process_start_time(pid)
        except OSError:
            start = 0
        _self_cache[0], _self_cache[1] = pid, start
    return _self_cache[0], _self_cache[1]


def process_alive(pid: int, start: int) -> bool:
    """Whether process pid that started at start still runs (Go's shm.Alive).

    pid 0 means unknown and counts as alive; a zombie counts as dead; start 0
    skips the start-time comparison."""
    if pid == 0:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = _parse_stat(f.read())
    except OSError:
        return False
    if st is None:
        return False
    if st[0] in (b"Z", b"X"):
        return False
    return start == 0 or st[1] == start


# ---------------------------------------------------------------------------
# Encoding helpers (not the hot path; used by tools, tests and golden vectors).


def record_size(n: int) -> int:
    """Ring bytes a record with an n-byte payload occupies."""
    return RECORD_HEADER_SIZE + ((n + ALIGN - 1) & ~(ALIGN - 1))


def default_max_record(capacity: int) -> int:
    return min(capacity // 4, 1 << 24)


Header = namedtuple(
    "Header",
    "magic version header_size capacity align max_record epoch flags "
    "producer_pid producer_start consumer_pid consumer_start",
)


def encode_header(buf, h: Header) -> None:
    """Write the static header fields of h (magic included) into buf[:80]."""
    HEADER.pack_into(
        buf,
        0,
        h.magic,
        h.version,
        h.header_size,
        h.capacity,
        h.align,
        h.max_record,
        h.epoch,
        h.flags,
        0,
        h.producer_pid,
        0,
        h.producer_start,
        h.consumer_pid,
        0,
        h.consumer_start,
    )


def validate_header(h: Header, file_size: int) -> None:
    """Raise RingBadHeader unless h is a header this client speaks and matches
    file_size (pass -1 to skip the size check).  Same checks and order as Go."""
    cap = h.capacity
    if h.magic != MAGIC:
        raise RingBadHeader(f"magic {h.magic:#x}, want {MAGIC:#x} (not a ring, or not initialised yet)")
    if h.version != VERSION:
        raise RingBadHeader(f"layout version {h.version}, this client speaks {VERSION}")
    if h.header_size != HEADER_SIZE:
        raise RingBadHeader(f"header size {h.header_size}, want {HEADER_SIZE}")
    if h.align != ALIGN:
        raise RingBadHeader(f"record alignment {h.align}, want {ALIGN}")
    if cap < MIN_CAPACITY or cap > MAX_CAPACITY or cap & (cap - 1):
        raise RingBadHeader(f"capacity {cap} is not a power of two in [{MIN_CAPACITY}, {MAX_CAPACITY}]")
    if h.max_record < 2 * RECORD_HEADER_SIZE or h.max_record > cap // 2 or h.max_record % ALIGN:
        raise RingBadHeader(
            f"max record {h.max_record} outside [{2 * RECORD_HEADER_SIZE}, capacity/2={cap // 2}] or unaligned"
        )
    if file_size >= 0 and file_size != HEADER_SIZE + cap:
        raise RingBadHeader(f"file is {file_size} bytes, header says {HEADER_SIZE + cap}")


def decode_header(buf, file_size: int = -1) -> Header:
    """Decode and validate the static header fields; never raises anything but
    RingBadHeader for bad contents."""
    if len(buf) < HEADER_SIZE:
        raise RingBadHeader(f"{len(buf)} bytes, want at least {HEADER_SIZE}")
    (magic, version, hsize, cap, align, maxrec, epoch, flags, _r0, ppid, _r1, pstart, cpid, _r2, cstart) = (
        HEADER.unpack_from(buf, 0)
    )
    h = Header(magic, version, hsize, cap, align, maxrec, epoch, flags, ppid, pstart, cpid, cstart)
    validate_header(h, file_size)
    return h


def encode_record_header(buf, off: int, length: int, typ: int, flags: int, seq: int) -> None:
    RECORD_HEADER.pack_into(buf, off, length, typ, flags, seq)


def encode_record(payload: bytes, typ: int, flags: int = 0, seq: int = 0) -> bytes:
    """The bytes of one record: header, payload, zero padding to 8."""
    b = bytearray(record_size(len(payload)))
    encode_record_header(b, 0, len(payload), typ, flags, seq)
    b[RECORD_HEADER_SIZE : RECORD_HEADER_SIZE + len(payload)] = payload
    return bytes(b)


def decode_record_header(buf, off: int, avail: int, max_record: int):
    """Decode the record header at buf[off:] and check it against the avail
    bytes known to be published there (bounded by the end of the data area)
    and max_record.  Returns (length, type, flags, seq); raises RingCorrupt."""
    if avail < RECORD_HEADER_SIZE or len(buf) - off < RECORD_HEADER_SIZE:
        raise RingCorrupt(f"{min(avail, len(buf) - off)} bytes published, less than a record header")
    length, typ, flags, seq = RECORD_HEADER.unpack_from(buf, off)
    _check_record(length, typ, avail if avail < len(buf) - off else len(buf) - off, max_record, -1)
    return length, typ, flags, seq


def _check_record(length: int, typ: int, avail: int, max_record: int, pos: int) -> int:
    """Shared record-header validation; returns the record's total size."""
    where = f" (at position {pos})" if pos >= 0 else ""
    if typ == 0:
        raise RingCorrupt(f"record type 0{where}")
    total = RECORD_HEADER_SIZE + ((length + ALIGN - 1) & ~(ALIGN - 1))
    if typ != TYPE_PAD and total > max_record:
        raise RingCorrupt(f"record of {total} bytes exceeds the maximum {max_record}{where}")
    if total > avail:
        raise RingCorrupt(f"record of {total} bytes runs past the {avail} published bytes{where}")
    return total


# ---------------------------------------------------------------------------
# The ring.

Record = namedtuple("Record", "type flags seq payload")
Record.__doc__ = """A record read from a ring.  From Consumer.next() the payload is
a read-only memoryview of ring memory, valid only until the next commit()."""
_new_record = tuple.__new__


class WaitConfig:
    """How one side waits: busy-poll for spin_ns, then os.sched_yield() for
    yield_ns, then park on the futex in park_ns slices (each slice re-checks
    the peer's liveness; it bounds a lost wake-up).  park_ns is capped at
    10 ms."""

    __slots__ = ("spin_ns", "yield_ns", "park_ns")

    def __init__(self, spin_ns: int = 50_000, yield_ns: int = 50_000, park_ns: int = 10_000_000):
        self.spin_ns = max(0, int(spin_ns))
        self.yield_ns = max(0, int(yield_ns))
        self.park_ns = min(max(1, int(park_ns)), 10_000_000)


DEFAULT_WAIT = WaitConfig()
PARK_WAIT = WaitConfig(0, 0)
SPIN_WAIT = WaitConfig(spin_ns=1 << 62, yield_ns=0)


def _deadline_ns(deadline, timeout):
    """Absolute time.monotonic_ns() deadline from a time.monotonic() deadline
    (seconds) or a relative timeout (seconds); None = wait while the peer lives."""
    if timeout is not None:
        d = time.monotonic_ns() + int(timeout * 1e9)
        if deadline is not None:
            d = min(d, int(deadline * 1e9))
        return d
    if deadline is not None:
        return int(deadline * 1e9)
    return None


class Ring:
    """A view of one ring's memory: header page plus data area.

    Use create() / open_ring() for a shared-memory file, or Ring.format() /
    Ring(buffer) over a writable buffer (bytearray) for in-process use and
    golden vectors.  Take a role with producer() or consumer()."""

    def __init__(self, buf, *, fd: int = -1, path: str = "", _mmap=None, _owner=None):
        if not _TSO and not os.environ.get("RINGSIDE_UNSAFE_WEAK_ORDERING"):
            raise RingError(
                f"ringside.ring needs a TSO CPU (x86-64); {_MACHINE} needs release/acquire "
                "fences from a C helper (see the module docstring)"
            )
        self._fd = fd
        self.path = path
        self._mmap = _mmap
        self._owner = _owner
        mv = memoryview(buf)
        if mv.readonly or mv.ndim != 1 or mv.itemsize != 1:
            mv.release()
            raise ValueError("ring memory must be a writable 1-D byte buffer")
        try:
            self.header = decode_header(mv, len(mv))
            # Base address for futex calls.  The temporary ctypes object holds a
            # buffer export only for this statement.
            base = ctypes.addressof(ctypes.c_char.from_buffer(mv))
            if base % 8:
                raise ValueError("ring memory must be 8-byte aligned")
        except BaseException:
            mv.release()
            raise
        # The mapping and its views (None once closed).
        self._mv: Any = mv
        self._q: Any = mv.cast("Q")
        self._i: Any = mv.cast("I")
        self._data: Any = mv[HEADER_SIZE:]
        self._dq: Any = self._data.cast("Q")
        self._rdata: Any = self._data.toreadonly()
        self._base = base
        self.capacity = self.header.capacity
        self.max_record = self.header.max_record
        self.epoch = self.header.epoch
        self._mask = self.capacity - 1
        # Positions are checked once here, and again each time they are read.
        self._check_positions(self._q[_Q_TAIL], self._q[_Q_HEAD])

    # -- construction -----------------------------------------------------

    @classmethod
    def format(cls, buf, capacity: int, max_record: int = 0, epoch: int = 0, flags: int = 0) -> "Ring":
        """Initialise buf (HEADER_SIZE+capacity bytes) as a new ring, magic last."""
        if max_record == 0:
            max_record = default_max_record(capacity)
        h = Header(MAGIC, VERSION, HEADER_SIZE, capacity, ALIGN, max_record, epoch, flags, 0, 0, 0, 0)
        validate_header(h, len(buf))
        mv = memoryview(buf)
        try:
            mv[:HEADER_SIZE] = bytes(HEADER_SIZE)
            encode_header(mv, h._replace(magic=0))
            q = mv[:8].cast("Q")
            q[0] = MAGIC  # publish: one aligned store after the rest of the header (TSO store order)
            q.release()
        finally:
            mv.release()
        return cls(buf)

    # -- properties ---------------------------------------------------------

    @property
    def max_payload(self) -> int:
        return self.max_record - RECORD_HEADER_SIZE

    def positions(self) -> tuple:
        """(tail, head) as published."""
        return self._q[_Q_TAIL], self._q[_Q_HEAD]

    def peers(self) -> tuple:
        """(producer pid, consumer pid) as recorded."""
        return self._i[_I_PROD_PID], self._i[_I_CONS_PID]

    def producer_alive(self) -> bool:
        return process_alive(self._i[_I_PROD_PID], self._q[_Q_PROD_START])

    def consumer_alive(self) -> bool:
        return process_alive(self._i[_I_CONS_PID], self._q[_Q_CONS_START])

    def producer(self, wait: WaitConfig = DEFAULT_WAIT, fence: bool = True) -> "Producer":
        return Producer(self, wait, fence)

    def consumer(self, wait: WaitConfig = DEFAULT_WAIT, fence: bool = True) -> "Consumer":
        return Consumer(self, wait, fence)

    def _check_positions(self, tail: int, head: int) -> None:
        if tail < head or tail - head > self.capacity or tail % ALIGN or head % ALIGN:
            raise RingCorrupt(f"positions tail={tail} head={head} (capacity {self.capacity})")

    def check(self) -> None:
        """Raise RingCorrupt if the file changed size since it was mapped (a
        touch past the end of a truncated mapping would raise SIGBUS)."""
        if self._fd < 0:
            return
        n = os.fstat(self._fd).st_size
        if n != len(self._mv):
            raise RingCorrupt(f"{self.path} changed size from {len(self._mv)} to {n} bytes")

    def bytes(self) -> bytes:
        """A copy of the whole ring memory (header page and data area)."""
        return self._mv.tobytes()

    # -- teardown -------------------------------------------------------------

    def close(self) -> None:
        """Unmap the ring (the file stays; see remove()).  Payload views that
        the caller still holds keep the mapping alive until released."""
        if self._mv is None:
            return
        for v in (self._rdata, self._dq, self._data, self._i, self._q, self._mv):
            v.release()
        self._mv = self._q = self._i = self._data = self._dq = self._rdata = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a borrowed payload view is still alive; unmapped when it goes
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Unlink the ring file (never follows a symbolic link)."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _map_fd(fd: int, path: str, size: int) -> Ring:
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        return Ring(mm, fd=fd, path=path, _mmap=mm)
    except BaseException:
        mm.close()
        raise


def create(
    path: str,
    capacity: int = 256 << 10,
    max_record: int = 0,
    epoch: int = 0,
    mode: int = 0o600,
    creator_producer: bool = False,
) -> Ring:
    """Create a new ring file at path: O_CREAT|O_EXCL|O_NOFOLLOW, exact mode,
    ftruncate, header written with the magic last.  An existing file (or a
    symbolic link) at path is an error: FileExistsError."""
    if capacity < MIN_CAPACITY or capacity > MAX_CAPACITY or capacity & (capacity - 1):
        raise ValueError(f"capacity {capacity} is not a power of two in [{MIN_CAPACITY}, {MAX_CAPACITY}]")
    while epoch == 0:
        epoch = int.from_bytes(os.urandom(8), "little")
    size = HEADER_SIZE + capacity
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            Ring.format(mm, capacity, max_record, epoch, FLAG_CREATOR_PRODUCER if creator_producer else 0)
            return Ring(mm, fd=fd, path=path, _mmap=mm)
        except BaseException:
            mm.close()
            raise
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise


def open_ring(path: str, epoch: int = 0) -> Ring:
    """Map an existing ring file without following a symbolic link and
    validate its header.  A non-zero epoch must match (stale ring refused)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == _errno.ELOOP:
            raise RingError(f"{path} is a symbolic link; refusing to follow it") from e
        raise
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise RingError(f"{path}: not a regular file")
        if st.st_size < HEADER_SIZE + MIN_CAPACITY or st.st_size > HEADER_SIZE + MAX_CAPACITY:
            raise RingBadHeader(
                f"{path}: size {st.st_size} outside [{HEADER_SIZE + MIN_CAPACITY}, {HEADER_SIZE + MAX_CAPACITY}]"
            )
        r = _map_fd(fd, path, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    if epoch and r.epoch != epoch:
        r.close()
        raise RingBadHeader(f"{path} has epoch {r.epoch:#x}, expected {epoch:#x} (stale ring)")
    return r


def open_fd(fd: int, epoch: int = 0, name: str = "") -> Ring:
    """Map a ring from a file descriptor (taken over: closed with the Ring,
    or at once on error) and validate its header, like open_ring.  This is
    how a client maps the rings the sidecar passes with its attach reply:
    they have no path, so no other process can open them."""
    name = name or f"fd {fd}"
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise RingError(f"{name}: not a regular file")
        if st.st_size < HEADER_SIZE + MIN_CAPACITY or st.st_size > HEADER_SIZE + MAX_CAPACITY:
            raise RingBadHeader(
                f"{name}: size {st.st_size} outside [{HEADER_SIZE + MIN_CAPACITY}, {HEADER_SIZE + MAX_CAPACITY}]"
            )
        os.set_inheritable(fd, False)
        r = _map_fd(fd, name, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    if epoch and r.epoch != epoch:
        r.close()
        raise RingBadHeader(f"{name} has epoch {r.epoch:#x}, expected {epoch:#x} (stale ring)")
    return r


# ---------------------------------------------------------------------------
# Producer.


class Producer:
    """The writing side.  Records are claimed/appended locally and become
    visible to the consumer at publish(), several per store of tail."""

    def __init__(self, ring: Ring, wait: WaitConfig = DEFAULT_WAIT, fence: bool = True):
        q, i = ring._q, ring._i
        t, h = q[_Q_TAIL], q[_Q_HEAD]
        ring._check_positions(t, h)
        pid, start = _self()
        q[_Q_PROD_START] = start
        i[_I_PROD_PID] = pid
        i[_I_PROD_STATE] = 0
        self.ring = ring
        self._q, self._i, self._dq, self._data = q, i, ring._dq, ring._data
        self._cap, self._mask, self._max = ring.capacity, ring._mask, ring.max_record
        self._tail = t  # local: written, maybe not published
        self._published = t
        self._head_cache = h
        self._wait = wait
        self._fence = fence
        self._cons_futex_addr = ring._base + OFF_CONS_FUTEX
        self._prod_futex_addr = ring._base + OFF_PROD_FUTEX
        self._ts = _Timespec()
        self._ts_addr = ctypes.addressof(self._ts)
        self.parks = 0

    @property
    def pending(self) -> int:
        """Bytes claimed but not yet published."""
        return self._tail - self._published

    def _refresh_head(self) -> int:
        h = self._q[_Q_HEAD]
        if h < self._head_cache or h > self._published:
            raise RingCorrupt(f"consumer head {h} outside [{self._head_cache}, {self._published}]")
        self._head_cache = h
        return h

    def _claim(self, n: int, typ: int, flags: int, seq: int) -> int:
        """Reserve a record; returns the payload's offset in the data area."""
        if typ <= 0 or typ >= TYPE_PAD:
            raise RingBadType(f"record type {typ:#x}")
        if flags >> 16 or flags < 0:
            raise RingBadType(f"record flags {flags:#x} do not fit 16 bits")
        if seq < 0 or seq > _U64_MAX:
            raise RingBadType(f"record seq {seq} does not fit 64 bits")
        size = RECORD_HEADER_SIZE + ((n + 7) & ~7)
        if n < 0 or size > self._max:
            raise RingTooLarge(f"payload of {n} bytes, at most {self._max - RECORD_HEADER_SIZE}")
        tail = self._tail
        cap = self._cap
        off = tail & self._mask
        contig = cap - off
        need = size if contig >= size else size + contig
        if tail + need - self._head_cache > cap and tail + need - self._refresh_head() > cap:
            raise RingFull(f"no room for {need} bytes")
        dq = self._dq
        if contig < size:
            # Wrap: a pad record covering the rest of the area, or (fewer than
            # 16 bytes left) a gap that both sides skip.  Only the pad's header
            # is written, exactly like Go.
            if contig >= RECORD_HEADER_SIZE:
                w = off >> 3
                dq[w] = (contig - RECORD_HEADER_SIZE) | (TYPE_PAD << 32)
                dq[w + 1] = 0
            tail += contig
            off = 0
        w = off >> 3
        # Record header as two aligned little-endian words: len|type<<32|flags<<48, seq.
        dq[w] = n | (typ << 32) | (flags << 48)
        dq[w + 1] = seq
        if n & 7:
            dq[w + (size >> 3) - 1] = 0  # zero the alignment padding (payload overwrites its part)
        self._tail = tail + size
        return off + RECORD_HEADER_SIZE

    def claim(self, n: int, typ: int = 1, flags: int = 0, seq: int = 0) -> memoryview:
        """Reserve a record with an n-byte payload and return the writable
        payload bytes to fill in place.  Visible at the next publish().
        Raises RingFull (no room now), RingTooLarge, RingBadType."""
        start = self._claim(n, typ, flags, seq)
        return self._data[start : start + n]

    def append(self, payload, typ: int = 1, flags: int = 0, seq: int = 0) -> None:
        """Copy payload (any bytes-like object) into a new record; see claim()."""
        if type(payload) is not bytes and type(payload) is not bytearray:
            payload = memoryview(payload).cast("B")
        n = len(payload)
        start = self._claim(n, typ, flags, seq)
        if n:
            self._data[start : start + n] = payload

    def publish(self, wake: bool = True) -> None:
        """Make every record claimed so far visible with one store of tail, and
        wake the consumer only if it is parked.  With wake=False a parked
        consumer is left asleep: it sees the records when something else wakes
        it (wake_consumer(), a later publish) or at the end of its current
        park slice at the latest."""
        t = self._tail
        if t == self._published:
            return
        # One aligned 8-byte MOV.  TSO: the payload and header stores above are
        # visible before it (release).
        self._q[_Q_TAIL] = t
        self._published = t
        if wake:
            self.wake_consumer()

    def wake_consumer(self) -> None:
        """Wake the consumer if it is parked (a no-op otherwise)."""
        # Dekker handshake with Consumer._park: the load of the parked flag
        # must not pass the tail store (x86's one reordering).  The fence is a
        # locked instruction; without it a lost wake-up costs <= one park slice.
        if self._fence:
            _fence_acquire()
            _fence_release()
        i = self._i
        if i[_I_CONS_PARKED]:
            # Only the producer writes this word: a plain increment is enough.
            i[_I_CONS_FUTEX] = (i[_I_CONS_FUTEX] + 1) & 0xFFFFFFFF
            _futex_wake(self._cons_futex_addr, 1)

    def put(self, payload, typ: int, seq: int, wake: bool = True) -> bool:
        """Fast path of write() for the common case: a bytes payload, flags
        0, a record that fits before the end of the data area in space known
        to be free. Returns False, writing nothing, when any of that does
        not hold; write() then does the general case (wrap, waiting for
        space, validation errors)."""
        if type(payload) is not bytes or not 0 < typ < TYPE_PAD or not 0 <= seq <= _U64_MAX:
            return False
        n = len(payload)
        size = RECORD_HEADER_SIZE + ((n + 7) & ~7)
        tail = self._tail
        off = tail & self._mask
        if size > self._max or self._cap - off < size or tail + size - self._head_cache > self._cap:
            return False
        dq = self._dq
        w = off >> 3
        dq[w] = n | (typ << 32)
        dq[w + 1] = seq
        if n & 7:
            dq[w + (size >> 3) - 1] = 0  # the alignment padding (the payload overwrites its part)
        if n:
            start = off + RECORD_HEADER_SIZE
            self._data[start : start + n] = payload
        self._tail = tail + size
        self.publish(wake)
        return True

    def write(
        self,
        payload,
        typ: int = 1,
        flags: int = 0,
        seq: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        wake: bool = True,
    ) -> None:
        """Append one record and publish it, waiting for space until deadline
        (time.monotonic() seconds) or timeout; None waits while the consumer
        lives.  wake=False: see publish().  Raises RingPeerDead /
        RingPeerClosed / RingTimeout."""
        while True:
            try:
                self.append(payload, typ, flags, seq)
            except RingFull:
                self.publish()
                n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
                self.wait_space(record_size(n), deadline, timeout)
                continue
            self.publish(wake)
            return

    def _space_for(self, need: int) -> bool:
        if self._tail + need - self._head_cache <= self._cap:
            return True
        return self._tail + need - self._refresh_head() <= self._cap

    def wait_space(self, size: int, deadline: float | None = None, timeout: float | None = None) -> None:
        """Wait until a record of size bytes (header included) could be claimed."""
        off = self._tail & self._mask
        need = size if self._cap - off >= size else size + self._cap - off
        if self._space_for(need):
            return
        dl = _deadline_ns(deadline, timeout)
        w = self._wait
        now = time.monotonic_ns()
        if w.spin_ns:
            end = now + w.spin_ns
            n = 0
            while True:
                if self._space_for(need):
                    return
                n += 1
                if n & 63 == 0 and time.monotonic_ns() > end:
                    break
        if w.yield_ns:
            end = time.monotonic_ns() + w.yield_ns
            while time.monotonic_ns() < end:
                os.sched_yield()
                if self._space_for(need):
                    return
        i = self._i
        while True:
            if i[_I_CONS_STATE]:
                raise RingPeerClosed("consumer closed the ring")
            if not self.ring.consumer_alive():
                raise RingPeerDead("consumer process is gone")
            self.ring.check()
            sleep = w.park_ns
            if dl is not None:
                left = dl - time.monotonic_ns()
                if left <= 0:
                    if self._space_for(need):
                        return
                    raise RingTimeout("deadline passed waiting for space")
                sleep = min(sleep, left)
            seq = i[_I_PROD_FUTEX]
            i[_I_PROD_PARKED] = 1
            _full_fence()  # store parked -> load head: Dekker with Consumer.commit
            if self._space_for(need):
                i[_I_PROD_PARKED] = 0
                return
            self.parks += 1
            try:
                _futex_wait(self._prod_futex_addr, seq, sleep, self._ts, self._ts_addr)
            finally:
                i[_I_PROD_PARKED] = 0
            if self._space_for(need):
                return

    def close(self) -> None:
        """Publish, mark the producer closed and wake the consumer, which
        drains what was published and then gets RingPeerClosed."""
        if self.ring._mv is None:
            return
        self.publish()
        i = self._i
        i[_I_PROD_STATE] = 1
        i[_I_CONS_FUTEX] = (i[_I_CONS_FUTEX] + 1) & 0xFFFFFFFF
        _futex_wake(self._cons_futex_addr, 1)


# ---------------------------------------------------------------------------
# Consumer.


class Consumer:
    """The reading side.  next() borrows records in place; commit() hands
    every borrowed record back to the producer with one store of head."""

    def __init__(self, ring: Ring, wait: WaitConfig = DEFAULT_WAIT, fence: bool = True):
        q, i = ring._q, ring._i
        t, h = q[_Q_TAIL], q[_Q_HEAD]
        ring._check_positions(t, h)
        pid, start = _self()
        q[_Q_CONS_START] = start
        i[_I_CONS_PID] = pid
        i[_I_CONS_STATE] = 0
        self.ring = ring
        self._q, self._i, self._dq, self._rdata = q, i, ring._dq, ring._rdata
        self._cap, self._mask, self._max = ring.capacity, ring._mask, ring.max_record
        self._head = h  # local: records up to here were handed out
        self._committed = h
        self._tail_cache = h
        self._wait = wait
        self._fence = fence
        self._cons_futex_addr = ring._base + OFF_CONS_FUTEX
        self._prod_futex_addr = ring._base + OFF_PROD_FUTEX
        self._ts = _Timespec()
        self._ts_addr = ctypes.addressof(self._ts)
        self.parks = 0

    def _load_tail(self) -> None:
        # One aligned 8-byte load.  TSO: later loads of record bytes are not
        # satisfied before it (acquire).
        t = self._q[_Q_TAIL]
        c = self._committed
        if t < self._tail_cache or t < c or t - c > self._cap or t & 7:
            raise RingCorrupt(f"producer tail {t}, consumer at {c} (capacity {self._cap})")
        self._tail_cache = t

    def next(self):
        """Borrow the next published record, or None if none is published.
        The payload is a read-only memoryview of ring memory, valid until
        commit(); several records may be borrowed before one commit().
        Raises RingCorrupt on malformed contents (the ring is then unusable)."""
        head = self._head
        reloaded = False
        cap = self._cap
        while True:
            if head == self._tail_cache:
                if reloaded:
                    self._head = head
                    return None
                self._load_tail()
                reloaded = True
                continue
            off = head & self._mask
            contig = cap - off
            avail = self._tail_cache - head
            if contig < RECORD_HEADER_SIZE:  # tail gap, skipped by both sides
                if avail < contig:
                    raise RingCorrupt(f"tail ends inside the {contig}-byte gap at the end of the ring")
                head += contig
                continue
            if avail > contig:
                avail = contig
            if avail < RECORD_HEADER_SIZE:
                raise RingCorrupt(f"{avail} bytes published, less than a record header (at position {head})")
            w = off >> 3
            w0 = self._dq[w]
            length = w0 & 0xFFFFFFFF
            typ = (w0 >> 32) & 0xFFFF
            total = RECORD_HEADER_SIZE + ((length + 7) & ~7)
            if typ == 0 or total > avail or (total > self._max and typ != TYPE_PAD):
                _check_record(length, typ, avail, self._max, head)  # raises with the detail
            if typ == TYPE_PAD:
                if total != contig:
                    raise RingCorrupt(
                        f"pad record of {total} bytes at position {head} does not reach "
                        f"the end of the ring ({contig} bytes)"
                    )
                head += total
                continue
            self._head = head + total
            start = off + RECORD_HEADER_SIZE
            return _new_record(Record, (typ, w0 >> 48, self._dq[w + 1], self._rdata[start : start + length]))

    def commit(self) -> None:
        """Release every borrowed record to the producer with one store of
        head, and wake the producer only if it waits for space."""
        h = self._head
        if h == self._committed:
            return
        # TSO: the payload reads above completed before this store (load->store order).
        self._q[_Q_HEAD] = h
        self._committed = h
        # Dekker handshake with Producer.wait_space: the load of the producer's
        # parked flag must not pass the head store.  fence=False saves ~0.3 us
        # per commit; a lost wake-up then costs <= one park slice of the
        # producer (it waits only when the ring is full).
        if self._fence:
            _fence_acquire()
            _fence_release()
        i = self._i
        if i[_I_PROD_PARKED]:
            i[_I_PROD_FUTEX] = (i[_I_PROD_FUTEX] + 1) & 0xFFFFFFFF
            _futex_wake(self._prod_futex_addr, 1)

    def read(self):
        """Copying form of next(): returns a Record with a bytes payload and
        commits, or None if nothing is published."""
        rec = self.next()
        if rec is None:
            return None
        rec = _new_record(Record, (rec[0], rec[1], rec[2], rec[3].tobytes()))
        self.commit()
        return rec

    def available(self) -> bool:
        """Whether a record may be published past what was read."""
        return self._q[_Q_TAIL] != self._head

    def wait(self, deadline: float | None = None, timeout: float | None = None) -> None:
        """Block until a record is published.  deadline is a time.monotonic()
        value, timeout relative seconds; both None waits while the producer
        lives.  Records published before the producer closed or died are
        always delivered first; then RingPeerClosed / RingPeerDead.  Raises
        RingTimeout when the deadline passes."""
        q = self._q
        head = self._head
        if q[_Q_TAIL] != head:
            return
        dl = _deadline_ns(deadline, timeout)
        w = self._wait
        if w.spin_ns:
            end = time.monotonic_ns() + w.spin_ns
            if dl is not None and dl < end:
                end = dl
            n = 0
            while True:
                if q[_Q_TAIL] != head:
                    return
                n += 1
                if n & 63 == 0 and time.monotonic_ns() > end:
                    break
        if w.yield_ns:
            end = time.monotonic_ns() + w.yield_ns
            if dl is not None and dl < end:
                end = dl
            while time.monotonic_ns() < end:
                os.sched_yield()
                if q[_Q_TAIL] != head:
                    return
        i = self._i
        ring = self.ring
        while True:
            if i[_I_PROD_STATE]:
                if q[_Q_TAIL] != head:
                    return
                raise RingPeerClosed("producer closed the ring")
            if not ring.producer_alive():
                if q[_Q_TAIL] != head:
                    return
                raise RingPeerDead(f"producer process {i[_I_PROD_PID]} is gone")
            ring.check()
            sleep = w.park_ns
            if dl is not None:
                left = dl - time.monotonic_ns()
                if left <= 0:
                    if q[_Q_TAIL] != head:
                        return
                    raise RingTimeout("deadline passed waiting for a record")
                sleep = min(sleep, left)
            # Dekker handshake with Producer.publish: read the futex sequence,
            # announce parked=1, full fence (store parked -> load tail), re-check.
            seq = i[_I_CONS_FUTEX]
            i[_I_CONS_PARKED] = 1
            _full_fence()
            if q[_Q_TAIL] != head:
                i[_I_CONS_PARKED] = 0
                return
            self.parks += 1
            try:
                _futex_wait(self._cons_futex_addr, seq, sleep, self._ts, self._ts_addr)
            finally:
                i[_I_CONS_PARKED] = 0
            if q[_Q_TAIL] != head:
                return

    def recv(self, deadline: float | None = None, timeout: float | None = None):
        """wait() then read(): the next record as a copy."""
        while True:
            rec = self.read()
            if rec is not None:
                return rec
            self.wait(deadline, timeout)

    def close(self) -> None:
        """Commit, mark the consumer closed and wake the producer."""
        if self.ring._mv is None:
            return
        self.commit()
        i = self._i
        i[_I_CONS_STATE] = 1
        i[_I_PROD_FUTEX] = (i[_I_PROD_FUTEX] + 1) & 0xFFFFFFFF
        _futex_wake(self._prod_futex_addr, 1)
