// Package testport picks loopback TCP ports for servers that tests start in
// other processes (a sidecar's metrics, redis-server), which bind them
// later.
package testport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// Free finds a free loopback port below the kernel's ephemeral range
// (ip_local_port_range), so that no outgoing connection's local port can
// take it between the pick and the server's bind, as a port bind(0) picks
// can. Ports are drawn at random, so that tests of several packages running
// at once rarely try the same.
func Free() (int, error) {
	lo := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				lo = v
			}
		}
	}
	const from = 12000
	for i := 0; i < 200 && lo > from+1000; i++ {
		p := from + rand.IntN(lo-from)
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p)); err == nil {
			l.Close()
			return p, nil
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Addr is Free as "127.0.0.1:port"; it panics when no port can be had.
func Addr() string {
	p, err := Free()
	if err != nil {
		panic(fmt.Sprintf("testport: no free loopback port: %v", err))
	}
	return "127.0.0.1:" + strconv.Itoa(p)
}
