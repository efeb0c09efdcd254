// fakecuda.c: a stand-in libcuda.so.1 for CPU-only CI. It implements the
// driver entry points ringside resolves, with "device memory" in /dev/shm
// files so that IPC handles work across processes. Copies run at once with
// memcpy; events report CUDA_ERROR_NOT_READY for their first queries so
// that polling is exercised. It checks what the real driver would reject
// or fault on: calls without a current context, async copies touching
// unregistered host memory or memory outside any allocation, overlapping
// host registrations, registrations of 512 GiB or more, batch attributes,
// opening a handle exported by the same process.
//
// Build: gcc -shared -fPIC -o DIR/libcuda.so.1 fakecuda.c
// Env: FAKECUDA_NOBATCH=1 hides cuMemcpyBatchAsync; FAKECUDA_BATCHFAIL=1
// makes it fail with CUDA_ERROR_INVALID_VALUE; FAKECUDA_NODEV=1 makes
// cuInit fail with CUDA_ERROR_NO_DEVICE.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned int type; int id; } loc_t;
typedef struct { unsigned int order; loc_t src, dst; unsigned int flags; } attrs_t;
typedef struct { char r[64]; } ipch_t;

static __thread void *cur_ctx;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int counter;

#define MAXA 4096
static struct { uintptr_t p; size_t n; int own; char name[64]; } allocs[MAXA];
static struct { uintptr_t p; size_t n; } hostregs[MAXA];

#define NEEDCTX() do { if (!cur_ctx) return 201; } while (0)

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

CUresult cuInit(unsigned int f) { (void)f; return getenv("FAKECUDA_NODEV") ? 100 : 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int i) { if (i != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char *s, int n, int d) { (void)d; snprintf(s, n, "ringside fake GPU"); return 0; }
CUresult cuDeviceGetUuid(char *u, int d) { for (int i = 0; i < 16; i++) u[i] = (char)(0xf0 + i + d); return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)(uintptr_t)(0x1000 + d); return 0; }
CUresult cuDevicePrimaryCtxRelease(int d) { (void)d; return 0; }
CUresult cuCtxSetCurrent(void *c) { cur_ctx = c; return 0; }
CUresult cuCtxGetStreamPriorityRange(int *l, int *g) { NEEDCTX(); *l = 0; *g = -5; return 0; }

CUresult cuMemAlloc(CUdeviceptr *p, size_t n) {
	NEEDCTX();
	char name[48];
	pthread_mutex_lock(&mu);
	snprintf(name, sizeof name, "/fakecuda-%d-%d", getpid(), counter++);
	pthread_mutex_unlock(&mu);
	int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
	if (fd < 0) return 2;
	if (ftruncate(fd, n) != 0) { close(fd); shm_unlink(name); return 2; }
	void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) { shm_unlink(name); return 2; }
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++) if (!allocs[i].p) {
		allocs[i].p = (uintptr_t)m; allocs[i].n = n; allocs[i].own = 1;
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
CUresult cuMemGetAddressRange(CUdeviceptr *b, size_t *n, CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	if (i >= 0) { if (b) *b = allocs[i].p; if (n) *n = allocs[i].n; }
	pthread_mutex_unlock(&mu);
	return i < 0 ? 1 : 0;
}
CUresult cuPointerGetAttribute(void *v, int attr, CUdeviceptr p) {
	NEEDCTX();
	if (attr != 10) return 1;
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	pthread_mutex_unlock(&mu);
	*(int *)v = i >= 0;
	return i < 0 ? 1 : 0;
}
CUresult cuIpcGetMemHandle(char *h, CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	if (i < 0 || !allocs[i].own) { pthread_mutex_unlock(&mu); return 1; }
	memset(h, 0, 64);
	memcpy(h, "FAKE", 4);
	snprintf(h + 4, 60, "%s", allocs[i].name);
	pthread_mutex_unlock(&mu);
	return 0;
}
CUresult cuIpcOpenMemHandle(CUdeviceptr *p, ipch_t h, unsigned int flags) {
	NEEDCTX();
	(void)flags;
	if (memcmp(h.r, "FAKE", 4) != 0) return 1; /* like VMM memory: invalid value */
	char name[60];
	memcpy(name, h.r + 4, 59);
	name[59] = 0;
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
		allocs[i].p = (uintptr_t)m; allocs[i].n = n; allocs[i].own = 0;
		snprintf(allocs[i].name, sizeof allocs[i].name, "%s", name);
		break;
	}
	pthread_mutex_unlock(&mu);
	*p = (CUdeviceptr)(uintptr_t)m;
	return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int i = find_alloc(p, 1);
	if (i < 0 || allocs[i].p != p || allocs[i].own) { pthread_mutex_unlock(&mu); return 1; }
	munmap((void *)allocs[i].p, allocs[i].n);
	allocs[i].p = 0;
	pthread_mutex_unlock(&mu);
	return 0;
}
CUresult cuMemHostRegister(void *p, size_t n, unsigned int flags) {
	NEEDCTX();
	(void)flags;
	if (n >= (512ull << 30)) return 1;
	uintptr_t a = (uintptr_t)p;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++)
		if (hostregs[i].p && a < hostregs[i].p + hostregs[i].n && hostregs[i].p < a + n) { pthread_mutex_unlock(&mu); return 712; }
	for (int i = 0; i < MAXA; i++) if (!hostregs[i].p) { hostregs[i].p = a; hostregs[i].n = n; break; }
	pthread_mutex_unlock(&mu);
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
	int ok = find_alloc(d, n) >= 0;
	pthread_mutex_unlock(&mu);
	if (!ok) return 1;
	memcpy((void *)(uintptr_t)d, s, n);
	return 0;
}
CUresult cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) {
	NEEDCTX();
	pthread_mutex_lock(&mu);
	int ok = find_alloc(s, n) >= 0;
	pthread_mutex_unlock(&mu);
	if (!ok) return 1;
	memcpy(d, (void *)(uintptr_t)s, n);
	return 0;
}
static CUresult copy1(int h2d, uintptr_t dst, uintptr_t src, size_t n) {
	pthread_mutex_lock(&mu);
	int ok = h2d ? (find_alloc(dst, n) >= 0 && is_registered(src, n)) : (find_alloc(src, n) >= 0 && is_registered(dst, n));
	pthread_mutex_unlock(&mu);
	if (!ok) return 1;
	memcpy((void *)dst, (const void *)src, n);
	return 0;
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *s, size_t n, void *st) {
	NEEDCTX();
	if (!st) return 400;
	return copy1(1, d, (uintptr_t)s, n);
}
CUresult cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t n, void *st) {
	NEEDCTX();
	if (!st) return 400;
	return copy1(0, (uintptr_t)d, s, n);
}
CUresult cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count, attrs_t *a, size_t *idx,
		size_t na, size_t *fail, void *st) {
	NEEDCTX();
	if (getenv("FAKECUDA_BATCHFAIL")) { *fail = 0; return 1; }
	if (!st || na != 1 || idx[0] != 0 || a[0].order < 1 || a[0].order > 3 || count == 0) { *fail = (size_t)-1; return 1; }
	for (size_t i = 0; i < count; i++) {
		pthread_mutex_lock(&mu);
		int h2d = find_alloc(d[i], n[i]) >= 0;
		pthread_mutex_unlock(&mu);
		CUresult r = copy1(h2d, d[i], s[i], n[i]);
		if (r) { *fail = i; return r; }
	}
	return 0;
}
CUresult cuStreamCreateWithPriority(void **s, unsigned int f, int prio) {
	NEEDCTX();
	(void)f; (void)prio;
	*s = malloc(8);
	return 0;
}
CUresult cuStreamDestroy(void *s) { NEEDCTX(); free(s); return 0; }
CUresult cuStreamSynchronize(void *s) { NEEDCTX(); (void)s; return 0; }
CUresult cuEventCreate(int **e, unsigned int f) { NEEDCTX(); (void)f; *e = calloc(1, sizeof(int)); return 0; }
CUresult cuEventRecord(int *e, void *s) { NEEDCTX(); if (!s) return 400; *e = 3; return 0; }
CUresult cuEventQuery(int *e) { NEEDCTX(); if (*e > 0) { (*e)--; return 600; } return 0; }
CUresult cuEventDestroy(int *e) { NEEDCTX(); free(e); return 0; }

static const char *ename(CUresult r) {
	switch (r) {
	case 0: return "CUDA_SUCCESS"; case 1: return "CUDA_ERROR_INVALID_VALUE"; case 100: return "CUDA_ERROR_NO_DEVICE";
	case 201: return "CUDA_ERROR_INVALID_CONTEXT"; case 600: return "CUDA_ERROR_NOT_READY";
	case 712: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; case 713: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
	}
	return NULL;
}
CUresult cuGetErrorName(CUresult r, const char **s) { *s = ename(r); return *s ? 0 : 1; }
CUresult cuGetErrorString(CUresult r, const char **s) { *s = ename(r) ? "fake driver error" : NULL; return *s ? 0 : 1; }

static struct { const char *name; void *fn; int minver; } procs[] = {
	{"cuInit", (void *)cuInit, 2000}, {"cuDriverGetVersion", (void *)cuDriverGetVersion, 2020},
	{"cuDeviceGetCount", (void *)cuDeviceGetCount, 2000}, {"cuDeviceGet", (void *)cuDeviceGet, 2000},
	{"cuDeviceGetName", (void *)cuDeviceGetName, 2000}, {"cuDeviceGetUuid", (void *)cuDeviceGetUuid, 9020},
	{"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain, 7000},
	{"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease, 7000},
	{"cuCtxSetCurrent", (void *)cuCtxSetCurrent, 4000},
	{"cuCtxGetStreamPriorityRange", (void *)cuCtxGetStreamPriorityRange, 5050},
	{"cuIpcGetMemHandle", (void *)cuIpcGetMemHandle, 4010}, {"cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle, 4010},
	{"cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle, 4010},
	{"cuMemGetAddressRange", (void *)cuMemGetAddressRange, 3020},
	{"cuPointerGetAttribute", (void *)cuPointerGetAttribute, 4000},
	{"cuMemAlloc", (void *)cuMemAlloc, 3020}, {"cuMemFree", (void *)cuMemFree, 3020},
	{"cuMemHostRegister", (void *)cuMemHostRegister, 6050}, {"cuMemHostUnregister", (void *)cuMemHostUnregister, 4000},
	{"cuMemcpyHtoD", (void *)cuMemcpyHtoD, 3020}, {"cuMemcpyDtoH", (void *)cuMemcpyDtoH, 3020},
	{"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync, 3020}, {"cuMemcpyDtoHAsync", (void *)cuMemcpyDtoHAsync, 3020},
	{"cuMemcpyBatchAsync", (void *)cuMemcpyBatchAsync, 12080},
	{"cuStreamCreateWithPriority", (void *)cuStreamCreateWithPriority, 5050},
	{"cuStreamDestroy", (void *)cuStreamDestroy, 4000}, {"cuStreamSynchronize", (void *)cuStreamSynchronize, 2000},
	{"cuEventCreate", (void *)cuEventCreate, 2000}, {"cuEventRecord", (void *)cuEventRecord, 2000},
	{"cuEventQuery", (void *)cuEventQuery, 2000}, {"cuEventDestroy", (void *)cuEventDestroy, 4000},
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
