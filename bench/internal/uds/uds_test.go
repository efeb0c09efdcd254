package uds

import (
	"bytes"
	"path/filepath"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/schema"
)

// TestFramesRoundTrip serves frames from a goroutine: every request comes
// back as its reply type with the client's sequence number, across sizes
// that straddle the read buffer.
func TestFramesRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f.sock")
	lfd, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseListener(lfd)
	done := make(chan error, 1)
	go func() {
		c, err := Accept(lfd, 10*time.Second)
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		for {
			typ, seq, p, err := c.Read()
			if err != nil {
				done <- nil // the client closed
				return
			}
			if err := c.Write(typ|schema.ReplyBit, 0, seq, p); err != nil {
				done <- err
				return
			}
		}
	}()
	cl, err := Dial(path, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{0, 1, 100, 64 << 10, 200 << 10} {
		p := bytes.Repeat([]byte{byte(n)}, n)
		got, err := cl.Call(schema.TypePing, p)
		if err != nil || !bytes.Equal(got, p) {
			t.Fatalf("%d bytes: got %d bytes, %v", n, len(got), err)
		}
	}
	cl.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestParseRegion(t *testing.T) {
	r := RegionFile{ID: 3, Path: "/dev/shm/x/engine0.kv", PageBytes: 4096, Pages: 17}
	got, err := ParseRegion(r.String())
	if err != nil || got != r {
		t.Fatalf("%q: %+v, %v", r.String(), got, err)
	}
	for _, bad := range []string{"", "1:2:3", "1:0:3:/p", "x:1:1:/p"} {
		if _, err := ParseRegion(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
