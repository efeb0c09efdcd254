// Package redistest starts real redis-server processes for tests and
// benchmarks: a single node, or a cluster of masters with replicas on
// loopback ports (redis-server --cluster-enabled yes, then redis-cli
// --cluster create), optionally with an ACL user and TLS from a throwaway
// CA it generates. Nothing here stands in for the server.
//
// The binaries come from Debian's redis-server and redis-tools packages
// (.ci/run installs them). Tests call Require, which skips a test where
// they are missing, except under CI=true, where a missing server fails it.
package redistest

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/internal/testport"
)

// Binaries are the server and the command-line client.
var (
	ServerBin = "redis-server"
	CLIBin    = "redis-cli"
)

// Available reports whether redis-server and redis-cli are on PATH.
func Available() error {
	for _, b := range []string{ServerBin, CLIBin} {
		if _, err := exec.LookPath(b); err != nil {
			return fmt.Errorf("%s not found (apt-get install -y redis-server redis-tools): %w", b, err)
		}
	}
	return nil
}

// Require skips t when the binaries are missing, or fails it under CI.
func Require(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI: %v", err)
		}
		t.Skip(err)
	}
}

// Options configures a server (every node of a cluster alike).
type Options struct {
	// User and Password add an ACL user with every permission and turn the
	// default user off; Password alone sets the default user's password
	// (requirepass).
	User, Password string
	// TLS serves TLS only, with a certificate for 127.0.0.1 signed by a CA
	// generated for the server (Server.TLS names the files).
	TLS bool
	// Args are more redis-server arguments ("--maxmemory", "64mb", ...).
	Args []string
	// NodeTimeout is a cluster's cluster-node-timeout (default 1 s: a
	// killed master's replica takes over within a few seconds).
	NodeTimeout time.Duration
}

// TLSFiles are the PEM files of a TLS server.
type TLSFiles struct {
	CA, Cert, Key string
}

// Server is one redis-server process.
type Server struct {
	Port int
	Addr string // 127.0.0.1:PORT
	Dir  string
	TLS  TLSFiles
	opts Options
	args []string
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
}

// Start starts one server in a directory of its own under base (a
// temporary directory when empty) and waits until it answers PING.
func Start(base string, o Options) (*Server, error) {
	return start(base, o, false, nil)
}

func start(base string, o Options, cluster bool, tlsFiles *TLSFiles) (*Server, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(base, "redis-")
	if err != nil {
		return nil, err
	}
	s := &Server{Dir: dir, opts: o}
	if o.TLS {
		if tlsFiles == nil {
			f, err := WriteTLS(dir)
			if err != nil {
				os.RemoveAll(dir)
				return nil, err
			}
			tlsFiles = &f
		}
		s.TLS = *tlsFiles
	}
	port, err := testport.Free()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	bus := 0
	if cluster {
		if bus, err = testport.Free(); err != nil || bus == port {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("redistest: no bus port: %v", err)
		}
	}
	s.Port, s.Addr = port, fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"--bind", "127.0.0.1", "--dir", dir, "--save", "", "--appendonly", "no", "--daemonize", "no",
		"--logfile", filepath.Join(dir, "redis.log"), "--protected-mode", "no"}
	if o.TLS {
		args = append(args, "--port", "0", "--tls-port", strconv.Itoa(port), "--tls-cert-file", s.TLS.Cert,
			"--tls-key-file", s.TLS.Key, "--tls-ca-cert-file", s.TLS.CA, "--tls-auth-clients", "optional")
		if cluster {
			args = append(args, "--tls-cluster", "yes", "--tls-replication", "yes")
		}
	} else {
		args = append(args, "--port", strconv.Itoa(port))
	}
	switch {
	case o.User != "":
		args = append(args, "--user", o.User, "on", ">"+o.Password, "~*", "&*", "+@all", "--user", "default", "off")
		if cluster {
			args = append(args, "--masteruser", o.User, "--masterauth", o.Password)
		}
	case o.Password != "":
		args = append(args, "--requirepass", o.Password)
		if cluster {
			args = append(args, "--masterauth", o.Password)
		}
	}
	if cluster {
		nt := o.NodeTimeout
		if nt == 0 {
			nt = time.Second
		}
		args = append(args, "--cluster-enabled", "yes", "--cluster-port", strconv.Itoa(bus), "--cluster-config-file", filepath.Join(dir, "nodes.conf"),
			"--cluster-node-timeout", strconv.FormatInt(nt.Milliseconds(), 10))
	}
	s.args = append(args, o.Args...)
	if err := s.launch(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

func (s *Server) launch() error {
	cmd := exec.Command(ServerBin, s.args...)
	cmd.Stdout, cmd.Stderr = nil, nil
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if out, err := s.CLI("PING"); err == nil && strings.TrimSpace(out) == "PONG" {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("redis-server on port %d exited at start: %s", s.Port, s.Log())
		default:
		}
		if time.Now().After(deadline) {
			s.Kill()
			return fmt.Errorf("redis-server on port %d did not answer PING: %s", s.Port, s.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Log returns the end of the server's log.
func (s *Server) Log() string {
	b, _ := os.ReadFile(filepath.Join(s.Dir, "redis.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// CLIArgs are the redis-cli arguments that reach this server.
func (s *Server) CLIArgs() []string {
	a := []string{"-h", "127.0.0.1", "-p", strconv.Itoa(s.Port)}
	if s.opts.TLS {
		a = append(a, "--tls", "--cacert", s.TLS.CA)
	}
	if s.opts.User != "" {
		a = append(a, "--user", s.opts.User, "--pass", s.opts.Password)
	} else if s.opts.Password != "" {
		a = append(a, "-a", s.opts.Password)
	}
	return append(a, "--no-auth-warning")
}

// CLI runs one redis-cli command against the server.
func (s *Server) CLI(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, CLIBin, append(s.CLIArgs(), args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("redis-cli %v: %w: %s", args, err, out)
	}
	if strings.HasPrefix(string(out), "ERR") || strings.HasPrefix(string(out), "NOAUTH") || strings.HasPrefix(string(out), "WRONGPASS") {
		return string(out), fmt.Errorf("redis-cli %v: %s", args, out)
	}
	return string(out), nil
}

// Kill sends SIGKILL and waits for the process to be gone.
func (s *Server) Kill() {
	s.signal(syscall.SIGKILL)
}

// Stop sends SIGTERM and waits (SIGKILL after 10 s).
func (s *Server) Stop() {
	s.signal(syscall.SIGTERM)
}

func (s *Server) signal(sig syscall.Signal) {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

// Alive reports whether the process runs.
func (s *Server) Alive() bool {
	s.mu.Lock()
	done := s.done
	s.mu.Unlock()
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Restart starts a stopped or killed server again, on the same port and
// directory (a cluster node rejoins from its nodes.conf).
func (s *Server) Restart() error {
	if s.Alive() {
		return errors.New("redistest: restart of a running server")
	}
	return s.launch()
}

// Close stops the server and removes its directory.
func (s *Server) Close() {
	s.Stop()
	os.RemoveAll(s.Dir)
}

// Single starts a server for t, stopped when t ends.
func Single(t testing.TB, o Options) *Server {
	t.Helper()
	Require(t)
	s, err := Start(t.TempDir(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// Cluster is a Redis Cluster of masters with replicas.
type Cluster struct {
	Nodes []*Server
	base  string
}

// StartCluster starts masters*(1+replicas) nodes and joins them with
// redis-cli --cluster create, then waits until every node says the
// cluster is ok and every replica is in sync.
func StartCluster(base string, masters, replicas int, o Options) (*Cluster, error) {
	c, err := startCluster(base, masters, replicas, o)
	if err != nil { // a port taken meanwhile, or a join that stalled: once more
		c, err = startCluster(base, masters, replicas, o)
	}
	return c, err
}

func startCluster(base string, masters, replicas int, o Options) (*Cluster, error) {
	c := &Cluster{base: base}
	var tlsFiles *TLSFiles
	if o.TLS {
		d, err := os.MkdirTemp(base, "redis-tls-")
		if err != nil {
			return nil, err
		}
		f, err := WriteTLS(d)
		if err != nil {
			return nil, err
		}
		tlsFiles = &f
	}
	for i := 0; i < masters*(1+replicas); i++ {
		s, err := start(base, o, true, tlsFiles)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.Nodes = append(c.Nodes, s)
	}
	args := []string{"--cluster", "create"}
	for _, s := range c.Nodes {
		args = append(args, s.Addr)
	}
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli := append(c.Nodes[0].CLIArgs()[4:], args...) // no -h/-p: the addresses are in the command
	if out, err := exec.CommandContext(ctx, CLIBin, cli...).CombinedOutput(); err != nil {
		c.Close()
		return nil, fmt.Errorf("redis-cli --cluster create: %w: %s", err, out)
	}
	if err := c.WaitHealthy(time.Minute); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// NewCluster starts a cluster for t, stopped when t ends.
func NewCluster(t testing.TB, masters, replicas int, o Options) *Cluster {
	t.Helper()
	Require(t)
	c, err := StartCluster(t.TempDir(), masters, replicas, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// Addrs are the nodes' addresses (the seed list for a client).
func (c *Cluster) Addrs() []string {
	var a []string
	for _, s := range c.Nodes {
		a = append(a, s.Addr)
	}
	return a
}

// Close stops every node and removes their directories.
func (c *Cluster) Close() {
	var wg sync.WaitGroup
	for _, s := range c.Nodes {
		wg.Add(1)
		go func() { defer wg.Done(); s.Close() }()
	}
	wg.Wait()
}

// WaitHealthy waits until every live node reports cluster_state:ok, every
// slot is served, and each master's replicas are online and caught up.
func (c *Cluster) WaitHealthy(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		ok := true
		for _, s := range c.Nodes {
			if !s.Alive() {
				continue
			}
			out, err := s.CLI("CLUSTER", "INFO")
			if err != nil || !strings.Contains(out, "cluster_state:ok") || !strings.Contains(out, "cluster_slots_ok:16384") {
				ok, last = false, fmt.Sprintf("node %s: %s %v", s.Addr, out, err)
				break
			}
			info, err := s.CLI("INFO", "replication")
			if err != nil {
				ok, last = false, err.Error()
				break
			}
			if strings.Contains(info, "role:slave") && !strings.Contains(info, "master_link_status:up") {
				ok, last = false, fmt.Sprintf("replica %s: %s", s.Addr, info)
				break
			}
		}
		if ok {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("redistest: cluster not healthy after %v: %s", timeout, last)
}

// Node returns the live node serving addr.
func (c *Cluster) Node(addr string) *Server {
	for _, s := range c.Nodes {
		if s.Addr == addr {
			return s
		}
	}
	return nil
}

// MasterOf returns the master that serves key's hash slot, as the live
// nodes see it.
func (c *Cluster) MasterOf(key string) (*Server, error) {
	var any *Server
	for _, s := range c.Nodes {
		if s.Alive() {
			any = s
			break
		}
	}
	if any == nil {
		return nil, errors.New("redistest: no live node")
	}
	out, err := any.CLI("CLUSTER", "KEYSLOT", key)
	if err != nil {
		return nil, err
	}
	slot, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		return nil, fmt.Errorf("redistest: keyslot %q: %v", out, err)
	}
	nodes, err := any.CLI("CLUSTER", "NODES")
	if err != nil {
		return nil, err
	}
	sc := bufio.NewScanner(strings.NewReader(nodes))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 9 || !strings.Contains(f[2], "master") || strings.Contains(f[2], "fail") {
			continue
		}
		addr := strings.SplitN(f[1], "@", 2)[0]
		for _, r := range f[8:] {
			lo, hi, found := strings.Cut(r, "-")
			if !found {
				hi = lo
			}
			a, e1 := strconv.Atoi(lo)
			b, e2 := strconv.Atoi(hi)
			if e1 == nil && e2 == nil && slot >= a && slot <= b {
				if s := c.Node(addr); s != nil {
					return s, nil
				}
			}
		}
	}
	return nil, fmt.Errorf("redistest: no master serves slot %d", slot)
}

// Masters returns the live masters.
func (c *Cluster) Masters() []*Server {
	var out []*Server
	for _, s := range c.Nodes {
		if !s.Alive() {
			continue
		}
		if info, err := s.CLI("INFO", "replication"); err == nil && strings.Contains(info, "role:master") {
			out = append(out, s)
		}
	}
	return out
}

// WriteTLS writes a throwaway CA and a server certificate for 127.0.0.1
// and localhost signed by it into dir (ca.pem, server.pem, server.key).
func WriteTLS(dir string) (TLSFiles, error) {
	f := TLSFiles{CA: filepath.Join(dir, "ca.pem"), Cert: filepath.Join(dir, "server.pem"), Key: filepath.Join(dir, "server.key")}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return f, err
	}
	now := time.Now()
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ringside test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return f, err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return f, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return f, err
	}
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), DNSNames: []string{"localhost"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		return f, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return f, err
	}
	for path, b := range map[string]*pem.Block{
		f.CA: {Type: "CERTIFICATE", Bytes: caDER}, f.Cert: {Type: "CERTIFICATE", Bytes: der}, f.Key: {Type: "EC PRIVATE KEY", Bytes: kb},
	} {
		if err := os.WriteFile(path, pem.EncodeToMemory(b), 0o600); err != nil {
			return f, err
		}
	}
	return f, nil
}
