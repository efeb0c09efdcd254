package sidecar

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// limitedServer serves handler through newHTTPServer on a loopback port.
func limitedServer(t *testing.T, h HTTPConfig, handler http.Handler) string {
	t.Helper()
	h.ensureDefaults()
	srv, lim := newHTTPServer(handler, h)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lim.listen(ln)) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != http.ErrServerClosed {
			t.Errorf("serve: %v", err)
		}
	})
	return ln.Addr().String()
}

// request sends one GET on c and reads the answer.
func request(c net.Conn, path string) (string, error) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: t\r\n\r\n", path)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// closed reports whether the server closed c within wait.
func closed(c net.Conn, wait time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(wait))
	_, err := c.Read(make([]byte, 1))
	ne, ok := err.(net.Error)
	return err != nil && (!ok || !ne.Timeout())
}

func TestConnLimitClosesLongestIdle(t *testing.T) {
	addr := limitedServer(t, HTTPConfig{MaxConns: 3}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	var conns []net.Conn
	for i := 0; i < 6; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if body, err := request(c, "/"); err != nil || body != "ok" {
			t.Fatalf("connection %d: %q %v", i, body, err)
		}
		conns = append(conns, c)
	}
	// Each of the last three made room by closing an idle one (the one
	// idle longest, in the server's view: which one that is depends on
	// when each server goroutine marked its connection idle, so only the
	// count and the newest are certain here).
	var open []int
	for i, c := range conns {
		if !closed(c, 50*time.Millisecond) {
			open = append(open, i)
		}
	}
	if len(open) != 3 || open[2] != 5 {
		t.Fatalf("connections %v left open, want 3 of them, the newest (5) among them", open)
	}
	// The three still open keep serving.
	for _, i := range open {
		if body, err := request(conns[i], "/"); err != nil || body != "ok" {
			t.Errorf("connection %d after the others were closed: %q %v", i, body, err)
		}
	}
}

func TestConnLimitKeepsBusyConnections(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	addr := limitedServer(t, HTTPConfig{MaxConns: 1}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			started <- struct{}{}
			<-release
		}
		io.WriteString(w, "ok")
	}))
	busy, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	slow := make(chan error, 1)
	go func() {
		body, err := request(busy, "/slow")
		if err == nil && body != "ok" {
			err = fmt.Errorf("body %q", body)
		}
		slow <- err
	}()
	<-started
	// The only connection is serving a request: a new one waits for it
	// instead of closing it.
	next, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	got := make(chan error, 1)
	go func() {
		body, err := request(next, "/")
		if err == nil && body != "ok" {
			err = fmt.Errorf("body %q", body)
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("a request was served beyond the limit while the only connection was busy: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("the busy request: %v", err)
	}
	// Now idle, the first connection makes room for the waiting one.
	if err := <-got; err != nil {
		t.Fatalf("the waiting request: %v", err)
	}
	if !closed(busy, time.Second) {
		t.Error("the idle connection was not closed to make room")
	}
}

func TestHTTPConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    HTTPConfig
		bad  int
	}{
		{"defaults", HTTPConfig{}, 0},
		{"negative timeouts", HTTPConfig{ReadTimeout: -1, WriteTimeout: -1, IdleTimeout: -1}, 3},
		{"negative max-conns", HTTPConfig{MaxConns: -1}, 1},
		{"huge max-conns", HTTPConfig{MaxConns: 1 << 20}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.h.ensureDefaults()
			if errs := tc.h.validate(); len(errs) != tc.bad {
				t.Errorf("%+v: %d errors %v, want %d", tc.h, len(errs), errs, tc.bad)
			}
		})
	}
}
