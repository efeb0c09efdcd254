package reliability

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/internal/shm"
	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/schema"
)

// guarded is engine memory between PROT_NONE guard areas.
type guarded struct {
	all     []byte // the mapping's read-write part
	reg     *region
	release func() error
}

// newGuarded maps pages+2*slackPages pages between guards and registers
// the middle pages as region id; the slack pages are checksummed.
func newGuarded(t *testing.T, id uint32, pages, slackPages int) *guarded {
	t.Helper()
	all, release, err := shm.GuardedAnon((pages + 2*slackPages) * slot)
	if err != nil {
		t.Fatal(err)
	}
	rand.NewChaCha8([32]byte{byte(id)}).Read(all)
	g := &guarded{all: all, release: release}
	g.reg = regionOver(id, all[slackPages*slot:(slackPages+pages)*slot])
	return g
}

// outside checksums the bytes of the mapping outside the registered region.
func (g *guarded) outside() [32]byte {
	lo := int(g.reg.reg.Base - shm.Addr(g.all))
	h := sha256.New()
	h.Write(g.all[:lo])
	h.Write(g.all[lo+len(g.reg.buf):])
	var s [32]byte
	copy(s[:], h.Sum(nil))
	return s
}

type fuzzer struct {
	t        *testing.T
	rng      *rand.Rand
	c        *connector.Client
	o        connector.Options
	regions  []*guarded
	scratch  *guarded
	leases   []uint64 // live leases of this session
	released []uint64 // leases released once
	foreign  []uint64 // live leases of another instance's session
	nextB    uint64

	records, bad, badAnswered, copyFailed, detaches int
	statuses                                        map[schema.Status]int
	kinds                                           map[string]int
}

type pending struct {
	seq   uint64
	typ   uint16
	kind  string
	bad   bool // must be answered with an error
	lease uint64
}

func (f *fuzzer) attach() {
	f.t.Helper()
	c, err := connector.Dial(f.o)
	if err != nil {
		f.t.Fatal(err)
	}
	f.c = c
	for _, g := range f.regions {
		if err := c.RegisterRegion(g.reg.reg); err != nil {
			f.t.Fatal(err)
		}
	}
	d := digests("fuzz-present", 16)
	c.PutHashes(1, d, true) // batches are per instance: append when it survived
	if _, err := c.PutHashes(1, d, false); err != nil && status(err) != schema.ErrCodeDuplicate {
		f.t.Fatal(err)
	}
	if _, err := c.Store(schema.View{Batch: 1, Count: 16}, f.regions[0].reg.reg.Region, iota32(16)); err != nil {
		f.t.Fatal(err)
	}
	f.leases = f.leases[:0]
}

func (f *fuzzer) pick(ids []uint64) uint64 {
	if len(ids) == 0 {
		return f.rng.Uint64()
	}
	return ids[f.rng.IntN(len(ids))]
}

func (f *fuzzer) pages(n, past int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(f.rng.IntN(16 + past))
	}
	return p
}

// next builds one record.
func (f *fuzzer) next() (uint16, []byte, pending) {
	r := f.rng
	reg := f.regions[r.IntN(len(f.regions))].reg.reg.Region
	if r.IntN(8) == 0 { // a region over the scratch mapping's guard pages, when registered
		reg = 3 + uint32(r.IntN(5))
	}
	view := func() schema.View {
		return schema.View{Batch: 1, Start: uint32(r.IntN(8)), Count: uint32(1 + r.IntN(8))}
	}
	switch k := r.IntN(100); {
	case k < 10: // random type and bytes
		typ := uint16(r.IntN(24))
		if typ == schema.TypeDetach || typ == 0 {
			typ = 0x40
		}
		// KV events' records (Describe, Events, EventSnapshot) are left to
		// their decoders' fuzzers and FuzzMachine: a random Events or
		// EventSnapshot asks for replies up to max_payload each, and this
		// client, which reads its replies only every 128 records, would
		// then be a reader that stopped reading (dropped after
		// --reply-timeout, as it should be), not the attack this test makes.
		if typ >= schema.TypeDescribe && typ <= schema.TypeEventSnapshot {
			typ = 0x40
		}
		b := make([]byte, r.IntN(80))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return typ, b, pending{typ: typ, kind: "random", bad: typ > schema.TypeSnapshot}
	case k < 25: // a valid record, mutated
		typ, b, _ := f.valid(reg, view)
		b = append([]byte(nil), b...)
		switch r.IntN(3) {
		case 0:
			if len(b) > 0 {
				b[r.IntN(len(b))] ^= byte(1 + r.IntN(255))
			}
		case 1:
			b = b[:r.IntN(len(b)+1)]
		default:
			b = append(b, byte(r.Uint32()))
		}
		return typ, b, pending{typ: typ, kind: "mutated"}
	case k < 30: // load before acquire (a lease never granted)
		b := (&schema.Load{Lease: 1<<50 + r.Uint64N(1<<20), Region: reg, Pages: []uint32{0}}).Append(nil)
		return schema.TypeLoad, b, pending{typ: schema.TypeLoad, kind: "load before acquire", bad: true}
	case k < 34: // release twice
		if len(f.released) == 0 {
			break
		}
		b := schema.IDRequest{ID: f.pick(f.released)}.Append(nil)
		return schema.TypeRelease, b, pending{typ: schema.TypeRelease, kind: "release twice", bad: true}
	case k < 40: // another session's ids: its leases, a region only it has
		if r.IntN(2) == 0 && len(f.foreign) > 0 {
			id := f.pick(f.foreign)
			switch r.IntN(3) {
			case 0:
				return schema.TypePoll, schema.IDRequest{ID: id}.Append(nil), pending{typ: schema.TypePoll, kind: "other session's lease", bad: true}
			case 1:
				return schema.TypeRelease, schema.IDRequest{ID: id}.Append(nil), pending{typ: schema.TypeRelease, kind: "other session's lease", bad: true}
			default:
				return schema.TypeLoad, (&schema.Load{Lease: id, Region: reg, Pages: []uint32{0}}).Append(nil), pending{typ: schema.TypeLoad, kind: "other session's lease", bad: true}
			}
		}
		b := (&schema.Store{View: schema.View{Batch: 1, Count: 1}, Region: 50, Pages: []uint32{0}}).Append(nil)
		return schema.TypeStore, b, pending{typ: schema.TypeStore, kind: "other session's region", bad: true}
	case k < 46: // huge counts
		var b []byte
		typ := []uint16{schema.TypePutHashes, schema.TypeLoad, schema.TypeStore, schema.TypeLookup, schema.TypeRegisterRegion}[r.IntN(5)]
		switch typ {
		case schema.TypePutHashes:
			b = (&schema.PutHashes{Batch: 9, Digests: make([]byte, 32)}).Append(nil, 32)
			binary.LittleEndian.PutUint32(b[8:], 0xFFFFFFFF-uint32(r.IntN(4)))
		case schema.TypeLoad:
			b = (&schema.Load{Lease: f.pick(f.leases), Region: reg, Pages: []uint32{0}}).Append(nil)
			binary.LittleEndian.PutUint32(b[12:], 1<<31+uint32(r.IntN(1000)))
		case schema.TypeStore:
			b = (&schema.Store{View: schema.View{Batch: 1, Count: 1}, Region: reg, Pages: []uint32{0}}).Append(nil)
			binary.LittleEndian.PutUint32(b[20:], 1<<30+uint32(r.IntN(1000)))
		case schema.TypeLookup:
			b = (&schema.Lookup{View: schema.View{Batch: 1, Start: uint32(r.IntN(4)), Count: 1<<31 + uint32(r.IntN(1<<20))}}).Append(nil)
		default:
			m := f.regions[0].reg.reg
			m.Region = 99
			m.PageCount = 1<<31 + uint32(r.IntN(1000))
			b = m.Append(nil)
		}
		return typ, b, pending{typ: typ, kind: "huge count", bad: true}
	case k < 54: // page indices past the registered region (of 16 pages)
		reg := f.regions[r.IntN(len(f.regions))].reg.reg.Region
		if r.IntN(2) == 0 {
			v := view()
			b := (&schema.Store{View: v, Region: reg, Pages: f.pastPages(int(v.Count))}).Append(nil)
			return schema.TypeStore, b, pending{typ: schema.TypeStore, kind: "page past region", bad: true}
		}
		if len(f.leases) == 0 {
			break
		}
		b := (&schema.Load{Lease: f.pick(f.leases), Region: reg, Pages: f.pastPages(1 + r.IntN(4))}).Append(nil)
		return schema.TypeLoad, b, pending{typ: schema.TypeLoad, kind: "page past region", bad: true}
	case k < 58: // regions that overlap the guard pages of a scratch mapping
		return schema.TypeRegisterRegion, f.scratchRegion(), pending{typ: schema.TypeRegisterRegion, kind: "region over guard pages"}
	case k < 61: // another process's memory, a CUDA region
		m := f.regions[0].reg.reg
		m.Region = 60 + uint32(r.IntN(10))
		if r.IntN(2) == 0 {
			m.PID = 1
		} else {
			m.Kind = schema.RegionCUDAIPC
		}
		return schema.TypeRegisterRegion, m.Append(nil), pending{typ: schema.TypeRegisterRegion, kind: "foreign or CUDA region", bad: true}
	}
	typ, b, kind := f.valid(reg, view)
	return typ, b, pending{typ: typ, kind: kind}
}

func (f *fuzzer) pastPages(n int) []uint32 {
	p := f.pages(n, 0)
	p[f.rng.IntN(n)] = 16 + uint32(f.rng.IntN(1<<20))
	return p
}

// scratchRegion registers (ids 3..7, often refused as duplicates) a
// region whose geometry reaches into the guard pages around the scratch
// mapping, never past them.
func (f *fuzzer) scratchRegion() []byte {
	r := f.rng
	lo := shm.Addr(f.scratch.all) - shm.GuardBytes
	hi := shm.Addr(f.scratch.all) + uint64(len(f.scratch.all)) + shm.GuardBytes
	base := lo + uint64(r.IntN(int(hi-lo)))
	length := 1 + uint64(r.IntN(int(hi-base)))
	ps := uint64(1 + r.IntN(slot))
	m := schema.RegisterRegion{Region: 3 + uint32(r.IntN(5)), Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: base, Length: length, PageSize: ps, PageCount: uint32(max(1, length/ps))}
	if r.IntN(3) == 0 {
		m.PageCount = uint32(1 + r.IntN(64))
	}
	if r.IntN(4) == 0 {
		m.Segments = []schema.Segment{{Offset: uint64(r.IntN(4096)), Stride: ps, Length: ps / 2}, {Offset: uint64(r.IntN(4096)), Stride: ps, Length: ps - ps/2}}
	}
	return m.Append(nil)
}

// valid builds a well-formed record of ordinary traffic.
func (f *fuzzer) valid(reg uint32, view func() schema.View) (uint16, []byte, string) {
	r := f.rng
	switch r.IntN(10) {
	case 0:
		f.nextB++
		return schema.TypePutHashes, (&schema.PutHashes{Batch: 100 + f.nextB%64, Digests: digests("fz", 1+r.IntN(8))}).Append(nil, 32), "valid"
	case 1:
		return schema.TypeDropHashes, schema.IDRequest{ID: 100 + uint64(r.IntN(64))}.Append(nil), "valid"
	case 2:
		return schema.TypeLookup, (&schema.Lookup{View: view()}).Append(nil), "valid"
	case 3:
		return schema.TypeAcquire, (&schema.Acquire{View: view(), TTLms: uint32(r.IntN(2000))}).Append(nil), "valid"
	case 4:
		return schema.TypePoll, schema.IDRequest{ID: f.pick(f.leases)}.Append(nil), "valid"
	case 5:
		return schema.TypeRelease, schema.IDRequest{ID: f.pick(f.leases)}.Append(nil), "valid"
	case 6:
		n := 1 + r.IntN(4)
		return schema.TypeLoad, (&schema.Load{Lease: f.pick(f.leases), Region: reg, First: uint32(r.IntN(2)), Pages: f.pages(n, 0)}).Append(nil), "valid"
	case 7:
		v := view()
		return schema.TypeStore, (&schema.Store{View: v, Region: reg, Pages: f.pages(int(v.Count), 0)}).Append(nil), "valid"
	case 8:
		return schema.TypeSnapshot, (&schema.Snapshot{From: r.Uint64N(1 << 20), Max: uint32(r.IntN(10))}).Append(nil), "valid"
	default:
		return schema.TypeChanges, (&schema.Changes{Epoch: r.Uint64N(3), Seq: r.Uint64N(100), Max: uint32(r.IntN(10))}).Append(nil), "valid"
	}
}

// settle reads the reply to one record and checks it.
func (f *fuzzer) settle(p pending) {
	b, err := f.c.Await(p.seq)
	if err != nil {
		f.t.Fatalf("no reply to a %s record (type %#x): %v", p.kind, p.typ, err)
	}
	if len(b) < 4 {
		f.t.Fatalf("reply without a status: %x", b)
	}
	st := schema.Status(binary.LittleEndian.Uint32(b))
	if st > schema.ErrCodeMismatch {
		f.t.Fatalf("unknown status %d", st)
	}
	f.statuses[st]++
	f.kinds[p.kind]++
	if st == schema.ErrCodeCopyFailed {
		f.copyFailed++
	}
	if p.bad {
		f.bad++
		if st != schema.OK {
			f.badAnswered++
		} else {
			f.t.Errorf("a bad record (%s, type %#x) was answered OK", p.kind, p.typ)
		}
	}
	if st != schema.OK || p.kind != "valid" && p.kind != "mutated" {
		return
	}
	switch p.typ {
	case schema.TypeAcquire:
		var lr schema.LeaseReply
		if lr.Decode(b) == nil && lr.Lease != 0 {
			f.leases = append(f.leases, lr.Lease)
			if len(f.leases) > 64 { // release the oldest in a later record
				f.leases = f.leases[1:]
			}
		}
	case schema.TypeRelease:
		f.released = append(f.released, p.lease)
		if len(f.released) > 256 {
			f.released = f.released[1:]
		}
		for i, l := range f.leases {
			if l == p.lease {
				f.leases = append(f.leases[:i], f.leases[i+1:]...)
				break
			}
		}
	}
}

// TestHostileClient drives a live sidecar process with at least a million
// random, mutated and deliberately invalid records, against engine memory
// between guard pages.
func TestHostileClient(t *testing.T) {
	row := record(t, "Hostile input", "a fuzzing client over a live sidecar: random and mutated records, load before acquire, release twice, use after detach, another session's lease and region ids, huge counts, page indices past the region, regions over guard pages, other processes' memory",
		"zero crashes (process alive, no panic, no session aborted); every record answered with a known status, every bad record with an error; no copy outside registered memory: regions sit between PROT_NONE guard pages (a stray copy faults: copy failed, counted) and the bytes just outside them keep their checksum", "")
	n := 1_000_000
	if long() {
		n = 5_000_000
	}
	sc := startSidecar(t, newDir(t), "--ring.capacity", "1MiB", "--log.level", "warn")
	seed := uint64(time.Now().UnixNano())
	f := &fuzzer{t: t, rng: rand.New(rand.NewPCG(seed, 3)), o: opts(sc.sock, "fuzz-a"), statuses: map[schema.Status]int{}, kinds: map[string]int{}}
	f.o.Timeout = 10 * time.Second
	exact := newGuarded(t, 1, 16, 0)
	slack := newGuarded(t, 2, 16, 1)
	f.scratch = newGuarded(t, 0, 8, 0)
	defer exact.release()
	defer slack.release()
	defer f.scratch.release()
	f.regions = []*guarded{exact, slack}
	sums := [2][32]byte{exact.outside(), slack.outside()}
	f.attach()
	// Another engine instance's session holds leases and a region id 50.
	other := dial(t, opts(sc.sock, "fuzz-b"))
	oreg := newRegion(50, 16)
	other.RegisterRegion(oreg.reg)
	other.PutHashes(1, digests("fuzz-present", 16), false)
	for i := 0; i < 8; i++ {
		if l, err := other.Acquire(schema.View{Batch: 1, Count: 4}, time.Hour); err == nil && l.Lease != 0 {
			f.foreign = append(f.foreign, l.Lease)
		}
	}
	if len(f.foreign) == 0 {
		t.Fatal("the other session got no lease")
	}
	t0 := time.Now()
	const window = 128
	inflight := make([]pending, 0, window)
	flush := func() {
		for _, p := range inflight {
			f.settle(p)
		}
		inflight = inflight[:0]
	}
	for f.records < n {
		if f.records%200_000 == 199_999 { // use after detach
			flush()
			seq, _ := f.c.Submit(schema.TypeDetach, nil)
			if _, err := f.c.Await(seq); err != nil {
				t.Fatalf("detach: %v", err)
			}
			// The rings are still mapped: records after the Detach reach a
			// closed session and fail, they are never served.
			if err := f.c.Ping(1); !errors.Is(err, ring.ErrPeerClosed) && !errors.Is(err, ring.ErrPeerDead) {
				t.Fatalf("a call after detach: %v", err)
			}
			f.c.Abandon()
			if err := f.c.Ping(2); !errors.Is(err, ring.ErrClosed) {
				t.Fatalf("a call after the client unmapped its rings: %v", err)
			}
			f.detaches++
			f.attach()
		}
		typ, b, p := f.next()
		if len(b) > f.c.MaxPayload() {
			continue
		}
		if p.typ == schema.TypeRelease && len(b) == 8 {
			p.lease = binary.LittleEndian.Uint64(b)
		}
		seq, err := f.c.Submit(typ, b)
		if err != nil {
			t.Fatalf("submit %s: %v", p.kind, err)
		}
		p.seq = seq
		inflight = append(inflight, p)
		f.records++
		if len(inflight) == window {
			flush()
		}
		if t.Failed() {
			break
		}
	}
	flush()
	elapsed := time.Since(t0)
	if err := f.c.Ping(7); err != nil {
		t.Fatalf("the fuzzed session is dead: %v", err)
	}
	if !sc.alive() || sc.panics() > 0 || sc.logCount("session aborted") > 0 {
		t.Fatalf("sidecar crashed or aborted a session: %s", sc.logTail())
	}
	if got := [2][32]byte{exact.outside(), slack.outside()}; got != sums {
		t.Fatal("bytes outside a registered region changed")
	}
	f.c.Close()
	other.Close()
	sc.waitQuiet(t, 0, 5*time.Second)
	var sts []string
	for s, c := range f.statuses {
		sts = append(sts, fmt.Sprintf("%d:%d", s, c))
	}
	sort.Strings(sts)
	row.add("%d records in %v (%.0f/s, seed %d), %d detach/use-after-detach cycles; sidecar alive, 0 panics, 0 sessions aborted", f.records, elapsed.Round(time.Millisecond), float64(f.records)/elapsed.Seconds(), seed, f.detaches)
	row.add("%d deliberately bad records, %d answered with an error; replies by status %s", f.bad, f.badAnswered, strings.Join(sts, " "))
	row.add("%d copies faulted on a guard page and were answered copy failed (11); checksums outside the registered regions unchanged; pool accounting exact after", f.copyFailed)
	if f.bad != f.badAnswered {
		t.Errorf("%d bad records answered OK", f.bad-f.badAnswered)
	}
}
