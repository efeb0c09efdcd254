"""The CUDA driver calls that share an engine's GPU memory with the sidecar.

The engine's KV cache is exported allocation by allocation with the CUDA
driver itself: a legacy IPC handle per ``cudaMalloc`` allocation, or, for
memory allocated with the virtual memory management API (vLLM 0.34's
extensible KV cache), a POSIX file descriptor per allocation
(:func:`export_fds`). Through ctypes on ``libcuda.so.1`` (or the library named by
``RINGSIDE_LIBCUDA``): never through torch's private ``_share_cuda_``, which
takes the runtime's handle of a different size and enters the memory into
torch's own IPC bookkeeping (a reference-counting file in /dev/shm, and a
freed cache kept alive for its importers).

Every entry point is resolved with ``cuGetProcAddress_v2`` at API version
12000, so each call gets the ABI of CUDA 12 whatever the library exports
under the plain name (it exports the legacy 32-bit ``cuMemGetAddressRange``
there; version 12000 hands out ``cuMemGetAddressRange_v2``, which takes a
64-bit pointer and a ``size_t`` size, and ``cuDeviceGetUuid_v2``).

The calls run in the context current on the calling thread: the engine's,
which torch made current (the caller selects the device with torch first).
Every failure raises :class:`CudaError`, naming the driver call and its
error (``cuGetErrorName``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Optional

LIB_ENV = "RINGSIDE_LIBCUDA"
LIB_DEFAULT = "libcuda.so.1"
API_VERSION = 12000  # the ABI every entry point is resolved at

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_FOUND = 500

CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4

CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20
CU_COMPUTEMODE_EXCLUSIVE_PROCESS = 3

CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14  # a uint64_t bitmask of CU_MEM_HANDLE_TYPE_*

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8

HANDLE_SIZE = 64  # CUipcMemHandle and CUipcEventHandle
UUID_SIZE = 16

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p
_int = ctypes.c_int

# Prototypes at API version 12000 (cuda.h): name -> argument types; every
# entry point returns a CUresult.
_PROTOS: dict[str, tuple] = {
    "cuGetErrorName": (_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuCtxGetDevice": (ctypes.POINTER(_int),),
    "cuDeviceGet": (ctypes.POINTER(_int), _int),
    "cuDeviceGetUuid": (ctypes.c_char_p, _int),  # CUuuid *, CUdevice (_v2 at this version)
    "cuDeviceGetAttribute": (ctypes.POINTER(_int), _int, _int),
    "cuMemGetAddressRange": (ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_size_t), _u64),  # _v2
    "cuPointerGetAttribute": (_vp, _int, _u64),
    "cuIpcGetMemHandle": (ctypes.c_char_p, _u64),  # CUipcMemHandle *, CUdeviceptr
    "cuEventCreate": (ctypes.POINTER(_vp), ctypes.c_uint),
    "cuEventRecord": (_vp, _vp),  # CUevent, CUstream
    "cuEventDestroy": (_vp,),  # _v2
    "cuIpcGetEventHandle": (ctypes.c_char_p, _vp),  # CUipcEventHandle *, CUevent
    # Virtual memory management (the file-descriptor path)
    "cuMemRetainAllocationHandle": (ctypes.POINTER(_u64), _vp),  # CUmemGenericAllocationHandle *, void *addr
    "cuMemExportToShareableHandle": (_vp, _u64, _int, ctypes.c_ulonglong),  # void *, handle, type, flags
    "cuMemRelease": (_u64,),
}


class CudaError(RuntimeError):
    """A driver call failed: ``call`` is its name, ``code`` the CUresult
    (None when the entry point itself could not be had)."""

    def __init__(self, call: str, code: Optional[int], name: str = "", detail: str = ""):
        self.call, self.code, self.name = call, code, name
        what = call
        if code is not None:
            what += ": %s (%d)" % (name, code) if name else ": error %d" % code
        super().__init__(what + (": " + detail if detail else ""))


class NotShareable(CudaError):
    """The memory cannot be exported with a CUDA IPC handle (virtual memory
    management allocations: PyTorch's expandable segments, vLLM's sleep-mode
    allocator; memory pools: cudaMallocAsync)."""


class Driver:
    """libcuda's entry points, resolved once (see the module doc)."""

    def __init__(self, path: Optional[str] = None):
        self.path = path or os.environ.get(LIB_ENV) or LIB_DEFAULT
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise CudaError("dlopen", None, detail="%s: %s" % (self.path, e))
        try:
            gpa = self.lib.cuGetProcAddress_v2
        except AttributeError:
            raise CudaError("cuGetProcAddress_v2", None, detail="not in %s (a CUDA 12 driver is needed)" % self.path)
        gpa.restype = _int
        gpa.argtypes = (ctypes.c_char_p, ctypes.POINTER(_vp), _int, _u64, ctypes.POINTER(_int))
        self._gpa = gpa
        self._fns: dict[str, Any] = {}
        self._mu = threading.Lock()

    def fn(self, name: str) -> Optional[Any]:
        """The entry point, or None when this driver has none of that name at
        API_VERSION."""
        with self._mu:
            if name in self._fns:
                return self._fns[name]
            p, status = _vp(), _int(-1)
            r = self._gpa(name.encode(), ctypes.byref(p), API_VERSION, 0, ctypes.byref(status))
            f = None
            if r == CUDA_SUCCESS and status.value == 0 and p.value:
                f = ctypes.CFUNCTYPE(_int, *_PROTOS[name])(p.value)
            self._fns[name] = f
            return f

    def error_name(self, code: int) -> str:
        f = self.fn("cuGetErrorName")
        if f is None:  # one version only: the plain export is the same call
            f = getattr(self.lib, "cuGetErrorName", None)
            if f is not None:
                f.restype, f.argtypes = _int, _PROTOS["cuGetErrorName"]
                self._fns["cuGetErrorName"] = f
        s = ctypes.c_char_p()
        if f is None or f(code, ctypes.byref(s)) != CUDA_SUCCESS or not s.value:
            return "CUDA error %d" % code
        return s.value.decode(errors="replace")

    def call(self, name: str, *args: Any) -> None:
        """Call an entry point; raises CudaError unless it succeeds."""
        f = self.fn(name)
        if f is None:
            raise CudaError(name, None, detail="not found in %s at API version %d" % (self.path, API_VERSION))
        r = f(*args)
        if r != CUDA_SUCCESS:
            raise CudaError(name, r, self.error_name(r))

    # -- the calls -----------------------------------------------------------------

    def device(self, ordinal: int) -> int:
        """The CUdevice of a device ordinal (torch's device index: both
        count the devices CUDA_VISIBLE_DEVICES shows)."""
        d = _int()
        self.call("cuDeviceGet", ctypes.byref(d), ordinal)
        return d.value

    def current_device(self) -> int:
        """The device of the calling thread's current context (the
        engine's); raises CudaError when the thread has none."""
        d = _int()
        try:
            self.call("cuCtxGetDevice", ctypes.byref(d))
        except CudaError as e:
            if e.code == CUDA_ERROR_INVALID_CONTEXT:
                e.args = (e.args[0] + ": no CUDA context is current on this thread",)
            raise
        return d.value

    def device_uuid(self, device: int) -> bytes:
        buf = ctypes.create_string_buffer(UUID_SIZE)
        self.call("cuDeviceGetUuid", buf, device)
        return buf.raw

    def compute_mode(self, device: int) -> Optional[int]:
        """The device's compute mode, or None when this driver cannot say."""
        if self.fn("cuDeviceGetAttribute") is None:
            return None
        v = _int()
        self.call("cuDeviceGetAttribute", ctypes.byref(v), CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, device)
        return v.value

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding the device address ptr."""
        base, size = _u64(), ctypes.c_size_t()
        self.call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ptr)
        return base.value, size.value

    def ipc_capable(self, ptr: int) -> Optional[bool]:
        """Whether the allocation holding ptr can be exported with a legacy
        CUDA IPC handle; None when the driver cannot say."""
        if self.fn("cuPointerGetAttribute") is None:
            return None
        v = _int()
        try:
            self.call("cuPointerGetAttribute", ctypes.byref(v), CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
        except CudaError:
            return None
        return bool(v.value)

    def ipc_mem_handle(self, base: int) -> bytes:
        """The 64-byte CUipcMemHandle of the allocation at base. Raises
        NotShareable for memory CUDA IPC cannot export."""
        if self.ipc_capable(base) is False:
            raise NotShareable(
                "cuPointerGetAttribute",
                None,
                detail="CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0 for the allocation at %#x: %s"
                % (base, NOT_SHAREABLE),
            )
        buf = ctypes.create_string_buffer(HANDLE_SIZE)
        try:
            self.call("cuIpcGetMemHandle", buf, base)
        except CudaError as e:
            if e.code == CUDA_ERROR_INVALID_VALUE:
                raise NotShareable(e.call, e.code, e.name, "the allocation at %#x: %s" % (base, NOT_SHAREABLE))
            raise
        return buf.raw

    def allowed_handle_types(self, ptr: int) -> Optional[int]:
        """CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES of the allocation holding
        ptr: the CU_MEM_HANDLE_TYPE_* bits it may be exported as (0 for
        cudaMalloc memory); None when the driver cannot say."""
        if self.fn("cuPointerGetAttribute") is None:
            return None
        v = _u64(0)  # the attribute is a uint64_t; a driver may write 4 bytes of it
        try:
            self.call("cuPointerGetAttribute", ctypes.byref(v), CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr)
        except CudaError:
            return None
        return v.value

    def retain_allocation(self, ptr: int) -> int:
        """The handle of the VMM allocation mapped at ptr
        (cuMemRetainAllocationHandle), with a reference to release_allocation."""
        h = _u64()
        self.call("cuMemRetainAllocationHandle", ctypes.byref(h), ptr)
        return h.value

    def release_allocation(self, handle: int) -> None:
        self.call("cuMemRelease", handle)

    def export_fd(self, handle: int) -> int:
        """A new POSIX file descriptor of a VMM allocation
        (cuMemExportToShareableHandle), the caller's to close."""
        fd = _int(-1)
        self.call("cuMemExportToShareableHandle", ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        return fd.value

    def ipc_event(self) -> "IpcEvent":
        """A new interprocess event (no timing) in the current context."""
        ev = _vp()
        self.call("cuEventCreate", ctypes.byref(ev), CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)
        buf = ctypes.create_string_buffer(HANDLE_SIZE)
        try:
            self.call("cuIpcGetEventHandle", buf, ev)
        except CudaError:
            self.call("cuEventDestroy", ev)
            raise
        return IpcEvent(self, ev.value, buf.raw)


NOT_SHAREABLE = (
    "it was allocated with the virtual memory management API (PyTorch's "
    "expandable_segments, vLLM's sleep mode) or from a memory pool (cudaMallocAsync), "
    "which CUDA IPC cannot export; run the engine with PyTorch's native allocator "
    "without expandable_segments"
)


def fd_refusal(base: int, types: Optional[int]) -> Optional[str]:
    """Why the VMM allocation at base, whose ALLOWED_HANDLE_TYPES are types,
    cannot be shared as a POSIX file descriptor; None if it can (or the
    driver cannot say)."""
    if types is None or types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
        return None
    if types & CU_MEM_HANDLE_TYPE_FABRIC:
        return (
            "the KV cache allocation at %#x can be exported as a FABRIC handle only, not as a POSIX file "
            "descriptor, which is what the sidecar imports: vLLM 0.34 asks the driver for FABRIC alone wherever "
            "an IMEX channel is available, even when POSIX file descriptors are requested "
            "(vllm/utils/vmm_driver.py), as beside NixlConnector. Set the plugin key kv_cache_access to "
            "legacy_ipc there (docs/vllm.md, GPU engines)" % base
        )
    return (
        "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0 for the KV cache allocation at %#x, and it was "
        "created without a shareable handle type (ALLOWED_HANDLE_TYPES %#x): neither CUDA IPC nor a POSIX file "
        "descriptor can export it (a descriptor needs CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR at cuMemCreate). %s"
        % (base, types, NOT_SHAREABLE[0].upper() + NOT_SHAREABLE[1:])
    )


class FdExport:
    """The descriptors of VMM allocations exported for one registration,
    and the allocation handles retained for them. ``close()`` closes each
    descriptor exactly once and releases each handle; it never raises."""

    def __init__(self, drv: Driver):
        self.drv = drv
        self.fds: list[int] = []
        self.handles: list[int] = []

    def close(self) -> None:
        fds, self.fds = self.fds, []
        handles, self.handles = self.handles, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for h in handles:
            try:
                self.drv.release_allocation(h)
            except CudaError:
                pass


def export_fds(drv: Driver, bases: "list[int] | tuple[int, ...]") -> FdExport:
    """Export the VMM allocations mapped at bases, in order, as POSIX file
    descriptors: for each, cuMemRetainAllocationHandle at its base, its
    ALLOWED_HANDLE_TYPES checked for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    (NotShareable otherwise: vLLM 0.34 asks for FABRIC alone where an IMEX
    channel exists), cuMemExportToShareableHandle. The caller sends the
    descriptors and then closes the export (FdExport.close: the descriptors
    closed, the handles released); on an error nothing is left open."""
    exp = FdExport(drv)
    try:
        for b in bases:
            exp.handles.append(drv.retain_allocation(b))
            why = fd_refusal(b, drv.allowed_handle_types(b))
            if why is not None:
                raise NotShareable("cuPointerGetAttribute", None, detail=why)
            exp.fds.append(drv.export_fd(exp.handles[-1]))
    except BaseException:
        exp.close()
        raise
    return exp


class IpcEvent:
    """An interprocess event whose handle the sidecar opens: ``record()``
    marks the point of the engine's stream that the sidecar's store copies
    wait for."""

    def __init__(self, drv: Driver, event: Optional[int], handle: bytes):
        self.drv, self.event, self.handle = drv, event, handle  # event: a CUevent, None once closed
        self.stream: Optional[int] = None  # the stream record() uses; None: torch's current one

    def record(self, stream: Optional[int] = None) -> None:
        """Record the event on stream (a raw CUstream), by default
        ``self.stream`` or else torch's current stream on this thread."""
        if stream is None:
            stream = self.stream if self.stream is not None else current_stream()
        self.drv.call("cuEventRecord", self.event, stream)

    def close(self) -> None:
        ev, self.event = self.event, None
        if ev:
            self.drv.call("cuEventDestroy", ev)

    def __repr__(self) -> str:
        return "<ringside IpcEvent %#x>" % (self.event or 0)


def current_stream() -> int:
    """torch's current stream on this thread as a raw CUstream (0, the
    legacy default stream, without torch)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.current_stream().cuda_stream)


_drivers: dict[str, Driver] = {}
_drivers_mu = threading.Lock()


def driver(path: Optional[str] = None) -> Driver:
    """The process's Driver for path (default: RINGSIDE_LIBCUDA, else
    libcuda.so.1), loaded once."""
    p = path or os.environ.get(LIB_ENV) or LIB_DEFAULT
    with _drivers_mu:
        d = _drivers.get(p)
        if d is None:
            d = _drivers[p] = Driver(p)
        return d
