package sidecar

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"
)

// HTTPConfig bounds the metrics server's connections (/metrics, /healthz,
// /readyz, /debug/state): a client may neither keep connections open
// without end nor hold more than MaxConns of them, so that it can never
// take the descriptors the attach socket and the rings need.
type HTTPConfig struct {
	// ReadTimeout bounds reading one request, headers and body
	// (--metrics.read-timeout, default 10 s; the headers alone get at most
	// 5 s).
	ReadTimeout time.Duration
	// WriteTimeout bounds writing one response, from the end of its
	// request's headers (--metrics.write-timeout, default 30 s).
	WriteTimeout time.Duration
	// IdleTimeout closes a keep-alive connection that sends no request for
	// this long (--metrics.idle-timeout, default 30 s).
	IdleTimeout time.Duration
	// MaxConns bounds the open connections (--metrics.max-conns, default
	// 64). When they are all open, a new one closes the connection that
	// has waited longest for a request; one waits only while every
	// connection is in the middle of a request.
	MaxConns int
}

// Defaults of HTTPConfig.
const (
	DefaultMetricsReadTimeout  = 10 * time.Second
	DefaultMetricsWriteTimeout = 30 * time.Second
	DefaultMetricsIdleTimeout  = 30 * time.Second
	DefaultMetricsMaxConns     = 64
	metricsHeaderTimeout       = 5 * time.Second
)

func (h *HTTPConfig) ensureDefaults() {
	if h.ReadTimeout == 0 {
		h.ReadTimeout = DefaultMetricsReadTimeout
	}
	if h.WriteTimeout == 0 {
		h.WriteTimeout = DefaultMetricsWriteTimeout
	}
	if h.IdleTimeout == 0 {
		h.IdleTimeout = DefaultMetricsIdleTimeout
	}
	if h.MaxConns == 0 {
		h.MaxConns = DefaultMetricsMaxConns
	}
}

func (h *HTTPConfig) validate() []error {
	var errs []error
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"metrics.read-timeout", h.ReadTimeout}, {"metrics.write-timeout", h.WriteTimeout}, {"metrics.idle-timeout", h.IdleTimeout}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("--%s: %v must be positive", d.flag, d.v))
		}
	}
	if h.MaxConns < 0 || h.MaxConns > 1<<16 {
		errs = append(errs, fmt.Errorf("--metrics.max-conns: %d outside [1, 65536]", h.MaxConns))
	}
	return errs
}

// newHTTPServer is the metrics server with h's timeouts, serving ln
// through a connLimit of h.MaxConns.
func newHTTPServer(handler http.Handler, h HTTPConfig) (*http.Server, *connLimit) {
	lim := &connLimit{max: h.MaxConns, open: map[*limitedConn]struct{}{}, wake: make(chan struct{}, 1), done: make(chan struct{})}
	srv := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: min(metricsHeaderTimeout, h.ReadTimeout),
		ReadTimeout:       h.ReadTimeout,
		WriteTimeout:      h.WriteTimeout,
		IdleTimeout:       h.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
		ConnState:         lim.connState,
	}
	return srv, lim
}

// connLimit is a listener that keeps at most max connections open. When
// they are all open, the next accepted connection closes the one that has
// waited longest for a request (idle between keep-alive requests, or new
// and silent), so that a client holding many idle connections cannot lock
// out the probes or Prometheus. Only while every connection is in the
// middle of a request (each bounded by the read and write timeouts) does
// the new one wait, and the accepts behind it: then max+1 connections are
// open, and the rest wait in the kernel's backlog.
type connLimit struct {
	net.Listener
	max       int
	mu        sync.Mutex
	open      map[*limitedConn]struct{}
	wake      chan struct{} // a token when a connection closes or goes idle
	done      chan struct{} // closed by Close
	closeOnce sync.Once
}

type limitedConn struct {
	net.Conn
	l *connLimit
	// quiet is when the connection began to wait for a request; zero while
	// it serves one. Guarded by l.mu.
	quiet     time.Time
	closeOnce sync.Once
}

func (l *connLimit) listen(ln net.Listener) net.Listener {
	l.Listener = ln
	return l
}

// Accept returns the next connection once there is room for it.
func (l *connLimit) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	lc := &limitedConn{Conn: c, l: l, quiet: time.Now()}
	for {
		l.mu.Lock()
		if len(l.open) < l.max {
			l.open[lc] = struct{}{}
			l.mu.Unlock()
			return lc, nil
		}
		var victim *limitedConn
		for o := range l.open {
			if !o.quiet.IsZero() && (victim == nil || o.quiet.Before(victim.quiet)) {
				victim = o
			}
		}
		if victim != nil {
			delete(l.open, victim)
		}
		l.mu.Unlock()
		if victim != nil {
			// Its server goroutine sees the read fail and closes it.
			victim.Conn.Close()
			continue
		}
		select {
		case <-l.wake:
		case <-l.done:
			c.Close()
			return nil, net.ErrClosed
		}
	}
}

// Close stops Accept, including one waiting for room.
func (l *connLimit) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	err := l.Listener.Close()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// connState follows each connection between requests (http.Server's
// ConnState hook).
func (l *connLimit) connState(c net.Conn, st http.ConnState) {
	lc, ok := c.(*limitedConn)
	if !ok {
		return
	}
	l.mu.Lock()
	switch st {
	case http.StateActive:
		lc.quiet = time.Time{}
	case http.StateIdle:
		lc.quiet = time.Now()
	}
	l.mu.Unlock()
	if st == http.StateIdle {
		l.wakeAccept() // an Accept waiting for room may close it now
	}
}

// wakeAccept lets an Accept waiting for room look again.
func (l *connLimit) wakeAccept() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.closeOnce.Do(func() {
		c.l.mu.Lock()
		delete(c.l.open, c)
		c.l.mu.Unlock()
		c.l.wakeAccept()
	})
	return err
}
