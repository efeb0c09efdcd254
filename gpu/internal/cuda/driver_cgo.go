//go:build cgo && linux

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

// Only the driver types used here, laid out as in cuda.h (64-bit Linux).
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { unsigned int type; int id; } CUmemLocation;          // 8 bytes
typedef struct {                                                      // 24 bytes
	unsigned int srcAccessOrder; // CUmemcpySrcAccessOrder
	CUmemLocation srcLocHint;
	CUmemLocation dstLocHint;
	unsigned int flags;
} CUmemcpyAttributes;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {                                                      // 32 bytes
	int type;                 // CUmemAllocationType
	int requestedHandleTypes; // CUmemAllocationHandleType bits
	CUmemLocation location;
	void *win32HandleMetaData;
	struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc; // 12 bytes

enum {
	RS_NOT_LOADED = -1,
	RS_VER = 12000,        // ABI version asked of cuGetProcAddress
	RS_VER_BATCH = 12080,  // cuMemcpyBatchAsync with failIdx (CUDA 12.8)
	CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
	CU_STREAM_NON_BLOCKING = 1,
	CU_EVENT_DISABLE_TIMING = 2,
	CU_EVENT_INTERPROCESS = 4,
	CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
	CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
	CU_MEM_ALLOCATION_TYPE_PINNED = 1,
	CU_MEM_LOCATION_TYPE_DEVICE = 1,
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
	CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
};

static struct {
	void *lib;
	CUresult (*getProcAddress2)(const char *, void **, int, unsigned long long, int *);
	CUresult (*getProcAddress1)(const char *, void **, int, unsigned long long);
	CUresult (*init)(unsigned int);
	CUresult (*getErrorName)(CUresult, const char **);
	CUresult (*getErrorString)(CUresult, const char **);
	CUresult (*driverGetVersion)(int *);
	CUresult (*deviceGetCount)(int *);
	CUresult (*deviceGet)(CUdevice *, int);
	CUresult (*deviceGetName)(char *, int, CUdevice);
	CUresult (*deviceGetUuid)(CUuuid *, CUdevice);
	CUresult (*deviceGetAttribute)(int *, int, CUdevice);
	CUresult (*primaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*primaryCtxRelease)(CUdevice);
	CUresult (*ctxSetCurrent)(CUcontext);
	CUresult (*ctxGetStreamPriorityRange)(int *, int *);
	CUresult (*ipcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
	CUresult (*ipcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
	CUresult (*ipcCloseMemHandle)(CUdeviceptr);
	CUresult (*memGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
	CUresult (*pointerGetAttribute)(void *, int, CUdeviceptr);
	CUresult (*memAlloc)(CUdeviceptr *, size_t);
	CUresult (*memFree)(CUdeviceptr);
	CUresult (*memHostRegister)(void *, size_t, unsigned int);
	CUresult (*memHostUnregister)(void *);
	CUresult (*memcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*memcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*memcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*memcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*memcpyBatchAsync)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
		CUmemcpyAttributes *, size_t *, size_t, size_t *, CUstream);
	CUresult (*streamCreateWithPriority)(CUstream *, unsigned int, int);
	CUresult (*streamDestroy)(CUstream);
	CUresult (*streamSynchronize)(CUstream);
	CUresult (*eventCreate)(CUevent *, unsigned int);
	CUresult (*eventRecord)(CUevent, CUstream);
	CUresult (*eventQuery)(CUevent);
	CUresult (*eventDestroy)(CUevent);
	CUresult (*ipcGetEventHandle)(CUipcEventHandle *, CUevent);
	CUresult (*ipcOpenEventHandle)(CUevent *, CUipcEventHandle);
	CUresult (*streamWaitEvent)(CUstream, CUevent, unsigned int);
	// Virtual memory management (optional: rs_has_vmm).
	CUresult (*memGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
	CUresult (*memCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
	CUresult (*memRelease)(CUmemGenericAllocationHandle);
	CUresult (*memAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*memAddressFree)(CUdeviceptr, size_t);
	CUresult (*memMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*memUnmap)(CUdeviceptr, size_t);
	CUresult (*memSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*memRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
	CUresult (*memExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
	CUresult (*memImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
} rs;

static int rs_proc(const char *name, void **fn, int version) {
	*fn = NULL;
	if (rs.getProcAddress2) {
		int status = 0;
		CUresult r = rs.getProcAddress2(name, fn, version, 0, &status);
		if (r != 0 || status != 0) { *fn = NULL; }
	} else if (rs.getProcAddress1) {
		if (rs.getProcAddress1(name, fn, version, 0) != 0) { *fn = NULL; }
	}
	return *fn != NULL;
}

// rs_load opens the driver, calls cuInit(0) and resolves every entry point.
// It returns 0, or a CUresult from cuInit, or -1 with a message in err.
static int rs_load(char *err, size_t n) {
	if (rs.lib != NULL) return 0;
	dlerror();
	void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
	if (lib == NULL) {
		const char *e = dlerror();
		snprintf(err, n, "dlopen libcuda.so.1: %s", e ? e : "unknown error");
		return -1;
	}
	*(void **)&rs.init = dlsym(lib, "cuInit");
	*(void **)&rs.getErrorName = dlsym(lib, "cuGetErrorName");
	*(void **)&rs.getErrorString = dlsym(lib, "cuGetErrorString");
	*(void **)&rs.getProcAddress2 = dlsym(lib, "cuGetProcAddress_v2");
	if (rs.getProcAddress2 == NULL)
		*(void **)&rs.getProcAddress1 = dlsym(lib, "cuGetProcAddress");
	if (rs.init == NULL || (rs.getProcAddress2 == NULL && rs.getProcAddress1 == NULL)) {
		snprintf(err, n, "libcuda.so.1 lacks cuInit or cuGetProcAddress (driver older than CUDA 11.3)");
		memset(&rs, 0, sizeof rs);
		dlclose(lib);
		return -1;
	}
	CUresult r = rs.init(0);
	if (r != 0) {
		// Keep the error functions for describing r; the rest stays unset.
		rs.lib = NULL;
		return r;
	}
	struct { const char *name; void **fn; int ver; } t[] = {
		{"cuDriverGetVersion", (void **)&rs.driverGetVersion, RS_VER},
		{"cuDeviceGetCount", (void **)&rs.deviceGetCount, RS_VER},
		{"cuDeviceGet", (void **)&rs.deviceGet, RS_VER},
		{"cuDeviceGetName", (void **)&rs.deviceGetName, RS_VER},
		{"cuDeviceGetUuid", (void **)&rs.deviceGetUuid, RS_VER},
		{"cuDeviceGetAttribute", (void **)&rs.deviceGetAttribute, RS_VER},
		{"cuDevicePrimaryCtxRetain", (void **)&rs.primaryCtxRetain, RS_VER},
		{"cuDevicePrimaryCtxRelease", (void **)&rs.primaryCtxRelease, RS_VER},
		{"cuCtxSetCurrent", (void **)&rs.ctxSetCurrent, RS_VER},
		{"cuCtxGetStreamPriorityRange", (void **)&rs.ctxGetStreamPriorityRange, RS_VER},
		{"cuIpcGetMemHandle", (void **)&rs.ipcGetMemHandle, RS_VER},
		{"cuIpcOpenMemHandle", (void **)&rs.ipcOpenMemHandle, RS_VER},
		{"cuIpcCloseMemHandle", (void **)&rs.ipcCloseMemHandle, RS_VER},
		{"cuMemGetAddressRange", (void **)&rs.memGetAddressRange, RS_VER},
		{"cuPointerGetAttribute", (void **)&rs.pointerGetAttribute, RS_VER},
		{"cuMemAlloc", (void **)&rs.memAlloc, RS_VER},
		{"cuMemFree", (void **)&rs.memFree, RS_VER},
		{"cuMemHostRegister", (void **)&rs.memHostRegister, RS_VER},
		{"cuMemHostUnregister", (void **)&rs.memHostUnregister, RS_VER},
		{"cuMemcpyHtoD", (void **)&rs.memcpyHtoD, RS_VER},
		{"cuMemcpyDtoH", (void **)&rs.memcpyDtoH, RS_VER},
		{"cuMemcpyHtoDAsync", (void **)&rs.memcpyHtoDAsync, RS_VER},
		{"cuMemcpyDtoHAsync", (void **)&rs.memcpyDtoHAsync, RS_VER},
		{"cuStreamCreateWithPriority", (void **)&rs.streamCreateWithPriority, RS_VER},
		{"cuStreamDestroy", (void **)&rs.streamDestroy, RS_VER},
		{"cuStreamSynchronize", (void **)&rs.streamSynchronize, RS_VER},
		{"cuEventCreate", (void **)&rs.eventCreate, RS_VER},
		{"cuEventRecord", (void **)&rs.eventRecord, RS_VER},
		{"cuEventQuery", (void **)&rs.eventQuery, RS_VER},
		{"cuEventDestroy", (void **)&rs.eventDestroy, RS_VER},
		{"cuIpcGetEventHandle", (void **)&rs.ipcGetEventHandle, RS_VER},
		{"cuIpcOpenEventHandle", (void **)&rs.ipcOpenEventHandle, RS_VER},
		{"cuStreamWaitEvent", (void **)&rs.streamWaitEvent, RS_VER},
	};
	for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
		if (!rs_proc(t[i].name, t[i].fn, t[i].ver)) {
			snprintf(err, n, "the driver does not provide %s (needs a CUDA 12 driver)", t[i].name);
			void *ge = (void *)rs.getErrorName, *gs = (void *)rs.getErrorString;
			memset(&rs, 0, sizeof rs);
			*(void **)&rs.getErrorName = ge;
			*(void **)&rs.getErrorString = gs;
			return -1;
		}
	}
	// Optional: absent before CUDA 12.8.
	rs_proc("cuMemcpyBatchAsync", (void **)&rs.memcpyBatchAsync, RS_VER_BATCH);
	// Optional: the virtual memory management entry points (CUDA 10.2+,
	// cuMemRetainAllocationHandle 11.0+), for memory shared through file
	// descriptors; a driver without them still serves legacy IPC.
	struct { const char *name; void **fn; } vmm[] = {
		{"cuMemGetAllocationGranularity", (void **)&rs.memGetAllocationGranularity},
		{"cuMemCreate", (void **)&rs.memCreate},
		{"cuMemRelease", (void **)&rs.memRelease},
		{"cuMemAddressReserve", (void **)&rs.memAddressReserve},
		{"cuMemAddressFree", (void **)&rs.memAddressFree},
		{"cuMemMap", (void **)&rs.memMap},
		{"cuMemUnmap", (void **)&rs.memUnmap},
		{"cuMemSetAccess", (void **)&rs.memSetAccess},
		{"cuMemRetainAllocationHandle", (void **)&rs.memRetainAllocationHandle},
		{"cuMemExportToShareableHandle", (void **)&rs.memExportToShareableHandle},
		{"cuMemImportFromShareableHandle", (void **)&rs.memImportFromShareableHandle},
	};
	for (size_t i = 0; i < sizeof vmm / sizeof vmm[0]; i++) rs_proc(vmm[i].name, vmm[i].fn, RS_VER);
	rs.lib = lib;
	return 0;
}

#define RS_CALL(fn, ...) (rs.fn ? rs.fn(__VA_ARGS__) : RS_NOT_LOADED)

static int rs_has_batch(void) { return rs.memcpyBatchAsync != NULL; }
static int rs_has_vmm(void) {
	return rs.memGetAllocationGranularity && rs.memCreate && rs.memRelease && rs.memAddressReserve &&
		rs.memAddressFree && rs.memMap && rs.memUnmap && rs.memSetAccess && rs.memRetainAllocationHandle &&
		rs.memExportToShareableHandle && rs.memImportFromShareableHandle;
}

static CUresult rs_error_name(CUresult r, const char **s) { *s = NULL; return RS_CALL(getErrorName, r, s); }
static CUresult rs_error_string(CUresult r, const char **s) { *s = NULL; return RS_CALL(getErrorString, r, s); }
static CUresult rs_driver_version(int *v) { return RS_CALL(driverGetVersion, v); }
static CUresult rs_device_count(int *n) { return RS_CALL(deviceGetCount, n); }
static CUresult rs_device_get(int *d, int ordinal) { return RS_CALL(deviceGet, d, ordinal); }
static CUresult rs_device_name(char *s, int n, int d) { return RS_CALL(deviceGetName, s, n, d); }
static CUresult rs_device_uuid(void *u, int d) { return RS_CALL(deviceGetUuid, (CUuuid *)u, d); }
static CUresult rs_device_attr(int *v, int attr, int d) { *v = 0; return RS_CALL(deviceGetAttribute, v, attr, d); }
static CUresult rs_ctx_retain(uintptr_t *c, int d) { return RS_CALL(primaryCtxRetain, (CUcontext *)c, d); }
static CUresult rs_ctx_release(int d) { return RS_CALL(primaryCtxRelease, d); }
static CUresult rs_ctx_set_current(uintptr_t c) { return RS_CALL(ctxSetCurrent, (CUcontext)c); }
static CUresult rs_priority_range(int *least, int *greatest) { return RS_CALL(ctxGetStreamPriorityRange, least, greatest); }

static CUresult rs_ipc_get(void *h, CUdeviceptr p) { return RS_CALL(ipcGetMemHandle, (CUipcMemHandle *)h, p); }
static CUresult rs_ipc_open(CUdeviceptr *p, const void *h) {
	CUipcMemHandle hv;
	memcpy(&hv, h, sizeof hv);
	return RS_CALL(ipcOpenMemHandle, p, hv, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}
static CUresult rs_ipc_close(CUdeviceptr p) { return RS_CALL(ipcCloseMemHandle, p); }
static CUresult rs_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr p) { return RS_CALL(memGetAddressRange, base, size, p); }
static CUresult rs_ipc_capable(int *v, CUdeviceptr p) {
	*v = 0;
	return RS_CALL(pointerGetAttribute, v, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p);
}
static CUresult rs_pointer_attr(uint64_t *v, int attr, CUdeviceptr p) {
	*v = 0; // attributes are 4 or 8 bytes wide: read into a zeroed 8-byte value
	return RS_CALL(pointerGetAttribute, v, attr, p);
}
static CUresult rs_mem_alloc(CUdeviceptr *p, size_t n) { return RS_CALL(memAlloc, p, n); }
static CUresult rs_mem_free(CUdeviceptr p) { return RS_CALL(memFree, p); }
static CUresult rs_host_register(uintptr_t p, size_t n, unsigned int flags) { return RS_CALL(memHostRegister, (void *)p, n, flags); }
static CUresult rs_host_unregister(uintptr_t p) { return RS_CALL(memHostUnregister, (void *)p); }
static CUresult rs_htod(CUdeviceptr d, const void *s, size_t n) { return RS_CALL(memcpyHtoD, d, s, n); }
static CUresult rs_dtoh(void *d, CUdeviceptr s, size_t n) { return RS_CALL(memcpyDtoH, d, s, n); }

static void rs_vmm_prop(CUmemAllocationProp *prop, int device, int types) {
	memset(prop, 0, sizeof *prop);
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = types;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = device;
}
static CUresult rs_vmm_granularity(size_t *g, int device) {
	CUmemAllocationProp prop;
	rs_vmm_prop(&prop, device, 0);
	return RS_CALL(memGetAllocationGranularity, g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}
static CUresult rs_vmm_create(uint64_t *h, size_t n, int device, int types) {
	CUmemAllocationProp prop;
	rs_vmm_prop(&prop, device, types);
	return RS_CALL(memCreate, (CUmemGenericAllocationHandle *)h, n, &prop, 0);
}
static CUresult rs_vmm_release(uint64_t h) { return RS_CALL(memRelease, h); }
static CUresult rs_vmm_reserve(CUdeviceptr *p, size_t n) { return RS_CALL(memAddressReserve, p, n, 0, 0, 0); }
static CUresult rs_vmm_address_free(CUdeviceptr p, size_t n) { return RS_CALL(memAddressFree, p, n); }
static CUresult rs_vmm_map(CUdeviceptr p, size_t n, uint64_t h) { return RS_CALL(memMap, p, n, 0, h, 0); }
static CUresult rs_vmm_unmap(CUdeviceptr p, size_t n) { return RS_CALL(memUnmap, p, n); }
static CUresult rs_vmm_set_access(CUdeviceptr p, size_t n, int device) {
	CUmemAccessDesc d;
	memset(&d, 0, sizeof d);
	d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	d.location.id = device;
	d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	return RS_CALL(memSetAccess, p, n, &d, 1);
}
static CUresult rs_vmm_retain(uint64_t *h, CUdeviceptr p) {
	return RS_CALL(memRetainAllocationHandle, (CUmemGenericAllocationHandle *)h, (void *)(uintptr_t)p);
}
static CUresult rs_vmm_export_fd(int *fd, uint64_t h) {
	*fd = -1;
	return RS_CALL(memExportToShareableHandle, fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}
static CUresult rs_vmm_import_fd(uint64_t *h, int fd) {
	return RS_CALL(memImportFromShareableHandle, (CUmemGenericAllocationHandle *)h, (void *)(uintptr_t)fd,
		CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

static CUresult rs_stream_create(uintptr_t *s, int priority) {
	return RS_CALL(streamCreateWithPriority, (CUstream *)s, CU_STREAM_NON_BLOCKING, priority);
}
static CUresult rs_stream_destroy(uintptr_t s) { return RS_CALL(streamDestroy, (CUstream)s); }
static CUresult rs_stream_sync(uintptr_t s) { return RS_CALL(streamSynchronize, (CUstream)s); }
static CUresult rs_event_create(uintptr_t *e) { return RS_CALL(eventCreate, (CUevent *)e, CU_EVENT_DISABLE_TIMING); }
static CUresult rs_event_record(uintptr_t e, uintptr_t s) { return RS_CALL(eventRecord, (CUevent)e, (CUstream)s); }
static CUresult rs_event_query(uintptr_t e) { return RS_CALL(eventQuery, (CUevent)e); }
static CUresult rs_event_destroy(uintptr_t e) { return RS_CALL(eventDestroy, (CUevent)e); }
static CUresult rs_ipc_event_create(uintptr_t *e) {
	return RS_CALL(eventCreate, (CUevent *)e, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
}
static CUresult rs_ipc_event_get(void *h, uintptr_t e) { return RS_CALL(ipcGetEventHandle, (CUipcEventHandle *)h, (CUevent)e); }
static CUresult rs_ipc_event_open(uintptr_t *e, const void *h) {
	CUipcEventHandle hv;
	memcpy(&hv, h, sizeof hv);
	return RS_CALL(ipcOpenEventHandle, (CUevent *)e, hv);
}
static CUresult rs_stream_wait_event(uintptr_t s, uintptr_t e) { return RS_CALL(streamWaitEvent, (CUstream)s, (CUevent)e, 0); }

// rs_copy_ranges enqueues one cuMemcpy{HtoD,DtoH}Async per range; on error
// *fail is the index of the failed range (earlier ones are enqueued).
static CUresult rs_copy_ranges(int dir, const uint64_t *dst, const uint64_t *src, const uint64_t *len,
		size_t n, uintptr_t stream, size_t *fail) {
	if (!rs.memcpyHtoDAsync || !rs.memcpyDtoHAsync) return RS_NOT_LOADED;
	for (size_t i = 0; i < n; i++) {
		CUresult r = dir == 0
			? rs.memcpyHtoDAsync((CUdeviceptr)dst[i], (const void *)(uintptr_t)src[i], len[i], (CUstream)stream)
			: rs.memcpyDtoHAsync((void *)(uintptr_t)dst[i], (CUdeviceptr)src[i], len[i], (CUstream)stream);
		if (r != 0) { *fail = i; return r; }
	}
	return 0;
}

// rs_copy_batch enqueues the ranges as one cuMemcpyBatchAsync with one
// attribute entry for all: source read in stream order (required for
// device-to-host, harmless for host-to-device), no location hints.
static CUresult rs_copy_batch(uint64_t *dst, uint64_t *src, uint64_t *len, size_t n, uintptr_t stream, size_t *fail) {
	if (!rs.memcpyBatchAsync) return RS_NOT_LOADED;
	CUmemcpyAttributes a;
	memset(&a, 0, sizeof a);
	a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
	size_t idx = 0;
	*fail = (size_t)-1;
	return rs.memcpyBatchAsync((CUdeviceptr *)dst, (CUdeviceptr *)src, (size_t *)len, n, &a, &idx, 1, fail, (CUstream)stream);
}

typedef char rs_check_attrs[sizeof(CUmemcpyAttributes) == 24 ? 1 : -1];
typedef char rs_check_prop[sizeof(CUmemAllocationProp) == 32 ? 1 : -1];
typedef char rs_check_access[sizeof(CUmemAccessDesc) == 12 ? 1 : -1];
typedef char rs_check_size[sizeof(size_t) == sizeof(uint64_t) ? 1 : -1];
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

var (
	loadOnce sync.Once
	loadErr  error
)

// Init loads libcuda.so.1, initializes the driver and checks that at least
// one device is visible. It is idempotent; its error wraps ErrUnavailable.
func Init() error {
	loadOnce.Do(func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var buf [512]C.char
		r := C.rs_load(&buf[0], C.size_t(len(buf)))
		switch {
		case r == -1:
			loadErr = fmt.Errorf("%w: %s", ErrUnavailable, C.GoString(&buf[0]))
			return
		case r != 0:
			loadErr = fmt.Errorf("%w: cuInit: %w", ErrUnavailable, Result(r))
			return
		}
		n, err := DeviceCount()
		if err == nil && n == 0 {
			err = ErrorNoDevice
		}
		if err != nil {
			loadErr = fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
	})
	return loadErr
}

func describe(r Result) (name, desc string) {
	var s *C.char
	if C.rs_error_name(C.CUresult(r), &s) == 0 && s != nil {
		name = C.GoString(s)
	}
	if C.rs_error_string(C.CUresult(r), &s) == 0 && s != nil {
		desc = C.GoString(s)
	}
	return name, desc
}

// HasBatch reports whether the driver has cuMemcpyBatchAsync (CUDA 12.8+).
func HasBatch() bool { return C.rs_has_batch() != 0 }

// DriverVersion returns the driver's CUDA version (e.g. 12080).
func DriverVersion() (int, error) {
	var v C.int
	return int(v), result(Result(C.rs_driver_version(&v)))
}

// DeviceCount returns the number of visible devices.
func DeviceCount() (int, error) {
	var n C.int
	return int(n), result(Result(C.rs_device_count(&n)))
}

// DeviceGet returns the device with the given ordinal.
func DeviceGet(ordinal int) (Device, error) {
	var d C.int
	return Device(d), result(Result(C.rs_device_get(&d, C.int(ordinal))))
}

// Name returns the device's marketing name.
func (d Device) Name() (string, error) {
	var buf [256]C.char
	if err := result(Result(C.rs_device_name(&buf[0], C.int(len(buf)), C.int(d)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// UUID returns the device's UUID (cuDeviceGetUuid, 12.0 ABI).
func (d Device) UUID() (UUID, error) {
	var u UUID
	err := result(Result(C.rs_device_uuid(unsafe.Pointer(&u[0]), C.int(d))))
	return u, err
}

// Attribute returns a device attribute (cuDeviceGetAttribute; it needs no
// context).
func (d Device) Attribute(attr int) (int, error) {
	var v C.int
	err := result(Result(C.rs_device_attr(&v, C.int(attr), C.int(d))))
	return int(v), err
}

// Retain retains the device's primary context.
func (d Device) Retain() (Context, error) {
	var c C.uintptr_t
	err := result(Result(C.rs_ctx_retain(&c, C.int(d))))
	return Context(c), err
}

// Release releases the device's primary context (once per Retain).
func (d Device) Release() error { return result(Result(C.rs_ctx_release(C.int(d)))) }

// SetCurrent binds c to the calling OS thread; the caller must be locked
// to its thread (runtime.LockOSThread) for as long as it relies on it.
func (c Context) SetCurrent() error { return result(Result(C.rs_ctx_set_current(C.uintptr_t(c)))) }

// StreamPriorityRange returns the current context's least and greatest
// stream priorities (greatest is the numerically lowest value).
func StreamPriorityRange() (least, greatest int, err error) {
	var l, g C.int
	err = result(Result(C.rs_priority_range(&l, &g)))
	return int(l), int(g), err
}

// IPCGetHandle exports the allocation containing p (current context).
func IPCGetHandle(p DevicePtr) (IPCHandle, error) {
	var h IPCHandle
	err := result(Result(C.rs_ipc_get(unsafe.Pointer(&h[0]), C.CUdeviceptr(p))))
	return h, err
}

// IPCOpen maps another process's allocation into the current context
// (with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) and returns its base address.
func IPCOpen(h IPCHandle) (DevicePtr, error) {
	var p C.CUdeviceptr
	err := result(Result(C.rs_ipc_open(&p, unsafe.Pointer(&h[0]))))
	return DevicePtr(p), err
}

// IPCClose unmaps an allocation opened with IPCOpen.
func IPCClose(p DevicePtr) error { return result(Result(C.rs_ipc_close(C.CUdeviceptr(p)))) }

// AddressRange returns the base and size of the allocation containing p.
func AddressRange(p DevicePtr) (DevicePtr, uint64, error) {
	var b C.CUdeviceptr
	var n C.size_t
	err := result(Result(C.rs_address_range(&b, &n, C.CUdeviceptr(p))))
	return DevicePtr(b), uint64(n), err
}

// IPCCapable reports CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE of p:
// false for virtual-memory-management allocations (cuMemCreate).
func IPCCapable(p DevicePtr) (bool, error) {
	var v C.int
	err := result(Result(C.rs_ipc_capable(&v, C.CUdeviceptr(p))))
	return v != 0, err
}

// PointerAttribute returns a CU_POINTER_ATTRIBUTE_* of p (the Attr*
// constants), read into a zeroed 64-bit value: the 4-byte attributes land
// in its low half.
func PointerAttribute(p DevicePtr, attr int) (uint64, error) {
	var v C.uint64_t
	err := result(Result(C.rs_pointer_attr(&v, C.int(attr), C.CUdeviceptr(p))))
	return uint64(v), err
}

// MemAlloc allocates device memory in the current context.
func MemAlloc(n uint64) (DevicePtr, error) {
	var p C.CUdeviceptr
	err := result(Result(C.rs_mem_alloc(&p, C.size_t(n))))
	return DevicePtr(p), err
}

// MemFree frees device memory.
func MemFree(p DevicePtr) error { return result(Result(C.rs_mem_free(C.CUdeviceptr(p)))) }

// Addr is the address of b[0] (0 when empty).
func Addr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

// HostRegister page-locks b for DMA. b must be memory outside the Go heap
// (an mmapped file or anonymous mapping) that stays mapped until
// HostUnregister.
func HostRegister(b []byte, flags uint) error {
	return result(Result(C.rs_host_register(C.uintptr_t(Addr(b)), C.size_t(len(b)), C.uint(flags))))
}

// HostUnregister undoes HostRegister of the region starting at b[0].
func HostUnregister(b []byte) error {
	return result(Result(C.rs_host_unregister(C.uintptr_t(Addr(b)))))
}

// MemcpyHtoD copies src to device memory synchronously.
func MemcpyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return result(Result(C.rs_htod(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)))))
}

// MemcpyDtoH copies device memory into dst synchronously.
func MemcpyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	return result(Result(C.rs_dtoh(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)))))
}

// NewStream creates a non-blocking stream with the given priority.
func NewStream(priority int) (Stream, error) {
	var s C.uintptr_t
	err := result(Result(C.rs_stream_create(&s, C.int(priority))))
	return Stream(s), err
}

// Destroy destroys the stream.
func (s Stream) Destroy() error { return result(Result(C.rs_stream_destroy(C.uintptr_t(s)))) }

// Synchronize blocks until the stream's work is done. Only for tests,
// benchmarks and teardown: it holds an OS thread.
func (s Stream) Synchronize() error { return result(Result(C.rs_stream_sync(C.uintptr_t(s)))) }

// NewEvent creates an event without timing.
func NewEvent() (Event, error) {
	var e C.uintptr_t
	err := result(Result(C.rs_event_create(&e)))
	return Event(e), err
}

// Record enqueues the event on s.
func (e Event) Record(s Stream) error {
	return result(Result(C.rs_event_record(C.uintptr_t(e), C.uintptr_t(s))))
}

// Query reports whether the work before the event's record has finished;
// an error means it failed (the context may be unusable).
func (e Event) Query() (bool, error) {
	switch r := Result(C.rs_event_query(C.uintptr_t(e))); r {
	case Success:
		return true, nil
	case ErrorNotReady:
		return false, nil
	default:
		return true, r
	}
}

// Destroy destroys the event.
func (e Event) Destroy() error { return result(Result(C.rs_event_destroy(C.uintptr_t(e)))) }

// NewIPCEvent creates an event that can be exported to another process
// (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, as cuIpcGetEventHandle
// requires).
func NewIPCEvent() (Event, error) {
	var e C.uintptr_t
	err := result(Result(C.rs_ipc_event_create(&e)))
	return Event(e), err
}

// IPCGetEventHandle exports an event made by NewIPCEvent.
func IPCGetEventHandle(e Event) (IPCEventHandle, error) {
	var h IPCEventHandle
	err := result(Result(C.rs_ipc_event_get(unsafe.Pointer(&h[0]), C.uintptr_t(e))))
	return h, err
}

// IPCOpenEvent opens another process's exported event in the current
// context; the event is released with Destroy.
func IPCOpenEvent(h IPCEventHandle) (Event, error) {
	var e C.uintptr_t
	err := result(Result(C.rs_ipc_event_open(&e, unsafe.Pointer(&h[0]))))
	return Event(e), err
}

// WaitEvent makes the work enqueued on s after this call wait until the
// work captured by e's latest record has completed (cuStreamWaitEvent; a
// never-recorded event is complete). It does not block the caller.
func (s Stream) WaitEvent(e Event) error {
	return result(Result(C.rs_stream_wait_event(C.uintptr_t(s), C.uintptr_t(e))))
}

// CopyAsync enqueues len(lens) copies on s: dst[i] <- src[i], lens[i]
// bytes. For HtoD dst are device and src host addresses, for DtoH the
// reverse; host addresses must lie in registered (pinned) memory. batch
// uses cuMemcpyBatchAsync (MaxBatch descriptors per call), otherwise one
// cuMemcpy{HtoD,DtoH}Async per range. It returns the driver calls made and,
// on error, the index of the first range that was not enqueued (ranges
// before it were).
func CopyAsync(dir Dir, batch bool, dst, src, lens []uint64, s Stream) (calls, failed int, err error) {
	n := len(lens)
	if len(dst) != n || len(src) != n {
		return 0, 0, fmt.Errorf("cuda: CopyAsync: %d dst, %d src, %d lengths", len(dst), len(src), n)
	}
	if n == 0 {
		return 0, 0, nil
	}
	var fail C.size_t
	if !batch {
		r := Result(C.rs_copy_ranges(C.int(dir), (*C.uint64_t)(unsafe.Pointer(&dst[0])), (*C.uint64_t)(unsafe.Pointer(&src[0])),
			(*C.uint64_t)(unsafe.Pointer(&lens[0])), C.size_t(n), C.uintptr_t(s), &fail))
		if r != Success {
			return int(fail) + 1, int(fail), r
		}
		return n, 0, nil
	}
	for off := 0; off < n; off += MaxBatch {
		k := min(MaxBatch, n-off)
		r := Result(C.rs_copy_batch((*C.uint64_t)(unsafe.Pointer(&dst[off])), (*C.uint64_t)(unsafe.Pointer(&src[off])),
			(*C.uint64_t)(unsafe.Pointer(&lens[off])), C.size_t(k), C.uintptr_t(s), &fail))
		calls++
		if r != Success {
			return calls, off, r
		}
	}
	return calls, 0, nil
}

// HasVMM reports whether the driver has every virtual memory management
// entry point the Mem* functions below call.
func HasVMM() bool { return C.rs_has_vmm() != 0 }

// MemGranularity returns the minimum allocation granularity of device d
// (cuMemGetAllocationGranularity): sizes, offsets and addresses of VMM
// mappings are multiples of it.
func MemGranularity(d Device) (uint64, error) {
	var g C.size_t
	err := result(Result(C.rs_vmm_granularity(&g, C.int(d))))
	return uint64(g), err
}

// MemCreate allocates n bytes on device d (cuMemCreate, pinned, a multiple
// of MemGranularity) that can be exported as the handle types requested
// (HandleType* bits); it has no mapping until MemMap.
func MemCreate(d Device, n uint64, handleTypes int) (MemHandle, error) {
	var h C.uint64_t
	err := result(Result(C.rs_vmm_create(&h, C.size_t(n), C.int(d), C.int(handleTypes))))
	return MemHandle(h), err
}

// Release drops one reference to the allocation (cuMemRelease); its memory
// is freed once no handle, mapping or exported descriptor is left.
func (h MemHandle) Release() error { return result(Result(C.rs_vmm_release(C.uint64_t(h)))) }

// MemAddressReserve reserves n bytes of device address space, aligned as
// the driver chooses.
func MemAddressReserve(n uint64) (DevicePtr, error) {
	var p C.CUdeviceptr
	err := result(Result(C.rs_vmm_reserve(&p, C.size_t(n))))
	return DevicePtr(p), err
}

// MemAddressFree frees a reservation: p and n as MemAddressReserve gave them.
func MemAddressFree(p DevicePtr, n uint64) error {
	return result(Result(C.rs_vmm_address_free(C.CUdeviceptr(p), C.size_t(n))))
}

// MemMap maps the first n bytes of h at p, inside a reservation; the
// mapping has no access until MemSetAccess.
func MemMap(p DevicePtr, n uint64, h MemHandle) error {
	return result(Result(C.rs_vmm_map(C.CUdeviceptr(p), C.size_t(n), C.uint64_t(h))))
}

// MemUnmap unmaps exactly one mapping made by MemMap.
func MemUnmap(p DevicePtr, n uint64) error {
	return result(Result(C.rs_vmm_unmap(C.CUdeviceptr(p), C.size_t(n))))
}

// MemSetAccess gives device d read-write access to [p, p+n), whole
// mappings.
func MemSetAccess(p DevicePtr, n uint64, d Device) error {
	return result(Result(C.rs_vmm_set_access(C.CUdeviceptr(p), C.size_t(n), C.int(d))))
}

// MemRetainHandle returns the handle of the allocation mapped at p (any
// address of the mapping), with a reference the caller releases.
func MemRetainHandle(p DevicePtr) (MemHandle, error) {
	var h C.uint64_t
	err := result(Result(C.rs_vmm_retain(&h, C.CUdeviceptr(p))))
	return MemHandle(h), err
}

// MemExportFD exports h as a POSIX file descriptor
// (cuMemExportToShareableHandle), which the caller owns and closes; it
// fails unless HandleTypePOSIXFD was requested at MemCreate.
func MemExportFD(h MemHandle) (int, error) {
	var fd C.int
	err := result(Result(C.rs_vmm_export_fd(&fd, C.uint64_t(h))))
	return int(fd), err
}

// MemImportFD imports an allocation from a descriptor another process
// exported (cuMemImportFromShareableHandle); the caller still owns fd and
// closes it. The handle is released with Release.
func MemImportFD(fd int) (MemHandle, error) {
	var h C.uint64_t
	err := result(Result(C.rs_vmm_import_fd(&h, C.int(fd))))
	return MemHandle(h), err
}
