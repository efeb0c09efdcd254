"""The CUDA driver API through ctypes, for the probes in this directory.

Entry points are resolved the way ringside's cgo shim resolves them
(gpu/internal/cuda): cuInit and cuGetProcAddress with dlsym, everything
else through cuGetProcAddress(name, 12000) so that the driver hands out the
ABI these declarations were written for (the _v2 variants of cuMemAlloc,
cuMemGetAddressRange, cuIpcOpenMemHandle, ... under their plain names). A
driver without an entry point makes `Driver.fn` raise `Missing`, which a
probe reports as "unsupported by this driver (<name> missing)".
"""

from __future__ import annotations

import ctypes
import mmap

ABI_VERSION = 12000

CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4
CU_STREAM_NON_BLOCKING = 0x1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_READY = 600

# CUpointer_attribute values the VMM probes read.
ATTR_LEGACY_IPC = 10  # IS_LEGACY_CUDA_IPC_CAPABLE
ATTR_RANGE_START = 11  # RANGE_START_ADDR: the reservation
ATTR_RANGE_SIZE = 12  # RANGE_SIZE
ATTR_MAPPED = 13  # MAPPED
ATTR_HANDLE_TYPES = 14  # ALLOWED_HANDLE_TYPES
ATTR_MAPPING_SIZE = 18  # MAPPING_SIZE: the mapping
ATTR_MAPPING_BASE = 19  # MAPPING_BASE_ADDR

# Errors after which a context is unusable (every later call fails the
# same way until the process exits): illegal address, launch failures,
# hardware, uncorrectable ECC (214) and NVLink (220) errors, unknown: the
# sidecar's classification (gpu/internal/cuda Sticky).
STICKY = {214, 220, 700, 714, 715, 716, 717, 718, 719, 999}

CUdeviceptr = ctypes.c_ulonglong


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle / CUipcEventHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class Missing(Exception):
    """The driver lacks an entry point."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class CudaError(Exception):
    """A driver call returned an error; code and name say which."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call}: {name} ({code})")
        self.call, self.code, self.name = call, code, name


P = ctypes.POINTER
_vp = ctypes.c_void_p
_sz = ctypes.c_size_t
_ui = ctypes.c_uint
_i = ctypes.c_int

# name: argument types (every entry point returns CUresult, an int).
SIGNATURES = {
    "cuDriverGetVersion": [P(_i)],
    "cuDeviceGet": [P(_i), _i],
    "cuDeviceGetCount": [P(_i)],
    "cuDeviceGetName": [ctypes.c_char_p, _i, _i],
    "cuDeviceGetUuid": [ctypes.c_char_p, _i],
    "cuDevicePrimaryCtxRetain": [P(_vp), _i],
    "cuDevicePrimaryCtxRelease": [_i],
    "cuCtxSetCurrent": [_vp],
    "cuCtxSynchronize": [],
    "cuMemAlloc": [P(CUdeviceptr), _sz],
    "cuMemFree": [CUdeviceptr],
    "cuMemGetAddressRange": [P(CUdeviceptr), P(_sz), CUdeviceptr],
    "cuMemGetInfo": [P(_sz), P(_sz)],
    "cuMemHostRegister": [_vp, _sz, _ui],
    "cuMemHostUnregister": [_vp],
    "cuMemcpyHtoD": [CUdeviceptr, _vp, _sz],
    "cuMemcpyDtoH": [_vp, CUdeviceptr, _sz],
    "cuMemcpyHtoDAsync": [CUdeviceptr, _vp, _sz, _vp],
    "cuMemcpyDtoHAsync": [_vp, CUdeviceptr, _sz, _vp],
    "cuIpcGetMemHandle": [P(IpcHandle), CUdeviceptr],
    "cuIpcOpenMemHandle": [P(CUdeviceptr), IpcHandle, _ui],
    "cuIpcCloseMemHandle": [CUdeviceptr],
    "cuIpcGetEventHandle": [P(IpcHandle), _vp],
    "cuIpcOpenEventHandle": [P(_vp), IpcHandle],
    "cuMemGetAllocationGranularity": [P(_sz), P(MemAllocationProp), _i],
    "cuMemCreate": [P(ctypes.c_ulonglong), _sz, P(MemAllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [ctypes.c_ulonglong],
    "cuMemAddressReserve": [P(CUdeviceptr), _sz, _sz, CUdeviceptr, ctypes.c_ulonglong],
    "cuMemAddressFree": [CUdeviceptr, _sz],
    "cuMemMap": [CUdeviceptr, _sz, _sz, ctypes.c_ulonglong, ctypes.c_ulonglong],
    "cuMemUnmap": [CUdeviceptr, _sz],
    "cuMemSetAccess": [CUdeviceptr, _sz, P(MemAccessDesc), _sz],
    "cuMemRetainAllocationHandle": [P(ctypes.c_ulonglong), _vp],
    "cuMemExportToShareableHandle": [_vp, ctypes.c_ulonglong, _i, ctypes.c_ulonglong],
    "cuMemImportFromShareableHandle": [P(ctypes.c_ulonglong), _vp, _i],
    "cuPointerGetAttribute": [_vp, _i, CUdeviceptr],
    "cuStreamCreateWithPriority": [P(_vp), _ui, _i],
    "cuStreamDestroy": [_vp],
    "cuStreamSynchronize": [_vp],
    "cuStreamQuery": [_vp],
    "cuStreamWaitEvent": [_vp, _vp, _ui],
    "cuEventCreate": [P(_vp), _ui],
    "cuEventRecord": [_vp, _vp],
    "cuEventQuery": [_vp],
    "cuEventSynchronize": [_vp],
    "cuEventDestroy": [_vp],
}


class Driver:
    """libcuda.so.1, initialised, with device 0's primary context current."""

    def __init__(self, device: int = 0):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._fns: dict[str, object] = {}
        self._gpa2 = self._sym("cuGetProcAddress_v2")
        self._gpa1 = None if self._gpa2 else self._sym("cuGetProcAddress")
        if self._gpa2:
            self._gpa2.restype = _i
            self._gpa2.argtypes = [ctypes.c_char_p, P(_vp), _i, ctypes.c_ulonglong, P(_i)]
        elif self._gpa1:
            self._gpa1.restype = _i
            self._gpa1.argtypes = [ctypes.c_char_p, P(_vp), _i, ctypes.c_ulonglong]
        init = self._sym("cuInit")
        if init is None:
            raise Missing("cuInit")
        init.restype, init.argtypes = _i, [_ui]
        self.check("cuInit", init(0))
        ver = _i()
        self.call("cuDriverGetVersion", ctypes.byref(ver))
        self.version = ver.value
        dev = _i()
        self.call("cuDeviceGet", ctypes.byref(dev), device)
        self.device = dev.value
        ctx = _vp()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.device)
        self.ctx = ctx
        self.call("cuCtxSetCurrent", ctx)

    def _sym(self, name: str):
        try:
            return getattr(self.lib, name)
        except AttributeError:
            return None

    def fn(self, name: str):
        """The entry point `name` at ABI_VERSION; raises Missing."""
        if name in self._fns:
            return self._fns[name]
        ptr = _vp()
        if self._gpa2:
            status = _i()
            r = self._gpa2(name.encode(), ctypes.byref(ptr), ABI_VERSION, 0, ctypes.byref(status))
        elif self._gpa1:
            r = self._gpa1(name.encode(), ctypes.byref(ptr), ABI_VERSION, 0)
        else:
            raise Missing("cuGetProcAddress")
        if r != 0 or not ptr.value:
            raise Missing(name)
        f = ctypes.CFUNCTYPE(_i, *SIGNATURES[name])(ptr.value)
        self._fns[name] = f
        return f

    def has(self, name: str) -> bool:
        try:
            self.fn(name)
            return True
        except Missing:
            return False

    def error_name(self, code: int) -> str:
        f = self._sym("cuGetErrorName")
        if f is not None:
            f.restype, f.argtypes = _i, [_i, P(ctypes.c_char_p)]
            s = ctypes.c_char_p()
            if f(code, ctypes.byref(s)) == 0 and s.value:
                return s.value.decode()
        return f"CUresult {code}"

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise CudaError(call, code, self.error_name(code))

    def call(self, name: str, *args) -> None:
        self.check(name, self.fn(name)(*args))

    def try_call(self, name: str, *args) -> int:
        """The call's result code (0: success); raises Missing only."""
        return int(self.fn(name)(*args))

    def opt(self, name: str, *args) -> int | None:
        """The call's result code, or None when the driver lacks it."""
        try:
            return self.try_call(name, *args)
        except Missing:
            return None

    def describe(self, code: int | None) -> str:
        if code is None:
            return "missing in this driver"
        return "CUDA_SUCCESS (0)" if code == 0 else f"{self.error_name(code)} ({code})"

    # Helpers.

    def uuid(self) -> bytes:
        buf = ctypes.create_string_buffer(16)
        self.call("cuDeviceGetUuid", buf, self.device)
        return buf.raw

    def name(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buf, 256, self.device)
        return buf.value.decode(errors="replace")

    def alloc(self, n: int) -> int:
        p = CUdeviceptr()
        self.call("cuMemAlloc", ctypes.byref(p), n)
        return p.value

    def mem_info(self) -> tuple[int, int] | None:
        """(free, total) device memory, or None when the driver lacks
        cuMemGetInfo or refuses it."""
        free, total = _sz(), _sz()
        if self.opt("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return free.value, total.value

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = CUdeviceptr(), _sz()
        self.call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ptr)
        return base.value, size.value

    def ipc_handle(self, ptr: int) -> bytes:
        h = IpcHandle()
        self.call("cuIpcGetMemHandle", ctypes.byref(h), ptr)
        return bytes(h.reserved)

    def ipc_open(self, handle: bytes) -> tuple[int, int]:
        """(code, pointer) of cuIpcOpenMemHandle."""
        h = IpcHandle()
        ctypes.memmove(ctypes.byref(h), handle, 64)
        p = CUdeviceptr()
        r = self.try_call("cuIpcOpenMemHandle", ctypes.byref(p), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return r, p.value

    def stream(self) -> int:
        s = _vp()
        self.call("cuStreamCreateWithPriority", ctypes.byref(s), CU_STREAM_NON_BLOCKING, 0)
        return s.value

    def granularity(self) -> int:
        prop = self.vmm_prop()
        g = _sz()
        minimum = CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), minimum)
        return g.value

    def vmm_prop(self, handle_types: int = CU_MEM_HANDLE_TYPE_NONE) -> MemAllocationProp:
        prop = MemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = handle_types
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        return prop

    # Virtual memory management: allocations shared by file descriptor.

    def vmm_create(self, n: int, handle_types: int) -> tuple[int, int]:
        """(code, handle) of cuMemCreate of n bytes requesting handle_types."""
        prop = self.vmm_prop(handle_types)
        h = ctypes.c_ulonglong()
        r = self.try_call("cuMemCreate", ctypes.byref(h), n, ctypes.byref(prop), 0)
        return r, h.value

    def access_desc(self, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> MemAccessDesc:
        acc = MemAccessDesc()
        acc.location.type, acc.location.id = CU_MEM_LOCATION_TYPE_DEVICE, self.device
        acc.flags = flags
        return acc

    def vmm_export_fd(self, handle: int) -> tuple[int, int]:
        """(code, fd) of cuMemExportToShareableHandle as a POSIX descriptor."""
        fd = ctypes.c_int(-1)
        r = self.try_call(
            "cuMemExportToShareableHandle", ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        )
        return r, fd.value

    def vmm_import_fd(self, fd: int) -> tuple[int, int]:
        """(code, handle) of cuMemImportFromShareableHandle of a descriptor."""
        h = ctypes.c_ulonglong()
        r = self.try_call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(h),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        return r, h.value

    def vmm_retain(self, ptr: int) -> tuple[int, int]:
        """(code, handle) of cuMemRetainAllocationHandle of an address."""
        h = ctypes.c_ulonglong()
        r = self.try_call("cuMemRetainAllocationHandle", ctypes.byref(h), ctypes.c_void_p(ptr))
        return r, h.value

    def pointer_attr(self, attr: int, ptr: int) -> tuple[int, int]:
        """(code, value) of cuPointerGetAttribute, read into a zeroed 8-byte value."""
        v = ctypes.c_uint64(0)
        r = self.try_call("cuPointerGetAttribute", ctypes.byref(v), attr, ptr)
        return r, v.value

    def fill(self, ptr: int, byte: int, n: int) -> int:
        """The code of a synchronous cuMemcpyHtoD of n bytes of byte to ptr."""
        src = (ctypes.c_ubyte * n)(*([byte] * n))
        return self.try_call("cuMemcpyHtoD", ptr, src, n)

    def read(self, ptr: int, n: int) -> tuple[int, list[int]]:
        """(code, the distinct byte values) of a synchronous cuMemcpyDtoH."""
        dst = (ctypes.c_ubyte * n)()
        r = self.try_call("cuMemcpyDtoH", dst, ptr, n)
        return r, sorted(set(bytes(dst))) if r == 0 else []


class VmmMapping:
    """A VMM allocation mapped read-write in a reservation of its size plus
    `spare` bytes left unmapped after it. Raises CudaError (undoing what it
    made) when a step fails; close() undoes all of it."""

    def __init__(self, drv: Driver, handle: int, n: int, spare: int = 0, owned: bool = True):
        self.drv, self.h, self.n, self.reserved = drv, handle, n, n + spare
        self.released = not owned  # nothing of ours to release
        p = CUdeviceptr()
        drv.call("cuMemAddressReserve", ctypes.byref(p), self.reserved, 0, 0, 0)
        self.ptr = p.value
        try:
            drv.call("cuMemMap", self.ptr, n, 0, handle, 0)
            try:
                acc = drv.access_desc()
                drv.call("cuMemSetAccess", self.ptr, n, ctypes.byref(acc), 1)
            except CudaError:
                drv.opt("cuMemUnmap", self.ptr, n)
                raise
        except CudaError:
            drv.opt("cuMemAddressFree", self.ptr, self.reserved)
            raise

    def release(self) -> int:
        """Release the handle, leaving the mapping; returns the code."""
        self.released = True
        return self.drv.try_call("cuMemRelease", self.h)

    def close(self) -> dict[str, int]:
        """Unmap, free the reservation, release the handle if still held;
        the codes of each call."""
        d = self.drv
        codes = {"cuMemUnmap": d.try_call("cuMemUnmap", self.ptr, self.n)}
        codes["cuMemAddressFree"] = d.try_call("cuMemAddressFree", self.ptr, self.reserved)
        if not self.released:
            codes["cuMemRelease"] = self.release()
        return codes


class PinnedBuffer:
    """Page-aligned host memory (anonymous mmap) registered with the driver."""

    def __init__(self, drv: Driver, n: int):
        self.drv, self.n = drv, n
        self.map = mmap.mmap(-1, n)
        self.buf = (ctypes.c_char * n).from_buffer(self.map)
        self.ptr = ctypes.addressof(self.buf)
        drv.call("cuMemHostRegister", ctypes.c_void_p(self.ptr), n, 0)

    def fill(self, byte: int, n: int | None = None) -> None:
        ctypes.memset(self.ptr, byte, self.n if n is None else n)

    def all_equal(self, byte: int, n: int) -> bool:
        return self.map[:n] == bytes([byte]) * n

    def close(self) -> None:
        self.drv.opt("cuMemHostUnregister", ctypes.c_void_p(self.ptr))
        del self.buf
        self.map.close()
