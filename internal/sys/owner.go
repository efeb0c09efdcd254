package sys

import (
	"os"
	"syscall"
)

// Owner returns the uid and gid that own the file fi describes (from
// os.Stat or os.Lstat); ok is false where the platform does not say.
func Owner(fi os.FileInfo) (uid, gid uint32, ok bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	return st.Uid, st.Gid, true
}
