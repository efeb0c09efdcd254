package pollbench

import (
	"bufio"
	"bytes"
	"fmt"
	"github.com/ringside-kv/ringside/internal/sys"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is a child process: the sidecar or the relay.
type proc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	errb bytes.Buffer
	done chan error
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
			// Drain the rest so the child never blocks on a full pipe.
			buf := make([]byte, 4096)
			for {
				if _, err := out.Read(buf); err != nil {
					return
				}
			}
		}()
	}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", name, exe, err)
	}
	// Let the child read this process's memory (process_vm_readv) even
	// under Yama ptrace_scope 1; harmless where Yama is absent.
	_ = sys.AllowPtracer(p.cmd.Process.Pid)
	go func() { p.done <- p.cmd.Wait() }()
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

// exited reports whether the child has ended (without consuming its status).
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

// wait waits for the child to exit; after timeout it kills.
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
