package replay

import (
	"fmt"
	"time"

	"github.com/ringside-kv/ringside/bench/internal/uds"
	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// caller sends one request record and returns its reply payload (valid
// until the next call). Both transports carry the very same records.
type caller interface {
	Call(typ uint16, payload []byte) ([]byte, error)
	Close() error
}

// ringCaller is a session's rings (connector.Client).
type ringCaller struct{ c *connector.Client }

func (r ringCaller) Call(typ uint16, payload []byte) ([]byte, error) {
	seq, err := r.c.Submit(typ, payload)
	if err != nil {
		return nil, err
	}
	return r.c.Await(seq)
}

func (r ringCaller) Close() error { return r.c.Close() }

// udsCaller is the Unix-socket baseline: frames to a relay process that
// forwards them over its own ring session.
type udsCaller struct{ c *uds.Client }

func (u udsCaller) Call(typ uint16, payload []byte) ([]byte, error) { return u.c.Call(typ, payload) }

func (u udsCaller) Close() error {
	u.c.Call(schema.TypeDetach, nil) // the relay ends on a Detach; no reply comes
	return u.c.Close()
}

// rpc encodes requests and decodes replies, as connector.Client does.
type rpc struct {
	c   caller
	buf []byte
}

func (r *rpc) simple(typ uint16, payload []byte) (uint64, error) {
	b, err := r.c.Call(typ, payload)
	if err != nil {
		return 0, err
	}
	var rep schema.Reply
	if err := rep.Decode(b); err != nil {
		return 0, err
	}
	return rep.Value, rep.Err()
}

func (r *rpc) putHashes(batch uint64, digests []byte, appendTo bool) error {
	m := schema.PutHashes{Batch: batch, Digests: digests}
	if appendTo {
		m.Flags = schema.FlagAppend
	}
	r.buf = m.Append(r.buf[:0], DigestWidth)
	_, err := r.simple(schema.TypePutHashes, r.buf)
	return err
}

func (r *rpc) dropHashes(batch uint64) error {
	r.buf = schema.IDRequest{ID: batch}.Append(r.buf[:0])
	_, err := r.simple(schema.TypeDropHashes, r.buf)
	return err
}

func (r *rpc) lookup(v schema.View) (int, error) {
	r.buf = (&schema.Lookup{View: v}).Append(r.buf[:0])
	n, err := r.simple(schema.TypeLookup, r.buf)
	return int(n), err
}

func (r *rpc) lease(typ uint16) (schema.LeaseReply, error) {
	var rep schema.LeaseReply
	b, err := r.c.Call(typ, r.buf)
	if err != nil {
		return rep, err
	}
	if err := rep.Decode(b); err != nil {
		return rep, err
	}
	if rep.Status != schema.OK {
		return rep, &schema.Error{Status: rep.Status, Message: rep.Message}
	}
	return rep, nil
}

func (r *rpc) acquire(v schema.View, ttl time.Duration) (schema.LeaseReply, error) {
	r.buf = (&schema.Acquire{View: v, TTLms: uint32(ttl / time.Millisecond)}).Append(r.buf[:0])
	return r.lease(schema.TypeAcquire)
}

func (r *rpc) poll(lease uint64) (schema.LeaseReply, error) {
	r.buf = schema.IDRequest{ID: lease}.Append(r.buf[:0])
	return r.lease(schema.TypePoll)
}

func (r *rpc) release(lease uint64) error {
	r.buf = schema.IDRequest{ID: lease}.Append(r.buf[:0])
	_, err := r.simple(schema.TypeRelease, r.buf)
	return err
}

// retain sends a Retain of view v: keep its leading present blocks for
// ttl at priority prio, or, with end, end the retentions set on them. It
// returns the blocks whose retention it set, renewed or ended.
func (r *rpc) retain(v schema.View, ttl time.Duration, prio uint8, end bool) (int, error) {
	m := schema.Retain{View: v}
	if end {
		m.Flags = schema.RetainFlagEnd
	} else {
		m.TTLms = uint32(max(1, (ttl+time.Millisecond-1)/time.Millisecond))
		m.Priority = prio
	}
	r.buf = m.Append(r.buf[:0])
	n, err := r.simple(schema.TypeRetain, r.buf)
	return int(n), err
}

func (r *rpc) registerRegion(m schema.RegisterRegion) error {
	r.buf = m.Append(r.buf[:0])
	_, err := r.simple(schema.TypeRegisterRegion, r.buf)
	return err
}

func (r *rpc) load(lease uint64, region, first uint32, pages []uint32) (int, error) {
	r.buf = (&schema.Load{Lease: lease, Region: region, First: first, Pages: pages}).Append(r.buf[:0])
	n, err := r.simple(schema.TypeLoad, r.buf)
	return int(n), err
}

func (r *rpc) store(v schema.View, region uint32, pages []uint32) (schema.StoreReply, error) {
	var rep schema.StoreReply
	r.buf = (&schema.Store{View: v, Region: region, Pages: pages}).Append(r.buf[:0])
	b, err := r.c.Call(schema.TypeStore, r.buf)
	if err != nil {
		return rep, err
	}
	if err := rep.Decode(b); err != nil {
		return rep, err
	}
	if rep.Status != schema.OK {
		return rep, &schema.Error{Status: rep.Status, Message: rep.Message}
	}
	return rep, nil
}

// changes reads the change log from a cursor; the reply's entries alias
// the transport's buffer until the next call.
func (r *rpc) changes(epoch, seq uint64) (schema.ChangesReply, error) {
	var rep schema.ChangesReply
	r.buf = (&schema.Changes{Epoch: epoch, Seq: seq}).Append(r.buf[:0])
	b, err := r.c.Call(schema.TypeChanges, r.buf)
	if err != nil {
		return rep, err
	}
	if err := rep.Decode(b); err != nil {
		return rep, err
	}
	if rep.Status != schema.OK {
		return rep, fmt.Errorf("changes: %w", &schema.Error{Status: rep.Status})
	}
	return rep, nil
}
