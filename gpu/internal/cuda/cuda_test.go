package cuda

import (
	"errors"
	"os"
	"strings"
	"testing"
)

// TestInitWithoutGPU: on a machine without a driver or device, Init fails
// with ErrUnavailable and every entry point fails instead of crashing.
func TestInitWithoutGPU(t *testing.T) {
	err := Init()
	if err == nil {
		n, _ := DeviceCount()
		t.Logf("CUDA available: %d device(s), batch copies %v", n, HasBatch())
		return
	}
	if os.Getenv("RINGSIDE_REQUIRE_GPU") == "1" {
		t.Fatalf("RINGSIDE_REQUIRE_GPU=1 but CUDA is unavailable: %v", err)
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Init = %v, want ErrUnavailable", err)
	}
	if err2 := Init(); err2 != err {
		t.Errorf("second Init = %v, want the same error", err2)
	}
	t.Logf("Init: %v", err)
	if _, err := MemAlloc(1); err == nil {
		t.Error("MemAlloc succeeded without a driver")
	}
	if _, _, err := CopyAsync(HtoD, true, []uint64{1}, []uint64{2}, []uint64{3}, 0); err == nil {
		t.Error("CopyAsync succeeded without a driver")
	}
	if done, err := Event(0).Query(); !done || err == nil {
		t.Errorf("Query = %v, %v; want done with an error", done, err)
	}
	if HasBatch() {
		t.Error("HasBatch without a driver")
	}
	if _, err := IPCOpenEvent(IPCEventHandle{1}); err == nil {
		t.Error("IPCOpenEvent succeeded without a driver")
	}
	if err := Stream(0).WaitEvent(1); err == nil {
		t.Error("WaitEvent succeeded without a driver")
	}
}

func TestResultError(t *testing.T) {
	for _, tc := range []struct {
		r    Result
		want string
	}{
		{ErrorInvalidValue, "CUDA_ERROR_INVALID_VALUE (1)"},
		{ErrorInvalidContext, "(201)"},
		{Result(12345), "CUresult 12345"},
		{ErrorNotLoaded, "(-1)"},
	} {
		if got := tc.r.Error(); !strings.Contains(got, tc.want) {
			t.Errorf("%d: %q does not contain %q", int32(tc.r), got, tc.want)
		}
	}
	u := UUID{0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	if got, want := u.String(), "GPU-deadbeef-0102-0304-0506-0708090a0b0c"; got != want {
		t.Errorf("UUID = %s, want %s", got, want)
	}
	if _, _, err := MemlockLimit(); err != nil {
		t.Logf("MemlockLimit: %v", err)
	}
}
