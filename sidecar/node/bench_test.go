package node

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/sidecar/machine"
)

// BenchmarkNodeTier measures writes and fetches of 256 KiB blocks (world
// size 1) through a node process in this process, over the real socket and
// windows: each block is copied twice (pod pool to window to node pool, or
// back) and checksummed on both sides.
func BenchmarkNodeTier(b *testing.B) {
	const bs, blocks = 256 << 10, 64
	dir, _ := os.MkdirTemp("", "rsnb")
	defer os.RemoveAll(dir)
	s, err := NewServer(ServerConfig{Dir: filepath.Join(dir, "n"), PoolBytes: 2 * blocks * (bs + SlotHeadroom), SlotBytes: bs, PodShare: 1}, zerolog.Nop())
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); <-s.Done() }()
	go s.Serve(ctx)
	pool := make([]byte, 2*blocks*bs)
	c, err := NewClient(ClientConfig{Socket: s.Socket(), Pod: "bench", IOTimeout: 10 * time.Second, LookupTimeout: time.Second}, pool, bs, zerolog.Nop())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	c.WaitConnected(5 * time.Second)
	ns := machine.L2NamespaceFor("m", "l", "", 16, 1)
	d := func(i int) []byte { return []byte(fmt.Sprintf("%016d", i)) }
	for i := range pool {
		pool[i] = byte(i * 7)
	}
	b.Run("write", func(b *testing.B) {
		b.SetBytes(bs)
		done := make(chan bool, blocks)
		for i := 0; i < b.N; i++ {
			c.Write(machine.L2Write{NS: ns, Digest: d(i), Length: bs, PoolOffsets: []uint64{uint64(i%blocks) * bs}}, func(bool) { done <- true })
			<-done
		}
	})
	for i := 0; i < blocks; i++ {
		done := make(chan bool, 1)
		c.Write(machine.L2Write{NS: ns, Digest: d(1<<30 + i), Length: bs, PoolOffsets: []uint64{uint64(i) * bs}}, func(bool) { done <- true })
		<-done
	}
	time.Sleep(100 * time.Millisecond)
	b.Run("fetch16", func(b *testing.B) {
		b.SetBytes(16 * bs)
		f := machine.L2Fetch{NS: ns, Length: bs, MaxLength: bs}
		for k := 0; k < 16; k++ {
			f.Blocks = append(f.Blocks, machine.L2FetchBlock{Digest: d(1<<30 + k), PoolOffsets: []uint64{uint64(blocks+k) * bs}})
		}
		ch := make(chan []machine.L2FetchResult, 1)
		for i := 0; i < b.N; i++ {
			c.Fetch(f, func(r []machine.L2FetchResult) { ch <- r })
			if r := <-ch; !r[15].OK {
				b.Fatal("miss")
			}
		}
	})
}
