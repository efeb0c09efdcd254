"""An engine that forks after attaching, for TestForkedChildOutlivesAttacher.

Python, not a re-executed Go test binary: a Go process cannot fork without
exec, and the attack needs a child that keeps the parent's socket fd, ring
mappings and registered memory (at the same addresses) after the parent,
the process that attached, has exited.

Protocol with the test, one JSON object per line on stdout:

  parent (pid P): attaches, maps 4 private anonymous pages (page 0 holds the
  block to store, 0xC3; pages 1..3 the pattern 0x5A), registers them as
  region 1, stores page 0 as the one digest of batch 1 (RS_DIGEST, hex),
  acquires a lease on it, prints {"parent", "session", "lease"} and forks;
  once the child has taken over the rings it exits (os._exit: no detach).

  child: takes the producer role of the submission ring and the consumer
  role of the completion ring for itself, as a fork-aware client does (the
  ring header then names the child, which is alive, so the sidecar's ring
  liveness check sees a live peer: only a session bound to the process that
  attached can tell that it is gone), prints {"child"}, lets the parent
  exit, then waits for a line on stdin (the test has reaped the parent, so
  pid P is free). Then it
    1. pings over the inherited session;
    2. makes pid P live again as its own fork (clone3 with set_tid = P,
       needs CAP_SYS_ADMIN): a new process with a copy of the same memory at
       the same addresses, as a reused pid would be;
    3. loads the leased block into page 1 of region 1, the region that
       names pid P;
    4. asks the new pid-P process whether its page 1 changed, and checks its
       own page 1;
  and prints {"ping", "reuse", "load", "victim_page", "own_page"}.
"""

import ctypes
import json
import mmap
import os
import sys

from ringside import ring as _ring
from ringside.client import Session

PAGE = 4096
STORED, PATTERN = 0xC3, 0x5A


def say(**kv):
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def page_state(buf, i):
    p = buf[i * PAGE : (i + 1) * PAGE]
    if p == bytes([PATTERN]) * PAGE:
        return "untouched"
    if p == bytes([STORED]) * PAGE:
        return "the stored block"
    return "other bytes"


class CloneArgs(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint64)
        for n in (
            "flags",
            "pidfd",
            "child_tid",
            "parent_tid",
            "exit_signal",
            "stack",
            "stack_size",
            "tls",
            "set_tid",
            "set_tid_size",
            "cgroup",
        )
    ]


SYS_CLONE3 = {"x86_64": 435, "aarch64": 435, "riscv64": 435, "loongarch64": 435, "s390x": 435}


def fork_as(pid):
    """Fork a child with the given pid (clone3 set_tid). Returns 0 in the
    child, the pid in the parent, or raises OSError."""
    nr = SYS_CLONE3.get(os.uname().machine)
    if nr is None:
        raise OSError(0, "clone3 number unknown on " + os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    tid = (ctypes.c_int * 1)(pid)
    args = CloneArgs(exit_signal=17, set_tid=ctypes.addressof(tid), set_tid_size=1)  # SIGCHLD
    r = libc.syscall(ctypes.c_long(nr), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, "clone3 set_tid=%d: %s" % (pid, os.strerror(e)))
    return r


def main():
    sock = os.environ["RS_SOCK"]
    digest = bytes.fromhex(os.environ["RS_DIGEST"])
    s = Session.attach(sock, instance="forker", model="llama-rel", layout="bf16/16/HND", timeout=2.0)
    buf = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf[0:PAGE] = bytes([STORED]) * PAGE
    buf[PAGE:] = bytes([PATTERN]) * (3 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    s.register_region(1, base, 4 * PAGE, PAGE, 4)
    s.put_hashes(1, digest)
    r = s.store(1, 0, 1, 1, [0])
    if r.stored != 1:
        say(error="store: %r" % (r,))
        os._exit(1)
    lease = s.acquire(1, 0, 1, ttl=60.0).lease
    parent = os.getpid()
    say(parent=parent, session=s.info.session, lease=lease)
    handover_r, handover_w = os.pipe()
    if os.fork() != 0:
        os.close(handover_w)
        os.read(handover_r, 1)  # the child holds the rings now
        os._exit(0)  # the process that attached is gone; the child keeps everything
    os.close(handover_r)
    # Private attributes: the client has no public "after fork" call.
    s._prod = _ring.Producer(s._sub, _ring.DEFAULT_WAIT)
    s._cons = _ring.Consumer(s._cmp, _ring.DEFAULT_WAIT)
    say(child=os.getpid())
    os.write(handover_w, b"x")
    os.close(handover_w)
    sys.stdin.readline()
    res = {}
    try:
        s.ping(7)
        res["ping"] = "ok"
    except Exception as e:  # noqa: BLE001 (any failure is the expected outcome)
        res["ping"] = "error: %s" % e
    rfd, wfd = os.pipe()
    victim = 0
    try:
        victim = fork_as(parent)
    except OSError as e:
        res["reuse"] = "skip: %s" % e.strerror
    if victim == 0 and "reuse" not in res:
        # The new process with pid P: wait until the load was tried, then
        # tell by the exit code whether page 1 changed.
        os.close(wfd)
        os.read(rfd, 1)
        os._exit({"untouched": 0, "the stored block": 1}.get(page_state(buf, 1), 2))
    os.close(rfd)
    if victim:
        res["reuse"] = "pid %d" % victim
    try:
        n = s.load(lease, 1, 0, [1])
        res["load"] = "ok %d" % n
    except Exception as e:  # noqa: BLE001
        res["load"] = "error: %s" % e
    os.write(wfd, b"x")
    os.close(wfd)
    if victim:
        _, st = os.waitpid(victim, 0)
        res["victim_page"] = {0: "untouched", 1: "the stored block"}.get(os.waitstatus_to_exitcode(st), "other bytes")
    res["own_page"] = page_state(buf, 1)
    say(**res)
    os._exit(0)


if __name__ == "__main__":
    main()
