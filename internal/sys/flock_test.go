package sys

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestTryLock(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "lock")
	l, err := TryLock(path, []byte("first\n"))
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); string(b) != "first\n" {
		t.Fatalf("lock file holds %q", b)
	}
	// A second open file description (another sidecar) is refused and
	// told what the holder wrote.
	_, err = TryLock(path, []byte("second\n"))
	var le *LockedError
	if !errors.As(err, &le) || le.Holder != "first\n" {
		t.Fatalf("second lock: %v, want a LockedError naming the holder", err)
	}
	if err := l.Unlock(); err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(); err != nil {
		t.Fatalf("second Unlock: %v", err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("lock file still there after Unlock: %v", err)
	}
	// A lock file left by a holder that died (no flock on it) is taken,
	// its stale content replaced.
	os.WriteFile(path, []byte("a much longer stale holder\n"), 0o600)
	l, err = TryLock(path, []byte("third\n"))
	if err != nil {
		t.Fatalf("a stale lock file: %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "third\n" {
		t.Fatalf("lock file holds %q", b)
	}
	l.Unlock()
}

func TestTryLockRefusesLinksAndNonFiles(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(dir, "victim")
	os.WriteFile(victim, []byte("keep"), 0o600)
	link := filepath.Join(dir, "link")
	os.Symlink(victim, link)
	if l, err := TryLock(link, []byte("x")); err == nil {
		l.Unlock()
		t.Fatal("locked through a symbolic link")
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Fatalf("the link's target was written: %q", b)
	}
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o700)
	if l, err := TryLock(sub, []byte("x")); err == nil {
		l.Unlock()
		t.Fatal("locked a directory")
	}
}

// TryLockWriteOnly's file is mode 0200 (a stale one is made so once
// locked), so that a process of the same uid that cannot write into the
// directory cannot open it to hold the lock; a second holder is refused.
func TestTryLockWriteOnly(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "lock")
	os.WriteFile(path, []byte("a stale holder, readable\n"), 0o644)
	l, err := TryLockWriteOnly(path, []byte("1\n"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o200 {
		t.Fatalf("lock file mode %v (%v), want 0200", st.Mode().Perm(), err)
	}
	_, err = TryLockWriteOnly(path, []byte("2\n"))
	var le *LockedError
	if !errors.As(err, &le) || le.Holder != "" {
		t.Fatalf("second lock: %v, want a LockedError", err)
	}
	l.Unlock()
	l, err = TryLockWriteOnly(path, []byte("3\n"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o200 {
		t.Fatalf("a new lock file's mode %v (%v), want 0200", st.Mode().Perm(), err)
	}
	l.Unlock()
}
