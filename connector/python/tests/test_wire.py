"""The Python client's wire is the Go one, and the Python client handles
every part of it.

Three sources are compared:

* the Go source itself: ``go run ./internal/wiregen/gen -print PKG`` prints
  what ringside/_wire_PKG.py must be now (skipped without a Go toolchain),
  so a Go constant, String or record directive changed without
  ``go generate ./schema/`` fails here as well as in Go's internal/wiregen
  test;
* the golden vectors (testdata/golden/schema/vectors.json and
  testdata/golden/ring/vectors.json, written by the Go golden tests with
  ``-update``), which list every wire constant with its Go name, public
  Python name, value and Go String, what the Go decoders accept where Go has
  no constant, and the bytes of every message;
* the generated modules (ringside._wire_schema and ringside._wire_ring) as
  ringside.schema and ringside.ring re-export them.

"Handled" means more than an equal value: every Go constant has its public
Python name, every Go status, state and record type has its enum member,
name and reply decoder, every Go limit is enforced by the Python decoders
and encoders at exactly the Go value, every record layout unpacks the golden
bytes to the golden values, and every Go size and offset is the size and
offset the Python codecs write. A Go constant that is added or changed and
regenerated, but not followed in Python, fails one of these tests.
"""

import json
import os
import shutil
import struct
import subprocess

import pytest
from conftest import REPO_ROOT

from ringside import _wire_ring, _wire_schema
from ringside import ring as R
from ringside import schema as S

GOLDEN = os.path.join(REPO_ROOT, "testdata", "golden")
GENERATED = {"schema": _wire_schema, "ring": _wire_ring}
PUBLIC = {"schema": S, "ring": R}


def _load(name):
    with open(os.path.join(GOLDEN, name, "vectors.json")) as f:
        return json.load(f)


SCHEMA = _load("schema")
RING = _load("ring")
SCHEMA_CONSTS = SCHEMA["constants"]
RING_CONSTS = RING["constants"]
GO = {("schema", c["name"]): c for c in SCHEMA_CONSTS}
GO.update({("ring", c["name"]): c for c in RING_CONSTS})


def go(pkg, name):
    """The Go value of pkg.name, from the golden vectors."""
    try:
        return GO[(pkg, name)]["value"]
    except KeyError:
        raise AssertionError(f"{pkg}.{name} is not in the golden vectors: was it renamed in Go?") from None


def lookup(module, dotted):
    """module.A.B for dotted "A.B" (an enum member), or None."""
    v = module
    for part in dotted.split("."):
        v = getattr(v, part, None)
    return v


# --------------------------------------------------------------------------
# The generated modules are what Go says, now and in the vectors.


@pytest.mark.parametrize("pkg", sorted(GENERATED))
def test_wire_module_is_current_with_the_go_source(pkg):
    gobin = shutil.which("go")
    if gobin is None:
        pytest.skip("the Go toolchain (go) is not on PATH: cannot read the Go constants")
    r = subprocess.run(
        [gobin, "run", "./internal/wiregen/gen", "-root", ".", "-print", pkg],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with open(GENERATED[pkg].__file__) as f:
        committed = f.read()
    if committed != r.stdout:
        diff = [
            f"  committed: {a}\n  from Go:   {b}"
            for a, b in zip(committed.splitlines(), r.stdout.splitlines())
            if a != b
        ]
        pytest.fail(
            f"ringside/_wire_{pkg}.py differs from the Go source: run `go generate ./schema/`, then "
            "`go test ./schema ./ring -run Golden -update`, and commit both\n" + "\n".join(diff[:10])
        )


@pytest.mark.parametrize("pkg,consts", [("schema", SCHEMA_CONSTS), ("ring", RING_CONSTS)])
def test_wire_module_matches_the_vectors(pkg, consts):
    gen = GENERATED[pkg]
    want = {c["python"]: c["value"] for c in consts}
    have = {n: lookup(gen, n) for n in want}
    assert have == want, (
        f"ringside/_wire_{pkg}.py and the golden vectors disagree: regenerate both "
        "(go generate ./schema/; go test ./schema ./ring -run Golden -update)"
    )
    # And no constant of the module is missing from the vectors.
    tables = {"LAYOUTS", "STATUS_NAMES", "STATE_NAMES", "TYPE_NAMES"}
    plain = {n for n in gen.__all__ if isinstance(getattr(gen, n), int) and n not in tables}
    assert plain <= set(want), "constants of _wire_%s.py the vectors lack: %s" % (pkg, sorted(plain - set(want)))


# --------------------------------------------------------------------------
# Every Go constant has its public Python name.


@pytest.mark.parametrize(
    "pkg,c",
    [("schema", c) for c in SCHEMA_CONSTS] + [("ring", c) for c in RING_CONSTS],
    ids=lambda v: v["name"] if isinstance(v, dict) else v,
)
def test_every_go_constant_has_its_public_name(pkg, c):
    value = lookup(PUBLIC[pkg], c["python"])
    where = f"ringside.{pkg}.{c['python']}"
    assert value is not None, f"Go's {pkg}.{c['name']} has no Python name {where}: regenerate (go generate ./schema/)"
    assert value == c["value"], f"{where} is {value}, Go's {pkg}.{c['name']} is {c['value']}"


def _of_type(t):
    return [c for c in SCHEMA_CONSTS if c["type"] == t]


def test_status_enum_is_the_go_statuses():
    go_codes = {c["value"]: c["string"] for c in _of_type("Status")}
    assert {int(s) for s in S.Status} == set(go_codes), "Status members differ from Go's status codes"
    for code, name in go_codes.items():
        assert str(S.Status(code)) == name, f"str(Status({code}))"
        assert S.status_name(code) == name, f"status_name({code})"
    assert len(S.STATUS_NAMES) == len(go_codes), "STATUS_NAMES has an entry per Go status, no more"
    unknown = max(go_codes) + 1
    assert S.status_name(unknown) == f"status({unknown})"  # Go: fmt.Sprintf("status(%d)")
    assert str(S.RingsideError(unknown)) == f"ringside: status({unknown})"


def test_state_enum_is_the_go_states():
    go_states = {c["value"]: c["string"] for c in _of_type("State")}
    assert {int(s) for s in S.State} == set(go_states), "State members differ from Go's query states"
    for v, name in go_states.items():
        assert str(S.State(v)) == name and S.state_name(v) == name
    assert S.state_name(0) == "state(0)" and S.state_name(max(go_states) + 1) == f"state({max(go_states) + 1})"


def test_record_types_have_names_and_reply_decoders():
    go_types = {c["value"]: c["string"] for c in SCHEMA_CONSTS if c["name"].startswith("Type") and "string" in c}
    assert set(S.TYPE_NAMES) == set(go_types), "TYPE_NAMES differs from Go's record types"
    assert set(S.REPLY_DECODERS) == set(go_types), "REPLY_DECODERS has no decoder for some Go record type"
    reply_bit = go("schema", "ReplyBit")
    for t, name in go_types.items():
        assert S.type_name(t) == name
        assert S.type_name(t | reply_bit) == name + "Reply"
        assert t & reply_bit == 0 and 0 < t < go("ring", "TypePad")
    unknown = max(go_types) + 1
    assert S.type_name(unknown) == "type(%#x)" % unknown  # Go: fmt.Sprintf("type(%#x)")


# --------------------------------------------------------------------------
# Every record layout reads the golden bytes as the golden values.


def _golden_messages():
    """(package, message, name, fields, bytes, digest width) of every golden
    vector with a record header: schema's messages, the ring's header page
    and records."""
    out = [
        ("schema", v["message"], v["name"], v["fields"], bytes.fromhex(v["hex"]), v.get("digest_width", 0))
        for v in SCHEMA["vectors"]
    ]
    with open(os.path.join(GOLDEN, "ring", RING["header_file"])) as f:
        out.append(("ring", "Header", "header", RING["header"], bytes.fromhex("".join(f.read().split())), 0))
    out += [("ring", "RecordHeader", r["name"], r, bytes.fromhex(r["hex"]), 0) for r in RING["records"]]
    return out


def _want(pkg, field, fields, width):
    """The value a header field must have in a vector (the rules of
    internal/wiregen's package doc, as its Go test applies them), or
    None for a derived field (~F)."""
    if field == "_":
        return 0
    if field.startswith("~"):
        return None
    if field[0].isupper():
        return go(pkg, field)
    fn, _, arg = field.rstrip(")").partition("(")
    if arg:
        x = fields[arg]
        if fn == "len":
            return len(x.encode("utf-8"))
        assert fn == "count", field
        return len(x) if isinstance(x, list) else len(x) // 2 // width
    x = fields[field]
    if isinstance(x, str):
        return bytes.fromhex(x)
    return int(x)


def test_record_layouts_read_the_golden_vectors():
    vectors = _golden_messages()
    for pkg, gen in GENERATED.items():
        for msg, (layout, fields, size) in gen.LAYOUTS.items():
            assert isinstance(layout, struct.Struct) and len(fields) == len(layout.unpack(bytes(layout.size)))
            if size is not None:
                assert layout.size == getattr(gen, size), f"{msg}: {layout.format} is not {size}"
            checked = 0
            for vpkg, vmsg, name, vfields, b, width in vectors:
                if (vpkg, vmsg) != (pkg, msg):
                    continue
                if msg == "Retain" and len(b) == S.RETAIN_NO_OWNER_SIZE:
                    b = bytes(b) + bytes(8)  # the form without the owner: owner 0
                got = layout.unpack_from(b, 0)
                for f, v in zip(fields, got):
                    w = _want(pkg, f, vfields, width)
                    if w is None:
                        continue
                    if f == "_" and isinstance(v, bytes):
                        v = int.from_bytes(v, "little")
                    assert v == w, f"{pkg} {name}: {msg} {layout.format} field {f} is {v!r}, the vector says {w!r}"
                    checked += 1
            assert checked or size is not None, f"{pkg}.{msg}: no golden vector checks it and it has no size constant"
    # The public names are the generated layouts.
    assert S.PUT_HASHES is _wire_schema.PUT_HASHES and R.RECORD_HEADER is _wire_ring.RECORD_HEADER


# --------------------------------------------------------------------------
# What the Go decoders accept without a constant of their own.


def _attach(**kw):
    args = dict(
        version=1,
        role=S.ROLE_WORKER,
        rank=0,
        world_size=1,
        digest_width=32,
        ring_capacity=0,
        instance="i",
        model="m",
        layout="l",
        salt="",
    )
    args.update(kw)
    return S.AttachRequest(**args)


def _accepts(f):
    try:
        f()
    except S.SchemaError:
        return False
    return True


def test_digest_widths_are_the_go_ones():
    want = SCHEMA["digest_widths"]
    assert list(S.DIGEST_WIDTHS) == want
    assert [w for w in range(256) if _accepts(lambda w=w: S.validate_attach_request(_attach(digest_width=w)))] == want
    assert [w for w in range(256) if _accepts(lambda w=w: S.decode_put_hashes(S.PUT_HASHES.pack(1, 0, 0), w))] == want
    assert [
        w
        for w in range(256)
        if _accepts(lambda w=w: S.decode_changes_reply(struct.pack("<IIQQIB3x", 0, 0, 0, 0, 0, w)))
    ] == want
    assert [
        w
        for w in range(256)
        if _accepts(lambda w=w: S.decode_snapshot_reply(struct.pack("<IIQQQIB3x", 0, 0, 0, 0, 0, 0, w)))
    ] == want
    assert [
        w
        for w in range(256)
        if _accepts(lambda w=w: S.decode_events_reply(struct.pack("<IIQQQIB3x", 0, 0, 0, 0, 0, 0, w)))
    ] == want
    assert [w for w in range(256) if _accepts(lambda w=w: S.decode_describe(bytes(8), w))] == want


def test_region_kinds_are_the_go_ones():
    want = SCHEMA["region_kinds"]
    got = [
        k
        for k in range(256)
        if _accepts(lambda k=k: S.decode_register_region(S.encode_register_region(1, k, 1, 1, 1, 1, 1)))
    ]
    assert got == want
    assert sorted((S.REGION_HOST_PROCESS, S.REGION_CUDA_IPC, S.REGION_CUDA_FD)) == want


# --------------------------------------------------------------------------
# Every Go limit is enforced in Python at exactly the Go value.


# Each probe returns, for a count n, the operations that must accept n at
# the Go limit and each reject it one past: decoders (from raw bytes, not
# from the encoder, which would refuse first) and encoders alike.


def _probe_hashes(n):
    ops = []
    for w in S.DIGEST_WIDTHS:
        raw = struct.pack("<QII", 1, n, 0) + bytes(n * w)
        ops += [lambda raw=raw, w=w: S.decode_put_hashes(raw, w), lambda w=w: S.encode_put_hashes(1, bytes(n * w), w)]
    return ops


def _probe_pages(n):
    load = struct.pack("<QIIII", 1, 1, n, 0, 0) + bytes(4 * n)
    store = struct.pack("<QIIII", 1, 0, n, 1, n) + bytes(4 * n)
    pages = list(range(n))
    return [
        lambda: S.decode_load(load),
        lambda: S.decode_store(store),
        lambda: S.encode_load(1, 1, 0, pages),
        lambda: S.encode_store(1, 0, n, 1, pages),
    ]


def _probe_segments(n):
    raw = struct.pack("<IB3xQQQQII", 1, S.REGION_HOST_PROCESS, 1, 1, 1, 1, 1, n) + bytes(24 * n)
    return [
        lambda: S.decode_register_region(raw),
        lambda: S.encode_register_region(1, S.REGION_HOST_PROCESS, 1, 1, 1, 1, 1, [(0, 0, 0)] * n),
    ]


def _probe_allocations(n):
    raw = struct.pack("<16sII64s", bytes(16), 0, n, bytes(64)) + struct.pack("<64sQQ", bytes(64), 1, 1) * n
    return [
        lambda: S.decode_cuda_extra(raw),
        lambda: S.encode_cuda_extra(bytes(16), [(bytes(64), 1, 1)] * n),
    ]


def _probe_descriptors(n):
    raw = struct.pack("<16sII64s", bytes(16), 0, n, bytes(64)) + b"".join(
        struct.pack("<IIQQ", i, 0, (i + 1) << 21, 1 << 21) for i in range(n)
    )
    return [
        lambda: S.decode_fd_extra(raw),
        lambda: S.encode_fd_extra(bytes(16), [(i, (i + 1) << 21, 1 << 21) for i in range(n)]),
    ]


def _probe_string(n):
    return [
        lambda f=f: S.validate_attach_request(_attach(**{f: "x" * n})) for f in ("instance", "model", "layout", "salt")
    ] + [lambda: S.decode_attach_request(S.encode_attach_request(instance="x" * n, model="m", layout="l"))]


def _probe_changes(n):
    return [
        lambda w=w: S.decode_changes_reply(struct.pack("<IIQQIB3x", 0, 0, 1, 2, n, w) + bytes(n * (8 + w)))
        for w in S.DIGEST_WIDTHS
    ]


def _probe_snapshot(n):
    return [
        lambda w=w: S.decode_snapshot_reply(struct.pack("<IIQQQIB3x", 0, 0, 1, 2, 3, n, w) + bytes(n * w))
        for w in S.DIGEST_WIDTHS
    ]


def _probe_world(n):
    return [
        lambda: S.validate_attach_request(_attach(world_size=n, rank=n - 1)),
        lambda: S.decode_attach_request(
            S.encode_attach_request(world_size=n, rank=0, instance="i", model="m", layout="l")
        ),
    ]


def _probe_describe_blocks(n):
    raw = struct.pack("<IIIHHB7x", 1, 0, n, 1, 0, 0) + bytes(n * 8 + 4 * n)
    run = [S.DescribeRun(None, bytes(8 * n), 1, bytes(4 * n))]
    return [lambda: S.decode_describe(raw, 8), lambda: S.encode_describe(run, 8)]


def _probe_describe_tokens(n):
    raw = struct.pack("<IIIHHB7x", 1, 0, 1, n, 0, 0) + bytes(8 + 4 * n)
    ev = struct.pack("<IIQQQIB3x", 0, 0, 1, 2, 0, 1, 8) + S.encode_event(S.EVENT_STORED, bytes(8), None, bytes(4 * n))
    run = [S.DescribeRun(None, bytes(8), n, bytes(4 * n))]
    return [lambda: S.decode_describe(raw, 8), lambda: S.encode_describe(run, 8), lambda: S.decode_events_reply(ev)]


def _probe_describe_extra(n):
    raw = struct.pack("<IIIHHB7x", 1, 0, 1, 1, n, 0) + bytes(8 + 4 + n)
    ev = struct.pack("<IIQQQIB3x", 0, 0, 1, 2, 0, 1, 8) + S.encode_event(
        S.EVENT_STORED, bytes(8), None, bytes(4), bytes(n)
    )
    run = [S.DescribeRun(None, bytes(8), 1, bytes(4), bytes(n))]
    return [lambda: S.decode_describe(raw, 8), lambda: S.encode_describe(run, 8), lambda: S.decode_events_reply(ev)]


def _probe_events(n):
    return [
        lambda w=w: S.decode_events_reply(
            struct.pack("<IIQQQIB3x", 0, 0, 1, 2, 3, n, w) + S.encode_event(S.EVENT_REMOVED, bytes(w)) * n
        )
        for w in S.DIGEST_WIDTHS
    ]


def _probe_retain_priority(n):
    return [
        lambda: S.decode_retain(S.RETAIN.pack(1, 2, 3, 4, n, 0, 0, 0)),
        lambda: S.decode_retain(S.RETAIN.pack(1, 2, 3, 4, n, 0, 0, 0)[: S.RETAIN_NO_OWNER_SIZE]),
    ]


# One probe per Go limit: a new Max* constant in Go needs one here.
LIMIT_PROBES = {
    "MaxHashesPerRecord": _probe_hashes,
    "MaxPagesPerRecord": _probe_pages,
    "MaxSegments": _probe_segments,
    "MaxAllocations": _probe_allocations,
    "MaxDescriptors": _probe_descriptors,
    "MaxStringLen": _probe_string,
    "MaxChangesPerReply": _probe_changes,
    "MaxSnapshotPerReply": _probe_snapshot,
    "MaxWorldSize": _probe_world,
    "MaxDescribeBlocks": _probe_describe_blocks,
    "MaxDescribeTokens": _probe_describe_tokens,
    "MaxDescribeExtra": _probe_describe_extra,
    "MaxEventsPerReply": _probe_events,
    "MaxRetainPriority": _probe_retain_priority,
}


def test_every_go_limit_has_a_probe():
    limits = {c["name"] for c in SCHEMA_CONSTS if c["name"].startswith("Max")}
    assert limits == set(LIMIT_PROBES), "a Go limit without a Python probe (or a probe for a limit Go lost)"


@pytest.mark.parametrize("name", sorted(LIMIT_PROBES))
def test_python_enforces_the_go_limit(name):
    limit = go("schema", name)
    for op in LIMIT_PROBES[name](limit):
        op()  # at the limit: accepted
    for i, op in enumerate(LIMIT_PROBES[name](limit + 1)):
        with pytest.raises(S.SchemaError):  # one past it: rejected, by every decoder and encoder
            op()
            pytest.fail(f"{name}: operation {i} accepts {limit + 1}, Go's limit is {limit}")


# --------------------------------------------------------------------------
# Every Go size and offset is what the Python codecs write.


def test_schema_sizes_are_what_python_encodes():
    assert len(S.encode_lookup(1, 2, 3)) == go("schema", "ViewSize")
    one = S.encode_register_region(1, S.REGION_HOST_PROCESS, 1, 1, 1, 1, 1, [(1, 2, 3)])
    none = S.encode_register_region(1, S.REGION_HOST_PROCESS, 1, 1, 1, 1, 1)
    assert len(one) - len(none) == go("schema", "SegmentSize")
    assert len(S.encode_change(S.OP_STORED, bytes(16))) - 16 == go("schema", "ChangeHeaderSize")
    one = S.encode_cuda_extra(bytes(16), [(bytes(64), 1, 2)])
    two = S.encode_cuda_extra(bytes(16), [(bytes(64), 1, 2)] * 2, event=bytes(64))
    assert len(one) == go("schema", "CUDAExtraHeaderSize") + go("schema", "CUDAAllocationSize")
    assert len(two) - len(one) == go("schema", "CUDAAllocationSize")
    assert struct.unpack_from("<16xI", two)[0] == go("schema", "CUDAExtraFlagEvent")
    assert len(S.describe_run_header(1, 1, 0, False)) == go("schema", "DescribeRunHeaderSize")
    assert len(S.encode_event(S.EVENT_REMOVED, bytes(8))) - 8 == go("schema", "EventHeaderSize")
    assert len(S.encode_events_reply(0, False, False, 1, 2, 3, 8)) == go("schema", "EventsReplyHeaderSize")
    assert len(S.encode_retain(1, 2, 3, 4, owner=5)) == go("schema", "RetainSize")
    assert len(S.encode_retain(1, 2, 3, 4)) == go("schema", "RetainNoOwnerSize")
    one = S.encode_fd_extra(bytes(16), [(0, 1, 2)])
    two = S.encode_fd_extra(bytes(16), [(0, 1, 2), (1, 3, 2)], event=bytes(64))
    assert len(one) == go("schema", "FDExtraHeaderSize") + go("schema", "FDAllocationSize")
    assert len(two) - len(one) == go("schema", "FDAllocationSize")
    head = S.encode_region_descriptors(3, 1, 2, b"")
    assert len(head) == go("schema", "RegionDescriptorsHeaderSize")
    assert struct.unpack_from("<I", head)[0] == go("schema", "DescriptorsMagic")
    assert struct.unpack_from("<I", S.encode_region_descriptors_reply(3, 0, 1))[0] == go(
        "schema", "DescriptorsReplyMagic"
    )
    sizes = {c["name"] for c in SCHEMA_CONSTS if c["name"].endswith("Size") and not c["name"].startswith("Max")}
    assert sizes == {
        "ViewSize",
        "SegmentSize",
        "ChangeHeaderSize",
        "CUDAExtraHeaderSize",
        "CUDAAllocationSize",
        "DescribeRunHeaderSize",
        "EventHeaderSize",
        "EventsReplyHeaderSize",
        "RetainSize",
        "RetainNoOwnerSize",
        "FDExtraHeaderSize",
        "FDAllocationSize",
        "RegionDescriptorsHeaderSize",
    }, "a Go size without a check here"


def test_schema_flags_and_magics_are_what_python_encodes():
    assert struct.unpack_from("<I", S.encode_attach_request(instance="i", model="m", layout="l"))[0] == go(
        "schema", "AttachMagic"
    )
    assert struct.unpack_from("<I", S.encode_attach_reply())[0] == go("schema", "AttachReplyMagic")
    assert struct.unpack_from("<4xH", S.encode_attach_request())[0] == go("schema", "Version")
    cr = S.encode_changes_reply(0, True, 1, 2, 8)
    assert struct.unpack_from("<4xI", cr)[0] == go("schema", "ChangesFlagResync")
    assert S.decode_changes_reply(cr).resync
    er = S.encode_events_reply(0, True, False, 1, 2, 0, 8)
    assert struct.unpack_from("<4xI", er)[0] == go("schema", "EventsFlagResync") and S.decode_events_reply(er).resync
    er = S.encode_events_reply(0, False, True, 1, 2, 3, 8)
    assert struct.unpack_from("<4xI", er)[0] == go("schema", "EventsFlagDone") and S.decode_events_reply(er).done
    run = S.encode_describe([S.DescribeRun(bytes(8), bytes(8), 1, bytes(4))], 8)
    assert run[16] == go("schema", "DescribeFlagParent")
    sr = S.encode_snapshot_reply(0, True, 1, 2, 3, 8)
    assert struct.unpack_from("<4xI", sr)[0] == go("schema", "SnapshotFlagDone")
    flags = go("schema", "FlagAppend") | go("schema", "FlagLookup")
    assert S.decode_put_hashes(S.encode_put_hashes(1, b"", 8, flags), 8).flags == flags
    with pytest.raises(S.SchemaError):  # no flag bit beyond Go's
        S.decode_put_hashes(S.encode_put_hashes(1, b"", 8, (go("schema", "FlagReplace") << 1)), 8)


def _header(**kw):
    h = dict(
        magic=go("ring", "Magic"),
        version=go("ring", "Version"),
        header_size=go("ring", "HeaderSize"),
        capacity=go("ring", "MinCapacity"),
        align=go("ring", "Align"),
        max_record=1024,
        epoch=0x1122334455667788,
        flags=go("ring", "FlagCreatorProducer"),
        producer_pid=0x01020304,
        producer_start=0x0A0B0C0D0E0F1011,
        consumer_pid=0x05060708,
        consumer_start=0x1213141516171819,
    )
    h.update(kw)
    return R.Header(**h)


def test_ring_header_checks_are_the_go_bounds():
    lo, hi = go("ring", "MinCapacity"), go("ring", "MaxCapacity")
    for cap, ok in ((lo, True), (lo // 2, False), (hi, True), (hi * 2, False)):
        h = _header(capacity=cap)
        if ok:
            R.validate_header(h, go("ring", "HeaderSize") + cap)
        else:
            with pytest.raises(R.RingBadHeader):
                R.validate_header(h, -1)
    for field in ("magic", "version", "header_size", "align"):
        with pytest.raises(R.RingBadHeader):
            R.validate_header(_header(**{field: getattr(_header(), field) + 1}), -1)


def test_ring_header_offsets_are_where_python_writes():
    h = _header()
    b = bytearray(go("ring", "HeaderSize"))
    R.encode_header(b, h)
    fields = {  # Go offset constant: (header field, width)
        "offMagic": ("magic", "Q"),
        "offVersion": ("version", "I"),
        "offHeaderSize": ("header_size", "I"),
        "offCapacity": ("capacity", "Q"),
        "offAlign": ("align", "I"),
        "offMaxRecord": ("max_record", "I"),
        "offEpoch": ("epoch", "Q"),
        "offFlags": ("flags", "I"),
        "offProducerPID": ("producer_pid", "I"),
        "offProducerStart": ("producer_start", "Q"),
        "offConsumerPID": ("consumer_pid", "I"),
        "offConsumerStart": ("consumer_start", "Q"),
    }
    for name, (field, fmt) in fields.items():
        assert struct.unpack_from("<" + fmt, b, go("ring", name))[0] == getattr(h, field), name
    assert R.decode_header(b) == h

    # The live words: positions and the two states, as the Python sides write them.
    cap = go("ring", "MinCapacity")
    mem = bytearray(go("ring", "HeaderSize") + cap)
    ring = R.Ring.format(mem, cap)
    p, c = ring.producer(), ring.consumer()
    p.append(b"x" * 5, 1, 0, 1)
    p.publish()
    assert c.read().payload == b"x" * 5
    c.commit()
    size = go("ring", "RecordHeaderSize") + go("ring", "Align")
    assert struct.unpack_from("<Q", mem, go("ring", "offTail"))[0] == size
    assert struct.unpack_from("<Q", mem, go("ring", "offHead"))[0] == size
    p.close()
    c.close()
    assert struct.unpack_from("<I", mem, go("ring", "offProdState"))[0] == 1
    assert struct.unpack_from("<I", mem, go("ring", "offConsState"))[0] == 1
    ring.close()
    checked = set(fields) | {"offTail", "offHead", "offProdState", "offConsState"}
    # The parked flags and futex words are read and written through the
    # same generated offsets (public names checked above); their behaviour is
    # tested by the cross-process wake-up tests.
    checked |= {"offConsParked", "offConsFutex", "offProdParked", "offProdFutex"}
    offsets = {c["name"] for c in RING_CONSTS if c["name"].startswith("off")}
    assert offsets == checked, "a Go ring offset without a check here"


def test_ring_records_are_the_go_framing():
    hdr = go("ring", "RecordHeaderSize")
    assert R.record_size(0) == hdr and R.record_size(1) == hdr + go("ring", "Align")
    assert len(R.encode_record(b"", 1)) == hdr
    pad = go("ring", "TypePad")
    b = bytearray(64)
    R.encode_record_header(b, 0, 64 - hdr, pad, 0, 0)
    assert R.decode_record_header(b, 0, 64, 32)[1] == pad  # a pad may exceed max record
    cap = go("ring", "MinCapacity")
    ring = R.Ring.format(bytearray(go("ring", "HeaderSize") + cap), cap)
    p = ring.producer()
    for bad in (0, pad):  # type 0 is invalid, the pad type is the producer's own
        with pytest.raises(R.RingBadType):
            p.append(b"", bad, 0, 1)
    ring.close()
