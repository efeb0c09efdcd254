package ring

import (
	"bufio"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as the peer process: with RINGSIDE_RING_CHILD set
// it runs childMain instead of the tests.
func TestMain(m *testing.M) {
	if mode := os.Getenv("RINGSIDE_RING_CHILD"); mode != "" {
		os.Exit(childMain(mode, os.Getenv("RINGSIDE_RING_PATH")))
	}
	os.Exit(m.Run())
}

const xprocRecords = 20000

func xprocPayload(i int) []byte { return payloadOf(i, (i*131)%3000) }

// childMain: "produce" writes xprocRecords records then closes; "consume"
// reads them and prints a checksum; "produce-forever" writes until killed.
func childMain(mode, path string) int {
	f, err := Open(path, 0)
	if err != nil {
		fmt.Println("open:", err)
		return 1
	}
	deadline := time.Now().Add(time.Minute)
	switch mode {
	case "produce", "produce-forever":
		p, err := NewProducer(f.Ring, DefaultWait)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		fmt.Println("ready")
		for i := 0; mode == "produce-forever" || i < xprocRecords; i++ {
			if err := p.Write(1, 0, uint64(i), xprocPayload(i), deadline); err != nil {
				fmt.Println("write:", err)
				return 1
			}
		}
		p.Close()
	case "consume":
		c, err := NewConsumer(f.Ring, DefaultWait)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		fmt.Println("ready")
		crc := crc32.NewIEEE()
		for i := 0; i < xprocRecords; i++ {
			if err := c.Wait(deadline); err != nil {
				fmt.Println("wait:", err)
				return 1
			}
			rec, err := c.Next()
			if err != nil || rec.Seq != uint64(i) {
				fmt.Println("next:", err, rec.Seq)
				return 1
			}
			crc.Write(rec.Payload)
			c.Commit()
		}
		fmt.Println("crc", crc.Sum32())
	}
	return 0
}

func startChild(t *testing.T, mode, path string) (*exec.Cmd, *bufio.Scanner) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "RINGSIDE_RING_CHILD="+mode, "RINGSIDE_RING_PATH="+path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	sc := bufio.NewScanner(out)
	if !sc.Scan() || sc.Text() != "ready" {
		t.Fatalf("child did not start: %q", sc.Text())
	}
	return cmd, sc
}

func TestCrossProcessChildProduces(t *testing.T) {
	path := shmDir(t) + "/ring"
	f, err := Create(path, Options{Capacity: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := NewConsumer(f.Ring, DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	startChild(t, "produce", path)
	deadline := time.Now().Add(time.Minute)
	crc := crc32.NewIEEE()
	for i := 0; i < xprocRecords; i++ {
		if err := c.Wait(deadline); err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		rec, err := c.Next()
		if err != nil {
			t.Fatal(err)
		}
		if rec.Seq != uint64(i) {
			t.Fatalf("seq %d, want %d", rec.Seq, i)
		}
		crc.Write(rec.Payload)
		c.Commit()
	}
	want := crc32.NewIEEE()
	for i := 0; i < xprocRecords; i++ {
		want.Write(xprocPayload(i))
	}
	if crc.Sum32() != want.Sum32() {
		t.Fatal("checksum mismatch")
	}
	if err := c.Wait(deadline); !errors.Is(err, ErrPeerClosed) {
		t.Fatalf("after child closed: %v", err)
	}
}

func TestCrossProcessChildConsumes(t *testing.T) {
	path := shmDir(t) + "/ring"
	f, err := Create(path, Options{Capacity: 64 << 10, CreatorProducer: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p, err := NewProducer(f.Ring, DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	cmd, sc := startChild(t, "consume", path)
	deadline := time.Now().Add(time.Minute)
	want := crc32.NewIEEE()
	for i := 0; i < xprocRecords; i++ {
		if err := p.Write(1, 0, uint64(i), xprocPayload(i), deadline); err != nil {
			t.Fatal(err)
		}
		want.Write(xprocPayload(i))
	}
	if !sc.Scan() {
		t.Fatal("no answer from child")
	}
	if got := sc.Text(); got != "crc "+strconv.FormatUint(uint64(want.Sum32()), 10) {
		t.Fatalf("child said %q", got)
	}
	cmd.Wait()
}

func TestCrossProcessDeadProducer(t *testing.T) {
	path := shmDir(t) + "/ring"
	f, err := Create(path, Options{Capacity: 16 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := NewConsumer(f.Ring, WaitConfig{Park: 2 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cmd, _ := startChild(t, "produce-forever", path)
	deadline := time.Now().Add(time.Minute)
	for i := 0; i < 1000; i++ {
		if err := c.Wait(deadline); err != nil {
			t.Fatal(err)
		}
		for {
			if _, err := c.Next(); err != nil {
				break
			}
		}
		c.Commit()
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	// Drain whatever it published, then the wait must report the death
	// well before the deadline.
	for {
		err := c.Wait(deadline)
		if errors.Is(err, ErrPeerDead) {
			break
		}
		if err != nil {
			t.Fatalf("got %v, want ErrPeerDead", err)
		}
		for {
			if _, err := c.Next(); err != nil {
				break
			}
		}
		c.Commit()
	}
	// A dead process's ring can be replaced by a new one at the same path.
	g, err := Create(path, Options{Capacity: 16 << 10})
	if !strings.Contains(fmt.Sprint(err), "in use") && err != nil {
		t.Fatal(err)
	}
	if err == nil {
		g.Close()
	} else {
		// This process is still recorded as the consumer and is alive.
		t.Logf("replacement refused while this process consumes: %v", err)
	}
}
