package nodebench

import (
	"os"
	"runtime/pprof"
	"syscall"
	"testing"
	"time"
)

func cpu() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestZZProf(t *testing.T) {
	f, _ := os.Create("/tmp/node.prof")
	defer f.Close()
	for _, bs := range []int{4 << 10} {
		for _, blocks := range []int{64} {
			groups := 10
			held := groups * blocks
			tr, err := Start(t.TempDir()+"/t", bs, held)
			if err != nil {
				t.Fatal(err)
			}
			if err := tr.WriteAll(time.Minute); err != nil {
				t.Fatal(err)
			}
			fs := make([]interface{}, 0)
			_ = fs
			for g := 0; g < groups; g++ {
				tr.Fetch(tr.FetchRange(g*blocks, blocks))
			}
			n := 5000
			pprof.StartCPUProfile(f)
			defer pprof.StopCPUProfile()
			c0, w0 := cpu(), time.Now()
			for i := 0; i < n; i++ {
				g := i % groups
				tr.Fetch(tr.FetchRange(g*blocks, blocks))
			}
			w, c := time.Since(w0), cpu()-c0
			t.Logf("bs %d blocks %d: per fetch wall %v cpu %v", bs, blocks, w/time.Duration(n), c/time.Duration(n))
			tr.Close()
		}
	}
}
