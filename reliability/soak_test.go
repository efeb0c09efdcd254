package reliability

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/replay"
	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
	"github.com/ringside-kv/ringside/sidecar/cache"
)

// soakBlocks caps the blocks of one replayed request (the trace's longest
// has 247), so that a request fits one engine region.
const soakBlocks = 64

func soakDuration() time.Duration {
	if *soakFlag > 0 {
		return *soakFlag
	}
	d, _ := time.ParseDuration(os.Getenv("RINGSIDE_SOAK"))
	return d
}

// loadTrace reads the Mooncake trace's hash_ids, one request a line, or
// makes synthetic prefix-sharing traffic when the file is missing.
func loadTrace(path string) ([][]uint64, string) {
	f, err := os.Open(path)
	if err != nil {
		rng := rand.New(rand.NewPCG(1, 1))
		var out [][]uint64
		for i := 0; i < 5000; i++ {
			n := 4 + rng.IntN(40)
			ids := make([]uint64, n)
			root := uint64(rng.IntN(50))
			for j := range ids {
				if j < n/2 {
					ids[j] = root*1000 + uint64(j)
				} else {
					ids[j] = 1_000_000 + uint64(i)*100 + uint64(j)
				}
			}
			out = append(out, ids)
		}
		return out, "synthetic prefix-sharing traffic (trace not found)"
	}
	defer f.Close()
	var out [][]uint64
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r struct {
			HashIDs []uint64 `json:"hash_ids"`
		}
		if json.Unmarshal(sc.Bytes(), &r) == nil && len(r.HashIDs) > 0 {
			out = append(out, r.HashIDs[:min(len(r.HashIDs), soakBlocks)])
		}
	}
	return out, path
}

// chain turns a request's block ids into chained digests (a digest names
// its whole prefix, as an engine's block hashes do).
func chain(ids []uint64) []byte {
	out := make([]byte, 0, len(ids)*32)
	var prev [32]byte
	var b [40]byte
	for _, id := range ids {
		copy(b[:32], prev[:])
		binary.LittleEndian.PutUint64(b[32:], id)
		prev = sha256.Sum256(b[:])
		out = append(out, prev[:]...)
	}
	return out
}

// soakTable numbers the distinct block digests of reqs densely (in trace
// order) and aligns each digest for MQP: its first word is set so that the
// sidecar's MQP history key of it (cache.MQPHistoryKey, in the soak's
// namespace, the sidecar's first) is its number, the page id the offline
// model (replay.MQPPages) hashes; the rest stays the sha256 chain. Every
// engine process builds the same table from the same trace. ids[i] are
// request i's numbers, digests[32*id:] the aligned digest of id.
func soakTable(reqs [][]uint64) (ids [][]uint32, digests []byte) {
	num := map[[32]byte]uint32{}
	ids = make([][]uint32, len(reqs))
	for i, r := range reqs {
		d := chain(r)
		ids[i] = make([]uint32, len(r))
		for b := range r {
			k := [32]byte(d[b*32 : (b+1)*32])
			id, ok := num[k]
			if !ok {
				id = uint32(len(num))
				num[k] = id
				binary.LittleEndian.PutUint64(k[:], 0)
				binary.LittleEndian.PutUint64(k[:], uint64(id)^cache.MQPHistoryKey(1, k[:]))
				digests = append(digests, k[:]...)
			}
			ids[i][b] = id
		}
	}
	return ids, digests
}

// soakPolicy is the sidecar's eviction policy in the soak: RINGSIDE_SOAK_POLICY
// (lru, mqp or mqp2), else the sidecar's default. The exact check uses its
// offline model.
func soakPolicy() string {
	if p := os.Getenv("RINGSIDE_SOAK_POLICY"); p != "" {
		return p
	}
	return cache.DefaultPolicy.String()
}

func tracePath() string {
	if p := os.Getenv("RINGSIDE_SOAK_TRACE"); p != "" {
		return p
	}
	root, _ := moduleRoot()
	return filepath.Join(root, "..", "shared", "traces", "conversation_trace.jsonl")
}

// soakChild is one soak engine. It prints "ready" once attached, then
// reads trace request indices from stdin, one a line, and runs each
// completely before reading the next, with bench/replay's engine sequence
// of calls (the one replay.Oracle models): put the hashes, look up (h
// leading hits of n), acquire the h hits, load and verify them, store the
// missed blocks [h, n) while the lease is held, release, drop the hashes.
// It then prints "done idx n h stored present skipped". Any error or
// unexpected answer is printed and ends the process (a corrupt load with
// exit status 3); EOF on stdin ends it cleanly.
func soakChild() int {
	reqs, _ := loadTrace(tracePath())
	ids, table := soakTable(reqs)
	o := opts(os.Getenv("RS_SOCK"), "soak-"+strconv.Itoa(os.Getpid()))
	o.Timeout = 5 * time.Second
	c, err := connector.Dial(o)
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	// Missed blocks are stored from pages [0, n-h), hits loaded into pages
	// [soakBlocks, soakBlocks+h): n <= soakBlocks, so 2*soakBlocks pages of
	// one pool slot each (4 KiB, 512 KiB in all) hold any request.
	r := newRegion(1, 2*soakBlocks)
	if err := c.RegisterRegion(r.reg); err != nil {
		fmt.Println("register:", err)
		return 1
	}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	var batch uint64
	for in.Scan() {
		idx, err := strconv.Atoi(in.Text())
		if err != nil || idx < 0 || idx >= len(reqs) {
			fmt.Printf("bad request index %q\n", in.Text())
			return 1
		}
		n := len(ids[idx])
		d := make([]byte, 0, 32*n)
		for _, id := range ids[idx] {
			d = append(d, table[32*id:32*(id+1)]...)
		}
		batch++
		if _, err := c.PutHashes(batch, d, false); err != nil {
			fmt.Println("put:", err)
			return 1
		}
		h, err := c.Lookup(schema.View{Batch: batch, Count: uint32(n)})
		if err != nil {
			fmt.Println("lookup:", err)
			return 1
		}
		var lease uint64
		if h > 0 {
			l, err := c.Acquire(schema.View{Batch: batch, Count: uint32(h)}, time.Minute)
			for err == nil && l.State == schema.StateWaiting {
				l, err = c.Poll(l.Lease)
			}
			if err != nil {
				fmt.Println("acquire:", err)
				return 1
			}
			lease = l.Lease
			if l.Lease == 0 || l.State != schema.StateReady || int(l.Blocks) != h {
				fmt.Printf("acquire: request %d: lease %d state %v pinned %d of %d hits\n", idx, l.Lease, l.State, l.Blocks, h)
				return 1
			}
			dst := make([]uint32, h)
			for j := range dst {
				dst[j] = uint32(soakBlocks + j)
			}
			got, err := c.Load(lease, 1, 0, dst)
			if err != nil || got != h {
				fmt.Printf("load: request %d: %d of %d blocks: %v\n", idx, got, h, err)
				return 1
			}
			for j := range dst {
				if !pageOK(r.page(int(dst[j])), d[j*32:(j+1)*32], 0) {
					fmt.Println("CORRUPT request", idx, "block", j)
					os.Exit(3)
				}
			}
		}
		var st schema.StoreReply
		if h < n {
			for j := h; j < n; j++ {
				fillPage(r.page(j-h), d[j*32:(j+1)*32], 0)
			}
			if st, err = c.Store(schema.View{Batch: batch, Start: uint32(h), Count: uint32(n - h)}, 1, iota32(n-h)); err != nil {
				fmt.Println("store:", err)
				return 1
			}
		}
		if lease != 0 {
			if err := c.Release(lease); err != nil {
				fmt.Println("release:", err)
				return 1
			}
		}
		if err := c.DropHashes(batch); err != nil {
			fmt.Println("drop:", err)
			return 1
		}
		fmt.Println("done", idx, n, h, st.Stored, st.Present, st.Skipped)
	}
	return 0
}

// soakResult is what one request did, as its engine reports it.
type soakResult struct {
	idx, blocks, hits, stored, present, skipped int
}

// soakEngine is a soak engine process driven over its stdin and stdout.
type soakEngine struct {
	cmd   *exec.Cmd
	pid   int
	in    io.WriteCloser
	lines chan string   // stdout, a line at a time; closed at EOF
	done  chan struct{} // closed once the process is reaped
}

// startSoakEngine starts an engine and waits until it is attached.
func startSoakEngine(t *testing.T, sock string) *soakEngine {
	t.Helper()
	cmd := child("soak", "RS_SOCK="+sock)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	e := &soakEngine{cmd: cmd, pid: cmd.Process.Pid, in: in, lines: make(chan string, 4), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			e.lines <- sc.Text()
		}
		close(e.lines)
		cmd.Wait()
		close(e.done)
	}()
	if line, err := e.next(20 * time.Second); err != nil || line != "ready" {
		e.kill()
		t.Fatalf("engine %d at start: %q %v", e.pid, line, err)
	}
	return e
}

// next returns the engine's next line of output.
func (e *soakEngine) next(within time.Duration) (string, error) {
	tm := time.NewTimer(within)
	defer tm.Stop()
	select {
	case line, ok := <-e.lines:
		if !ok {
			<-e.done
			return "", fmt.Errorf("engine exited: %v", e.cmd.ProcessState)
		}
		return line, nil
	case <-tm.C:
		return "", fmt.Errorf("no answer within %v", within)
	}
}

// run hands the engine trace request idx (of blocks blocks) and waits
// until it is done.
func (e *soakEngine) run(idx, blocks int) (soakResult, error) {
	r := soakResult{idx: -1}
	if _, err := fmt.Fprintf(e.in, "%d\n", idx); err != nil {
		return r, fmt.Errorf("engine %d: %w", e.pid, err)
	}
	line, err := e.next(30 * time.Second)
	if err != nil {
		return r, fmt.Errorf("engine %d, request %d in flight: %w", e.pid, idx, err)
	}
	f := strings.Fields(line)
	if len(f) == 7 && f[0] == "done" {
		v := make([]int, 6)
		for i := range v {
			if v[i], err = strconv.Atoi(f[i+1]); err != nil {
				break
			}
		}
		r = soakResult{v[0], v[1], v[2], v[3], v[4], v[5]}
	}
	if err != nil || r.idx != idx || r.blocks != blocks {
		return r, fmt.Errorf("engine %d, request %d (%d blocks): %q", e.pid, idx, blocks, line)
	}
	return r, nil
}

// kill SIGKILLs the engine and reaps it; it may be called again.
func (e *soakEngine) kill() {
	e.cmd.Process.Signal(syscall.SIGKILL)
	for range e.lines {
	}
	<-e.done
}

// TestSoak replays the conversation trace one request at a time, in trace
// order, through several engine processes, with random engine restarts
// between requests, and checks the live hit counts against the exact
// offline model of the sidecar's policy, replay.OraclePages or
// replay.MQPPages (make soak; RINGSIDE_SOAK=10m; RINGSIDE_SOAK_POLICY).
func TestSoak(t *testing.T) {
	dur := soakDuration()
	if dur <= 0 {
		t.Skip("soak: run with `make soak` or RINGSIDE_SOAK=10m (-soak 10m)")
	}
	const engines = 3
	row := record(t, "Soak", fmt.Sprintf("%v: %d engine processes replay the conversation trace one request at a time in trace order (the test process hands each request, from a random starting point and wrapping around, to a randomly chosen engine and waits until it is done; one page per 512-token block id, at most %d blocks a request, chained digests, every loaded block verified, the missed blocks stored while the hits' lease is held), with random SIGKILL restarts of an idle engine every 2-8 s, against a 16 MiB pool; kills in the middle of an operation are TestEngineSIGKILLRounds' (200 rounds)", dur, engines, soakBlocks),
		"sidecar VmRSS at the end within 2% of its level at the end of warm-up (the first minute, or half the run if shorter); goroutines and fds back to their idle level; zero leaked leases, pins or writes; zero corrupt loads; hit rate equal to the exact offline model of the sidecar's eviction policy at the same capacity (the sidecar's default, or RINGSIDE_SOAK_POLICY=lru|mqp|mqp2: replay.OraclePages for LRU, replay.MQPPages for MQP, replay.MQP2Pages for MQP2, over the requests in the order they completed): hit blocks and looked-up blocks exactly equal, and the sidecar's own lookup, hit, store, NoSpace (LRU; MQP's and MQP2's models count none: present+NoSpace checked as a sum), eviction and resident-block counts equal the model's",
		"1. leaks / pins never released; 2. restart / fault tolerance")
	reqs, src := loadTrace(tracePath())
	policy := soakPolicy()
	sc := startSidecar(t, newDir(t), "--pool.bytes", "16MiB", "--ring.capacity", "1MiB", "--cache.policy", policy)
	slots := sc.state().Pool.Capacity
	idleG, idleFD := sc.metric("go_goroutines"), fdCount(sc.pid())
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
	es := make([]*soakEngine, engines)
	t.Cleanup(func() {
		for _, e := range es {
			if e != nil {
				e.kill()
			}
		}
	})
	for i := range es {
		es[i] = startSoakEngine(t, sc.sock)
	}
	warm := min(time.Minute, dur/2)
	t0 := time.Now()
	var warmRSS, lastRSS, warmSum, lastSum, warmN, lastN int64
	// RSS is compared as means over windows long against the garbage
	// collector's cycle (a few seconds here): 30 s, or half the warm-up.
	win := min(30*time.Second, warm/2)
	restarts := 0
	nextRestart := t0.Add(time.Duration(2000+rng.IntN(6000)) * time.Millisecond)
	var samples []string
	first := rng.IntN(len(reqs))
	var order []int // trace indices of the completed requests, in order
	var asked, hit, stored, present, skipped int64
	lastSample := t0
	for pos := first; time.Since(t0) < dur; pos = (pos + 1) % len(reqs) {
		if time.Now().After(nextRestart) {
			// Every engine is idle here: the kill never cuts a request.
			k := rng.IntN(engines)
			es[k].kill()
			if !killed(es[k].cmd) {
				t.Fatalf("engine %d: %v, not SIGKILL", es[k].pid, es[k].cmd.ProcessState)
			}
			es[k] = startSoakEngine(t, sc.sock)
			restarts++
			nextRestart = time.Now().Add(time.Duration(2000+rng.IntN(6000)) * time.Millisecond)
		}
		r, err := es[rng.IntN(engines)].run(pos, len(reqs[pos]))
		if err != nil {
			t.Fatal(err)
		}
		order = append(order, pos)
		asked, hit = asked+int64(r.blocks), hit+int64(r.hits)
		stored, present, skipped = stored+int64(r.stored), present+int64(r.present), skipped+int64(r.skipped)
		if time.Since(lastSample) < 250*time.Millisecond {
			continue
		}
		lastSample = time.Now()
		// RSS is averaged over two windows: the one ending at warm-up and
		// the last one.
		el := time.Since(t0)
		rss := rssKiB(sc.pid())
		if el > warm-win && el <= warm {
			warmSum, warmN = warmSum+rss, warmN+1
		}
		if el > dur-win {
			lastSum, lastN = lastSum+rss, lastN+1
		}
		if len(samples) < int(el/(15*time.Second)) {
			samples = append(samples, fmt.Sprintf("%ds:%dKiB/%vg/%dfd", int(el.Seconds()), rss, sc.metric("go_goroutines"), fdCount(sc.pid())))
		}
	}
	warmRSS, lastRSS = warmSum/max(warmN, 1), lastSum/max(lastN, 1)
	for _, e := range es {
		e.kill()
	}
	_, st := sc.waitQuiet(t, 0, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	endG, endFD := sc.metric("go_goroutines"), fdCount(sc.pid())
	drift := float64(lastRSS-warmRSS) / float64(warmRSS) * 100
	if math.Abs(drift) > 2 {
		t.Errorf("RSS drifted %.2f%% after warm-up: %d KiB at %v, %d KiB at the end", drift, warmRSS, warm, lastRSS)
	}
	if endG > idleG+2 || endFD > idleFD+2 {
		t.Errorf("growth: goroutines %v -> %v, fds %d -> %d", idleG, endG, idleFD, endFD)
	}
	if st.Pool.Leases != 0 || st.Pool.PinnedBlocks != 0 || st.Pool.Writing != 0 {
		t.Errorf("leaked: %+v", st.Pool)
	}

	// The exact offline model of the sidecar's policy over the requests
	// as they completed, each distinct digest numbered as the engines did
	// (soakTable: under MQP the model hashes those numbers where the
	// sidecar hashes the digests aligned to them).
	pagesOf, _ := soakTable(reqs)
	seq := make([][]uint32, len(order))
	numIDs := 0
	for j, i := range order {
		seq[j] = pagesOf[i]
	}
	for _, p := range pagesOf {
		for _, id := range p {
			numIDs = max(numIDs, int(id)+1)
		}
	}
	var o replay.OracleResult
	model := "offline LRU"
	if policy == "mqp" || policy == "mqp2" {
		// MQP's (and MQP2's) model counts no refused or present stores:
		// their sum, the missed blocks not stored, is checked instead.
		m := replay.MQPPages(seq, nil, numIDs, slots)
		model = "offline MQP"
		if policy == "mqp2" {
			m, model = replay.MQP2Pages(seq, nil, numIDs, slots), "offline MQP2"
		}
		o = replay.OracleResult{TotalPages: m.TotalPages, HitPages: m.HitPages, StoredPages: m.StoredPages, Evictions: m.Evictions,
			Resident: int(m.StoredPages - m.Evictions), PresentPages: -1, SkippedPages: -1}
		if present+skipped != m.TotalPages-m.HitPages-m.StoredPages {
			t.Errorf("live: %d present + %d skipped, %s: %d missed blocks not stored", present, skipped, model, m.TotalPages-m.HitPages-m.StoredPages)
		}
		present, skipped = -1, -1
	} else {
		o = replay.OraclePages(seq, numIDs, slots)
	}
	if hit != o.HitPages || asked != o.TotalPages {
		t.Errorf("live hits %d of %d looked-up blocks, %s of %d slots %d of %d", hit, asked, model, slots, o.HitPages, o.TotalPages)
	}
	if stored != o.StoredPages || present != o.PresentPages || skipped != o.SkippedPages {
		t.Errorf("live stores: %d stored, %d present, %d skipped; %s: %d, %d, %d", stored, present, skipped, model, o.StoredPages, o.PresentPages, o.SkippedPages)
	}
	p := st.Pool
	noSpace := p.NoSpace
	if policy == "mqp" || policy == "mqp2" {
		noSpace = uint64(o.SkippedPages) // not modelled
	}
	if p.Lookups != uint64(len(order)) || p.LookupBlocks != uint64(asked) || p.HitBlocks != uint64(hit) ||
		p.Stores != uint64(o.StoredPages) || noSpace != uint64(o.SkippedPages) || p.Evictions != uint64(o.Evictions) || p.Blocks != o.Resident {
		t.Errorf("sidecar counters: %d lookups, %d/%d blocks hit, %d stores, %d NoSpace, %d evictions, %d blocks; want %d, %d/%d, %d, %d, %d, %d",
			p.Lookups, p.HitBlocks, p.LookupBlocks, p.Stores, p.NoSpace, p.Evictions, p.Blocks,
			len(order), hit, asked, o.StoredPages, o.SkippedPages, o.Evictions, o.Resident)
	}
	row.add("%d requests (%s, trace order from request %d), %d engine restarts; eviction policy %s; live hit rate %.4f (%d/%d blocks) = %s of %d slots over the same requests in the same order %.4f (%d/%d blocks), exactly; sidecar counters = model: %d stores, %d NoSpace, %d evictions, %d blocks resident at the end",
		len(order), filepath.Base(src), first, restarts, policy, float64(hit)/float64(max(asked, 1)), hit, asked, model, slots, o.HitRatio(), o.HitPages, o.TotalPages,
		p.Stores, p.NoSpace, p.Evictions, p.Blocks)
	row.add("VmRSS %d KiB at the end of warm-up (%v), %d KiB at the end (means over the last %v of each: the Go heap's garbage-collection sawtooth moves single samples by ±3%%) (%+.2f%%); goroutines %v idle → %v idle after; fds %d → %d; at the end 0 leases, 0 pins, 0 writes, free+used = capacity", warmRSS, warm, lastRSS, win, drift, idleG, endG, idleFD, endFD)
	row.add("samples: %s", strings.Join(samples, " "))
}
