package testport

import (
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// Ports are outside the ephemeral range and bindable.
func TestFree(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skip(err)
	}
	f := strings.Fields(string(b))
	lo, _ := strconv.Atoi(f[0])
	hi, _ := strconv.Atoi(f[1])
	for i := 0; i < 32; i++ {
		p, err := Free()
		if err != nil {
			t.Fatal(err)
		}
		if p >= lo && p <= hi {
			t.Fatalf("port %d in the ephemeral range %d-%d", p, lo, hi)
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
	}
}
