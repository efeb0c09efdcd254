package sys

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A Pidfd is a file descriptor that names one process, not a pid: it keeps
// naming that process after the pid is reused, and becomes readable when
// the process exits. The sidecar binds each session to the pidfd of the
// process that attached, so that a forked child or a later holder of the
// pid never inherits the session.
type Pidfd struct {
	fd  atomic.Int32 // -1 once closed
	pid int
}

// ErrNoPidfd reports a kernel without pidfds (before Linux 5.3).
var ErrNoPidfd = errors.New("sys: pidfds are not supported by this kernel")

// PeerPidfd returns a pidfd of the process at the other end of c. It takes
// SO_PEERPIDFD (Linux 6.5), which names the very process that connected;
// on older kernels it opens a pidfd of cred.PID and accepts it only if that
// process started before the connection was accepted (so a process that
// took the pid since cannot pass for the peer). ErrNoPidfd when the kernel
// has neither.
func PeerPidfd(c *net.UnixConn, cred Cred, accepted time.Time) (*Pidfd, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var fd int
	var serr error
	err = raw.Control(func(s uintptr) {
		fd, serr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, unix.SO_PEERPIDFD)
	})
	if err != nil {
		return nil, err
	}
	if serr == nil {
		unix.CloseOnExec(fd)
		p := &Pidfd{pid: cred.PID}
		p.fd.Store(int32(fd))
		return p, nil
	}
	if !errors.Is(serr, unix.ENOPROTOOPT) && !errors.Is(serr, unix.EINVAL) {
		return nil, fmt.Errorf("SO_PEERPIDFD: %w", serr)
	}
	fd, err = unix.PidfdOpen(cred.PID, 0)
	if errors.Is(err, unix.ENOSYS) {
		return nil, ErrNoPidfd
	}
	if err != nil {
		return nil, fmt.Errorf("pidfd_open(%d): %w", cred.PID, err)
	}
	p := &Pidfd{pid: cred.PID}
	p.fd.Store(int32(fd))
	_, start, err := ProcStat(cred.PID)
	if err != nil {
		p.Close()
		return nil, fmt.Errorf("pid %d: %w", cred.PID, err)
	}
	if limit := bootTicks(accepted) + 1; start > limit {
		p.Close()
		return nil, fmt.Errorf("pid %d started after the connection was accepted (start %d > %d ticks since boot): not the peer", cred.PID, start, limit)
	}
	return p, nil
}

// OpenPidfd returns a pidfd of pid (tests and tools; the sidecar uses
// PeerPidfd).
func OpenPidfd(pid int) (*Pidfd, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ENOSYS) {
		return nil, ErrNoPidfd
	}
	if err != nil {
		return nil, err
	}
	p := &Pidfd{pid: pid}
	p.fd.Store(int32(fd))
	return p, nil
}

// PID is the pid the process had when the pidfd was taken.
func (p *Pidfd) PID() int { return p.pid }

// Exited reports whether the process has exited (a closed Pidfd counts as
// exited). It does not block.
func (p *Pidfd) Exited() bool {
	fd := p.fd.Load()
	if fd < 0 {
		return true
	}
	fds := []unix.PollFd{{Fd: fd, Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err != nil || n > 0
	}
}

// Close closes the pidfd; it is idempotent. A Watch on it must be removed
// first (ExitWatcher.Unwatch).
func (p *Pidfd) Close() {
	if fd := p.fd.Swap(-1); fd >= 0 {
		unix.Close(int(fd))
	}
}

// ExitWatcher calls a function when a watched process exits: one goroutine
// waits in epoll on every watched pidfd, so watching a process costs no
// thread of its own.
type ExitWatcher struct {
	epfd int

	mu     sync.Mutex
	next   uint64
	fns    map[uint64]func()
	tokens map[*Pidfd]uint64
	closed bool
	done   chan struct{}
}

// NewExitWatcher starts a watcher.
func NewExitWatcher() (*ExitWatcher, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	w := &ExitWatcher{epfd: epfd, fns: map[uint64]func(){}, tokens: map[*Pidfd]uint64{}, done: make(chan struct{})}
	go w.loop()
	return w, nil
}

// epollToken packs a 64-bit token into an EpollEvent's data (Fd and the
// padding that follows it are the kernel's u64).
func epollToken(ev *unix.EpollEvent) *uint64 { return (*uint64)(unsafe.Pointer(&ev.Fd)) }

// Watch calls fn (once, on the watcher's goroutine) when p's process
// exits; if it has exited already, soon. fn must not block.
func (w *ExitWatcher) Watch(p *Pidfd, fn func()) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return os.ErrClosed
	}
	fd := p.fd.Load()
	if fd < 0 {
		return os.ErrClosed
	}
	w.next++
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLONESHOT}
	*epollToken(&ev) = w.next
	if err := unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, int(fd), &ev); err != nil {
		return fmt.Errorf("epoll_ctl: %w", err)
	}
	w.fns[w.next] = fn
	w.tokens[p] = w.next
	return nil
}

// Unwatch stops watching p; after it returns, the function given to Watch
// is never called.
func (w *ExitWatcher) Unwatch(p *Pidfd) {
	w.mu.Lock()
	defer w.mu.Unlock()
	tok, ok := w.tokens[p]
	if !ok {
		return
	}
	delete(w.tokens, p)
	delete(w.fns, tok)
	if fd := p.fd.Load(); fd >= 0 {
		unix.EpollCtl(w.epfd, unix.EPOLL_CTL_DEL, int(fd), nil)
	}
}

func (w *ExitWatcher) loop() {
	defer close(w.done)
	evs := make([]unix.EpollEvent, 16)
	for {
		n, err := unix.EpollWait(w.epfd, evs, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return // closed
		}
		for i := 0; i < n; i++ {
			tok := *epollToken(&evs[i])
			if tok == 0 {
				return // Close's wake-up
			}
			w.mu.Lock()
			fn := w.fns[tok]
			delete(w.fns, tok)
			w.mu.Unlock()
			if fn != nil {
				fn()
			}
		}
	}
}

// Close stops the watcher; no function is called after it returns.
func (w *ExitWatcher) Close() {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.closed = true
	w.fns = map[uint64]func(){}
	w.mu.Unlock()
	// Wake the loop with an eventfd registered under token 0.
	efd, err := unix.Eventfd(1, unix.EFD_CLOEXEC)
	if err == nil {
		ev := unix.EpollEvent{Events: unix.EPOLLIN}
		unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, efd, &ev)
		<-w.done
		unix.Close(efd)
	}
	unix.Close(w.epfd)
}

// ProbeMemory reads one byte at addr of process pid (process_vm_readv). It
// fails once the process has released its memory, which an exiting process
// does before its pidfd becomes readable: a copy that ends while its
// process dies is caught by the probe when the pidfd is not yet readable.
func ProbeMemory(pid int, addr uint64) error {
	var b [1]byte
	local := []unix.Iovec{{Base: &b[0], Len: 1}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: 1}}
	n, err := unix.ProcessVMReadv(pid, local, remote, 0)
	if err != nil {
		return err
	}
	if n != 1 {
		return fmt.Errorf("process_vm_readv: read %d bytes", n)
	}
	return nil
}

// userHZ is the unit of /proc's times (USER_HZ, 100 on every Linux ABI
// Go supports).
const userHZ = 100

// bootTicks converts a wall-clock instant to clock ticks since boot.
func bootTicks(t time.Time) uint64 {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts) != nil {
		return ^uint64(0)
	}
	sinceBoot := time.Duration(ts.Nano()) - time.Since(t)
	if sinceBoot < 0 {
		return 0
	}
	return uint64(sinceBoot / (time.Second / userHZ))
}
