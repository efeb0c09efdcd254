"""Driver of the python row of `ringside bench poll` (not a public API).

The Go bench has already published the pages, filled the engine instance's
load budget and queued waiting queries; this driver attaches with the Python
session client (ringside.client) as another session of the same engine
instance, which makes those leases visible to it, and times Poll calls on
them, one call at a time. It prints one JSON object per size:

    {"hashes": 64, "samples_ns": [[...], [...], [...]]}

and exits non-zero, with the reason on stderr, when the client is missing or
does not fit; the Go side then prints the row as skipped with that reason.
"""

import argparse
import json
import sys
import time


def _connect(args):
    from .client import Session

    return Session.attach(args.socket, instance=args.instance, model=args.model, layout=args.layout, timeout=30.0)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ringside._pollbench")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--polls", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--lease", action="append", default=[], help="HASHES=LEASE_ID")
    args = ap.parse_args(argv)
    leases = []
    for spec in args.lease:
        n, lid = spec.split("=", 1)
        leases.append((int(n), int(lid)))
    c = _connect(args)
    try:
        poll = c.poll
        clock = time.perf_counter_ns
        for n, lid in leases:
            first = poll(lid)
            if first.state != 1 or first.blocks != n or first.lease != lid:  # 1: waiting
                raise RuntimeError("lease %d: %r, want %d blocks, waiting" % (lid, first, n))
            for _ in range(args.warmup):
                r = poll(lid)
                if r.state != 1:
                    raise RuntimeError("lease %d: %r, want waiting" % (lid, r))
        # Batches go round robin over the sizes, as in the Go rows.
        samples = {n: [] for n, _ in leases}
        for _ in range(args.batches):
            for n, lid in leases:
                s = [0] * args.polls
                for i in range(args.polls):
                    t0 = clock()
                    poll(lid)
                    s[i] = clock() - t0
                samples[n].append(s)
        for n, _ in leases:
            sys.stdout.write(json.dumps({"hashes": n, "samples_ns": samples[n]}) + "\n")
        sys.stdout.flush()
    finally:
        close = getattr(c, "close", None)
        if callable(close):
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
