package uds

import (
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/schema"
)

// RelayConfig is the command line of a socket front end (the hidden
// `ringside-bench poll-relay` and `ringside-bench replay-relay`).
type RelayConfig struct {
	Sidecar  string // the sidecar's attach socket
	Listen   string // the Unix socket to serve frames on
	Instance string // engine instance, model and layout: those of the bench client, so
	Model    string // that its leases and batches are visible to the relay's session
	Layout   string
	Timeout  time.Duration // bound on waiting for the client and on every call
	Ready    io.Writer     // gets "ready\n" once the socket listens
	// Regions are shared-memory files that the relay maps and registers
	// as its own memory before it is ready: the sidecar accepts only a
	// session's own process memory, so engine memory that the socket
	// client loads into and stores from lives in a file both map.
	Regions []RegionFile
}

// RegionFile is engine memory in a shared-memory file.
type RegionFile struct {
	ID        uint32
	Path      string
	PageBytes int
	Pages     int
}

// ParseRegion parses "ID:PAGE_BYTES:PAGES:PATH".
func ParseRegion(s string) (RegionFile, error) {
	var r RegionFile
	var path string
	n, err := fmt.Sscanf(s, "%d:%d:%d:%s", &r.ID, &r.PageBytes, &r.Pages, &path)
	if err != nil || n != 4 || r.PageBytes <= 0 || r.Pages <= 0 || path == "" {
		return r, fmt.Errorf("region %q: want ID:PAGE_BYTES:PAGES:PATH", s)
	}
	r.Path = path
	return r, nil
}

// String is the form ParseRegion reads.
func (r RegionFile) String() string {
	return fmt.Sprintf("%d:%d:%d:%s", r.ID, r.PageBytes, r.Pages, r.Path)
}

// Relay is the socket baseline's front end. The sidecar has no socket
// transport of its own and its request dispatcher is reachable only through
// a session's rings, so the front end is a relay process: it attaches to
// the sidecar as a session of the bench client's engine instance, accepts
// one socket connection and, for every frame, submits the record unchanged
// on its ring and sends the reply record back unchanged, with the client's
// correlation number. A socket round trip through the relay therefore costs
// the ring round trip plus the socket's own round trip.
func Relay(rc RelayConfig) error {
	if rc.Timeout <= 0 {
		rc.Timeout = time.Minute
	}
	if rc.Ready == nil {
		rc.Ready = io.Discard
	}
	c, err := connector.Dial(connector.Options{Socket: rc.Sidecar, Instance: rc.Instance, Model: rc.Model, Layout: rc.Layout, Timeout: rc.Timeout})
	if err != nil {
		return err
	}
	defer c.Close()
	for _, r := range rc.Regions {
		m, err := shm.Open(r.Path, r.PageBytes*r.Pages)
		if err != nil {
			return fmt.Errorf("relay: region %d: %w", r.ID, err)
		}
		defer m.Close()
		mem := m.Bytes()[:r.PageBytes*r.Pages]
		err = c.RegisterRegion(schema.RegisterRegion{
			Region: r.ID, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
			Base: shm.Addr(mem), Length: uint64(len(mem)),
			PageSize: uint64(r.PageBytes), PageCount: uint32(r.Pages),
		})
		if err != nil {
			return fmt.Errorf("relay: register region %d: %w", r.ID, err)
		}
	}
	lfd, err := Listen(rc.Listen)
	if err != nil {
		return err
	}
	defer os.Remove(rc.Listen)
	defer CloseListener(lfd)
	harness.SayReady(rc.Ready)
	fc, err := Accept(lfd, rc.Timeout)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	defer fc.Close()
	for {
		typ, seq, payload, err := fc.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("relay: read: %w", err)
		}
		if typ == schema.TypeDetach {
			return nil // the relay's own session detaches on return
		}
		s, err := c.Submit(typ, payload)
		if err != nil {
			return fmt.Errorf("relay: submit: %w", err)
		}
		reply, err := c.Await(s)
		if err != nil {
			return fmt.Errorf("relay: await: %w", err)
		}
		if err := fc.Write(typ|schema.ReplyBit, 0, seq, reply); err != nil {
			return fmt.Errorf("relay: write: %w", err)
		}
	}
}
