package shm

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// shmDir is a directory on the shared-memory mount where there is one (the
// file system the sidecar's pool lives on), else a temporary directory.
func shmDir(t *testing.T) string {
	t.Helper()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "ringside-shm-test-")
		if err == nil {
			t.Cleanup(func() { os.RemoveAll(d) })
			return d
		}
	}
	return t.TempDir()
}

// resident counts the pages of b that are mapped in (mincore).
func resident(t *testing.T, b []byte) int {
	t.Helper()
	vec := make([]byte, (len(b)+4095)/4096)
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatal(e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

func TestReserve(t *testing.T) {
	dir := shmDir(t)
	for _, tc := range []struct {
		name string
		size int
	}{
		{"one page", 4096},
		{"1 MiB", 1 << 20},
		{"odd tail", 3<<20 + 4096*3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, tc.name)
			m, err := Create(path, tc.size, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { m.Close(); Unlink(path) }()
			var st unix.Stat_t
			if err := unix.Stat(path, &st); err != nil {
				t.Fatal(err)
			}
			if st.Blocks*512 >= int64(tc.size) {
				t.Fatalf("a new file is already allocated (%d blocks): the test proves nothing", st.Blocks)
			}
			if err := m.Reserve(); err != nil {
				if errors.Is(err, ErrReserveUnsupported) {
					t.Skipf("%s: %v", dir, err)
				}
				t.Fatal(err)
			}
			if err := unix.Stat(path, &st); err != nil {
				t.Fatal(err)
			}
			if st.Blocks*512 < int64(tc.size) {
				t.Errorf("after Reserve: %d bytes allocated, want %d", st.Blocks*512, tc.size)
			}
			if got, want := resident(t, m.Bytes()), (tc.size+4095)/4096; got != want {
				t.Errorf("after Reserve: %d of %d pages mapped in", got, want)
			}
			for i, b := range m.Bytes() {
				if b != 0 {
					t.Fatalf("byte %d is %d after Reserve, want the new file's zero", i, b)
				}
			}
		})
	}
}

// TestReserveNoSpace: a mapping larger than its tmpfs mount (ftruncate makes
// it sparse, so Create succeeds) is refused by Reserve with ENOSPC, an error
// and not a SIGBUS. It needs to mount a small tmpfs (root, CAP_SYS_ADMIN).
func TestReserveNoSpace(t *testing.T) {
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a 1 MiB tmpfs here (%v)", err)
	}
	defer unix.Unmount(dir, 0)
	path := filepath.Join(dir, "pool")
	m, err := Create(path, 4<<20, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	err = m.Reserve()
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("Reserve of 4 MiB on a 1 MiB tmpfs: %v, want ENOSPC", err)
	}
}

// allocated is the bytes of backing store the file at path has.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func TestCreateAllocated(t *testing.T) {
	dir := shmDir(t)
	for _, size := range []int{4096, 1 << 20, 3<<20 + 4096*3} {
		path := filepath.Join(dir, "a")
		m, err := CreateAllocated(path, size, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if got := allocated(t, path); got < int64(size) {
			t.Errorf("size %d: %d bytes allocated", size, got)
		}
		if m.Len() != size {
			t.Errorf("size %d: mapped %d", size, m.Len())
		}
		for i, b := range m.Bytes() {
			if b != 0 {
				t.Fatalf("size %d: byte %d is %d, want zero", size, i, b)
			}
		}
		m.Close()
		Unlink(path)
	}
}

// TestCreateAllocatedNoSpace: on a 1 MiB tmpfs, a 4 MiB CreateAllocated
// fails with ENOSPC and leaves neither the file nor its pages; one that
// fits succeeds. So does the zero-writing fallback (file systems without
// fallocate). Needs to mount a tmpfs (root, CAP_SYS_ADMIN).
func TestCreateAllocatedNoSpace(t *testing.T) {
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a 1 MiB tmpfs here (%v)", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	free := func() uint64 {
		var st unix.Statfs_t
		if err := unix.Statfs(dir, &st); err != nil {
			t.Fatal(err)
		}
		return st.Bavail * uint64(st.Bsize)
	}
	before := free()
	path := filepath.Join(dir, "ring")
	m, err := CreateAllocated(path, 4<<20, 0o600)
	if err == nil {
		m.Close()
		t.Fatal("a 4 MiB file allocated on a 1 MiB tmpfs")
	}
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("CreateAllocated of 4 MiB on a 1 MiB tmpfs: %v, want ENOSPC", err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Errorf("the refused file is still there (%v)", err)
	}
	if now := free(); now != before {
		t.Errorf("%d bytes free after the refusal, %d before", now, before)
	}
	m, err = CreateAllocated(path, 512<<10, 0o600)
	if err != nil {
		t.Fatalf("512 KiB on an empty 1 MiB tmpfs: %v", err)
	}
	m.Close()
	Unlink(path)

	// The fallback, as used where fallocate is missing.
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := writeZeros(fd, 512<<10); err != nil {
		t.Fatal(err)
	}
	if got := allocated(t, path); got < 512<<10 {
		t.Errorf("writeZeros: %d bytes allocated of 512 KiB", got)
	}
	if err := writeZeros(fd, 4<<20); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("writeZeros of 4 MiB on a 1 MiB tmpfs: %v, want ENOSPC", err)
	}
}

func TestMemfdSealed(t *testing.T) {
	m, err := CreateMemfd("test", 1<<20, true)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if !SealedAgainstResize(m.FD()) {
		t.Fatal("not sealed")
	}
	if err := unix.Ftruncate(m.FD(), 4096); err == nil {
		t.Fatal("a sealed memfd was shrunk")
	}
	if err := unix.Ftruncate(m.FD(), 2<<20); err == nil {
		t.Fatal("a sealed memfd was grown")
	}
	m.Bytes()[123] = 7
	// Another mapping of the same descriptor (as a peer's) sees the bytes.
	fd, err := unix.Dup(m.FD())
	if err != nil {
		t.Fatal(err)
	}
	p, err := OpenFD(fd, "peer", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Bytes()[123] != 7 {
		t.Fatal("the peer's mapping does not share the memory")
	}
}
