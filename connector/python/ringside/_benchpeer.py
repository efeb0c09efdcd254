"""Benchmark peer: the Python side of ringside's round-trip benchmarks.

A Go benchmark creates the rings (or listens on the socket), spawns this
module, echoes every request, and reads back one JSON line from stdout.

Ring mode (Python produces on the request ring, consumes the response ring;
both files already exist, created by the Go side)::

    python3 -m ringside._benchpeer ring REQ_RING RESP_RING --size N --count N
            [--wait spin|park] [--warmup W] [--no-fence]
            [--req-epoch E] [--resp-epoch E] [--timeout S]

Unix-socket baseline (Python connects to a SOCK_STREAM listener)::

    python3 -m ringside._benchpeer uds SOCKET_PATH --size N --count N
            [--warmup W] [--timeout S]

Each of the W + N round trips sends one request and waits for its response;
only the last N are timed, each with time.perf_counter_ns() from just before
the send to just after the response was read.  Requests are records of type
1 with seq = round-trip index (0, 1, ...) and an N-byte payload; the
response must carry the same seq (any type 1..0xFFFE, any payload size).  On
a socket each message is a 16-byte frame header laid out like a ring record
header (u32 payload length, u16 type, u16 flags, u64 seq; little-endian)
followed by exactly length payload bytes, no padding.

--wait spin busy-polls the response ring (holds a CPU); park spins not at
all and sleeps on the futex at once.  --no-fence drops the locked
instruction after each tail/head store (see ringside.ring: a lost wake-up
then costs up to one 10 ms park slice).

Output, one line: {"p50_ns": .., "p99_ns": .., "n": .., "mean_ns": ..,
"min_ns": .., "max_ns": .., "mode": "ring-spin"|"ring-park"|"uds"}.
Exit status 0 on success; errors go to stderr with status 1.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

from . import ring as _ring

FRAME = struct.Struct("<IHHQ")


def summarize(samples: list, mode: str) -> dict:
    s = sorted(samples)
    n = len(s)
    if n == 0:
        return {"p50_ns": 0, "p99_ns": 0, "n": 0, "mean_ns": 0, "min_ns": 0, "max_ns": 0, "mode": mode}

    def pct(q):  # nearest rank
        k = -(-q * n // 100)  # ceil(q*n/100)
        return s[min(n - 1, max(0, k - 1))]

    return {
        "p50_ns": pct(50),
        "p99_ns": pct(99),
        "n": n,
        "mean_ns": sum(s) // n,
        "min_ns": s[0],
        "max_ns": s[-1],
        "mode": mode,
    }


def run_ring(
    req_path: str,
    resp_path: str,
    size: int,
    count: int,
    wait: str = "spin",
    warmup: int = 100,
    fence: bool = True,
    req_epoch: int = 0,
    resp_epoch: int = 0,
    timeout: float = 60.0,
) -> dict:
    if wait not in ("spin", "park"):
        raise ValueError(f"wait mode {wait!r}, want spin or park")
    wc = _ring.SPIN_WAIT if wait == "spin" else _ring.PARK_WAIT
    req = _ring.open_ring(req_path, req_epoch)
    resp = _ring.open_ring(resp_path, resp_epoch)
    prod = req.producer(fence=fence)
    cons = resp.consumer(wc, fence=fence)
    payload = bytes(size)
    samples = [0] * count
    clock = time.perf_counter_ns
    deadline = time.monotonic() + timeout
    append, publish, nxt, commit, cwait = prod.append, prod.publish, cons.next, cons.commit, cons.wait
    try:
        for i in range(warmup + count):
            t0 = clock()
            try:
                append(payload, 1, 0, i)
            except _ring.RingFull:
                prod.write(payload, 1, 0, i, deadline)
            publish()
            rec = nxt()
            while rec is None:
                cwait(deadline)
                rec = nxt()
            seq = rec.seq
            del rec
            commit()
            t1 = clock()
            if seq != i:
                raise RuntimeError(f"response seq {seq}, want {i}")
            if i >= warmup:
                samples[i - warmup] = t1 - t0
    finally:
        prod.close()
        cons.close()
        req.close()
        resp.close()
    return summarize(samples, "ring-" + wait)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        k = sock.recv_into(view)
        if k == 0:
            raise ConnectionError("peer closed the socket")
        view = view[k:]


def run_uds(path: str, size: int, count: int, warmup: int = 100, timeout: float = 60.0) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    msg = bytearray(FRAME.size + size)
    hdr = bytearray(FRAME.size)
    hview = memoryview(hdr)
    body = bytearray(max(size, 4096))
    samples = [0] * count
    clock = time.perf_counter_ns
    try:
        for i in range(warmup + count):
            t0 = clock()
            FRAME.pack_into(msg, 0, size, 1, 0, i)
            sock.sendall(msg)
            _recv_exact(sock, hview)
            n, _typ, _flags, seq = FRAME.unpack_from(hdr)
            if n > len(body):
                body = bytearray(n)
            _recv_exact(sock, memoryview(body)[:n])
            t1 = clock()
            if seq != i:
                raise RuntimeError(f"response seq {seq}, want {i}")
            if i >= warmup:
                samples[i - warmup] = t1 - t0
    finally:
        sock.close()
    return summarize(samples, "uds")


# Echo sides, for tests and for a Python-only baseline.


def serve_ring_echo(req: _ring.Ring, resp: _ring.Ring, count: int, timeout: float = 60.0) -> int:
    """Echo count requests from req back on resp (same seq and payload)."""
    cons = req.consumer(_ring.PARK_WAIT)
    prod = resp.producer()
    deadline = time.monotonic() + timeout
    done = 0
    try:
        while done < count:
            rec = cons.next()
            if rec is None:
                cons.wait(deadline)
                continue
            prod.write(rec.payload, rec.type, rec.flags, rec.seq, deadline)
            del rec
            cons.commit()
            done += 1
    finally:
        prod.close()
        cons.close()
    return done


def serve_uds_echo(conn: socket.socket, count: int) -> int:
    hdr = bytearray(FRAME.size)
    done = 0
    with conn:
        while done < count:
            _recv_exact(conn, memoryview(hdr))
            n = FRAME.unpack_from(hdr)[0]
            body = bytearray(n)
            _recv_exact(conn, memoryview(body))
            conn.sendall(bytes(hdr) + body)
            done += 1
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m ringside._benchpeer", description="ringside round-trip benchmark peer"
    )
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("ring", help="request/response rings")
    r.add_argument("req")
    r.add_argument("resp")
    r.add_argument("--wait", choices=("spin", "park"), default="spin")
    r.add_argument("--no-fence", action="store_true")
    r.add_argument("--req-epoch", type=lambda s: int(s, 0), default=0)
    r.add_argument("--resp-epoch", type=lambda s: int(s, 0), default=0)
    u = sub.add_parser("uds", help="Unix domain socket baseline")
    u.add_argument("socket")
    for p in (r, u):
        p.add_argument("--size", type=int, required=True)
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--warmup", type=int, default=100)
        p.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    try:
        if a.mode == "ring":
            out = run_ring(
                a.req, a.resp, a.size, a.count, a.wait, a.warmup, not a.no_fence, a.req_epoch, a.resp_epoch, a.timeout
            )
        else:
            out = run_uds(a.socket, a.size, a.count, a.warmup, a.timeout)
    except Exception as e:  # noqa: BLE001 - one clear line for the Go side
        print(f"benchpeer: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
