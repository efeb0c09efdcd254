package reliability

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
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

func tracePath() string {
	if p := os.Getenv("RINGSIDE_SOAK_TRACE"); p != "" {
		return p
	}
	root, _ := moduleRoot()
	return filepath.Join(root, "..", "shared", "traces", "conversation_trace.jsonl")
}

// soakChild replays requests RS_START, RS_START+RS_STRIDE, ... of the
// trace forever, verifying every loaded block, and prints cumulative
// counters every 500 ms: "stats requests lookupBlocks hitBlocks".
func soakChild() int {
	reqs, _ := loadTrace(tracePath())
	start, stride := envInt("RS_START", 0), envInt("RS_STRIDE", 1)
	o := opts(os.Getenv("RS_SOCK"), "soak-"+strconv.Itoa(os.Getpid()))
	o.Timeout = 5 * time.Second
	c, err := connector.Dial(o)
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	r := newRegion(1, 2*soakBlocks)
	if err := c.RegisterRegion(r.reg); err != nil {
		fmt.Println("register:", err)
		return 1
	}
	var n, asked, hits int
	last := time.Now()
	for i := start; ; i += stride {
		ids := reqs[i%len(reqs)]
		d := chain(ids)
		batch := uint64(i + 1)
		if _, err := c.PutHashes(batch, d, false); err != nil {
			fmt.Println("put:", err)
			return 1
		}
		v := schema.View{Batch: batch, Count: uint32(len(ids))}
		h, err := c.Lookup(v)
		if err != nil {
			fmt.Println("lookup:", err)
			return 1
		}
		asked += len(ids)
		hits += h
		if h > 0 {
			l, err := c.Acquire(v, 5*time.Second)
			if err == nil && l.Lease != 0 && l.State == schema.StateReady {
				dst := make([]uint32, l.Blocks)
				for j := range dst {
					dst[j] = uint32(soakBlocks + j)
				}
				if _, err := c.Load(l.Lease, 1, 0, dst); err == nil {
					for j := range dst {
						if !pageOK(r.page(int(dst[j])), d[j*32:(j+1)*32], 0) {
							fmt.Println("CORRUPT request", i, "block", j)
							os.Exit(3)
						}
					}
				}
			}
			if l.Lease != 0 {
				c.Release(l.Lease)
			}
		}
		for j := h; j < len(ids); j++ {
			fillPage(r.page(j-h), d[j*32:(j+1)*32], 0)
		}
		if h < len(ids) {
			pages := iota32(len(ids) - h)
			c.Store(schema.View{Batch: batch, Start: uint32(h), Count: uint32(len(ids) - h)}, 1, pages)
		}
		c.DropHashes(batch)
		n++
		if time.Since(last) > 500*time.Millisecond {
			fmt.Println("stats", n, asked, hits)
			last = time.Now()
		}
	}
}

// offlineLRU is the leading-run hit ratio of an LRU cache of capacity
// blocks over the requests in trace order (one block per id).
func offlineLRU(reqs [][]uint64, capacity int) float64 {
	type node struct {
		prev, next *node
		key        [32]byte
	}
	idx := map[[32]byte]*node{}
	head := &node{}
	head.prev, head.next = head, head
	unlink := func(n *node) { n.prev.next, n.next.prev = n.next, n.prev }
	front := func(n *node) { n.prev, n.next = head, head.next; head.next.prev = n; head.next = n }
	var asked, hits int
	for _, ids := range reqs {
		d := chain(ids)
		h := 0
		for h < len(ids) {
			var k [32]byte
			copy(k[:], d[h*32:])
			if _, ok := idx[k]; !ok {
				break
			}
			h++
		}
		asked += len(ids)
		hits += h
		for j := range ids {
			var k [32]byte
			copy(k[:], d[j*32:])
			if n, ok := idx[k]; ok {
				unlink(n)
				front(n)
				continue
			}
			if len(idx) == capacity {
				t := head.prev
				unlink(t)
				delete(idx, t.key)
			}
			n := &node{key: k}
			idx[k] = n
			front(n)
		}
	}
	return float64(hits) / float64(max(asked, 1))
}

type child2 struct {
	mu                   sync.Mutex
	requests, asked, hit int
	corrupt              string
	done                 chan struct{}
	pid                  int
	kill                 func()
}

func startSoakEngine(t *testing.T, sock string, start, stride int) *child2 {
	cmd := child("soak", "RS_SOCK="+sock, "RS_START="+strconv.Itoa(start), "RS_STRIDE="+strconv.Itoa(stride))
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	e := &child2{done: make(chan struct{}), pid: cmd.Process.Pid, kill: func() { cmd.Process.Signal(syscall.SIGKILL) }}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			e.mu.Lock()
			if len(f) == 4 && f[0] == "stats" {
				e.requests, _ = strconv.Atoi(f[1])
				e.asked, _ = strconv.Atoi(f[2])
				e.hit, _ = strconv.Atoi(f[3])
			} else {
				e.corrupt = sc.Text()
			}
			e.mu.Unlock()
		}
		cmd.Wait()
		close(e.done)
	}()
	return e
}

// TestSoak replays the conversation trace from several engine processes
// with random engine restarts (make soak; RINGSIDE_SOAK=10m).
func TestSoak(t *testing.T) {
	dur := soakDuration()
	if dur <= 0 {
		t.Skip("soak: run with `make soak` or RINGSIDE_SOAK=10m (-soak 10m)")
	}
	row := record(t, "Soak", fmt.Sprintf("%v: 3 engine processes replay the conversation trace (one page per 512-token block id, chained digests, every loaded block verified) with random SIGKILL restarts every 2-8 s, against a 16 MiB pool", dur),
		"sidecar VmRSS at the end within 2% of its level at the end of warm-up (the first minute, or half the run if shorter); goroutines and fds back to their idle level; zero leaked leases, pins or writes; zero corrupt loads; hit rate reported next to an offline LRU of the same capacity",
		"1. leaks / pins never released; 2. restart / fault tolerance")
	reqs, src := loadTrace(tracePath())
	sc := startSidecar(t, newDir(t), "--pool.bytes", "16MiB", "--ring.capacity", "1MiB")
	slots := sc.state().Pool.Capacity
	idleG, idleFD := sc.metric("go_goroutines"), fdCount(sc.pid())
	const engines = 3
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
	es := make([]*child2, engines)
	var retired []*child2
	for i := range es {
		es[i] = startSoakEngine(t, sc.sock, rng.IntN(len(reqs)), engines)
	}
	warm := min(time.Minute, dur/2)
	t0 := time.Now()
	var warmRSS, lastRSS, warmSum, lastSum, warmN, lastN int64
	restarts := 0
	nextRestart := t0.Add(time.Duration(2000+rng.IntN(6000)) * time.Millisecond)
	var samples []string
	for time.Since(t0) < dur {
		time.Sleep(250 * time.Millisecond)
		if time.Now().After(nextRestart) {
			k := rng.IntN(engines)
			es[k].kill()
			<-es[k].done
			retired = append(retired, es[k])
			es[k] = startSoakEngine(t, sc.sock, rng.IntN(len(reqs)), engines)
			restarts++
			nextRestart = time.Now().Add(time.Duration(2000+rng.IntN(6000)) * time.Millisecond)
		}
		// RSS is averaged over 5 s windows: the one ending at warm-up and
		// the last one.
		el := time.Since(t0)
		rss := rssKiB(sc.pid())
		if el > warm-5*time.Second && el <= warm {
			warmSum, warmN = warmSum+rss, warmN+1
		}
		if el > dur-5*time.Second {
			lastSum, lastN = lastSum+rss, lastN+1
		}
		if len(samples) < int(time.Since(t0)/(15*time.Second)) {
			samples = append(samples, fmt.Sprintf("%ds:%dKiB/%vg/%dfd", int(time.Since(t0).Seconds()), rssKiB(sc.pid()), sc.metric("go_goroutines"), fdCount(sc.pid())))
		}
		for _, e := range es {
			e.mu.Lock()
			if e.corrupt != "" {
				t.Fatalf("engine: %s", e.corrupt)
			}
			e.mu.Unlock()
		}
	}
	warmRSS, lastRSS = warmSum/max(warmN, 1), lastSum/max(lastN, 1)
	for _, e := range es {
		e.kill()
		<-e.done
	}
	retired = append(retired, es...)
	_, st := sc.waitQuiet(t, 0, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	endG, endFD := sc.metric("go_goroutines"), fdCount(sc.pid())
	var requests, asked, hit int
	for _, e := range retired {
		e.mu.Lock()
		requests += e.requests
		asked += e.asked
		hit += e.hit
		if e.corrupt != "" && !strings.HasPrefix(e.corrupt, "dial") {
			t.Errorf("engine: %s", e.corrupt)
		}
		e.mu.Unlock()
	}
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
	lru := offlineLRU(reqs, slots)
	row.add("%d requests (%s), %d engine restarts; live hit rate %.3f (%d/%d blocks), offline LRU of %d slots over the trace in order %.3f (concurrent engines and restarts reorder requests, so the two are not expected to be equal)",
		requests, filepath.Base(src), restarts, float64(hit)/float64(max(asked, 1)), hit, asked, slots, lru)
	row.add("VmRSS %d KiB at the end of warm-up (%v), %d KiB at the end (5 s means) (%+.2f%%); goroutines %v idle → %v idle after; fds %d → %d; at the end 0 leases, 0 pins, 0 writes, free+used = capacity", warmRSS, warm, lastRSS, drift, idleG, endG, idleFD, endFD)
	row.add("samples: %s", strings.Join(samples, " "))
}
