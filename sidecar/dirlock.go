package sidecar

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/ringside-kv/ringside/internal/sys"
)

// lockName is the lock file in --dir; it holds the holder's pid.
const lockName = "ringside.lock"

// lockDir takes the exclusive lock of dir, so that a second sidecar on the
// same directory refuses to start, naming the holder's pid, before it
// touches the socket, the pool or a ring of the first. The lock is held
// until Unlock (Serve's end) or the process's end, whichever comes first.
func lockDir(dir string) (*sys.FileLock, error) {
	path := filepath.Join(dir, lockName)
	l, err := sys.TryLock(path, []byte(strconv.Itoa(os.Getpid())+"\n"))
	var le *sys.LockedError
	if errors.As(err, &le) {
		holder := "pid " + strings.TrimSpace(le.Holder)
		if strings.TrimSpace(le.Holder) == "" {
			holder = "a sidecar still starting"
		}
		return nil, fmt.Errorf("--dir %s is in use by another sidecar (%s holds %s): stop it, or give this one a directory of its own", dir, holder, path)
	}
	if err != nil {
		return nil, fmt.Errorf("--dir: %w", err)
	}
	return l, nil
}

// checkDir refuses a --dir that a process of another uid could write to:
// one owned by another uid, writable by others (sticky or not: another uid
// could still create the next ring's or the lock's name first), or writable
// by a group other than the sidecar's own unless groupAccess asks for that.
// Such a uid could replace the socket (and receive the attach requests of
// engines, root ones included), the pool or a ring. Its parents are not
// checked: a memory-backed emptyDir is mode 0777.
func checkDir(dir string, groupAccess bool) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("--dir: %w", err)
	}
	uid, gid, ok := sys.Owner(fi)
	if !ok {
		return fmt.Errorf("--dir %s: cannot tell who owns it", dir)
	}
	euid, egid := uint32(os.Geteuid()), uint32(os.Getegid())
	mode := uint32(fi.Mode().Perm())
	if fi.Mode()&os.ModeSticky != 0 {
		mode |= 0o1000
	}
	if fi.Mode()&os.ModeSetgid != 0 {
		mode |= 0o2000
	}
	var why, hint string
	switch {
	case uid != euid:
		why = "another uid owns it, so a process of that uid"
	case mode&0o002 != 0:
		why = "every uid may write to it, so a process of any uid"
	case mode&0o020 != 0 && gid != egid && !groupAccess:
		why = fmt.Sprintf("group %d, not the sidecar's own, may write to it, so a process of that group", gid)
		hint = " (--group-access allows a group that engines of another uid share)"
	default:
		return nil
	}
	return fmt.Errorf("--dir %s is owned by uid %d, gid %d, mode %04o: %s could replace the socket (and receive engines' attach requests), the pool or a ring; the sidecar (uid %d, gid %d) needs a directory of its own that no other uid may write to (mode 0700, or 0770 with --group-access)%s",
		dir, uid, gid, mode, why, euid, egid, hint)
}
