"""Cross-process helper for ringside's ring tests (Go's ring/python_test.go
and the Python dead-peer test spawn it).

    python3 -m ringside._xproc consume PATH COUNT [--epoch E] [--timeout S]
    python3 -m ringside._xproc produce PATH COUNT [--batch B] [--timeout S]
    python3 -m ringside._xproc produce-forever PATH [--interval-ms MS]

Record i (i = 0, 1, ...) has seq i, type 1 + i % 3, flags i & 0xffff, a
payload of size_for(i) bytes whose byte j is (i*31 + j) & 0xff (the golden
vectors' payload rule).  consume checks every record and prints one JSON line
{"n": N, "bytes": B, "crc": CRC32-IEEE chained over the payloads}; produce
prints the same line for what it wrote, then closes its side.
produce-forever writes one record per interval until killed and prints
"ready" after the first one is published.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib

from . import ring as _ring

_PATTERN = bytes(range(256)) * 80  # 20 KiB: any (offset < 256, n <= 20 KiB - 256) slice


def size_for(i: int) -> int:
    """Payload size of record i: mostly small and varied, every 97th large."""
    if i % 97 == 0:
        return 3000
    return (i * 37) % 301


def payload_for(seq: int, n: int) -> bytes:
    o = (seq * 31) & 0xFF
    return _PATTERN[o : o + n]


def type_for(i: int) -> int:
    return 1 + i % 3


def consume(path: str, count: int, epoch: int = 0, timeout: float = 60.0) -> dict:
    r = _ring.open_ring(path, epoch)
    c = r.consumer()
    crc = 0
    nbytes = 0
    deadline = time.monotonic() + timeout
    for i in range(count):
        while True:
            rec = c.next()
            if rec is not None:
                break
            c.commit()
            c.wait(deadline)
        n = size_for(i)
        p = rec.payload
        if rec.seq != i or rec.type != type_for(i) or rec.flags != i & 0xFFFF or len(p) != n or p != payload_for(i, n):
            raise SystemExit(f"record {i}: got seq={rec.seq} type={rec.type} flags={rec.flags} len={len(p)}")
        crc = zlib.crc32(p, crc)
        nbytes += n
        del p, rec
        if i % 8 == 7:  # borrow several records per commit
            c.commit()
    c.close()
    r.close()
    return {"n": count, "bytes": nbytes, "crc": crc}


def produce(path: str, count: int, batch: int = 4, timeout: float = 60.0, epoch: int = 0) -> dict:
    r = _ring.open_ring(path, epoch)
    p = r.producer()
    crc = 0
    nbytes = 0
    deadline = time.monotonic() + timeout
    for i in range(count):
        n = size_for(i)
        pl = payload_for(i, n)
        while True:
            try:
                p.append(pl, type_for(i), i & 0xFFFF, i)
                break
            except _ring.RingFull:
                p.publish()
                p.wait_space(_ring.record_size(n), deadline)
        crc = zlib.crc32(pl, crc)
        nbytes += n
        if i % batch == batch - 1:
            p.publish()
    p.close()
    r.close()
    return {"n": count, "bytes": nbytes, "crc": crc}


def produce_forever(path: str, interval_ms: float = 1.0) -> None:
    r = _ring.open_ring(path)
    p = r.producer()
    i = 0
    while True:
        n = size_for(i)
        p.write(payload_for(i, n), type_for(i), i & 0xFFFF, i)
        if i == 0:
            print("ready", flush=True)
        i += 1
        time.sleep(interval_ms / 1000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ringside._xproc")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consume")
    c.add_argument("path")
    c.add_argument("count", type=int)
    c.add_argument("--epoch", type=lambda s: int(s, 0), default=0)
    c.add_argument("--timeout", type=float, default=60.0)
    p = sub.add_parser("produce")
    p.add_argument("path")
    p.add_argument("count", type=int)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epoch", type=lambda s: int(s, 0), default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    f = sub.add_parser("produce-forever")
    f.add_argument("path")
    f.add_argument("--interval-ms", type=float, default=1.0)
    a = ap.parse_args(argv)
    if a.cmd == "consume":
        out = consume(a.path, a.count, a.epoch, a.timeout)
    elif a.cmd == "produce":
        out = produce(a.path, a.count, a.batch, a.timeout, a.epoch)
    else:
        produce_forever(a.path, a.interval_ms)
        return 0
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
