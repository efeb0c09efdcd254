package node_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/bench/nodebench"
)

// BenchmarkNodeTier measures writes and fetches of 256 KiB blocks (world
// size 1) through a node process in this process, over the real socket: a
// write is copied twice (pod pool to window to node pool) and checksummed
// on both sides, a fetch copied once (node pool to pod pool) and
// checksummed as it is copied. The node tier is bench/nodebench's
// (`ringside-bench node` measures its fetches against a plain copy).
func BenchmarkNodeTier(b *testing.B) {
	const bs, blocks = 256 << 10, 64
	dir, _ := os.MkdirTemp("", "rsnb")
	defer os.RemoveAll(dir)
	t, err := nodebench.Start(filepath.Join(dir, "t"), bs, 2*blocks)
	if err != nil {
		b.Fatal(err)
	}
	defer t.Close()
	b.Run("write", func(b *testing.B) {
		b.SetBytes(bs)
		for i := 0; i < b.N; i++ {
			if !t.Write(nodebench.Digest(1<<30+i), i%blocks) {
				b.Fatal("refused")
			}
		}
	})
	for i := 0; i < blocks; i++ {
		if !t.Write(nodebench.Digest(i), i) {
			b.Fatal("refused")
		}
	}
	if err := t.WaitWrites(time.Minute); err != nil {
		b.Fatal(err)
	}
	b.Run("fetch16", func(b *testing.B) {
		b.SetBytes(16 * bs)
		f := t.FetchRange(0, 16)
		for i := 0; i < b.N; i++ {
			if t.Fetch(f) != 16 {
				b.Fatal("miss")
			}
		}
	})
}
