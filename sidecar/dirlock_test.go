package sidecar

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/sidecar/machine"
)

func TestCheckDir(t *testing.T) {
	root := os.Getuid() == 0
	for _, tc := range []struct {
		name        string
		mode        os.FileMode
		uid, gid    int // -1: unchanged (chown needs root)
		groupAccess bool
		refuse      []string // words the error names; nil: accepted
	}{
		{"0700", 0o700, -1, -1, false, nil},
		{"0755", 0o755, -1, -1, false, nil},
		{"0770 own group", 0o770, -1, -1, false, nil},
		{"0777", 0o777, -1, -1, false, []string{"mode 0777", "every uid"}},
		{"1777", 0o777 | os.ModeSticky, -1, -1, false, []string{"mode 1777"}},
		{"0702", 0o702, -1, -1, false, []string{"mode 0702"}},
		{"another uid", 0o700, 65534, -1, false, []string{"uid 65534", "mode 0700", "another uid owns it"}},
		{"another group, group-writable", 0o770, -1, 65534, false, []string{"gid 65534", "mode 0770", "--group-access"}},
		{"another group, group-writable, --group-access", 0o770, -1, 65534, true, nil},
		{"another group, not group-writable", 0o750, -1, 65534, false, nil},
		{"another group, --group-access, writable by all", 0o777, -1, 65534, true, []string{"mode 0777"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if (tc.uid >= 0 || tc.gid >= 0) && !root {
				t.Skip("needs root to give a directory away")
			}
			dir := filepath.Join(t.TempDir(), "d")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(dir, tc.uid, tc.gid); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(dir, tc.mode); err != nil {
				t.Fatal(err)
			}
			err := checkDir(dir, tc.groupAccess)
			if tc.refuse == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.refuse {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not name %q", err, w)
				}
			}
		})
	}
}

// TestDirLockInProcess: a second Server on a running one's Dir fails in New
// naming the holder (this process) and leaves the first's files alone; once
// the first has stopped, New succeeds again.
func TestDirLockInProcess(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "d")
	cfg := Config{Dir: dir, PoolBytes: 64 * 4096, Machine: machine.Config{SlotBytes: 4096}, CopyBackend: "host"}
	first, err := New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Serve(ctx) }()
	sock, _ := os.Stat(filepath.Join(dir, "ringside.sock")) // the pool has no name (server.go)
	_, err = New(cfg, zerolog.Nop())
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Errorf("second server on the same dir: %v, want a refusal naming pid %d", err, os.Getpid())
	}
	if now, err := os.Stat(filepath.Join(dir, "ringside.sock")); err != nil || !os.SameFile(sock, now) {
		t.Errorf("the first server's socket was replaced or removed: %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	again, err := New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatalf("after the first stopped: %v", err)
	}
	ctx, cancel = context.WithCancel(context.Background())
	go func() { done <- again.Serve(ctx) }()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("files left behind: %v", left)
	}
}
