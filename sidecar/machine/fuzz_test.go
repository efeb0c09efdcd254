package machine_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/gpu"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/machine"
	"github.com/ringside-kv/ringside/sidecar/machine/machinetest"
)

// FuzzMachine drives a Machine with a program read from the input: three
// sessions (two of one instance, one of another tenant, two uids) send
// records of any type and payload (mutated from valid ones), copies end in
// any order with success or failure, registrations succeed or fail,
// sessions end and attach again, time passes. The program drives a
// machinetest.Env that holds every copy, registration and call of the
// tier for the program to end: after every step the Machine's and the
// cache's invariants must hold, every reply must go to a live session and
// start with a known status, every copy must stay inside its region, the
// pool and its slots (the Env moves the bytes), and no call may panic.
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
	cfg := machinetest.Config{
		Cache: cache.Config{Capacity: 32, DeltaLogSize: 64, Epoch: 5},
		Machine: machine.Config{SlotBytes: 4096, MetaBytes: 1 << 20, RingBytes: 1 << 20, MaxSessions: 8,
			MaxBatches: 8, MaxLeases: 8, ChunkBytes: 8192},
	}
	ops := 8
	if l2 {
		policy := machine.WriteThrough
		if len(prog) > 0 && prog[0]&1 == 1 {
			policy = machine.WriteOnEvict
		}
		cfg.L2 = machine.L2Config{Enabled: true, Policy: policy, Timeout: 200 * time.Millisecond, WriteSlots: 4, EvictAhead: 6,
			MaxLookupBlocks: 3, MaxFetchBlocks: 3}
		ops = 11
	}
	env := machinetest.New(t, cfg)
	env.HoldCopies, env.HoldRegisters, env.HoldTier = true, true, true
	env.Step = 0 // time passes only at the program's ticks
	m := env.M
	type sess struct {
		id   machine.SessionID
		live bool
		req  schema.AttachRequest
		uid  uint32
		base uint64 // the engine memory its regions are registered over
	}
	sessions := []*sess{
		{req: schema.AttachRequest{Version: schema.Version, Role: schema.RoleScheduler, WorldSize: 1, DigestWidth: 32, Instance: "a", Model: "m", Layout: "l"}, uid: 1},
		{req: schema.AttachRequest{Version: schema.Version, Role: schema.RoleWorker, WorldSize: 1, DigestWidth: 32, Instance: "a", Model: "m", Layout: "l"}, uid: 1},
		{req: schema.AttachRequest{Version: schema.Version, Role: schema.RoleClient, WorldSize: 1, DigestWidth: 16, Instance: "b", Model: "m", Layout: "l", Salt: "t"}, uid: 2},
	}
	for _, s := range sessions {
		_, s.base = env.Memory(64 * 8192)
	}
	attach := func(s *sess) {
		a, serr := env.Attach(machine.AttachArgs{UID: s.uid, PID: 100 + int(s.uid), Req: &s.req, RingBytes: 1 << 16, MaxPayload: 16 << 10})
		if serr == nil {
			s.id, s.live = a.Session, true
		}
	}
	for _, s := range sessions {
		attach(s)
	}
	// handle hands a record to the Machine; a session that asked to end
	// is detached by the Env.
	handle := func(s *sess, typ uint16, seq uint64, p []byte) {
		if env.Handle(s.id, typ, seq, p) {
			s.live = false
		}
	}
	detach := func(s *sess) {
		env.Detach(s.id)
		s.live = false
	}
	// Valid records to mutate: what a client sends.
	dig := func(i byte, w int) []byte { d := make([]byte, w); d[0], d[w-1] = i, i^0x5a; return d }
	template := func(r *progReader, s *sess) (uint16, []byte) {
		w := int(s.req.DigestWidth)
		k := r.byte()
		switch k % 17 {
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
				PID: uint64(100 + s.uid), Base: s.base, Length: 64 * ps, PageSize: ps, PageCount: 64}).Append(nil)
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
		case 15: // retention (a ttl of 0, priority 4 or flag bit 1 are malformed), of owner 0 to 2
			return schema.TypeRetain, (&schema.Retain{View: schema.View{Batch: uint64(r.byte() % 4), Start: uint32(r.byte() % 3), Count: uint32(r.byte() % 6)},
				TTLms: uint32(r.byte()) * 10, Priority: r.byte() % 5, Flags: r.byte() % 3, Owner: uint64(r.byte() % 3)}).Append(nil)
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
			handle(s, typ, seq, p)
		case 3: // a copy ends
			if len(env.Copies) == 0 {
				continue
			}
			i := int(r.byte()) % len(env.Copies)
			switch r.byte() % 4 {
			case 0:
				env.EndCopy(i, errors.New("fuzz: copy failed"), false)
			case 1:
				env.EndCopy(i, nil, true)
			default:
				env.EndCopy(i, nil, false)
			}
		case 4: // a registration ends
			if len(env.Registers) == 0 {
				continue
			}
			var err error
			if r.byte()%4 == 0 {
				err = gpu.ErrUnsupported
			}
			env.EndRegister(0, err)
		case 5: // time passes
			env.Tick(time.Duration(r.byte()) * 50 * time.Millisecond)
		case 6: // a session ends (or attaches again)
			if s.live {
				detach(s)
			} else {
				attach(s)
			}
		case 7: // a session with copies in flight ends, its copies end later
			if s.live && len(env.Copies) > 0 {
				detach(s)
			}
		case 8: // a lookup of the tier ends
			if len(env.Lookups) == 0 {
				continue
			}
			i := int(r.byte()) % len(env.Lookups)
			lk := env.Lookups[i]
			env.EndLookup(i, int(r.byte())%(len(lk.Digests)/lk.NS.Width+2))
		case 9: // a fetch ends
			if len(env.Fetches) == 0 {
				continue
			}
			i := int(r.byte()) % len(env.Fetches)
			f := env.Fetches[i]
			res := make([]machine.L2FetchResult, len(f.Blocks))
			for k := range res {
				length := f.Length
				if length == 0 {
					length = []uint64{4096, 2048, 0, 1 << 20}[r.byte()%4]
				}
				res[k] = machine.L2FetchResult{OK: r.byte()%3 != 0, Length: length}
			}
			env.EndFetch(i, res[:int(r.byte())%(len(res)+1)])
		case 10: // a write has read its slots, or was refused
			if len(env.Writes) == 0 {
				continue
			}
			env.DeliverWrite(int(r.byte())%len(env.Writes), r.byte()%3 == 0)
		}
	}
	// Everything ends: registrations fail, copies complete, the tier's
	// calls end, sessions detach; then nothing is held.
	for len(env.Registers) > 0 {
		env.EndRegister(0, gpu.ErrUnsupported)
	}
	for len(env.Copies)+len(env.Lookups)+len(env.Fetches)+len(env.Writes) > 0 {
		switch {
		case len(env.Copies) > 0:
			env.EndCopy(0, nil, false)
		case len(env.Lookups) > 0:
			env.EndLookup(0, 0)
		case len(env.Fetches) > 0:
			env.EndFetch(0, nil)
		default:
			env.EndWrite(0, false)
		}
	}
	for _, s := range sessions {
		if s.live {
			detach(s)
		}
	}
	env.Tick(1e12)
	if l2 {
		if c := m.L2Counters(); c.WritingSlots != 0 || c.PendingLookups != 0 || c.PendingFetches != 0 {
			t.Fatalf("the tier holds work after the end: %+v", c)
		}
	}
	u := m.Usage()
	st := m.Cache().Stats()
	if u.Sessions != 0 || u.Queries != 0 || u.Copies != 0 || u.Namespaces > 2 || st.Leases != 0 || st.Loads != 0 || st.Writers != 0 || st.PinnedBlocks != 0 {
		t.Fatalf("after every session ended: %+v, pool %+v", u, st)
	}
	if err := m.Leftover(); err != nil {
		t.Fatal(err)
	}
}
