"""Python client of the ringside sidecar: one attached session.

The Python twin of the Go package github.com/ringside-kv/ringside/connector
(connector/client.go): it attaches over the sidecar's Unix socket
(SOCK_SEQPACKET, one message per datagram), then speaks the ring protocol of
docs/protocol.md: this process is the producer of the submission ring and the
consumer of the completion ring. The socket stays open for the life of the
session; its closing (including by the kernel when the process dies) tells
the sidecar that the process is gone, and the sidecar then reclaims every
lease, region and budget the session held.

    with Session.attach(instance="engine-a", model="llama", layout="bf16/16/HND") as s:
        s.register_region(1, base, length, page_size, page_count)
        s.put_hashes(1, digests)
        n = s.lookup(1, 0, count)

Errors
------
Every call has a deadline: the session ``timeout`` (seconds, default 5). A
sidecar that is slow raises :class:`RingsideTimeout`; one that is gone
(killed, shut down, rings unusable) raises :class:`RingsideUnavailable`. A
call never hangs. A non-OK reply raises :class:`RingsideError` with the
reply's ``status`` and ``message``. All three are ``RingsideError``.

**An engine plugin must treat any RingsideError as a cache miss, never as a
failed request**: the cache is an optimisation, and the request can always be
served by recomputing the KV blocks. After RingsideUnavailable the session is
dead (every later call raises it at once): drop it, and attach again later if
you like. After RingsideTimeout the session stays usable: the late reply is
discarded when it arrives.

Arguments that cannot be encoded (a page index past u32, digests that are not
a multiple of the digest width, a payload larger than the ring) raise
:class:`ringside.schema.SchemaError` or :class:`ringside.ring.RingTooLarge`
(both ``ValueError``): those are programming errors, not cache misses.

A Session is not thread-safe: one thread drives it, as one engine process
drives its session.
"""

from __future__ import annotations

import logging as _logging
import os
import socket as _socket
import struct
import time
from typing import Dict, Literal, Optional, Sequence, Tuple, overload

from . import ring as _ring
from . import schema as _schema
from .schema import (
    REGION_HOST_PROCESS,
    ROLE_CLIENT,
    ROLE_SCHEDULER,
    ROLE_WORKER,
    AttachReply,
    ChangesReply,
    LeaseReply,
    RingsideError,
    SnapshotReply,
    State,
    Status,
    StoreReply,
)

DEFAULT_SOCKET = "/dev/shm/ringside/ringside.sock"

__all__ = [
    "DEFAULT_SOCKET",
    "Session",
    "RingsideError",
    "RingsideTimeout",
    "RingsideUnavailable",
    "LeaseReply",
    "StoreReply",
    "ChangesReply",
    "SnapshotReply",
    "AttachReply",
    "State",
    "Status",
    "ROLE_CLIENT",
    "ROLE_SCHEDULER",
    "ROLE_WORKER",
    "REGION_HOST_PROCESS",
]


_log = _logging.getLogger("ringside.client")

_RETAIN_REPLY = _schema.TYPE_RETAIN | _schema.REPLY_BIT


class RingsideUnavailable(RingsideError):
    """The sidecar is gone or unusable (socket refused, peer dead or closed,
    ring corrupt). ``status`` is None: no reply carried it. Treat as a miss."""

    def __init__(self, message: str):
        super().__init__(None, message)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return "ringside: unavailable: " + self.message


class RingsideTimeout(RingsideError, TimeoutError):
    """The call's deadline passed before the sidecar answered. ``status`` is
    None. Treat as a miss; the session stays usable."""

    def __init__(self, message: str):
        super().__init__(None, message)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return "ringside: timeout: " + self.message


_MAX_PENDING = 1 << 16  # unclaimed out-of-order replies kept (as Go)
_MAX_ABANDONED = 1 << 12  # seqs of timed-out calls whose late replies are dropped
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF

_UNAVAILABLE = (_ring.RingPeerDead, _ring.RingPeerClosed, _ring.RingCorrupt, _ring.RingClosed, _ring.RingBadHeader)


def _msg(mv, off: int) -> str:
    return bytes(mv[off:]).decode("utf-8", "surrogateescape") if len(mv) > off else ""


def _malformed(e: Exception) -> RingsideError:
    return RingsideError(Status.MALFORMED, "malformed reply from the sidecar: %s" % e)


# Decoders applied to the reply payload (a memoryview of ring memory) before
# the slot is handed back. Each returns the value or raises RingsideError.


def _dec_value(mv) -> int:
    try:
        status, _z, value = _schema.REPLY.unpack_from(mv, 0)
    except struct.error as e:
        raise _malformed(e) from None
    if status:
        raise RingsideError(status, _msg(mv, 16))
    return value


def _dec_lease(mv) -> LeaseReply:
    try:
        status, state, lease, blocks, _z = _schema.LEASE_REPLY.unpack_from(mv, 0)
    except struct.error as e:
        raise _malformed(e) from None
    msg = _msg(mv, 24) if len(mv) > 24 else ""
    if status:
        raise RingsideError(status, msg)
    return LeaseReply(status, state, lease, blocks, msg)


def _dec_store(mv) -> StoreReply:
    try:
        r = _schema.decode_store_reply(mv)
    except _schema.SchemaError as e:
        raise _malformed(e) from None
    if r.status:
        raise RingsideError(r.status, r.message)
    return r


def _dec_changes(mv) -> ChangesReply:
    # A non-OK ChangesReply may be a bare Reply (the sidecar's generic error
    # path): look at the status word first.
    try:
        status = _schema.reply_status(mv)
        if status:
            raise RingsideError(status, _msg(mv, 16) if len(mv) >= 16 else "")
        return _schema.decode_changes_reply(mv)
    except _schema.SchemaError as e:
        raise _malformed(e) from None


def _dec_snapshot(mv) -> SnapshotReply:
    # As _dec_changes: a non-OK reply may be a bare Reply (a sidecar that
    # does not know Snapshot answers status 2 that way).
    try:
        status = _schema.reply_status(mv)
        if status:
            msg = ""
            try:
                _schema.decode_snapshot_reply(mv)  # the sidecar's SnapshotReply: no message
            except _schema.SchemaError:
                msg = _msg(mv, 16) if len(mv) >= 16 else ""
            raise RingsideError(status, msg)
        return _schema.decode_snapshot_reply(mv)
    except _schema.SchemaError as e:
        raise _malformed(e) from None


def _dec_events(mv):
    # As _dec_snapshot: a sidecar without the event records answers status 2
    # in a bare Reply.
    try:
        status = _schema.reply_status(mv)
        if status:
            msg = ""
            try:
                _schema.decode_events_reply(mv)
            except _schema.SchemaError:
                msg = _msg(mv, 16) if len(mv) >= 16 else ""
            raise RingsideError(status, msg)
        return _schema.decode_events_reply(mv)
    except _schema.SchemaError as e:
        raise _malformed(e) from None


def _dec_bytes(mv) -> bytes:
    return mv.tobytes()


def value_reply(payload) -> Tuple[int, int, str]:
    """A common Reply's (status, value, message) (protocol.md section 6.1),
    from the bytes await_reply or try_reply returned. Raises RingsideError
    (MALFORMED) for a payload too short to be one."""
    try:
        status, _z, value = _schema.REPLY.unpack_from(payload, 0)
    except struct.error as e:
        raise _malformed(e) from None
    return status, value, _msg(memoryview(payload), 16) if status else ""


def _retain_payload(batch: int, start: int, count: int, ttl_ms: int, priority: int, end: bool, owner: int) -> bytes:
    """A Retain record's payload (the checks of Session.retain)."""
    if not 0 <= owner <= _U64_MAX:
        raise ValueError("retain owner %r not in 0..2**64-1" % (owner,))
    if end:
        return _schema.encode_retain(batch, start, count, 0, 0, _schema.RETAIN_FLAG_END, owner)
    if not 0 <= priority <= _schema.MAX_RETAIN_PRIORITY:
        raise ValueError("retain priority %r not in 0..%d" % (priority, _schema.MAX_RETAIN_PRIORITY))
    if ttl_ms < 1:
        raise ValueError("retain ttl_ms %r must be at least 1 (end=True ends a retention)" % (ttl_ms,))
    return _schema.encode_retain(batch, start, count, min(int(ttl_ms), _U32_MAX), priority, 0, owner)


class Session:
    """One attached session. Create it with :meth:`Session.attach`."""

    def __init__(
        self, sock: _socket.socket, info: AttachReply, sub, cmp, prod, cons, *, digest_width: int, timeout: float
    ):
        self._sock = sock
        self.info = info  #: the sidecar's AttachReply (session id, epoch, pool geometry)
        self._sub, self._cmp = sub, cmp
        self._prod, self._cons = prod, cons
        self._width = digest_width
        self.timeout = timeout
        self._seq = 0
        self._pending: Dict[int, bytes] = {}
        self._abandoned: Dict[int, None] = {}
        self.quiet_failures = 0  # failed fire-and-forget requests (send)
        # False once the sidecar answered a Retain with UNKNOWN_TYPE (it
        # predates it): retain() then sends nothing for the session.
        self.retain_supported = True
        self.last_quiet_failure: Optional[tuple] = None  # (status, message) of the last one
        self._dead: Optional[str] = None
        self._peer_gone = False  # the sidecar closed the session's rings, or its process is gone
        self._closed = False
        self._unwoken = False  # records published with wake=False since the last wake
        # The sidecar's socket (attach sets it): register_fd_region connects to it.
        self.socket_path: Optional[str] = None

    # -- attach / detach -------------------------------------------------------

    @classmethod
    def attach(
        cls,
        socket: str = DEFAULT_SOCKET,
        *,
        instance: str,
        model: str,
        layout: str,
        salt: str = "",
        role: int = ROLE_CLIENT,
        rank: int = 0,
        world_size: int = 1,
        digest_width: int = 32,
        ring_capacity: int = 0,
        timeout: float = 5.0,
        wait: Optional[_ring.WaitConfig] = None,
    ) -> "Session":
        """Attach to the sidecar listening on the socket path.

        Raises RingsideError (status and message of the refusal),
        RingsideUnavailable (no sidecar there) or RingsideTimeout; SchemaError
        for an invalid request (empty instance, rank >= world size, ...)."""
        socket_path = socket
        if timeout is None or timeout <= 0:
            raise ValueError("timeout must be positive seconds")
        req = _schema.AttachRequest(
            _schema.VERSION, role, rank, world_size, digest_width, ring_capacity, instance, model, layout, salt
        )
        _schema.validate_attach_request(req)
        msg = _schema.encode_attach_request(*req)
        deadline = time.monotonic() + timeout
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)  # close-on-exec by default
        try:
            try:
                sock.settimeout(timeout)
                sock.connect(socket_path)
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sock.send(msg)
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                # Protocol version 2: a successful reply carries the two
                # rings as descriptors (submission first).
                b, fds, _, _ = _socket.recv_fds(sock, 8192, 2)
            except _socket.timeout:
                raise RingsideTimeout("attach to %s: no answer within %.3gs" % (socket_path, timeout)) from None
            except OSError as e:
                raise RingsideUnavailable("attach to %s: %s" % (socket_path, e)) from None
            try:
                if not b:
                    raise RingsideUnavailable("attach to %s: the sidecar closed the connection" % socket_path)
                try:
                    info = _schema.decode_attach_reply(b)
                except _schema.SchemaError as e:
                    raise _malformed(e) from None
                if info.status != 0:
                    raise RingsideError(info.status, info.message)
                if len(fds) != 2:
                    raise RingsideUnavailable("attach reply carried %d ring descriptors, want 2" % len(fds))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            sub = cmp = prod = cons = None
            try:
                sub_fd, cmp_fd = fds
                try:
                    sub = _ring.open_fd(sub_fd, info.epoch, info.submission_ring)
                except BaseException:
                    os.close(cmp_fd)
                    raise
                cmp = _ring.open_fd(cmp_fd, info.epoch, info.completion_ring)
                w = wait if wait is not None else _ring.DEFAULT_WAIT
                prod = _ring.Producer(sub, w)
                cons = _ring.Consumer(cmp, w)
            except (_ring.RingError, OSError) as e:
                for r in (sub, cmp):
                    if r is not None:
                        r.close()
                raise RingsideUnavailable("opening the session rings: %s" % e) from None
            sock.setblocking(True)  # only its closing matters from now on
            s = cls(sock, info, sub, cmp, prod, cons, digest_width=digest_width, timeout=timeout)
            s.socket_path = socket_path
            return s
        except BaseException:
            sock.close()
            raise

    def close(self) -> bool:
        """Detach cleanly; if the sidecar is gone or slow, just drop the
        session (never raises). Idempotent. Returns whether the sidecar is
        known to have ended the session (its Detach reply came, or it is
        gone): only then has it let go of what the session shared with it
        (regions, interprocess events); False if it did not answer within
        min(timeout, 1 s), or the session was closed before."""
        if self._closed:
            return False
        ended = False
        try:
            if self._dead is None:
                try:
                    self._call(_schema.TYPE_DETACH, b"", _dec_bytes, min(self.timeout, 1.0))
                    ended = True
                except Exception:  # noqa: BLE001 (closing must never raise)
                    ended = self._peer_gone
            else:
                ended = self._peer_gone
        finally:
            self._closed = True
            self._release()
        return ended

    def begin_detach(self) -> Optional[int]:
        """Publish a Detach and return its correlation number, without
        waiting for ring space or for the reply; None when it could not be
        published (the session is dead or closed, or its ring is full).
        Follow it with :meth:`detached`, then :meth:`abandon`."""
        if self._dead is not None or self._closed:
            return None
        self._seq = seq = self._seq + 1
        try:
            if not self._prod.put(b"", _schema.TYPE_DETACH, seq, True):
                self._prod.write(b"", _schema.TYPE_DETACH, 0, seq, time.monotonic(), wake=True)
        except _UNAVAILABLE + (_ring.RingTimeout,) as e:
            self._fail(e)
            return None
        return seq

    def detached(self, seq: Optional[int]) -> bool:
        """Whether the sidecar has ended this session, never waiting: the
        reply to the Detach published as seq (:meth:`begin_detach`; None:
        none was) arrived, or the sidecar closed the session's rings (it
        does so only after ending it) or exited. From then on no store of
        the session can be committed any more (docs/protocol.md, section
        8.1), so the pages its stores read may be reused."""
        if self._peer_gone:
            return True
        if seq is None or self._dead is not None or self._closed:
            return False
        try:
            return self.try_reply(seq) is not None
        except RingsideError:
            return self._peer_gone

    @property
    def peer_gone(self) -> bool:
        """The sidecar closed the session's rings, or its process is gone."""
        return self._peer_gone

    def gone(self) -> bool:
        """Whether the sidecar closed this session's rings or exited, never
        waiting: it closes them only once it has ended the session and
        withdrawn the session's copies not yet issued (unlike the Detach
        reply, which it sends first). Reads what arrived meanwhile (replies
        are kept for their callers); False once this side closed or
        abandoned the session, which can then no longer be told."""
        if self._peer_gone:
            return True
        if self._dead is not None or self._closed:
            return False
        try:
            self.try_reply(0)  # no request has seq 0: drains the completion ring
            self._cons.wait(timeout=0)  # raises once the ring is drained and closed
        except RingsideError:
            pass
        except _ring.RingTimeout:
            pass
        except _UNAVAILABLE as e:
            self._fail(e)
        return self._peer_gone

    def abandon(self) -> None:
        """Drop the session without detaching, as a crashed process would:
        the socket closes and the sidecar reclaims what the session held."""
        self._closed = True
        self._dead = self._dead or "session abandoned"
        self._release()

    def _release(self) -> None:
        for side in (self._prod, self._cons):
            try:
                side.close()
            except Exception:  # noqa: BLE001 (closing must never raise)
                pass
        for r in (self._sub, self._cmp):
            try:
                r.close()
            except Exception:  # noqa: BLE001 (closing must never raise)
                pass
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_payload(self) -> int:
        """The largest request payload the session's rings carry."""
        return self._sub.max_payload

    @property
    def digest_width(self) -> int:
        return self._width

    # -- raw records -----------------------------------------------------------

    def _check(self) -> None:
        if self._dead is not None:
            raise RingsideUnavailable(self._dead)
        if self._closed:
            raise RingsideUnavailable("session closed")

    def _fail(self, e: Exception) -> RingsideError:
        if isinstance(e, _ring.RingTimeout):
            return RingsideTimeout(str(e) or "deadline passed")
        if isinstance(e, (_ring.RingPeerDead, _ring.RingPeerClosed)):
            self._peer_gone = True
        self._dead = "%s: %s" % (type(e).__name__, e)
        return RingsideUnavailable(self._dead)

    def submit(self, type: int, payload=b"", wake: bool = True) -> int:  # noqa: A002 (mirrors the record field)
        """Send one request record without waiting; returns its correlation
        number for :meth:`await_reply`. Waits for ring space at most the
        session timeout.

        wake=False publishes the record without waking a parked sidecar loop
        (a futex wake costs a system call, and tens of microseconds on a
        virtual machine): it is handled when something wakes the loop, at the
        latest at the end of the loop's current park slice (10 ms). Every
        wait for a reply (await_reply, the synchronous calls) and kick() wake
        it first, so a pipelined request is never left waiting for the slice."""
        if self._dead is not None or self._closed:
            self._check()
        self._seq = seq = self._seq + 1
        prod = self._prod
        try:
            if not prod.put(payload, type, seq, wake):
                prod.write(payload, type, 0, seq, time.monotonic() + self.timeout, wake=wake)
        except _UNAVAILABLE + (_ring.RingTimeout,) as e:
            raise self._fail(e) from None
        if not wake:
            self._unwoken = True
        return seq

    def kick(self) -> None:
        """Wake the sidecar's loop if records were published without waking
        it (submit/send with wake=False) and it is parked."""
        if self._unwoken:
            self._unwoken = False
            try:
                self._prod.wake_consumer()
            except OSError as e:
                raise self._fail(e) from None

    def drain(self) -> None:
        """Consume every reply that has arrived, without waiting: replies to
        fire-and-forget sends are discarded, others kept for their callers.
        Call it now and then on a session that mostly sends, so that the
        completion ring never fills."""
        self.try_reply(-1)  # no request has seq -1: every reply that arrived is stashed or dropped

    @overload
    def await_reply(self, seq: int, timeout: Optional[float] = None, keep: Literal[False] = False) -> bytes: ...

    @overload
    def await_reply(self, seq: int, timeout: Optional[float] = None, keep: bool = False) -> Optional[bytes]: ...

    def await_reply(self, seq: int, timeout: Optional[float] = None, keep: bool = False) -> Optional[bytes]:
        """The reply payload of request seq (whatever its status), waiting at
        most timeout seconds (default: the session timeout). Replies to other
        requests that arrive first are kept for their own await_reply.

        When the time is up it raises RingsideTimeout and forgets seq; with
        keep=True it returns None instead and seq can be awaited again (a
        bounded wait, e.g. a few microseconds within a scheduler step)."""
        p = self._pending.pop(seq, None)
        if p is not None:
            return p
        self._check()
        if not 0 < seq <= self._seq:
            raise ValueError("seq %d was never submitted" % seq)
        return self._await(seq, _dec_bytes, self.timeout if timeout is None else timeout, keep)

    def forget(self, seq: int) -> None:
        """Give up on the reply of request seq: it is discarded when it
        arrives (or now, if it has)."""
        if self._pending.pop(seq, None) is None:
            self._abandon(seq)

    def send(self, type: int, payload=b"", wake: bool = True) -> None:  # noqa: A002
        """Send one request whose reply nobody waits for (fire and forget),
        with seq 0: the sidecar answers it only if it fails (protocol.md
        section 3.2), and such a reply is counted in ``quiet_failures`` and
        dropped. Records are handled in order, so a later request sees this
        one's effect (e.g. a PutHashes before the Lookup that uses the
        batch); an error in it also shows up as an error of the requests
        that depend on it. wake: see submit()."""
        if self._dead is not None or self._closed:
            self._check()
        prod = self._prod
        try:
            if not prod.put(payload, type, 0, wake):
                prod.write(payload, type, 0, 0, time.monotonic() + self.timeout, wake=wake)
        except _UNAVAILABLE + (_ring.RingTimeout,) as e:
            raise self._fail(e) from None
        if not wake:
            self._unwoken = True

    def sidecar_pid(self) -> int:
        """The sidecar's pid as the kernel recorded it for the socket
        (SO_PEERCRED), or 0 when unknown."""
        try:
            raw = self._sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
            return int.from_bytes(raw[0:4], "little")
        except OSError:
            return 0

    def allow_sidecar_ptrace(self) -> bool:
        """Let the sidecar copy this process's memory (process_vm_readv /
        process_vm_writev) under Yama ptrace_scope 1 without any capability:
        prctl(PR_SET_PTRACER, sidecar pid). A no-op where Yama is absent;
        returns whether the call succeeded."""
        pid = self.sidecar_pid()
        if pid <= 0:
            return False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PTRACER = 0x59616D61
            return libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) == 0
        except (OSError, AttributeError):
            return False

    def try_reply(self, seq: int):
        """The reply payload of request seq if it has arrived, else None;
        never waits. Replies to other requests are kept for their callers."""
        p = self._pending.pop(seq, None)
        if p is not None:
            return p
        self._check()
        cons = self._cons
        try:
            while True:
                rec = cons.next()
                if rec is None:
                    cons.commit()
                    return None
                rseq = rec[2]
                if rseq == seq:
                    try:
                        return rec[3].tobytes()
                    finally:
                        cons.commit()
                self._stash(rseq, rec[3], rec[0])
        except _UNAVAILABLE as e:
            raise self._fail(e) from None

    def _await(self, seq: int, decode, timeout: float, keep: bool = False):
        deadline = time.monotonic() + timeout
        cons = self._cons
        try:
            while True:
                rec = cons.next()
                if rec is None:
                    cons.commit()
                    # About to wait: wake the sidecar for records published
                    # without waking it (only now: when the reply is already
                    # there, no system call is made).
                    self.kick()
                    cons.wait(deadline)
                    continue
                rseq = rec[2]
                if rseq == seq:
                    try:
                        return decode(rec[3])
                    finally:
                        cons.commit()
                self._stash(rseq, rec[3], rec[0])
        except _UNAVAILABLE as e:
            raise self._fail(e) from None
        except _ring.RingTimeout:
            if keep:
                return None
            self._abandon(seq)
            raise RingsideTimeout("no reply to request %d within %.3gs" % (seq, timeout)) from None

    def _stash(self, seq: int, payload, typ: int = 0) -> None:
        if seq == 0:
            if typ == _RETAIN_REPLY and len(payload) >= 4 and _schema.reply_status(payload) == Status.UNKNOWN_TYPE:
                # A sidecar that predates Retain (protocol.md section 13):
                # not a failure, the hint is off for the session.
                self.retain_supported = False
                return
            # A fire-and-forget request failed (an old sidecar also answers
            # the ones that succeeded: status 0, not counted).
            if len(payload) >= 4 and _schema.reply_status(payload):
                self.quiet_failures += 1
                self.last_quiet_failure = (
                    _schema.reply_status(payload),
                    _msg(payload, 16) if len(payload) >= 16 else "",
                )
            return
        if seq in self._abandoned:
            del self._abandoned[seq]
            return
        if len(self._pending) >= _MAX_PENDING:
            # Bounded: forget the oldest unclaimed reply (its await_reply times out).
            del self._pending[next(iter(self._pending))]
        self._pending[seq] = payload.tobytes()

    def _abandon(self, seq: int) -> None:
        if len(self._abandoned) >= _MAX_ABANDONED:
            del self._abandoned[next(iter(self._abandoned))]
        self._abandoned[seq] = None

    def _call(self, typ: int, payload, decode, timeout: Optional[float] = None):
        """submit + await with one deadline; decode runs on the ring payload."""
        if self._dead is not None or self._closed:
            self._check()
        self._seq = seq = self._seq + 1
        t = self.timeout if timeout is None else timeout
        try:
            self._prod.write(payload, typ, 0, seq, time.monotonic() + t)
        except _UNAVAILABLE + (_ring.RingTimeout,) as e:
            raise self._fail(e) from None
        self._unwoken = False  # the write woke the loop: it handles earlier records first
        return self._await(seq, decode, t)

    # -- requests --------------------------------------------------------------

    def put_hashes(self, batch: int, digests, append: bool = False) -> int:
        """Register digests (joined bytes, a multiple of the digest width) as
        batch, or append them to it; returns the batch length in hashes."""
        p = _schema.encode_put_hashes(batch, digests, self._width, _schema.FLAG_APPEND if append else 0)
        return self._call(_schema.TYPE_PUT_HASHES, p, _dec_value)

    def drop_hashes(self, batch: int) -> None:
        """Forget a batch."""
        self._call(_schema.TYPE_DROP_HASHES, _schema.encode_id(batch), _dec_value)

    def lookup(self, batch: int, start: int = 0, count: int = 0) -> int:
        """Number of leading blocks of the view that the sidecar holds."""
        try:
            p = _schema.LOOKUP.pack(batch, start, count)
        except struct.error:
            p = _schema.encode_lookup(batch, start, count)  # raises SchemaError
        return self._call(_schema.TYPE_LOOKUP, p, _dec_value)

    def acquire(self, batch: int, start: int, count: int, ttl: Optional[float] = None) -> LeaseReply:
        """Pin the leading present blocks of the view under a lease. ttl in
        seconds (None: the sidecar default). A LeaseReply with state MISS and
        lease 0 means nothing could be pinned."""
        ttl_ms = 0
        if ttl is not None and ttl > 0:
            ttl_ms = min(max(int(ttl * 1000), 1), _U32_MAX)
        return self._call(_schema.TYPE_ACQUIRE, _schema.encode_acquire(batch, start, count, ttl_ms), _dec_lease)

    def retain(
        self,
        batch: int,
        start: int,
        count: int,
        ttl_ms: int,
        priority: int = 0,
        end: bool = False,
        wait: bool = True,
        *,
        owner: int = 0,
    ) -> Optional[int]:
        """Retention hint (docs/protocol.md section 5.14): keep the leading
        present blocks of the view for ttl_ms milliseconds at priority 0..3
        (3 is kept longest; retained blocks are evicted after every block
        without retention, never instead of a store), or with end=True end
        the retention this uid and owner set on the view's blocks (ttl_ms
        and priority are then ignored). owner (a u64 the client chooses,
        e.g. a hash of a caller's session id; 0: none) is who holds the
        retention within the uid: a block retained by another owner, or
        another uid, is left alone and not counted, and only the same uid
        and owner renew, re-prioritise or end a retention. Returns the
        number of blocks whose retention was set, renewed or ended. With
        wait=False the request is sent fire and forget (seq 0) and None is
        returned: a failure is counted in quiet_failures. A sidecar that
        does not know Retain (UNKNOWN_TYPE) turns retain_supported off for
        the session, without raising: from then on retain() sends nothing
        and returns None. Other refusals raise RingsideError: TOO_LARGE when
        the blocks the uid retains take its share of the pool for retention
        (--limits.retain-share) or ttl_ms is past the sidecar's
        --retain.max-ttl; MALFORMED for a non-zero owner from a sidecar that
        predates the owner (owner 0 is sent in the form every sidecar that
        knows Retain reads). ValueError for a priority outside 0..3, a
        ttl_ms below 1 without end, or an owner outside 0..2**64-1 (nothing
        is sent)."""
        if not self.retain_supported:
            return None
        p = _retain_payload(batch, start, count, ttl_ms, priority, end, owner)
        if not wait:
            self.send(_schema.TYPE_RETAIN, p)
            return None
        try:
            return self._call(_schema.TYPE_RETAIN, p, _dec_value)
        except RingsideError as e:
            if e.status != Status.UNKNOWN_TYPE:
                raise
            self.retain_supported = False
            return None

    def retain_submit(
        self, batch: int, start: int, count: int, ttl_ms: int, priority: int = 0, end: bool = False, *, owner: int = 0
    ) -> int:
        """retain() without waiting, for a caller that wants the sidecar's
        answer later: its seq for try_reply/await_reply (decode the reply
        with :func:`value_reply`), or 0 when retain_supported is off (nothing
        is sent). The reply of a sidecar that predates Retain has status
        UNKNOWN_TYPE; the caller then turns retain_supported off. Raises
        ValueError like retain()."""
        if not self.retain_supported:
            return 0
        return self.submit(_schema.TYPE_RETAIN, _retain_payload(batch, start, count, ttl_ms, priority, end, owner))

    def poll(self, lease: int) -> LeaseReply:
        """A lease's current state."""
        try:
            p = _schema.ID_REQUEST.pack(lease)
        except struct.error:
            p = _schema.encode_poll(lease)
        return self._call(_schema.TYPE_POLL, p, _dec_lease)

    def release(self, lease: int) -> None:
        """End a lease (in any state)."""
        self._call(_schema.TYPE_RELEASE, _schema.encode_release(lease), _dec_value)

    def register_region(
        self,
        region_id: int,
        base: int,
        length: int,
        page_size: int,
        page_count: int,
        segments: Sequence[Tuple[int, int, int]] = (),
        pid: Optional[int] = None,
        kind: int = REGION_HOST_PROCESS,
        extra=b"",
    ) -> None:
        """Register engine memory (by default host memory of this process)."""
        p = _schema.encode_register_region(
            region_id, kind, os.getpid() if pid is None else pid, base, length, page_size, page_count, segments, extra
        )
        self._call(_schema.TYPE_REGISTER_REGION, p, _dec_value)

    def register_fd_region(
        self,
        region_id: int,
        base: int,
        length: int,
        page_size: int,
        page_count: int,
        segments: Sequence[Tuple[int, int, int]],
        extra,
        fds: Sequence[int],
        pid: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Register GPU memory shared by file descriptor (REGION_CUDA_FD,
        docs/protocol.md section 5.5.2): a RegionDescriptors message on a
        connection of its own to the sidecar's socket, carrying fds (the
        descriptors the FDExtra ``extra`` names by index, in that order)
        with SCM_RIGHTS; the sidecar answers on that connection. The
        descriptors stay the caller's: close them once this returns or
        raises (the sidecar has its own copies, which it closes once it
        imported them). Raises RingsideError with the refusal's status and
        message; UNKNOWN_TYPE when the sidecar predates descriptor regions
        (it answers the message as a malformed attach); RingsideTimeout or
        RingsideUnavailable as any call."""
        self._check()
        if self.socket_path is None:
            raise RingsideUnavailable("register_fd_region: the session's socket path is unknown")
        region = _schema.encode_register_region(
            region_id,
            _schema.REGION_CUDA_FD,
            os.getpid() if pid is None else pid,
            base,
            length,
            page_size,
            page_count,
            segments,
            extra,
        )
        msg = _schema.encode_region_descriptors(_schema.VERSION, self.info.session, self.info.epoch, region)
        t = self.timeout if timeout is None else timeout
        c = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)  # close-on-exec by default
        try:
            try:
                c.settimeout(t)
                c.connect(self.socket_path)
                _socket.send_fds(c, [msg], list(fds))
                b = c.recv(65536)
            except _socket.timeout:
                raise RingsideTimeout("register_fd_region: no answer within %.3gs" % t) from None
            except OSError as e:
                raise RingsideUnavailable("register_fd_region on %s: %s" % (self.socket_path, e)) from None
        finally:
            c.close()
        if len(b) < 4:
            raise RingsideUnavailable("register_fd_region: the sidecar closed the connection without an answer")
        if struct.unpack_from("<I", b)[0] == _schema.ATTACH_REPLY_MAGIC:
            try:
                old = _schema.decode_attach_reply(b).message
            except _schema.SchemaError:
                old = "an attach reply"
            raise RingsideError(
                Status.UNKNOWN_TYPE,
                "the sidecar does not take GPU memory shared by file descriptor (it predates RegionDescriptors "
                "and answered: %s)" % old,
            )
        try:
            rep = _schema.decode_region_descriptors_reply(b)
        except _schema.SchemaError as e:
            raise _malformed(e) from None
        if rep.status != 0:
            raise RingsideError(rep.status, rep.message)

    def load(self, lease: int, region: int, first: int, pages) -> int:
        """Copy lease blocks first.. into the given pages of a region and wait
        for the copy; returns the blocks copied."""
        return self._call(_schema.TYPE_LOAD, _schema.encode_load(lease, region, first, pages), _dec_value)

    def store(self, batch: int, start: int, count: int, region: int, pages) -> StoreReply:
        """Copy pages of a region into the pool as blocks start..start+count
        of a batch (len(pages) == count) and wait for the copy."""
        return self._call(_schema.TYPE_STORE, _schema.encode_store(batch, start, count, region, pages), _dec_store)

    def changes(self, epoch: int = 0, seq: int = 0, max: int = 0) -> ChangesReply:  # noqa: A002
        """Read the change log from a cursor (zero cursor: start at the head,
        resync set). Iterate ``reply.changes()`` for (op, digest) pairs; the
        next cursor is (reply.epoch, reply.next)."""
        return self._call(_schema.TYPE_CHANGES, _schema.encode_changes(epoch, seq, max), _dec_changes)

    def snapshot(self, from_pos: int = 0, max: int = 0) -> SnapshotReply:  # noqa: A002
        """One page of the digests of the namespace's present blocks, from
        scan position from_pos (0 starts; then the previous reply's next), at
        most max of them (0: the sidecar's bound). reply.digests() lists them;
        reply.done says there are no more pages; (reply.epoch, reply.seq) is
        the change-log head cursor when the page was read. To rebuild a
        mirror (docs/protocol.md section 11): keep the FIRST page's cursor,
        read pages until done, then apply changes() from that cursor; on
        resync, start the snapshot again. A worker session is refused
        (status NOT_PERMITTED); a sidecar without Snapshot answers
        UNKNOWN_TYPE."""
        return self._call(_schema.TYPE_SNAPSHOT, _schema.encode_snapshot(from_pos, max), _dec_snapshot)

    def describe(self, runs) -> int:
        """Describe blocks for KV events (docs/protocol.md section 5.11): runs
        of schema.DescribeRun (a chain's parent digest, the run's digests, its
        token ids as u32 bytes). Returns the descriptions added (blocks
        described before keep theirs). A sidecar without the event records
        answers UNKNOWN_TYPE; one over the metadata bounds TOO_LARGE."""
        return self._call(_schema.TYPE_DESCRIBE, _schema.encode_describe(runs, self._width), _dec_value)

    def events(self, epoch: int = 0, seq: int = 0, max: int = 0):  # noqa: A002
        """Read the namespace's event log from a cursor, as changes() reads
        the change log: an EventsReply whose events() are self-describing
        (op, digest, parent, token ids, extra); the next cursor is
        (reply.epoch, reply.seq); resync: rebuild with event_snapshot()."""
        return self._call(_schema.TYPE_EVENTS, _schema.encode_changes(epoch, seq, max), _dec_events)

    def event_snapshot(self, from_pos: int = 0, max: int = 0):  # noqa: A002
        """One page of the namespace's present, described blocks (as
        snapshot() pages the present ones): an EventsReply of stored events,
        reply.next the next page's from_pos, reply.done the last page,
        (reply.epoch, reply.seq) the event log's head when the page was read."""
        return self._call(_schema.TYPE_EVENT_SNAPSHOT, _schema.encode_snapshot(from_pos, max), _dec_events)

    def ping(self, v: int = 0) -> int:
        """Round trip; returns the echoed value."""
        got = self._call(_schema.TYPE_PING, _schema.encode_id(v), _dec_value)
        if got != v:
            raise RingsideError(Status.INTERNAL, "ping answered %d, want %d" % (got, v))
        return got

    def __repr__(self) -> str:
        st = "closed" if self._closed else ("dead" if self._dead else "attached")
        return "<ringside.Session %d %s>" % (self.info.session, st)


class Link:
    """A sidecar session that is re-attached lazily after a failure, for
    engine plugins: ``get`` returns the session, or None meaning "no sidecar
    now" (the caller treats it as a miss) and tries to attach again at most
    once per ``reattach`` seconds. ``generation`` counts attaches, so ids
    from an older session can be recognised as void. ``miss_text`` says in
    the logs what the engine does meanwhile."""

    def __init__(
        self, socket: str, timeout: float, reattach: float, attach: dict, miss_text: str = "serving without the cache"
    ):
        self.socket, self.timeout, self.reattach, self.attach_args = socket, timeout, reattach, attach
        self.miss_text = miss_text
        self.session: Optional[Session] = None
        self.generation = 0
        self._next_try = 0.0
        self._warned = False

    def get(self) -> Optional[Session]:
        if self.session is not None:
            return self.session
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.reattach
        try:
            self.session = Session.attach(self.socket, timeout=self.timeout, **self.attach_args)
        except (RingsideError, OSError, ValueError) as e:
            if not self._warned:
                _log.warning(
                    "ringside: sidecar not available at %s (%s); %s, retrying every %.0fs",
                    self.socket,
                    e,
                    self.miss_text,
                    self.reattach,
                )
                self._warned = True
            return None
        self.generation += 1
        self._warned = False
        _log.info("ringside: attached to the sidecar at %s (session %d)", self.socket, self.session.info.session)
        return self.session

    def drop(self, err: BaseException) -> None:
        """Forget a failed session (the sidecar reclaims whatever it held)."""
        if self.session is not None:
            _log.warning("ringside: sidecar session lost (%s); %s", err, self.miss_text)
            try:
                self.session.abandon()
            except Exception:  # noqa: BLE001
                pass
        self.session = None

    def retire(self, err: Exception) -> Optional[Session]:
        """Forget a failed session like :meth:`drop`, but hand it to the
        caller unclosed, to end it (begin_detach, detached, abandon)."""
        s, self.session = self.session, None
        if s is not None:
            _log.warning("ringside: sidecar session lost (%s); %s", err, self.miss_text)
        return s

    def close(self) -> bool:
        """Close the session (Session.close); whether the sidecar is known to
        have ended it (True when there was none)."""
        s, self.session = self.session, None
        return s.close() if s is not None else True
