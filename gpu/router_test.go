package gpu

import (
	"errors"
	"testing"
)

func TestSplitRanges(t *testing.T) {
	rs := []Range{{Pool: 0, Engine: 100, Len: 10}, {Pool: 14, Engine: 200, Len: 20}, {Pool: 40, Engine: 300, Len: 8}}
	got := splitRanges(append([]Range(nil), rs...), 16, 64)
	want := []Range{{0, 100, 10}, {14, 200, 2}, {16, 202, 16}, {32, 218, 2}, {40, 300, 8}}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
	if got := splitRanges(rs, 64, 64); len(got) != 3 {
		t.Errorf("pool within one chunk: %v", got)
	}
}

func TestRouter(t *testing.T) {
	h := newHost(t, make([]byte, 4096))
	r := NewRouter(h)
	if r.Name() != "host" || !r.Supports(HostShared) || r.Supports(CUDAIPC) || !Supports(r, HostProcess) {
		t.Fatalf("router %s supports the wrong kinds", r.Name())
	}
	if _, err := r.Register(validCUDA()); !errors.Is(err, ErrUnsupported) {
		t.Errorf("Register(CUDAIPC) = %v, want ErrUnsupported", err)
	}
	h1, err := r.Register(validShared())
	if err != nil {
		t.Fatal(err)
	}
	h2, err := r.Register(validShared())
	if err != nil || h2 == h1 {
		t.Fatalf("second Register = %d, %v", h2, err)
	}
	if err := r.Unregister(h1); err != nil {
		t.Fatal(err)
	}
	_, err = Do(r, Op{Dir: EngineToPool, Region: h2, Pages: []uint32{9}, PoolOffsets: []uint64{0}})
	var ce *CopyError
	if !errors.As(err, &ce) || ce.Region != h2 || !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("out-of-bounds op via router: %v", err)
	}
	if _, err := Do(r, Op{Dir: EngineToPool, Region: h2, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatal(err)
	}
	if _, err := Do(r, Op{Dir: EngineToPool, Region: h1, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("op on unregistered handle: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Do(r, Op{Dir: EngineToPool, Region: h2}); err == nil {
		t.Error("Submit after Close succeeded")
	}
}

// TestCUDAUnavailable: without a driver NewCUDA fails cleanly with
// ErrCUDAUnavailable (the conformance suite in gputest covers the rest).
func TestCUDAUnavailable(t *testing.T) {
	c, err := NewCUDA(make([]byte, 4096), CUDAOptions{})
	if err == nil {
		c.Close()
		t.Skip("a CUDA driver is present")
	}
	if !errors.Is(err, ErrCUDAUnavailable) {
		t.Fatalf("NewCUDA = %v, want ErrCUDAUnavailable", err)
	}
	t.Log(err)
}
