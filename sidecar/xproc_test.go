package sidecar_test

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/gpu/gputest"
	"github.com/ringside-kv/ringside/schema"
)

// The test binary doubles as an engine process: with RINGSIDE_ENGINE_SOCKET
// set it attaches, stores and loads in a loop until it is killed.
func TestMain(m *testing.M) {
	if sock := os.Getenv("RINGSIDE_ENGINE_SOCKET"); sock != "" {
		os.Exit(engineMain(sock))
	}
	code := m.Run()
	gputest.SweepFakeFiles() // the fake driver's files of engines the tests killed
	os.Exit(code)
}

func engineMain(sock string) int {
	c, err := connector.Dial(connector.Options{Socket: sock, Instance: "victim-" + strconv.Itoa(os.Getpid()), Model: "llama", Layout: "bf16/16/HND"})
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	buf := make([]byte, 16*slot)
	reg := schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess, PID: uint64(os.Getpid()),
		Base: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint64(len(buf)), PageSize: slot, PageCount: 16}
	if err := c.RegisterRegion(reg); err != nil {
		fmt.Println("register:", err)
		return 1
	}
	fmt.Println("ready")
	for i := uint64(1); ; i++ {
		c.PutHashes(i, digests(strconv.FormatUint(i%4, 10), 8), false)
		c.Store(schema.View{Batch: i, Count: 8}, 1, []uint32{0, 1, 2, 3, 4, 5, 6, 7})
		l, err := c.Acquire(schema.View{Batch: i, Count: 8}, time.Hour)
		if err == nil && l.Lease != 0 {
			// Leave some leases and loads dangling on purpose.
			seq, _ := c.Submit(schema.TypeLoad, (&schema.Load{Lease: l.Lease, Region: 1, Pages: []uint32{8, 9, 10, 11}}).Append(nil))
			if i%3 != 0 {
				c.Await(seq)
				c.Release(l.Lease)
			}
		}
		c.DropHashes(i)
	}
}

// TestEngineKilledMidTraffic kills engine processes with SIGKILL at random
// points of their traffic: afterwards every lease is reclaimed, the pool's
// accounting is exact, stored blocks are still served, and a new engine
// attaches and gets hits.
func TestEngineKilledMidTraffic(t *testing.T) {
	h := newHarness(t, nil)
	rounds := 20
	if testing.Short() {
		rounds = 5
	}
	rng := rand.New(rand.NewPCG(7, 7))
	for round := 0; round < rounds; round++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "RINGSIDE_ENGINE_SOCKET="+h.cfg.Socket)
		out, _ := cmd.StdoutPipe()
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(out)
		if !sc.Scan() || sc.Text() != "ready" {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("engine did not start: %q", sc.Text())
		}
		time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := h.srv.State()
		p := st.Pool
		if len(st.Sessions) == 0 && p.Leases == 0 && p.Writing == 0 && p.PinnedBlocks == 0 {
			if p.Free+p.Used != p.Capacity {
				t.Fatalf("accounting: %+v", p)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not reclaimed: %d sessions, %+v", len(st.Sessions), p)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Blocks fully stored by the dead engines are still served to a new one
	// of the same namespace (the four prompts the engines cycled through).
	c := h.dial(func(o *connector.Options) { o.Instance = "after" })
	hits := 0
	for i := 0; i < 4; i++ {
		c.PutHashes(uint64(100+i), digests(strconv.Itoa(i), 8), false)
		n, err := c.Lookup(schema.View{Batch: uint64(100 + i), Count: 8})
		if err != nil {
			t.Fatal(err)
		}
		hits += n
	}
	if hits == 0 {
		t.Fatal("a new engine got no hits from blocks the killed engines had stored")
	}
}
