package reliability

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// stalled is engine memory whose chosen pages are missing under a
// userfaultfd (MISSING mode): the first access to one of them, by this
// process or by the sidecar's process_vm_readv/process_vm_writev (a remote,
// kernel-mode fault), blocks until resolve places the page's content, or
// until this process exits (the kernel then releases the userfaultfd and the
// blocked copy goes on as if no handler had been registered). The tests use
// it to hold a copy at a known point while they race something against it.
//
// Nothing in this process may touch a missing page before resolve: the
// faulting thread would wait for a handler goroutine the Go runtime might
// not schedule. resolve leaves every page present, so that reading the
// memory afterwards never faults.
type stalled struct {
	mem      []byte        // the whole mapping (page-aligned, anonymous, private)
	page     int           // bytes per page (the OS page size)
	content  [][]byte      // what each missing page gets at resolve, by missing index
	missing  []int         // indices of the missing pages
	fd       int           // the userfaultfd
	faults   chan uint64   // fault addresses, as the handler reads them
	first    chan struct{} // closed at the first fault
	stop     chan struct{}
	stopped  chan struct{}
	once     sync.Once
	resolved bool
	mu       sync.Mutex
	nfaults  int
}

// uffd ioctl numbers and ABI (linux/userfaultfd.h). The request numbers use
// the generic _IOC encoding (x86, arm, arm64, riscv, loongarch, s390).
const (
	uffdAPI            = 0xAA
	uffdioAPI          = 3<<30 | 24<<16 | 0xAA<<8 | 0x3F // _IOWR(0xAA, 0x3F, struct uffdio_api)
	uffdioRegister     = 3<<30 | 32<<16 | 0xAA<<8        // _IOWR(0xAA, 0x00, struct uffdio_register)
	uffdioUnregister   = 2<<30 | 16<<16 | 0xAA<<8 | 0x01 // _IOR(0xAA, 0x01, struct uffdio_range)
	uffdioWake         = 2<<30 | 16<<16 | 0xAA<<8 | 0x02 // _IOR(0xAA, 0x02, struct uffdio_range)
	uffdioCopy         = 3<<30 | 40<<16 | 0xAA<<8 | 0x03 // _IOWR(0xAA, 0x03, struct uffdio_copy)
	uffdRegisterMiss   = 1                               // UFFDIO_REGISTER_MODE_MISSING
	uffdEventPagefault = 0x12
	uffdMsgSize        = 32
)

// errNoUffd marks a missing kernel feature or privilege (the test skips).
var errNoUffd = errors.New("userfaultfd unavailable")

// uffdArchOK reports whether the generic ioctl encoding above holds here.
func uffdArchOK() bool {
	switch runtime.GOARCH {
	case "amd64", "386", "arm64", "arm", "riscv64", "loong64", "s390x":
		return true
	}
	return false
}

// newStalled maps pages OS pages, writes fill(i, page) into each, registers
// the mapping with a new userfaultfd in MISSING mode and then drops the
// pages listed in missing (MADV_DONTNEED), which become missing again; at
// resolve they get the content fill wrote. An error wrapping errNoUffd says
// the kernel or the privileges do not allow remote (kernel-mode) faults.
func newStalled(pages int, fill func(i int, p []byte), missing ...int) (*stalled, error) {
	if !uffdArchOK() {
		return nil, fmt.Errorf("%w: the ioctl encoding of %s is not the generic one this helper uses", errNoUffd, runtime.GOARCH)
	}
	pg := os.Getpagesize()
	mem, err := unix.Mmap(-1, 0, pages*pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	// Small pages only: a transparent huge page would make the whole 2 MiB
	// one unit of presence.
	unix.Madvise(mem, unix.MADV_NOHUGEPAGE)
	s := &stalled{mem: mem, page: pg, fd: -1, faults: make(chan uint64, 1024), first: make(chan struct{}),
		stop: make(chan struct{}), stopped: make(chan struct{})}
	for i := 0; i < pages; i++ {
		fill(i, mem[i*pg:(i+1)*pg])
	}
	for _, i := range missing {
		if i < 0 || i >= pages {
			unix.Munmap(mem)
			return nil, fmt.Errorf("missing page %d outside [0, %d)", i, pages)
		}
		s.missing = append(s.missing, i)
		s.content = append(s.content, append([]byte(nil), mem[i*pg:(i+1)*pg]...))
	}
	// Without UFFD_USER_MODE_ONLY: faults raised by the kernel on behalf of
	// another process (process_vm_*) must be caught too. That needs
	// CAP_SYS_PTRACE (or vm.unprivileged_userfaultfd=1).
	fd, _, errno := unix.Syscall(unix.SYS_USERFAULTFD, uintptr(unix.O_CLOEXEC|unix.O_NONBLOCK), 0, 0)
	if errno != 0 {
		unix.Munmap(mem)
		if errno == unix.EPERM || errno == unix.ENOSYS || errno == unix.EACCES {
			return nil, fmt.Errorf("%w: userfaultfd(2) without UFFD_USER_MODE_ONLY: %v (needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1, and CONFIG_USERFAULTFD)", errNoUffd, errno)
		}
		return nil, fmt.Errorf("userfaultfd: %w", errno)
	}
	s.fd = int(fd)
	fail := func(what string, err error) (*stalled, error) {
		unix.Close(s.fd)
		unix.Munmap(mem)
		return nil, fmt.Errorf("userfaultfd %s: %w", what, err)
	}
	var api [3]uint64 // api, features, ioctls
	api[0] = uffdAPI
	if err := ioctlPtr(s.fd, uffdioAPI, unsafe.Pointer(&api[0])); err != nil {
		return fail("UFFDIO_API", err)
	}
	var reg [4]uint64 // range.start, range.len, mode, ioctls
	reg[0], reg[1], reg[2] = uint64(uintptr(unsafe.Pointer(&mem[0]))), uint64(len(mem)), uffdRegisterMiss
	if err := ioctlPtr(s.fd, uffdioRegister, unsafe.Pointer(&reg[0])); err != nil {
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EPERM) {
			return nil, fmt.Errorf("%w: UFFDIO_REGISTER (missing mode) on anonymous memory: %v", errNoUffd, err)
		}
		return fail("UFFDIO_REGISTER", err)
	}
	for _, i := range s.missing {
		if err := unix.Madvise(mem[i*pg:(i+1)*pg], unix.MADV_DONTNEED); err != nil {
			return fail("MADV_DONTNEED", err)
		}
	}
	go s.handle()
	return s, nil
}

// stalledOrSkip is newStalled for a test: a missing feature skips it with
// the reason.
func stalledOrSkip(t *testing.T, pages int, fill func(i int, p []byte), missing ...int) *stalled {
	t.Helper()
	s, err := newStalled(pages, fill, missing...)
	if errors.Is(err, errNoUffd) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.close)
	return s
}

func ioctlPtr(fd int, req uintptr, arg unsafe.Pointer) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
	if errno != 0 {
		return errno
	}
	return nil
}

// handle reads fault messages; it only reports them (resolve places the
// pages).
func (s *stalled) handle() {
	defer close(s.stopped)
	buf := make([]byte, uffdMsgSize*16)
	fds := []unix.PollFd{{Fd: int32(s.fd), Events: unix.POLLIN}}
	for {
		select {
		case <-s.stop:
			return
		default:
		}
		n, err := unix.Poll(fds, 50)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return
		}
		if n <= 0 {
			continue
		}
		got, err := unix.Read(s.fd, buf)
		if err != nil {
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
				continue
			}
			return
		}
		for off := 0; off+uffdMsgSize <= got; off += uffdMsgSize {
			m := buf[off : off+uffdMsgSize]
			if m[0] != uffdEventPagefault {
				continue
			}
			addr := binary.LittleEndian.Uint64(m[16:24])
			s.mu.Lock()
			s.nfaults++
			if s.nfaults == 1 {
				close(s.first)
			}
			s.mu.Unlock()
			select {
			case s.faults <- addr:
			default:
			}
		}
	}
}

// waitFault waits until something faulted on a missing page (the copy is
// stalled), at most d.
func (s *stalled) waitFault(d time.Duration) error {
	select {
	case <-s.first:
		return nil
	case <-time.After(d):
		return fmt.Errorf("no access to the missing pages within %v (the copy did not start, or did not reach them)", d)
	}
}

// resolve places every missing page (UFFDIO_COPY, which wakes whoever waits
// on it): the stalled copy goes on. Idempotent.
func (s *stalled) resolve() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.resolved {
		return nil
	}
	s.resolved = true
	var first error
	for k, i := range s.missing {
		dst := uint64(uintptr(unsafe.Pointer(&s.mem[i*s.page])))
		var cp [5]uint64 // dst, src, len, mode, copy (result)
		cp[0], cp[1], cp[2] = dst, uint64(uintptr(unsafe.Pointer(&s.content[k][0]))), uint64(s.page)
		err := ioctlPtr(s.fd, uffdioCopy, unsafe.Pointer(&cp[0]))
		if errors.Is(err, unix.EEXIST) { // already placed: just wake any waiter
			var r [2]uint64
			r[0], r[1] = dst, uint64(s.page)
			err = ioctlPtr(s.fd, uffdioWake, unsafe.Pointer(&r[0]))
		}
		if err != nil && first == nil {
			first = fmt.Errorf("UFFDIO_COPY page %d: %w", i, err)
		}
	}
	runtime.KeepAlive(s.content)
	return first
}

// close resolves what is still missing, unregisters and unmaps.
func (s *stalled) close() {
	s.once.Do(func() {
		s.resolve()
		close(s.stop)
		<-s.stopped
		var r [2]uint64
		r[0], r[1] = uint64(uintptr(unsafe.Pointer(&s.mem[0]))), uint64(len(s.mem))
		ioctlPtr(s.fd, uffdioUnregister, unsafe.Pointer(&r[0]))
		unix.Close(s.fd)
		// The sidecar may still be copying into this memory if the test
		// failed early; once it is unmapped, that copy fails (EFAULT),
		// which is harmless to it.
		unix.Munmap(s.mem)
	})
}

// TestUffdHelper checks the helper itself: a process_vm_readv of this
// process's own stalled page blocks until resolve, then reads the content.
func TestUffdHelper(t *testing.T) {
	s := stalledOrSkip(t, 4, func(i int, p []byte) {
		for j := range p {
			p[j] = byte(i + 1)
		}
	}, 0)
	dst := make([]byte, 4*s.page)
	done := make(chan error, 1)
	go func() {
		local := []unix.Iovec{{Base: &dst[0]}}
		local[0].SetLen(len(dst))
		remote := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&s.mem[0])), Len: len(s.mem)}}
		n, err := unix.ProcessVMReadv(os.Getpid(), local, remote, 0)
		if err == nil && n != len(dst) {
			err = fmt.Errorf("short read %d", n)
		}
		done <- err
	}()
	if err := s.waitFault(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		t.Fatalf("the read did not stall: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := s.resolve(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the read stayed stalled after resolve")
	}
	for i := 0; i < 4; i++ {
		if dst[i*s.page] != byte(i+1) || dst[(i+1)*s.page-1] != byte(i+1) {
			t.Fatalf("page %d read %d", i, dst[i*s.page])
		}
	}
}
