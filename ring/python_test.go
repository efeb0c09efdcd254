package ring_test

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/ring"
)

// Cross-language tests: a Go process and a Python process (the connector in
// ../connector/python, driven through `python3 -m ringside._xproc`) exchange
// records through a real ring file under /dev/shm. The record script is
// shared with ringside/_xproc.py: record i has seq i, type 1+i%3, flags
// i&0xffff, pySizeFor(i) payload bytes following the golden payload rule.

func pySizeFor(i int) int {
	if i%97 == 0 {
		return 3000
	}
	return (i * 37) % 301
}

func pyTypeFor(i int) uint16 { return uint16(1 + i%3) }

type pyResult struct {
	N     int    `json:"n"`
	Bytes int    `json:"bytes"`
	CRC   uint32 `json:"crc"`
}

// pythonCmd returns a python3 command running ringside._xproc with the
// connector on PYTHONPATH, or skips the test when python3 is missing.
func pythonCmd(t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found")
	}
	pkg, err := filepath.Abs(filepath.Join("..", "connector", "python"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(pkg, "ringside", "ring.py")); err != nil {
		t.Skipf("Python connector not found: %v", err)
	}
	cmd := exec.Command(py, append([]string{"-m", "ringside._xproc"}, args...)...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pkg)
	return cmd
}

// pyShmPath returns a unique ring path under /dev/shm, removed at cleanup.
func pyShmPath(t *testing.T) string {
	t.Helper()
	dir := "/dev/shm"
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		dir = t.TempDir()
	}
	var b [6]byte
	rand.Read(b[:])
	p := filepath.Join(dir, fmt.Sprintf("ringside-gotest-%d-%s", os.Getpid(), hex.EncodeToString(b[:])))
	t.Cleanup(func() { os.Remove(p) })
	return p
}

func pyCheckRecord(t *testing.T, i int, rec ring.Record) {
	t.Helper()
	n := pySizeFor(i)
	if rec.Seq != uint64(i) || rec.Type != pyTypeFor(i) || rec.Flags != uint16(i) || !bytes.Equal(rec.Payload, goldenPayload(uint64(i), n)) {
		t.Fatalf("record %d: seq=%d type=%d flags=%d len=%d", i, rec.Seq, rec.Type, rec.Flags, len(rec.Payload))
	}
}

func TestPythonConsumesGo(t *testing.T) {
	const n = 3000
	path := pyShmPath(t)
	f, err := ring.Create(path, ring.Options{Capacity: 16 << 10, CreatorProducer: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p, err := ring.NewProducer(f.Ring, ring.DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	cmd := pythonCmd(t, "consume", path, fmt.Sprint(n), "--epoch", fmt.Sprintf("%#x", f.Epoch()), "--timeout", "60")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	deadline := time.Now().Add(60 * time.Second)
	var crc uint32
	total := 0
	for i := 0; i < n; i++ {
		pl := goldenPayload(uint64(i), pySizeFor(i))
		for {
			err := p.Append(pyTypeFor(i), uint16(i), uint64(i), pl)
			if err == nil {
				break
			}
			if !errors.Is(err, ring.ErrFull) {
				t.Fatal(err)
			}
			p.Publish()
			if err := p.WaitSpace(ring.RecordSize(len(pl)), deadline); err != nil {
				t.Fatalf("record %d: %v; python stderr: %s", i, err, stderr.String())
			}
		}
		crc = crc32.Update(crc, crc32.IEEETable, pl)
		total += len(pl)
		if i%5 == 4 {
			p.Publish()
		}
	}
	p.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("python consumer: %v; stderr: %s", err, stderr.String())
	}
	var got pyResult
	if err := json.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("python output %q: %v", stdout.String(), err)
	}
	if want := (pyResult{N: n, Bytes: total, CRC: crc}); got != want {
		t.Fatalf("python read %+v, Go wrote %+v", got, want)
	}
	if tail, _ := f.Positions(); tail < 20*uint64(f.Capacity()) {
		t.Fatalf("only %d bytes went through a %d-byte ring: not enough wraps", tail, f.Capacity())
	}
}

func TestPythonProducesGo(t *testing.T) {
	const n = 3000
	path := pyShmPath(t)
	f, err := ring.Create(path, ring.Options{Capacity: 16 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := ring.NewConsumer(f.Ring, ring.DefaultWait)
	if err != nil {
		t.Fatal(err)
	}
	cmd := pythonCmd(t, "produce", path, fmt.Sprint(n), "--epoch", fmt.Sprintf("%#x", f.Epoch()), "--timeout", "60")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	deadline := time.Now().Add(60 * time.Second)
	var crc uint32
	total := 0
	for i := 0; i < n; {
		rec, err := c.Next()
		if errors.Is(err, ring.ErrEmpty) {
			c.Commit()
			if err := c.Wait(deadline); err != nil {
				t.Fatalf("after %d records: %v; python stderr: %s", i, err, stderr.String())
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		pyCheckRecord(t, i, rec)
		crc = crc32.Update(crc, crc32.IEEETable, rec.Payload)
		total += len(rec.Payload)
		i++
		if i%7 == 0 {
			c.Commit()
		}
	}
	c.Commit()
	if err := c.Wait(time.Now().Add(30 * time.Second)); !errors.Is(err, ring.ErrPeerClosed) {
		t.Fatalf("after the last record: %v, want ErrPeerClosed", err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("python producer: %v; stderr: %s", err, stderr.String())
	}
	var got pyResult
	if err := json.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("python output %q: %v", stdout.String(), err)
	}
	if want := (pyResult{N: n, Bytes: total, CRC: crc}); got != want {
		t.Fatalf("python wrote %+v, Go read %+v", got, want)
	}
}

func TestPythonProducerKilled(t *testing.T) {
	path := pyShmPath(t)
	f, err := ring.Create(path, ring.Options{Capacity: 16 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := ring.NewConsumer(f.Ring, ring.ParkWait)
	if err != nil {
		t.Fatal(err)
	}
	cmd := pythonCmd(t, "produce-forever", path, "--interval-ms", "1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "ready\n" {
		t.Fatalf("python producer said %q, %v; stderr: %s", line, err, stderr.String())
	}
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; i < 30; {
		rec, err := c.Next()
		if errors.Is(err, ring.ErrEmpty) {
			c.Commit()
			if err := c.Wait(deadline); err != nil {
				t.Fatalf("after %d records: %v", i, err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		pyCheckRecord(t, i, rec)
		i++
	}
	c.Commit()
	if !f.ProducerAlive() {
		t.Fatal("producer reported dead while running")
	}
	// SIGKILL mid-stream: no chance to mark the ring closed.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	cmd.Wait()
	for {
		err := c.Wait(time.Now().Add(5 * time.Second))
		if err == nil {
			for {
				if _, err := c.Next(); err != nil {
					break
				}
			}
			c.Commit()
			continue
		}
		if !errors.Is(err, ring.ErrPeerDead) {
			t.Fatalf("Wait after SIGKILL: %v, want ErrPeerDead", err)
		}
		break
	}
	if d := time.Since(killed); d > 2*time.Second {
		t.Fatalf("ErrPeerDead took %v", d)
	}
}
