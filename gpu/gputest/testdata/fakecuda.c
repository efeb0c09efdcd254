// fakecuda.c: a stand-in libcuda.so.1 for CPU-only CI. It implements the
// driver entry points ringside resolves, with "device memory" in /dev/shm
// files so that IPC handles work across processes. It checks what the real
// driver would reject or fault on: calls without a current context, async
// copies touching unregistered host memory or memory outside any
// allocation, overlapping host registrations, registrations of 512 GiB or
// more, batch attributes, opening a handle exported by the same process.
//
// Each behaviour that stands for something the real driver does names the
// CUDA driver API documentation entry it follows and the device probe
// (bench/gpu/probe_ipc.py) that checks it on a GPU: ipc-range,
// ipc-corrupt-handle, vmm-export, ipc-event, vmm-fd-export, vmm-fd-import,
// vmm-release-mapped, vmm-export-unrequested, vmm-pointer-attrs,
// vmm-map-rules, exporter-death, event-death. A behaviour no probe has
// confirmed yet is an assumption, not a fact about the driver (the
// exporter's death, under Fault injection, is one; so is the death of an
// exporter whose event record is still pending, under Interprocess events).
//
// Build: gcc -shared -fPIC -o DIR/libcuda.so.1 fakecuda.c
// Env:
//   FAKECUDA_NOBATCH=1    hides cuMemcpyBatchAsync
//   FAKECUDA_BATCHFAIL=1  makes it fail with CUDA_ERROR_INVALID_VALUE
//   FAKECUDA_NODEV=1      makes cuInit fail with CUDA_ERROR_NO_DEVICE
//   FAKECUDA_VMM=1        makes this process's cuMemAlloc memory stand for
//                         virtual-memory-management memory (cuMemCreate +
//                         cuMemMap, as PyTorch's expandable segments): it
//                         cannot be exported with legacy IPC
//   FAKECUDA_EVENT_HOLD=F while file F exists, an interprocess event this
//                         process records stays incomplete (the work before
//                         the record "still runs", like a kernel); if this
//                         process dies before F is removed, the record
//                         never completes (see Interprocess events)
//   FAKECUDA_EVENT_US=N   an event (not interprocess) this process records
//                         completes N microseconds after its record runs
//                         (a copy that takes that long on the GPU)
//   FAKECUDA_PIN_US_PER_MIB=N cuMemHostRegister takes N microseconds per MiB
//                         (a real driver pins about 0.1 s per GiB: 100)
//   FAKECUDA_COUNTERS=D   this process counts its driver calls in the file
//                         D/<pid>: NCOUNT little-endian u64s (enum counter)
//   FAKECUDA_STICKY_AFTER=N the Nth copy call of this process (batch or
//                         per-range) fails with CUDA_ERROR_ILLEGAL_ADDRESS
//                         and every later call fails with it (sticky)
//   FAKECUDA_COPY_HOLD=F  while file F exists, a copy call blocks before it
//                         returns (a slow driver call: the calling thread
//                         is busy)
//   FAKECUDA_COMPUTE_MODE=M cuDeviceGetAttribute(COMPUTE_MODE) answers M
//   FAKECUDA_IMEX=1       this process has an IMEX channel: cuMemCreate may
//                         request CU_MEM_HANDLE_TYPE_FABRIC (see Virtual
//                         memory management)
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned int type; int id; } loc_t;
typedef struct { unsigned int order; loc_t src, dst; unsigned int flags; } attrs_t;
typedef struct { char r[64]; } ipch_t;
// CUmemLocation, CUmemAllocationProp (32 bytes) and CUmemAccessDesc as in
// cuda.h (64-bit Linux), as vLLM 0.34's vllm/utils/vmm_driver.py lays them out.
typedef struct { int type; int id; } memloc_t;
typedef struct {
	int type, requestedHandleTypes;
	memloc_t location;
	void *win32HandleMetaData;
	struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} allocprop_t;
typedef struct { memloc_t location; int flags; } accessdesc_t;
typedef char check_allocprop[sizeof(allocprop_t) == 32 ? 1 : -1];

static __thread void *cur_ctx;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int counter;

// ---- Per-call counters (FAKECUDA_COUNTERS) ----
// The order is part of the interface: gpu/gputest reads the file by index.
enum counter {
	C_MAGIC,        // 0x544e434b41464b46 once the file is set up
	C_BATCH,        // cuMemcpyBatchAsync calls
	C_RANGE,        // cuMemcpyHtoDAsync + cuMemcpyDtoHAsync calls
	C_IPC_OPEN,     // successful cuIpcOpenMemHandle
	C_IPC_CLOSE,    // successful cuIpcCloseMemHandle
	C_EVENT_OPEN,   // successful cuIpcOpenEventHandle
	C_EVENT_CLOSE,  // cuEventDestroy of an opened (imported) event
	C_WAIT_EVENT,   // cuStreamWaitEvent calls
	C_DEFERRED,     // async copies queued behind an incomplete event
	C_CTX_RETAIN,   // cuDevicePrimaryCtxRetain calls
	C_HOST_REG,     // successful cuMemHostRegister
	C_STICKY,       // calls refused because the context is poisoned
	C_VMM_ALLOC,    // VMM allocations made: cuMemCreate + cuMemImportFromShareableHandle
	C_VMM_FREE,     // VMM allocations freed (last handle released and last mapping unmapped)
	C_VMM_MAP,      // successful cuMemMap
	C_VMM_UNMAP,    // successful cuMemUnmap
	C_VMM_RESERVE,  // successful cuMemAddressReserve
	C_VMM_ADDRFREE, // successful cuMemAddressFree
	C_VMM_EXPORT,   // file descriptors handed out by cuMemExportToShareableHandle
	C_VMM_IMPORT,   // successful cuMemImportFromShareableHandle
	NCOUNT
};
static uint64_t *counters;
static pthread_once_t counters_once = PTHREAD_ONCE_INIT;
static void counters_init(void) {
	const char *d = getenv("FAKECUDA_COUNTERS");
	if (!d) return;
	char path[512];
	snprintf(path, sizeof path, "%s/%d", d, getpid());
	int fd = open(path, O_RDWR | O_CREAT, 0600);
	if (fd < 0) return;
	if (ftruncate(fd, NCOUNT * 8) != 0) { close(fd); return; }
	void *m = mmap(NULL, NCOUNT * 8, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) return;
	counters = m;
	__atomic_store_n(&counters[C_MAGIC], 0x544e434b41464b46ull, __ATOMIC_SEQ_CST);
}
static void count(enum counter c) {
	pthread_once(&counters_once, counters_init);
	if (counters) __atomic_add_fetch(&counters[c], 1, __ATOMIC_SEQ_CST);
}

// ---- Fault injection ----
// Sticky errors. Source: the CUDA driver API's CUresult documentation of
// CUDA_ERROR_ILLEGAL_ADDRESS (700) and of 714-719: the error "leaves the
// process in an inconsistent state and any further CUDA work will return
// the same error. To continue using CUDA, the process must be terminated
// and relaunched." Once poisoned, every entry point that takes the context
// returns the poisoning code (C_STICKY counts those calls). Injected with
// FAKECUDA_STICKY_AFTER=N: the Nth copy call of the process poisons it.
// Probe: exporter-death reports which codes a real context returns after
// a fault, and whether they stay.
static int sticky;
static uint64_t copy_calls;
static CUresult poisoned(void) {
	int r = __atomic_load_n(&sticky, __ATOMIC_SEQ_CST);
	return r;
}
static void poison(CUresult r) { __atomic_store_n(&sticky, r, __ATOMIC_SEQ_CST); }

// Exporter death: the exporter process exits (or is SIGKILLed) while this
// process holds a mapping of its allocation. Assumption (the review's
// hypothesis, NOT a documented fact): a copy that touches a dead exporter's
// allocation fails with CUDA_ERROR_ILLEGAL_ADDRESS and poisons the context
// like any sticky error. Source: cuIpcOpenMemHandle says only that
// "Calling cuMemFree on an exported memory region before calling
// cuIpcCloseMemHandle in the importing context will result in undefined
// behavior"; an exporter's exit frees its allocations. Probe:
// exporter-death must confirm or refute it (the real driver may keep the
// memory alive until the importer closes it, or fail only the copy).
// The fake's shm file outlives a killed exporter, so the model is a check:
// the exporter's pid (in the allocation's name) is gone or a zombie.
static int pid_dead(int pid) {
	char path[64], buf[256];
	snprintf(path, sizeof path, "/proc/%d/stat", pid);
	int fd = open(path, O_RDONLY);
	if (fd < 0) return 1;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0) return 1;
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	return p && (p[2] == 'Z' || p[2] == 'X');
}

// copy_hold blocks while FAKECUDA_COPY_HOLD's file exists.
static void copy_hold(void) {
	const char *f = getenv("FAKECUDA_COPY_HOLD");
	for (int i = 0; f && access(f, F_OK) == 0 && i < 60000; i++) usleep(1000);
}

// copy_entry runs at the start of every copy call, after it is counted:
// the injected sticky error, then a poisoned context.
static CUresult copy_entry(void) {
	copy_hold();
	uint64_t n = __atomic_add_fetch(&copy_calls, 1, __ATOMIC_SEQ_CST);
	const char *after = getenv("FAKECUDA_STICKY_AFTER");
	if (after && n == strtoull(after, NULL, 10)) poison(700);
	CUresult r = poisoned();
	if (r) count(C_STICKY);
	return r;
}

// ---- Device memory ----
// cuMemAlloc rounds the mapping up to 2 MiB, and cuMemGetAddressRange, in
// the exporter and on an importer's pointer, reports the rounded size.
// Source: the cuMemGetAddressRange entry ("the base address and size of
// the allocation by cuMemAlloc() ... that contains the input pointer")
// does not say whether the size is the requested or the granularity-
// rounded one; the fake takes the rounded size in both processes, the
// case where trusting the reported size would overrun what the engine
// declared. Probe: ipc-range confirms or refutes which.
#define GRANULE (2u << 20)
#define MAXA 4096
static struct { uintptr_t p; size_t n; int own, vmm; char name[64]; } allocs[MAXA];
static int seen_pids[64]; // exporters this process imported from (cuMemGetInfo)
static struct { uintptr_t p; size_t n; } hostregs[MAXA];

#define NEEDCTX() do { if (!cur_ctx) return 201; CUresult p_ = poisoned(); if (p_) { count(C_STICKY); return p_; } } while (0)

static int find_alloc(uintptr_t p, size_t n) {
	for (int i = 0; i < MAXA; i++)
		if (allocs[i].p && p >= allocs[i].p && p + n <= allocs[i].p + allocs[i].n) return i;
	return -1;
}
static int is_registered(uintptr_t p, size_t n) {
	for (int i = 0; i < MAXA; i++)
		if (hostregs[i].p && p >= hostregs[i].p && p + n <= hostregs[i].p + hostregs[i].n) return 1;
	return 0;
}

// ---- Virtual memory management: the model's state ----
// A VMM allocation (cuMemCreate, or cuMemImportFromShareableHandle of an
// exported one) is a memfd of its size: the "physical memory". Mapping it
// (cuMemMap) maps the memfd at the address inside a reservation
// (cuMemAddressReserve, a PROT_NONE placeholder), and cuMemSetAccess makes
// it readable/writable. An exported POSIX file descriptor is a descriptor
// of the same memfd, so another process that imports it maps the same
// bytes. The entry points, with their sources, follow the device copies.
// vmems[i].refs counts the handle's references in this process (cuMemCreate
// or the import: 1; each cuMemRetainAllocationHandle: +1; each cuMemRelease:
// -1) and maps its mappings; the memfd is closed when both are 0.
struct vmem { int used; uint64_t handle; int fd; size_t n; unsigned types; int refs, maps; };
struct vres { uintptr_t p; size_t n; };
struct vmap { uintptr_t p; size_t n; int mem; int access; };
static struct vmem vmems[MAXA];
static struct vres vress[MAXA];
static struct vmap vmaps[MAXA];
static uint64_t vmem_seq;

#define HT_POSIX_FD 1u  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
#define HT_FABRIC 8u    // CU_MEM_HANDLE_TYPE_FABRIC
#define ACCESS_READ 1   // CU_MEM_ACCESS_FLAGS_PROT_READ
#define ACCESS_RW 3     // CU_MEM_ACCESS_FLAGS_PROT_READWRITE

// The mapping holding p, or -1.
static int find_vmap(uintptr_t p) {
	for (int i = 0; i < MAXA; i++)
		if (vmaps[i].p && p >= vmaps[i].p && p < vmaps[i].p + vmaps[i].n) return i;
	return -1;
}
// The reservation holding p, or -1.
static int find_vres(uintptr_t p) {
	for (int i = 0; i < MAXA; i++)
		if (vress[i].p && p >= vress[i].p && p < vress[i].p + vress[i].n) return i;
	return -1;
}
// vmm_range reports whether [p, p+n) lies in mapped VMM memory (one
// mapping or adjacent ones) whose access allows reading, or writing.
static int vmm_range(uintptr_t p, size_t n, int write) {
	uintptr_t cur = p, end = p + (n ? n : 1);
	while (cur < end) {
		int m = find_vmap(cur);
		if (m < 0 || vmaps[m].access < (write ? ACCESS_RW : ACCESS_READ)) return 0;
		cur = vmaps[m].p + vmaps[m].n;
	}
	return 1;
}
// dev_range: device memory a copy may touch, legacy or VMM. The index of
// the cuMemAlloc/IPC allocation, DEV_VMM for mapped VMM memory with the
// access the copy needs, -1 otherwise. Called with mu held.
#define DEV_VMM (-2)
static int dev_range(uintptr_t p, size_t n, int write) {
	int a = find_alloc(p, n);
	if (a >= 0) return a;
	return vmm_range(p, n, write) ? DEV_VMM : -1;
}

// An exported handle: a 4-byte tag, the shm name, and a check byte at the
// end. A handle whose bytes were corrupted anywhere fails to open with
// CUDA_ERROR_INVALID_VALUE. Source: cuIpcOpenMemHandle and
// cuIpcOpenEventHandle list CUDA_ERROR_INVALID_VALUE among their results;
// which code a corrupted handle gets is not documented. Probe:
// ipc-corrupt-handle.
static unsigned char check_byte(const char *h) {
	unsigned char c = 0xA5;
	for (int i = 0; i < 63; i++) c = (unsigned char)(c * 31 + (unsigned char)h[i]);
	return c;
}
static void make_handle(char *h, const char *tag, const char *name) {
	memset(h, 0, 64);
	memcpy(h, tag, 4);
	snprintf(h + 4, 59, "%s", name);
	h[63] = (char)check_byte(h);
}
// parse_handle copies the name out of a well-formed handle; 0 if corrupt.
static int parse_handle(const char *h, const char *tag, char *name) {
	if (memcmp(h, tag, 4) != 0 || (unsigned char)h[63] != check_byte(h)) return 0;
	memcpy(name, h + 4, 59);
	name[58] = 0;
	return memchr(h + 4, 0, 59) != NULL && name[0] == '/';
}

CUresult cuInit(unsigned int f) { (void)f; return getenv("FAKECUDA_NODEV") ? 100 : 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int i) { if (i != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char *s, int n, int d) { (void)d; snprintf(s, n, "ringside fake GPU"); return 0; }
CUresult cuDeviceGetUuid(char *u, int d) { for (int i = 0; i < 16; i++) u[i] = (char)(0xf0 + i + d); return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { count(C_CTX_RETAIN); *c = (void *)(uintptr_t)(0x1000 + d); return 0; }
// CU_DEVICE_ATTRIBUTE_COMPUTE_MODE (20) only; FAKECUDA_COMPUTE_MODE sets it.
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
	if (d != 0) return 101;
	if (attr != 20) return 1;
	const char *m = getenv("FAKECUDA_COMPUTE_MODE");
	*v = m ? atoi(m) : 0;
	return 0;
}
CUresult cuDevicePrimaryCtxRelease(int d) { (void)d; return 0; }
CUresult cuCtxSetCurrent(void *c) { cur_ctx = c; return 0; }
// cuCtxGetCurrent, cuCtxGetDevice: the thread's context (NULL, with
// success, when none is current: cuCtxGetCurrent) and its device
// (CUDA_ERROR_INVALID_CONTEXT without one), as vLLM 0.34's
// vllm/utils/vmm_driver.py CudaVmmDriver.ensure_context asks them.
CUresult cuCtxGetCurrent(void **c) { if (!c) return 1; *c = cur_ctx; return 0; }
CUresult cuCtxGetDevice(int *d) {
	if (!d) return 1;
	if (!cur_ctx) return 201;
	*d = (int)((uintptr_t)cur_ctx - 0x1000);
	return 0;
}
CUresult cuCtxGetStreamPriorityRange(int *l, int *g) { NEEDCTX(); *l = 0; *g = -5; return 0; }

// shm_create creates a shared memory object exclusively. Its names hold
// this process's pid, so one that exists already was left by a dead process
// that had the same pid (killed before it unlinked its files): it goes.
static int shm_create(const char *name) {
	int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
	if (fd < 0 && errno == EEXIST) {
		shm_unlink(name);
		fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
	}
	return fd;
}

CUresult cuMemAlloc(CUdeviceptr *p, size_t n) {
	NEEDCTX();
	if (n == 0) return 1;
	size_t rounded = (n + GRANULE - 1) / GRANULE * GRANULE;
	char name[48];
	pthread_mutex_lock(&mu);
	snprintf(name, sizeof name, "/fakecuda-%d-%d", getpid(), counter++);
	pthread_mutex_unlock(&mu);
	int fd = shm_create(name);
	if (fd < 0) return 2;
	if (ftruncate(fd, rounded) != 0) { close(fd); shm_unlink(name); return 2; }
	void *m = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) { shm_unlink(name); return 2; }
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++) if (!allocs[i].p) {
		allocs[i].p = (uintptr_t)m; allocs[i].n = rounded; allocs[i].own = 1;
		allocs[i].vmm = getenv("FAKECUDA_VMM") != NULL;
		snprintf(allocs[i].name, sizeof allocs[i].name, "%s", name);
		break;
	}
	pthread_mutex_unlock(&mu);
	*p = (CUdeviceptr)(uintptr_t)m;
	return 0;
}
CUresult cuMemFree(CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	if (i < 0 || allocs[i].p != p || !allocs[i].own) { pthread_mutex_unlock(&mu); return 1; }
	munmap((void *)allocs[i].p, allocs[i].n);
	shm_unlink(allocs[i].name);
	allocs[i].p = 0;
	pthread_mutex_unlock(&mu);
	return 0;
}
// For VMM memory the range is the mapping holding p: cuPointerGetAttribute's
// CU_POINTER_ATTRIBUTE_RANGE_SIZE entry sends there ("To retrieve the size
// of the mapped region, see cuMemGetAddressRange"). Probe: vmm-pointer-attrs.
CUresult cuMemGetAddressRange(CUdeviceptr *b, size_t *n, CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1), m = i < 0 ? find_vmap(p) : -1;
	if (i >= 0) { if (b) *b = allocs[i].p; if (n) *n = allocs[i].n; }
	if (m >= 0) { if (b) *b = vmaps[m].p; if (n) *n = vmaps[m].n; }
	pthread_mutex_unlock(&mu);
	return i < 0 && m < 0 ? 1 : 0;
}
// cuMemGetInfo: free and total device memory. The model: 80 GiB in all, of
// which the allocations of the processes this one knows of (itself and the
// exporters it imported from; each allocation a /dev/shm/fakecuda-<pid>-<n>
// file) are used while their process lives or while this process maps
// them. An exited exporter's allocation stays used until its importers
// close their mappings, and is freed then (cuIpcCloseMemHandle removes its
// file). Source: cuMemGetInfo; for the exporter's exit nothing is
// documented. Assumption: what LMCache issue #4676 reports (a dead vLLM
// worker's KV memory stayed resident while the importer kept it open);
// probe event-death compares cuMemGetInfo before the exporter's death and
// after the import is closed.
CUresult cuMemGetInfo(size_t *free_, size_t *total) {
	NEEDCTX();
	const size_t all = 80ull << 30;
	size_t used = 0;
	DIR *dir = opendir("/dev/shm");
	pthread_mutex_lock(&mu);
	for (struct dirent *de; dir && (de = readdir(dir)) != NULL;) {
		int pid = 0, n = 0, known = 0;
		if (sscanf(de->d_name, "fakecuda-%d-%d", &pid, &n) != 2) continue;
		known = pid == getpid();
		for (int i = 0; !known && i < 64 && seen_pids[i]; i++) known = seen_pids[i] == pid;
		if (!known) continue;
		int mapped = 0;
		for (int i = 0; i < MAXA && !mapped; i++)
			mapped = allocs[i].p && !strcmp(allocs[i].name + 1, de->d_name);
		struct stat st;
		char path[300];
		snprintf(path, sizeof path, "/dev/shm/%s", de->d_name);
		if ((mapped || !pid_dead(pid)) && stat(path, &st) == 0) used += (size_t)st.st_size;
	}
	pthread_mutex_unlock(&mu);
	if (dir) closedir(dir);
	if (free_) *free_ = used < all ? all - used : 0;
	if (total) *total = all;
	return 0;
}
// cuPointerGetAttribute ("Unified Addressing"), the attributes ringside
// reads: IS_LEGACY_CUDA_IPC_CAPABLE (10, int: "suitable for
// cudaIpcGetMemHandle": 1 for cuMemAlloc memory, 0 for VMM mappings and
// for FAKECUDA_VMM's stand-ins), RANGE_START_ADDR (11) and RANGE_SIZE (12,
// "not necessarily the address of the mapped region, but the address of
// the mappable address range ptr references (e.g. from
// cuMemAddressReserve)": the reservation for VMM memory), MAPPED (13, int;
// 0 with CUDA_SUCCESS for a reserved address with no mapping: assumption),
// ALLOWED_HANDLE_TYPES (14, "a bitmask of the allowed handle types for an
// allocation that may be passed to cuMemExportToShareableHandle": the
// types requested at cuMemCreate, 0 for cuMemAlloc memory; written as 4
// bytes, read it into a zeroed 8-byte value), MAPPING_SIZE (18) and
// MAPPING_BASE_ADDR (19: the mapping). Any other attribute, or a pointer
// the driver does not know, is CUDA_ERROR_INVALID_VALUE. Probe:
// vmm-pointer-attrs.
CUresult cuPointerGetAttribute(void *v, int attr, CUdeviceptr p) {
	NEEDCTX();
	if (!v) return 1;
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1), m = i < 0 ? find_vmap(p) : -1, r = i < 0 && m < 0 ? find_vres(p) : -1;
	CUresult res = 0;
	uint64_t base = 0, size = 0, mbase = 0, msize = 0;
	unsigned types = 0;
	int ipc = 0;
	if (i >= 0) {
		base = mbase = allocs[i].p; size = msize = allocs[i].n; ipc = !allocs[i].vmm;
	} else if (m >= 0) {
		int rr = find_vres(p);
		base = vress[rr].p; size = vress[rr].n; mbase = vmaps[m].p; msize = vmaps[m].n;
		types = vmems[vmaps[m].mem].types;
	}
	int known = i >= 0 || m >= 0;
	switch (attr) {
	case 10: if (known) *(int *)v = ipc; else res = 1; break;
	case 11: if (known) *(uint64_t *)v = base; else res = 1; break;
	case 12: if (known) *(uint64_t *)v = size; else res = 1; break;
	case 13: if (known || r >= 0) *(int *)v = known; else res = 1; break;
	case 14: if (known) *(unsigned *)v = types; else res = 1; break;
	case 18: if (known) *(uint64_t *)v = msize; else res = 1; break;
	case 19: if (known) *(uint64_t *)v = mbase; else res = 1; break;
	default: res = 1;
	}
	pthread_mutex_unlock(&mu);
	return res;
}
// VMM memory cannot be exported with legacy IPC: cuIpcGetMemHandle fails
// with CUDA_ERROR_INVALID_VALUE in the exporter, so the engine learns it
// before any handle reaches the sidecar. Source: cuIpcGetMemHandle takes
// "a pointer to the base of an existing device memory allocation created
// with cuMemAlloc"; CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
// (cuPointerGetAttribute) is 0 for cuMemCreate memory. Both the mappings
// of cuMemMap (not in allocs[]: refused) and FAKECUDA_VMM's cuMemAlloc
// stand-ins are refused. Probes: vmm-export, vmm-pointer-attrs.
CUresult cuIpcGetMemHandle(char *h, CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	if (i < 0 || !allocs[i].own || allocs[i].vmm) { pthread_mutex_unlock(&mu); return 1; }
	make_handle(h, "FAKE", allocs[i].name);
	pthread_mutex_unlock(&mu);
	return 0;
}
CUresult cuIpcOpenMemHandle(CUdeviceptr *p, ipch_t h, unsigned int flags) {
	NEEDCTX();
	(void)flags;
	char name[60];
	if (!parse_handle(h.r, "FAKE", name)) return 1;
	int pid = 0;
	sscanf(name, "/fakecuda-%d-", &pid);
	if (pid == getpid()) return 201; /* same-process open */
	int fd = shm_open(name, O_RDWR, 0);
	if (fd < 0) return 1;
	off_t n = lseek(fd, 0, SEEK_END);
	void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) return 205;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++) if (!allocs[i].p) {
		allocs[i].p = (uintptr_t)m; allocs[i].n = n; allocs[i].own = 0; allocs[i].vmm = 0;
		snprintf(allocs[i].name, sizeof allocs[i].name, "%s", name);
		break;
	}
	for (int i = 0; i < 64; i++) {
		if (seen_pids[i] == pid) break;
		if (!seen_pids[i]) { seen_pids[i] = pid; break; }
	}
	pthread_mutex_unlock(&mu);
	count(C_IPC_OPEN);
	*p = (CUdeviceptr)(uintptr_t)m;
	return 0;
}
// Closing the last mapping of a dead exporter's allocation frees it (see
// cuMemGetInfo): its file is removed.
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	if (i < 0 || allocs[i].p != p || allocs[i].own) { pthread_mutex_unlock(&mu); return 1; }
	munmap((void *)allocs[i].p, allocs[i].n);
	allocs[i].p = 0;
	int pid = 0, mapped = 0;
	sscanf(allocs[i].name, "/fakecuda-%d-", &pid);
	for (int k = 0; k < MAXA; k++)
		if (allocs[k].p && !strcmp(allocs[k].name, allocs[i].name)) mapped = 1;
	if (pid > 0 && !mapped && pid_dead(pid)) shm_unlink(allocs[i].name);
	pthread_mutex_unlock(&mu);
	count(C_IPC_CLOSE);
	return 0;
}
// FAKECUDA_PIN_US_PER_MIB makes a registration take its time, as a real
// driver's does (about 0.1 s per GiB: docs/architecture.md, the copy path).
CUresult cuMemHostRegister(void *p, size_t n, unsigned int flags) {
	NEEDCTX();
	(void)flags;
	if (n >= (512ull << 30)) return 1;
	const char *pin_us = getenv("FAKECUDA_PIN_US_PER_MIB");
	if (pin_us) {
		uint64_t us = strtoull(pin_us, NULL, 10) * (uint64_t)n / (1u << 20);
		struct timespec t = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
		while (nanosleep(&t, &t) != 0) {}
	}
	uintptr_t a = (uintptr_t)p;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++)
		if (hostregs[i].p && a < hostregs[i].p + hostregs[i].n && hostregs[i].p < a + n) { pthread_mutex_unlock(&mu); return 712; }
	for (int i = 0; i < MAXA; i++) if (!hostregs[i].p) { hostregs[i].p = a; hostregs[i].n = n; break; }
	pthread_mutex_unlock(&mu);
	count(C_HOST_REG);
	return 0;
}
CUresult cuMemHostUnregister(void *p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++) if (hostregs[i].p == (uintptr_t)p) { hostregs[i].p = 0; pthread_mutex_unlock(&mu); return 0; }
	pthread_mutex_unlock(&mu);
	return 713;
}
CUresult cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int ok = dev_range(d, n, 1) != -1;
	pthread_mutex_unlock(&mu);
	if (!ok) return 1;
	memcpy((void *)(uintptr_t)d, s, n);
	return 0;
}
CUresult cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int ok = dev_range(s, n, 0) != -1;
	pthread_mutex_unlock(&mu);
	if (!ok) return 1;
	memcpy(d, (void *)(uintptr_t)s, n);
	return 0;
}

// ---- Virtual memory management (cuMemCreate, cuMemMap, shareable handles) ----
// Each behaviour names its entry in the CUDA Driver API documentation
// (section "Virtual Memory Management", and cuPointerGetAttribute in
// "Unified Addressing") and the device probe that checks it. What a
// section does not say (which code a given refusal gets) is the fake's
// choice, marked "assumption", and reported by the probe named.
//
// Granularity: 2 MiB for every valid property, minimum and recommended.
// Source: cuMemGetAllocationGranularity ("either the minimal or
// recommended granularity for a given allocation specification"); 2 MiB
// is what vLLM's ExtensibleTensor floors its granule at. Probe:
// vmm-pointer-attrs reports the real one.
static CUresult check_prop(const allocprop_t *prop, int create) {
	if (!prop || prop->type != 1 /* CU_MEM_ALLOCATION_TYPE_PINNED */) return 1;
	if (prop->location.type != 1 /* CU_MEM_LOCATION_TYPE_DEVICE */) return 1;
	if (prop->location.id != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE, listed by cuMemCreate */
	if (!create) return 0;
	// Requested handle types: POSIX_FILE_DESCRIPTOR (1) and FABRIC (8),
	// alone or together, or NONE (0); the Win32 types (2, 4) are refused
	// on Linux (CUmemAllocationHandleType: "Permitted only on POSIX
	// systems" is the fd type's; the code is an assumption).
	unsigned t = (unsigned)prop->requestedHandleTypes;
	if (t & ~(HT_POSIX_FD | HT_FABRIC)) return 1;
	// FABRIC needs an IMEX channel the process can open (cuMemCreate: an
	// application using FABRIC "must ensure ... at least one IMEX channel
	// file accessible"); without FAKECUDA_IMEX the fake is a node without
	// one and refuses with CUDA_ERROR_NOT_PERMITTED, a code vLLM 0.34's
	// CudaVmmDriver.create falls back on (with NOT_SUPPORTED). Probe:
	// vmm-export-unrequested reports a real node's answer.
	if ((t & HT_FABRIC) && !getenv("FAKECUDA_IMEX")) return 800;
	return 0;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const allocprop_t *prop, int option) {
	NEEDCTX();
	if (!g || (option != 0 && option != 1)) return 1; /* MINIMUM, RECOMMENDED */
	CUresult r = check_prop(prop, 0);
	if (r) return r;
	*g = GRANULE;
	return 0;
}

static void vmem_put(int i) {
	if (vmems[i].refs > 0 || vmems[i].maps > 0) return;
	close(vmems[i].fd);
	vmems[i].used = 0;
	count(C_VMM_FREE);
}
// The allocation of a valid handle (one with a reference left), or -1.
static int find_vmem(uint64_t h) {
	for (int i = 0; i < MAXA; i++)
		if (vmems[i].used && vmems[i].handle == h && vmems[i].refs > 0) return i;
	return -1;
}
static int new_vmem(int fd, size_t n, unsigned types) {
	for (int i = 0; i < MAXA; i++) if (!vmems[i].used) {
		vmems[i] = (struct vmem){.used = 1, .handle = 0x564d4d0000000000ull | ++vmem_seq, .fd = fd, .n = n,
			.types = types, .refs = 1};
		count(C_VMM_ALLOC);
		return i;
	}
	return -1;
}

// cuMemCreate: size a multiple of the granularity (cuMemCreate: "must be a
// multiple of the the value given via cuMemGetAllocationGranularity with
// the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag"), flags 0 ("must be zero
// now"), otherwise CUDA_ERROR_INVALID_VALUE. The allocation has no mapping
// ("The created allocation will not have any device or host mappings").
CUresult cuMemCreate(uint64_t *h, size_t n, const allocprop_t *prop, unsigned long long flags) {
	NEEDCTX();
	if (!h || flags != 0 || n == 0 || n % GRANULE) return 1;
	CUresult r = check_prop(prop, 1);
	if (r) return r;
	char name[48];
	snprintf(name, sizeof name, "fakecuda-vmm-t%u", (unsigned)prop->requestedHandleTypes);
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0) return 2;
	if (ftruncate(fd, (off_t)n) != 0) { close(fd); return 2; }
	pthread_mutex_lock(&mu);
	int i = new_vmem(fd, n, (unsigned)prop->requestedHandleTypes);
	if (i >= 0) *h = vmems[i].handle;
	pthread_mutex_unlock(&mu);
	if (i < 0) { close(fd); return 2; }
	return 0;
}

// cuMemRelease: the handle's reference goes; the memory stays while a
// mapping remains. Source: cuMemRelease ("The memory allocation will be
// freed when all outstanding mappings to the memory are unmapped and when
// all outstanding references to the handle (including it's shareable
// counterparts) are also released. The generic memory handle can be freed
// when there are still outstanding mappings made with this handle."). A
// handle with no reference left is refused with CUDA_ERROR_INVALID_VALUE
// (the documentation: undefined behaviour; the fake is a checker). Probe:
// vmm-release-mapped.
CUresult cuMemRelease(uint64_t h) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_vmem(h);
	if (i >= 0) { vmems[i].refs--; vmem_put(i); }
	pthread_mutex_unlock(&mu);
	return i < 0 ? 1 : 0;
}

// cuMemAddressReserve: size and addr multiples of the host page size,
// alignment a power of two or 0, flags 0 (cuMemAddressReserve), otherwise
// CUDA_ERROR_INVALID_VALUE; addr is a hint ("treats it as a hint") the
// fake ignores. The reservation is aligned to the granularity at least, so
// that its start can be mapped (vLLM reserves with alignment 0 and maps at
// the start: assumption checked by every probe that maps).
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr, unsigned long long flags) {
	NEEDCTX();
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	if (!p || flags != 0 || n == 0 || n % page || addr % page || (align & (align - 1))) return 1;
	size_t a = align > GRANULE ? align : GRANULE;
	char *m = mmap(NULL, n + a, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED) return 2;
	uintptr_t base = ((uintptr_t)m + a - 1) / a * a;
	if (base > (uintptr_t)m) munmap(m, base - (uintptr_t)m);
	if ((uintptr_t)m + n + a > base + n) munmap((void *)(base + n), (uintptr_t)m + n + a - (base + n));
	pthread_mutex_lock(&mu);
	int i;
	for (i = 0; i < MAXA && vress[i].p; i++) {}
	if (i < MAXA) vress[i] = (struct vres){base, n};
	pthread_mutex_unlock(&mu);
	if (i == MAXA) { munmap((void *)base, n); return 2; }
	count(C_VMM_RESERVE);
	*p = base;
	return 0;
}

// cuMemAddressFree: ptr and size must be those of a reservation ("The size
// must match what was given to memAddressReserve and the ptr given must
// match what was returned"), otherwise CUDA_ERROR_INVALID_VALUE.
// Assumption: a reservation with a mapping still in it is refused the same
// way (the documentation does not say; the fake takes the strict side).
// Probe: vmm-map-rules.
CUresult cuMemAddressFree(CUdeviceptr p, size_t n) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i;
	for (i = 0; i < MAXA; i++) if (vress[i].p && vress[i].p == p && vress[i].n == n) break;
	int busy = 0;
	for (int m = 0; i < MAXA && m < MAXA; m++)
		if (vmaps[m].p && vmaps[m].p >= p && vmaps[m].p < p + n) busy = 1;
	if (i < MAXA && !busy) { munmap((void *)p, n); vress[i].p = 0; }
	pthread_mutex_unlock(&mu);
	if (i == MAXA || busy) return 1;
	count(C_VMM_ADDRFREE);
	return 0;
}

// cuMemMap: ptr, size and offset multiples of the granularity; offset 0
// (the offset parameter: "Note: currently must be zero"); offset + size
// within the allocation; the range inside one reservation ("must be an
// address reservation previously reserved with cuMemAddressReserve") and
// not mapped already ("cuMemMap can only create mappings on VA range
// reservations that are not currently mapped"); flags 0. Otherwise
// CUDA_ERROR_INVALID_VALUE (assumption for the overlap and the offset;
// probe vmm-map-rules reports the codes). The new mapping has no access
// ("calling cuMemMap does not make the address accessible"): until
// cuMemSetAccess a copy touching it is refused with
// CUDA_ERROR_INVALID_VALUE (assumption: a GPU would fault instead).
CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, uint64_t h, unsigned long long flags) {
	NEEDCTX();
	if (flags != 0 || n == 0 || p % GRANULE || n % GRANULE || off % GRANULE || off != 0) return 1;
	pthread_mutex_lock(&mu);
	int v = find_vmem(h), r = find_vres(p), m;
	int ok = v >= 0 && off + n <= vmems[v].n && r >= 0 && p + n <= vress[r].p + vress[r].n;
	for (m = 0; ok && m < MAXA; m++)
		if (vmaps[m].p && vmaps[m].p < p + n && p < vmaps[m].p + vmaps[m].n) ok = 0;
	for (m = 0; ok && m < MAXA && vmaps[m].p; m++) {}
	if (!ok || m == MAXA) { pthread_mutex_unlock(&mu); return 1; }
	void *at = mmap((void *)p, n, PROT_NONE, MAP_SHARED | MAP_FIXED, vmems[v].fd, (off_t)off);
	if (at == MAP_FAILED) { pthread_mutex_unlock(&mu); return 2; }
	vmaps[m] = (struct vmap){p, n, v, 0};
	vmems[v].maps++;
	pthread_mutex_unlock(&mu);
	count(C_VMM_MAP);
	return 0;
}

// cuMemUnmap: the range must be exactly one mapping ("The range must be
// the entire contiguous address range that was mapped to. In other words,
// cuMemUnmap cannot unmap a sub-range"), otherwise
// CUDA_ERROR_INVALID_VALUE; the range is a reservation again ("the address
// range is converted to an address reservation"), and the memory is freed
// if no handle or mapping is left ("Any backing memory allocations will be
// freed if there are no existing mappings and there are no unreleased
// memory handles"). Probes: vmm-release-mapped, vmm-map-rules.
CUresult cuMemUnmap(CUdeviceptr p, size_t n) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int m = find_vmap(p);
	if (m < 0 || vmaps[m].p != p || vmaps[m].n != n) { pthread_mutex_unlock(&mu); return 1; }
	mmap((void *)p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
	int v = vmaps[m].mem;
	vmaps[m].p = 0;
	vmems[v].maps--;
	vmem_put(v);
	pthread_mutex_unlock(&mu);
	count(C_VMM_UNMAP);
	return 0;
}

// cuMemSetAccess: the range must be whole mappings, contiguous ("The range
// must be a fully mapped address range containing all allocations created
// by cuMemMap / cuMemCreate"), otherwise CUDA_ERROR_INVALID_VALUE; each
// descriptor names device 0 (else CUDA_ERROR_INVALID_DEVICE, listed) and
// PROT_NONE (0), PROT_READ (1) or PROT_READWRITE (3). The fake applies the
// access with mprotect, so a stray host access faults as a device one
// would. Probe: every probe that maps.
CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const accessdesc_t *desc, size_t count_) {
	NEEDCTX();
	if (!desc || count_ == 0) return 1;
	int access = 0;
	for (size_t i = 0; i < count_; i++) {
		if (desc[i].location.type != 1) return 1;
		if (desc[i].location.id != 0) return 101;
		if (desc[i].flags != 0 && desc[i].flags != ACCESS_READ && desc[i].flags != ACCESS_RW) return 1;
		access = desc[i].flags;
	}
	pthread_mutex_lock(&mu);
	uintptr_t cur = p;
	while (cur < p + n) {
		int m = find_vmap(cur);
		if (m < 0 || vmaps[m].p != cur || cur + vmaps[m].n > p + n) break;
		cur += vmaps[m].n;
	}
	if (n == 0 || cur != p + n) { pthread_mutex_unlock(&mu); return 1; }
	for (cur = p; cur < p + n;) {
		int m = find_vmap(cur);
		vmaps[m].access = access;
		mprotect((void *)cur, vmaps[m].n, access == ACCESS_RW ? PROT_READ | PROT_WRITE : access ? PROT_READ : PROT_NONE);
		cur += vmaps[m].n;
	}
	pthread_mutex_unlock(&mu);
	return 0;
}

// cuMemRetainAllocationHandle: any address in a mapping ("can be any
// address in a range previously mapped by cuMemMap, and not necessarily
// the start address") gives the handle that was mapped there ("guaranteed
// to be the same handle value used to map the memory") and one more
// reference to release; an address that is not mapped (cuMemAlloc memory
// included) fails ("If the address requested is not mapped, the function
// will fail": CUDA_ERROR_INVALID_VALUE, assumption). Probes: vmm-fd-export,
// vmm-map-rules.
CUresult cuMemRetainAllocationHandle(uint64_t *h, void *addr) {
	NEEDCTX();
	if (!h) return 1;
	pthread_mutex_lock(&mu);
	int m = find_vmap((uintptr_t)addr);
	if (m >= 0) {
		struct vmem *v = &vmems[vmaps[m].mem];
		v->refs++;
		*h = v->handle;
	}
	pthread_mutex_unlock(&mu);
	return m < 0 ? 1 : 0;
}

// cuMemExportToShareableHandle: a POSIX file descriptor (an int written to
// *shareableHandle) of an allocation created with that type requested; a
// new descriptor per call, which the caller closes, and which keeps the
// memory alive on its own (cuMemExportToShareableHandle: "Once all
// shareable handles are closed and the allocation is released, the
// allocated memory referenced will be released back to the OS"). A type
// not requested at cuMemCreate is refused; the section lists
// CUDA_ERROR_INVALID_VALUE, NOT_PERMITTED and NOT_SUPPORTED without saying
// which is this one: the fake answers CUDA_ERROR_INVALID_VALUE
// (assumption; probe vmm-export-unrequested reports the real code). flags
// must be 0 ("Reserved, must be zero"). A FABRIC export of an allocation
// that requested it is not modelled (CUDA_ERROR_NOT_SUPPORTED): ringside
// does not import fabric handles. The descriptor is not close-on-exec
// (assumption; probe vmm-fd-export reports the real flag). Probes:
// vmm-fd-export, vmm-export-unrequested.
CUresult cuMemExportToShareableHandle(void *out, uint64_t h, int type, unsigned long long flags) {
	NEEDCTX();
	if (!out || flags != 0) return 1;
	pthread_mutex_lock(&mu);
	int i = find_vmem(h);
	CUresult r = 0;
	int fd = -1;
	if (i < 0 || (type != (int)HT_POSIX_FD && type != (int)HT_FABRIC) || !(vmems[i].types & (unsigned)type)) r = 1;
	else if (type == (int)HT_FABRIC) r = 801;
	else if ((fd = fcntl(vmems[i].fd, F_DUPFD, 0)) < 0) r = 2;
	pthread_mutex_unlock(&mu);
	if (r) return r;
	*(int *)out = fd;
	count(C_VMM_EXPORT);
	return 0;
}

// cuMemImportFromShareableHandle: osHandle is the descriptor itself, cast
// to a pointer ((void *)(uintptr_t)fd, as NCCL and CUDA's memMapIPCDrv
// sample pass it). A descriptor of an allocation exported by this fake
// gives a new handle in this process (a new one per import: "There is no
// guarantee that the contents of handle will be the same CUDA memory
// handle for the same given OS shareable handle"), of the exported size
// and handle types, to be mapped ("the process must use cuMemMap to map
// the memory into its address ranges before setting accessibility with
// cuMemSetAccess") and released ("Each time a recipient process imports a
// shareable handle, it needs to pair it with cuMemRelease", cuMemRelease).
// The caller keeps its descriptor and closes it. Any other descriptor is
// refused with CUDA_ERROR_INVALID_VALUE; FABRIC with
// CUDA_ERROR_NOT_PERMITTED without an IMEX channel ("If shHandleType is
// CU_MEM_HANDLE_TYPE_FABRIC and the importer process has not been granted
// access to the same IMEX channel") and as not modelled (NOT_SUPPORTED)
// with one. The memory outlives the exporter: it is freed when every
// handle, mapping and descriptor of it, in any process, is gone
// (cuMemRelease, above). Probes: vmm-fd-import, vmm-release-mapped.
CUresult cuMemImportFromShareableHandle(uint64_t *h, void *os, int type) {
	NEEDCTX();
	if (!h) return 1;
	if (type == (int)HT_FABRIC) return getenv("FAKECUDA_IMEX") ? 801 : 800;
	if (type != (int)HT_POSIX_FD) return 1;
	int fd = (int)(intptr_t)os;
	char path[64], link[128];
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	ssize_t k = readlink(path, link, sizeof link - 1);
	unsigned types = 0;
	struct stat st;
	if (k <= 0) return 1;
	link[k] = 0;
	if (sscanf(link, "/memfd:fakecuda-vmm-t%u", &types) != 1 || fstat(fd, &st) != 0 || st.st_size <= 0) return 1;
	int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (own < 0) return 2;
	pthread_mutex_lock(&mu);
	int i = new_vmem(own, (size_t)st.st_size, types);
	if (i >= 0) *h = vmems[i].handle;
	pthread_mutex_unlock(&mu);
	if (i < 0) { close(own); return 2; }
	count(C_VMM_IMPORT);
	return 0;
}

// ---- Interprocess events ----
// An interprocess event's state lives in a shm file that the exporter
// creates and importers map: how many times it was recorded and the last
// record that completed. cuStreamWaitEvent waits for the record that was
// the latest when it was called; an event never recorded is complete.
// Sources: cuEventCreate (CU_EVENT_INTERPROCESS "must be specified along
// with CU_EVENT_DISABLE_TIMING"), cuIpcGetEventHandle (the event must have
// both flags; after cuIpcOpenEventHandle, cuEventRecord, cuStreamWaitEvent
// and cuEventQuery "may be used in either process"), cuStreamWaitEvent
// ("all future work submitted to hStream will wait until hEvent completes";
// it waits for the latest cuEventRecord before the call). Probe: ipc-event.
//
// The exporter's death with a record pending: an exporter killed while
// the work queued before its record still runs (FAKECUDA_EVENT_HOLD's file
// exists) never runs that record, so the event never completes, for a
// cuStreamWaitEvent already issued, for one issued later and for
// cuEventQuery: whatever waits on it in another process waits forever.
// Once the hold's file is gone the record completes if, when someone next
// looks (a query, a stream advancing), the exporter still lives; from then
// on it stays complete. (The fake cannot tell a hold removed before the
// death from one removed after, unless someone looked in between: a test
// removes the hold before the death, and looks, or only after it.)
// Sources: cuIpcOpenEventHandle ("Performing operations on the imported
// event after the exported event has been freed with cuEventDestroy will
// result in undefined behavior"; an exporter's exit frees its events),
// PyTorch PR #15974 ("the event ... that last called record must not be
// destructed. Otherwise, synchronize could block forever"), LMCache issue
// #4676 (a server that waited on a dead vLLM worker's event hung, and its
// imports of the worker's memory were never released). Assumption: a real
// driver does the same; probe event-death reports what it does.
#define EV_INTERPROCESS 4
#define EV_DISABLE_TIMING 2
struct ipcev { uint64_t recorded, done; char hold[200]; int pid; };
struct stream;
struct ev {
	int countdown;        // NOT_READY answers left after completion (polling is exercised)
	uint64_t ready_ns;    // FAKECUDA_EVENT_US: CLOCK_MONOTONIC time the recorded work ends
	int pending;          // a record of this event is queued on stream st, not yet run
	struct stream *st;
	unsigned flags;
	int imported;
	struct ipcev *sh;     // interprocess events
	char name[64];
};
static int ipc_complete(struct ipcev *sh, uint64_t seq) {
	if (__atomic_load_n(&sh->done, __ATOMIC_SEQ_CST) >= seq) return 1;
	if (!sh->hold[0] || access(sh->hold, F_OK) == 0) return 0; // the held work still runs
	// The held work finished: the record runs, unless its process died
	// first (see the exporter's death above), and then stays run.
	if (pid_dead(sh->pid)) return 0;
	uint64_t rec = __atomic_load_n(&sh->recorded, __ATOMIC_SEQ_CST), done = __atomic_load_n(&sh->done, __ATOMIC_SEQ_CST);
	while (done < rec && !__atomic_compare_exchange_n(&sh->done, &done, rec, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
	return 1;
}
static uint64_t now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

// ---- Streams ----
// A stream is a queue run in order. A copy is checked when it is enqueued
// (the driver's parameter errors are synchronous) and runs at once when
// nothing is queued ahead of it; behind a cuStreamWaitEvent on an
// incomplete event it stays queued until the event completes. Queued work
// is run by the calls that look at the stream: enqueueing on it,
// cuEventQuery of an event recorded on it, cuStreamSynchronize. That is
// the model of a GPU's asynchronous progress: what is behind the wait
// never runs early, and it runs at the latest when someone asks.
//
// Stream 0 (NULL) is the legacy default stream, which the driver accepts
// wherever it takes a stream ("CU_STREAM_LEGACY ... also the default
// stream": what torch records on unless a stream is set): here one more
// stream of the process, for copies, cuStreamWaitEvent, cuEventRecord and
// cuStreamSynchronize. Its implicit synchronization with the process's
// other blocking streams is not modeled (ringside's streams are created
// non-blocking, and the engine's side records on one stream).
enum { OP_COPY, OP_WAIT_IPC, OP_WAIT_LOCAL, OP_RECORD };
struct op { int kind; uintptr_t dst, src; size_t n; struct ipcev *sh; uint64_t seq; struct ev *ev; };
// busy_ns: with FAKECUDA_EVENT_US, when the work recorded on the stream so
// far ends (the stream runs one thing after another).
struct stream { struct op *q; size_t head, n, cap; uint64_t busy_ns; };
static struct stream legacy_stream;
static struct stream *stream_of(void *s) { return s ? (struct stream *)s : &legacy_stream; }

static void ev_recorded(struct ev *e, struct stream *st) {
	e->pending = 0;
	e->st = NULL;
	e->countdown = 3;
	const char *us = getenv("FAKECUDA_EVENT_US");
	if (us && !e->sh) {
		uint64_t now = now_ns(), from = st && st->busy_ns > now ? st->busy_ns : now;
		e->ready_ns = from + strtoull(us, NULL, 10) * 1000ull;
		if (st) st->busy_ns = e->ready_ns;
		e->countdown = 0;
	}
	if (e->sh) { // a record by this process of an interprocess event
		struct ipcev *sh = e->sh;
		const char *hold = getenv("FAKECUDA_EVENT_HOLD");
		if (hold && access(hold, F_OK) == 0) {
			snprintf(sh->hold, sizeof sh->hold, "%s", hold);
		} else {
			sh->hold[0] = 0;
			__atomic_store_n(&sh->done, sh->recorded, __ATOMIC_SEQ_CST);
		}
	}
}
// advance runs the stream's queued work up to the first wait that cannot
// pass yet. Called with mu held.
static void advance(struct stream *s) {
	while (s->head < s->n) {
		struct op *o = &s->q[s->head];
		if (o->kind == OP_WAIT_IPC && !ipc_complete(o->sh, o->seq)) return;
		if (o->kind == OP_WAIT_LOCAL && o->ev->pending) return;
		if (o->kind == OP_COPY) memcpy((void *)o->dst, (const void *)o->src, o->n);
		if (o->kind == OP_RECORD) ev_recorded(o->ev, s);
		s->head++;
	}
	s->head = s->n = 0;
}
static void push(struct stream *s, struct op o) {
	if (s->n == s->cap) {
		s->cap = s->cap ? 2 * s->cap : 16;
		s->q = realloc(s->q, s->cap * sizeof *s->q);
	}
	s->q[s->n++] = o;
}

static CUresult copy1(int h2d, uintptr_t dst, uintptr_t src, size_t n, struct stream *st) {
	pthread_mutex_lock(&mu);
	int a = h2d ? dev_range(dst, n, 1) : dev_range(src, n, 0);
	int ok = a != -1 && (h2d ? is_registered(src, n) : is_registered(dst, n));
	if (!ok) { pthread_mutex_unlock(&mu); return 1; }
	int exporter = 0;
	if (a >= 0 && !allocs[a].own) sscanf(allocs[a].name, "/fakecuda-%d-", &exporter);
	if (exporter > 0 && pid_dead(exporter)) { // see Fault injection: exporter death
		pthread_mutex_unlock(&mu);
		poison(700);
		return 700;
	}
	advance(st);
	if (st->n > 0) {
		push(st, (struct op){.kind = OP_COPY, .dst = dst, .src = src, .n = n});
		pthread_mutex_unlock(&mu);
		count(C_DEFERRED);
		return 0;
	}
	pthread_mutex_unlock(&mu);
	memcpy((void *)dst, (const void *)src, n);
	return 0;
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *s, size_t n, void *st) {
	if (!cur_ctx) return 201;
	count(C_RANGE);
	CUresult r = copy_entry();
	if (r) return r;
	return copy1(1, d, (uintptr_t)s, n, stream_of(st));
}
CUresult cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t n, void *st) {
	if (!cur_ctx) return 201;
	count(C_RANGE);
	CUresult r = copy_entry();
	if (r) return r;
	return copy1(0, (uintptr_t)d, s, n, stream_of(st));
}
CUresult cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count_, attrs_t *a, size_t *idx,
		size_t na, size_t *fail, void *st) {
	if (!cur_ctx) return 201;
	count(C_BATCH);
	CUresult r0 = copy_entry();
	if (r0) { *fail = 0; return r0; }
	if (getenv("FAKECUDA_BATCHFAIL")) { *fail = 0; return 1; }
	if (na != 1 || idx[0] != 0 || a[0].order < 1 || a[0].order > 3 || count_ == 0) { *fail = (size_t)-1; return 1; }
	for (size_t i = 0; i < count_; i++) {
		pthread_mutex_lock(&mu);
		int h2d = dev_range(d[i], n[i], 1) != -1;
		pthread_mutex_unlock(&mu);
		CUresult r = copy1(h2d, d[i], s[i], n[i], stream_of(st));
		if (r) { *fail = i; return r; }
	}
	return 0;
}
CUresult cuStreamCreateWithPriority(void **s, unsigned int f, int prio) {
	NEEDCTX();
	(void)f; (void)prio;
	*s = calloc(1, sizeof(struct stream));
	return 0;
}
CUresult cuStreamDestroy(void *s) {
	NEEDCTX();
	struct stream *st = s;
	pthread_mutex_lock(&mu);
	advance(st); // work still blocked is dropped with the stream
	for (size_t i = st->head; i < st->n; i++)
		if (st->q[i].kind == OP_RECORD) st->q[i].ev->st = NULL;
	pthread_mutex_unlock(&mu);
	free(st->q);
	free(st);
	return 0;
}
CUresult cuStreamSynchronize(void *s) {
	NEEDCTX();
	for (int i = 0; i < 60000; i++) {
		pthread_mutex_lock(&mu);
		advance(stream_of(s));
		int empty = stream_of(s)->n == 0;
		pthread_mutex_unlock(&mu);
		if (empty) return 0;
		usleep(1000);
	}
	return 999;
}
// cuStreamQuery: CUDA_SUCCESS once everything queued on the stream has run,
// CUDA_ERROR_NOT_READY while something waits (cuStreamQuery: "Returns
// CUDA_SUCCESS if all operations in the stream specified by hStream have
// completed, or CUDA_ERROR_NOT_READY if not"). Probe: event-death.
CUresult cuStreamQuery(void *s) {
	NEEDCTX();
	if (!s) return 400;
	pthread_mutex_lock(&mu);
	advance(s);
	int empty = ((struct stream *)s)->n == 0;
	pthread_mutex_unlock(&mu);
	return empty ? 0 : 600;
}
CUresult cuStreamWaitEvent(void *s, struct ev *e, unsigned int flags) {
	NEEDCTX();
	count(C_WAIT_EVENT);
	if (!e || flags != 0) return 1;
	pthread_mutex_lock(&mu);
	struct stream *st = stream_of(s);
	if (e->sh) {
		uint64_t seq = __atomic_load_n(&e->sh->recorded, __ATOMIC_SEQ_CST);
		if (!ipc_complete(e->sh, seq)) push(st, (struct op){.kind = OP_WAIT_IPC, .sh = e->sh, .seq = seq});
	} else if (e->pending) {
		push(st, (struct op){.kind = OP_WAIT_LOCAL, .ev = e});
	}
	advance(st);
	pthread_mutex_unlock(&mu);
	return 0;
}

static struct ev *ev_new(unsigned flags) {
	struct ev *e = calloc(1, sizeof *e);
	e->flags = flags;
	return e;
}
static struct ipcev *map_ipcev(const char *name, int create) {
	int fd = create ? shm_create(name) : shm_open(name, O_RDWR, 0600);
	if (fd < 0) return NULL;
	if (create && ftruncate(fd, sizeof(struct ipcev)) != 0) { close(fd); shm_unlink(name); return NULL; }
	void *m = mmap(NULL, sizeof(struct ipcev), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	return m == MAP_FAILED ? NULL : m;
}
CUresult cuEventCreate(struct ev **e, unsigned int f) {
	NEEDCTX();
	if ((f & EV_INTERPROCESS) && !(f & EV_DISABLE_TIMING)) return 1;
	*e = ev_new(f);
	if (f & EV_INTERPROCESS) {
		pthread_mutex_lock(&mu);
		snprintf((*e)->name, sizeof (*e)->name, "/fakecuda-ev-%d-%d", getpid(), counter++);
		pthread_mutex_unlock(&mu);
		if (!((*e)->sh = map_ipcev((*e)->name, 1))) { free(*e); return 2; }
		(*e)->sh->pid = getpid();
	}
	return 0;
}
CUresult cuEventRecord(struct ev *e, void *s) {
	NEEDCTX();
	struct stream *st = stream_of(s);
	pthread_mutex_lock(&mu);
	if (e->sh) __atomic_add_fetch(&e->sh->recorded, 1, __ATOMIC_SEQ_CST);
	advance(st);
	if (st->n > 0) {
		e->pending = 1;
		e->st = st;
		push(st, (struct op){.kind = OP_RECORD, .ev = e});
	} else {
		ev_recorded(e, st);
	}
	pthread_mutex_unlock(&mu);
	return 0;
}
CUresult cuEventQuery(struct ev *e) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	if (e->pending && e->st) advance(e->st);
	CUresult r;
	if (e->pending) {
		r = 600;
	} else if (e->sh) {
		r = ipc_complete(e->sh, __atomic_load_n(&e->sh->recorded, __ATOMIC_SEQ_CST)) ? 0 : 600;
	} else if (e->ready_ns && now_ns() < e->ready_ns) {
		r = 600;
	} else if (e->countdown > 0) {
		e->countdown--;
		r = 600;
	} else {
		r = 0;
	}
	pthread_mutex_unlock(&mu);
	return r;
}
CUresult cuEventDestroy(struct ev *e) {
	NEEDCTX();
	if (e->sh) {
		munmap(e->sh, sizeof(struct ipcev));
		if (e->imported) count(C_EVENT_CLOSE);
		else shm_unlink(e->name);
	}
	free(e);
	return 0;
}
CUresult cuIpcGetEventHandle(char *h, struct ev *e) {
	NEEDCTX();
	if (!e) return 400;
	if (!e->sh || e->imported || (e->flags & (EV_INTERPROCESS | EV_DISABLE_TIMING)) != (EV_INTERPROCESS | EV_DISABLE_TIMING)) return 1;
	make_handle(h, "FEVT", e->name);
	return 0;
}
CUresult cuIpcOpenEventHandle(struct ev **e, ipch_t h) {
	NEEDCTX();
	char name[60];
	if (!parse_handle(h.r, "FEVT", name)) return 1;
	struct ipcev *sh = map_ipcev(name, 0);
	if (!sh) return 1;
	*e = ev_new(EV_INTERPROCESS | EV_DISABLE_TIMING);
	(*e)->sh = sh;
	(*e)->imported = 1;
	snprintf((*e)->name, sizeof (*e)->name, "%s", name);
	count(C_EVENT_OPEN);
	return 0;
}

static const char *ename(CUresult r) {
	switch (r) {
	case 0: return "CUDA_SUCCESS"; case 1: return "CUDA_ERROR_INVALID_VALUE"; case 100: return "CUDA_ERROR_NO_DEVICE";
	case 201: return "CUDA_ERROR_INVALID_CONTEXT"; case 600: return "CUDA_ERROR_NOT_READY";
	case 712: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; case 713: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
	case 700: return "CUDA_ERROR_ILLEGAL_ADDRESS"; case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
	case 101: return "CUDA_ERROR_INVALID_DEVICE"; case 800: return "CUDA_ERROR_NOT_PERMITTED";
	case 801: return "CUDA_ERROR_NOT_SUPPORTED";
	}
	return NULL;
}
CUresult cuGetErrorName(CUresult r, const char **s) { *s = ename(r); return *s ? 0 : 1; }
CUresult cuGetErrorString(CUresult r, const char **s) { *s = ename(r) ? "fake driver error" : NULL; return *s ? 0 : 1; }

static struct { const char *name; void *fn; int minver; } procs[] = {
	{"cuInit", (void *)cuInit, 2000}, {"cuDriverGetVersion", (void *)cuDriverGetVersion, 2020},
	{"cuDeviceGetCount", (void *)cuDeviceGetCount, 2000}, {"cuDeviceGet", (void *)cuDeviceGet, 2000},
	{"cuDeviceGetName", (void *)cuDeviceGetName, 2000}, {"cuDeviceGetUuid", (void *)cuDeviceGetUuid, 9020},
	{"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute, 2000},
	{"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain, 7000},
	{"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease, 7000},
	{"cuCtxSetCurrent", (void *)cuCtxSetCurrent, 4000},
	{"cuCtxGetCurrent", (void *)cuCtxGetCurrent, 4000}, {"cuCtxGetDevice", (void *)cuCtxGetDevice, 2000},
	{"cuCtxGetStreamPriorityRange", (void *)cuCtxGetStreamPriorityRange, 5050},
	{"cuIpcGetMemHandle", (void *)cuIpcGetMemHandle, 4010}, {"cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle, 4010},
	{"cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle, 4010},
	{"cuIpcGetEventHandle", (void *)cuIpcGetEventHandle, 4010}, {"cuIpcOpenEventHandle", (void *)cuIpcOpenEventHandle, 4010},
	{"cuMemGetAddressRange", (void *)cuMemGetAddressRange, 3020},
	{"cuPointerGetAttribute", (void *)cuPointerGetAttribute, 4000},
	{"cuMemAlloc", (void *)cuMemAlloc, 3020}, {"cuMemFree", (void *)cuMemFree, 3020},
	{"cuMemHostRegister", (void *)cuMemHostRegister, 6050}, {"cuMemHostUnregister", (void *)cuMemHostUnregister, 4000},
	{"cuMemcpyHtoD", (void *)cuMemcpyHtoD, 3020}, {"cuMemcpyDtoH", (void *)cuMemcpyDtoH, 3020},
	{"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync, 3020}, {"cuMemcpyDtoHAsync", (void *)cuMemcpyDtoHAsync, 3020},
	{"cuMemcpyBatchAsync", (void *)cuMemcpyBatchAsync, 12080},
	{"cuStreamCreateWithPriority", (void *)cuStreamCreateWithPriority, 5050},
	{"cuStreamDestroy", (void *)cuStreamDestroy, 4000}, {"cuStreamSynchronize", (void *)cuStreamSynchronize, 2000},
	{"cuStreamQuery", (void *)cuStreamQuery, 2000}, {"cuMemGetInfo", (void *)cuMemGetInfo, 3020},
	{"cuStreamWaitEvent", (void *)cuStreamWaitEvent, 3020},
	{"cuEventCreate", (void *)cuEventCreate, 2000}, {"cuEventRecord", (void *)cuEventRecord, 2000},
	{"cuEventQuery", (void *)cuEventQuery, 2000}, {"cuEventDestroy", (void *)cuEventDestroy, 4000},
	{"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity, 10020},
	{"cuMemCreate", (void *)cuMemCreate, 10020}, {"cuMemRelease", (void *)cuMemRelease, 10020},
	{"cuMemAddressReserve", (void *)cuMemAddressReserve, 10020}, {"cuMemAddressFree", (void *)cuMemAddressFree, 10020},
	{"cuMemMap", (void *)cuMemMap, 10020}, {"cuMemUnmap", (void *)cuMemUnmap, 10020},
	{"cuMemSetAccess", (void *)cuMemSetAccess, 10020},
	{"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle, 11000},
	{"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle, 10020},
	{"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle, 10020},
};

CUresult cuGetProcAddress_v2(const char *sym, void **fn, int ver, unsigned long long flags, int *status) {
	(void)flags;
	*fn = NULL;
	for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
		if (strcmp(procs[i].name, sym) != 0) continue;
		if (!strcmp(sym, "cuMemcpyBatchAsync") && getenv("FAKECUDA_NOBATCH")) break;
		if (ver < procs[i].minver) { if (status) *status = 2; return 500; }
		*fn = procs[i].fn;
		if (status) *status = 0;
		return 0;
	}
	if (status) *status = 1;
	return 500;
}
