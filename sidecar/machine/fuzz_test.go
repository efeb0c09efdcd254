package machine

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// FuzzMachine drives a Machine with a program read from the input: three
// sessions (two of one instance, one of another tenant, two uids) send
// records of any type and payload (mutated from valid ones), copies end in
// any order with success or failure, registrations succeed or fail,
// sessions end and attach again, time passes. After every step the
// Machine's and the cache's invariants must hold (CheckInvariants), every
// reply must go to a live session and start with a known status, and no
// call may panic.
func FuzzMachine(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
	f.Add([]byte{7, 0, 0, 9, 0, 1, 3, 4, 1, 8, 0, 2, 200, 201, 6, 250})
	f.Add([]byte("store load release detach tick attach"))
	f.Fuzz(func(t *testing.T, prog []byte) {
		runProgram(t, prog, false)
	})
}

// FuzzMachineL2 is FuzzMachine with the shared tier on: lookups, fetches
// and writes of the tier end in any order, found or not, valid or not,
// sessions end while they run, and every invariant holds after each step
// (a write's pin, a fetch's tickets and their metadata included).
func FuzzMachineL2(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
	f.Add([]byte{7, 0, 0, 9, 0, 1, 3, 4, 1, 8, 0, 2, 200, 201, 6, 250})
	f.Add([]byte("store lookup fetch write evict tick detach attach"))
	f.Fuzz(func(t *testing.T, prog []byte) {
		runProgram(t, prog, true)
	})
}

func TestMachineProgramsSmoke(t *testing.T) {
	for _, l2 := range []bool{false, true} {
		for i := 0; i < 200; i++ {
			p := make([]byte, 64)
			for k := range p {
				p[k] = byte(i*131 + k*17 + k*k*i)
			}
			runProgram(t, p, l2)
		}
	}
}

// progReader hands out the program's bytes (zeros past its end).
type progReader struct {
	b []byte
	i int
}

func (r *progReader) byte() byte {
	if r.i >= len(r.b) {
		r.i++
		return 0
	}
	r.i++
	return r.b[r.i-1]
}

func (r *progReader) done() bool { return r.i >= len(r.b) }

func runProgram(t *testing.T, prog []byte, l2 bool) {
	c, err := cache.New(cache.Config{Capacity: 32, DeltaLogSize: 64, Epoch: 5})
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{SlotBytes: 4096, MetaBytes: 1 << 20, RingBytes: 1 << 20, MaxSessions: 8,
		MaxBatches: 8, MaxLeases: 8, ChunkBytes: 8192}, c)
	if err != nil {
		t.Fatal(err)
	}
	ops := 8
	if l2 {
		policy := WriteThrough
		if len(prog) > 0 && prog[0]&1 == 1 {
			policy = WriteOnEvict
		}
		m.EnableL2(L2Config{Policy: policy, Timeout: 200 * time.Millisecond, WriteSlots: 4, EvictAhead: 6, MaxLookupBlocks: 3, MaxFetchBlocks: 3})
		ops = 11
	}
	out := new(Output)
	var now int64
	type sess struct {
		id   SessionID
		live bool
		req  schema.AttachRequest
		uid  uint32
	}
	sessions := []*sess{
		{req: schema.AttachRequest{Version: schema.Version, Role: schema.RoleScheduler, WorldSize: 1, DigestWidth: 32, Instance: "a", Model: "m", Layout: "l"}, uid: 1},
		{req: schema.AttachRequest{Version: schema.Version, Role: schema.RoleWorker, WorldSize: 1, DigestWidth: 32, Instance: "a", Model: "m", Layout: "l"}, uid: 1},
		{req: schema.AttachRequest{Version: schema.Version, Role: schema.RoleClient, WorldSize: 1, DigestWidth: 16, Instance: "b", Model: "m", Layout: "l", Salt: "t"}, uid: 2},
	}
	var copies []Copy
	var regs []Register
	var lookups []L2Lookup
	var fetches []L2Fetch
	var writes []L2Write
	handles := map[gpu.Handle]bool{}
	nextHandle := gpu.Handle(0)
	live := func(id SessionID) bool {
		for _, s := range sessions {
			if s.live && s.id == id {
				return true
			}
		}
		return false
	}
	drain := func() {
		for _, r := range out.Replies {
			if !live(r.Session) {
				t.Fatalf("reply to session %d, which is not live", r.Session)
			}
			if len(r.Payload) < 4 {
				t.Fatalf("reply without a status: %x", r.Payload)
			}
			if st := schema.Status(binary.LittleEndian.Uint32(r.Payload)); st > schema.ErrCodeMismatch {
				t.Fatalf("unknown status %d", st)
			}
		}
		copies = append(copies, out.Copies...)
		regs = append(regs, out.Registers...)
		lookups = append(lookups, out.L2Lookups...)
		fetches = append(fetches, out.L2Fetches...)
		writes = append(writes, out.L2Writes...)
		for _, f := range out.L2Fetches {
			for _, b := range f.Blocks {
				if len(b.PoolOffsets) != f.NS.World {
					t.Fatalf("fetch %d: a block with %d slots, world %d", f.ID, len(b.PoolOffsets), f.NS.World)
				}
			}
		}
		for _, h := range out.Unregister {
			if !handles[h] {
				t.Fatalf("unregister of handle %d, never registered or twice", h)
			}
			delete(handles, h)
		}
		if err := m.CheckInvariants(); err != nil {
			t.Fatal(err)
		}
	}
	attach := func(s *sess) {
		a, serr := m.Attach(now, AttachArgs{UID: s.uid, PID: 100 + int(s.uid), Req: &s.req, RingBytes: 1 << 16, MaxPayload: 16 << 10})
		if serr == nil {
			s.id, s.live = a.Session, true
		}
		if err := m.CheckInvariants(); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range sessions {
		attach(s)
	}
	// Valid records to mutate: what a client sends.
	dig := func(i byte, w int) []byte { d := make([]byte, w); d[0], d[w-1] = i, i^0x5a; return d }
	template := func(r *progReader, s *sess) (uint16, []byte) {
		w := int(s.req.DigestWidth)
		k := r.byte()
		switch k % 16 {
		case 0:
			var d []byte
			for i := byte(0); i < r.byte()%6; i++ {
				d = append(d, dig(i+r.byte()%3, w)...)
			}
			return schema.TypePutHashes, (&schema.PutHashes{Batch: uint64(r.byte() % 4), Flags: uint32(r.byte() % 8), Digests: d}).Append(nil, w)
		case 1:
			return schema.TypeLookup, (&schema.Lookup{View: schema.View{Batch: uint64(r.byte() % 4), Start: uint32(r.byte() % 3), Count: uint32(r.byte() % 6)}}).Append(nil)
		case 2:
			return schema.TypeAcquire, (&schema.Acquire{View: schema.View{Batch: uint64(r.byte() % 4), Count: uint32(r.byte() % 6)}, TTLms: uint32(r.byte()) * 10}).Append(nil)
		case 3:
			return schema.TypePoll, schema.IDRequest{ID: uint64(r.byte() % 6)}.Append(nil)
		case 4:
			return schema.TypeRelease, schema.IDRequest{ID: uint64(r.byte() % 6)}.Append(nil)
		case 5:
			ps := []uint64{4096, 8192, 2048}[r.byte()%3]
			return schema.TypeRegisterRegion, (&schema.RegisterRegion{Region: uint32(r.byte() % 3), Kind: schema.RegionHostProcess,
				PID: uint64(100 + s.uid), Base: 1 << 20, Length: 64 * ps, PageSize: ps, PageCount: 64}).Append(nil)
		case 6:
			var pages []uint32
			for i := byte(0); i < r.byte()%5; i++ {
				pages = append(pages, uint32(r.byte()%70))
			}
			return schema.TypeLoad, (&schema.Load{Lease: uint64(r.byte() % 6), Region: uint32(r.byte() % 3), First: uint32(r.byte() % 3), Pages: pages}).Append(nil)
		case 7:
			n := r.byte() % 5
			var pages []uint32
			for i := byte(0); i < n; i++ {
				pages = append(pages, uint32(r.byte()%70))
			}
			return schema.TypeStore, (&schema.Store{View: schema.View{Batch: uint64(r.byte() % 4), Start: uint32(r.byte() % 2), Count: uint32(n)}, Region: uint32(r.byte() % 3), Pages: pages}).Append(nil)
		case 8:
			return schema.TypeChanges, (&schema.Changes{Epoch: uint64(r.byte() % 2 * 5), Seq: uint64(r.byte()), Max: uint32(r.byte() % 4)}).Append(nil)
		case 9:
			return schema.TypeSnapshot, (&schema.Snapshot{From: uint64(r.byte() % 40), Max: uint32(r.byte() % 4)}).Append(nil)
		case 10:
			return schema.TypeDropHashes, schema.IDRequest{ID: uint64(r.byte() % 4)}.Append(nil)
		case 11:
			return schema.TypePing, schema.IDRequest{ID: 7}.Append(nil)
		case 12: // KV events (events.go)
			var runs []schema.DescribeRun
			for i := byte(0); i < r.byte()%3; i++ {
				n, t := int(r.byte()%3)+1, int(r.byte()%4)+1
				var d []byte
				for j := 0; j < n; j++ {
					d = append(d, dig(byte(j)+r.byte()%3, w)...)
				}
				run := schema.DescribeRun{Digests: d, TokensPerBlock: uint16(t), Tokens: make([]byte, 4*n*t), Extra: make([]byte, r.byte()%3)}
				if r.byte()%2 == 0 {
					run.Parent = dig(r.byte()%3, w)
				}
				runs = append(runs, run)
			}
			return schema.TypeDescribe, (&schema.Describe{Runs: runs}).Append(nil, w)
		case 13:
			return schema.TypeEvents, (&schema.Changes{Epoch: uint64(r.byte() % 2 * 5), Seq: uint64(r.byte()), Max: uint32(r.byte() % 4)}).Append(nil)
		case 14:
			return schema.TypeEventSnapshot, (&schema.Snapshot{From: uint64(r.byte() % 40), Max: uint32(r.byte() % 4)}).Append(nil)
		}
		b := make([]byte, r.byte()%40)
		for i := range b {
			b[i] = r.byte()
		}
		return uint16(r.byte())<<8 | uint16(r.byte()), b
	}
	r := &progReader{b: prog}
	for steps := 0; !r.done() && steps < 400; steps++ {
		op := r.byte()
		s := sessions[int(r.byte())%len(sessions)]
		switch int(op) % ops {
		case 0, 1, 2: // a record
			if !s.live {
				attach(s)
				continue
			}
			typ, p := template(r, s)
			if r.byte()%4 == 0 && len(p) > 0 { // mutate a byte
				p[int(r.byte())%len(p)] ^= r.byte()
			}
			seq := uint64(r.byte() % 3) // 0 sometimes: fire and forget
			m.Handle(now, s.id, typ, seq, p, out)
			end := out.End
			drain()
			if end {
				m.Detach(now, s.id, out)
				s.live = false
				drain()
			}
		case 3: // a copy ends
			if len(copies) == 0 {
				continue
			}
			i := int(r.byte()) % len(copies)
			cp := copies[i]
			copies = append(copies[:i], copies[i+1:]...)
			res := CopyResult{Bytes: int64(len(cp.Pages)) * int64(cp.PageBytes)}
			switch r.byte() % 4 {
			case 0:
				res.Err = errors.New("fuzz: copy failed")
			case 1:
				res.Exited = true
			}
			m.CopyDone(now, cp.ID, res, out)
			drain()
		case 4: // a registration ends
			if len(regs) == 0 {
				continue
			}
			rg := regs[0]
			regs = regs[1:]
			var err error
			var h gpu.Handle
			if r.byte()%4 == 0 {
				err = gpu.ErrUnsupported
			} else {
				nextHandle++
				h = nextHandle
				handles[h] = true
			}
			m.RegisterDone(now, rg.Session, rg.ID, h, err, out)
			drain()
		case 5: // time passes
			now += int64(r.byte()) * 50e6
			m.Tick(now, out)
			drain()
		case 6: // a session ends (or attaches again)
			if s.live {
				m.Detach(now, s.id, out)
				s.live = false
				drain()
			} else {
				attach(s)
			}
		case 7: // a session with copies in flight ends, its copies end later
			if s.live && len(copies) > 0 {
				m.Detach(now, s.id, out)
				s.live = false
				drain()
			}
		case 8: // a lookup of the tier ends
			if len(lookups) == 0 {
				continue
			}
			i := int(r.byte()) % len(lookups)
			lk := lookups[i]
			lookups = append(lookups[:i], lookups[i+1:]...)
			m.L2LookupDone(now, lk.ID, int(r.byte())%(len(lk.Digests)/lk.NS.Width+2), out)
			drain()
		case 9: // a fetch ends
			if len(fetches) == 0 {
				continue
			}
			i := int(r.byte()) % len(fetches)
			f := fetches[i]
			fetches = append(fetches[:i], fetches[i+1:]...)
			res := make([]L2FetchResult, len(f.Blocks))
			for k := range res {
				length := f.Length
				if length == 0 {
					length = []uint64{4096, 2048, 0, 1 << 20}[r.byte()%4]
				}
				res[k] = L2FetchResult{OK: r.byte()%3 != 0, Length: length}
			}
			m.L2FetchDone(now, f.ID, res[:int(r.byte())%(len(res)+1)], out)
			drain()
		case 10: // a write has read its slots, or was refused
			if len(writes) == 0 {
				continue
			}
			i := int(r.byte()) % len(writes)
			w := writes[i]
			writes = append(writes[:i], writes[i+1:]...)
			m.L2WriteDone(now, w.ID, r.byte()%3 == 0, out)
			drain()
		}
	}
	// Everything ends: copies complete, sessions detach; then nothing is
	// held.
	for _, rg := range regs {
		m.RegisterDone(now, rg.Session, rg.ID, 0, gpu.ErrUnsupported, out)
		drain()
	}
	for len(copies)+len(lookups)+len(fetches)+len(writes) > 0 {
		cs, ls, fs, ws := copies, lookups, fetches, writes
		copies, lookups, fetches, writes = nil, nil, nil, nil
		for _, cp := range cs {
			m.CopyDone(now, cp.ID, CopyResult{}, out)
			drain()
		}
		for _, lk := range ls {
			m.L2LookupDone(now, lk.ID, 0, out)
			drain()
		}
		for _, f := range fs {
			m.L2FetchDone(now, f.ID, nil, out)
			drain()
		}
		for _, w := range ws {
			m.L2WriteDone(now, w.ID, false, out)
			drain()
		}
	}
	for _, s := range sessions {
		if s.live {
			m.Detach(now, s.id, out)
			s.live = false
			drain()
		}
	}
	m.Tick(now+int64(1e12), out)
	drain()
	if l2 {
		if c := m.L2Counters(); c.WritingSlots != 0 || c.PendingLookups != 0 || c.PendingFetches != 0 {
			t.Fatalf("the tier holds work after the end: %+v", c)
		}
	}
	u := m.Usage()
	st := c.Stats()
	if u.Sessions != 0 || u.Queries != 0 || u.Copies != 0 || u.Namespaces > 2 || st.Leases != 0 || st.Loads != 0 || st.Writers != 0 || st.PinnedBlocks != 0 {
		t.Fatalf("after every session ended: %+v, pool %+v", u, st)
	}
	if m.total != (usage{}) && m.total.meta != int64(len(m.namespaces))*namespaceMeta {
		t.Fatalf("usage left after the end: %+v", m.total)
	}
}
