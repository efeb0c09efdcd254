//go:build !cgo || !linux

package cuda

import (
	"fmt"
	"unsafe"
)

var errNoCgo = fmt.Errorf("%w: built without cgo (CGO_ENABLED=0) or not on Linux", ErrUnavailable)

// Init always fails: this build has no cgo (or is not Linux).
func Init() error { return errNoCgo }

func describe(Result) (string, string) { return "", "" }

// HasBatch is false without a driver.
func HasBatch() bool { return false }

// DriverVersion fails without a driver.
func DriverVersion() (int, error) { return 0, ErrorNotLoaded }

// DeviceCount fails without a driver.
func DeviceCount() (int, error) { return 0, ErrorNotLoaded }

// DeviceGet fails without a driver.
func DeviceGet(int) (Device, error) { return 0, ErrorNotLoaded }

// Name fails without a driver.
func (d Device) Name() (string, error) { return "", ErrorNotLoaded }

// UUID fails without a driver.
func (d Device) UUID() (UUID, error) { return UUID{}, ErrorNotLoaded }

// Attribute fails without a driver.
func (d Device) Attribute(int) (int, error) { return 0, ErrorNotLoaded }

// Retain fails without a driver.
func (d Device) Retain() (Context, error) { return 0, ErrorNotLoaded }

// Release fails without a driver.
func (d Device) Release() error { return ErrorNotLoaded }

// SetCurrent fails without a driver.
func (c Context) SetCurrent() error { return ErrorNotLoaded }

// StreamPriorityRange fails without a driver.
func StreamPriorityRange() (int, int, error) { return 0, 0, ErrorNotLoaded }

// IPCGetHandle fails without a driver.
func IPCGetHandle(DevicePtr) (IPCHandle, error) { return IPCHandle{}, ErrorNotLoaded }

// IPCOpen fails without a driver.
func IPCOpen(IPCHandle) (DevicePtr, error) { return 0, ErrorNotLoaded }

// IPCClose fails without a driver.
func IPCClose(DevicePtr) error { return ErrorNotLoaded }

// AddressRange fails without a driver.
func AddressRange(DevicePtr) (DevicePtr, uint64, error) { return 0, 0, ErrorNotLoaded }

// IPCCapable fails without a driver.
func IPCCapable(DevicePtr) (bool, error) { return false, ErrorNotLoaded }

// PointerAttribute fails without a driver.
func PointerAttribute(DevicePtr, int) (uint64, error) { return 0, ErrorNotLoaded }

// MemAlloc fails without a driver.
func MemAlloc(uint64) (DevicePtr, error) { return 0, ErrorNotLoaded }

// MemFree fails without a driver.
func MemFree(DevicePtr) error { return ErrorNotLoaded }

// Addr is the address of b[0] (0 when empty).
func Addr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

// HostRegister fails without a driver.
func HostRegister([]byte, uint) error { return ErrorNotLoaded }

// HostUnregister fails without a driver.
func HostUnregister([]byte) error { return ErrorNotLoaded }

// MemcpyHtoD fails without a driver.
func MemcpyHtoD(DevicePtr, []byte) error { return ErrorNotLoaded }

// MemcpyDtoH fails without a driver.
func MemcpyDtoH([]byte, DevicePtr) error { return ErrorNotLoaded }

// NewStream fails without a driver.
func NewStream(int) (Stream, error) { return 0, ErrorNotLoaded }

// Destroy fails without a driver.
func (s Stream) Destroy() error { return ErrorNotLoaded }

// Synchronize fails without a driver.
func (s Stream) Synchronize() error { return ErrorNotLoaded }

// NewEvent fails without a driver.
func NewEvent() (Event, error) { return 0, ErrorNotLoaded }

// Record fails without a driver.
func (e Event) Record(Stream) error { return ErrorNotLoaded }

// Query fails without a driver.
func (e Event) Query() (bool, error) { return true, ErrorNotLoaded }

// Destroy fails without a driver.
func (e Event) Destroy() error { return ErrorNotLoaded }

// NewIPCEvent fails without a driver.
func NewIPCEvent() (Event, error) { return 0, ErrorNotLoaded }

// IPCGetEventHandle fails without a driver.
func IPCGetEventHandle(Event) (IPCEventHandle, error) { return IPCEventHandle{}, ErrorNotLoaded }

// IPCOpenEvent fails without a driver.
func IPCOpenEvent(IPCEventHandle) (Event, error) { return 0, ErrorNotLoaded }

// WaitEvent fails without a driver.
func (s Stream) WaitEvent(Event) error { return ErrorNotLoaded }

// CopyAsync fails without a driver.
func CopyAsync(Dir, bool, []uint64, []uint64, []uint64, Stream) (int, int, error) {
	return 0, 0, ErrorNotLoaded
}

// HasVMM is false without a driver.
func HasVMM() bool { return false }

// MemGranularity fails without a driver.
func MemGranularity(Device) (uint64, error) { return 0, ErrorNotLoaded }

// MemCreate fails without a driver.
func MemCreate(Device, uint64, int) (MemHandle, error) { return 0, ErrorNotLoaded }

// Release fails without a driver.
func (h MemHandle) Release() error { return ErrorNotLoaded }

// MemAddressReserve fails without a driver.
func MemAddressReserve(uint64) (DevicePtr, error) { return 0, ErrorNotLoaded }

// MemAddressFree fails without a driver.
func MemAddressFree(DevicePtr, uint64) error { return ErrorNotLoaded }

// MemMap fails without a driver.
func MemMap(DevicePtr, uint64, MemHandle) error { return ErrorNotLoaded }

// MemUnmap fails without a driver.
func MemUnmap(DevicePtr, uint64) error { return ErrorNotLoaded }

// MemSetAccess fails without a driver.
func MemSetAccess(DevicePtr, uint64, Device) error { return ErrorNotLoaded }

// MemRetainHandle fails without a driver.
func MemRetainHandle(DevicePtr) (MemHandle, error) { return 0, ErrorNotLoaded }

// MemExportFD fails without a driver.
func MemExportFD(MemHandle) (int, error) { return -1, ErrorNotLoaded }

// MemImportFD fails without a driver.
func MemImportFD(int) (MemHandle, error) { return 0, ErrorNotLoaded }
