package shm

import (
	"os"
	"testing"
)

func TestGuardedAnon(t *testing.T) {
	buf, release, err := GuardedAnon(3*os.Getpagesize() - 5)
	if err != nil {
		t.Fatal(err)
	}
	if len(buf) != 3*os.Getpagesize() || Addr(buf)%uint64(os.Getpagesize()) != 0 {
		t.Fatalf("len %d addr %#x", len(buf), Addr(buf))
	}
	for i := range buf {
		buf[i] = byte(i)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := GuardedAnon(0); err == nil {
		t.Fatal("zero size accepted")
	}
}
