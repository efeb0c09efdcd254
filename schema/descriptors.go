package schema

// GPU memory shared by POSIX file descriptors (added within version 3,
// docs/protocol.md section 5.5.2). Virtual memory management allocations
// (cuMemCreate: vLLM 0.34's extensible KV cache) cannot be exported with a
// legacy CUDA IPC handle; each is exported as a file descriptor instead
// (cuMemExportToShareableHandle), and descriptors cannot travel through a
// ring. Such a region is registered with one RegionDescriptors message on
// a connection of its own to the attach socket, which carries the
// descriptors (SCM_RIGHTS) and names each of them; the sidecar answers on
// that connection with a RegionDescriptorsReply and closes it. A sidecar
// that predates the message reads it as an AttachRequest with a wrong
// magic and answers with an AttachReply of status 1: the client learns
// that descriptors are not understood, and its session is untouched.

// Magics of the descriptor messages on the attach socket.
const (
	DescriptorsMagic      uint32 = 0x44465352 // "RSFD"
	DescriptorsReplyMagic uint32 = 0x4b465352 // "RSFK"
)

// MaxDescriptors is the most descriptors one RegionDescriptors message
// carries (and so the most allocations of an FDExtra): Linux's SCM_MAX_FD,
// the most one sendmsg passes.
const MaxDescriptors = 253

// The extra bytes of a RegionCUDAFD region: the GPU, an optional
// interprocess CUDA event that stores wait for, and every allocation the
// region's segments lie in, each naming the descriptor of the message that
// carries it.
//
//	 0 u8[16] GPU UUID   16 u32 flags (CUDAExtraFlagEvent)   20 u32 allocation count n
//	24 u8[64] cudaIpcEventHandle_t (zero without CUDAExtraFlagEvent)
//	88 n × (u32 descriptor index, u32 zero, u64 base, u64 size)
//
//wire:struct FDExtra "<16sII64s" gpu flags count(allocations) event size=FDExtraHeaderSize
//wire:struct FDAllocation "<IIQQ" index _ base size size=FDAllocationSize
const (
	FDExtraHeaderSize = 88
	FDAllocationSize  = 24
)

// FDAllocation is one allocation of the engine shared by descriptor: Index
// is the position of its descriptor in the message's SCM_RIGHTS array;
// the engine maps the allocation whole (Size bytes) at Base, so a segment
// at engine address a lies at offset a - Base in it.
type FDAllocation struct {
	Index uint32
	Base  uint64
	Size  uint64
}

// FDExtra is RegisterRegion's extra bytes for RegionCUDAFD.
type FDExtra struct {
	GPU         [16]byte
	Flags       uint32
	Event       [64]byte
	Allocations []FDAllocation
}

// Append encodes m.
func (m *FDExtra) Append(dst []byte) []byte {
	w := writer{dst}
	w.raw(m.GPU[:])
	w.u32(m.Flags)
	w.u32(uint32(len(m.Allocations)))
	w.raw(m.Event[:])
	for _, a := range m.Allocations {
		w.u32(a.Index)
		w.u32(0)
		w.u64(a.Base)
		w.u64(a.Size)
	}
	return w.b
}

// Decode parses m: unknown flags, no allocation or more than
// MaxDescriptors, an event handle without its flag, a descriptor index
// that is not below the allocation count or that two allocations name, a
// non-zero reserved word, an allocation of size zero or whose base + size
// overflows, and trailing bytes are malformed. So the indexes name each of
// the n descriptors exactly once. Whether the allocations overlap or hold
// the region is the copy engine's to check.
func (m *FDExtra) Decode(b []byte) error {
	r := reader{b: b, what: "CUDA descriptor extra"}
	copy(m.GPU[:], r.bytes(16))
	m.Flags = r.u32()
	n := r.u32()
	copy(m.Event[:], r.bytes(64))
	switch {
	case r.err != nil:
	case m.Flags&^CUDAExtraFlagEvent != 0:
		r.fail("unknown flags %#x", m.Flags)
	case n == 0 || n > MaxDescriptors:
		r.fail("%d allocations, want 1 to %d", n, MaxDescriptors)
	case m.Flags&CUDAExtraFlagEvent == 0 && m.Event != [64]byte{}:
		r.fail("an event handle without the event flag")
	}
	m.Allocations = m.Allocations[:0]
	var seen [MaxDescriptors]bool
	for i := 0; i < int(n) && r.err == nil; i++ {
		var a FDAllocation
		a.Index = r.u32()
		z := r.u32()
		a.Base, a.Size = r.u64(), r.u64()
		switch {
		case r.err != nil:
		case a.Index >= n:
			r.fail("allocation %d: descriptor index %d, the message carries %d", i, a.Index, n)
		case seen[a.Index]:
			r.fail("allocation %d: descriptor index %d is named twice", i, a.Index)
		case z != 0:
			r.fail("allocation %d: reserved word %#x, not zero", i, z)
		case a.Size == 0 || a.Base+a.Size < a.Base:
			r.fail("allocation %d: base %#x size %d", i, a.Base, a.Size)
		default:
			seen[a.Index] = true
		}
		m.Allocations = append(m.Allocations, a)
	}
	return r.done()
}

// RegionDescriptors registers a RegionCUDAFD region of an attached
// session, on a connection of its own to the attach socket; the message
// carries the descriptors of the region's allocations (SCM_RIGHTS), as
// many as its FDExtra names. Only the process that attached the session
// may send it (SO_PEERCRED).
//
//	 0 u32 magic "RSFD"   4 u16 version   6 u16 zero
//	 8 u64 session id (AttachReply)   16 u64 epoch (AttachReply)
//	24 a RegisterRegion of kind RegionCUDAFD (its extra an FDExtra), to the end
//
//wire:struct RegionDescriptors "<IHHQQ" DescriptorsMagic version _ session epoch size=RegionDescriptorsHeaderSize
type RegionDescriptors struct {
	Version uint16
	Session uint64
	Epoch   uint64
	Region  RegisterRegion
}

// RegionDescriptorsHeaderSize is the bytes before the RegisterRegion.
const RegionDescriptorsHeaderSize = 24

// Append encodes m.
func (m *RegionDescriptors) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(DescriptorsMagic)
	w.u16(m.Version)
	w.u16(0)
	w.u64(m.Session)
	w.u64(m.Epoch)
	return m.Region.Append(w.b)
}

// Decode parses m: the magic, and a RegisterRegion of kind RegionCUDAFD
// after the header. Its extra is left to FDExtra.Decode.
func (m *RegionDescriptors) Decode(b []byte) error {
	r := reader{b: b, what: "RegionDescriptors"}
	if magic := r.u32(); r.err == nil && magic != DescriptorsMagic {
		r.fail("magic %#x", magic)
	}
	m.Version = r.u16()
	r.u16()
	m.Session = r.u64()
	m.Epoch = r.u64()
	if r.err != nil {
		return r.done()
	}
	if err := m.Region.Decode(b[r.off:]); err != nil {
		return err
	}
	if m.Region.Kind != RegionCUDAFD {
		r.fail("region kind %d, want %d (CUDA by descriptor)", m.Region.Kind, RegionCUDAFD)
		return r.done()
	}
	return nil
}

// RegionDescriptorsReply answers a RegionDescriptors message on its
// connection.
//
//	 0 u32 magic "RSFK"   4 u16 version   6 u16 zero
//	 8 u32 status        12 u32 region id
//	16 message (UTF-8, to the end)
//
//wire:struct RegionDescriptorsReply "<IHHII" DescriptorsReplyMagic version _ status region
type RegionDescriptorsReply struct {
	Version uint16
	Status  Status
	Region  uint32
	Message string
}

// Append encodes m.
func (m *RegionDescriptorsReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(DescriptorsReplyMagic)
	w.u16(m.Version)
	w.u16(0)
	w.u32(uint32(m.Status))
	w.u32(m.Region)
	w.raw([]byte(m.Message))
	return w.b
}

// Decode parses m.
func (m *RegionDescriptorsReply) Decode(b []byte) error {
	r := reader{b: b, what: "RegionDescriptorsReply"}
	if magic := r.u32(); r.err == nil && magic != DescriptorsReplyMagic {
		r.fail("magic %#x", magic)
	}
	m.Version = r.u16()
	r.u16()
	m.Status = Status(r.u32())
	m.Region = r.u32()
	m.Message = string(r.bytes(len(b) - r.off))
	return r.done()
}
