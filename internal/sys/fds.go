package sys

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// ReadFDs reads one datagram from c into buf with the descriptors it
// carries (SCM_RIGHTS; received close-on-exec). The descriptors are the
// caller's to close, whatever else it returns. truncated reports a
// datagram longer than buf or descriptors beyond room for maxFDs (the
// kernel closed those). A control message other than SCM_RIGHTS is
// ignored.
func ReadFDs(c *net.UnixConn, buf []byte, maxFDs int) (n int, fds []int, truncated bool, err error) {
	oob := make([]byte, unix.CmsgSpace(4*maxFDs))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		for i := range msgs {
			if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
				continue
			}
			got, rerr := unix.ParseUnixRights(&msgs[i])
			fds = append(fds, got...)
			perr = errors.Join(perr, rerr)
		}
		if perr != nil && err == nil {
			err = fmt.Errorf("parsing the control message: %w", perr)
		}
	}
	truncated = flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0
	return n, fds, truncated, err
}

// CloseFDs closes every descriptor of fds.
func CloseFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// FDKind names what descriptor fd of this process is ("socket", "FIFO",
// "directory", "character device", "block device", "regular file",
// "symbolic link", "other") and what /proc/self/fd says it points at
// (e.g. "/dev/zero", "socket:[12345]", "/memfd:x (deleted)"; empty if
// unreadable). notFile reports the kinds that are never a device
// driver's exported memory: sockets, FIFOs and directories.
func FDKind(fd int) (kind, target string, notFile bool) {
	target, _ = os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "unreadable descriptor (" + err.Error() + ")", target, false
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFSOCK:
		return "socket", target, true
	case unix.S_IFIFO:
		return "FIFO", target, true
	case unix.S_IFDIR:
		return "directory", target, true
	case unix.S_IFCHR:
		return "character device", target, false
	case unix.S_IFBLK:
		return "block device", target, false
	case unix.S_IFREG:
		return "regular file", target, false
	case unix.S_IFLNK:
		return "symbolic link", target, false
	}
	return "other", target, false
}
