"""ringside wire protocol (version 1): the attach handshake and ring records.

A byte-for-byte port of the Go package github.com/ringside-kv/ringside/schema
(see docs/protocol.md). Golden vectors in testdata/golden/schema/vectors.json
keep the two identical; tests/test_schema.py checks them.

Every integer is little-endian at a fixed offset. Encoders return ``bytes``
(the ring record *payload*; the record type and correlation number travel in
the ring record header). Decoders take any bytes-like object (``bytes``,
``bytearray``, ``memoryview``), make every check the Go decoders make, and
raise :class:`SchemaError` (a ``ValueError``) on malformed input. Byte fields
of decoded values (digests, extra bytes, change entries) are copied out as
``bytes``, so a decoded value stays valid after the ring slot is reused.

Standard library only; encoders on the hot path (Lookup, Acquire, PutHashes,
Load, Store, Poll/Release) are one precompiled ``struct`` call plus at most
one concatenation.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Generator, Iterator, NamedTuple, Optional, Sequence, Tuple

# The wire of the Go package schema, generated from it (internal/wiregen):
# every constant under its public name (TYPE_*, MAX_*, FLAG_*, ...), the
# Status and State enums and the name tables (STATUS_NAMES, STATE_NAMES,
# TYPE_NAMES) with Go's text, and each record's fixed header as a
# struct.Struct (PUT_HASHES, REPLY, EVENTS_REPLY, ...) beside its offset
# diagram. tests/test_wire.py checks them against the Go golden vectors.
from ._wire_schema import *  # noqa: F403

DIGEST_WIDTHS = (8, 16, 32)  # Go checks these as literals; test_wire.py checks them against Go's validation

# Whether u32 arrays in native order are in wire order (little-endian):
# array("I") and memoryview.cast("I") then read and write the wire directly.
NATIVE_U32 = sys.byteorder == "little" and array("I").itemsize == 4


def type_name(t: int) -> str:
    """Name of a record type, as Go's schema.TypeName ("Lookup", "LookupReply", "type(0xe)")."""
    n = TYPE_NAMES.get(t & ~REPLY_BIT & 0xFFFF)
    if n is None:
        return "type(%#x)" % t
    return n + "Reply" if t & REPLY_BIT else n


def status_name(s: int) -> str:
    """Go's Status.String: the name, or "status(N)" for an unknown code."""
    n = STATUS_NAMES.get(s)
    return "status(%d)" % s if n is None else n


def state_name(s: int) -> str:
    """Go's State.String: "waiting" ... "released", or "state(N)"."""
    n = STATE_NAMES.get(s)
    return "state(%d)" % s if n is None else n


class SchemaError(ValueError):
    """A record that does not decode (Go: an error wrapping schema.ErrMalformed),
    or arguments an encoder cannot represent."""


class RingsideError(Exception):
    """A non-OK reply status with the sidecar's message (Go: *schema.Error)."""

    def __init__(self, status: int, message: str = ""):
        self.status = status
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        if not self.message:
            return "ringside: " + status_name(self.status)
        return "ringside: " + status_name(self.status) + ": " + self.message


def _err(status: int, message: str) -> Optional[RingsideError]:
    return None if status == 0 else RingsideError(status, message)


# --------------------------------------------------------------------------
# Codecs. Each record's fixed header is its generated layout (PUT_HASHES,
# LOAD, ...); what follows it is packed here.

_U32 = struct.Struct("<I")


def _pack_pages(pages) -> bytes:
    """u32 page indices, little-endian."""
    try:
        if NATIVE_U32:
            if isinstance(pages, array) and pages.typecode == "I":
                return pages.tobytes()
            return array("I", pages).tobytes()
        return struct.pack("<%dI" % len(pages), *pages)
    except (OverflowError, TypeError, struct.error) as e:
        raise SchemaError("page index out of range for u32: %s" % e) from None


def _unpack_pages(b, off: int, n: int) -> Tuple[int, ...]:
    return struct.unpack_from("<%dI" % n, b, off)


def _enc_str(s: str, what: str) -> bytes:
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise SchemaError("%s: %s" % (what, e)) from None


def _dec_str(b) -> str:
    # Go keeps arbitrary bytes in a string; surrogateescape keeps them too,
    # so that decode(encode(x)) round-trips even for non-UTF-8 input.
    return bytes(b).decode("utf-8", "surrogateescape")


def _need(what: str, b, off: int, n: int) -> None:
    if n < 0 or off + n > len(b):
        raise SchemaError("%s: need %d bytes at offset %d, have %d" % (what, n, off, len(b)))


def _done(what: str, b, off: int) -> None:
    if off != len(b):
        raise SchemaError("%s: %d trailing bytes" % (what, len(b) - off))


def _view(b):
    return b if isinstance(b, memoryview) else memoryview(b)


# --------------------------------------------------------------------------
# Attach handshake (Unix socket)


class AttachRequest(NamedTuple):
    version: int
    role: int
    rank: int
    world_size: int
    digest_width: int
    ring_capacity: int
    instance: str  # engine instance id: ranks of one engine share it
    model: str
    layout: str  # layout fingerprint: dtype, block size, page layout, hash algorithm
    salt: str = ""  # tenant salt; empty for none


def validate_attach_request(m: AttachRequest) -> None:
    """The semantic rules Go's AttachRequest.Validate enforces."""
    if not ROLE_SCHEDULER <= m.role <= ROLE_CLIENT:
        raise SchemaError("attach: role %d" % m.role)
    if m.world_size == 0 or m.world_size > MAX_WORLD_SIZE:
        raise SchemaError("attach: world size %d outside [1, %d]" % (m.world_size, MAX_WORLD_SIZE))
    if m.rank >= m.world_size:
        raise SchemaError("attach: rank %d not below world size %d" % (m.rank, m.world_size))
    if m.digest_width not in DIGEST_WIDTHS:
        raise SchemaError("attach: digest width %d, want 8, 16 or 32" % m.digest_width)
    if not m.instance or not m.model or not m.layout:
        raise SchemaError("attach: instance, model and layout must not be empty")
    for s in (m.instance, m.model, m.layout, m.salt):
        try:
            raw = s.encode("utf-8")  # strict: lone surrogates (non-UTF-8 bytes) fail
        except UnicodeEncodeError:
            raw = None
        if raw is None or len(raw) > MAX_STRING_LEN:
            raise SchemaError("attach: string longer than %d bytes or not UTF-8" % MAX_STRING_LEN)


def encode_attach_request(
    version: int = VERSION,
    role: int = ROLE_WORKER,
    rank: int = 0,
    world_size: int = 1,
    digest_width: int = 32,
    ring_capacity: int = 0,
    instance: str = "",
    model: str = "",
    layout: str = "",
    salt: str = "",
) -> bytes:
    """The attach request (socket message). Does not validate: see validate_attach_request."""
    strs = [_enc_str(s, "attach request") for s in (instance, model, layout, salt)]
    try:
        head = ATTACH_REQUEST.pack(
            ATTACH_MAGIC, version, role, rank, world_size, digest_width, ring_capacity, *(len(s) for s in strs)
        )
    except struct.error as e:
        raise SchemaError("attach request: %s" % e) from None
    return head + b"".join(strs)


def decode_attach_request(b) -> AttachRequest:
    """Parse and validate an attach request (Go: AttachRequest.Decode)."""
    what = "attach request"
    _need(what, b, 0, 4)
    magic = _U32.unpack_from(b, 0)[0]
    if magic != ATTACH_MAGIC:
        raise SchemaError("%s: magic %#x" % (what, magic))
    _need(what, b, 4, ATTACH_REQUEST.size - 4)
    magic, version, role, rank, world, width, cap, n1, n2, n3, n4 = ATTACH_REQUEST.unpack_from(b, 0)
    off = ATTACH_REQUEST.size
    _need(what, b, off, n1 + n2 + n3 + n4)
    mv = _view(b)
    strs = []
    for n in (n1, n2, n3, n4):
        strs.append(_dec_str(mv[off : off + n]))
        off += n
    _done(what, b, off)
    m = AttachRequest(version, role, rank, world, width, cap, *strs)
    validate_attach_request(m)
    return m


class AttachReply(NamedTuple):
    version: int
    status: int
    namespace: int
    session: int
    epoch: int  # boot token of both rings
    pool_slots: int
    slot_bytes: int
    max_payload: int
    submission_ring: str
    completion_ring: str
    pool_path: str
    message: str

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, self.message)


def encode_attach_reply(
    version: int = VERSION,
    status: int = 0,
    namespace: int = 0,
    session: int = 0,
    epoch: int = 0,
    pool_slots: int = 0,
    slot_bytes: int = 0,
    max_payload: int = 0,
    submission_ring: str = "",
    completion_ring: str = "",
    pool_path: str = "",
    message: str = "",
) -> bytes:
    strs = [_enc_str(s, "attach reply") for s in (submission_ring, completion_ring, pool_path, message)]
    try:
        head = ATTACH_REPLY.pack(
            ATTACH_REPLY_MAGIC,
            version,
            0,
            status,
            namespace,
            session,
            epoch,
            pool_slots,
            slot_bytes,
            max_payload,
            *(len(s) for s in strs),
        )
    except struct.error as e:
        raise SchemaError("attach reply: %s" % e) from None
    return head + b"".join(strs)


def decode_attach_reply(b) -> AttachReply:
    what = "attach reply"
    _need(what, b, 0, 4)
    magic = _U32.unpack_from(b, 0)[0]
    if magic != ATTACH_REPLY_MAGIC:
        raise SchemaError("%s: magic %#x" % (what, magic))
    _need(what, b, 4, ATTACH_REPLY.size - 4)
    (magic, version, _zero, status, ns, session, epoch, slots, slot_bytes, max_payload, n1, n2, n3, n4) = (
        ATTACH_REPLY.unpack_from(b, 0)
    )
    off = ATTACH_REPLY.size
    _need(what, b, off, n1 + n2 + n3 + n4)
    mv = _view(b)
    strs = []
    for n in (n1, n2, n3, n4):
        strs.append(_dec_str(mv[off : off + n]))
        off += n
    _done(what, b, off)
    return AttachReply(version, status, ns, session, epoch, slots, slot_bytes, max_payload, *strs)


# --------------------------------------------------------------------------
# Requests (submission ring, engine -> sidecar)


class PutHashes(NamedTuple):
    batch: int
    flags: int
    digests: bytes  # count x width bytes


def encode_put_hashes(batch: int, digests, width: int, flags: int = 0) -> bytes:
    """PutHashes payload. ``digests`` is the already-joined digest bytes
    (count x width, any bytes-like object)."""
    if width not in DIGEST_WIDTHS:
        raise SchemaError("PutHashes: digest width %d, want 8, 16 or 32" % width)
    n, rem = divmod(len(digests), width)
    if rem:
        raise SchemaError("PutHashes: %d digest bytes is not a multiple of width %d" % (len(digests), width))
    if n > MAX_HASHES_PER_RECORD:
        raise SchemaError("PutHashes: %d hashes, at most %d per record" % (n, MAX_HASHES_PER_RECORD))
    try:
        return PUT_HASHES.pack(batch, n, flags) + digests
    except struct.error as e:
        raise SchemaError("PutHashes: %s" % e) from None


def decode_put_hashes(b, width: int) -> PutHashes:
    """Parse PutHashes for a session with the given digest width."""
    what = "PutHashes"
    if width not in DIGEST_WIDTHS:
        raise SchemaError("%s: digest width %d, want 8, 16 or 32" % (what, width))
    _need(what, b, 0, 16)
    batch, n, flags = PUT_HASHES.unpack_from(b, 0)
    if n > MAX_HASHES_PER_RECORD:
        raise SchemaError("%s: %d hashes, at most %d per record" % (what, n, MAX_HASHES_PER_RECORD))
    if flags & ~(FLAG_APPEND | FLAG_LOOKUP | FLAG_REPLACE):
        raise SchemaError("%s: unknown flags %#x" % (what, flags))
    if flags & FLAG_APPEND and flags & FLAG_REPLACE:
        raise SchemaError("%s: flags %#x: FlagAppend and FlagReplace together" % (what, flags))
    _need(what, b, 16, n * width)
    _done(what, b, 16 + n * width)
    return PutHashes(batch, flags, bytes(_view(b)[16:]))


def encode_id(id_: int) -> bytes:
    """Payload of DropHashes (batch id), Poll and Release (lease id)."""
    try:
        return ID_REQUEST.pack(id_)
    except struct.error as e:
        raise SchemaError("id request: %s" % e) from None


encode_drop_hashes = encode_id
encode_poll = encode_id
encode_release = encode_id


def decode_id(b) -> int:
    what = "id request"
    _need(what, b, 0, 8)
    _done(what, b, 8)
    return ID_REQUEST.unpack_from(b, 0)[0]


class View(NamedTuple):
    """A prefix range of a registered hash batch; Lookup's payload."""

    batch: int
    start: int
    count: int


Lookup = View


def encode_lookup(batch: int, start: int, count: int) -> bytes:
    try:
        return LOOKUP.pack(batch, start, count)
    except struct.error as e:
        raise SchemaError("Lookup: %s" % e) from None


def decode_lookup(b) -> View:
    what = "Lookup"
    _need(what, b, 0, 16)
    _done(what, b, 16)
    return View._make(LOOKUP.unpack_from(b, 0))


class Acquire(NamedTuple):
    batch: int
    start: int
    count: int
    ttl_ms: int = 0  # 0 = sidecar default


def encode_acquire(batch: int, start: int, count: int, ttl_ms: int = 0) -> bytes:
    try:
        return ACQUIRE.pack(batch, start, count, ttl_ms, 0)
    except struct.error as e:
        raise SchemaError("Acquire: %s" % e) from None


def decode_acquire(b) -> Acquire:
    what = "Acquire"
    _need(what, b, 0, 24)
    batch, start, count, ttl, flags = ACQUIRE.unpack_from(b, 0)
    if flags:
        raise SchemaError("%s: unknown flags %#x" % (what, flags))
    _done(what, b, 24)
    return Acquire(batch, start, count, ttl)


class Retain(NamedTuple):
    """Keep a view's blocks for ttl_ms at a priority, or (flags
    RETAIN_FLAG_END) end that retention (added within version 3). owner
    identifies, within the uid, who holds the retention (0: none; the u64
    at offset 24, appended within version 3)."""

    batch: int
    start: int
    count: int
    ttl_ms: int = 0
    priority: int = 0
    flags: int = 0
    owner: int = 0


def encode_retain(
    batch: int, start: int, count: int, ttl_ms: int = 0, priority: int = 0, flags: int = 0, owner: int = 0
) -> bytes:
    """A Retain: RETAIN_NO_OWNER_SIZE bytes when owner is 0 (what a sidecar
    that predates the owner understands), else RETAIN_SIZE."""
    try:
        b = RETAIN.pack(batch, start, count, ttl_ms, priority, flags, 0, owner)
    except struct.error as e:
        raise SchemaError("Retain: %s" % e) from None
    return b if owner else b[:RETAIN_NO_OWNER_SIZE]


def decode_retain(b) -> Retain:
    what = "Retain"
    _need(what, b, 0, RETAIN_NO_OWNER_SIZE)
    rest = len(b) - RETAIN_NO_OWNER_SIZE
    if 0 < rest < RETAIN_SIZE - RETAIN_NO_OWNER_SIZE:
        raise SchemaError("%s: %d trailing bytes (an owner is 8)" % (what, rest))
    if rest > 0:
        batch, start, count, ttl, prio, flags, zero, owner = RETAIN.unpack_from(b, 0)
        end = RETAIN_SIZE
    else:
        batch, start, count, ttl, prio, flags, zero, owner = RETAIN.unpack(bytes(b) + bytes(8))
        end = RETAIN_NO_OWNER_SIZE
    if flags & ~RETAIN_FLAG_END:
        raise SchemaError("%s: unknown flags %#x" % (what, flags))
    if zero:
        raise SchemaError("%s: reserved bytes 22-23 are %#x, not zero" % (what, zero))
    if prio > MAX_RETAIN_PRIORITY:
        raise SchemaError("%s: priority %d, at most %d" % (what, prio, MAX_RETAIN_PRIORITY))
    if ttl == 0 and not flags & RETAIN_FLAG_END:
        raise SchemaError("%s: ttl 0 without the END flag" % what)
    _done(what, b, end)
    return Retain(batch, start, count, ttl, prio, flags, owner)


class Segment(NamedTuple):
    """One per-layer piece of an engine page."""

    offset: int
    stride: int
    length: int


class RegisterRegion(NamedTuple):
    region: int
    kind: int
    pid: int
    base: int
    length: int
    page_size: int
    page_count: int
    segments: Tuple[Segment, ...]
    extra: bytes  # kind-specific; CUDA IPC: see encode_cuda_extra


def encode_register_region(
    region: int,
    kind: int,
    pid: int,
    base: int,
    length: int,
    page_size: int,
    page_count: int,
    segments: Sequence[Tuple[int, int, int]] = (),
    extra=b"",
) -> bytes:
    if len(segments) > MAX_SEGMENTS:
        raise SchemaError("RegisterRegion: %d segments, at most %d" % (len(segments), MAX_SEGMENTS))
    try:
        parts = [REGISTER_REGION.pack(region, kind, pid, base, length, page_size, page_count, len(segments))]
        parts.extend(SEGMENT.pack(*s) for s in segments)
    except (struct.error, TypeError) as e:
        raise SchemaError("RegisterRegion: %s" % e) from None
    parts.append(bytes(extra))
    return b"".join(parts)


def decode_register_region(b) -> RegisterRegion:
    what = "RegisterRegion"
    _need(what, b, 0, 48)
    region, kind, pid, base, length, page_size, page_count, n = REGISTER_REGION.unpack_from(b, 0)
    if n > MAX_SEGMENTS:
        raise SchemaError("%s: %d segments, at most %d" % (what, n, MAX_SEGMENTS))
    if kind not in (REGION_HOST_PROCESS, REGION_CUDA_IPC, REGION_CUDA_FD):
        raise SchemaError("%s: unknown region kind %d" % (what, kind))
    _need(what, b, 48, n * SEGMENT_SIZE)
    off = 48 + n * SEGMENT_SIZE
    segs = tuple(Segment._make(s) for s in SEGMENT.iter_unpack(_view(b)[48:off]))
    return RegisterRegion(region, kind, pid, base, length, page_size, page_count, segs, bytes(_view(b)[off:]))


class CUDAAllocation(NamedTuple):
    handle: bytes  # cudaIpcMemHandle_t of the allocation's base (64 bytes)
    base: int  # the allocation's base address in the engine
    size: int  # its size in bytes


class CUDAExtra(NamedTuple):
    gpu: bytes  # the device's UUID (16 bytes)
    event: Optional[bytes]  # cudaIpcEventHandle_t (64 bytes) that stores wait for, or None
    allocations: Tuple[CUDAAllocation, ...]


def encode_cuda_extra(
    gpu_uuid: bytes, allocations: Sequence[Tuple[bytes, int, int]], event: Optional[bytes] = None
) -> bytes:
    """RegisterRegion extra bytes for REGION_CUDA_IPC (protocol version 3):
    the GPU's UUID, an optional interprocess event handle whose last record
    the sidecar's store copies wait for, and each (handle, base, size) device
    allocation the region's segments lie in."""
    what = "CUDA IPC extra"
    if len(gpu_uuid) != 16:
        raise SchemaError("%s: GPU UUID of %d bytes, want 16" % (what, len(gpu_uuid)))
    if event is not None and len(event) != 64:
        raise SchemaError("%s: event handle of %d bytes, want 64" % (what, len(event)))
    if not 1 <= len(allocations) <= MAX_ALLOCATIONS:
        raise SchemaError("%s: %d allocations, want 1 to %d" % (what, len(allocations), MAX_ALLOCATIONS))
    flags = CUDA_EXTRA_FLAG_EVENT if event is not None else 0
    parts = [CUDA_EXTRA.pack(bytes(gpu_uuid), flags, len(allocations), bytes(event or bytes(64)))]
    for i, (handle, base, size) in enumerate(allocations):
        if len(handle) != 64:
            raise SchemaError("%s: allocation %d: handle of %d bytes, want 64" % (what, i, len(handle)))
        if size <= 0 or base < 0 or base + size >= 1 << 64:
            raise SchemaError("%s: allocation %d: base %#x size %d" % (what, i, base, size))
        parts.append(CUDA_ALLOCATION.pack(bytes(handle), base, size))
    return b"".join(parts)


def decode_cuda_extra(b) -> CUDAExtra:
    what = "CUDA IPC extra"
    _need(what, b, 0, CUDA_EXTRA_HEADER_SIZE)
    gpu, flags, n, event = CUDA_EXTRA.unpack_from(b, 0)
    if flags & ~CUDA_EXTRA_FLAG_EVENT:
        raise SchemaError("%s: unknown flags %#x" % (what, flags))
    if not 1 <= n <= MAX_ALLOCATIONS:
        raise SchemaError("%s: %d allocations, want 1 to %d" % (what, n, MAX_ALLOCATIONS))
    if not flags & CUDA_EXTRA_FLAG_EVENT and any(event):
        raise SchemaError("%s: an event handle without the event flag" % what)
    _need(what, b, CUDA_EXTRA_HEADER_SIZE, n * CUDA_ALLOCATION_SIZE)
    end = CUDA_EXTRA_HEADER_SIZE + n * CUDA_ALLOCATION_SIZE
    if len(b) != end:
        raise SchemaError("%s: %d trailing bytes" % (what, len(b) - end))
    allocs = []
    for i, (h, base, size) in enumerate(CUDA_ALLOCATION.iter_unpack(_view(b)[CUDA_EXTRA_HEADER_SIZE:end])):
        if size == 0 or base + size >= 1 << 64:
            raise SchemaError("%s: allocation %d: base %#x size %d" % (what, i, base, size))
        allocs.append(CUDAAllocation(h, base, size))
    return CUDAExtra(gpu, event if flags & CUDA_EXTRA_FLAG_EVENT else None, tuple(allocs))


# GPU memory shared by POSIX file descriptors (added within version 3): a
# REGION_CUDA_FD region travels in a RegionDescriptors message on a
# connection of its own to the attach socket, with the descriptors of its
# allocations (SCM_RIGHTS); see client.Session.register_fd_region.


class FDAllocation(NamedTuple):
    index: int  # position of its descriptor in the message's SCM_RIGHTS array
    base: int  # where the engine maps the allocation (whole)
    size: int  # its size in bytes


class FDExtra(NamedTuple):
    gpu: bytes  # the device's UUID (16 bytes)
    event: Optional[bytes]  # cudaIpcEventHandle_t (64 bytes) that stores wait for, or None
    allocations: Tuple[FDAllocation, ...]


def encode_fd_extra(
    gpu_uuid: bytes, allocations: Sequence[Tuple[int, int, int]], event: Optional[bytes] = None
) -> bytes:
    """RegisterRegion extra bytes for REGION_CUDA_FD: the GPU's UUID, an
    optional interprocess event handle, and each (descriptor index, base,
    size) allocation the region's segments lie in; the indexes name each of
    the message's descriptors once."""
    what = "CUDA descriptor extra"
    if len(gpu_uuid) != 16:
        raise SchemaError("%s: GPU UUID of %d bytes, want 16" % (what, len(gpu_uuid)))
    if event is not None and len(event) != 64:
        raise SchemaError("%s: event handle of %d bytes, want 64" % (what, len(event)))
    n = len(allocations)
    if not 1 <= n <= MAX_DESCRIPTORS:
        raise SchemaError("%s: %d allocations, want 1 to %d" % (what, n, MAX_DESCRIPTORS))
    if sorted(int(a[0]) for a in allocations) != list(range(n)):
        raise SchemaError("%s: the descriptor indexes are not 0..%d, each once" % (what, n - 1))
    flags = CUDA_EXTRA_FLAG_EVENT if event is not None else 0
    parts = [FD_EXTRA.pack(bytes(gpu_uuid), flags, n, bytes(event or bytes(64)))]
    for i, (index, base, size) in enumerate(allocations):
        if size <= 0 or base < 0 or base + size >= 1 << 64:
            raise SchemaError("%s: allocation %d: base %#x size %d" % (what, i, base, size))
        parts.append(FD_ALLOCATION.pack(index, 0, base, size))
    return b"".join(parts)


def decode_fd_extra(b) -> FDExtra:
    what = "CUDA descriptor extra"
    _need(what, b, 0, FD_EXTRA_HEADER_SIZE)
    gpu, flags, n, event = FD_EXTRA.unpack_from(b, 0)
    if flags & ~CUDA_EXTRA_FLAG_EVENT:
        raise SchemaError("%s: unknown flags %#x" % (what, flags))
    if not 1 <= n <= MAX_DESCRIPTORS:
        raise SchemaError("%s: %d allocations, want 1 to %d" % (what, n, MAX_DESCRIPTORS))
    if not flags & CUDA_EXTRA_FLAG_EVENT and any(event):
        raise SchemaError("%s: an event handle without the event flag" % what)
    _need(what, b, FD_EXTRA_HEADER_SIZE, n * FD_ALLOCATION_SIZE)
    end = FD_EXTRA_HEADER_SIZE + n * FD_ALLOCATION_SIZE
    _done(what, b, end)
    allocs, seen = [], set()
    for i, (index, zero, base, size) in enumerate(FD_ALLOCATION.iter_unpack(_view(b)[FD_EXTRA_HEADER_SIZE:end])):
        if index >= n:
            raise SchemaError("%s: allocation %d: descriptor index %d, the message carries %d" % (what, i, index, n))
        if index in seen:
            raise SchemaError("%s: allocation %d: descriptor index %d is named twice" % (what, i, index))
        if zero:
            raise SchemaError("%s: allocation %d: reserved word %#x, not zero" % (what, i, zero))
        if size == 0 or base + size >= 1 << 64:
            raise SchemaError("%s: allocation %d: base %#x size %d" % (what, i, base, size))
        seen.add(index)
        allocs.append(FDAllocation(index, base, size))
    return FDExtra(gpu, event if flags & CUDA_EXTRA_FLAG_EVENT else None, tuple(allocs))


class RegionDescriptors(NamedTuple):
    version: int
    session: int  # the AttachReply's session id
    epoch: int  # the AttachReply's epoch
    region: RegisterRegion  # of kind REGION_CUDA_FD


def encode_region_descriptors(version: int, session: int, epoch: int, region_payload) -> bytes:
    """The RegionDescriptors message: its header and a RegisterRegion
    payload (encode_register_region) of kind REGION_CUDA_FD."""
    try:
        head = REGION_DESCRIPTORS.pack(DESCRIPTORS_MAGIC, version, 0, session, epoch)
    except struct.error as e:
        raise SchemaError("RegionDescriptors: %s" % e) from None
    return head + bytes(region_payload)


def decode_region_descriptors(b) -> RegionDescriptors:
    what = "RegionDescriptors"
    _need(what, b, 0, REGION_DESCRIPTORS_HEADER_SIZE)
    magic, version, _zero, session, epoch = REGION_DESCRIPTORS.unpack_from(b, 0)
    if magic != DESCRIPTORS_MAGIC:
        raise SchemaError("%s: magic %#x" % (what, magic))
    region = decode_register_region(_view(b)[REGION_DESCRIPTORS_HEADER_SIZE:])
    if region.kind != REGION_CUDA_FD:
        raise SchemaError("%s: region kind %d, want %d (CUDA by descriptor)" % (what, region.kind, REGION_CUDA_FD))
    return RegionDescriptors(version, session, epoch, region)


class RegionDescriptorsReply(NamedTuple):
    version: int
    status: int
    region: int
    message: str

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, self.message)


def encode_region_descriptors_reply(version: int, status: int, region: int, message: str = "") -> bytes:
    try:
        return REGION_DESCRIPTORS_REPLY.pack(DESCRIPTORS_REPLY_MAGIC, version, 0, status, region) + _enc_str(
            message, "RegionDescriptorsReply"
        )
    except struct.error as e:
        raise SchemaError("RegionDescriptorsReply: %s" % e) from None


def decode_region_descriptors_reply(b) -> RegionDescriptorsReply:
    what = "RegionDescriptorsReply"
    _need(what, b, 0, REGION_DESCRIPTORS_REPLY.size)
    magic, version, _zero, status, region = REGION_DESCRIPTORS_REPLY.unpack_from(b, 0)
    if magic != DESCRIPTORS_REPLY_MAGIC:
        raise SchemaError("%s: magic %#x" % (what, magic))
    return RegionDescriptorsReply(version, status, region, _dec_str(_view(b)[REGION_DESCRIPTORS_REPLY.size :]))


class Load(NamedTuple):
    lease: int
    region: int
    first: int  # index of the lease's first block to copy
    pages: Tuple[int, ...]  # destination page per block


def encode_load(lease: int, region: int, first: int, pages) -> bytes:
    """Load blocks first..first+len(pages) of a lease into the given pages."""
    n = len(pages)
    if n > MAX_PAGES_PER_RECORD:
        raise SchemaError("Load: %d pages, at most %d per record" % (n, MAX_PAGES_PER_RECORD))
    try:
        return LOAD.pack(lease, region, n, first, 0) + _pack_pages(pages)
    except struct.error as e:
        raise SchemaError("Load: %s" % e) from None


def decode_load(b) -> Load:
    what = "Load"
    _need(what, b, 0, 24)
    lease, region, n, first, _zero = LOAD.unpack_from(b, 0)
    if n > MAX_PAGES_PER_RECORD:
        raise SchemaError("%s: %d pages, at most %d per record" % (what, n, MAX_PAGES_PER_RECORD))
    _need(what, b, 24, 4 * n)
    _done(what, b, 24 + 4 * n)
    return Load(lease, region, first, _unpack_pages(b, 24, n))


class Store(NamedTuple):
    batch: int
    start: int
    count: int
    region: int
    pages: Tuple[int, ...]  # source page per block; len(pages) == count


def encode_store(batch: int, start: int, count: int, region: int, pages) -> bytes:
    """Store pages as blocks start..start+count of a batch (len(pages) must equal count)."""
    n = len(pages)
    if n != count:
        raise SchemaError("Store: %d pages for a view of %d blocks" % (n, count))
    if n > MAX_PAGES_PER_RECORD:
        raise SchemaError("Store: %d pages, at most %d per record" % (n, MAX_PAGES_PER_RECORD))
    try:
        return STORE.pack(batch, start, count, region, n) + _pack_pages(pages)
    except struct.error as e:
        raise SchemaError("Store: %s" % e) from None


def decode_store(b) -> Store:
    what = "Store"
    _need(what, b, 0, 24)
    batch, start, count, region, n = STORE.unpack_from(b, 0)
    if n > MAX_PAGES_PER_RECORD:
        raise SchemaError("%s: %d pages, at most %d per record" % (what, n, MAX_PAGES_PER_RECORD))
    _need(what, b, 24, 4 * n)
    if n != count:
        raise SchemaError("%s: %d pages for a view of %d blocks" % (what, n, count))
    _done(what, b, 24 + 4 * n)
    return Store(batch, start, count, region, _unpack_pages(b, 24, n))


class Changes(NamedTuple):
    epoch: int
    seq: int  # next sequence number to read
    max: int  # at most this many entries


def encode_changes(epoch: int, seq: int, max: int) -> bytes:  # noqa: A002 (mirrors the Go field)
    try:
        return CHANGES.pack(epoch, seq, max, 0)
    except struct.error as e:
        raise SchemaError("Changes: %s" % e) from None


def decode_changes(b) -> Changes:
    what = "Changes"
    _need(what, b, 0, 24)
    _done(what, b, 24)
    epoch, seq, mx, _zero = CHANGES.unpack_from(b, 0)
    return Changes(epoch, seq, mx)


class Snapshot(NamedTuple):
    from_pos: int  # scan position to resume at: 0 starts, later pages send the previous reply's next
    max: int  # at most this many digests (0: the sidecar's bound)


def encode_snapshot(from_pos: int, max: int = 0) -> bytes:  # noqa: A002 (mirrors the Go field)
    try:
        return SNAPSHOT.pack(from_pos, max, 0)
    except struct.error as e:
        raise SchemaError("Snapshot: %s" % e) from None


def decode_snapshot(b) -> Snapshot:
    what = "Snapshot"
    _need(what, b, 0, 16)
    _done(what, b, 16)
    from_pos, mx, _zero = SNAPSHOT.unpack_from(b, 0)
    return Snapshot(from_pos, mx)


# --------------------------------------------------------------------------
# Replies (completion ring, sidecar -> engine; record type = request type | REPLY_BIT)


class Reply(NamedTuple):
    """The common reply. value: PutHashes, the batch length after the call;
    Lookup, leading present blocks; Load, blocks copied; Ping, the echoed
    value; otherwise 0."""

    status: int
    value: int
    message: str

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, self.message)


def encode_reply(status: int, value: int = 0, message: str = "") -> bytes:
    try:
        return REPLY.pack(status, 0, value) + _enc_str(message, "reply")
    except struct.error as e:
        raise SchemaError("reply: %s" % e) from None


def decode_reply(b) -> Reply:
    _need("reply", b, 0, 16)
    status, _zero, value = REPLY.unpack_from(b, 0)
    return Reply(status, value, _dec_str(_view(b)[16:]))


class LeaseReply(NamedTuple):
    """Answers Acquire and Poll."""

    status: int
    state: int
    lease: int
    blocks: int  # blocks pinned
    message: str

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, self.message)


def encode_lease_reply(status: int, state: int, lease: int, blocks: int, message: str = "") -> bytes:
    try:
        return LEASE_REPLY.pack(status, state, lease, blocks, 0) + _enc_str(message, "lease reply")
    except struct.error as e:
        raise SchemaError("lease reply: %s" % e) from None


def decode_lease_reply(b) -> LeaseReply:
    _need("lease reply", b, 0, 24)
    status, state, lease, blocks, _zero = LEASE_REPLY.unpack_from(b, 0)
    return LeaseReply(status, state, lease, blocks, _dec_str(_view(b)[24:]))


class StoreReply(NamedTuple):
    """Answers Store."""

    status: int
    stored: int
    present: int  # already present, skipped
    skipped: int  # not stored (no space)
    message: str

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, self.message)


def encode_store_reply(status: int, stored: int, present: int, skipped: int, message: str = "") -> bytes:
    try:
        return STORE_REPLY.pack(status, stored, present, skipped) + _enc_str(message, "store reply")
    except struct.error as e:
        raise SchemaError("store reply: %s" % e) from None


def decode_store_reply(b) -> StoreReply:
    _need("store reply", b, 0, 16)
    status, stored, present, skipped = STORE_REPLY.unpack_from(b, 0)
    return StoreReply(status, stored, present, skipped, _dec_str(_view(b)[16:]))


class Change(NamedTuple):
    op: int
    digest: bytes


class ChangesReply(NamedTuple):
    """Answers Changes. entries: n x (8 + width) bytes; see changes()."""

    status: int
    resync: bool
    epoch: int
    next: int
    width: int
    entries: bytes

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, "")

    @property
    def n_entries(self) -> int:
        return len(self.entries) // (8 + self.width) if self.width else 0

    def change_at(self, i: int) -> Change:
        es = 8 + self.width
        if not 0 <= i < self.n_entries:
            raise IndexError(i)
        return Change(self.entries[i * es], self.entries[i * es + 8 : (i + 1) * es])

    def changes(self) -> Iterator[Change]:
        for op, digest in iter_changes(self.entries, self.n_entries, self.width, 0):
            yield Change(op, digest)


def iter_changes(b, n: int, width: int, off: int = CHANGES_REPLY.size) -> Iterator[Tuple[int, bytes]]:
    """The n change-log entries of width-byte digests at b[off:], which must
    end there: (op, digest) pairs, each digest copied out as bytes. b is a
    ChangesReply payload (its header unpacked with CHANGES_REPLY), or its
    entries alone (off 0). Raises SchemaError, before the first pair, when
    the entries do not fill b or are more than MAX_CHANGES_PER_REPLY.

    The one reader of change entries (ChangesReply.changes() and the local
    index's follower read through it). The iterator is a zip over the ops
    (one strided slice) and the digests (one list), so that reading it
    costs what a loop over the bytes would."""
    es = CHANGE_HEADER_SIZE + width
    end = off + n * es
    if n > MAX_CHANGES_PER_REPLY or len(b) != end or width not in DIGEST_WIDTHS:
        raise SchemaError(
            "changes reply: %d entries of %d-byte digests in %d bytes from offset %d" % (n, width, len(b), off)
        )
    if n <= 1:  # a poll of a quiet log: no list to build
        return iter(((b[off], b[end - width : end]),) if n else ())
    return zip(b[off:end:es], [b[d : d + width] for d in range(off + CHANGE_HEADER_SIZE, end, es)])


def encode_change(op: int, digest) -> bytes:
    """One change-log entry (op, 7 zero bytes, digest)."""
    return CHANGE_HEADER.pack(op) + bytes(digest)


def encode_changes_reply(
    status: int,
    resync: bool,
    epoch: int,
    next: int,  # noqa: A002
    width: int,
    entries=b"",
) -> bytes:
    """entries: joined encode_change() bytes, each 8 + width long."""
    es = 8 + width
    n, rem = divmod(len(entries), es)
    if rem:
        raise SchemaError("changes reply: %d entry bytes is not a multiple of %d" % (len(entries), es))
    try:
        return CHANGES_REPLY.pack(status, CHANGES_FLAG_RESYNC if resync else 0, epoch, next, n, width) + bytes(entries)
    except struct.error as e:
        raise SchemaError("changes reply: %s" % e) from None


def decode_changes_reply(b) -> ChangesReply:
    what = "changes reply"
    _need(what, b, 0, 32)
    status, flags, epoch, nxt, n, width = CHANGES_REPLY.unpack_from(b, 0)
    if width not in DIGEST_WIDTHS:
        raise SchemaError("%s: digest width %d" % (what, width))
    if n > MAX_CHANGES_PER_REPLY:
        raise SchemaError("%s: %d entries, at most %d" % (what, n, MAX_CHANGES_PER_REPLY))
    size = n * (8 + width)
    _need(what, b, 32, size)
    _done(what, b, 32 + size)
    return ChangesReply(status, bool(flags & CHANGES_FLAG_RESYNC), epoch, nxt, width, bytes(_view(b)[32:]))


class SnapshotReply(NamedTuple):
    """Answers Snapshot: one page of digests of present blocks. (epoch, seq)
    is the namespace's change-log head cursor when the page was read; next is
    the from_pos of the next page; done: no more pages. entries: count x
    width digest bytes; see digests()."""

    status: int
    done: bool
    epoch: int
    seq: int
    next: int
    width: int
    entries: bytes

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, "")

    @property
    def count(self) -> int:
        return len(self.entries) // self.width if self.width else 0

    def digest_at(self, i: int) -> bytes:
        if not 0 <= i < self.count:
            raise IndexError(i)
        w = self.width
        return self.entries[i * w : (i + 1) * w]

    def digests(self) -> list[bytes]:
        """The page's digests, each a bytes of width bytes."""
        w, e = self.width, self.entries
        return [e[off : off + w] for off in range(0, self.count * w, w)]


def encode_snapshot_reply(
    status: int,
    done: bool,
    epoch: int,
    seq: int,
    next: int,  # noqa: A002
    width: int,
    entries=b"",
) -> bytes:
    """entries: joined digests, a multiple of width bytes."""
    if width <= 0:
        n, rem = 0, len(entries)
    else:
        n, rem = divmod(len(entries), width)
    if rem:
        raise SchemaError("snapshot reply: %d digest bytes is not a multiple of width %d" % (len(entries), width))
    try:
        head = SNAPSHOT_REPLY.pack(status, SNAPSHOT_FLAG_DONE if done else 0, epoch, seq, next, n, width)
        return head + bytes(entries)
    except struct.error as e:
        raise SchemaError("snapshot reply: %s" % e) from None


def decode_snapshot_reply(b) -> SnapshotReply:
    what = "snapshot reply"
    _need(what, b, 0, 40)
    status, flags, epoch, seq, nxt, n, width = SNAPSHOT_REPLY.unpack_from(b, 0)
    if width not in DIGEST_WIDTHS:
        raise SchemaError("%s: digest width %d" % (what, width))
    if n > MAX_SNAPSHOT_PER_REPLY:
        raise SchemaError("%s: %d entries, at most %d" % (what, n, MAX_SNAPSHOT_PER_REPLY))
    size = n * width
    _need(what, b, 40, size)
    _done(what, b, 40 + size)
    return SnapshotReply(status, bool(flags & SNAPSHOT_FLAG_DONE), epoch, seq, nxt, width, bytes(_view(b)[40:]))


# --------------------------------------------------------------------------
# KV events (protocol.md sections 5.11-5.13, 6.6): Describe, and the
# EventsReply that answers Events (a Changes payload, encode_changes) and
# EventSnapshot (a Snapshot payload, encode_snapshot).


class DescribeRun(NamedTuple):
    """A run of consecutive blocks of one prefix chain: block i's parent is
    block i-1, the first block's is parent (None: the chain's first block).
    tokens: blocks x tokens_per_block u32 token ids, little-endian bytes."""

    parent: Optional[bytes]
    digests: bytes
    tokens_per_block: int
    tokens: bytes
    extra: bytes = b""


def describe_run_header(blocks: int, tokens_per_block: int, extra_len: int, parent: bool) -> bytes:
    """The 16-byte header of one Describe run (the hot path builds runs from
    it and the run's bytes, without DescribeRun objects)."""
    try:
        return DESCRIBE_RUN.pack(blocks, tokens_per_block, extra_len, DESCRIBE_FLAG_PARENT if parent else 0)
    except struct.error as e:
        raise SchemaError("Describe: %s" % e) from None


def describe_header(runs: int) -> bytes:
    """The 8-byte header of a Describe of that many runs."""
    return DESCRIBE.pack(runs, 0)


def encode_describe(runs: Sequence[DescribeRun], width: int) -> bytes:
    if width not in DIGEST_WIDTHS:
        raise SchemaError("Describe: digest width %d" % width)
    parts = [describe_header(len(runs))]
    total = 0
    for r in runs:
        n = len(r.digests) // width if width else 0
        t = r.tokens_per_block
        total += n
        if n == 0 or len(r.digests) != n * width:
            raise SchemaError("Describe: a run of %d digest bytes (width %d)" % (len(r.digests), width))
        if total > MAX_DESCRIBE_BLOCKS:
            raise SchemaError("Describe: more than %d blocks" % MAX_DESCRIBE_BLOCKS)
        if not 1 <= t <= MAX_DESCRIBE_TOKENS or len(r.tokens) != 4 * n * t:
            raise SchemaError("Describe: %d token bytes for %d blocks of %d tokens" % (len(r.tokens), n, t))
        if len(r.extra) > MAX_DESCRIBE_EXTRA:
            raise SchemaError("Describe: %d extra bytes, at most %d" % (len(r.extra), MAX_DESCRIBE_EXTRA))
        if r.parent is not None and len(r.parent) != width:
            raise SchemaError("Describe: parent of %d bytes" % len(r.parent))
        parts.append(describe_run_header(n, t, len(r.extra), r.parent is not None))
        if r.parent is not None:
            parts.append(bytes(r.parent))
        parts += [bytes(r.digests), bytes(r.tokens), bytes(r.extra)]
    return b"".join(parts)


def decode_describe(b, width: int) -> Tuple[DescribeRun, ...]:
    what = "Describe"
    if width not in DIGEST_WIDTHS:
        raise SchemaError("%s: digest width %d" % (what, width))
    _need(what, b, 0, 8)
    n, flags = DESCRIBE.unpack_from(b, 0)
    if flags:
        raise SchemaError("%s: flags %#x" % (what, flags))
    if n > MAX_DESCRIBE_BLOCKS:
        raise SchemaError("%s: %d runs, at most %d blocks per record" % (what, n, MAX_DESCRIBE_BLOCKS))
    mv = _view(b)
    off, total, runs = 8, 0, []
    for i in range(n):
        _need(what, b, off, 16)
        blocks, t, e, f = DESCRIBE_RUN.unpack_from(b, off)
        off += 16
        if blocks == 0:
            raise SchemaError("%s: run %d has no blocks" % (what, i))
        total += blocks
        if total > MAX_DESCRIBE_BLOCKS:
            raise SchemaError("%s: more than %d blocks" % (what, MAX_DESCRIBE_BLOCKS))
        if not 1 <= t <= MAX_DESCRIBE_TOKENS:
            raise SchemaError("%s: run %d: %d tokens per block" % (what, i, t))
        if e > MAX_DESCRIBE_EXTRA:
            raise SchemaError("%s: run %d: %d extra bytes" % (what, i, e))
        if f & ~DESCRIBE_FLAG_PARENT:
            raise SchemaError("%s: run %d: flags %#x" % (what, i, f))
        parent = None
        if f & DESCRIBE_FLAG_PARENT:
            _need(what, b, off, width)
            parent = bytes(mv[off : off + width])
            off += width
        size = blocks * width + 4 * blocks * t + e
        _need(what, b, off, size)
        d = bytes(mv[off : off + blocks * width])
        off += blocks * width
        tk = bytes(mv[off : off + 4 * blocks * t])
        off += 4 * blocks * t
        x = bytes(mv[off : off + e])
        off += e
        runs.append(DescribeRun(parent, d, t, tk, x))
    _done(what, b, off)
    return tuple(runs)


class Event(NamedTuple):
    """One entry of an EventsReply. tokens: u32 token ids, little-endian
    bytes (token_ids() lists them); removed events carry the digest alone."""

    op: int
    digest: bytes
    parent: Optional[bytes]
    tokens: bytes
    extra: bytes

    def token_ids(self) -> list[int]:
        return _tokens_list(self.tokens)


def _tokens_list(b) -> list[int]:
    if NATIVE_U32:
        return memoryview(b).cast("I").tolist() if len(b) else []
    return list(struct.unpack("<%dI" % (len(b) // 4), b))


def encode_event(op: int, digest, parent=None, tokens=b"", extra=b"") -> bytes:
    """One EventsReply entry."""
    return (
        EVENT_HEADER.pack(op, DESCRIBE_FLAG_PARENT if parent is not None else 0, len(tokens) // 4, len(extra))
        + bytes(digest)
        + (bytes(parent) if parent is not None else b"")
        + bytes(tokens)
        + bytes(extra)
    )


class EventsReply(NamedTuple):
    """Answers Events ((epoch, seq): the cursor to send next; resync: rebuild
    from EventSnapshot) and EventSnapshot ((epoch, seq): the event log's
    head when the page was read; next: the from_pos of the next page; done:
    no more pages). entries: count self-describing events; see events()."""

    status: int
    resync: bool
    done: bool
    epoch: int
    seq: int
    next: int
    width: int
    count: int
    entries: bytes

    def err(self) -> Optional[RingsideError]:
        return _err(self.status, "")

    def events(self) -> Iterator[Event]:
        """The entries, each copied out (an Event of bytes)."""
        for op, digest, parent, tokens, extra, _ in iter_events(self.entries, self.count, self.width, 0):
            yield Event(op, digest, parent, b"" if tokens is None else bytes(tokens), extra)


# One EventsReply entry as iter_events reads it: (op, digest, parent,
# tokens, extra, tokens per block).
EventEntry = Tuple[int, bytes, Optional[bytes], Optional[memoryview], bytes, int]


def iter_events(b, n: int, width: int, off: int = EVENTS_REPLY_HEADER_SIZE) -> Generator[EventEntry, None, int]:
    """The n EventsReply entries of width-byte digests at b[off:], which
    must end there, each checked as Go's decoder checks it:
    (op, digest, parent, tokens, extra, t). op is EVENT_STORED (parent: the
    block's parent, None for a chain's first block; tokens: a memoryview of
    its t u32 token ids; extra: its extra bytes) or EVENT_REMOVED (the
    digest alone: parent and tokens None, extra b"", t 0).

    Digests, parents and extra bytes are copied out as bytes; tokens alias
    b (valid while b is). A malformed or truncated entry, or bytes past the
    last, raise SchemaError once the entries before it were read.

    The one reader of event entries: EventsReply.events() copies each out,
    check_events() walks them, and the KV events feed (ringside.events)
    announces them as they are read."""
    return _events(b, off, n, width, True)


def _events(b, off: int, n: int, width: int, whole: bool) -> Generator[EventEntry, None, int]:
    """iter_events; whole: the entries must end b. Returns the offset past
    them."""
    size = len(b)
    mv = memoryview(b)
    unpack = EVENT_HEADER.unpack_from
    head = EVENT_HEADER_SIZE
    stored_op, removed_op = EVENT_STORED, EVENT_REMOVED
    max_t, max_x = MAX_DESCRIBE_TOKENS, MAX_DESCRIBE_EXTRA
    for _ in range(n):
        if off + head > size:
            raise SchemaError("events reply: " + _event_error(b, off, width))
        op, f, t, x = unpack(b, off)
        end = off + head + width + (width if f else 0) + 4 * t + x
        if end > size or f > 1 or t > max_t or x > max_x:
            raise SchemaError("events reply: " + _event_error(b, off, width))
        p = off + head + width
        if op == stored_op:
            if f:
                e = p + width + 4 * t
                yield op, b[p - width : p], b[p : p + width], mv[p + width : e], b[e:end] if x else b"", t
            else:
                e = p + 4 * t
                yield op, b[p - width : p], None, mv[p:e], b[e:end] if x else b"", t
        elif op == removed_op and not (f or t or x):
            yield op, b[p - width : p], None, None, b"", 0
        else:
            raise SchemaError("events reply: " + _event_error(b, off, width))
        off = end
    if whole and off != size:
        raise SchemaError("events reply: %d trailing bytes" % (size - off))
    return off


def _event_error(b, off: int, width: int) -> str:
    """What is wrong with the event entry at b[off:] (_events found it
    malformed)."""
    if off + EVENT_HEADER_SIZE > len(b):
        return "need %d bytes at offset %d, have %d" % (EVENT_HEADER_SIZE, off, len(b))
    op, f, t, x = EVENT_HEADER.unpack_from(b, off)
    if op != EVENT_STORED and op != EVENT_REMOVED:
        return "event op %d" % op
    if f & ~DESCRIBE_FLAG_PARENT:
        return "event flags %#x" % f
    if t > MAX_DESCRIBE_TOKENS or x > MAX_DESCRIBE_EXTRA:
        return "event with %d tokens and %d extra bytes" % (t, x)
    if op == EVENT_REMOVED and (f or t or x):
        return "a removed event carries its digest alone"
    n = EVENT_HEADER_SIZE + width + (width if f else 0) + 4 * t + x
    return "need %d bytes at offset %d, have %d" % (n, off, len(b))


def encode_events_reply(
    status: int,
    resync: bool,
    done: bool,
    epoch: int,
    seq: int,
    next: int,  # noqa: A002
    width: int,
    count: int = 0,
    entries=b"",
) -> bytes:
    flags = (EVENTS_FLAG_RESYNC if resync else 0) | (EVENTS_FLAG_DONE if done else 0)
    try:
        return EVENTS_REPLY.pack(status, flags, epoch, seq, next, count, width) + bytes(entries)
    except struct.error as e:
        raise SchemaError("events reply: %s" % e) from None


def check_events(b, off: int, n: int, width: int) -> int:
    """Check n entries of width-byte digests from offset off; returns the
    offset past them (raises SchemaError as the Go decoder fails)."""
    entries = _events(b, off, n, width, False)
    while True:
        try:
            next(entries)
        except StopIteration as stop:
            return stop.value


def decode_events_reply(b) -> EventsReply:
    what = "events reply"
    _need(what, b, 0, 40)
    status, flags, epoch, seq, nxt, n, width = EVENTS_REPLY.unpack_from(b, 0)
    if width not in DIGEST_WIDTHS:
        raise SchemaError("%s: digest width %d" % (what, width))
    if n > MAX_EVENTS_PER_REPLY:
        raise SchemaError("%s: %d entries, at most %d" % (what, n, MAX_EVENTS_PER_REPLY))
    end = check_events(b, EVENTS_REPLY.size, n, width)
    _done(what, b, end)
    return EventsReply(
        status,
        bool(flags & EVENTS_FLAG_RESYNC),
        bool(flags & EVENTS_FLAG_DONE),
        epoch,
        seq,
        nxt,
        width,
        n,
        bytes(_view(b)[40:end]),
    )


# Which decoder reads the reply to each request type.
REPLY_DECODERS = {
    TYPE_PUT_HASHES: decode_reply,
    TYPE_DROP_HASHES: decode_reply,
    TYPE_LOOKUP: decode_reply,
    TYPE_ACQUIRE: decode_lease_reply,
    TYPE_POLL: decode_lease_reply,
    TYPE_RELEASE: decode_reply,
    TYPE_REGISTER_REGION: decode_reply,
    TYPE_LOAD: decode_reply,
    TYPE_STORE: decode_store_reply,
    TYPE_CHANGES: decode_changes_reply,
    TYPE_DETACH: decode_reply,
    TYPE_PING: decode_reply,
    TYPE_SNAPSHOT: decode_snapshot_reply,
    TYPE_DESCRIBE: decode_reply,
    TYPE_EVENTS: decode_events_reply,
    TYPE_EVENT_SNAPSHOT: decode_events_reply,
    TYPE_RETAIN: decode_reply,
}


def reply_status(b) -> int:
    """The status word every reply payload starts with."""
    _need("reply", b, 0, 4)
    return _U32.unpack_from(b, 0)[0]


__all__ = [
    n
    for n in dir()
    if not n.startswith("_")
    and n
    not in (
        "annotations",
        "struct",
        "sys",
        "array",
        "Iterator",
        "Generator",
        "NamedTuple",
        "Optional",
        "Sequence",
        "Tuple",
    )
]
