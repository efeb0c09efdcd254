// Package harness is what the benchmark drivers share: child processes
// started with a ready-line handshake and bounded waits, the Python
// interpreter and connector package they run, the ringside executable
// they start as the sidecar, and the pieces of their reports (JSON Lines,
// verdicts, medians, nearest-rank percentiles, the machine's load).
//
// It is for cmd/ringside-bench and its packages only; the product binary
// never links it (cmd/ringside's tests check).
package harness

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ringside-kv/ringside/internal/sys"
)

// ReadyLine is what a server child prints on stdout, alone on a line, once
// it can be used.
const ReadyLine = "ready"

// SayReady prints the ready line on w (a server child's stdout).
func SayReady(w io.Writer) {
	fmt.Fprintln(w, ReadyLine)
}

// stderrKeep bounds the child's stderr kept in memory (its end: the
// cause of a failure is near the end); stderrShow is how much of its end
// an error message quotes.
const (
	stderrKeep = 1 << 20
	stderrShow = 2000
)

// Options say how a child starts.
type Options struct {
	// Ready waits for ReadyLine as the first line of the child's stdout
	// (the rest is read and dropped so that the child never blocks on a
	// full pipe). Without it stdout is discarded and Start returns as soon
	// as the child runs.
	Ready bool
	// Timeout bounds the wait for the ready line (default one minute).
	Timeout time.Duration
	// Context, when set, kills the child when it is done.
	Context context.Context
}

// Child is a running child process: a sidecar, a relay, a server. The end
// of its stderr (at least the last MiB) is kept for error messages. A benchmark killed
// mid-run takes its children along (Pdeathsig).
type Child struct {
	name    string
	cmd     *exec.Cmd
	mu      sync.Mutex
	errb    bytes.Buffer
	done    chan error // holds the exit status once the child has ended
	started time.Time
	ended   time.Time
}

type stderrWriter struct{ c *Child }

func (w stderrWriter) Write(b []byte) (int, error) {
	w.c.mu.Lock()
	defer w.c.mu.Unlock()
	w.c.errb.Write(b)
	if n := w.c.errb.Len(); n > 2*stderrKeep {
		w.c.errb.Next(n - stderrKeep)
	}
	return len(b), nil
}

// Start runs exe with args as the child called name.
func Start(name, exe string, args []string, opt Options) (*Child, error) {
	if opt.Timeout <= 0 {
		opt.Timeout = time.Minute
	}
	c := &Child{name: name, done: make(chan error, 1)}
	if opt.Context != nil {
		c.cmd = exec.CommandContext(opt.Context, exe, args...)
	} else {
		c.cmd = exec.Command(exe, args...)
	}
	c.cmd.Stderr = stderrWriter{c}
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var lines chan string
	if opt.Ready {
		// A pipe of our own rather than StdoutPipe: Wait would close that
		// one as the child exits, maybe before its line was read.
		pr, pw, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		c.cmd.Stdout = pw
		lines = make(chan string, 1)
		go func() {
			defer pr.Close()
			line, err := bufio.NewReader(pr).ReadString('\n')
			if err != nil && line == "" {
				close(lines) // no line at all
				return
			}
			lines <- strings.TrimSpace(line)
			_, _ = io.Copy(io.Discard, pr)
		}()
	}
	c.started = time.Now()
	err := c.cmd.Start()
	if pw, ok := c.cmd.Stdout.(*os.File); ok {
		pw.Close() // the child has its own copy
	}
	if err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", name, exe, err)
	}
	// Let the child read and write this process's memory
	// (process_vm_readv/writev) even under Yama ptrace_scope 1; harmless
	// where Yama is absent.
	_ = sys.AllowPtracer(c.cmd.Process.Pid)
	go func() {
		err := c.cmd.Wait()
		c.ended = time.Now()
		c.done <- err
	}()
	if !opt.Ready {
		return c, nil
	}
	t := time.NewTimer(opt.Timeout)
	defer t.Stop()
	select {
	case line, ok := <-lines:
		if line == ReadyLine {
			return c, nil
		}
		if ok {
			c.Kill()
			return nil, fmt.Errorf("%s said %q: %s", name, line, c.Stderr())
		}
		// Stdout closed without a line: the child is ending.
		select {
		case err := <-c.done:
			c.done <- err
			return nil, fmt.Errorf("%s exited before it was ready (%v): %s", name, err, c.Stderr())
		case <-t.C:
			c.Kill()
			return nil, fmt.Errorf("%s closed its stdout without a ready line: %s", name, c.Stderr())
		}
	case err := <-c.done:
		c.done <- err
		return nil, fmt.Errorf("%s exited before it was ready (%v): %s", name, err, c.Stderr())
	case <-t.C:
		c.Kill()
		return nil, fmt.Errorf("%s not ready in %v: %s", name, opt.Timeout, c.Stderr())
	}
}

// Name is the name the child was started with.
func (c *Child) Name() string { return c.name }

// PID is the child's process id.
func (c *Child) PID() int { return c.cmd.Process.Pid }

// Stderr is the end of what the child wrote on stderr, trimmed.
func (c *Child) Stderr() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := strings.TrimSpace(c.errb.String())
	if len(s) > stderrShow {
		s = "..." + s[len(s)-stderrShow:]
	}
	return s
}

// Exited reports whether the child has ended, and its exit status.
func (c *Child) Exited() (bool, error) {
	select {
	case err := <-c.done:
		c.done <- err
		return true, err
	default:
		return false, nil
	}
}

// Stop sends SIGTERM and waits; after timeout it kills.
func (c *Child) Stop(timeout time.Duration) error {
	if ok, err := c.Exited(); ok {
		return c.result(err)
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	return c.Wait(timeout)
}

// Wait waits for the child to exit; after timeout it kills. The error
// quotes the child's stderr.
func (c *Child) Wait(timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-c.done:
		c.done <- err
		return c.result(err)
	case <-t.C:
		c.Kill()
		return fmt.Errorf("%s did not exit within %v; killed: %s", c.name, timeout, c.Stderr())
	}
}

func (c *Child) result(err error) error {
	if err != nil {
		return fmt.Errorf("%s: %v: %s", c.name, err, c.Stderr())
	}
	return nil
}

// Kill kills the child and waits for it.
func (c *Child) Kill() {
	_ = c.cmd.Process.Kill()
	err := <-c.done
	c.done <- err
}

// WaitUntil calls try every 10 ms until it succeeds, the child exits, ctx
// ends or timeout passes; the errors name the child and say what it was
// not (e.g. "attachable").
func (c *Child) WaitUntil(ctx context.Context, timeout time.Duration, what string, try func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := try()
		if err == nil {
			return nil
		}
		if done, perr := c.Exited(); done {
			return fmt.Errorf("%s exited (%v): %s", c.name, perr, c.Stderr())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not %s in %v: %v: %s", c.name, what, timeout, err, c.Stderr())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Usage is an ended child's CPU time, peak resident set and lifetime.
type Usage struct {
	CPU     time.Duration
	MaxRSS  int64 // bytes
	Elapsed time.Duration
}

// Usage reads the ended child's CPU time from its rusage; peak is its peak
// resident set as PeakRSS read it while it ran. (rusage's maxrss is no good
// here: Go starts children with CLONE_VM|CLONE_VFORK and the kernel folds
// the parent's high-water mark into the child's maxrss at exec.)
func (c *Child) Usage(peak int64) Usage {
	var u Usage
	if c.cmd.ProcessState == nil {
		return u
	}
	u.CPU = c.cmd.ProcessState.UserTime() + c.cmd.ProcessState.SystemTime()
	u.MaxRSS = peak
	u.Elapsed = c.ended.Sub(c.started)
	return u
}

// PeakRSS is the running child's VmHWM (the peak resident set of its own
// address space) in bytes, or 0.
func (c *Child) PeakRSS() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.cmd.Process.Pid))
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
