"""A real `ringside serve` process, for tests and benchmarks.

The one way the Python tests (tests/conftest.py's ``start_sidecar`` fixture)
and the vLLM benchmarks (bench/vllm) start a sidecar: a fresh directory under
/dev/shm, a socket that is listening (and, with metrics, a /debug/state that
says ready) before the constructor returns, and a stop that checks the
sidecar exited cleanly and removed what it made::

    sc = SidecarProcess(binary, pool="64MiB", slot="32KiB", metrics=True)
    try:
        s = sc.attach(instance="engine-a")   # a client.Session, closed by stop()
        ...
    finally:
        sc.stop()
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any, Optional

BASE = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_given: set[int] = set()


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP pid and return once every one of its threads is stopped
    (state T in /proc/PID/task/*/stat). The signal is asynchronous: each
    thread stops only when it next handles it, so without the wait a
    thread may still run, and answer a request, after kill() returns; the
    main thread's state alone does not say the others have stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that exited meanwhile
        if states and all(st in ("T", "t") for st in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("process %d did not stop within %.0f s: thread states %s" % (pid, timeout, states))
        time.sleep(0.001)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to, for a process
    started next to bind. It is below the kernel's ephemeral range (or above
    it), so that no outgoing connection of any process can take it between
    this call and that bind (a port the kernel picked with bind(0) can), and
    it is never the same twice in one process."""
    lo, hi = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        pass
    first, last = (max(1024, lo - 16384), lo - 1) if lo > 2048 else (hi + 1, 65535)
    for _ in range(1000):
        port = random.randint(first, last)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port


def listening(path: str) -> bool:
    """Whether a Unix socket is bound to path and listening (bind and listen
    are two steps: a connect between them is refused)."""
    if not os.path.exists(path):
        return False
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7] == path and int(parts[3], 16) & 0x10000:
                    return True
    except OSError:  # no procfs: the file's existence has to do
        return True
    return False


class SidecarProcess:
    """One sidecar process (see the module doc).

    pool, slot, ring_capacity, budget: the matching `serve` flags (None: the
    sidecar's default). metrics: serve /metrics and /debug/state on a free
    port (state() and requests() need it). prefill_blocks: synthetic index
    entries (--debug.prefill-blocks). args: more flags. log: a file path the
    sidecar's output is appended to (default: a temporary file, see logs()).
    directory: use this directory (kept by stop) instead of a fresh one.
    """

    def __init__(
        self,
        binary: str,
        *,
        pool: Optional[str] = "4MiB",
        slot: Optional[str] = "4KiB",
        ring_capacity: Optional[str] = None,
        budget: Optional[str] = None,
        metrics: bool = False,
        prefill_blocks: int = 0,
        args: Sequence[str] = (),
        log: Optional[str] = None,
        log_level: Optional[str] = None,
        directory: Optional[str] = None,
        prefix: str = "rs-py-",
        ready_timeout: float = 30.0,
    ):
        self.binary = binary
        self.own_dir = directory is None
        self.dir = directory or tempfile.mkdtemp(prefix=prefix, dir=BASE)
        self.sock = os.path.join(self.dir, "ringside.sock")
        self.metrics = "127.0.0.1:%d" % free_port() if metrics else ""
        cmd = [binary, "serve", "--dir", self.dir, "--metrics.addr", self.metrics]
        for flag, v in (
            ("--pool.bytes", pool),
            ("--pool.slot-bytes", slot),
            ("--ring.capacity", ring_capacity),
            ("--budget", budget),
        ):
            if v is not None:
                cmd += [flag, str(v)]
        if prefill_blocks:
            cmd += ["--debug.prefill-blocks", str(prefill_blocks)]
        if log_level:
            cmd += ["--log.format", "console", "--log.level", log_level]
        self.cmd = cmd + list(args)
        self.log_path = log
        self.ready_timeout = ready_timeout
        self.sessions: list = []
        self.killed = False
        self.proc: Any = None
        self._log: Any = None
        self.start()

    # -- life --------------------------------------------------------------------

    def start(self) -> None:
        """Start (or, after kill(), restart) the process and wait until it serves."""
        if self._log is not None and not self.log_path:
            self._log.close()
        self._log = open(self.log_path, "ab") if self.log_path else tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=self._log)
        self.killed = False
        deadline = time.monotonic() + self.ready_timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(check=False)
                raise AssertionError("sidecar did not start (%s):\n%s" % (" ".join(self.cmd), self.logs()))
            time.sleep(0.01)

    def _ready(self) -> bool:
        if not listening(self.sock):
            return False
        if not self.metrics:
            return True
        try:
            return bool(self.state().get("ready"))
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, check: bool = True) -> None:
        """Close the sessions made by attach(), SIGTERM the process and wait;
        with check, fail unless it exited 0 and (if not killed) left nothing
        in its directory (a process that was already gone, killed by the
        test, is not checked). A fresh directory is removed."""
        for s in self.sessions:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - a session of a dead sidecar
                pass
        self.sessions = []
        rc = 0
        if self.proc is not None and self.proc.poll() is not None:
            self.killed = True
        elif self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                if check:
                    raise AssertionError("sidecar ignored SIGTERM:\n" + self.logs()) from None
        left = os.listdir(self.dir) if os.path.isdir(self.dir) else []
        logs = self.logs() if check else ""
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._log is not None and not self.log_path:
            self._log.close()
            self._log = None
        if check:
            assert rc == 0, "sidecar exited with %d:\n%s" % (rc, logs)
            if not self.killed:
                assert left == [], "files left behind: %r" % left

    # -- looking at it -------------------------------------------------------------

    def logs(self) -> str:
        if self.log_path:
            try:
                with open(self.log_path, "rb") as f:
                    return f.read().decode(errors="replace")
            except OSError:
                return ""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def attach(self, **kw: Any) -> Any:
        """A client.Session on this sidecar (closed by stop())."""
        from .client import Session

        o = dict(instance="engine-a", model="llama", layout="bf16/16/HND", timeout=5.0)
        o.update(kw)
        s = Session.attach(self.sock, **o)
        self.sessions.append(s)
        return s

    def state(self) -> dict:
        """GET /debug/state (needs metrics)."""
        with urllib.request.urlopen("http://%s/debug/state" % self.metrics, timeout=5) as r:
            return json.load(r)

    def requests(self, typ: str) -> float:
        """ringside_requests_total for one record type (needs metrics)."""
        with urllib.request.urlopen("http://%s/metrics" % self.metrics, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith('ringside_requests_total{type="%s"}' % typ):
                    return float(line.split()[-1])
        return 0.0

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far."""
        try:
            with open("/proc/%d/stat" % self.proc.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0
