package redistest

import (
	"strings"
	"testing"
)

func TestSingleACLAndTLS(t *testing.T) {
	s := Single(t, Options{User: "ringside", Password: "s3cret", TLS: true})
	if out, err := s.CLI("SET", "k", "v"); err != nil || !strings.Contains(out, "OK") {
		t.Fatalf("SET as the ACL user over TLS: %q %v", out, err)
	}
	// The default user is off.
	s.opts.User, s.opts.Password = "", ""
	if _, err := s.CLI("GET", "k"); err == nil {
		t.Fatal("the default user may still read")
	}
}

func TestClusterFailover(t *testing.T) {
	c := NewCluster(t, 3, 1, Options{})
	if len(c.Masters()) != 3 {
		t.Fatalf("%d masters", len(c.Masters()))
	}
	m, err := c.MasterOf("{tag}x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.CLI("SET", "{tag}x", "1"); err != nil {
		t.Fatal(err)
	}
	// Replication is asynchronous: the write must reach the replica before
	// its master dies, or the promoted replica rightly lacks it.
	if out, err := m.CLI("WAIT", "1", "10000"); err != nil || strings.TrimSpace(out) != "1" {
		t.Fatalf("WAIT for the replica: %q %v", out, err)
	}
	m.Kill()
	if err := c.WaitHealthy(30e9); err != nil {
		t.Fatal(err)
	}
	n, err := c.MasterOf("{tag}x")
	if err != nil || n == m {
		t.Fatalf("no replica took over: %v", err)
	}
	if out, err := n.CLI("GET", "{tag}x"); err != nil || strings.TrimSpace(out) != "1" {
		t.Fatalf("after failover: %q %v", out, err)
	}
}
