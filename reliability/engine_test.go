package reliability

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

const (
	enginePrompts = 24
	engineBlocks  = 8
)

var enginePhases = []string{"attach", "register", "acquire", "load", "store", "external"}

// engineChild is an engine process: it runs RS_ITERS iterations of real
// traffic (lookup, acquire, load with checksum verification, store) and
// then SIGKILLs itself in the middle of RS_PHASE, with the request of that
// phase submitted and its reply not read; with phase "external" it loops
// until the parent kills it. It prints "stored P" for every prompt it saw
// fully present, and exits 3 on a corrupt load.
func engineChild() int {
	sock, phase := os.Getenv("RS_SOCK"), os.Getenv("RS_PHASE")
	rng := rand.New(rand.NewPCG(uint64(envInt("RS_SEED", 1)), 9))
	go func() { // a child that is never killed is a test failure
		time.Sleep(30 * time.Second)
		fmt.Println("not killed")
		os.Exit(4)
	}()
	die := func() { syscall.Kill(os.Getpid(), syscall.SIGKILL); select {} }
	o := opts(sock, "engine-"+strconv.Itoa(os.Getpid()))
	if phase == "attach" && rng.IntN(2) == 0 {
		dieMidAttach(o, rng, die)
	}
	c, err := connector.Dial(o)
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	r := newRegion(1, 2*engineBlocks)
	if phase == "register" && rng.IntN(2) == 0 {
		c.Submit(schema.TypeRegisterRegion, r.reg.Append(nil))
		die()
	}
	if err := c.RegisterRegion(r.reg); err != nil {
		fmt.Println("register:", err)
		return 1
	}
	iters := envInt("RS_ITERS", 1)
	for i := 0; phase == "external" || i < iters; i++ {
		if code := engineIteration(c, r, rng, uint64(i+1), ""); code != 0 {
			return code
		}
	}
	// The kill point: submit the phase's request and die before its reply.
	p := rng.IntN(enginePrompts)
	d := digests("prompt-"+strconv.Itoa(p), engineBlocks)
	batch := uint64(1 << 20)
	c.PutHashes(batch, d, false)
	v := schema.View{Batch: batch, Count: engineBlocks}
	switch phase {
	case "attach":
		dieMidAttach(o, rng, die)
	case "register":
		r2 := newRegion(2, 4)
		c.Submit(schema.TypeRegisterRegion, r2.reg.Append(nil))
	case "acquire":
		c.Submit(schema.TypeAcquire, (&schema.Acquire{View: v, TTLms: 60000}).Append(nil))
	case "load":
		l, err := c.Acquire(v, time.Minute)
		if err == nil && l.Lease != 0 {
			c.Submit(schema.TypeLoad, (&schema.Load{Lease: l.Lease, Region: 1, Pages: iota32(int(l.Blocks))}).Append(nil))
		}
	case "store":
		for j := 0; j < engineBlocks; j++ {
			fillPage(r.page(j), d[j*32:(j+1)*32], 0)
		}
		// Another prompt, so that the store has something to copy.
		d2 := digests("fresh-"+strconv.Itoa(os.Getpid()), engineBlocks)
		c.PutHashes(batch+1, d2, false)
		c.Submit(schema.TypeStore, (&schema.Store{View: schema.View{Batch: batch + 1, Count: engineBlocks}, Region: 1, Pages: iota32(engineBlocks)}).Append(nil))
	}
	die()
	return 0
}

// dieMidAttach connects and sends an attach request, then dies either
// before reading the reply or after it, before mapping the rings.
func dieMidAttach(o connector.Options, rng *rand.Rand, die func()) {
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: o.Socket, Net: "unixpacket"})
	if err != nil {
		fmt.Println("dial:", err)
		os.Exit(1)
	}
	req := schema.AttachRequest{Version: schema.Version, Role: schema.RoleWorker, WorldSize: 1, DigestWidth: 32,
		Instance: o.Instance + "-half", Model: o.Model, Layout: o.Layout}
	conn.Write(req.Append(nil))
	if rng.IntN(2) == 0 {
		b := make([]byte, 8192)
		conn.Read(b)
	}
	die()
}

// engineIteration serves one request of a prompt as an engine would:
// lookup, acquire and load the hits (verifying every loaded page), store
// the whole prompt, and report it when every block is present.
func engineIteration(c *connector.Client, r *region, rng *rand.Rand, batch uint64, salt string) int {
	p := rng.IntN(enginePrompts)
	d := digests(salt+"prompt-"+strconv.Itoa(p), engineBlocks)
	if _, err := c.PutHashes(batch, d, false); err != nil {
		fmt.Println("put:", err)
		return 1
	}
	v := schema.View{Batch: batch, Count: engineBlocks}
	if n, err := c.Lookup(v); err == nil && n > 0 {
		l, err := c.Acquire(v, 2*time.Second)
		if err == nil && l.Lease != 0 && l.State == schema.StateReady {
			dst := make([]uint32, l.Blocks)
			for j := range dst {
				dst[j] = uint32(engineBlocks + j)
			}
			if _, err := c.Load(l.Lease, 1, 0, dst); err == nil {
				for j := range dst {
					if !pageOK(r.page(int(dst[j])), d[j*32:(j+1)*32], 0) {
						fmt.Printf("CORRUPT prompt %d block %d\n", p, j)
						os.Exit(3)
					}
				}
			}
			c.Release(l.Lease)
		}
	}
	for j := 0; j < engineBlocks; j++ {
		fillPage(r.page(j), d[j*32:(j+1)*32], 0)
	}
	if _, err := c.Store(v, 1, iota32(engineBlocks)); err == nil {
		if n, err := c.Lookup(v); err == nil && n == engineBlocks {
			fmt.Println("stored", p)
		}
	}
	c.DropHashes(batch)
	return 0
}

// TestEngineSIGKILLRounds kills engine processes with SIGKILL at random
// points of attach, register, acquire, load and store, against a real
// sidecar process, in waves of concurrent engines.
func TestEngineSIGKILLRounds(t *testing.T) {
	row := record(t, "Faults", "engine processes SIGKILLed at random points of attach, register, acquire, load and store (half at a precise point with the request in flight, half by the parent at a random delay), 4 engines at a time",
		"after every wave: all leases, pins, writes and sessions reclaimed within the lease TTL (3 s); free+used = capacity; no ring file left; no corrupt load; afterwards every fully stored prompt is still served byte-exact to a new engine",
		"1. leaks / pins never released; 2. restart / fault tolerance")
	rounds := 200
	if long() {
		rounds = 1000
	}
	const wave = 4
	sc := startSidecar(t, newDir(t))
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	stored := map[int]bool{}
	phases := map[string]int{}
	var maxReclaim time.Duration
	t0 := time.Now()
	for done := 0; done < rounds; done += wave {
		var wg sync.WaitGroup
		var mu sync.Mutex
		var failures []string
		for k := 0; k < wave; k++ {
			phase := enginePhases[rng.IntN(len(enginePhases))]
			phases[phase]++
			cmd := child("engine", "RS_SOCK="+sc.sock, "RS_PHASE="+phase, "RS_ITERS="+strconv.Itoa(rng.IntN(4)), "RS_SEED="+strconv.Itoa(rng.IntN(1<<30)))
			out, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			delay := time.Duration(2+rng.IntN(60)) * time.Millisecond
			wg.Add(1)
			go func() {
				defer wg.Done()
				if phase == "external" {
					time.AfterFunc(delay, func() { cmd.Process.Signal(syscall.SIGKILL) })
				}
				var lines []string
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					lines = append(lines, sc.Text())
				}
				err := cmd.Wait()
				mu.Lock()
				defer mu.Unlock()
				for _, l := range lines {
					if p, ok := strings.CutPrefix(l, "stored "); ok {
						n, _ := strconv.Atoi(p)
						stored[n] = true
					}
				}
				if !killed(cmd) {
					failures = append(failures, fmt.Sprintf("engine (%s) exited without SIGKILL: %v: %q", phase, err, lines))
				}
			}()
		}
		wg.Wait()
		if len(failures) > 0 {
			t.Fatal(strings.Join(failures, "\n"))
		}
		took, _ := sc.waitQuiet(t, 0, 3*time.Second)
		// A session leaves the table just before its rings are unlinked,
		// and a half attach may still be creating its rings: wait for them.
		w0 := time.Now()
		for left := ringFiles(sc.dir); len(left) > 0; left = ringFiles(sc.dir) {
			if time.Since(w0) > 3*time.Second {
				t.Fatalf("ring files left after wave %d: %v", done/wave, left)
			}
			sc.waitQuiet(t, 0, 3*time.Second)
			time.Sleep(5 * time.Millisecond)
		}
		maxReclaim = max(maxReclaim, took+time.Since(w0))
	}
	elapsed := time.Since(t0)
	st := sc.state()
	if !sc.alive() {
		t.Fatal("sidecar died")
	}
	// A new engine attaches and gets every fully stored prompt, byte-exact.
	c := dial(t, opts(sc.sock, "after"))
	dst := newRegion(1, engineBlocks)
	if err := c.RegisterRegion(dst.reg); err != nil {
		t.Fatal(err)
	}
	hits := 0
	for p := range stored {
		d := digests("prompt-"+strconv.Itoa(p), engineBlocks)
		b := uint64(100 + p)
		c.PutHashes(b, d, false)
		v := schema.View{Batch: b, Count: engineBlocks}
		n, err := c.Lookup(v)
		if err != nil || n != engineBlocks {
			t.Fatalf("prompt %d was fully stored, now %d blocks present (%v)", p, n, err)
		}
		l, err := c.Acquire(v, time.Minute)
		if err != nil || l.Blocks != engineBlocks {
			t.Fatalf("acquire prompt %d: %+v %v", p, l, err)
		}
		if _, err := c.Load(l.Lease, 1, 0, iota32(engineBlocks)); err != nil {
			t.Fatalf("load prompt %d: %v", p, err)
		}
		for j := 0; j < engineBlocks; j++ {
			if !pageOK(dst.page(j), d[j*32:(j+1)*32], 0) {
				t.Fatalf("prompt %d block %d: wrong bytes", p, j)
			}
		}
		hits += engineBlocks
		c.Release(l.Lease)
	}
	if len(stored) == 0 {
		t.Fatal("no engine stored a whole prompt: nothing to check")
	}
	row.add("%d engines killed in %v (%v); slowest reclaim after a wave %v (bound 3 s)", rounds, elapsed.Round(time.Millisecond), phases, maxReclaim.Round(time.Millisecond))
	row.add("pool after: %d blocks, free %d + used %d = capacity %d, 0 leases/pins/writes", st.Pool.Blocks, st.Pool.Free, st.Pool.Used, st.Pool.Capacity)
	row.add("new engine: %d/%d prompts fully hit, %d blocks loaded byte-exact", len(stored), enginePrompts, hits)
}

// killed reports whether a finished command died of SIGKILL.
func killed(cmd *exec.Cmd) bool {
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}
