package replay

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ringside-kv/ringside/internal/sys"
)

// proc is a child process: a sidecar or a relay.
type proc struct {
	name    string
	cmd     *exec.Cmd
	mu      sync.Mutex
	errb    bytes.Buffer
	done    chan error
	started time.Time
	ended   time.Time
}

type lockedWriter struct{ p *proc }

func (w lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	if w.p.errb.Len() < 1<<20 {
		w.p.errb.Write(b)
	}
	return len(b), nil
}

func (p *proc) stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := strings.TrimSpace(p.errb.String())
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	return s
}

// start runs exe args; with ready set, it waits for a "ready" line on the
// child's stdout.
func start(name, exe string, args []string, ready bool, timeout time.Duration) (*proc, error) {
	p := &proc{name: name, done: make(chan error, 1)}
	p.cmd = exec.Command(exe, args...)
	p.cmd.Stderr = lockedWriter{p}
	// A bench killed mid-run takes its children along.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var lines chan string
	if ready {
		out, err := p.cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		lines = make(chan string, 1)
		go func() {
			line, _ := bufio.NewReader(out).ReadString('\n')
			lines <- strings.TrimSpace(line)
			buf := make([]byte, 4096)
			for {
				if _, err := out.Read(buf); err != nil {
					return
				}
			}
		}()
	}
	p.started = time.Now()
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", name, exe, err)
	}
	// Let the child read and write this process's memory
	// (process_vm_readv/writev) even under Yama ptrace_scope 1.
	_ = sys.AllowPtracer(p.cmd.Process.Pid)
	go func() {
		err := p.cmd.Wait()
		p.ended = time.Now()
		p.done <- err
	}()
	if !ready {
		return p, nil
	}
	select {
	case line := <-lines:
		if line == "ready" {
			return p, nil
		}
		p.kill()
		return nil, fmt.Errorf("%s said %q: %s", name, line, p.stderr())
	case err := <-p.done:
		p.done <- err
		return nil, fmt.Errorf("%s exited before it was ready (%v): %s", name, err, p.stderr())
	case <-time.After(timeout):
		p.kill()
		return nil, fmt.Errorf("%s not ready in %v: %s", name, timeout, p.stderr())
	}
}

func (p *proc) exited() (error, bool) {
	select {
	case err := <-p.done:
		p.done <- err
		return err, true
	default:
		return nil, false
	}
}

// stop sends SIGTERM and waits; after timeout it kills.
func (p *proc) stop(timeout time.Duration) error {
	if err, ok := p.exited(); ok {
		return p.result(err)
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	return p.wait(timeout)
}

func (p *proc) wait(timeout time.Duration) error {
	select {
	case err := <-p.done:
		p.done <- err
		return p.result(err)
	case <-time.After(timeout):
		p.kill()
		return fmt.Errorf("%s did not exit within %v; killed: %s", p.name, timeout, p.stderr())
	}
}

func (p *proc) result(err error) error {
	if err != nil {
		return fmt.Errorf("%s: %v: %s", p.name, err, p.stderr())
	}
	return nil
}

func (p *proc) kill() {
	p.cmd.Process.Kill()
	err := <-p.done
	p.done <- err
}

// usage is the ended child's CPU time and peak resident set, and its
// lifetime.
type usage struct {
	CPU     time.Duration
	MaxRSS  int64 // bytes
	Elapsed time.Duration
}

// usage reads the ended child's CPU time from its rusage. The peak
// resident set comes from peakRSS, read while it ran: rusage's maxrss is
// no good here, because Go starts children with CLONE_VM|CLONE_VFORK and
// the kernel folds the parent's high-water mark into the child's maxrss
// at exec.
func (p *proc) usage(peak int64) usage {
	var u usage
	if p.cmd.ProcessState == nil {
		return u
	}
	u.CPU = p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime()
	u.MaxRSS = peak
	u.Elapsed = p.ended.Sub(p.started)
	return u
}

// peakRSS is the running child's VmHWM (peak resident set of its own
// address space) in bytes, or 0.
func (p *proc) peakRSS() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err == nil {
				return kb << 10
			}
		}
	}
	return 0
}
