package schema

import (
	"fmt"
	"unicode/utf8"
)

// Roles a session attaches with.
const (
	RoleScheduler uint16 = 1 // the engine's scheduler: lookups, leases, the change log
	RoleWorker    uint16 = 2 // a tensor-parallel worker: memory, loads, stores
	RoleClient    uint16 = 3 // tools and benchmarks: everything
)

// Socket handshake magics.
const (
	AttachMagic      uint32 = 0x54415352 // "RSAT"
	AttachReplyMagic uint32 = 0x4b415352 // "RSAK"
)

// AttachRequest is the one message an engine sends on the Unix socket.
//
//	 0 u32 magic "RSAT"     4 u16 version      6 u16 role
//	 8 u32 rank            12 u32 world size  16 u8 digest width (8|16|32)
//	17 u8[3] zero          20 u32 ring capacity (0 = sidecar default)
//	24 u16 len(instance)   26 u16 len(model)  28 u16 len(layout) 30 u16 len(salt)
//	32 instance, model, layout, salt (UTF-8, back to back)
//
//wire:struct AttachRequest "<IHHIIB3xIHHHH" AttachMagic version role rank world_size digest_width ring_capacity len(instance) len(model) len(layout) len(salt)
type AttachRequest struct {
	Version      uint16
	Role         uint16
	Rank         uint32
	WorldSize    uint32
	DigestWidth  uint8
	RingCapacity uint32
	Instance     string // engine instance id: ranks of one engine share it
	Model        string
	Layout       string // layout fingerprint: dtype, block size, page layout, hash algorithm
	Salt         string // tenant salt; empty for none
}

// Append encodes m.
func (m *AttachRequest) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(AttachMagic)
	w.u16(m.Version)
	w.u16(m.Role)
	w.u32(m.Rank)
	w.u32(m.WorldSize)
	w.u8(m.DigestWidth)
	w.zero(3)
	w.u32(m.RingCapacity)
	w.u16(uint16(len(m.Instance)))
	w.u16(uint16(len(m.Model)))
	w.u16(uint16(len(m.Layout)))
	w.u16(uint16(len(m.Salt)))
	w.raw([]byte(m.Instance))
	w.raw([]byte(m.Model))
	w.raw([]byte(m.Layout))
	w.raw([]byte(m.Salt))
	return w.b
}

// Validate checks the semantic rules of an attach request.
func (m *AttachRequest) Validate() error {
	switch {
	case m.Role < RoleScheduler || m.Role > RoleClient:
		return fmt.Errorf("%w: attach: role %d", ErrMalformed, m.Role)
	case m.WorldSize == 0 || m.WorldSize > MaxWorldSize:
		return fmt.Errorf("%w: attach: world size %d outside [1, %d]", ErrMalformed, m.WorldSize, MaxWorldSize)
	case m.Rank >= m.WorldSize:
		return fmt.Errorf("%w: attach: rank %d not below world size %d", ErrMalformed, m.Rank, m.WorldSize)
	case m.DigestWidth != 8 && m.DigestWidth != 16 && m.DigestWidth != 32:
		return fmt.Errorf("%w: attach: digest width %d, want 8, 16 or 32", ErrMalformed, m.DigestWidth)
	case m.Instance == "" || m.Model == "" || m.Layout == "":
		return fmt.Errorf("%w: attach: instance, model and layout must not be empty", ErrMalformed)
	}
	for _, s := range []string{m.Instance, m.Model, m.Layout, m.Salt} {
		if len(s) > MaxStringLen || !utf8.ValidString(s) {
			return fmt.Errorf("%w: attach: string longer than %d bytes or not UTF-8", ErrMalformed, MaxStringLen)
		}
	}
	return nil
}

// Decode parses and validates an attach request.
func (m *AttachRequest) Decode(b []byte) error {
	r := reader{b: b, what: "attach request"}
	if magic := r.u32(); r.err == nil && magic != AttachMagic {
		r.fail("magic %#x", magic)
	}
	m.Version = r.u16()
	m.Role = r.u16()
	m.Rank = r.u32()
	m.WorldSize = r.u32()
	m.DigestWidth = r.u8()
	r.bytes(3)
	m.RingCapacity = r.u32()
	n1, n2, n3, n4 := int(r.u16()), int(r.u16()), int(r.u16()), int(r.u16())
	m.Instance = string(r.bytes(n1))
	m.Model = string(r.bytes(n2))
	m.Layout = string(r.bytes(n3))
	m.Salt = string(r.bytes(n4))
	if err := r.done(); err != nil {
		return err
	}
	return m.Validate()
}

// AttachReply answers an attach request on the socket.
//
//	 0 u32 magic "RSAK"   4 u16 version   6 u16 zero
//	 8 u32 status        12 u32 namespace id
//	16 u64 session id    24 u64 epoch (boot token of both rings)
//	32 u64 pool slots    40 u32 slot bytes   44 u32 max record payload
//	48 u16 len(submission ring path)  50 u16 len(completion ring path)
//	52 u16 len(pool path)             54 u16 len(message)
//	56 the strings, back to back
//
//wire:struct AttachReply "<IHHIIQQQIIHHHH" AttachReplyMagic version _ status namespace session epoch pool_slots slot_bytes max_payload len(submission_ring) len(completion_ring) len(pool_path) len(message)
type AttachReply struct {
	Version        uint16
	Status         Status
	Namespace      uint32
	Session        uint64
	Epoch          uint64
	PoolSlots      uint64
	SlotBytes      uint32
	MaxPayload     uint32
	SubmissionRing string
	CompletionRing string
	PoolPath       string
	Message        string
}

// Append encodes m.
func (m *AttachReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(AttachReplyMagic)
	w.u16(m.Version)
	w.u16(0)
	w.u32(uint32(m.Status))
	w.u32(m.Namespace)
	w.u64(m.Session)
	w.u64(m.Epoch)
	w.u64(m.PoolSlots)
	w.u32(m.SlotBytes)
	w.u32(m.MaxPayload)
	w.u16(uint16(len(m.SubmissionRing)))
	w.u16(uint16(len(m.CompletionRing)))
	w.u16(uint16(len(m.PoolPath)))
	w.u16(uint16(len(m.Message)))
	w.raw([]byte(m.SubmissionRing))
	w.raw([]byte(m.CompletionRing))
	w.raw([]byte(m.PoolPath))
	w.raw([]byte(m.Message))
	return w.b
}

// Decode parses an attach reply.
func (m *AttachReply) Decode(b []byte) error {
	r := reader{b: b, what: "attach reply"}
	if magic := r.u32(); r.err == nil && magic != AttachReplyMagic {
		r.fail("magic %#x", magic)
	}
	m.Version = r.u16()
	r.u16()
	m.Status = Status(r.u32())
	m.Namespace = r.u32()
	m.Session = r.u64()
	m.Epoch = r.u64()
	m.PoolSlots = r.u64()
	m.SlotBytes = r.u32()
	m.MaxPayload = r.u32()
	n1, n2, n3, n4 := int(r.u16()), int(r.u16()), int(r.u16()), int(r.u16())
	m.SubmissionRing = string(r.bytes(n1))
	m.CompletionRing = string(r.bytes(n2))
	m.PoolPath = string(r.bytes(n3))
	m.Message = string(r.bytes(n4))
	return r.done()
}

// View names a prefix range of a registered hash batch.
//
//	0 u64 batch id   8 u32 start   12 u32 count
type View struct {
	Batch uint64
	Start uint32
	Count uint32
}

// ViewSize is the encoded size of a View.
const ViewSize = 16

func (v View) append(w *writer) {
	w.u64(v.Batch)
	w.u32(v.Start)
	w.u32(v.Count)
}

func (v *View) read(r *reader) {
	v.Batch = r.u64()
	v.Start = r.u32()
	v.Count = r.u32()
}

// PutHashes registers a batch of digests under a client-chosen id, or
// appends to an existing batch (FlagAppend).
//
//	0 u64 batch id   8 u32 count   12 u32 flags   16 count × width digest bytes
//
//wire:struct PutHashes "<QII" batch count(digests) flags
type PutHashes struct {
	Batch   uint64
	Flags   uint32
	Digests []byte // count × the session's digest width; aliases the input on Decode
}

// PutHashes flags.
const (
	// FlagAppend appends the digests to an existing batch.
	FlagAppend uint32 = 1
	// FlagLookup makes the reply a Lookup of the whole batch after the call
	// (its value is the number of leading digests the cache holds, not the
	// batch length): admission in one record instead of two.
	FlagLookup uint32 = 2
	// FlagReplace registers the batch whether or not the id is registered:
	// an existing batch's digests are replaced. A client reuses the id of a
	// finished request's batch this way instead of dropping it (one record
	// fewer a request). Not with FlagAppend.
	FlagReplace uint32 = 4
)

// Append encodes m; width is the session's digest width (8, 16 or 32) and
// len(m.Digests) must be a multiple of it.
func (m *PutHashes) Append(dst []byte, width int) []byte {
	w := writer{dst}
	w.u64(m.Batch)
	w.u32(uint32(len(m.Digests) / max(width, 1)))
	w.u32(m.Flags)
	w.raw(m.Digests)
	return w.b
}

// Decode parses m from b for a session with the given digest width.
func (m *PutHashes) Decode(b []byte, width int) error {
	r := reader{b: b, what: "PutHashes"}
	if width != 8 && width != 16 && width != 32 {
		r.fail("digest width %d, want 8, 16 or 32", width)
	}
	m.Batch = r.u64()
	n := r.u32()
	m.Flags = r.u32()
	if r.err == nil && n > MaxHashesPerRecord {
		r.fail("%d hashes, at most %d per record", n, MaxHashesPerRecord)
	}
	if r.err == nil && m.Flags&^(FlagAppend|FlagLookup|FlagReplace) != 0 {
		r.fail("unknown flags %#x", m.Flags)
	}
	if r.err == nil && m.Flags&FlagAppend != 0 && m.Flags&FlagReplace != 0 {
		r.fail("flags %#x: FlagAppend and FlagReplace together", m.Flags)
	}
	m.Digests = r.bytes(int(n) * width)
	return r.done()
}

// IDRequest is the payload of DropHashes, Poll and Release: one id.
//
//	0 u64 id
//
//wire:struct IDRequest "<Q" id
type IDRequest struct{ ID uint64 }

// Append encodes m.
func (m IDRequest) Append(dst []byte) []byte { return le.AppendUint64(dst, m.ID) }

// Decode parses m.
func (m *IDRequest) Decode(b []byte) error {
	r := reader{b: b, what: "id request"}
	m.ID = r.u64()
	return r.done()
}

// Lookup counts the leading blocks of a view that the namespace holds.
//
//	0 view
//
//wire:struct Lookup "<QII" batch start count size=ViewSize
type Lookup struct{ View View }

// Append encodes m.
func (m *Lookup) Append(dst []byte) []byte {
	w := writer{dst}
	m.View.append(&w)
	return w.b
}

// Decode parses m.
func (m *Lookup) Decode(b []byte) error {
	r := reader{b: b, what: "Lookup"}
	m.View.read(&r)
	return r.done()
}

// Acquire pins the leading present blocks of a view under a new lease.
//
//	0 view   16 u32 ttl in milliseconds (0 = sidecar default)   20 u32 flags (zero)
//
//wire:struct Acquire "<QIIII" batch start count ttl_ms _
type Acquire struct {
	View  View
	TTLms uint32
}

// Append encodes m.
func (m *Acquire) Append(dst []byte) []byte {
	w := writer{dst}
	m.View.append(&w)
	w.u32(m.TTLms)
	w.u32(0)
	return w.b
}

// Decode parses m.
func (m *Acquire) Decode(b []byte) error {
	r := reader{b: b, what: "Acquire"}
	m.View.read(&r)
	m.TTLms = r.u32()
	if f := r.u32(); r.err == nil && f != 0 {
		r.fail("unknown flags %#x", f)
	}
	return r.done()
}

// Retain asks the sidecar to keep the leading present blocks of a view for
// ttl at a priority (evicted after every block without retention, the
// lowest priority first), or, with RetainFlagEnd, ends the retention this
// uid and owner set on the view's blocks (docs/protocol.md, section 5.14).
// Added within version 3: a sidecar that predates it answers status 2.
// The owner (a u64 at offset 24) was appended within version 3 too: a
// Retain of RetainNoOwnerSize bytes decodes with owner 0, and Append
// writes that shorter form when Owner is 0, so that a sidecar that
// predates the owner still understands it.
//
//	0 view   16 u32 ttl in milliseconds   20 u8 priority (0..3)   21 u8 flags   22 u16 zero   24 u64 owner
//
//wire:struct Retain "<QIIIBBHQ" batch start count ttl_ms priority flags _ owner size=RetainSize min=RetainNoOwnerSize
type Retain struct {
	View     View
	TTLms    uint32 // at least 1 without RetainFlagEnd; ignored with it
	Priority uint8  // 0..MaxRetainPriority; ignored with RetainFlagEnd
	Flags    uint8
	// Owner identifies, within the uid, who holds the retention (a client
	// chooses it, e.g. a hash of a caller's session id; 0: none): only the
	// same uid and owner renew, re-prioritise or end it.
	Owner uint64
}

// Retain's sizes, flags and priorities.
const (
	// RetainSize is the encoded size of a Retain with its owner.
	RetainSize = 32
	// RetainNoOwnerSize is the size of a Retain without the owner (the
	// form that Retain had when it was added, owner 0).
	RetainNoOwnerSize = 24
	// RetainFlagEnd ends the retention of the view's blocks instead of
	// setting it.
	RetainFlagEnd uint8 = 1
	// MaxRetainPriority is the highest retention priority (kept longest).
	MaxRetainPriority = 3
)

// Append encodes m: RetainNoOwnerSize bytes when m.Owner is 0, else
// RetainSize.
func (m *Retain) Append(dst []byte) []byte {
	w := writer{dst}
	m.View.append(&w)
	w.u32(m.TTLms)
	w.u8(m.Priority)
	w.u8(m.Flags)
	w.u16(0)
	if m.Owner != 0 {
		w.u64(m.Owner)
	}
	return w.b
}

// Decode parses m, of RetainNoOwnerSize bytes (owner 0) or RetainSize:
// another length, unknown flags, a non-zero reserved field, a priority
// past MaxRetainPriority, and a ttl of 0 without RetainFlagEnd are
// malformed.
func (m *Retain) Decode(b []byte) error {
	r := reader{b: b, what: "Retain"}
	m.View.read(&r)
	m.TTLms = r.u32()
	m.Priority = r.u8()
	m.Flags = r.u8()
	z := r.u16()
	m.Owner = 0
	if rest := len(b) - r.off; r.err == nil && rest > 0 && rest < 8 {
		r.fail("%d trailing bytes (an owner is 8)", rest)
	} else if rest >= 8 {
		m.Owner = r.u64()
	}
	switch {
	case r.err != nil:
	case m.Flags&^RetainFlagEnd != 0:
		r.fail("unknown flags %#x", m.Flags)
	case z != 0:
		r.fail("reserved bytes 22-23 are %#x, not zero", z)
	case m.Priority > MaxRetainPriority:
		r.fail("priority %d, at most %d", m.Priority, MaxRetainPriority)
	case m.TTLms == 0 && m.Flags&RetainFlagEnd == 0:
		r.fail("ttl 0 without the END flag")
	}
	return r.done()
}

// Segment is one per-layer piece of an engine page.
type Segment struct{ Offset, Stride, Length uint64 }

// SegmentSize is the encoded size of a Segment: u64 offset, stride, length.
//
//wire:struct Segment "<QQQ" offset stride length size=SegmentSize
const SegmentSize = 24

// The extra bytes of a RegionCUDAIPC region (protocol version 3): the GPU,
// an optional interprocess CUDA event that stores wait for, and every device
// allocation the region's segments lie in.
//
//	 0 u8[16] GPU UUID   16 u32 flags   20 u32 allocation count n
//	24 u8[64] cudaIpcEventHandle_t (zero without CUDAExtraFlagEvent)
//	88 n × (u8[64] cudaIpcMemHandle_t, u64 base, u64 size)
//
//wire:struct CUDAExtra "<16sII64s" gpu flags count(allocations) event size=CUDAExtraHeaderSize
//wire:struct CUDAAllocation "<64sQQ" handle base size size=CUDAAllocationSize
const (
	CUDAExtraHeaderSize        = 88
	CUDAAllocationSize         = 80
	CUDAExtraFlagEvent  uint32 = 1 // the event handle is set: a Store's copies wait for its last record
	MaxAllocations             = MaxSegments
)

// CUDAAllocation is one device allocation of the engine: the IPC handle of
// its base, and its base address and size in the engine's address space.
type CUDAAllocation struct {
	Handle [64]byte
	Base   uint64
	Size   uint64
}

// CUDAExtra is RegisterRegion's extra bytes for RegionCUDAIPC.
type CUDAExtra struct {
	GPU         [16]byte
	Flags       uint32
	Event       [64]byte
	Allocations []CUDAAllocation
}

// Append encodes m.
func (m *CUDAExtra) Append(dst []byte) []byte {
	w := writer{dst}
	w.raw(m.GPU[:])
	w.u32(m.Flags)
	w.u32(uint32(len(m.Allocations)))
	w.raw(m.Event[:])
	for _, a := range m.Allocations {
		w.raw(a.Handle[:])
		w.u64(a.Base)
		w.u64(a.Size)
	}
	return w.b
}

// Decode parses m: unknown flags, no allocation or more than
// MaxAllocations, an event handle without its flag, an allocation of size
// zero or whose base + size overflows, and trailing bytes are malformed.
// Whether the allocations overlap or hold the region is the copy engine's
// to check.
func (m *CUDAExtra) Decode(b []byte) error {
	r := reader{b: b, what: "CUDA IPC extra"}
	copy(m.GPU[:], r.bytes(16))
	m.Flags = r.u32()
	n := r.u32()
	copy(m.Event[:], r.bytes(64))
	switch {
	case r.err != nil:
	case m.Flags&^CUDAExtraFlagEvent != 0:
		r.fail("unknown flags %#x", m.Flags)
	case n == 0 || n > MaxAllocations:
		r.fail("%d allocations, want 1 to %d", n, MaxAllocations)
	case m.Flags&CUDAExtraFlagEvent == 0 && m.Event != [64]byte{}:
		r.fail("an event handle without the event flag")
	}
	m.Allocations = m.Allocations[:0]
	for i := 0; i < int(n) && r.err == nil; i++ {
		var a CUDAAllocation
		copy(a.Handle[:], r.bytes(64))
		a.Base, a.Size = r.u64(), r.u64()
		if r.err == nil && (a.Size == 0 || a.Base+a.Size < a.Base) {
			r.fail("allocation %d: base %#x size %d", i, a.Base, a.Size)
		}
		m.Allocations = append(m.Allocations, a)
	}
	return r.done()
}

// Region kinds.
const (
	RegionHostProcess uint8 = 1 // host memory of the engine process, by pid and address
	RegionCUDAIPC     uint8 = 2 // GPU memory exported with a CUDA IPC handle
	RegionCUDAFD      uint8 = 3 // GPU memory shared by POSIX file descriptors: only in a RegionDescriptors message
)

// RegisterRegion registers engine memory that loads and stores copy to and
// from.
//
//	 0 u32 region id (client chosen)   4 u8 kind   5 u8[3] zero
//	 8 u64 pid                        16 u64 base address
//	24 u64 length                     32 u64 page size
//	40 u32 page count                 44 u32 segment count
//	48 segments: u64 offset, u64 stride, u64 length each
//	.. kind-specific bytes to the end (CUDA IPC: CUDAExtra; CUDA by
//	   descriptor: FDExtra)
//
//wire:struct RegisterRegion "<IB3xQQQQII" region kind pid base length page_size page_count count(segments)
type RegisterRegion struct {
	Region    uint32
	Kind      uint8
	PID       uint64
	Base      uint64
	Length    uint64
	PageSize  uint64
	PageCount uint32
	Segments  []Segment
	Extra     []byte
}

// Append encodes m.
func (m *RegisterRegion) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(m.Region)
	w.u8(m.Kind)
	w.zero(3)
	w.u64(m.PID)
	w.u64(m.Base)
	w.u64(m.Length)
	w.u64(m.PageSize)
	w.u32(m.PageCount)
	w.u32(uint32(len(m.Segments)))
	for _, s := range m.Segments {
		w.u64(s.Offset)
		w.u64(s.Stride)
		w.u64(s.Length)
	}
	w.raw(m.Extra)
	return w.b
}

// Decode parses m. Bounds of the region itself are checked by the copy
// engine when the sidecar registers it.
func (m *RegisterRegion) Decode(b []byte) error {
	r := reader{b: b, what: "RegisterRegion"}
	m.Region = r.u32()
	m.Kind = r.u8()
	r.bytes(3)
	m.PID = r.u64()
	m.Base = r.u64()
	m.Length = r.u64()
	m.PageSize = r.u64()
	m.PageCount = r.u32()
	n := r.u32()
	if r.err == nil && n > MaxSegments {
		r.fail("%d segments, at most %d", n, MaxSegments)
	}
	if r.err == nil && m.Kind != RegionHostProcess && m.Kind != RegionCUDAIPC && m.Kind != RegionCUDAFD {
		r.fail("unknown region kind %d", m.Kind)
	}
	m.Segments = m.Segments[:0]
	for i := 0; i < int(n) && r.err == nil; i++ {
		m.Segments = append(m.Segments, Segment{Offset: r.u64(), Stride: r.u64(), Length: r.u64()})
	}
	if r.err == nil {
		m.Extra = r.bytes(len(b) - r.off)
	}
	return r.done()
}

// Load copies blocks First..First+len(Pages) of a lease into engine pages.
//
//	 0 u64 lease id   8 u32 region id   12 u32 count   16 u32 first   20 u32 zero
//	24 count × u32 page index
//
//wire:struct Load "<QIIII" lease region count(pages) first _
type Load struct {
	Lease  uint64
	Region uint32
	First  uint32
	Pages  []uint32
}

// Append encodes m.
func (m *Load) Append(dst []byte) []byte {
	w := writer{dst}
	w.u64(m.Lease)
	w.u32(m.Region)
	w.u32(uint32(len(m.Pages)))
	w.u32(m.First)
	w.u32(0)
	for _, p := range m.Pages {
		w.u32(p)
	}
	return w.b
}

// Decode parses m, reusing m.Pages' storage.
func (m *Load) Decode(b []byte) error {
	r := reader{b: b, what: "Load"}
	m.Lease = r.u64()
	m.Region = r.u32()
	n := r.u32()
	m.First = r.u32()
	r.u32()
	m.Pages = readPages(&r, n, m.Pages)
	return r.done()
}

func readPages(r *reader, n uint32, buf []uint32) []uint32 {
	if r.err == nil && n > MaxPagesPerRecord {
		r.fail("%d pages, at most %d per record", n, MaxPagesPerRecord)
	}
	raw := r.bytes(int(n) * 4)
	buf = buf[:0]
	for i := 0; i+4 <= len(raw); i += 4 {
		buf = append(buf, le.Uint32(raw[i:]))
	}
	return buf
}

// Store copies engine pages into the pool as the blocks of a view.
//
//	 0 view   16 u32 region id   20 u32 count (= view count)
//	24 count × u32 page index
//
//wire:struct Store "<QIIII" batch start count region count(pages)
type Store struct {
	View   View
	Region uint32
	Pages  []uint32
}

// Append encodes m.
func (m *Store) Append(dst []byte) []byte {
	w := writer{dst}
	m.View.append(&w)
	w.u32(m.Region)
	w.u32(uint32(len(m.Pages)))
	for _, p := range m.Pages {
		w.u32(p)
	}
	return w.b
}

// Decode parses m, reusing m.Pages' storage.
func (m *Store) Decode(b []byte) error {
	r := reader{b: b, what: "Store"}
	m.View.read(&r)
	m.Region = r.u32()
	n := r.u32()
	m.Pages = readPages(&r, n, m.Pages)
	if r.err == nil && n != m.View.Count {
		r.fail("%d pages for a view of %d blocks", n, m.View.Count)
	}
	return r.done()
}

// Changes reads the namespace's change log from a cursor.
//
//	0 u64 epoch   8 u64 next sequence   16 u32 max entries   20 u32 zero
//
//wire:struct Changes "<QQII" epoch seq max _
type Changes struct {
	Epoch uint64
	Seq   uint64
	Max   uint32
}

// Append encodes m.
func (m *Changes) Append(dst []byte) []byte {
	w := writer{dst}
	w.u64(m.Epoch)
	w.u64(m.Seq)
	w.u32(m.Max)
	w.u32(0)
	return w.b
}

// Decode parses m.
func (m *Changes) Decode(b []byte) error {
	r := reader{b: b, what: "Changes"}
	m.Epoch = r.u64()
	m.Seq = r.u64()
	m.Max = r.u32()
	r.u32()
	return r.done()
}

// Snapshot reads one page of the digests of the namespace's present blocks
// (see SnapshotReply). From is an opaque scan position: 0 starts a
// snapshot, each later page sends the previous reply's Next.
//
//	0 u64 from   8 u32 max entries (0: the sidecar's bound)   12 u32 zero
//
//wire:struct Snapshot "<QII" from max _
type Snapshot struct {
	From uint64
	Max  uint32
}

// Append encodes m.
func (m *Snapshot) Append(dst []byte) []byte {
	w := writer{dst}
	w.u64(m.From)
	w.u32(m.Max)
	w.u32(0)
	return w.b
}

// Decode parses m.
func (m *Snapshot) Decode(b []byte) error {
	r := reader{b: b, what: "Snapshot"}
	m.From = r.u64()
	m.Max = r.u32()
	r.u32()
	return r.done()
}

// Reply is the common reply: status, a value, and a message.
//
//	0 u32 status   4 u32 zero   8 u64 value   16 message (UTF-8, to the end)
//
// Value is: PutHashes, the batch length after the call; Lookup, the number
// of leading present blocks; Load, the number of blocks copied; Ping, the
// echoed value; otherwise zero.
//
//wire:struct Reply "<IIQ" status _ value
type Reply struct {
	Status  Status
	Value   uint64
	Message string
}

// Append encodes m.
func (m *Reply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(uint32(m.Status))
	w.u32(0)
	w.u64(m.Value)
	w.raw([]byte(m.Message))
	return w.b
}

// Decode parses m.
func (m *Reply) Decode(b []byte) error {
	r := reader{b: b, what: "reply"}
	m.Status = Status(r.u32())
	r.u32()
	m.Value = r.u64()
	m.Message = string(r.bytes(len(b) - r.off))
	return r.done()
}

// Err returns nil for OK and an *Error otherwise.
func (m *Reply) Err() error {
	if m.Status == OK {
		return nil
	}
	return &Error{Status: m.Status, Message: m.Message}
}

// LeaseReply answers Acquire and Poll.
//
//	0 u32 status   4 u32 state   8 u64 lease id   16 u32 blocks pinned   20 u32 zero
//	24 message (UTF-8, to the end)
//
//wire:struct LeaseReply "<IIQII" status state lease blocks _
type LeaseReply struct {
	Status  Status
	State   State
	Lease   uint64
	Blocks  uint32
	Message string
}

// Append encodes m.
func (m *LeaseReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(uint32(m.Status))
	w.u32(uint32(m.State))
	w.u64(m.Lease)
	w.u32(m.Blocks)
	w.u32(0)
	w.raw([]byte(m.Message))
	return w.b
}

// Decode parses m.
func (m *LeaseReply) Decode(b []byte) error {
	r := reader{b: b, what: "lease reply"}
	m.Status = Status(r.u32())
	m.State = State(r.u32())
	m.Lease = r.u64()
	m.Blocks = r.u32()
	r.u32()
	m.Message = string(r.bytes(len(b) - r.off))
	return r.done()
}

// StoreReply answers Store.
//
//	0 u32 status   4 u32 stored   8 u32 already present   12 u32 not stored (no space)
//	16 message (UTF-8, to the end)
//
//wire:struct StoreReply "<IIII" status stored present skipped
type StoreReply struct {
	Status  Status
	Stored  uint32
	Present uint32
	Skipped uint32
	Message string
}

// Append encodes m.
func (m *StoreReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(uint32(m.Status))
	w.u32(m.Stored)
	w.u32(m.Present)
	w.u32(m.Skipped)
	w.raw([]byte(m.Message))
	return w.b
}

// Decode parses m.
func (m *StoreReply) Decode(b []byte) error {
	r := reader{b: b, what: "store reply"}
	m.Status = Status(r.u32())
	m.Stored = r.u32()
	m.Present = r.u32()
	m.Skipped = r.u32()
	m.Message = string(r.bytes(len(b) - r.off))
	return r.done()
}

// ChangesFlagResync is ChangesReply's flags bit 0: the cursor is behind the
// log (or from another epoch), resynchronise from a snapshot.
const ChangesFlagResync uint32 = 1

// ChangeHeaderSize is the size of a change entry before its digest: u8 op,
// u8[7] zero.
//
//wire:struct ChangeHeader "<B7x" op size=ChangeHeaderSize
const ChangeHeaderSize = 8

// Change operations in the log.
const (
	OpStored  uint8 = 1
	OpEvicted uint8 = 2
	OpCleared uint8 = 3 // the whole namespace was cleared; digest is zero
)

// ChangesReply carries log entries.
//
//	 0 u32 status   4 u32 flags (bit 0: resynchronise from a snapshot)
//	 8 u64 epoch   16 u64 next sequence   24 u32 count   28 u8 digest width   29 u8[3] zero
//	32 count × entry: u8 op, u8[7] zero, digest (width bytes)
//
//wire:struct ChangesReply "<IIQQIB3x" status ~flags epoch next count(entries) width
type ChangesReply struct {
	Status  Status
	Resync  bool
	Epoch   uint64
	Next    uint64
	Width   uint8
	Entries []byte // count × (8 + width) bytes, see ChangeAt
}

// Append encodes m.
func (m *ChangesReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(uint32(m.Status))
	var flags uint32
	if m.Resync {
		flags = ChangesFlagResync
	}
	w.u32(flags)
	w.u64(m.Epoch)
	w.u64(m.Next)
	es := ChangeHeaderSize + int(m.Width)
	w.u32(uint32(len(m.Entries) / es))
	w.u8(m.Width)
	w.zero(3)
	w.raw(m.Entries)
	return w.b
}

// Decode parses m; Entries aliases b.
func (m *ChangesReply) Decode(b []byte) error {
	r := reader{b: b, what: "changes reply"}
	m.Status = Status(r.u32())
	flags := r.u32()
	m.Resync = flags&ChangesFlagResync != 0
	m.Epoch = r.u64()
	m.Next = r.u64()
	n := r.u32()
	m.Width = r.u8()
	r.bytes(3)
	if r.err == nil && m.Width != 8 && m.Width != 16 && m.Width != 32 {
		r.fail("digest width %d", m.Width)
	}
	if r.err == nil && n > MaxChangesPerReply {
		r.fail("%d entries, at most %d", n, MaxChangesPerReply)
	}
	m.Entries = r.bytes(int(n) * (ChangeHeaderSize + int(m.Width)))
	return r.done()
}

// Len is the number of entries.
func (m *ChangesReply) Len() int {
	if m.Width == 0 {
		return 0
	}
	return len(m.Entries) / (ChangeHeaderSize + int(m.Width))
}

// ChangeAt returns entry i's operation and digest (aliasing Entries).
func (m *ChangesReply) ChangeAt(i int) (op uint8, digest []byte) {
	es := ChangeHeaderSize + int(m.Width)
	e := m.Entries[i*es : (i+1)*es]
	return e[0], e[ChangeHeaderSize:]
}

// AppendChange appends one entry to an Entries buffer.
func AppendChange(dst []byte, op uint8, digest []byte) []byte {
	dst = append(dst, op, 0, 0, 0, 0, 0, 0, 0)
	return append(dst, digest...)
}

// SnapshotFlagDone is SnapshotReply's flags bit 0: the scan reached the end
// of the pool, there are no more pages.
const SnapshotFlagDone uint32 = 1

// SnapshotReply answers Snapshot with one page of digests of present blocks.
// (Epoch, Seq) is the head cursor of the namespace's change log when the
// page was read; Next is the From of the next page.
//
//	 0 u32 status   4 u32 flags (bit 0: done)   8 u64 epoch   16 u64 seq
//	24 u64 next   32 u32 count   36 u8 digest width   37 u8[3] zero
//	40 count × digest (width bytes)
//
//wire:struct SnapshotReply "<IIQQQIB3x" status ~flags epoch seq next count(entries) width
type SnapshotReply struct {
	Status  Status
	Done    bool
	Epoch   uint64
	Seq     uint64
	Next    uint64
	Width   uint8
	Entries []byte // count × width digest bytes, see DigestAt
}

// Append encodes m.
func (m *SnapshotReply) Append(dst []byte) []byte {
	w := writer{dst}
	w.u32(uint32(m.Status))
	var flags uint32
	if m.Done {
		flags = SnapshotFlagDone
	}
	w.u32(flags)
	w.u64(m.Epoch)
	w.u64(m.Seq)
	w.u64(m.Next)
	n := 0
	if m.Width != 0 {
		n = len(m.Entries) / int(m.Width)
	}
	w.u32(uint32(n))
	w.u8(m.Width)
	w.zero(3)
	w.raw(m.Entries)
	return w.b
}

// Decode parses m; Entries aliases b.
func (m *SnapshotReply) Decode(b []byte) error {
	r := reader{b: b, what: "snapshot reply"}
	m.Status = Status(r.u32())
	m.Done = r.u32()&SnapshotFlagDone != 0
	m.Epoch = r.u64()
	m.Seq = r.u64()
	m.Next = r.u64()
	n := r.u32()
	m.Width = r.u8()
	r.bytes(3)
	if r.err == nil && m.Width != 8 && m.Width != 16 && m.Width != 32 {
		r.fail("digest width %d", m.Width)
	}
	if r.err == nil && n > MaxSnapshotPerReply {
		r.fail("%d entries, at most %d", n, MaxSnapshotPerReply)
	}
	m.Entries = r.bytes(int(n) * int(m.Width))
	return r.done()
}

// Len is the number of digests.
func (m *SnapshotReply) Len() int {
	if m.Width == 0 {
		return 0
	}
	return len(m.Entries) / int(m.Width)
}

// DigestAt returns digest i (aliasing Entries).
func (m *SnapshotReply) DigestAt(i int) []byte {
	w := int(m.Width)
	return m.Entries[i*w : (i+1)*w : (i+1)*w]
}
