// Package cuda is ringside's only contact with the CUDA driver API. It loads
// libcuda.so.1 with dlopen at run time and declares, in its cgo preamble,
// only the driver types and entry points it calls: there is no cuda.h, no
// CUDA toolkit at build time and no link-time dependency on libcuda, so a
// binary built here (CGO_ENABLED=1, gcc only) starts on machines without a
// GPU and reports the driver as unavailable. Without cgo (or off Linux) the
// same API exists and every call fails with ErrUnavailable.
//
// Entry points are resolved once, at Init: cuInit, cuGetErrorName/String
// and cuGetProcAddress with dlsym, everything else through
// cuGetProcAddress(name, version) so that the driver hands out the ABI
// version these declarations were written for (12.0 for the classic API,
// 12.8 for cuMemcpyBatchAsync, whose 12.8 form still takes failIdx).
// Unlike the go-nvml pattern (prototypes linked with
// --unresolved-symbols=ignore-in-object-files), the preamble keeps an
// explicit function-pointer table: a call before a successful Init returns
// an error instead of jumping to an unresolved symbol, and no linker flags
// are needed. All dl calls run inside one C call on a goroutine locked to
// its OS thread (dlerror is thread-local).
//
// CUDA contexts are per OS thread: callers that use a Context call
// SetCurrent on a goroutine locked with runtime.LockOSThread and keep
// issuing their calls from it (the gpu package runs one such goroutine per
// device). Handles (Context, Stream, Event) are opaque integers; device
// addresses are DevicePtr; host addresses are passed as integers so that no
// Go pointer reaches an asynchronous copy.
package cuda

import (
	"errors"
	"fmt"
)

// ErrUnavailable: no usable CUDA driver or device (library missing, no
// device, driver too old, or a build without cgo). Init's error wraps it.
var ErrUnavailable = errors.New("cuda: unavailable")

// Result is a CUresult. Every failed driver call returns one (as error).
type Result int32

// CUresult values this package and its callers test for.
const (
	Success                          Result = 0
	ErrorInvalidValue                Result = 1
	ErrorOutOfMemory                 Result = 2
	ErrorNotInitialized              Result = 3
	ErrorStubLibrary                 Result = 34
	ErrorNoDevice                    Result = 100
	ErrorInvalidDevice               Result = 101
	ErrorInvalidContext              Result = 201
	ErrorMapFailed                   Result = 205
	ErrorAlreadyMapped               Result = 208
	ErrorECCUncorrectable            Result = 214
	ErrorNVLinkUncorrectable         Result = 220
	ErrorInvalidHandle               Result = 400
	ErrorNotFound                    Result = 500
	ErrorNotReady                    Result = 600
	ErrorIllegalAddress              Result = 700
	ErrorHostMemoryAlreadyRegistered Result = 712
	ErrorHostMemoryNotRegistered     Result = 713
	ErrorHardwareStackError          Result = 714
	ErrorIllegalInstruction          Result = 715
	ErrorMisalignedAddress           Result = 716
	ErrorInvalidAddressSpace         Result = 717
	ErrorInvalidPC                   Result = 718
	ErrorLaunchFailed                Result = 719
	ErrorNotPermitted                Result = 800
	ErrorNotSupported                Result = 801
	ErrorUnknown                     Result = 999
	// ErrorNotLoaded is not a driver code: the entry point was called
	// before a successful Init, or the driver does not export it.
	ErrorNotLoaded Result = -1
)

var names = map[Result]string{
	Success: "CUDA_SUCCESS", ErrorInvalidValue: "CUDA_ERROR_INVALID_VALUE",
	ErrorOutOfMemory: "CUDA_ERROR_OUT_OF_MEMORY", ErrorNotInitialized: "CUDA_ERROR_NOT_INITIALIZED",
	ErrorStubLibrary: "CUDA_ERROR_STUB_LIBRARY", ErrorNoDevice: "CUDA_ERROR_NO_DEVICE",
	ErrorInvalidDevice: "CUDA_ERROR_INVALID_DEVICE", ErrorInvalidContext: "CUDA_ERROR_INVALID_CONTEXT",
	ErrorMapFailed: "CUDA_ERROR_MAP_FAILED", ErrorAlreadyMapped: "CUDA_ERROR_ALREADY_MAPPED",
	ErrorECCUncorrectable: "CUDA_ERROR_ECC_UNCORRECTABLE", ErrorNVLinkUncorrectable: "CUDA_ERROR_NVLINK_UNCORRECTABLE",
	ErrorInvalidHandle: "CUDA_ERROR_INVALID_HANDLE", ErrorNotFound: "CUDA_ERROR_NOT_FOUND",
	ErrorNotReady: "CUDA_ERROR_NOT_READY", ErrorIllegalAddress: "CUDA_ERROR_ILLEGAL_ADDRESS",
	ErrorHostMemoryAlreadyRegistered: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
	ErrorHostMemoryNotRegistered:     "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
	ErrorHardwareStackError:          "CUDA_ERROR_HARDWARE_STACK_ERROR",
	ErrorIllegalInstruction:          "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	ErrorMisalignedAddress:           "CUDA_ERROR_MISALIGNED_ADDRESS",
	ErrorInvalidAddressSpace:         "CUDA_ERROR_INVALID_ADDRESS_SPACE",
	ErrorInvalidPC:                   "CUDA_ERROR_INVALID_PC", ErrorLaunchFailed: "CUDA_ERROR_LAUNCH_FAILED",
	ErrorNotPermitted: "CUDA_ERROR_NOT_PERMITTED", ErrorNotSupported: "CUDA_ERROR_NOT_SUPPORTED",
	ErrorUnknown: "CUDA_ERROR_UNKNOWN", ErrorNotLoaded: "entry point not loaded",
}

// Error names the code, with the driver's description when it is loaded.
func (r Result) Error() string {
	name, desc := describe(r)
	if name == "" {
		name = names[r]
	}
	if name == "" {
		name = fmt.Sprintf("CUresult %d", int32(r))
	} else {
		name = fmt.Sprintf("%s (%d)", name, int32(r))
	}
	if desc != "" {
		return "cuda: " + name + ": " + desc
	}
	return "cuda: " + name
}

// Sticky reports whether err carries a CUresult after which the context is
// unusable: the CUDA driver API documents CUDA_ERROR_ILLEGAL_ADDRESS (700),
// CUDA_ERROR_HARDWARE_STACK_ERROR (714), CUDA_ERROR_ILLEGAL_INSTRUCTION
// (715), CUDA_ERROR_MISALIGNED_ADDRESS (716),
// CUDA_ERROR_INVALID_ADDRESS_SPACE (717), CUDA_ERROR_INVALID_PC (718) and
// CUDA_ERROR_LAUNCH_FAILED (719) as leaving "the process in an inconsistent
// state and any further CUDA work will return the same error"; the
// process must be terminated and relaunched. CUDA_ERROR_UNKNOWN (999),
// CUDA_ERROR_ECC_UNCORRECTABLE (214: "an uncorrectable ECC error was
// detected during execution") and CUDA_ERROR_NVLINK_UNCORRECTABLE (220:
// "an uncorrectable NVLink error was detected during the execution") are
// treated the same way: the documentation does not say what state they
// leave, and a hardware fault does not go away for the next call.
func Sticky(err error) bool {
	var r Result
	if !errors.As(err, &r) {
		return false
	}
	switch r {
	case ErrorIllegalAddress, ErrorHardwareStackError, ErrorIllegalInstruction, ErrorMisalignedAddress,
		ErrorInvalidAddressSpace, ErrorInvalidPC, ErrorLaunchFailed, ErrorUnknown,
		ErrorECCUncorrectable, ErrorNVLinkUncorrectable:
		return true
	}
	return false
}

// Code returns the CUresult err carries, or Success if it carries none.
func Code(err error) Result {
	var r Result
	if errors.As(err, &r) {
		return r
	}
	return Success
}

// result turns a CUresult into nil or a Result error.
func result(r Result) error {
	if r == Success {
		return nil
	}
	return r
}

// DevicePtr is a device (or unified) virtual address in this process.
type DevicePtr uint64

// Context is a retained primary context (CUcontext), Stream a CUstream,
// Event a CUevent: opaque driver handles.
type (
	Context uintptr
	Stream  uintptr
	Event   uintptr
)

// Device is a CUdevice: a visible GPU.
type Device int32

// IPCHandle is a cudaIpcMemHandle_t / CUipcMemHandle.
type IPCHandle [64]byte

// IPCEventHandle is a cudaIpcEventHandle_t / CUipcEventHandle.
type IPCEventHandle [64]byte

// MemHandle is a CUmemGenericAllocationHandle: a virtual memory
// management allocation (cuMemCreate, or imported from another process).
type MemHandle uint64

// Handle types an allocation may be exported as (CUmemAllocationHandleType
// bits, MemCreate's handleTypes).
const (
	HandleTypeNone    = 0x0 // CU_MEM_HANDLE_TYPE_NONE
	HandleTypePOSIXFD = 0x1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	HandleTypeFabric  = 0x8 // CU_MEM_HANDLE_TYPE_FABRIC
)

// Pointer attributes (CUpointer_attribute) for PointerAttribute.
const (
	AttrLegacyIPCCapable   = 10 // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE (int)
	AttrRangeStartAddr     = 11 // CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: the reservation (VMM)
	AttrRangeSize          = 12 // CU_POINTER_ATTRIBUTE_RANGE_SIZE
	AttrMapped             = 13 // CU_POINTER_ATTRIBUTE_MAPPED (int)
	AttrAllowedHandleTypes = 14 // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: HandleType* bits
	AttrMappingSize        = 18 // CU_POINTER_ATTRIBUTE_MAPPING_SIZE: the mapping (VMM)
	AttrMappingBaseAddr    = 19 // CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR
)

// UUID is a CUuuid.
type UUID [16]byte

func (u UUID) String() string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// Dir is the direction of a host<->device copy.
type Dir int

const (
	// HtoD copies from (pinned) host memory to device memory.
	HtoD Dir = iota
	// DtoH copies from device memory to (pinned) host memory.
	DtoH
)

// Host-registration flags (CU_MEMHOSTREGISTER_*).
const (
	HostRegisterPortable  = 0x01
	HostRegisterDeviceMap = 0x02
)

// MaxBatch caps the descriptors of one cuMemcpyBatchAsync call; a larger
// copy list is issued as several calls on the same stream.
const MaxBatch = 8192

// Device attributes (CUdevice_attribute) and compute modes (CUcomputemode).
const (
	AttrComputeMode = 20 // CU_DEVICE_ATTRIBUTE_COMPUTE_MODE

	ComputeDefault          = 0 // CU_COMPUTEMODE_DEFAULT
	ComputeProhibited       = 2 // CU_COMPUTEMODE_PROHIBITED
	ComputeExclusiveProcess = 3 // CU_COMPUTEMODE_EXCLUSIVE_PROCESS
)

// Unlimited is RLIM_INFINITY as MemlockLimit reports it.
const Unlimited = ^uint64(0)
