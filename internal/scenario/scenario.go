// Package scenario runs the protocol scenarios of testdata/scenarios
// (their language is documented in testdata/scenarios/README.md) against a
// Driver: the pure state machine (sidecar/machine's tests) or a real sidecar
// through the connector (sidecar's tests). The Python driver
// (connector/python/tests/test_scenarios.py) implements the same language;
// every driver must print exactly the expected output.
//
// Test support only: nothing in the product imports it.
package scenario

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/ringside-kv/ringside/schema"
)

// RingCapacity is the data capacity of every session ring in scenarios.
const RingCapacity = 64 << 10

// Config is the sidecar a scenario runs against (its `sidecar` command).
type Config struct {
	Slots      int
	SlotBytes  uint64
	Budget     int64  // 0: the sidecar's default
	ChunkBytes uint64 // 0: the sidecar's default
}

// AttachOptions are an attach request's fields.
type AttachOptions struct {
	Instance, Model, Layout, Salt string
	Role                          uint16
	Rank, WorldSize, DigestWidth  int
}

// Pool is what `pool` prints of the cache's counters.
type Pool struct {
	Blocks, Pending, Pinned, Leases, Loads, Writers, Used, Free int
}

// Memory is client memory a region is registered over.
type Memory interface {
	Bytes() []byte
	Base() uint64
}

// Driver runs scenarios against one implementation of the protocol.
type Driver interface {
	// Start starts the sidecar (once, before anything else).
	Start(cfg Config) error
	// Attach attaches a session; a refusal is a *schema.Error.
	Attach(o AttachOptions) (Session, error)
	// PID is the process id sessions attach with.
	PID() int
	// Memory allocates n zeroed bytes of client memory.
	Memory(n int) Memory
	// Pool reports the cache's counters.
	Pool() (Pool, error)
}

// Session is one attached session. Its request methods are those of
// connector.Client: a refusal is a *schema.Error, anything else fails the
// scenario.
type Session interface {
	PutHashesFlags(batch uint64, digests []byte, flags uint32) (int, error)
	DropHashes(batch uint64) error
	Lookup(v schema.View) (int, error)
	Acquire(v schema.View, ttl time.Duration) (schema.LeaseReply, error)
	Poll(lease uint64) (schema.LeaseReply, error)
	Release(lease uint64) error
	RegisterRegion(r schema.RegisterRegion) error
	Load(lease uint64, region, first uint32, pages []uint32) (int, error)
	Store(v schema.View, region uint32, pages []uint32) (schema.StoreReply, error)
	Changes(epoch, seq uint64, max uint32) (schema.ChangesReply, error)
	Snapshot(from uint64, max uint32) (schema.SnapshotReply, error)
	Ping(v uint64) error
	// Call sends one request and returns its reply payload.
	Call(typ uint16, payload []byte) ([]byte, error)
	// Quiet sends one request with seq 0 and returns the status of the
	// reply it got, if any (replied false: none, as a success gets none).
	Quiet(typ uint16, payload []byte) (st schema.Status, replied bool, err error)
	// Detach ends the session cleanly, Abandon as a crashed process: both
	// return once the sidecar has forgotten the session.
	Detach() error
	Abandon() error
}

// Files lists the scenario files of dir.
func Files(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.txt"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no scenarios in %s (%v)", dir, err)
	}
	sort.Strings(files)
	return files
}

// RunAll runs every scenario of dir as a subtest, each with a fresh driver.
func RunAll(t *testing.T, dir string, newDriver func(t *testing.T) Driver) {
	for _, f := range Files(t, dir) {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".txt"), func(t *testing.T) {
			Run(t, f, newDriver(t))
		})
	}
}

// Run runs one scenario file against d.
func Run(t *testing.T, path string, d Driver) {
	r := &runner{d: d, sessions: map[string]*sess{}, leases: map[string]uint64{}, cursors: map[string]cursor{},
		names: map[string]string{}, contents: map[[32]byte]string{}, chains: map[string][][32]byte{}}
	datadriven.RunTest(t, path, func(t *testing.T, td *datadriven.TestData) string {
		out, err := r.exec(td)
		if err != nil {
			t.Fatalf("%s: %s: %v", td.Pos, td.Cmd, err)
		}
		return out
	})
}

type sess struct {
	s       Session
	width   int
	regions map[uint32]*region
}

type region struct {
	mem       Memory
	pageBytes int
	pages     int
}

type cursor struct{ epoch, seq uint64 }

type runner struct {
	d        Driver
	cfg      Config
	started  bool
	sessions map[string]*sess
	leases   map[string]uint64
	cursors  map[string]cursor
	names    map[string]string     // digest bytes (at any width) -> SEED#I
	contents map[[32]byte]string   // sha256 of a page's content -> TAG#I
	chains   map[string][][32]byte // SEED -> its digests so far
}

// args is a command's arguments, each consumed once: an argument the
// command does not know is an error.
type args struct {
	m    map[string]string
	used map[string]bool
}

func newArgs(td *datadriven.TestData) (*args, error) {
	a := &args{m: map[string]string{}, used: map[string]bool{}}
	for _, c := range td.CmdArgs {
		if len(c.Vals) > 1 {
			return nil, fmt.Errorf("argument %s: one value, no parentheses", c.Key)
		}
		if _, dup := a.m[c.Key]; dup {
			return nil, fmt.Errorf("argument %s given twice", c.Key)
		}
		v := ""
		if len(c.Vals) == 1 {
			v = c.Vals[0]
		}
		a.m[c.Key] = v
	}
	return a, nil
}

func (a *args) has(k string) bool {
	_, ok := a.m[k]
	a.used[k] = true
	return ok
}

func (a *args) str(k, def string) string {
	a.used[k] = true
	if v, ok := a.m[k]; ok {
		return v
	}
	return def
}

func (a *args) need(k string) (string, error) {
	a.used[k] = true
	v, ok := a.m[k]
	if !ok {
		return "", fmt.Errorf("missing argument %s=", k)
	}
	return v, nil
}

func (a *args) num(k string, def uint64) (uint64, error) {
	a.used[k] = true
	v, ok := a.m[k]
	if !ok {
		return def, nil
	}
	n, err := strconv.ParseUint(v, 0, 64)
	if err != nil {
		return 0, fmt.Errorf("argument %s=%s: not a number", k, v)
	}
	return n, nil
}

func (a *args) needNum(k string) (uint64, error) {
	if _, err := a.need(k); err != nil {
		return 0, err
	}
	return a.num(k, 0)
}

func (a *args) done() error {
	var extra []string
	for k := range a.m {
		if !a.used[k] {
			extra = append(extra, k)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		return fmt.Errorf("unknown arguments %v", extra)
	}
	return nil
}

// errStatus formats a refusal; any other error fails the scenario.
func errStatus(err error) (string, error) {
	var se *schema.Error
	if errors.As(err, &se) {
		return StatusString(se.Status), nil
	}
	return "", err
}

// StatusString is how a status prints.
func StatusString(st schema.Status) string {
	return fmt.Sprintf("status %d (%s)", uint32(st), st)
}

func (r *runner) exec(td *datadriven.TestData) (string, error) {
	a, err := newArgs(td)
	if err != nil {
		return "", err
	}
	if td.Cmd == "sidecar" {
		if r.started {
			return "", errors.New("sidecar must be the first command")
		}
		return r.start(a)
	}
	if !r.started {
		if _, err := r.start(&args{m: map[string]string{}, used: map[string]bool{}}); err != nil {
			return "", err
		}
	}
	var out string
	switch td.Cmd {
	case "attach":
		out, err = r.attach(a)
	case "pool":
		out, err = r.pool()
	default:
		out, err = r.request(td, a)
	}
	if err != nil {
		return "", err
	}
	if err := a.done(); err != nil {
		return "", err
	}
	return out, nil
}

func (r *runner) start(a *args) (string, error) {
	var c Config
	slots, err := a.num("slots", 64)
	if err != nil {
		return "", err
	}
	c.Slots = int(slots)
	if c.SlotBytes, err = a.num("slot-bytes", 4096); err != nil {
		return "", err
	}
	b, err := a.num("budget", 0)
	if err != nil {
		return "", err
	}
	c.Budget = int64(b)
	if c.ChunkBytes, err = a.num("chunk-bytes", 0); err != nil {
		return "", err
	}
	if err := a.done(); err != nil {
		return "", err
	}
	if err := r.d.Start(c); err != nil {
		return "", err
	}
	r.cfg, r.started = c, true
	return "ok", nil
}

var roles = map[string]uint16{"client": schema.RoleClient, "scheduler": schema.RoleScheduler, "worker": schema.RoleWorker}

func (r *runner) attach(a *args) (string, error) {
	name, err := a.need("s")
	if err != nil {
		return "", err
	}
	if _, dup := r.sessions[name]; dup {
		return "", fmt.Errorf("session %s is attached already", name)
	}
	o := AttachOptions{Instance: a.str("instance", "engine-a"), Model: a.str("model", "llama"),
		Layout: a.str("layout", "bf16/16/HND"), Salt: a.str("salt", "")}
	role, ok := roles[a.str("role", "client")]
	if !ok {
		return "", fmt.Errorf("role %q: client, scheduler or worker", a.str("role", ""))
	}
	o.Role = role
	rank, err := a.num("rank", 0)
	if err != nil {
		return "", err
	}
	world, err := a.num("world", 1)
	if err != nil {
		return "", err
	}
	width, err := a.num("width", 32)
	if err != nil {
		return "", err
	}
	o.Rank, o.WorldSize, o.DigestWidth = int(rank), int(world), int(width)
	s, err := r.d.Attach(o)
	if err != nil {
		return errStatus(err)
	}
	r.sessions[name] = &sess{s: s, width: o.DigestWidth, regions: map[uint32]*region{}}
	return "ok", nil
}

func (r *runner) pool() (string, error) {
	p, err := r.d.Pool()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("blocks=%d pending=%d pinned=%d leases=%d loads=%d writers=%d used=%d free=%d",
		p.Blocks, p.Pending, p.Pinned, p.Leases, p.Loads, p.Writers, p.Used, p.Free), nil
}

// sessionCommands are the commands of one session (s=NAME).
var sessionCommands = map[string]bool{
	"detach": true, "abandon": true, "put": true, "drop": true, "lookup": true, "acquire": true, "poll": true,
	"release": true, "region": true, "fill": true, "check": true, "store": true, "load": true, "changes": true,
	"snapshot": true, "ping": true, "raw": true, "send": true,
}

// request runs a command of one session.
func (r *runner) request(td *datadriven.TestData, a *args) (string, error) {
	if !sessionCommands[td.Cmd] {
		return "", fmt.Errorf("unknown command %q", td.Cmd)
	}
	name, err := a.need("s")
	if err != nil {
		return "", err
	}
	s := r.sessions[name]
	if s == nil {
		return "", fmt.Errorf("no session %s", name)
	}
	switch td.Cmd {
	case "detach", "abandon":
		if td.Cmd == "detach" {
			err = s.s.Detach()
		} else {
			err = s.s.Abandon()
		}
		if err != nil {
			return "", err
		}
		delete(r.sessions, name)
		return "ok", nil
	case "put":
		return r.put(s, a)
	case "drop":
		b, err := a.needNum("batch")
		if err != nil {
			return "", err
		}
		if a.has("quiet") {
			return r.quiet(s, schema.TypeDropHashes, schema.IDRequest{ID: b}.Append(nil))
		}
		return okOr(s.s.DropHashes(b))
	case "lookup":
		v, err := view(a, true)
		if err != nil {
			return "", err
		}
		n, err := s.s.Lookup(v)
		if err != nil {
			return errStatus(err)
		}
		return fmt.Sprintf("hits=%d", n), nil
	case "acquire":
		return r.acquire(s, a)
	case "poll":
		id, err := r.lease(a)
		if err != nil {
			return "", err
		}
		l, err := s.s.Poll(id)
		if err != nil {
			return errStatus(err)
		}
		return fmt.Sprintf("%s blocks=%d", l.State, l.Blocks), nil
	case "release":
		id, err := r.lease(a)
		if err != nil {
			return "", err
		}
		if a.has("quiet") {
			return r.quiet(s, schema.TypeRelease, schema.IDRequest{ID: id}.Append(nil))
		}
		return okOr(s.s.Release(id))
	case "region":
		return r.region(s, a)
	case "fill":
		return r.fill(s, a)
	case "check":
		return r.check(s, a)
	case "store":
		return r.store(s, a)
	case "load":
		return r.load(s, a)
	case "changes":
		return r.changes(s, a)
	case "snapshot":
		return r.snapshot(s, a)
	case "ping":
		v, err := a.num("v", 0)
		if err != nil {
			return "", err
		}
		if err := s.s.Ping(v); err != nil {
			return errStatus(err)
		}
		return fmt.Sprintf("pong %d", v), nil
	case "raw", "send":
		typ, payload, err := rawRequest(td, a)
		if err != nil {
			return "", err
		}
		if td.Cmd == "send" {
			return r.quiet(s, typ, payload)
		}
		b, err := s.s.Call(typ, payload)
		if err != nil {
			return "", err
		}
		if len(b) < 4 {
			return "", fmt.Errorf("reply of %d bytes has no status", len(b))
		}
		return StatusString(schema.Status(binary.LittleEndian.Uint32(b))), nil
	}
	return "", fmt.Errorf("unknown command %q", td.Cmd)
}

func okOr(err error) (string, error) {
	if err != nil {
		return errStatus(err)
	}
	return "ok", nil
}

func (r *runner) quiet(s *sess, typ uint16, payload []byte) (string, error) {
	st, replied, err := s.s.Quiet(typ, payload)
	if err != nil {
		return "", err
	}
	if !replied {
		return "no reply", nil
	}
	return StatusString(st), nil
}

func (r *runner) put(s *sess, a *args) (string, error) {
	b, err := a.needNum("batch")
	if err != nil {
		return "", err
	}
	spec, err := a.need("d")
	if err != nil {
		return "", err
	}
	d, err := r.digests(spec, s.width)
	if err != nil {
		return "", err
	}
	var flags uint32
	for _, f := range []struct {
		name string
		flag uint32
	}{{"append", schema.FlagAppend}, {"lookup", schema.FlagLookup}, {"replace", schema.FlagReplace}} {
		if a.has(f.name) {
			flags |= f.flag
		}
	}
	if a.has("quiet") {
		m := schema.PutHashes{Batch: b, Flags: flags, Digests: d}
		return r.quiet(s, schema.TypePutHashes, m.Append(nil, s.width))
	}
	n, err := s.s.PutHashesFlags(b, d, flags)
	if err != nil {
		return errStatus(err)
	}
	if flags&schema.FlagLookup != 0 {
		return fmt.Sprintf("hits=%d", n), nil
	}
	return fmt.Sprintf("len=%d", n), nil
}

func view(a *args, needCount bool) (schema.View, error) {
	var v schema.View
	var err error
	if v.Batch, err = a.needNum("batch"); err != nil {
		return v, err
	}
	start, err := a.num("start", 0)
	if err != nil {
		return v, err
	}
	v.Start = uint32(start)
	if needCount {
		c, err := a.needNum("count")
		if err != nil {
			return v, err
		}
		v.Count = uint32(c)
	}
	return v, nil
}

func (r *runner) lease(a *args) (uint64, error) {
	l, err := a.need("lease")
	if err != nil {
		return 0, err
	}
	if n, err := strconv.ParseUint(l, 10, 64); err == nil {
		return n, nil
	}
	id, ok := r.leases[l]
	if !ok {
		return 0, fmt.Errorf("no lease %s", l)
	}
	return id, nil
}

func (r *runner) acquire(s *sess, a *args) (string, error) {
	v, err := view(a, true)
	if err != nil {
		return "", err
	}
	name, err := a.need("as")
	if err != nil {
		return "", err
	}
	if _, err := strconv.ParseUint(name, 10, 64); err == nil || name == "" {
		return "", fmt.Errorf("lease name %q: a number names a lease id", name)
	}
	ttl, err := a.num("ttl", 0)
	if err != nil {
		return "", err
	}
	l, err := s.s.Acquire(v, time.Duration(ttl)*time.Second)
	if err != nil {
		return errStatus(err)
	}
	r.leases[name] = l.Lease
	if (l.Lease == 0) != (l.State == schema.StateMiss) {
		return "", fmt.Errorf("lease %d in state %s", l.Lease, l.State)
	}
	return fmt.Sprintf("%s blocks=%d", l.State, l.Blocks), nil
}

func (r *runner) region(s *sess, a *args) (string, error) {
	id, err := a.needNum("id")
	if err != nil {
		return "", err
	}
	pages, err := a.needNum("pages")
	if err != nil {
		return "", err
	}
	pb, err := a.num("page-bytes", r.cfg.SlotBytes)
	if err != nil {
		return "", err
	}
	declared, err := a.num("declare-pages", pages)
	if err != nil {
		return "", err
	}
	if pages == 0 || pages > 1<<16 || pb == 0 || pb > 1<<20 {
		return "", fmt.Errorf("region of %d pages of %d bytes: out of what scenarios allocate", pages, pb)
	}
	mem := r.d.Memory(int(pages * pb))
	reg := schema.RegisterRegion{Region: uint32(id), Kind: schema.RegionHostProcess, PID: uint64(r.d.PID()),
		Base: mem.Base(), Length: uint64(len(mem.Bytes())), PageSize: pb, PageCount: uint32(declared)}
	switch a.str("pid", "") {
	case "":
	case "other":
		reg.PID++
	default:
		return "", errors.New("pid=other is the only pid")
	}
	switch a.str("kind", "host") {
	case "host":
	case "cuda":
		reg.Kind = schema.RegionCUDAIPC
	default:
		return "", errors.New("kind: host or cuda")
	}
	var st string
	if a.has("quiet") {
		st, err = r.quiet(s, schema.TypeRegisterRegion, reg.Append(nil))
	} else {
		st, err = okOr(s.s.RegisterRegion(reg))
	}
	if err != nil {
		return "", err
	}
	if (st == "ok" || st == "no reply") && s.regions[uint32(id)] == nil {
		s.regions[uint32(id)] = &region{mem: mem, pageBytes: int(pb), pages: int(pages)}
	}
	return st, nil
}

func (r *runner) memRegion(s *sess, a *args) (*region, error) {
	id, err := a.needNum("region")
	if err != nil {
		return nil, err
	}
	rg := s.regions[uint32(id)]
	if rg == nil {
		return nil, fmt.Errorf("no region %d registered in this session", id)
	}
	return rg, nil
}

func (r *runner) fill(s *sess, a *args) (string, error) {
	rg, err := r.memRegion(s, a)
	if err != nil {
		return "", err
	}
	tag, err := a.need("tag")
	if err != nil {
		return "", err
	}
	if tag == "" || strings.ContainsAny(tag, "#, ") || tag == "zero" || tag == "unknown" {
		return "", fmt.Errorf("tag %q", tag)
	}
	spec, err := a.need("pages")
	if err != nil {
		return "", err
	}
	pages, err := PageList(spec)
	if err != nil {
		return "", err
	}
	for _, p := range pages {
		if int(p) >= rg.pages {
			return "", fmt.Errorf("page %d past the region's %d pages", p, rg.pages)
		}
		c := Content(tag, int(p), rg.pageBytes)
		copy(rg.mem.Bytes()[int(p)*rg.pageBytes:], c)
		r.contents[sha256.Sum256(c)] = fmt.Sprintf("%s#%d", tag, p)
	}
	return "ok", nil
}

func (r *runner) check(s *sess, a *args) (string, error) {
	rg, err := r.memRegion(s, a)
	if err != nil {
		return "", err
	}
	var pages []uint32
	if spec := a.str("pages", ""); a.has("pages") {
		if pages, err = PageList(spec); err != nil {
			return "", err
		}
	} else {
		for p := 0; p < rg.pages; p++ {
			pages = append(pages, uint32(p))
		}
	}
	var b strings.Builder
	zero := make([]byte, rg.pageBytes)
	for _, p := range pages {
		if int(p) >= rg.pages {
			return "", fmt.Errorf("page %d past the region's %d pages", p, rg.pages)
		}
		pg := rg.mem.Bytes()[int(p)*rg.pageBytes : int(p+1)*rg.pageBytes]
		name := "unknown"
		if bytes.Equal(pg, zero) {
			name = "zero"
		} else if n, ok := r.contents[sha256.Sum256(pg)]; ok {
			name = n
		}
		fmt.Fprintf(&b, "%d: %s\n", p, name)
	}
	return b.String(), nil
}

func (r *runner) store(s *sess, a *args) (string, error) {
	v, err := view(a, false)
	if err != nil {
		return "", err
	}
	id, err := a.needNum("region")
	if err != nil {
		return "", err
	}
	spec, err := a.need("pages")
	if err != nil {
		return "", err
	}
	pages, err := PageList(spec)
	if err != nil {
		return "", err
	}
	v.Count = uint32(len(pages))
	st, err := s.s.Store(v, uint32(id), pages)
	if err != nil {
		return errStatus(err)
	}
	return fmt.Sprintf("stored=%d present=%d skipped=%d", st.Stored, st.Present, st.Skipped), nil
}

func (r *runner) load(s *sess, a *args) (string, error) {
	l, err := r.lease(a)
	if err != nil {
		return "", err
	}
	id, err := a.needNum("region")
	if err != nil {
		return "", err
	}
	first, err := a.num("first", 0)
	if err != nil {
		return "", err
	}
	spec, err := a.need("pages")
	if err != nil {
		return "", err
	}
	pages, err := PageList(spec)
	if err != nil {
		return "", err
	}
	n, err := s.s.Load(l, uint32(id), uint32(first), pages)
	if err != nil {
		return errStatus(err)
	}
	return fmt.Sprintf("loaded=%d", n), nil
}

func (r *runner) cursorArg(a *args, k string) (cursor, bool, error) {
	name := a.str(k, "")
	if !a.has(k) {
		return cursor{}, false, nil
	}
	c, ok := r.cursors[name]
	if !ok {
		return c, false, fmt.Errorf("no cursor %s", name)
	}
	return c, true, nil
}

func (r *runner) digestName(d []byte) string {
	if n, ok := r.names[string(d)]; ok {
		return n
	}
	return "unknown"
}

func (r *runner) changes(s *sess, a *args) (string, error) {
	from, _, err := r.cursorArg(a, "from")
	if err != nil {
		return "", err
	}
	if a.has("wrong-epoch") {
		from.epoch++
	}
	max, err := a.num("max", 0)
	if err != nil {
		return "", err
	}
	as := a.str("as", "")
	rep, err := s.s.Changes(from.epoch, from.seq, uint32(max))
	if err != nil {
		return errStatus(err)
	}
	if as != "" {
		r.cursors[as] = cursor{rep.Epoch, rep.Next}
	}
	var b strings.Builder
	if rep.Resync {
		b.WriteString("resync ")
	}
	fmt.Fprintf(&b, "entries=%d\n", rep.Len())
	for i := 0; i < rep.Len(); i++ {
		op, d := rep.ChangeAt(i)
		switch op {
		case schema.OpStored:
			fmt.Fprintf(&b, "stored %s\n", r.digestName(d))
		case schema.OpEvicted:
			fmt.Fprintf(&b, "evicted %s\n", r.digestName(d))
		case schema.OpCleared:
			b.WriteString("cleared\n")
		default:
			fmt.Fprintf(&b, "op(%d) %s\n", op, r.digestName(d))
		}
	}
	return b.String(), nil
}

func (r *runner) snapshot(s *sess, a *args) (string, error) {
	from, err := a.num("from", 0)
	if err != nil {
		return "", err
	}
	max, err := a.num("max", 0)
	if err != nil {
		return "", err
	}
	as := a.str("as", "")
	rep, err := s.s.Snapshot(from, uint32(max))
	if err != nil {
		return errStatus(err)
	}
	if as != "" {
		r.cursors[as] = cursor{rep.Epoch, rep.Seq}
	}
	var b strings.Builder
	state := "more"
	if rep.Done {
		state = "done"
	}
	fmt.Fprintf(&b, "%s next=%d entries=%d\n", state, rep.Next, rep.Len())
	for i := 0; i < rep.Len(); i++ {
		fmt.Fprintf(&b, "%s\n", r.digestName(rep.DigestAt(i)))
	}
	return b.String(), nil
}

var typeNames = map[string]uint16{
	"put": schema.TypePutHashes, "drop": schema.TypeDropHashes, "lookup": schema.TypeLookup,
	"acquire": schema.TypeAcquire, "poll": schema.TypePoll, "release": schema.TypeRelease,
	"region": schema.TypeRegisterRegion, "load": schema.TypeLoad, "store": schema.TypeStore,
	"changes": schema.TypeChanges, "detach": schema.TypeDetach, "ping": schema.TypePing,
	"snapshot": schema.TypeSnapshot,
}

func rawRequest(td *datadriven.TestData, a *args) (uint16, []byte, error) {
	ts, err := a.need("type")
	if err != nil {
		return 0, nil, err
	}
	typ, ok := typeNames[ts]
	if !ok {
		n, err := strconv.ParseUint(ts, 0, 16)
		if err != nil {
			return 0, nil, fmt.Errorf("type %q: a number or a request name", ts)
		}
		typ = uint16(n)
	}
	h := a.str("payload", "")
	if td.Input != "" {
		if a.has("payload") {
			return 0, nil, errors.New("payload both as argument and input")
		}
		h = td.Input
	}
	h = strings.Join(strings.Fields(h), "")
	p, err := hex.DecodeString(h)
	if err != nil {
		return 0, nil, fmt.Errorf("payload: %v", err)
	}
	return typ, p, nil
}

// PageList parses a page list: comma-separated indices and inclusive
// ranges ("0-3,7"); "" is the empty list.
func PageList(spec string) ([]uint32, error) {
	var out []uint32
	if spec == "" {
		return out, nil
	}
	for _, item := range strings.Split(spec, ",") {
		lo, hi, isRange := strings.Cut(item, "-")
		a, err := strconv.ParseUint(lo, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("page list %q: %q", spec, item)
		}
		b := a
		if isRange {
			if b, err = strconv.ParseUint(hi, 10, 32); err != nil || b < a || b-a > 1<<16 {
				return nil, fmt.Errorf("page list %q: %q", spec, item)
			}
		}
		for p := a; p <= b; p++ {
			out = append(out, uint32(p))
		}
	}
	return out, nil
}

// digests parses a digest list ("p#0-5,q#0") into the digests' bytes cut
// to width, and remembers their names.
func (r *runner) digests(spec string, width int) ([]byte, error) {
	var out []byte
	if spec == "" {
		return out, nil
	}
	for _, item := range strings.Split(spec, ",") {
		seed, rng, ok := strings.Cut(item, "#")
		if !ok || seed == "" {
			return nil, fmt.Errorf("digest list %q: %q is not SEED#I or SEED#I-J", spec, item)
		}
		lo, hi, isRange := strings.Cut(rng, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b >= 1<<16 {
			return nil, fmt.Errorf("digest list %q: %q", spec, item)
		}
		chain := r.chain(seed, b+1)
		for i := a; i <= b; i++ {
			d := chain[i][:width]
			r.names[string(d)] = fmt.Sprintf("%s#%d", seed, i)
			out = append(out, d...)
		}
	}
	return out, nil
}

func (r *runner) chain(seed string, n int) [][32]byte {
	c := r.chains[seed]
	for len(c) < n {
		var prev [32]byte
		if len(c) == 0 {
			prev = sha256.Sum256([]byte(seed))
		} else {
			prev = c[len(c)-1]
		}
		c = append(c, sha256.Sum256(append(prev[:], byte(len(c)))))
	}
	r.chains[seed] = c
	return c
}

// Content is the content named TAG#I of a page of n bytes.
func Content(tag string, i, n int) []byte {
	seed := sha256.Sum256([]byte(fmt.Sprintf("%s#%d", tag, i)))
	out := make([]byte, 0, n+32)
	var k [4]byte
	for j := 0; len(out) < n; j++ {
		binary.LittleEndian.PutUint32(k[:], uint32(j))
		h := sha256.Sum256(append(seed[:], k[:]...))
		out = append(out, h[:]...)
	}
	return out[:n]
}
