package pollbench

import (
	"time"

	"github.com/ringside-kv/ringside/bench/internal/uds"
	"github.com/ringside-kv/ringside/schema"
)

// The socket baseline (framing, client and relay) lives in
// bench/internal/uds, shared with `ringside-bench replay`.

// RelayConfig is the command line of the socket front end (the hidden
// `ringside-bench poll-relay`).
type RelayConfig = uds.RelayConfig

// Relay is the socket baseline's front end: see uds.Relay.
func Relay(rc RelayConfig) error { return uds.Relay(rc) }

// udsClient is the Go client of the socket baseline: the same Poll record
// and the same reply record as connector.Client.Poll, framed on a socket.
type udsClient struct {
	c   *uds.Client
	req []byte
}

func dialUDS(path string, timeout time.Duration) (*udsClient, error) {
	c, err := uds.Dial(path, timeout)
	if err != nil {
		return nil, err
	}
	return &udsClient{c: c}, nil
}

func (u *udsClient) close() error { return u.c.Close() }

func (u *udsClient) poll(lease uint64) (schema.LeaseReply, error) {
	var r schema.LeaseReply
	u.req = schema.IDRequest{ID: lease}.Append(u.req[:0])
	p, err := u.c.Call(schema.TypePoll, u.req)
	if err != nil {
		return r, err
	}
	if err := r.Decode(p); err != nil {
		return r, err
	}
	if r.Status != schema.OK {
		return r, &schema.Error{Status: r.Status, Message: r.Message}
	}
	return r, nil
}
