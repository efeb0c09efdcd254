package sys

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// netnsChildEnv, set to a socket path, makes this test binary a client in
// a network namespace of its own: it connects, prints its socket's cookie
// and waits for the parent to close.
const netnsChildEnv = "RS_SYS_NETNS_DIAL"

func TestMain(m *testing.M) {
	if p := os.Getenv(netnsChildEnv); p != "" {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: p, Net: "unixpacket"})
		if err != nil {
			fmt.Println("dial:", err)
			os.Exit(2)
		}
		v, err := NetNSCookie(c)
		if err != nil {
			fmt.Println(err)
			os.Exit(2)
		}
		fmt.Println(v)
		c.Read(make([]byte, 1))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestNetNSCookie: an accepted connection carries the network namespace of
// the socket that connected: the listener's own when the client shares its
// namespace, the client's (and not the listener's) when it has its own.
func TestNetNSCookie(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	mine, err := NetNSCookie(l)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if got, err := NetNSCookie(a); err != nil || got != mine {
		t.Fatalf("same namespace: accepted %d (%v), listener %d", got, err, mine)
	}
	if os.Getuid() != 0 {
		t.Skip("a client in a network namespace of its own needs root")
	}
	for i := 0; i < 2; i++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), netnsChildEnv+"="+sock)
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatalf("a child in a new network namespace: %v", err)
		}
		a, err := l.AcceptUnix()
		if err != nil {
			t.Fatal(err)
		}
		line := make([]byte, 64)
		n, _ := out.Read(line)
		theirs, perr := strconv.ParseUint(strings.TrimSpace(string(line[:n])), 10, 64)
		got, err := NetNSCookie(a)
		a.Close()
		cmd.Wait()
		if perr != nil || err != nil {
			t.Fatalf("child said %q (%v); accepted: %v", line[:n], perr, err)
		}
		if got != theirs || got == mine {
			t.Fatalf("a client in its own namespace: accepted %d, the client's socket %d, the listener's %d", got, theirs, mine)
		}
	}
}

// TestPeerClosed: an open peer is not closed, one that shut only its
// writes is not (it may still read), one that closed is.
func TestPeerClosed(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	a, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if PeerClosed(a) {
		t.Fatal("open: reported closed")
	}
	c.Write([]byte("unread"))
	c.CloseWrite()
	if PeerClosed(a) {
		t.Fatal("writes shut: reported closed")
	}
	c.Close()
	if !PeerClosed(a) {
		t.Fatal("closed, a message unread: not reported closed")
	}
}
