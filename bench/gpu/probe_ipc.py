#!/usr/bin/env python3
"""What the CUDA driver does with IPC between two processes, as ringside uses it.

A child process (this script with --child) allocates device memory and
exports it; this process imports it, as the sidecar imports an engine's KV
memory. One line per probe, `PROBE <name>: <verdict> (<details>)`:

  ipc-range           cuMemGetAddressRange on the imported pointer of a
                      1 MiB + 4 KiB allocation: the exact size, or rounded
                      up to the allocation granularity
  ipc-corrupt-handle  a handle with bytes 0-1 flipped: does the open fail,
                      with which code
  vmm-export          memory from cuMemCreate + cuMemMap (what PyTorch's
                      expandable segments use): does cuIpcGetMemHandle
                      refuse it
  ipc-event           the child records an interprocess event after a long
                      chain of copies; this process waits on it with
                      cuStreamWaitEvent before its own copy: is the copy
                      held back, does it see the chain's last write
  vmm-fd-export       VMM memory created with CU_MEM_HANDLE_TYPE_POSIX_FILE_
                      DESCRIPTOR requested (vLLM 0.34's KV cache): the child
                      retains its handle from an address inside the mapping
                      and exports a file descriptor (what it refers to, is
                      it close-on-exec), sent here with SCM_RIGHTS
  vmm-fd-import       this process imports the descriptor, maps it and
                      moves bytes both ways with the child
  vmm-release-mapped  both handles released while mapped, then the child
                      unmaps and exits: do the bytes still move, does this
                      process's mapping keep the memory
  vmm-export-unrequested  a descriptor export of memory that requested no
                      handle type (and a FABRIC allocation, where one can be
                      made): which error
  vmm-pointer-attrs   cuPointerGetAttribute (IS_LEGACY_CUDA_IPC_CAPABLE,
                      ALLOWED_HANDLE_TYPES, MAPPED, the range and the
                      mapping), cuMemGetAddressRange and cuIpcGetMemHandle on
                      VMM memory and on cuMemAlloc memory, against what the
                      stand-in driver answers
  exporter-death      D2H copies of a large imported allocation queued, the
                      child SIGKILLed meanwhile: which errors come back, is
                      this process's context poisoned (a sticky error)
  vmm-map-rules       in a child of its own (a refused copy may fault
                      its context): the codes of cuMemMap, cuMemSetAccess,
                      cuMemUnmap, cuMemAddressFree, cuMemRetainAllocationHandle
                      and copies for what the documentation refuses, against
                      the stand-in's
  event-death         last, in a process of its own (it may leave a stream,
                      or a call, hanging): the child records an interprocess
                      event behind about 2 s of H2D copies; this process
                      waits on it (cuStreamWaitEvent) and queues a D2H copy
                      of the child's memory behind the wait; the child is
                      SIGKILLed; cuStreamQuery and cuEventQuery are polled
                      for 10 s: does the wait ever end (with which code); a
                      copy on another stream meanwhile; then the import is
                      closed: is the child's memory freed, and when
                      (cuMemGetInfo before the kill, 10 s after it, after
                      the close). What an engine that dies with its store
                      event's record pending does to a sidecar that waited
                      on the event on the GPU

Only the driver API through ctypes (cudrv.py): no toolkit, no torch. A call
the driver lacks makes its probe `unsupported by this driver (<name>
missing)`; a call the driver or the sandbox refuses is that probe's verdict.
The exit status is 1 only when a probe itself broke (verdict `error`).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cudrv  # noqa: E402
from cudrv import CudaError, Missing  # noqa: E402

PROBES = [
    "ipc-range",
    "ipc-corrupt-handle",
    "vmm-export",
    "ipc-event",
    "vmm-fd-export",
    "vmm-fd-import",
    "vmm-release-mapped",
    "vmm-export-unrequested",
    "vmm-pointer-attrs",
    "exporter-death",
    "vmm-map-rules",
    "event-death",
]
MIB = 1 << 20


def verdict(name: str, v: str, details: str) -> None:
    print(f"PROBE {name}: {v} ({details})", flush=True)


# ---------------------------------------------------------------- child


class ChildState:
    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock  # SCM_RIGHTS to the parent
        self.mappings: list[cudrv.VmmMapping] = []
        self.drv = cudrv.Driver()
        self.allocs: list[int] = []
        self.buffers: list[cudrv.PinnedBuffer] = []
        self.vmm: list[tuple[int, int, int]] = []
        self.stream = 0
        self.event = ctypes.c_void_p()
        self.event_mem = 0
        self.event_bytes = 0

    def op_init(self, _m: dict) -> dict:
        return {"pid": os.getpid(), "uuid": self.drv.uuid().hex(), "name": self.drv.name()}

    def op_alloc(self, m: dict) -> dict:
        n = int(m["bytes"])
        p = self.drv.alloc(n)
        self.allocs.append(p)
        if "fill" in m:
            k = min(n, MIB)
            src = (ctypes.c_ubyte * k)(*([int(m["fill"])] * k))
            self.drv.call("cuMemcpyHtoD", p, src, k)
        return {"handle": self.drv.ipc_handle(p).hex()}

    def op_vmm(self, _m: dict) -> dict:
        d = self.drv
        gran = d.granularity()
        prop = d.vmm_prop()
        h = ctypes.c_ulonglong()
        d.call("cuMemCreate", ctypes.byref(h), gran, ctypes.byref(prop), 0)
        ptr = cudrv.CUdeviceptr()
        d.call("cuMemAddressReserve", ctypes.byref(ptr), gran, 0, 0, 0)
        d.call("cuMemMap", ptr.value, gran, 0, h.value, 0)
        acc = cudrv.MemAccessDesc()
        acc.location.type, acc.location.id = cudrv.CU_MEM_LOCATION_TYPE_DEVICE, d.device
        acc.flags = cudrv.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        d.call("cuMemSetAccess", ptr.value, gran, ctypes.byref(acc), 1)
        self.vmm.append((ptr.value, gran, h.value))
        ih = cudrv.IpcHandle()
        r = d.try_call("cuIpcGetMemHandle", ctypes.byref(ih), ptr.value)
        out = {"granularity": gran, "export": r, "export_name": d.describe(r)}
        if r == 0:
            out["handle"] = bytes(ih.reserved).hex()
        return out

    def op_event_prepare(self, m: dict) -> dict:
        d = self.drv
        n = int(m["bytes"])
        d.call("cuEventCreate", ctypes.byref(self.event), cudrv.CU_EVENT_INTERPROCESS | cudrv.CU_EVENT_DISABLE_TIMING)
        eh = cudrv.IpcHandle()
        d.call("cuIpcGetEventHandle", ctypes.byref(eh), self.event)
        self.event_mem = d.alloc(n)
        self.allocs.append(self.event_mem)
        self.event_bytes = n
        self.stream = d.stream()
        zero, mark = cudrv.PinnedBuffer(d, n), cudrv.PinnedBuffer(d, n)
        zero.fill(0)
        mark.fill(0xAB)
        self.buffers += [zero, mark]
        return {"event": bytes(eh.reserved).hex(), "mem": d.ipc_handle(self.event_mem).hex()}

    def op_event_go(self, m: dict) -> dict:
        d = self.drv
        zero, mark = self.buffers[-2], self.buffers[-1]
        for _ in range(int(m["reps"])):
            d.call("cuMemcpyHtoDAsync", self.event_mem, ctypes.c_void_p(zero.ptr), self.event_bytes, self.stream)
        d.call("cuMemcpyHtoDAsync", self.event_mem, ctypes.c_void_p(mark.ptr), self.event_bytes, self.stream)
        d.call("cuEventRecord", self.event, self.stream)
        q = d.try_call("cuEventQuery", self.event)
        return {"pending": q == cudrv.CUDA_ERROR_NOT_READY, "query": d.describe(q)}

    def op_vmm_fd(self, m: dict) -> dict:
        """A VMM allocation of `granules` granules requesting `types`, mapped
        with one granule of its reservation left unmapped, its first half
        filled with `fill`; exported as a descriptor from a handle retained
        at an address inside the mapping, sent to the parent when `send`."""
        d = self.drv
        gran = d.granularity()
        n = gran * int(m.get("granules", 2))
        r, h = d.vmm_create(n, int(m["types"]))
        out: dict = {"granularity": gran, "bytes": n, "create": r, "create_name": d.describe(r)}
        if r != 0:
            return out
        vm = cudrv.VmmMapping(d, h, n, spare=gran)
        self.mappings.append(vm)
        out["id"] = len(self.mappings) - 1
        out["fill"] = d.fill(vm.ptr, int(m.get("fill", 0)), n // 2)
        r, rh = d.vmm_retain(vm.ptr + n // 2 + 4096)
        out["retain"], out["retain_name"], out["same_handle"] = r, d.describe(r), r == 0 and rh == h
        r, fd = d.vmm_export_fd(rh if r == 0 else h)
        out["export"], out["export_name"] = r, d.describe(r)
        if out["retain"] == 0:
            out["release_retained"] = d.try_call("cuMemRelease", rh)
        if r == 0:
            try:
                out["fd_target"] = os.readlink(f"/proc/self/fd/{fd}")
                out["cloexec"] = bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
                if m.get("send") and self.sock is not None:
                    socket.send_fds(self.sock, [b"f"], [fd])
                    out["sent"] = True
            finally:
                os.close(fd)
        return out

    def op_vmm_read(self, m: dict) -> dict:
        vm = self.mappings[int(m["id"])]
        r, distinct = self.drv.read(vm.ptr + int(m["at"]), int(m["n"]))
        return {"read": r, "read_name": self.drv.describe(r), "distinct": distinct}

    def op_vmm_fill(self, m: dict) -> dict:
        vm = self.mappings[int(m["id"])]
        r = self.drv.fill(vm.ptr + int(m["at"]), int(m["byte"]), int(m["n"]))
        return {"fill": r, "fill_name": self.drv.describe(r)}

    def op_vmm_release(self, m: dict) -> dict:
        r = self.mappings[int(m["id"])].release()
        return {"release": r, "release_name": self.drv.describe(r)}

    def op_vmm_free(self, m: dict) -> dict:
        vm = self.mappings[int(m["id"])]
        codes = vm.close()
        vm.n = 0
        return {"codes": {k: self.drv.describe(v) for k, v in codes.items()}}

    def op_vmm_rules(self, _m: dict) -> dict:
        """The codes of what the Virtual Memory Management section refuses
        (vmm-map-rules); every call that unexpectedly succeeds is undone."""
        d = self.drv
        g = d.granularity()
        codes: dict[str, int] = {}
        r, h = d.vmm_create(2 * g, cudrv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        if r != 0:
            raise CudaError("cuMemCreate", r, d.error_name(r))
        p = cudrv.CUdeviceptr()
        d.call("cuMemAddressReserve", ctypes.byref(p), 4 * g, 0, 0, 0)
        base = p.value
        own = d.alloc(g)

        def try_map(name: str, at: int, n: int, off: int) -> None:
            codes[name] = d.try_call("cuMemMap", at, n, off, h, 0)
            if codes[name] == 0:
                d.opt("cuMemUnmap", at, n)

        try:
            r, h2 = d.vmm_create(g + 4096, cudrv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            codes["cuMemCreate of a size off the granularity"] = r
            if r == 0:
                d.opt("cuMemRelease", h2)
            try_map("cuMemMap of a size off the granularity", base, g + 4096, 0)
            try_map("cuMemMap at an address off the granularity", base + 4096, g, 0)
            try_map("cuMemMap at a nonzero offset", base, g, g)
            try_map("cuMemMap of more than the allocation", base, 3 * g, 0)
            try_map("cuMemMap past the reservation", base + 3 * g, 2 * g, 0)
            d.call("cuMemMap", base, 2 * g, 0, h, 0)
            try_map("cuMemMap over a mapped range", base + g, g, 0)
            acc = d.access_desc()
            codes["cuMemSetAccess of part of a mapping"] = d.try_call("cuMemSetAccess", base, g, ctypes.byref(acc), 1)
            codes["cuMemSetAccess past the mapping"] = d.try_call("cuMemSetAccess", base, 3 * g, ctypes.byref(acc), 1)
            codes["cuMemUnmap of part of a mapping"] = d.try_call("cuMemUnmap", base, g)
            codes["cuMemAddressFree of a mapped reservation"] = d.try_call("cuMemAddressFree", base, 4 * g)
            codes["cuMemAddressFree of another size"] = d.try_call("cuMemAddressFree", base, 2 * g)
            r, rh = d.vmm_retain(base + 3 * g)
            codes["cuMemRetainAllocationHandle of a reserved address not mapped"] = r
            if r == 0:
                d.opt("cuMemRelease", rh)
            r, rh = d.vmm_retain(own)
            codes["cuMemRetainAllocationHandle of cuMemAlloc memory"] = r
            if r == 0:
                d.opt("cuMemRelease", rh)
            # Last, as they may fault the context on a GPU: copies the
            # mapping's access does not allow.
            ro = d.access_desc(cudrv.CU_MEM_ACCESS_FLAGS_PROT_READ)
            codes["cuMemSetAccess read-only"] = d.try_call("cuMemSetAccess", base, 2 * g, ctypes.byref(ro), 1)
            codes["cuMemcpyHtoD into read-only memory"] = d.fill(base, 0x42, 4096)
            codes["cuMemcpyDtoH from read-only memory"] = d.read(base, 4096)[0]
            codes["cuMemUnmap"] = d.try_call("cuMemUnmap", base, 2 * g)
            d.call("cuMemMap", base, 2 * g, 0, h, 0)
            codes["cuMemcpyDtoH from memory mapped without access"] = d.read(base, 4096)[0]
            codes["cuMemUnmap (again)"] = d.try_call("cuMemUnmap", base, 2 * g)
        finally:
            codes["cuMemAddressFree"] = d.try_call("cuMemAddressFree", base, 4 * g)
            codes["cuMemRelease"] = d.try_call("cuMemRelease", h)
            d.opt("cuMemFree", own)
        return {"codes": codes, "names": {k: d.describe(v) for k, v in codes.items()}}

    def close(self) -> None:
        d = self.drv
        for vm in self.mappings:
            if vm.n:
                vm.close()
        if self.stream:
            d.opt("cuStreamSynchronize", self.stream)
        if self.event:
            d.opt("cuEventDestroy", self.event)
        for b in self.buffers:
            b.close()
        for ptr, n, h in self.vmm:
            d.opt("cuMemUnmap", ptr, n)
            d.opt("cuMemAddressFree", ptr, n)
            d.opt("cuMemRelease", h)
        for p in self.allocs:
            d.opt("cuMemFree", p)


def child_main(fd_sock: int | None) -> int:
    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    sock = None if fd_sock is None else socket.socket(fileno=fd_sock)
    try:
        st = ChildState(sock)
    except Missing as e:
        reply({"missing": e.name})
        return 0
    except (CudaError, OSError) as e:
        reply({"error": str(e), "code": getattr(e, "code", -1)})
        return 0
    for line in sys.stdin:
        m = json.loads(line)
        if m["op"] == "exit":
            st.close()
            reply({"bye": True})
            return 0
        try:
            reply(getattr(st, "op_" + m["op"])(m))
        except Missing as e:
            reply({"missing": e.name})
        except CudaError as e:
            reply({"error": str(e), "code": e.code})
    return 0


# ---------------------------------------------------------------- parent


class Unsupported(Exception):
    """The probe cannot run: `what` is its verdict's detail."""

    def __init__(self, verdict: str, details: str):
        super().__init__(details)
        self.verdict, self.details = verdict, details


class Child:
    """This script run with --child, spoken to in JSON lines."""

    def __init__(self, timeout: float, env: dict | None = None):
        self.timeout = timeout
        # The child sends file descriptors here (SCM_RIGHTS), as an engine
        # sends them on its attach socket.
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "--fd-sock", str(theirs.fileno())],
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.ask("init")

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, op: str, **kw) -> dict:
        """The child's reply to op; raises Unsupported for missing calls
        and refusals, so that they become the probe's verdict."""
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            raise Unsupported("failed", f"the child gave no answer to {op} within {self.timeout:.0f} s") from None
        if line is None:
            raise Unsupported("failed", f"the child exited ({self.p.wait()}) during {op}")
        m = json.loads(line)
        if "missing" in m:
            raise Unsupported("unsupported by this driver", f"{m['missing']} missing")
        if "error" in m:
            raise Unsupported("refused", f"child {op}: {m['error']}")
        return m

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.ask("exit")
            except (Unsupported, OSError):
                pass
        if self.p.poll() is None:
            try:
                self.p.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.sock.close()

    def kill(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def recv_fd(self) -> int:
        """A descriptor the child sent (close-on-exec here)."""
        self.sock.settimeout(self.timeout)
        _, fds, _, _ = socket.recv_fds(self.sock, 16, 1, socket.MSG_CMSG_CLOEXEC)
        if len(fds) != 1:
            raise Unsupported("failed", f"{len(fds)} descriptors received, want 1")
        return fds[0]


def open_or_refuse(drv: cudrv.Driver, handle: bytes) -> int:
    r, p = drv.ipc_open(handle)
    if r != 0:
        raise Unsupported("refused", f"cuIpcOpenMemHandle of the child's allocation: {drv.describe(r)}")
    return p


def stand_in_cleanup(handle: bytes) -> None:
    """The stand-in driver keeps "device memory" in /dev/shm files named in
    its handles; a SIGKILLed exporter leaves its files behind, and so does
    a cuMemFree that a sticky error refuses."""
    if handle[:4] == b"FAKE":
        name = handle[4:].split(b"\0", 1)[0].decode(errors="replace")
        if name.startswith("/fakecuda-") and "/" not in name[1:]:
            try:
                os.unlink("/dev/shm" + name)
            except OSError:
                pass


def probe_range(drv: cudrv.Driver, child: Child, args, st: dict) -> None:
    n = args.range_bytes
    h = bytes.fromhex(child.ask("alloc", bytes=n)["handle"])
    st["handle"] = h
    p = open_or_refuse(drv, h)
    try:
        base, size = drv.address_range(p)
    finally:
        drv.opt("cuIpcCloseMemHandle", p)
    try:
        gran = drv.granularity()
    except (Missing, CudaError):
        gran = 0
    where = "base = imported pointer" if base == p else f"base {base:#x} != imported pointer {p:#x}"
    d = f"asked {n} B, range {size} B, {where}, VMM granularity {gran or 'unknown'}"
    if size == n:
        verdict("ipc-range", "exact", d)
    elif size > n and gran and size % gran == 0:
        verdict("ipc-range", f"rounded up to the granularity ({size - n} B more)", d)
    elif size > n:
        mult = size & -size
        verdict("ipc-range", f"rounded up to a multiple of {mult} B ({size - n} B more)", d)
    else:
        verdict("ipc-range", "smaller than the allocation", d)


def probe_bad_handle(drv: cudrv.Driver, child: Child, args, st: dict) -> None:
    h = st.get("handle")
    if h is None:
        h = bytes.fromhex(child.ask("alloc", bytes=args.range_bytes)["handle"])
    bad = bytes([h[0] ^ 0xFF, h[1] ^ 0xFF]) + h[2:]
    r, p = drv.ipc_open(bad)
    if r == 0:
        drv.opt("cuIpcCloseMemHandle", p)
        verdict("ipc-corrupt-handle", "opens", "cuIpcOpenMemHandle of a handle with bytes 0-1 flipped succeeded")
    else:
        d = "cuIpcOpenMemHandle of a handle with bytes 0-1 flipped"
        verdict("ipc-corrupt-handle", f"open fails with {drv.describe(r)}", d)


def probe_vmm(drv: cudrv.Driver, child: Child, _args, _st: dict) -> None:
    m = child.ask("vmm")
    d = f"cuMemCreate + cuMemMap of {m['granularity']} B (one granule), cuIpcGetMemHandle: {m['export_name']}"
    if m["export"] != 0:
        verdict("vmm-export", f"export fails with {m['export_name']}", d)
        return
    r, p = drv.ipc_open(bytes.fromhex(m["handle"]))
    if r == 0:
        drv.opt("cuIpcCloseMemHandle", p)
    verdict("vmm-export", "export succeeds", f"{d}; the importer's cuIpcOpenMemHandle: {drv.describe(r)}")


def probe_event(drv: cudrv.Driver, child: Child, args, _st: dict) -> None:
    for name in ("cuIpcOpenEventHandle", "cuStreamWaitEvent", "cuEventQuery"):
        if not drv.has(name):
            raise Unsupported("unsupported by this driver", f"{name} missing")
    n = args.event_bytes
    m = child.ask("event_prepare", bytes=n)
    mem = open_or_refuse(drv, bytes.fromhex(m["mem"]))
    host = cudrv.PinnedBuffer(drv, n)
    try:
        host.fill(0x11)
        eh = cudrv.IpcHandle()
        ctypes.memmove(ctypes.byref(eh), bytes.fromhex(m["event"]), 64)
        ev = ctypes.c_void_p()
        r = drv.try_call("cuIpcOpenEventHandle", ctypes.byref(ev), eh)
        if r != 0:
            raise Unsupported("refused", f"cuIpcOpenEventHandle: {drv.describe(r)}")
        s = drv.stream()
        if args.stand_in_hold:
            open(args.stand_in_hold, "w").close()
        go = child.ask("event_go", reps=args.event_reps)
        q = drv.try_call("cuEventQuery", ev)
        t0 = time.monotonic()
        drv.call("cuStreamWaitEvent", s, ev, 0)
        drv.call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, n, s)
        held = host.all_equal(0x11, min(n, 4096))
        if args.stand_in_hold:
            os.unlink(args.stand_in_hold)
        drv.call("cuStreamSynchronize", s)
        took = time.monotonic() - t0
        seen = host.all_equal(0xAB, n)
        pending = q == cudrv.CUDA_ERROR_NOT_READY
        d = (
            f"{args.event_reps} H2D copies of {n} B then the marker, recorded in the child; "
            f"event pending in the child after the record: {go['pending']}, here before the wait: {pending} "
            f"({drv.describe(q)}); this process's copy held back after it was queued: {held}; "
            f"wait + copy took {took * 1e3:.1f} ms"
        )
        if not seen:
            verdict("ipc-event", "the copy did not wait: it saw data from before the marker", d)
        elif held or pending:
            verdict("ipc-event", "the copy follows the event", d)
        else:
            verdict("ipc-event", "inconclusive: the event had completed before the wait", d)
        drv.opt("cuStreamDestroy", s)
        drv.opt("cuEventDestroy", ev)
    finally:
        host.close()
        drv.opt("cuIpcCloseMemHandle", mem)


def probe_death(drv: cudrv.Driver, child: Child, args, _st: dict) -> None:
    n, copies = args.death_bytes, args.death_copies
    for name in ("cuMemcpyDtoHAsync", "cuStreamSynchronize"):
        if not drv.has(name):
            raise Unsupported("unsupported by this driver", f"{name} missing")
    h = own_handle = b""
    h = bytes.fromhex(child.ask("alloc", bytes=n, fill=0x5A)["handle"])
    try:
        mem = open_or_refuse(drv, h)
        host = cudrv.PinnedBuffer(drv, n)
        own = drv.alloc(MIB)
        own_handle = drv.ipc_handle(own)  # only to clean up after the stand-in
        s = drv.stream()
        codes: dict[str, int] = {}
        for i in range(copies):
            r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, n, s)
            if r:
                codes[f"queue copy {i}"] = r
                break
        q = drv.opt("cuStreamQuery", s)
        t0 = time.monotonic()
        child.kill()
        killed_after = time.monotonic() - t0
        codes["sync after the kill"] = drv.try_call("cuStreamSynchronize", s)
        r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), own, MIB, s)
        codes["copy of an own buffer"] = r or drv.try_call("cuStreamSynchronize", s)
        host.fill(0)
        r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, MIB, s)
        codes["copy of the import after the death"] = r or drv.try_call("cuStreamSynchronize", s)
        readable = codes["copy of the import after the death"] == 0 and host.all_equal(0x5A, MIB)
        codes["cuIpcCloseMemHandle"] = drv.try_call("cuIpcCloseMemHandle", mem)
        if (r := drv.opt("cuCtxSynchronize")) is not None:
            codes["cuCtxSynchronize"] = r
        drv.opt("cuMemFree", own)
        drv.opt("cuStreamDestroy", s)
        host.close()
        busy = "unknown" if q is None else "still busy" if q == cudrv.CUDA_ERROR_NOT_READY else "already idle"
        errors = {k: v for k, v in codes.items() if v}
        sticky = sorted({v for v in errors.values() if v in cudrv.STICKY})
        d = (
            f"{copies} D2H copies of {n} B queued, stream at the kill: {busy} ({drv.describe(q)}), "
            f"child reaped in {killed_after * 1e3:.0f} ms; "
            + "; ".join(f"{k}: {drv.describe(v)}" for k, v in codes.items())
            + f"; imported data still readable after the death: {readable}"
        )
        if sticky:
            verdict("exporter-death", f"context poisoned (sticky {', '.join(drv.describe(c) for c in sticky)})", d)
        elif errors:
            verdict("exporter-death", "errors, context still usable", d)
        else:
            verdict("exporter-death", "no error", d)
    finally:
        stand_in_cleanup(h)
        stand_in_cleanup(own_handle)


def probe_event_death(drv: cudrv.Driver, child: Child, args, _st: dict) -> None:
    """event-death, run in a process of its own (see event_death_isolated)."""
    for name in ("cuIpcOpenEventHandle", "cuStreamWaitEvent", "cuEventQuery", "cuStreamQuery"):
        if not drv.has(name):
            raise Unsupported("unsupported by this driver", f"{name} missing")
    n = args.event_bytes
    m = child.ask("event_prepare", bytes=n)
    mh = bytes.fromhex(m["mem"])
    try:
        mem = open_or_refuse(drv, mh)
        host = cudrv.PinnedBuffer(drv, MIB)
        eh = cudrv.IpcHandle()
        ctypes.memmove(ctypes.byref(eh), bytes.fromhex(m["event"]), 64)
        ev = ctypes.c_void_p()
        r = drv.try_call("cuIpcOpenEventHandle", ctypes.byref(ev), eh)
        if r != 0:
            raise Unsupported("refused", f"cuIpcOpenEventHandle: {drv.describe(r)}")
        s, other = drv.stream(), drv.stream()
        own = drv.alloc(MIB)
        if args.stand_in_hold:
            open(args.stand_in_hold, "w").close()
        t0 = time.monotonic()
        go = child.ask("event_go", reps=args.event_death_reps)
        queued = time.monotonic() - t0
        drv.call("cuStreamWaitEvent", s, ev, 0)
        drv.call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), mem, MIB, s)
        before = drv.mem_info()
        q0 = drv.try_call("cuStreamQuery", s)
        child.kill()
        killed = time.monotonic()
        if args.stand_in_hold:
            os.unlink(args.stand_in_hold)  # the child's copies would end now: its record never runs
        sq = eq = cudrv.CUDA_ERROR_NOT_READY
        ended = None
        while time.monotonic() - killed < args.event_death_poll:
            sq, eq = drv.try_call("cuStreamQuery", s), drv.try_call("cuEventQuery", ev)
            if sq != cudrv.CUDA_ERROR_NOT_READY:
                ended = time.monotonic() - killed
                break
            time.sleep(0.01)
        # Another stream, as another engine's copies: not behind the wait.
        r = drv.try_call("cuMemcpyDtoHAsync", ctypes.c_void_p(host.ptr), own, MIB, other)
        other_code = r or drv.try_call("cuStreamSynchronize", other)
        dead = drv.mem_info()  # the child's context is gone; its memory, maybe not
        codes = {"cuIpcCloseMemHandle": drv.try_call("cuIpcCloseMemHandle", mem)}
        after = drv.mem_info()
        codes["cuStreamDestroy of the waiting stream"] = drv.try_call("cuStreamDestroy", s)
        codes["cuEventDestroy of the import"] = drv.try_call("cuEventDestroy", ev)
        drv.opt("cuStreamDestroy", other)
        drv.opt("cuMemFree", own)
        host.close()
        d = (
            f"the child queued {args.event_death_reps} H2D copies of {n} B in {queued:.2f} s, then recorded "
            f"(pending: {go['pending']}); stream before the kill: {drv.describe(q0)}; "
            f"stream {drv.describe(sq)} and event {drv.describe(eq)} "
            + (f"{ended:.2f} s after the kill" if ended is not None else f"after {args.event_death_poll:g} s")
            + f"; a copy on another stream meanwhile: {drv.describe(other_code)}; "
            + "; ".join(f"{k}: {drv.describe(v)}" for k, v in codes.items())
        )
        if before is None or dead is None or after is None:
            mem_v = "memory unknown"
            d += "; cuMemGetInfo unavailable"
        else:
            d += (
                f"; free memory before the kill {before[0]} B, after the polling {dead[0]} B, "
                f"after the close {after[0]} B (the child's allocation {n} B)"
            )
            if after[0] - dead[0] >= n:
                mem_v = "memory freed at the close"
            elif after[0] - before[0] >= n:
                mem_v = "memory freed at the death"
            else:
                mem_v = "memory not freed"
        sticky = sorted({v for v in (sq, eq, other_code, *codes.values()) if v in cudrv.STICKY})
        if sticky:
            wait_v = f"context poisoned (sticky {', '.join(drv.describe(c) for c in sticky)})"
        elif ended is None:
            wait_v = "the wait never ends"
        else:
            wait_v = f"the wait ends with {drv.describe(sq)}"
        verdict("event-death", f"{wait_v}; {mem_v}", d)
    finally:
        stand_in_cleanup(mh)


def event_death_isolated(_drv: cudrv.Driver, _child: Child, args, _st: dict) -> None:
    """event-death in a process of its own: a wait that never ends, or a
    call that hangs, must not keep the other probes from running, and this
    process's context stays out of it."""
    cmd = [sys.executable, os.path.abspath(__file__), "--only", "event-death"]
    cmd += ["--event-bytes", str(args.event_bytes), "--event-death-reps", str(args.event_death_reps)]
    cmd += ["--event-death-poll", str(args.event_death_poll), "--timeout", str(args.timeout)]
    if args.stand_in_hold:
        cmd += ["--stand-in-hold", args.stand_in_hold]
    limit = args.event_death_poll + args.timeout
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        raise Unsupported("hangs", f"no verdict within {limit:g} s; its output: {out.strip()[-300:]!r}") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE event-death: ")]
    if not lines:
        raise Unsupported("failed", f"exit {p.returncode}, no verdict; stderr: {p.stderr.strip()[-300:]!r}")
    print(lines[-1], flush=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)


def vmm_needed(drv: cudrv.Driver) -> None:
    for name in (
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemRetainAllocationHandle",
        "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle",
        "cuPointerGetAttribute",
    ):
        if not drv.has(name):
            raise Unsupported("unsupported by this driver", f"{name} missing")


def probe_vmm_fd_export(drv: cudrv.Driver, child: Child, _args, st: dict) -> None:
    vmm_needed(drv)
    m = child.ask("vmm_fd", types=cudrv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, fill=0x3C, granules=2, send=True)
    if m["create"] != 0:
        raise Unsupported("refused", f"cuMemCreate with POSIX_FILE_DESCRIPTOR requested: {m['create_name']}")
    d = (
        f"{m['bytes']} B (granularity {m['granularity']}); cuMemRetainAllocationHandle at an address inside the "
        f"mapping: {m['retain_name']}, the mapped handle: {m['same_handle']}; "
        f"cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR): {m['export_name']}"
    )
    if m["export"] != 0:
        verdict("vmm-fd-export", f"export fails with {m['export_name']}", d)
        return
    st["vmm_child"] = m
    st["vmm_fd"] = child.recv_fd()
    d += f"; the descriptor refers to {m['fd_target']!r}, close-on-exec: {m['cloexec']}; sent with SCM_RIGHTS"
    verdict("vmm-fd-export", "exports a file descriptor", d)


def probe_vmm_fd_import(drv: cudrv.Driver, child: Child, _args, st: dict) -> None:
    vmm_needed(drv)
    fd, m = st.pop("vmm_fd", None), st.get("vmm_child")
    if fd is None or m is None:
        raise Unsupported("skipped", "no descriptor: vmm-fd-export did not export one")
    r, h = drv.vmm_import_fd(fd)
    os.close(fd)  # the import holds the memory
    if r != 0:
        verdict(
            "vmm-fd-import",
            f"import fails with {drv.describe(r)}",
            "cuMemImportFromShareableHandle of the child's descriptor",
        )
        return
    n = m["bytes"]
    try:
        vm = cudrv.VmmMapping(drv, h, n)
    except CudaError as e:
        drv.opt("cuMemRelease", h)
        verdict("vmm-fd-import", f"mapping the import fails ({e})", "cuMemImportFromShareableHandle succeeded")
        return
    st["vmm_import"] = vm
    r1, seen = drv.read(vm.ptr, n // 2)
    r2 = drv.fill(vm.ptr + n // 2, 0xD2, n // 2)
    back = child.ask("vmm_read", id=m["id"], at=n // 2, n=n // 2)
    r3 = drv.fill(vm.ptr, 0x77, 4096)
    again = child.ask("vmm_read", id=m["id"], at=0, n=4096)
    d = (
        f"imported and mapped {n} B; this process reads the child's first half: {drv.describe(r1)}, "
        f"byte values {[hex(b) for b in seen]} (want ['0x3c']); writes the second half: {drv.describe(r2)}, "
        f"the child reads {[hex(b) for b in back['distinct']]} (want ['0xd2']); a later write here "
        f"({drv.describe(r3)}) the child reads as {[hex(b) for b in again['distinct']]} (want ['0x77'])"
    )
    if seen == [0x3C] and back["distinct"] == [0xD2] and again["distinct"] == [0x77]:
        verdict("vmm-fd-import", "bytes move both ways", d)
    else:
        verdict("vmm-fd-import", "bytes differ", d)


def probe_vmm_release_mapped(drv: cudrv.Driver, child: Child, _args, st: dict) -> None:
    vm, m = st.pop("vmm_import", None), st.get("vmm_child")
    if vm is None or m is None:
        raise Unsupported("skipped", "no imported mapping: vmm-fd-import did not map one")
    n = m["bytes"]
    codes = {"cuMemRelease of the import, mapped": vm.release()}
    codes["cuMemRelease in the child, mapped"] = child.ask("vmm_release", id=m["id"])["release"]
    child.ask("vmm_fill", id=m["id"], at=0, byte=0x6B, n=n)
    r1, seen = drv.read(vm.ptr, n)
    codes["cuMemcpyDtoH after both releases"] = r1
    freed = child.ask("vmm_free", id=m["id"])["codes"]
    child.close()  # the exporter exits: its context and mappings go
    r2, after = drv.read(vm.ptr, n)
    codes["cuMemcpyDtoH after the child exited"] = r2
    codes.update(vm.close())
    d = (
        "; ".join(f"{k}: {drv.describe(v)}" for k, v in codes.items())
        + f"; the child unmapped and freed ({', '.join(f'{k} {v}' for k, v in freed.items())}) and exited; "
        f"bytes read here after the releases {[hex(b) for b in seen]}, "
        f"after the exit {[hex(b) for b in after]} (want ['0x6b'])"
    )
    if seen == [0x6B] and after == [0x6B] and not any(codes.values()):
        verdict("vmm-release-mapped", "the memory lives until the last mapping goes", d)
    elif seen == [0x6B]:
        verdict("vmm-release-mapped", "released while mapped works; lost when the exporter exited", d)
    else:
        verdict("vmm-release-mapped", "the memory did not outlive its handles", d)


def probe_vmm_export_unrequested(drv: cudrv.Driver, child: Child, _args, _st: dict) -> None:
    vmm_needed(drv)
    m = child.ask("vmm_fd", types=cudrv.CU_MEM_HANDLE_TYPE_NONE, granules=1)
    if m["create"] != 0:
        raise Unsupported("refused", f"cuMemCreate with no handle type requested: {m['create_name']}")
    f = child.ask("vmm_fd", types=cudrv.CU_MEM_HANDLE_TYPE_FABRIC, granules=1)
    fabric = f"cuMemCreate requesting FABRIC alone: {f['create_name']}"
    if f["create"] == 0:
        fabric += f", its POSIX_FILE_DESCRIPTOR export: {f['export_name']}"
    d = f"requestedHandleTypes 0, cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR): {m['export_name']}; {fabric}"
    if m["export"] != 0:
        verdict("vmm-export-unrequested", f"export fails with {m['export_name']}", d)
    else:
        verdict("vmm-export-unrequested", "export succeeds", d)


def probe_vmm_pointer_attrs(drv: cudrv.Driver, _child: Child, _args, _st: dict) -> None:
    vmm_needed(drv)
    g = drv.granularity()
    n = 2 * g
    r, h = drv.vmm_create(n, cudrv.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    if r != 0:
        raise Unsupported("refused", f"cuMemCreate: {drv.describe(r)}")
    vm = cudrv.VmmMapping(drv, h, n, spare=g)
    own = drv.alloc(g)
    try:
        p, q = vm.ptr, vm.ptr + 12345
        got: dict[str, tuple] = {}
        want: dict[str, tuple] = {}

        def check(name: str, value: tuple, expect: tuple) -> None:
            got[name], want[name] = value, expect

        check("VMM IS_LEGACY_CUDA_IPC_CAPABLE", drv.pointer_attr(cudrv.ATTR_LEGACY_IPC, q), (0, 0))
        check("VMM ALLOWED_HANDLE_TYPES", drv.pointer_attr(cudrv.ATTR_HANDLE_TYPES, q), (0, 1))
        check("VMM MAPPED", drv.pointer_attr(cudrv.ATTR_MAPPED, q), (0, 1))
        check("MAPPED of a reserved address not mapped", drv.pointer_attr(cudrv.ATTR_MAPPED, p + n), (0, 0))
        check("VMM RANGE_START_ADDR", drv.pointer_attr(cudrv.ATTR_RANGE_START, q), (0, p))
        check("VMM RANGE_SIZE", drv.pointer_attr(cudrv.ATTR_RANGE_SIZE, q), (0, n + g))
        check("VMM MAPPING_BASE_ADDR", drv.pointer_attr(cudrv.ATTR_MAPPING_BASE, q), (0, p))
        check("VMM MAPPING_SIZE", drv.pointer_attr(cudrv.ATTR_MAPPING_SIZE, q), (0, n))
        base, size = cudrv.CUdeviceptr(), ctypes.c_size_t()
        r = drv.try_call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), q)
        check("VMM cuMemGetAddressRange", (r, base.value, size.value), (0, p, n))
        ih = cudrv.IpcHandle()
        check("VMM cuIpcGetMemHandle", (drv.try_call("cuIpcGetMemHandle", ctypes.byref(ih), p),), (1,))
        check("cuMemAlloc IS_LEGACY_CUDA_IPC_CAPABLE", drv.pointer_attr(cudrv.ATTR_LEGACY_IPC, own), (0, 1))
        check("cuMemAlloc ALLOWED_HANDLE_TYPES", drv.pointer_attr(cudrv.ATTR_HANDLE_TYPES, own), (0, 0))
    finally:
        drv.opt("cuMemFree", own)
        vm.close()
    differ = [f"{k}: {got[k]} (stand-in {want[k]})" for k in got if got[k] != want[k]]
    d = f"granularity {g}; a {n} B mapping in a {n + g} B reservation; " + "; ".join(f"{k} {v}" for k, v in got.items())
    if differ:
        verdict("vmm-pointer-attrs", "differs from the stand-in: " + "; ".join(differ), d)
    else:
        verdict("vmm-pointer-attrs", "as the stand-in models", d)


# What the stand-in driver answers to each of op_vmm_rules' calls.
STAND_IN_RULES = {
    "cuMemCreate of a size off the granularity": 1,
    "cuMemMap of a size off the granularity": 1,
    "cuMemMap at an address off the granularity": 1,
    "cuMemMap at a nonzero offset": 1,
    "cuMemMap of more than the allocation": 1,
    "cuMemMap past the reservation": 1,
    "cuMemMap over a mapped range": 1,
    "cuMemSetAccess of part of a mapping": 1,
    "cuMemSetAccess past the mapping": 1,
    "cuMemUnmap of part of a mapping": 1,
    "cuMemAddressFree of a mapped reservation": 1,
    "cuMemAddressFree of another size": 1,
    "cuMemRetainAllocationHandle of a reserved address not mapped": 1,
    "cuMemRetainAllocationHandle of cuMemAlloc memory": 1,
    "cuMemSetAccess read-only": 0,
    "cuMemcpyHtoD into read-only memory": 1,
    "cuMemcpyDtoH from read-only memory": 0,
    "cuMemUnmap": 0,
    "cuMemcpyDtoH from memory mapped without access": 1,
    "cuMemUnmap (again)": 0,
    "cuMemAddressFree": 0,
    "cuMemRelease": 0,
}


def probe_vmm_map_rules(_drv: cudrv.Driver, child: Child, _args, st: dict) -> None:
    m = child.ask("vmm_rules")
    codes, names = m["codes"], m["names"]
    differ = [
        f"{k}: {names[k]} (stand-in {STAND_IN_RULES.get(k)})" for k, v in codes.items() if v != STAND_IN_RULES.get(k)
    ]
    d = "; ".join(f"{k}: {names[k]}" for k in codes)
    child.close()  # a refused copy may have poisoned its context
    if differ:
        verdict("vmm-map-rules", "differs from the stand-in: " + "; ".join(differ), d)
    else:
        verdict("vmm-map-rules", "as the stand-in models", d)


def parent_main(args) -> int:
    try:
        drv = cudrv.Driver()
    except OSError as e:
        for p in PROBES:
            verdict(p, "skipped", f"no driver: {e}")
        return 0
    except Missing as e:
        for p in PROBES:
            verdict(p, "unsupported by this driver", f"{e.name} missing")
        return 0
    except CudaError as e:
        for p in PROBES:
            verdict(p, "skipped", f"no usable GPU: {e}")
        return 0
    if args.only is None:
        print(f"driver {drv.version}, device 0: {drv.name()} (uuid {drv.uuid().hex()}), pid {os.getpid()}", flush=True)
    broke = False
    state: dict = {}
    child = None
    probes = [
        ("ipc-range", probe_range),
        ("ipc-corrupt-handle", probe_bad_handle),
        ("vmm-export", probe_vmm),
        ("ipc-event", probe_event),
        ("vmm-fd-export", probe_vmm_fd_export),
        ("vmm-fd-import", probe_vmm_fd_import),
        ("vmm-release-mapped", probe_vmm_release_mapped),
        ("vmm-export-unrequested", probe_vmm_export_unrequested),
        ("vmm-pointer-attrs", probe_vmm_pointer_attrs),
        ("exporter-death", probe_death),
        # Its child's refused copies may fault on a GPU; it uses no
        # context of this process, which exporter-death may poison.
        ("vmm-map-rules", probe_vmm_map_rules),
        # Last, in a process of its own: it may leave a wait, or a
        # call, hanging.
        ("event-death", event_death_isolated),
    ]
    if args.only is not None:
        probes = [(args.only, {"event-death": probe_event_death}[args.only])]
    try:
        for name, fn in probes:
            try:
                if name in ("vmm-map-rules", "exporter-death", "event-death") and child is not None:
                    child.close()  # a fresh child: either may leave its context poisoned
                    child = None
                if fn is not event_death_isolated and (child is None or child.p.poll() is not None):
                    hold = {"FAKECUDA_EVENT_HOLD": args.stand_in_hold} if args.stand_in_hold else {}
                    child = Child(args.timeout, hold)
                fn(drv, child, args, state)
            except Unsupported as e:
                verdict(name, e.verdict, e.details)
            except Missing as e:
                verdict(name, "unsupported by this driver", f"{e.name} missing")
            except CudaError as e:
                verdict(name, "refused", str(e))
            except Exception as e:  # noqa: BLE001 (a bug in the probe, not a driver answer: reported, the rest run)
                broke = True
                verdict(name, "error", f"{type(e).__name__}: {e}")
                traceback.print_exc()
    finally:
        if child is not None and child.p.poll() is None:
            child.close()
        for k in ("vmm_fd",):
            if k in state:
                os.close(state.pop(k))
        if "vmm_import" in state:
            state.pop("vmm_import").close()
    return 1 if broke else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fd-sock", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--range-bytes", type=int, default=MIB + 4096)
    ap.add_argument("--event-bytes", type=int, default=256 * MIB)
    ap.add_argument("--event-reps", type=int, default=40, help="H2D copies of --event-bytes before the marker")
    ap.add_argument("--death-bytes", type=int, default=1 << 30)
    ap.add_argument("--death-copies", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=30, help="seconds to wait for each answer of the child")
    ap.add_argument(
        "--event-death-reps",
        type=int,
        default=400,
        help="event-death: H2D copies of --event-bytes the child queues before its record (about 2 s at PCIe 5 speed)",
    )
    ap.add_argument("--event-death-poll", type=float, default=10, help="event-death: seconds to poll after the kill")
    ap.add_argument("--only", choices=["event-death"], help=argparse.SUPPRESS)
    ap.add_argument(
        "--stand-in-hold",
        metavar="FILE",
        help="for the stand-in driver (gpu/gputest/testdata/fakecuda.c), whose copies finish at once: the "
        "child's interprocess event stays incomplete while FILE exists (FAKECUDA_EVENT_HOLD); this "
        "process removes FILE after queueing its wait and copy",
    )
    args = ap.parse_args()
    if args.child:
        return child_main(args.fd_sock)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
