package cuda

import (
	"errors"
	"fmt"
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
	if HasVMM() {
		t.Error("HasVMM without a driver")
	}
	if _, err := MemCreate(0, 2<<20, HandleTypePOSIXFD); err == nil {
		t.Error("MemCreate succeeded without a driver")
	}
	if _, err := MemImportFD(0); err == nil {
		t.Error("MemImportFD succeeded without a driver")
	}
	if _, err := PointerAttribute(1, AttrAllowedHandleTypes); err == nil {
		t.Error("PointerAttribute succeeded without a driver")
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

// TestSticky: the codes after which the CUDA documentation says the
// process must be relaunched (and CUDA_ERROR_UNKNOWN, and the uncorrectable
// ECC and NVLink errors) are sticky, wrapped or not; per-op failures and
// non-driver errors are not.
func TestSticky(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{ErrorIllegalAddress, true},
		{Result(714), true},
		{Result(715), true},
		{Result(716), true},
		{Result(717), true},
		{Result(718), true},
		{ErrorLaunchFailed, true},
		{ErrorUnknown, true},
		{Result(214), true}, // CUDA_ERROR_ECC_UNCORRECTABLE
		{Result(220), true}, // CUDA_ERROR_NVLINK_UNCORRECTABLE
		{fmt.Errorf("enqueueing range 3 of 9: %w", ErrorIllegalAddress), true},
		{errors.Join(errors.New("recording"), fmt.Errorf("x: %w", Result(719))), true},
		{Success, false},
		{ErrorInvalidValue, false},
		{ErrorOutOfMemory, false},
		{ErrorNotReady, false},
		{ErrorMapFailed, false},
		{ErrorHostMemoryNotRegistered, false},
		{Result(713), false},
		{Result(215), false}, // CUDA_ERROR_UNSUPPORTED_LIMIT
		{Result(219), false}, // CUDA_ERROR_INVALID_GRAPHICS_CONTEXT
		{Result(720), false},
		{ErrorNotLoaded, false},
		{errors.New("cuda: CUDA_ERROR_ILLEGAL_ADDRESS (700)"), false},
		{nil, false},
	} {
		if got := Sticky(tc.err); got != tc.want {
			t.Errorf("Sticky(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	if c := Code(fmt.Errorf("a: %w", ErrorInvalidPC)); c != ErrorInvalidPC {
		t.Errorf("Code = %d, want 718", c)
	}
	if c := Code(errors.New("plain")); c != Success {
		t.Errorf("Code of a plain error = %d, want 0", c)
	}
	if got := ErrorMisalignedAddress.Error(); !strings.Contains(got, "CUDA_ERROR_MISALIGNED_ADDRESS (716)") {
		t.Errorf("716 reads %q", got)
	}
	if got := Result(214).Error(); !strings.Contains(got, "CUDA_ERROR_ECC_UNCORRECTABLE (214)") {
		t.Errorf("214 reads %q", got)
	}
	if got := Result(220).Error(); !strings.Contains(got, "CUDA_ERROR_NVLINK_UNCORRECTABLE (220)") {
		t.Errorf("220 reads %q", got)
	}
}
