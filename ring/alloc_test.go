package ring

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// smallTmpfs mounts a tmpfs of size bytes (root, CAP_SYS_ADMIN) and
// returns its directory.
func smallTmpfs(t *testing.T, size string) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Skipf("cannot mount a %s tmpfs here (%v): needs root", size, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// fill writes a file into dir until the mount is full.
func fill(t *testing.T, dir string) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			return
		}
	}
}

func freeBytes(t *testing.T, dir string) uint64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return st.Bavail * uint64(st.Bsize)
}

// TestCreateNoSpace: a ring that does not fit its mount is refused by
// Create with an error wrapping ENOSPC and leaves no file behind; neither
// Create nor a write into a ring it made may fault (SIGBUS on a sparse page
// that the full mount cannot back).
func TestCreateNoSpace(t *testing.T) {
	for _, tc := range []struct {
		name     string
		mount    string
		full     bool   // fill the mount first
		capacity uint64 // the ring's data capacity
	}{
		{"full mount", "1m", true, MinCapacity},
		{"room for the header only", "1m", false, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := smallTmpfs(t, tc.mount)
			if tc.full {
				fill(t, dir)
			}
			free := freeBytes(t, dir)
			path := filepath.Join(dir, "s1-0.sub")
			var f *File
			var err error
			phase := "Create"
			func() {
				// A fault is a panic here, not the end of the test binary.
				defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
				defer func() {
					if r := recover(); r != nil {
						if a, ok := r.(interface{ Addr() uintptr }); ok {
							r = fmt.Sprintf("memory fault (SIGBUS) at %#x", a.Addr())
						}
						t.Fatalf("%s faulted on a %s tmpfs with %d bytes free: %v", phase, tc.mount, free, r)
					}
				}()
				f, err = Create(path, Options{Capacity: tc.capacity})
				if err == nil {
					// The whole ring must be writable without a fault.
					phase = "a write into the ring Create made"
					b := f.m.Bytes()
					for i := 0; i < len(b); i += 4096 {
						b[i] = 0
					}
				}
			}()
			if err == nil {
				f.Close()
				t.Fatalf("Create of a %d-byte ring with %d bytes free succeeded", HeaderSize+tc.capacity, free)
			}
			if !errors.Is(err, syscall.ENOSPC) {
				t.Errorf("Create: %v, want an error wrapping ENOSPC", err)
			}
			if _, serr := os.Lstat(path); !os.IsNotExist(serr) {
				t.Errorf("a refused Create left %s behind (%v)", path, serr)
			}
			if now := freeBytes(t, dir); now != free {
				t.Errorf("%d bytes free after the refused Create, %d before", now, free)
			}
		})
	}
}

// TestCreateAllocates: a new ring's file is allocated in full (no sparse
// page a later write could fault on).
func TestCreateAllocates(t *testing.T) {
	dir := smallTmpfs(t, "4m")
	path := filepath.Join(dir, "s1-0.sub")
	f, err := Create(path, Options{Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if size := int64(HeaderSize + 1<<20); st.Blocks*512 < size {
		t.Errorf("%d bytes allocated of a %d-byte ring", st.Blocks*512, size)
	}
}
