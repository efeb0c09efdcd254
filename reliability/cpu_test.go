package reliability

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ringside-kv/ringside/connector"
	"github.com/ringside-kv/ringside/schema"
)

func init() {
	defect(Defect{Issue: 16, Point: 21, Title: "(same class as the futex and wake-up floods above) a client that keeps bumping and waking the futex word its session loop parks on, publishing nothing, turns the loop into a busy loop",
		Tests:  "TestFutexHammer",
		Before: "with the guard removed (maxSpuriousWakes = 1<<30, same build otherwise): the sidecar spent 55 CPU ticks while the attacker spent 137 (3,194,540 wakes): ratio 0.40 > 0.1",
		Fix:    "a wait woken early 32 times in a row with nothing to read sleeps without the futex for the rest of it (ring/wait.go): a hostile peer costs one check a park"})
	defect(Defect{Issue: 16, Point: 22, Title: "a client that writes on its attach socket after the handshake keeps a sidecar goroutine reading and discarding, and keeps its session",
		Tests:  "TestSocketChatter",
		Before: "with the old read-and-discard loop: session 2 still attached after 5s",
		Fix:    "anything written on the socket after the handshake ends the session (docs/protocol.md 4.1)"})
}

// cpuTicks is the user+system CPU time of process pid, in clock ticks.
func cpuTicks(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	u, _ := strconv.ParseInt(f[11], 10, 64) // field 14
	s, _ := strconv.ParseInt(f[12], 10, 64) // field 15
	return u + s
}

// threadTicks is the CPU time of this process's calling thread.
func threadTicks() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/stat", unix.Gettid()))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return u + s
}

// TestFutexHammer: a client keeps changing and waking the futex word the
// sidecar's session loop parks on (its submission ring's data futex),
// without publishing anything. The sidecar must not turn that into a busy
// loop: its CPU while the attack runs stays a small fraction of the CPU the
// attacker spends (a same-run ratio), and a bystander of another tenant
// keeps working within 5x of its latency without the attack.
func TestFutexHammer(t *testing.T) {
	row := record(t, "Resource exhaustion", "a client bumps and wakes the futex word its session loop parks on (the submission ring's data futex), in a tight loop, publishing nothing",
		"the sidecar spends less than a tenth of the CPU the attacker spends (same run); a bystander of another tenant sees no failure or wrong byte, and its median Lookup and Load latency stays within 5x of its median without the attack", "")
	sc := startSidecar(t, newDir(t))
	b := startBystander(t, sc)
	b.baseline(300)
	c := dial(t, opts(sc.sock, "hammer"))
	sub, _ := c.RingFDs()
	mem, err := unix.Mmap(sub, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	word := (*atomic.Uint32)(unsafe.Pointer(&mem[388])) // the data futex (ring/layout.go)
	hammer := func(d time.Duration) (attacker int64, wakes int) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		a0 := threadTicks()
		for t0 := time.Now(); time.Since(t0) < d; {
			word.Add(1)
			unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(word)), 1 /* FUTEX_WAKE */, 1<<30, 0, 0, 0)
			wakes++
		}
		return threadTicks() - a0, wakes
	}
	// First the CPU, with nothing else going on: what the sidecar spends
	// while the attacker spends a core.
	s0 := cpuTicks(t, sc.pid())
	attackerCPU, wakes := hammer(2 * time.Second)
	sidecarCPU := cpuTicks(t, sc.pid()) - s0
	// Then the bystander, under the same attack.
	b.during(func() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			hammer(2 * time.Second)
		}()
		<-done
		b.waitRounds(20, 3*time.Second)
	})
	b.baseline(300)
	rep := b.check(t, 5)
	if err := c.Ping(7); err != nil {
		t.Errorf("the hammering client's own session: %v", err)
	}
	ratio := float64(sidecarCPU) / float64(max(attackerCPU, 1))
	if attackerCPU < 50 { // under 0.5 s of CPU in 2 s: the measurement says nothing
		t.Skipf("the attacker got only %d ticks of CPU in 2 s (a loaded machine)", attackerCPU)
	}
	if ratio > 0.1 {
		t.Errorf("the sidecar spent %d CPU ticks while the attacker spent %d (%d wakes): ratio %.2f > 0.1", sidecarCPU, attackerCPU, wakes, ratio)
	}
	row.add("%d wakes in 2 s; CPU ticks: attacker %d, sidecar %d (ratio %.3f, bound 0.1)", wakes, attackerCPU, sidecarCPU, ratio)
	row.add("%v", rep)
}

// TestSocketChatter: a client that writes on its attach socket after the
// handshake loses its session (the socket carries no messages then), and
// never keeps a sidecar thread busy reading.
func TestSocketChatter(t *testing.T) {
	row := record(t, "Hostile input", "a client writes on its attach socket after the handshake, as fast as it can",
		"its session ends (its next call fails); the sidecar serves another session", "")
	sc := startSidecar(t, newDir(t))
	by := dial(t, opts(sc.sock, "bystander"))
	c := dial(t, opts(sc.sock, "chatter"))
	fd := socketFD(t, c)
	for i := 0; i < 100; i++ {
		if _, err := syscall.Write(fd, make([]byte, 64)); err != nil {
			break
		}
	}
	sc.waitGone(t, c.Info().Session, 5*time.Second)
	if _, err := c.Lookup(schema.View{Batch: 1}); err == nil {
		t.Error("the chattering session still serves")
	}
	if err := by.Ping(3); err != nil {
		t.Fatal(err)
	}
	row.add("session ended; bystander served")
}

// socketFD is c's attach socket.
func socketFD(t *testing.T, c *connector.Client) int {
	t.Helper()
	fd := c.SocketFD()
	if fd < 0 {
		t.Fatal("the client has no socket")
	}
	return fd
}
