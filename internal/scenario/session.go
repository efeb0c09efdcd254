package scenario

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/ringside-kv/ringside/schema"
)

// sessionCommands are the commands of one session (s=NAME).
var sessionCommands = map[string]bool{
	"detach": true, "abandon": true, "put": true, "drop": true, "lookup": true, "acquire": true, "poll": true,
	"release": true, "region": true, "fill": true, "check": true, "store": true, "load": true, "changes": true,
	"snapshot": true, "ping": true, "raw": true, "send": true, "describe": true, "events": true, "event-snapshot": true,
	"retain": true,
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
	case "fill":
		return r.fill(s, a)
	case "check":
		return r.check(s, a)
	}
	return r.run(s, line(td), func() (string, error) { return r.call(td, a, s) })
}

// call runs a command that sends requests.
func (r *runner) call(td *datadriven.TestData, a *args, s *sess) (string, error) {
	c := s.c
	switch td.Cmd {
	case "detach", "abandon":
		var err error
		if td.Cmd == "detach" {
			err = s.s.Detach()
		} else {
			err = s.s.Abandon()
		}
		if err != nil {
			return "", err
		}
		delete(r.sessions, s.name)
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
		return okOr(c.DropHashes(b))
	case "lookup":
		v, err := view(a, true)
		if err != nil {
			return "", err
		}
		n, err := c.Lookup(v)
		if err != nil {
			return errStatus(err)
		}
		return fmt.Sprintf("hits=%d", n), nil
	case "acquire":
		return r.acquire(s, a)
	case "retain":
		return r.retain(s, a)
	case "poll":
		id, err := r.lease(a)
		if err != nil {
			return "", err
		}
		l, err := c.Poll(id)
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
		return okOr(c.Release(id))
	case "region":
		return r.region(s, a)
	case "store":
		return r.store(s, a)
	case "load":
		return r.load(s, a)
	case "changes":
		return r.changes(s, a)
	case "snapshot":
		return r.snapshot(s, a)
	case "describe":
		return r.describe(s, a)
	case "events", "event-snapshot":
		return r.events(td.Cmd, s, a)
	case "ping":
		v, err := a.num("v", 0)
		if err != nil {
			return "", err
		}
		if err := c.Ping(v); err != nil {
			return errStatus(err)
		}
		return fmt.Sprintf("pong %d", v), nil
	case "raw", "send":
		return r.raw(td, a, s)
	}
	return "", fmt.Errorf("unknown command %q", td.Cmd)
}

func okOr(err error) (string, error) {
	if err != nil {
		return errStatus(err)
	}
	return "ok", nil
}

// quiet sends with seq 0, then a Ping: records are handled in order, so by
// the Ping's reply the quiet one's reply, if any, has arrived.
func (r *runner) quiet(s *sess, typ uint16, payload []byte) (string, error) {
	c := s.c
	n0, _ := c.QuietFailures()
	if err := c.Send(typ, payload); err != nil {
		return "", err
	}
	if err := c.Ping(1); err != nil {
		return "", err
	}
	switch n, st := c.QuietFailures(); n - n0 {
	case 0:
		return "no reply", nil
	case 1:
		return StatusString(st), nil
	default:
		return "", fmt.Errorf("%d replies to one quiet request", n-n0)
	}
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
	n, err := s.c.PutHashesFlags(b, d, flags)
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
	l, err := s.c.Acquire(v, time.Duration(ttl)*time.Second)
	if err != nil {
		return errStatus(err)
	}
	r.leases[name] = l.Lease
	if (l.Lease == 0) != (l.State == schema.StateMiss) {
		return "", fmt.Errorf("lease %d in state %s", l.Lease, l.State)
	}
	return fmt.Sprintf("%s blocks=%d", l.State, l.Blocks), nil
}

// retain sends a Retain of an owner (0: none, the 24-byte form): ttl-ms
// and prio as given, or with end its END.
func (r *runner) retain(s *sess, a *args) (string, error) {
	v, err := view(a, true)
	if err != nil {
		return "", err
	}
	ttl, err := a.num("ttl-ms", 0)
	if err != nil {
		return "", err
	}
	prio, err := a.num("prio", 0)
	if err != nil {
		return "", err
	}
	owner, err := a.num("owner", 0)
	if err != nil {
		return "", err
	}
	end := a.has("end")
	if a.has("quiet") {
		m := schema.Retain{View: v, TTLms: uint32(ttl), Priority: uint8(prio), Owner: owner}
		if end {
			m.Flags = schema.RetainFlagEnd
		}
		return r.quiet(s, schema.TypeRetain, m.Append(nil))
	}
	n, err := s.c.RetainOwned(v, owner, time.Duration(ttl)*time.Millisecond, int(prio), end)
	if err != nil {
		return errStatus(err)
	}
	if end {
		return fmt.Sprintf("ended=%d", n), nil
	}
	return fmt.Sprintf("retained=%d", n), nil
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
	pb, err := a.num("page-bytes", s.node.cfg.SlotBytes)
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
		st, err = okOr(s.c.RegisterRegion(reg))
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
	for _, p := range pages {
		if int(p) >= rg.pages {
			return "", fmt.Errorf("page %d past the region's %d pages", p, rg.pages)
		}
		fmt.Fprintf(&b, "%d: %s\n", p, r.pageName(rg.mem.Bytes()[int(p)*rg.pageBytes:int(p+1)*rg.pageBytes]))
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
	st, err := s.c.Store(v, uint32(id), pages)
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
	n, err := s.c.Load(l, uint32(id), uint32(first), pages)
	if err != nil {
		return errStatus(err)
	}
	return fmt.Sprintf("loaded=%d", n), nil
}

func (r *runner) cursorArg(a *args, k string) (cursor, error) {
	name := a.str(k, "")
	if !a.has(k) {
		return cursor{}, nil
	}
	c, ok := r.cursors[name]
	if !ok {
		return c, fmt.Errorf("no cursor %s", name)
	}
	return c, nil
}

func (r *runner) changes(s *sess, a *args) (string, error) {
	from, err := r.cursorArg(a, "from")
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
	rep, err := s.c.Changes(from.epoch, from.seq, uint32(max))
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
	rep, err := s.c.Snapshot(from, uint32(max))
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

// describe sends a Describe of one run: the blocks d, each of
// tokens-per-block consecutive token ids from first-token on.
func (r *runner) describe(s *sess, a *args) (string, error) {
	spec, err := a.need("d")
	if err != nil {
		return "", err
	}
	d, err := r.digests(spec, s.width)
	if err != nil {
		return "", err
	}
	run := schema.DescribeRun{Digests: d}
	if p := a.str("parent", ""); p != "" {
		if run.Parent, err = r.digests(p, s.width); err != nil || len(run.Parent) != s.width {
			return "", fmt.Errorf("parent=%s: one digest", p)
		}
	}
	tpb, err := a.num("tokens-per-block", 1)
	if err != nil {
		return "", err
	}
	first, err := a.num("first-token", 0)
	if err != nil {
		return "", err
	}
	n := len(d) / s.width * int(tpb)
	if tpb == 0 || tpb > 1<<16-1 || n > 1<<24 {
		return "", fmt.Errorf("tokens-per-block=%d", tpb)
	}
	run.TokensPerBlock = uint16(tpb)
	run.Tokens = make([]byte, 4*n)
	for i := range n {
		binary.LittleEndian.PutUint32(run.Tokens[4*i:], uint32(first)+uint32(i))
	}
	if x := a.str("extra", ""); x != "" {
		run.Extra = []byte(x)
	}
	got, err := s.c.Describe([]schema.DescribeRun{run})
	if err != nil {
		return errStatus(err)
	}
	return fmt.Sprintf("described=%d", got), nil
}

// events reads the event log (events) or a page of the described present
// blocks (event-snapshot).
func (r *runner) events(cmd string, s *sess, a *args) (string, error) {
	max, err := a.num("max", 0)
	if err != nil {
		return "", err
	}
	as := a.str("as", "")
	var rep schema.EventsReply
	var b strings.Builder
	if cmd == "events" {
		from, err := r.cursorArg(a, "from")
		if err != nil {
			return "", err
		}
		if a.has("wrong-epoch") {
			from.epoch++
		}
		if rep, err = s.c.Events(from.epoch, from.seq, uint32(max)); err != nil {
			return errStatus(err)
		}
		if rep.Resync {
			b.WriteString("resync ")
		}
		fmt.Fprintf(&b, "events=%d\n", rep.Count)
	} else {
		from, err := a.num("from", 0)
		if err != nil {
			return "", err
		}
		if rep, err = s.c.EventSnapshot(from, uint32(max)); err != nil {
			return errStatus(err)
		}
		state := "more"
		if rep.Done {
			state = "done"
		}
		fmt.Fprintf(&b, "%s next=%d events=%d\n", state, rep.Next, rep.Count)
	}
	if as != "" {
		r.cursors[as] = cursor{rep.Epoch, rep.Seq}
	}
	rep.Events(func(e *schema.Event) bool {
		b.WriteString(r.eventLine(e))
		return true
	})
	return b.String(), nil
}

// eventLine prints an event: stored NAME [parent=NAME] [tokens=A-B]
// [extra=TEXT], or removed NAME.
func (r *runner) eventLine(e *schema.Event) string {
	var b strings.Builder
	switch e.Op {
	case schema.EventStored:
		b.WriteString("stored ")
	case schema.EventRemoved:
		b.WriteString("removed ")
	default:
		fmt.Fprintf(&b, "op(%d) ", e.Op)
	}
	b.WriteString(r.digestName(e.Digest))
	if e.Parent != nil {
		fmt.Fprintf(&b, " parent=%s", r.digestName(e.Parent))
	}
	if n := e.TokenCount(); n > 0 {
		consecutive := true
		for i := 1; i < n; i++ {
			consecutive = consecutive && e.Token(i) == e.Token(i-1)+1
		}
		if consecutive {
			fmt.Fprintf(&b, " tokens=%d-%d", e.Token(0), e.Token(n-1))
		} else {
			ts := make([]string, n)
			for i := range ts {
				ts[i] = strconv.FormatUint(uint64(e.Token(i)), 10)
			}
			fmt.Fprintf(&b, " tokens=%s", strings.Join(ts, ","))
		}
	}
	if len(e.Extra) > 0 {
		fmt.Fprintf(&b, " extra=%s", e.Extra)
	}
	b.WriteString("\n")
	return b.String()
}

var typeNames = map[string]uint16{
	"put": schema.TypePutHashes, "drop": schema.TypeDropHashes, "lookup": schema.TypeLookup,
	"acquire": schema.TypeAcquire, "poll": schema.TypePoll, "release": schema.TypeRelease,
	"region": schema.TypeRegisterRegion, "load": schema.TypeLoad, "store": schema.TypeStore,
	"changes": schema.TypeChanges, "detach": schema.TypeDetach, "ping": schema.TypePing,
	"snapshot": schema.TypeSnapshot, "describe": schema.TypeDescribe, "events": schema.TypeEvents,
	"event-snapshot": schema.TypeEventSnapshot, "retain": schema.TypeRetain,
}

// raw sends a record as written; reply=common|events decodes its reply in
// that layout (the reply must be one).
func (r *runner) raw(td *datadriven.TestData, a *args, s *sess) (string, error) {
	typ, payload, err := rawRequest(td, a)
	if err != nil {
		return "", err
	}
	if td.Cmd == "send" {
		return r.quiet(s, typ, payload)
	}
	layout := a.str("reply", "")
	b, err := s.c.Call(typ, payload)
	if err != nil {
		return "", err
	}
	if len(b) < 4 {
		return "", fmt.Errorf("reply of %d bytes has no status", len(b))
	}
	st := StatusString(schema.Status(binary.LittleEndian.Uint32(b)))
	switch layout {
	case "":
		return st, nil
	case "common":
		var rep schema.Reply
		if err := rep.Decode(b); err != nil {
			return "", fmt.Errorf("the reply is no common Reply: %v", err)
		}
		return fmt.Sprintf("%s value=%d", st, rep.Value), nil
	case "events":
		var rep schema.EventsReply
		if err := rep.Decode(b); err != nil {
			return "", fmt.Errorf("the reply is no EventsReply: %v", err)
		}
		return fmt.Sprintf("%s width=%d events=%d", st, rep.Width, rep.Count), nil
	}
	return "", errors.New("reply: common or events")
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
