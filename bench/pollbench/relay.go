package pollbench

import (
	"errors"
	"fmt"
	"github.com/ringside-kv/ringside/internal/sys"
	"io"
	"os"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// RelayConfig is the command line of the socket front end (the hidden
// `ringside bench poll-relay`).
type RelayConfig struct {
	Sidecar  string // the sidecar's attach socket
	Listen   string // the Unix socket to serve frames on
	Instance string // engine instance, model and layout: those of the bench client, so
	Model    string // that its leases are visible to the relay's session
	Layout   string
	Timeout  time.Duration // bound on waiting for the client and on every call
	Ready    io.Writer     // gets "ready\n" once the socket listens
}

// Relay is the socket baseline's front end. The sidecar has no socket
// transport of its own and its request dispatcher is reachable only through
// a session's rings, so the front end is a relay process: it attaches to
// the sidecar as a session of the bench client's engine instance, accepts
// one socket connection and, for every frame, submits the record unchanged
// on its ring and sends the reply record back unchanged, with the client's
// correlation number. A socket round trip through the relay therefore costs
// the ring round trip plus the socket's own round trip; the difference
// between the uds and the ring rows is the socket's cost.
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
	lfd, err := listenUDS(rc.Listen)
	if err != nil {
		return err
	}
	defer os.Remove(rc.Listen)
	defer sys.Close(lfd)
	fmt.Fprintln(rc.Ready, "ready")
	fd, err := acceptUDS(lfd, rc.Timeout)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	fc, err := newFrameConn(fd, rc.Timeout)
	if err != nil {
		sys.Close(fd)
		return err
	}
	defer fc.close()
	for {
		typ, seq, payload, err := fc.read()
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
		if err := fc.write(typ|schema.ReplyBit, 0, seq, reply); err != nil {
			return fmt.Errorf("relay: write: %w", err)
		}
	}
}
