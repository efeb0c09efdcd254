package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// childEnv makes the test binary one of the children below instead of
// running the tests.
const childEnv = "RINGSIDE_HARNESS_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(child(mode))
	}
	os.Exit(m.Run())
}

// child is a test child's behaviour.
func child(mode string) int {
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	switch mode {
	case "ready": // ready, a flood of stdout, then serve until SIGTERM
		SayReady(os.Stdout)
		fmt.Print(strings.Repeat("x", 1<<20))
		<-term
		return 0
	case "liar":
		fmt.Println("hello")
		time.Sleep(time.Minute)
	case "die":
		fmt.Fprintln(os.Stderr, "boom: no such ring")
		return 3
	case "silent":
		time.Sleep(time.Minute)
	case "spam": // more stderr than is kept, then the cause
		for range 3 << 10 {
			fmt.Fprintln(os.Stderr, strings.Repeat("noise ", 170))
		}
		fmt.Fprintln(os.Stderr, "the cause")
		return 1
	case "stubborn": // ignores SIGTERM
		signal.Ignore(syscall.SIGTERM)
		SayReady(os.Stdout)
		time.Sleep(time.Minute)
	case "burn": // uses CPU and memory, then exits on SIGTERM
		SayReady(os.Stdout)
		buf := make([]byte, 64<<20)
		go func() {
			for {
				for i := 0; i < len(buf); i += 4096 {
					buf[i]++
				}
			}
		}()
		<-term
		return 0
	}
	return 2
}

func startChild(t *testing.T, mode string, opt Options) (*Child, error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(childEnv, mode) // inherited by the child only: tests see it after, not before
	c, err := Start("child-"+mode, exe, nil, opt)
	os.Unsetenv(childEnv)
	if c != nil {
		t.Cleanup(func() { c.Kill() })
	}
	return c, err
}

func TestStartHandshake(t *testing.T) {
	tests := []struct {
		mode    string
		timeout time.Duration
		wantErr []string // substrings of Start's error; none: it starts
	}{
		{mode: "ready"},
		{mode: "stubborn"},
		{mode: "liar", wantErr: []string{"child-liar said \"hello\""}},
		{mode: "die", wantErr: []string{"child-die exited before it was ready", "exit status 3", "boom: no such ring"}},
		{mode: "silent", timeout: 300 * time.Millisecond, wantErr: []string{"child-silent not ready in 300ms"}},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			c, err := startChild(t, tt.mode, Options{Ready: true, Timeout: tt.timeout})
			if len(tt.wantErr) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				if done, err := c.Exited(); done {
					t.Fatalf("exited after its ready line: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("started")
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestStopWaitKill(t *testing.T) {
	c, err := startChild(t, "ready", Options{Ready: true})
	if err != nil {
		t.Fatal(err)
	}
	// The child flooded its stdout after the ready line: it is drained, so
	// the child is alive to take SIGTERM and exit 0.
	if err := c.Stop(30 * time.Second); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if done, err := c.Exited(); !done || err != nil {
		t.Fatalf("exited %v, %v", done, err)
	}
	if err := c.Stop(time.Second); err != nil {
		t.Fatalf("a second stop: %v", err)
	}

	s, err := startChild(t, "stubborn", Options{Ready: true})
	if err != nil {
		t.Fatal(err)
	}
	err = s.Stop(200 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "child-stubborn did not exit within 200ms; killed") {
		t.Fatalf("stop of a child ignoring SIGTERM: %v", err)
	}
	if done, _ := s.Exited(); !done {
		t.Fatal("not killed")
	}

	d, err := startChild(t, "die", Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Wait(30 * time.Second)
	if err == nil || !strings.Contains(err.Error(), "child-die: exit status 3: boom: no such ring") {
		t.Fatalf("wait: %v", err)
	}
}

func TestStderrKeepsTheEnd(t *testing.T) {
	c, err := startChild(t, "spam", Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = c.Wait(time.Minute)
	if err == nil {
		t.Fatal("spam exited 0")
	}
	s := c.Stderr()
	if !strings.HasSuffix(s, "the cause") || !strings.HasPrefix(s, "...") || len(s) > stderrShow+3 {
		t.Errorf("stderr quoted as %d bytes ending %q", len(s), s[max(0, len(s)-40):])
	}
	c.mu.Lock()
	kept := c.errb.Len()
	c.mu.Unlock()
	if kept < stderrKeep || kept > 2*stderrKeep {
		t.Errorf("kept %d bytes of about 3 MiB, want between %d and %d", kept, stderrKeep, 2*stderrKeep)
	}
}

func TestContextKills(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	c, err := startChild(t, "stubborn", Options{Ready: true, Context: ctx})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	err = c.Wait(30 * time.Second)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("after the context ended: %v", err)
	}
}

func TestUsage(t *testing.T) {
	c, err := startChild(t, "burn", Options{Ready: true})
	if err != nil {
		t.Fatal(err)
	}
	var peak int64
	for peak < 64<<20 {
		if peak = c.PeakRSS(); peak == 0 {
			t.Skip("no /proc/PID/status VmHWM here")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := c.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	u := c.Usage(peak)
	if u.CPU <= 0 || u.Elapsed <= 0 || u.MaxRSS != peak {
		t.Errorf("usage %+v", u)
	}
	if u.CPU > 2*u.Elapsed { // one spinning thread, a little GC
		t.Errorf("CPU %v over a lifetime of %v", u.CPU, u.Elapsed)
	}
}

func TestWaitUntil(t *testing.T) {
	flag := filepath.Join(t.TempDir(), "up")
	exists := func() error { _, err := os.Stat(flag); return err }

	c, err := startChild(t, "stubborn", Options{Ready: true})
	if err != nil {
		t.Fatal(err)
	}
	err = c.WaitUntil(context.Background(), 100*time.Millisecond, "attachable", exists)
	if err == nil || !strings.Contains(err.Error(), "child-stubborn not attachable in 100ms") || !errors.Is(err, err) {
		t.Fatalf("timeout: %v", err)
	}
	go func() { time.Sleep(50 * time.Millisecond); os.WriteFile(flag, nil, 0o600) }()
	if err := c.WaitUntil(context.Background(), 30*time.Second, "attachable", exists); err != nil {
		t.Fatalf("after the file appeared: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.WaitUntil(ctx, 30*time.Second, "up", func() error { return errors.New("no") }); !errors.Is(err, context.Canceled) {
		t.Fatalf("ended context: %v", err)
	}

	d, err := startChild(t, "die", Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = d.WaitUntil(context.Background(), 30*time.Second, "attachable", func() error { return errors.New("refused") })
	if err == nil || !strings.Contains(err.Error(), "child-die exited (exit status 3): boom") {
		t.Fatalf("a child that died: %v", err)
	}
}
