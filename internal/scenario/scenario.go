// Package scenario runs the protocol scenarios of testdata/scenarios
// (their language is documented in testdata/scenarios/README.md) against a
// Driver: the pure state machine (sidecar/machine's tests, over
// sidecar/machine/machinetest) or real sidecars (sidecar's tests). Both
// drive their sessions through connector.Client, the pure driver with a
// transport over the Machine. The Python driver
// (connector/python/tests/test_scenarios.py) implements the same language;
// every driver must print exactly the expected output.
//
// Like etcd's raft interaction tests, the order of everything the sidecar
// does on its own (copies, the shared tier's lookups, fetches and writes,
// the passing of time) is a script line where a driver lets the script
// order it (Orderer: the pure driver); a file that orders names the
// drivers that run it.
//
// Test support only: nothing in the product imports it.
package scenario

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

// RingCapacity is the data capacity of every session ring in scenarios.
const RingCapacity = 64 << 10

// Config is one sidecar (node) of a scenario: its `sidecar` command.
type Config struct {
	Slots      int
	SlotBytes  uint64
	Budget     int64  // 0: the sidecar's default
	ChunkBytes uint64 // 0: the sidecar's default
	// PinShare, RetainShare, PendingShare and SessionShare are the
	// sidecar's --limits shares, and MetaBytes its metadata bound (0: the
	// defaults).
	PinShare, RetainShare, PendingShare, SessionShare float64
	MetaBytes                                         int64
	// Tier is the shared tier, which every node of the scenario with one
	// shares; nil: none.
	Tier *TierConfig
}

// TierConfig is a node's shared tier.
type TierConfig struct {
	WriteOnEvict bool // the policy: write-on-evict, or write-through
	// WriteSlots and EvictAhead are the sidecar's --l2 settings (0: its
	// defaults).
	WriteSlots, EvictAhead int
}

// AttachOptions are an attach request's fields.
type AttachOptions struct {
	Instance, Model, Layout, Salt string
	Role                          uint16
	Rank, WorldSize, DigestWidth  int
	// UID names another uid than the driver's own (the pure driver
	// only); sessions given one name share that uid.
	UID string
}

// Pool is what `pool` prints of the cache's counters.
type Pool struct {
	Blocks, Pending, Pinned, Leases, Loads, Writers, Used, Free int
}

// Counters is what `counters` prints: the cache's, the shared tier's (Tier
// nil: no tier) and, from the pure driver only, the Machine's.
type Counters struct {
	StoredSlots                 int
	Evictions, EvictedUnwritten uint64
	Tier                        *TierCounters
	Machine                     *MachineCounters
}

// TierCounters are a node's counts of the shared tier's traffic
// (machine.L2Counters).
type TierCounters struct {
	Lookups, LookupBlocks, LookupHits, LookupTimeouts                       uint64
	Fetches, FetchBlocks, Fetched, FetchMisses, FetchTimeouts, FetchNoSpace uint64
	Writes, WritesSkipped, WritesRefused                                    uint64
	WritingSlots, PendingLookups, PendingFetches                            int
}

// MachineCounters are the Machine's own counts (machine.Counters).
type MachineCounters struct {
	DiscardedEndedStores, DiscardedExitedStores, DoomedWrites uint64
}

// Usage is what `usage` prints: what the Machine holds against its limits.
type Usage struct {
	Sessions  int
	MetaBytes int64
}

// Memory is client memory a region is registered over.
type Memory interface {
	Bytes() []byte
	Base() uint64
}

// Driver runs scenarios against one implementation of the protocol.
type Driver interface {
	// Name is the driver's name in a file's drivers directive.
	Name() string
	// Start starts one sidecar: a node (every `sidecar` command, before
	// anything else, or the default one).
	Start(cfg Config) (Node, error)
	// PID is the process id sessions attach with.
	PID() int
	// Memory allocates n zeroed bytes of client memory.
	Memory(n int) Memory
	// TierValues is the number of values the shared tier holds.
	TierValues() (int, error)
}

// Settler is a driver whose sidecars go on working after a command
// returns (real ones: the shared tier's writes and fetches run on their
// own): Settle returns once they are done, so that the next command sees
// what a driver that carries everything out at once would.
type Settler interface {
	Settle() error
}

// Node is one sidecar.
type Node interface {
	// Attach attaches a session; a refusal is a *schema.Error.
	Attach(o AttachOptions) (Session, error)
	Pool() (Pool, error)
	Counters() (Counters, error)
	Usage() (Usage, error)
}

// Session is one attached session: requests go through its Client (a
// refusal is a *schema.Error, anything else fails the scenario).
type Session interface {
	Client() *connector.Client
	// Detach ends the session cleanly (the Client's Close), Abandon as a
	// crashed process: both return once the sidecar has forgotten it.
	Detach() error
	Abandon() error
}

// The drivers' names.
const (
	Pure   = "pure"
	Go     = "go"
	Python = "python"
)

// allDrivers run a file without a drivers directive.
var allDrivers = []string{Pure, Go, Python}

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

// Drivers returns the drivers that run a scenario file: those its
// `# drivers: a, b` line names (among the comments before its first
// command), or all of them.
func Drivers(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		if !strings.HasPrefix(line, "#") {
			break
		}
		rest, ok := strings.CutPrefix(line, "# drivers:")
		if !ok {
			continue
		}
		var out []string
		for _, d := range strings.Split(rest, ",") {
			d = strings.TrimSpace(d)
			if d != Pure && d != Go && d != Python {
				return nil, fmt.Errorf("%s: drivers: unknown driver %q", path, d)
			}
			out = append(out, d)
		}
		return out, nil
	}
	return allDrivers, sc.Err()
}

// RunAll runs every scenario of dir that names d's driver as a subtest,
// each with a fresh driver.
func RunAll(t *testing.T, dir string, newDriver func(t *testing.T) Driver) {
	for _, f := range Files(t, dir) {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".txt"), func(t *testing.T) {
			Run(t, f, newDriver(t))
		})
	}
}

// Run runs one scenario file against d; a file that does not name d's
// driver is skipped.
func Run(t *testing.T, path string, d Driver) {
	names, err := Drivers(path)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, n := range names {
		found = found || n == d.Name()
	}
	if !found {
		t.Skipf("drivers: %s", strings.Join(names, ", "))
	}
	r := &runner{d: d, nodes: map[string]*node{}, sessions: map[string]*sess{}, leases: map[string]uint64{},
		cursors: map[string]cursor{}, names: map[string]string{}, contents: map[[32]byte]string{}, chains: map[string][][32]byte{}}
	datadriven.RunTest(t, path, func(t *testing.T, td *datadriven.TestData) string {
		out, err := r.exec(td)
		if err != nil {
			t.Fatalf("%s: %s: %v", td.Pos, td.Cmd, err)
		}
		return out
	})
	if len(r.parked) > 0 {
		var what []string
		for _, p := range r.parked {
			what = append(what, p.line)
		}
		r.abandonParked()
		t.Fatalf("requests still unanswered at the end: %s", strings.Join(what, "; "))
	}
}

type sess struct {
	name    string
	s       Session
	c       *connector.Client
	node    *node
	width   int
	regions map[uint32]*region
}

type region struct {
	mem       Memory
	pageBytes int
	pages     int
}

type node struct {
	name string
	n    Node
	cfg  Config
}

type cursor struct{ epoch, seq uint64 }

type runner struct {
	d        Driver
	nodes    map[string]*node
	first    *node // the node commands without node= name
	sessions map[string]*sess
	leases   map[string]uint64
	cursors  map[string]cursor
	names    map[string]string     // digest bytes (at any width) -> SEED#I
	contents map[[32]byte]string   // sha256 of a page's content -> TAG#I
	chains   map[string][][32]byte // SEED -> its digests so far
	parked   []*parked             // requests waiting for a reply (order.go)
	all      []*sess               // every session attached, ended ones too
}

// args is a command's arguments, each consumed once: an argument the
// command does not know is an error.
type args struct {
	m    map[string]string
	used map[string]bool
	keys []string // in the order given
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
		a.keys = append(a.keys, c.Key)
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

func (a *args) float(k string) (float64, error) {
	a.used[k] = true
	v, ok := a.m[k]
	if !ok {
		return 0, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 0 || f > 1 {
		return 0, fmt.Errorf("argument %s=%s: not a number in [0, 1]", k, v)
	}
	return f, nil
}

func (a *args) needNum(k string) (uint64, error) {
	if _, err := a.need(k); err != nil {
		return 0, err
	}
	return a.num(k, 0)
}

// word returns the i-th argument if it is a bare word (no value), or "".
func (a *args) word(i int) string {
	if i >= len(a.keys) || a.m[a.keys[i]] != "" {
		return ""
	}
	a.used[a.keys[i]] = true
	return a.keys[i]
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

// line is a command as written (for the replies of parked requests).
func line(td *datadriven.TestData) string {
	var b strings.Builder
	b.WriteString(td.Cmd)
	for _, c := range td.CmdArgs {
		b.WriteString(" ")
		b.WriteString(c.String())
	}
	return b.String()
}

func (r *runner) exec(td *datadriven.TestData) (string, error) {
	a, err := newArgs(td)
	if err != nil {
		return "", err
	}
	if td.Cmd == "sidecar" {
		if len(r.sessions) > 0 || len(r.parked) > 0 || (r.first != nil && r.first.name == "") {
			return "", errors.New("sidecar commands come first (and name their node when there are several)")
		}
		return r.start(a)
	}
	if r.first == nil {
		if _, err := r.start(&args{m: map[string]string{}, used: map[string]bool{}}); err != nil {
			return "", err
		}
	}
	var out string
	switch td.Cmd {
	case "attach":
		out, err = r.attach(a)
	case "pool", "counters", "usage", "tick", "copies", "tier":
		out, err = r.nodeCommand(td.Cmd, a)
	default:
		out, err = r.request(td, a)
	}
	if err != nil {
		return "", err
	}
	if err := a.done(); err != nil {
		return "", err
	}
	if st, ok := r.d.(Settler); ok {
		if err := st.Settle(); err != nil {
			return "", err
		}
	}
	woke, err := r.wake()
	if err != nil {
		return "", err
	}
	if woke != "" {
		if out != "" && !strings.HasSuffix(out, "\n") {
			out += "\n"
		}
		out += woke
	}
	return out, nil
}

func (r *runner) start(a *args) (string, error) {
	name := a.str("node", "")
	if _, dup := r.nodes[name]; dup {
		return "", fmt.Errorf("node %q started twice", name)
	}
	if len(r.nodes) > 0 && name == "" {
		return "", errors.New("several sidecars: each names its node (node=NAME)")
	}
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
	if c.PinShare, err = a.float("pin-share"); err != nil {
		return "", err
	}
	if c.RetainShare, err = a.float("retain-share"); err != nil {
		return "", err
	}
	if c.PendingShare, err = a.float("pending-share"); err != nil {
		return "", err
	}
	if c.SessionShare, err = a.float("session-share"); err != nil {
		return "", err
	}
	mb, err := a.num("meta-bytes", 0)
	if err != nil {
		return "", err
	}
	c.MetaBytes = int64(mb)
	switch a.str("tier", "off") {
	case "off":
		for _, k := range []string{"policy", "write-slots", "evict-ahead"} {
			if a.has(k) {
				return "", fmt.Errorf("%s= without tier=on", k)
			}
		}
	case "on":
		tc := &TierConfig{}
		switch a.str("policy", "write-through") {
		case "write-through":
		case "write-on-evict":
			tc.WriteOnEvict = true
		default:
			return "", errors.New("policy: write-through or write-on-evict")
		}
		ws, err := a.num("write-slots", 0)
		if err != nil {
			return "", err
		}
		ea, err := a.num("evict-ahead", 0)
		if err != nil {
			return "", err
		}
		tc.WriteSlots, tc.EvictAhead = int(ws), int(ea)
		c.Tier = tc
	default:
		return "", errors.New("tier: on or off")
	}
	if err := a.done(); err != nil {
		return "", err
	}
	n, err := r.d.Start(c)
	if err != nil {
		return "", err
	}
	nd := &node{name: name, n: n, cfg: c}
	r.nodes[name] = nd
	if r.first == nil {
		r.first = nd
	}
	return "ok", nil
}

// nodeOf is the node a command names (node=NAME), or the first one.
func (r *runner) nodeOf(a *args) (*node, error) {
	if !a.has("node") {
		return r.first, nil
	}
	name := a.str("node", "")
	n := r.nodes[name]
	if n == nil {
		return nil, fmt.Errorf("no node %q", name)
	}
	return n, nil
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
	nd, err := r.nodeOf(a)
	if err != nil {
		return "", err
	}
	o := AttachOptions{Instance: a.str("instance", "engine-a"), Model: a.str("model", "llama"),
		Layout: a.str("layout", "bf16/16/HND"), Salt: a.str("salt", ""), UID: a.str("uid", "")}
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
	s, err := nd.n.Attach(o)
	if err != nil {
		return errStatus(err)
	}
	ss := &sess{name: name, s: s, c: s.Client(), node: nd, width: o.DigestWidth, regions: map[uint32]*region{}}
	r.sessions[name] = ss
	r.all = append(r.all, ss)
	return "ok", nil
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

func (r *runner) digestName(d []byte) string {
	if n, ok := r.names[string(d)]; ok {
		return n
	}
	return "unknown"
}

// digestNames prints digests (flat, width bytes each) as a digest list,
// runs of one seed as ranges: "p#0-5,q#0".
func (r *runner) digestNames(flat []byte, width int) string {
	var items []string
	seed, lo, hi := "", -1, -1
	flush := func() {
		switch {
		case lo < 0:
		case lo == hi:
			items = append(items, fmt.Sprintf("%s#%d", seed, lo))
		default:
			items = append(items, fmt.Sprintf("%s#%d-%d", seed, lo, hi))
		}
	}
	for off := 0; off+width <= len(flat); off += width {
		name := r.digestName(flat[off : off+width])
		s, is, ok := strings.Cut(name, "#")
		i, err := strconv.Atoi(is)
		if ok && err == nil && s == seed && i == hi+1 && lo >= 0 {
			hi = i
			continue
		}
		flush()
		if !ok || err != nil {
			items = append(items, name)
			seed, lo, hi = "", -1, -1
			continue
		}
		seed, lo, hi = s, i, i
	}
	flush()
	return strings.Join(items, ",")
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

// pageName is the name of a page's content: its TAG#I, zero, or unknown.
func (r *runner) pageName(pg []byte) string {
	zero := true
	for _, c := range pg {
		if c != 0 {
			zero = false
			break
		}
	}
	if zero {
		return "zero"
	}
	if n, ok := r.contents[sha256.Sum256(pg)]; ok {
		return n
	}
	return "unknown"
}
