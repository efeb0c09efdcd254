package host

import (
	"errors"
	"testing"

	"github.com/ringside-kv/ringside/gpu"
)

func TestRouter(t *testing.T) {
	h := newHost(t, make([]byte, 4096))
	r := gpu.NewRouter(h)
	if r.Name() != "host" || !r.Supports(gpu.HostShared) || r.Supports(gpu.CUDAIPC) || !gpu.Supports(r, gpu.HostProcess) {
		t.Fatalf("router %s supports the wrong kinds", r.Name())
	}
	if _, err := r.Register(validCUDA()); !errors.Is(err, gpu.ErrUnsupported) {
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
	_, err = gpu.Do(r, gpu.Op{Dir: gpu.EngineToPool, Region: h2, Pages: []uint32{9}, PoolOffsets: []uint64{0}})
	var ce *gpu.CopyError
	if !errors.As(err, &ce) || ce.Region != h2 || !errors.Is(err, gpu.ErrOutOfBounds) {
		t.Errorf("out-of-bounds op via router: %v", err)
	}
	if _, err := gpu.Do(r, gpu.Op{Dir: gpu.EngineToPool, Region: h2, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); err != nil {
		t.Fatal(err)
	}
	if _, err := gpu.Do(r, gpu.Op{Dir: gpu.EngineToPool, Region: h1, Pages: []uint32{1}, PoolOffsets: []uint64{0}}); !errors.Is(err, gpu.ErrUnknownRegion) {
		t.Errorf("op on unregistered handle: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := gpu.Do(r, gpu.Op{Dir: gpu.EngineToPool, Region: h2}); err == nil {
		t.Error("Submit after Close succeeded")
	}
}
