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
// ipc-corrupt-handle, vmm-export, ipc-event, exporter-death. A behaviour
// no probe has confirmed yet is an assumption, not a fact about the
// driver (the exporter's death, under Fault injection, is one).
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
//                         the record "still runs", like a kernel)
//   FAKECUDA_COUNTERS=D   this process counts its driver calls in the file
//                         D/<pid>: NCOUNT little-endian u64s (enum counter)
//   FAKECUDA_STICKY_AFTER=N the Nth copy call of this process (batch or
//                         per-range) fails with CUDA_ERROR_ILLEGAL_ADDRESS
//                         and every later call fails with it (sticky)
//   FAKECUDA_COPY_HOLD=F  while file F exists, a copy call blocks before it
//                         returns (a slow driver call: the calling thread
//                         is busy)
//   FAKECUDA_COMPUTE_MODE=M cuDeviceGetAttribute(COMPUTE_MODE) answers M
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned int type; int id; } loc_t;
typedef struct { unsigned int order; loc_t src, dst; unsigned int flags; } attrs_t;
typedef struct { char r[64]; } ipch_t;

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
CUresult cuCtxGetStreamPriorityRange(int *l, int *g) { NEEDCTX(); *l = 0; *g = -5; return 0; }

CUresult cuMemAlloc(CUdeviceptr *p, size_t n) {
	NEEDCTX();
	if (n == 0) return 1;
	size_t rounded = (n + GRANULE - 1) / GRANULE * GRANULE;
	char name[48];
	pthread_mutex_lock(&mu);
	snprintf(name, sizeof name, "/fakecuda-%d-%d", getpid(), counter++);
	pthread_mutex_unlock(&mu);
	int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
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
	*(int *)v = i >= 0 && !allocs[i].vmm;
	pthread_mutex_unlock(&mu);
	return i < 0 ? 1 : 0;
}
// VMM memory cannot be exported with legacy IPC: cuIpcGetMemHandle fails
// with CUDA_ERROR_INVALID_VALUE in the exporter, so the engine learns it
// before any handle reaches the sidecar. Source: cuIpcGetMemHandle takes
// "a pointer to the base of an existing device memory allocation created
// with cuMemAlloc"; CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
// (cuPointerGetAttribute) is 0 for cuMemCreate memory. Probe: vmm-export.
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
	pthread_mutex_unlock(&mu);
	count(C_IPC_OPEN);
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
	count(C_IPC_CLOSE);
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
#define EV_INTERPROCESS 4
#define EV_DISABLE_TIMING 2
struct ipcev { uint64_t recorded, done; char hold[200]; };
struct stream;
struct ev {
	int countdown;        // NOT_READY answers left after completion (polling is exercised)
	int pending;          // a record of this event is queued on stream st, not yet run
	struct stream *st;
	unsigned flags;
	int imported;
	struct ipcev *sh;     // interprocess events
	char name[64];
};
static int ipc_complete(struct ipcev *sh, uint64_t seq) {
	if (__atomic_load_n(&sh->done, __ATOMIC_SEQ_CST) >= seq) return 1;
	return sh->hold[0] && access(sh->hold, F_OK) != 0; // the held work finished
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
enum { OP_COPY, OP_WAIT_IPC, OP_WAIT_LOCAL, OP_RECORD };
struct op { int kind; uintptr_t dst, src; size_t n; struct ipcev *sh; uint64_t seq; struct ev *ev; };
struct stream { struct op *q; size_t head, n, cap; };

static void ev_recorded(struct ev *e) {
	e->pending = 0;
	e->st = NULL;
	e->countdown = 3;
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
		if (o->kind == OP_RECORD) ev_recorded(o->ev);
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
	int a = h2d ? find_alloc(dst, n) : find_alloc(src, n);
	int ok = a >= 0 && (h2d ? is_registered(src, n) : is_registered(dst, n));
	if (!ok) { pthread_mutex_unlock(&mu); return 1; }
	int exporter = 0;
	if (!allocs[a].own) sscanf(allocs[a].name, "/fakecuda-%d-", &exporter);
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
	if (!st) return 400;
	return copy1(1, d, (uintptr_t)s, n, st);
}
CUresult cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t n, void *st) {
	if (!cur_ctx) return 201;
	count(C_RANGE);
	CUresult r = copy_entry();
	if (r) return r;
	if (!st) return 400;
	return copy1(0, (uintptr_t)d, s, n, st);
}
CUresult cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count_, attrs_t *a, size_t *idx,
		size_t na, size_t *fail, void *st) {
	if (!cur_ctx) return 201;
	count(C_BATCH);
	CUresult r0 = copy_entry();
	if (r0) { *fail = 0; return r0; }
	if (getenv("FAKECUDA_BATCHFAIL")) { *fail = 0; return 1; }
	if (!st || na != 1 || idx[0] != 0 || a[0].order < 1 || a[0].order > 3 || count_ == 0) { *fail = (size_t)-1; return 1; }
	for (size_t i = 0; i < count_; i++) {
		pthread_mutex_lock(&mu);
		int h2d = find_alloc(d[i], n[i]) >= 0;
		pthread_mutex_unlock(&mu);
		CUresult r = copy1(h2d, d[i], s[i], n[i], st);
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
		advance(s);
		int empty = ((struct stream *)s)->n == 0;
		pthread_mutex_unlock(&mu);
		if (empty) return 0;
		usleep(1000);
	}
	return 999;
}
CUresult cuStreamWaitEvent(void *s, struct ev *e, unsigned int flags) {
	NEEDCTX();
	count(C_WAIT_EVENT);
	if (!s) return 400;
	if (!e || flags != 0) return 1;
	pthread_mutex_lock(&mu);
	struct stream *st = s;
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
	int fd = shm_open(name, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
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
	}
	return 0;
}
CUresult cuEventRecord(struct ev *e, void *s) {
	NEEDCTX();
	if (!s) return 400;
	struct stream *st = s;
	pthread_mutex_lock(&mu);
	if (e->sh) __atomic_add_fetch(&e->sh->recorded, 1, __ATOMIC_SEQ_CST);
	advance(st);
	if (st->n > 0) {
		e->pending = 1;
		e->st = st;
		push(st, (struct op){.kind = OP_RECORD, .ev = e});
	} else {
		ev_recorded(e);
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
	case 700: return "CUDA_ERROR_ILLEGAL_ADDRESS";
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
	{"cuStreamWaitEvent", (void *)cuStreamWaitEvent, 3020},
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
