"""The protocol scenarios (testdata/scenarios) through ringside.client.Session
against a real `ringside serve` process.

The Python driver of the scenario language documented in
testdata/scenarios/README.md; the Go drivers (internal/scenario) run the
same files against the state machine alone and against in-process
sidecars. Every driver must print exactly the expected output. This one never
rewrites a file: it fails on the first difference and prints a diff. It runs
one sidecar without the shared tier, so it skips the files whose drivers
line does not name it (those that order copies and the tier's work, or
need several sidecars, a tier or another uid).
"""

import ctypes
import difflib
import glob
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import urllib.request

import pytest

from ringside import schema as S
from ringside.client import RingsideError, RingsideTimeout, RingsideUnavailable, Session
from ringside.sidecar_process import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None, reason="the Go toolchain (go) is not on PATH: cannot build the ringside sidecar"
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCENARIOS = os.path.join(REPO, "testdata", "scenarios")
BASE = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
RING_CAPACITY = 64 << 10
# The sidecar command's --limits shares, in Sidecar's order.
SHARES = ("pin-share", "retain-share", "pending-share", "session-share")

# Under Yama ptrace_scope=1 the sidecar (our child) may not read our memory
# with process_vm_readv unless we allow it. Harmless where Yama is absent.
try:
    ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong((1 << 64) - 1), 0, 0, 0)
except Exception:  # noqa: BLE001  # pragma: no cover
    pass


class ScenarioError(Exception):
    """The scenario itself is wrong (an unknown name, command or argument)."""


# -- the datadriven file format (github.com/cockroachdb/datadriven) ----------


def parse_line(line):
    """datadriven's ParseLine: a command, then arguments `key`, `key=value`
    or `key=(v1, v2, ...)`. Returns (cmd, [(key, [values])])."""
    line = line.strip()
    if not line:
        return "", []
    orig = line

    def bad():
        raise ScenarioError("cannot parse directive: %s" % orig)

    def until(chars):
        nonlocal line
        idx = min((line.find(c) for c in chars if c in line), default=len(line))
        res, line = line[:idx], line[idx:]
        return res

    cmd = until(" ")
    if not cmd:
        bad()
    line = line.strip()
    args = []
    while line:
        key = until(" =")
        if not key:
            bad()
        vals = []
        if line.startswith("="):
            line = line[1:]
            if not line or line[0] == " ":
                vals = [""]
            elif line[0] != "(":
                vals = [until(" ")]
            else:
                pos, nest, start = 1, 1, 1
                while nest > 0:
                    if pos == len(line):
                        bad()
                    ch = line[pos]
                    pos += 1
                    if ch == "," and nest == 1:
                        vals.append(line[start : pos - 1])
                        while pos < len(line) and line[pos] == " ":
                            pos += 1
                        start = pos
                    elif ch == "(":
                        nest += 1
                    elif ch == ")":
                        nest -= 1
                vals.append(line[start : pos - 1])
                line = line[pos:]
        args.append((key, vals))
        line = line.strip()
    return cmd, args


class Directive:
    def __init__(self, pos, line, cmd, args, input_, expected):
        self.pos, self.line, self.cmd, self.args, self.input, self.expected = pos, line, cmd, args, input_, expected


def read_directives(path):
    """The directives of a datadriven file, as datadriven's reader finds
    them: comments skipped, `\\` continues a line, input up to `----`, the
    expected output up to a blank line (or between `----` pairs)."""
    with open(path) as f:
        lines = f.read().splitlines()
    i, out = 0, []
    while i < len(lines):
        raw = lines[i]
        i += 1
        pos = "%s:%d" % (path, i)
        line = raw.strip()
        if line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        cmd, args = parse_line(line)
        if not cmd:
            continue
        inp, sep = [], False
        while i < len(lines):
            ln = lines[i]
            i += 1
            if ln == "----":
                sep = True
                break
            inp.append(ln)
        expected = []
        if sep:
            first = ""
            if i < len(lines):
                first = lines[i]
                i += 1
            if first == "----":
                while i < len(lines):
                    ln = lines[i]
                    i += 1
                    if ln == "----" and i < len(lines):
                        ln2 = lines[i]
                        i += 1
                        if ln2 == "----":
                            if i < len(lines):
                                if lines[i] != "":
                                    raise ScenarioError("%s: non-blank line after ---- ----" % pos)
                                i += 1
                            break
                        expected += [ln, ln2]
                        continue
                    expected.append(ln)
            else:
                ln = first
                while True:
                    if ln.strip() == "":
                        break
                    expected.append(ln)
                    if i >= len(lines):
                        break
                    ln = lines[i]
                    i += 1
        out.append(Directive(pos, line, cmd, args, "\n".join(inp).strip(), "".join(e + "\n" for e in expected)))
    return out


# -- deterministic data ---------------------------------------------------------


def content(tag, i, n):
    """The page content named TAG#I, n bytes."""
    seed = hashlib.sha256(("%s#%d" % (tag, i)).encode()).digest()
    out = b"".join(hashlib.sha256(seed + struct.pack("<I", j)).digest() for j in range((n + 31) // 32))
    return out[:n]


def page_list(spec):
    out = []
    if spec == "":
        return out
    for item in spec.split(","):
        lo, dash, hi = item.partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise ScenarioError("page list %r: %r" % (spec, item)) from None
        if a < 0 or b < a or b - a > 1 << 16 or b >= 1 << 32:
            raise ScenarioError("page list %r: %r" % (spec, item))
        out += range(a, b + 1)
    return out


def status_string(st):
    return "status %d (%s)" % (st, S.status_name(st))


TYPES = {
    "put": S.TYPE_PUT_HASHES,
    "drop": S.TYPE_DROP_HASHES,
    "lookup": S.TYPE_LOOKUP,
    "acquire": S.TYPE_ACQUIRE,
    "poll": S.TYPE_POLL,
    "release": S.TYPE_RELEASE,
    "region": S.TYPE_REGISTER_REGION,
    "load": S.TYPE_LOAD,
    "store": S.TYPE_STORE,
    "changes": S.TYPE_CHANGES,
    "detach": S.TYPE_DETACH,
    "ping": S.TYPE_PING,
    "snapshot": S.TYPE_SNAPSHOT,
    "describe": S.TYPE_DESCRIBE,
    "events": S.TYPE_EVENTS,
    "event-snapshot": S.TYPE_EVENT_SNAPSHOT,
    "retain": S.TYPE_RETAIN,
}
ROLES = {"client": S.ROLE_CLIENT, "scheduler": S.ROLE_SCHEDULER, "worker": S.ROLE_WORKER}


# -- the driver: a real sidecar process ----------------------------------------


def listening(path):
    if not os.path.exists(path):
        return False
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7] == path and int(parts[3], 16) & 0x10000:
                    return True
    except OSError:
        return True
    return False


class Sidecar:
    """`ringside serve` on a fresh directory, with its metrics endpoint (for
    the pool's counters and the list of sessions)."""

    def __init__(self, binary, slots, slot_bytes, budget, chunk_bytes, shares=(0, 0, 0, 0), meta_bytes=0):
        self.dir = tempfile.mkdtemp(prefix="rs-scen-", dir=BASE)
        self.sock = os.path.join(self.dir, "ringside.sock")
        self.metrics = "127.0.0.1:%d" % free_port()
        args = [
            binary,
            "serve",
            "--dir",
            self.dir,
            "--pool.bytes",
            str(slots * slot_bytes),
            "--pool.slot-bytes",
            str(slot_bytes),
            "--ring.capacity",
            str(RING_CAPACITY),
            "--metrics.addr",
            self.metrics,
            # The scenarios' eviction orders are exact LRU's, as the Go
            # drivers run the machine (a zero cache.Config), not serve's
            # default policy.
            "--cache.policy",
            "lru",
        ]
        if budget:
            args += ["--budget", str(budget)]
        if chunk_bytes:
            args += ["--copy.chunk-bytes", str(chunk_bytes)]
        for flag, share in zip(SHARES, shares):
            if share:
                args += ["--limits." + flag, repr(share)]
        if meta_bytes:
            args += ["--limits.metadata-bytes", str(meta_bytes)]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("sidecar did not start:\n" + self.logs())
            if listening(self.sock):
                try:
                    self.state()
                    break
                except OSError:
                    pass
            time.sleep(0.005)

    def logs(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def state(self):
        with urllib.request.urlopen("http://%s/debug/state" % self.metrics, timeout=2) as r:
            return json.load(r)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("sidecar ignored SIGTERM:\n" + self.logs())
            assert rc == 0, "sidecar exited with %d:\n%s" % (rc, self.logs())
        left = os.listdir(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.log.close()
        assert left == [], "files left behind: %r" % left


class Memory:
    """Client memory of this process, zeroed."""

    def __init__(self, n):
        self.n = n
        self.buf = ctypes.create_string_buffer(n)
        self.base = ctypes.addressof(self.buf)

    def read(self, off, n):
        return ctypes.string_at(self.base + off, n)

    def write(self, off, b):
        ctypes.memmove(self.base + off, b, len(b))


class Region:
    def __init__(self, mem, page_bytes, pages):
        self.mem, self.page_bytes, self.pages = mem, page_bytes, pages


class Sess:
    def __init__(self, s, width):
        self.s, self.width, self.regions = s, width, {}


class Runner:
    """The scenario interpreter: the Python twin of internal/scenario."""

    def __init__(self, binary):
        self.binary = binary
        self.sidecar = None
        self.slot_bytes = 4096
        self.sessions = {}
        self.leases = {}
        self.cursors = {}
        self.names = {}  # digest bytes (any width) -> SEED#I
        self.contents = {}  # sha256 of a page's content -> TAG#I
        self.chains = {}

    def close(self):
        for ss in self.sessions.values():
            ss.s.close()
        if self.sidecar is not None:
            self.sidecar.stop()

    # -- arguments

    class Args:
        def __init__(self, d):
            self.m, self.used = {}, set()
            for k, vals in d.args:
                if len(vals) > 1:
                    raise ScenarioError("argument %s: one value, no parentheses" % k)
                if k in self.m:
                    raise ScenarioError("argument %s given twice" % k)
                self.m[k] = vals[0] if vals else ""

        def has(self, k):
            self.used.add(k)
            return k in self.m

        def str(self, k, default=""):
            self.used.add(k)
            return self.m.get(k, default)

        def need(self, k):
            self.used.add(k)
            if k not in self.m:
                raise ScenarioError("missing argument %s=" % k)
            return self.m[k]

        def num(self, k, default=0):
            self.used.add(k)
            if k not in self.m:
                return default
            v = self.m[k]
            try:
                n = int(v, 0)
            except ValueError:
                raise ScenarioError("argument %s=%s: not a number" % (k, v)) from None
            if n < 0 or n >= 1 << 64:
                raise ScenarioError("argument %s=%s: not a number" % (k, v))
            return n

        def share(self, k):
            self.used.add(k)
            v = self.m.get(k, "0")
            try:
                f = float(v)
            except ValueError:
                raise ScenarioError("argument %s=%s: not a number in [0, 1]" % (k, v)) from None
            if not 0 <= f <= 1:
                raise ScenarioError("argument %s=%s: not a number in [0, 1]" % (k, v))
            return f

        def need_num(self, k):
            self.need(k)
            return self.num(k)

        def done(self):
            extra = sorted(set(self.m) - self.used)
            if extra:
                raise ScenarioError("unknown arguments %s" % extra)

    # -- running

    def run(self, path):
        for d in read_directives(path):
            try:
                actual = self.exec(d)
            except ScenarioError as e:
                raise ScenarioError("%s: %s: %s" % (d.pos, d.cmd, e)) from None
            if actual and not actual.endswith("\n"):
                actual += "\n"
            if actual != d.expected:
                diff = "".join(
                    difflib.unified_diff(d.expected.splitlines(True), actual.splitlines(True), "expected", "found")
                )
                pytest.fail(
                    "%s:\n  %s\noutput differs from the expected output:\n%s" % (d.pos, d.line, diff), pytrace=False
                )

    def exec(self, d):
        a = self.Args(d)
        if d.cmd == "sidecar":
            if self.sidecar is not None:
                raise ScenarioError("sidecar must be the first command")
            return self.start(a)
        if self.sidecar is None:
            self.start(self.Args(Directive("", "", "sidecar", [], "", "")))
        if d.cmd == "attach":
            out = self.attach(a)
        elif d.cmd == "pool":
            out = self.pool()
        elif d.cmd == "usage":
            u = self.sidecar.state()["usage"]
            out = "sessions=%d meta-bytes=%d" % (u["Sessions"], u["MetaBytes"])
        elif d.cmd == "counters":
            out = self.counters(a)
        elif d.cmd in ("tick", "copies", "tier"):
            raise ScenarioError("%s: only the pure driver lets scripts order time, copies and the tier" % d.cmd)
        else:
            out = self.request(d, a)
        a.done()
        return out

    def start(self, a):
        slots = a.num("slots", 64)
        self.slot_bytes = a.num("slot-bytes", 4096)
        budget = a.num("budget", 0)
        chunk = a.num("chunk-bytes", 0)
        shares = tuple(a.share(k) for k in SHARES)
        meta = a.num("meta-bytes", 0)
        if a.has("node") or a.str("tier", "off") != "off":
            raise ScenarioError("this driver runs one sidecar, without the shared tier")
        a.done()
        self.sidecar = Sidecar(self.binary, slots, self.slot_bytes, budget, chunk, shares, meta)
        return "ok"

    def counters(self, a):
        if a.has("machine"):
            raise ScenarioError("counters machine: only the pure driver sees the Machine's counters")
        p = self.sidecar.state()["pool"]
        return "stored-slots=%d evictions=%d evicted-unwritten=%d" % (p["Stored"], p["Evictions"], p["EvictedUnmarked"])

    def attach(self, a):
        name = a.need("s")
        if name in self.sessions:
            raise ScenarioError("session %s is attached already" % name)
        if a.has("node") or a.has("uid"):
            raise ScenarioError("this driver runs one sidecar, and attaches with its own uid")
        role = a.str("role", "client")
        if role not in ROLES:
            raise ScenarioError("role %r: client, scheduler or worker" % role)
        width = a.num("width", 32)
        kw = dict(
            instance=a.str("instance", "engine-a"),
            model=a.str("model", "llama"),
            layout=a.str("layout", "bf16/16/HND"),
            salt=a.str("salt", ""),
            role=ROLES[role],
            rank=a.num("rank", 0),
            world_size=a.num("world", 1),
            digest_width=width,
        )
        try:
            s = Session.attach(self.sidecar.sock, timeout=5.0, **kw)
        except (RingsideTimeout, RingsideUnavailable):
            raise
        except RingsideError as e:
            return status_string(e.status)
        self.sessions[name] = Sess(s, width)
        return "ok"

    def pool(self):
        p = self.sidecar.state()["pool"]
        return "blocks=%d pending=%d pinned=%d leases=%d loads=%d writers=%d used=%d free=%d" % (
            p["Blocks"],
            p["PendingBlocks"],
            p["PinnedBlocks"],
            p["Leases"],
            p["Loads"],
            p["Writers"],
            p["Used"],
            p["Free"],
        )

    def gone(self, session_id):
        """Waits until the sidecar has forgotten a session (its end is
        asynchronous)."""
        deadline = time.monotonic() + 10
        while any(x["id"] == session_id for x in self.sidecar.state()["sessions"] or []):
            assert time.monotonic() < deadline, "session %d still attached 10 s after it ended" % session_id
            time.sleep(0.002)

    def quiet(self, ss, typ, payload):
        s = ss.s
        n0 = s.quiet_failures
        s.send(typ, payload)
        s.ping(1)  # handled in order: by its reply, the quiet one's is in
        n = s.quiet_failures - n0
        if n == 0:
            return "no reply"
        assert n == 1, "%d replies to one quiet request" % n
        return status_string(s.last_quiet_failure[0])

    def lease(self, a):
        ref = a.need("lease")
        if ref.isdigit():
            return int(ref)
        if ref not in self.leases:
            raise ScenarioError("no lease %s" % ref)
        return self.leases[ref]

    def view(self, a, need_count=True):
        b = a.need_num("batch")
        start = a.num("start", 0)
        count = a.need_num("count") if need_count else 0
        return b, start, count

    COMMANDS = frozenset(
        {
            "detach",
            "abandon",
            "put",
            "drop",
            "lookup",
            "acquire",
            "poll",
            "release",
            "region",
            "fill",
            "check",
            "store",
            "load",
            "changes",
            "snapshot",
            "ping",
            "raw",
            "send",
            "describe",
            "events",
            "event-snapshot",
            "retain",
        }
    )

    def request(self, d, a):
        if d.cmd not in self.COMMANDS:
            raise ScenarioError("unknown command %r" % d.cmd)
        name = a.need("s")
        ss = self.sessions.get(name)
        if ss is None:
            raise ScenarioError("no session %s" % name)
        try:
            return self.call(d, a, ss, name)
        except (RingsideTimeout, RingsideUnavailable):
            raise
        except RingsideError as e:
            if e.status is None:
                raise
            return status_string(e.status)

    def call(self, d, a, ss, name):
        s, cmd = ss.s, d.cmd
        if cmd in ("detach", "abandon"):
            sid = s.info.session
            if cmd == "detach":
                s.close()
            else:
                s.abandon()
            self.gone(sid)
            del self.sessions[name]
            return "ok"
        if cmd == "put":
            return self.put(ss, a)
        if cmd == "drop":
            b = a.need_num("batch")
            if a.has("quiet"):
                return self.quiet(ss, S.TYPE_DROP_HASHES, S.encode_drop_hashes(b))
            s.drop_hashes(b)
            return "ok"
        if cmd == "lookup":
            return "hits=%d" % s.lookup(*self.view(a))
        if cmd == "acquire":
            b, start, count = self.view(a)
            as_ = a.need("as")
            if as_ == "" or as_.isdigit():
                raise ScenarioError("lease name %r: a number names a lease id" % as_)
            ttl = a.num("ttl", 0)
            r = s.acquire(b, start, count, ttl=ttl or None)
            self.leases[as_] = r.lease
            if (r.lease == 0) != (r.state == S.State.MISS):
                raise AssertionError("lease %d in state %s" % (r.lease, S.state_name(r.state)))
            return "%s blocks=%d" % (S.state_name(r.state), r.blocks)
        if cmd == "retain":
            b, start, count = self.view(a)
            ttl, prio, end, owner = a.num("ttl-ms", 0), a.num("prio", 0), a.has("end"), a.num("owner", 0)
            if a.has("quiet"):  # through the client's fire and forget
                n0 = s.quiet_failures
                assert s.retain(b, start, count, ttl, prio, end, wait=False, owner=owner) is None
                s.ping(1)
                n = s.quiet_failures - n0
                if n == 0:
                    return "no reply"
                assert n == 1, "%d replies to one quiet request" % n
                return status_string(s.last_quiet_failure[0])
            got = s.retain(b, start, count, ttl, prio, end, owner=owner)
            assert got is not None and s.retain_supported, "the sidecar does not know Retain"
            return ("ended=%d" if end else "retained=%d") % got
        if cmd == "poll":
            r = s.poll(self.lease(a))
            return "%s blocks=%d" % (S.state_name(r.state), r.blocks)
        if cmd == "release":
            lease = self.lease(a)
            if a.has("quiet"):
                return self.quiet(ss, S.TYPE_RELEASE, S.encode_release(lease))
            s.release(lease)
            return "ok"
        if cmd == "region":
            return self.region(ss, a)
        if cmd == "fill":
            return self.fill(ss, a)
        if cmd == "check":
            return self.check(ss, a)
        if cmd == "store":
            b, start, _ = self.view(a, need_count=False)
            region = a.need_num("region")
            pages = page_list(a.need("pages"))
            r = s.store(b, start, len(pages), region, pages)
            return "stored=%d present=%d skipped=%d" % (r.stored, r.present, r.skipped)
        if cmd == "load":
            lease = self.lease(a)
            region = a.need_num("region")
            first = a.num("first", 0)
            pages = page_list(a.need("pages"))
            return "loaded=%d" % s.load(lease, region, first, pages)
        if cmd == "changes":
            return self.changes(ss, a)
        if cmd == "snapshot":
            return self.snapshot(ss, a)
        if cmd == "describe":
            return self.describe(ss, a)
        if cmd in ("events", "event-snapshot"):
            return self.events(ss, cmd, a)
        if cmd == "ping":
            v = a.num("v", 0)
            return "pong %d" % s.ping(v)
        if cmd in ("raw", "send"):
            typ, payload = self.raw_request(d, a)
            if cmd == "send":
                return self.quiet(ss, typ, payload)
            layout = a.str("reply", "")
            b = s.await_reply(s.submit(typ, payload))
            if len(b) < 4:
                raise AssertionError("reply of %d bytes has no status" % len(b))
            st = status_string(S.reply_status(b))
            if layout == "":
                return st
            if layout == "common":
                return "%s value=%d" % (st, S.decode_reply(b).value)
            if layout == "events":
                r = S.decode_events_reply(b)
                return "%s width=%d events=%d" % (st, r.width, r.count)
            raise ScenarioError("reply: common or events")
        raise ScenarioError("unknown command %r" % cmd)

    def put(self, ss, a):
        b = a.need_num("batch")
        dg = self.digests(a.need("d"), ss.width)
        flags = 0
        for f, bit in (("append", S.FLAG_APPEND), ("lookup", S.FLAG_LOOKUP), ("replace", S.FLAG_REPLACE)):
            if a.has(f):
                flags |= bit
        payload = S.encode_put_hashes(b, dg, ss.width, flags)
        if a.has("quiet"):
            return self.quiet(ss, S.TYPE_PUT_HASHES, payload)
        if flags & ~S.FLAG_APPEND == 0:
            n = ss.s.put_hashes(b, dg, append=bool(flags & S.FLAG_APPEND))
        else:  # the typed API has no lookup or replace flag: the record itself
            r = S.decode_reply(ss.s.await_reply(ss.s.submit(S.TYPE_PUT_HASHES, payload)))
            if r.status:
                return status_string(r.status)
            n = r.value
        return ("hits=%d" if flags & S.FLAG_LOOKUP else "len=%d") % n

    def region(self, ss, a):
        rid = a.need_num("id")
        pages = a.need_num("pages")
        pb = a.num("page-bytes", self.slot_bytes)
        declared = a.num("declare-pages", pages)
        if pages == 0 or pages > 1 << 16 or pb == 0 or pb > 1 << 20:
            raise ScenarioError("region of %d pages of %d bytes: out of what scenarios allocate" % (pages, pb))
        mem = Memory(pages * pb)
        pid = os.getpid()
        p = a.str("pid", "")
        if p == "other":
            pid += 1
        elif p != "":
            raise ScenarioError("pid=other is the only pid")
        k = a.str("kind", "host")
        if k not in ("host", "cuda"):
            raise ScenarioError("kind: host or cuda")
        kind = S.REGION_CUDA_IPC if k == "cuda" else S.REGION_HOST_PROCESS
        if a.has("quiet"):
            st = self.quiet(
                ss, S.TYPE_REGISTER_REGION, S.encode_register_region(rid, kind, pid, mem.base, mem.n, pb, declared)
            )
        else:
            try:
                ss.s.register_region(rid, mem.base, mem.n, pb, declared, pid=pid, kind=kind)
                st = "ok"
            except (RingsideTimeout, RingsideUnavailable):
                raise
            except RingsideError as e:
                st = status_string(e.status)
        if st in ("ok", "no reply") and rid not in ss.regions:
            ss.regions[rid] = Region(mem, pb, pages)
        return st

    def mem_region(self, ss, a):
        rid = a.need_num("region")
        if rid not in ss.regions:
            raise ScenarioError("no region %d registered in this session" % rid)
        return ss.regions[rid]

    def fill(self, ss, a):
        rg = self.mem_region(ss, a)
        tag = a.need("tag")
        if not tag or any(c in tag for c in "#, ") or tag in ("zero", "unknown"):
            raise ScenarioError("tag %r" % tag)
        for p in page_list(a.need("pages")):
            if p >= rg.pages:
                raise ScenarioError("page %d past the region's %d pages" % (p, rg.pages))
            c = content(tag, p, rg.page_bytes)
            rg.mem.write(p * rg.page_bytes, c)
            self.contents[hashlib.sha256(c).digest()] = "%s#%d" % (tag, p)
        return "ok"

    def check(self, ss, a):
        rg = self.mem_region(ss, a)
        pages = page_list(a.str("pages")) if a.has("pages") else range(rg.pages)
        zero = bytes(rg.page_bytes)
        out = []
        for p in pages:
            if p >= rg.pages:
                raise ScenarioError("page %d past the region's %d pages" % (p, rg.pages))
            pg = rg.mem.read(p * rg.page_bytes, rg.page_bytes)
            name = "zero" if pg == zero else self.contents.get(hashlib.sha256(pg).digest(), "unknown")
            out.append("%d: %s\n" % (p, name))
        return "".join(out)

    def cursor(self, a, k):
        if not a.has(k):
            return (0, 0)
        name = a.str(k)
        if name not in self.cursors:
            raise ScenarioError("no cursor %s" % name)
        return self.cursors[name]

    def name_of(self, dg):
        return self.names.get(bytes(dg), "unknown")

    def changes(self, ss, a):
        epoch, seq = self.cursor(a, "from")
        if a.has("wrong-epoch"):
            epoch += 1
        mx = a.num("max", 0)
        as_ = a.str("as", "")
        r = ss.s.changes(epoch, seq, mx)
        if as_:
            self.cursors[as_] = (r.epoch, r.next)
        out = ["%sentries=%d\n" % ("resync " if r.resync else "", r.n_entries)]
        for op, dg in r.changes():
            if op == S.OP_STORED:
                out.append("stored %s\n" % self.name_of(dg))
            elif op == S.OP_EVICTED:
                out.append("evicted %s\n" % self.name_of(dg))
            elif op == S.OP_CLEARED:
                out.append("cleared\n")
            else:
                out.append("op(%d) %s\n" % (op, self.name_of(dg)))
        return "".join(out)

    def snapshot(self, ss, a):
        frm = a.num("from", 0)
        mx = a.num("max", 0)
        as_ = a.str("as", "")
        r = ss.s.snapshot(frm, mx)
        if as_:
            self.cursors[as_] = (r.epoch, r.seq)
        out = ["%s next=%d entries=%d\n" % ("done" if r.done else "more", r.next, r.count)]
        out += ["%s\n" % self.name_of(dg) for dg in r.digests()]
        return "".join(out)

    def describe(self, ss, a):
        """A Describe of one run: the blocks d, each of tokens-per-block
        consecutive token ids from first-token on."""
        dg = self.digests(a.need("d"), ss.width)
        parent = None
        if a.str("parent", ""):
            parent = self.digests(a.str("parent"), ss.width)
            if len(parent) != ss.width:
                raise ScenarioError("parent=%s: one digest" % a.str("parent"))
        tpb = a.num("tokens-per-block", 1)
        first = a.num("first-token", 0)
        n = len(dg) // ss.width * tpb
        if tpb == 0 or tpb > 0xFFFF or n > 1 << 24:
            raise ScenarioError("tokens-per-block=%d" % tpb)
        tokens = struct.pack("<%dI" % n, *range(first, first + n))
        extra = a.str("extra", "").encode()
        return "described=%d" % ss.s.describe([S.DescribeRun(parent, dg, tpb, tokens, extra)])

    def events(self, ss, cmd, a):
        mx = a.num("max", 0)
        as_ = a.str("as", "")
        if cmd == "events":
            epoch, seq = self.cursor(a, "from")
            if a.has("wrong-epoch"):
                epoch += 1
            r = ss.s.events(epoch, seq, mx)
            out = ["%sevents=%d\n" % ("resync " if r.resync else "", r.count)]
        else:
            r = ss.s.event_snapshot(a.num("from", 0), mx)
            out = ["%s next=%d events=%d\n" % ("done" if r.done else "more", r.next, r.count)]
        if as_:
            self.cursors[as_] = (r.epoch, r.seq)
        for e in r.events():
            out.append(self.event_line(e))
        return "".join(out)

    def event_line(self, e):
        """stored NAME [parent=NAME] [tokens=A-B] [extra=TEXT], or removed NAME."""
        op = {S.EVENT_STORED: "stored", S.EVENT_REMOVED: "removed"}.get(e.op, "op(%d)" % e.op)
        line = "%s %s" % (op, self.name_of(e.digest))
        if e.parent is not None:
            line += " parent=%s" % self.name_of(e.parent)
        ts = e.token_ids()
        if ts:
            if all(ts[i] == ts[i - 1] + 1 for i in range(1, len(ts))):
                line += " tokens=%d-%d" % (ts[0], ts[-1])
            else:
                line += " tokens=%s" % ",".join(str(t) for t in ts)
        if e.extra:
            line += " extra=%s" % bytes(e.extra).decode()
        return line + "\n"

    def raw_request(self, d, a):
        ts = a.need("type")
        if ts in TYPES:
            typ = TYPES[ts]
        else:
            try:
                typ = int(ts, 0)
            except ValueError:
                raise ScenarioError("type %r: a number or a request name" % ts) from None
            if not 0 <= typ < 1 << 16:
                raise ScenarioError("type %r: a number or a request name" % ts)
        h = a.str("payload", "")
        if d.input:
            if a.has("payload"):
                raise ScenarioError("payload both as argument and input")
            h = d.input
        try:
            return typ, bytes.fromhex("".join(h.split()))
        except ValueError as e:
            raise ScenarioError("payload: %s" % e) from None

    def digests(self, spec, width):
        out = []
        if spec == "":
            return b""
        for item in spec.split(","):
            seed, hsh, rng = item.partition("#")
            lo, dash, hi = rng.partition("-")
            try:
                if not hsh or not seed:
                    raise ValueError
                a = int(lo)
                b = int(hi) if dash else a
            except ValueError:
                raise ScenarioError("digest list %r: %r is not SEED#I or SEED#I-J" % (spec, item)) from None
            if a < 0 or b < a or b >= 1 << 16:
                raise ScenarioError("digest list %r: %r" % (spec, item))
            chain = self.chain(seed, b + 1)
            for i in range(a, b + 1):
                dg = chain[i][:width]
                self.names[dg] = "%s#%d" % (seed, i)
                out.append(dg)
        return b"".join(out)

    def chain(self, seed, n):
        c = self.chains.setdefault(seed, [])
        while len(c) < n:
            prev = c[-1] if c else hashlib.sha256(seed.encode()).digest()
            c.append(hashlib.sha256(prev + bytes([len(c) & 0xFF])).digest())
        return c


DRIVERS = ("pure", "go", "python")


def drivers(path):
    """The drivers that run a scenario file: those its `# drivers: a, b` line
    (among the comments before its first command) names, or all of them."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if not line.startswith("#"):
                break
            if line.startswith("# drivers:"):
                names = [n.strip() for n in line[len("# drivers:") :].split(",")]
                for n in names:
                    if n not in DRIVERS:
                        raise ScenarioError("%s: drivers: unknown driver %r" % (path, n))
                return names
    return list(DRIVERS)


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(SCENARIOS, "*.txt"))), ids=lambda p: os.path.basename(p)[:-4]
)
def test_scenario(path, ringside_bin):
    names = drivers(path)
    if "python" not in names:
        pytest.skip("drivers: " + ", ".join(names))
    r = Runner(ringside_bin)
    try:
        r.run(path)
    finally:
        r.close()


def test_scenarios_found():
    assert len(glob.glob(os.path.join(SCENARIOS, "*.txt"))) >= 10, "no scenarios in " + SCENARIOS


def test_reader_matches_datadriven():
    """The reader parses what datadriven does: comments, continued lines,
    input blocks, outputs ended by a blank line or between ---- pairs, and
    argument values in parentheses."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(
            "# comment\n\ncmd a=1 b \\\n  c=(x, y)\n----\nline 1\nline 2\n\n"
            "raw s=a\n01 02\n03\n----\n----\nfirst\n\nafter a blank\n----\n----\n\nlast\n----\n"
        )
    try:
        ds = read_directives(f.name)
    finally:
        os.unlink(f.name)
    assert [(d.cmd, d.args, d.input, d.expected) for d in ds] == [
        ("cmd", [("a", ["1"]), ("b", []), ("c", ["x", "y"])], "", "line 1\nline 2\n"),
        ("raw", [("s", ["a"])], "01 02\n03", "first\n\nafter a blank\n"),
        ("last", [], "", ""),
    ]
    assert page_list("0-2,7") == [0, 1, 2, 7] and page_list("") == []
    with pytest.raises(ScenarioError):
        page_list("3-1")


def test_deterministic_data():
    """The drivers must send the same bytes: these values are pinned here and
    in internal/scenario/scenario_test.go (TestDeterministicData)."""
    r = Runner("")
    d = r.digests("p#0,p#299", 32)
    assert d[:32].hex() == "d3c226bfb1ac95e23c678396c52fdd83071367264bc0d7790e603838eb020f0c"
    assert d[32:40].hex() == "5181c2c785d41e9e"
    assert r.names[d[32:]] == "p#299"
    w8 = r.digests("p#299", 8)
    assert w8 == d[32:40] and r.names[w8] == "p#299"
    assert (
        hashlib.sha256(content("kv", 3, 70)).hexdigest()
        == "5ab27d17b40c3b491391f2b9e683d3daeff4e9885bde4676a45c4fdee9fa215a"
    )
    for bad in ("p", "#1", "p#", "p#2-1", "p#x", "p#0,"):
        with pytest.raises(ScenarioError):
            r.digests(bad, 32)
    d = r.digests("a-b#1-2,c#0", 16)
    assert len(d) == 48 and r.names[d[16:32]] == "a-b#2"
