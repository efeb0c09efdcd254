package l2_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/internal/redistest"
	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

const slotBytes = 64 << 10

var testNS = machine.L2Namespace{FP: [16]byte{1, 2, 3}, Layout: 0xfeed, Width: 32, World: 2}

func digest(i int) []byte {
	d := sha256.Sum256([]byte{byte(i), byte(i >> 8), 'x'})
	return d[:]
}

// fill writes block i's rank r bytes into slot s of pool.
func fill(pool []byte, s, i, r int) {
	p := pool[s*slotBytes : (s+1)*slotBytes]
	for k := 0; k < len(p); k += 8 {
		binary.LittleEndian.PutUint64(p[k:], uint64(i)<<32|uint64(r)<<24|uint64(k))
	}
}

func newTier(t *testing.T, cfg l2.Config, pool []byte) *l2.Tier {
	t.Helper()
	tr, err := l2.New(cfg, pool, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tr.Close)
	return tr
}

func connected(t *testing.T, tr *l2.Tier) {
	t.Helper()
	if !tr.WaitConnected(20 * time.Second) {
		t.Fatal("the tier did not connect")
	}
}

// write writes blocks [0, n) of testNS from pool slots 2i, 2i+1 and waits
// until every write has been carried out.
func write(t *testing.T, tr *l2.Tier, pool []byte, n int) {
	t.Helper()
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		fill(pool, 2*i, i, 0)
		fill(pool, 2*i+1, i, 1)
		wg.Add(1)
		refused := false
		tr.Write(machine.L2Write{ID: uint64(i), NS: testNS, Digest: digest(i), Length: slotBytes,
			PoolOffsets: []uint64{uint64(2*i) * slotBytes, uint64(2*i+1) * slotBytes}}, func(r bool) {
			refused = r
			wg.Done()
		})
		wg.Wait()
		if refused {
			t.Fatalf("write %d refused", i)
		}
	}
	// copied() comes before the SETs: wait for them to land.
	deadline := time.Now().Add(10 * time.Second)
	for tr.Metrics().Snapshot().Writes["ok"] < float64(n) {
		if time.Now().After(deadline) {
			t.Fatalf("writes did not complete: %+v", tr.Metrics().Snapshot())
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func lookup(tr *l2.Tier, n int) int {
	var d []byte
	for i := 0; i < n; i++ {
		d = append(d, digest(i)...)
	}
	ch := make(chan int, 1)
	tr.Lookup(machine.L2Lookup{ID: 1, NS: testNS, Digests: d}, func(f int) { ch <- f })
	return <-ch
}

// fetch fetches blocks [0, n) into slots of dst from slot base on.
func fetch(tr *l2.Tier, dst []byte, n, base int) []machine.L2FetchResult {
	f := machine.L2Fetch{ID: 1, NS: testNS, Length: slotBytes, MaxLength: slotBytes}
	for i := 0; i < n; i++ {
		f.Blocks = append(f.Blocks, machine.L2FetchBlock{Digest: digest(i),
			PoolOffsets: []uint64{uint64(base+2*i) * slotBytes, uint64(base+2*i+1) * slotBytes}})
	}
	ch := make(chan []machine.L2FetchResult, 1)
	tr.Fetch(f, func(r []machine.L2FetchResult) { ch <- r })
	return <-ch
}

func checkFetched(t *testing.T, src, dst []byte, res []machine.L2FetchResult, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		if !res[i].OK || res[i].Length != slotBytes {
			t.Fatalf("block %d: %+v", i, res[i])
		}
		for r := 0; r < 2; r++ {
			s := 2*i + r
			if !bytes.Equal(src[s*slotBytes:(s+1)*slotBytes], dst[s*slotBytes:(s+1)*slotBytes]) {
				t.Fatalf("block %d rank %d: fetched bytes differ", i, r)
			}
		}
	}
}

func TestSingleNodeWriteLookupFetch(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	src := make([]byte, 16*slotBytes)
	tr := newTier(t, l2.Config{Addrs: []string{srv.Addr}, Prefix: "test:", TTL: time.Hour}, src)
	connected(t, tr)
	if tr.Mode() != "single" {
		t.Fatalf("mode %q", tr.Mode())
	}
	write(t, tr, src, 5)
	// The key: the prefix, one hash tag for every rank of a block, the rank.
	c := tr.Client()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "*").Result()
	if err != nil || len(keys) != 10 {
		t.Fatalf("keys %v %v", keys, err)
	}
	k0 := l2.Key("test:", testNS, digest(0), 0)
	if !strings.HasPrefix(k0, "test:{") || !strings.HasSuffix(k0, "}:0") || !strings.Contains(k0, l2.HashTag(testNS, digest(0))) {
		t.Fatalf("key %q", k0)
	}
	// The TTL is set.
	if ttl, err := c.PTTL(ctx, k0).Result(); err != nil || ttl <= 59*time.Minute || ttl > time.Hour {
		t.Fatalf("ttl %v %v", ttl, err)
	}
	v, _ := c.Get(ctx, k0).Bytes()
	if len(v) != l2.HeaderSize+slotBytes {
		t.Fatalf("value of %d bytes", len(v))
	}
	// Lookups count the leading blocks: 5 of 7.
	if got := lookup(tr, 7); got != 5 {
		t.Fatalf("lookup found %d, want 5", got)
	}
	// A block with one rank gone is not there, nor is what follows it.
	c.Del(ctx, l2.Key("test:", testNS, digest(2), 1))
	if got := lookup(tr, 5); got != 2 {
		t.Fatalf("lookup after a rank's loss found %d, want 2", got)
	}
	// Another node (another pool) fetches them.
	dst := make([]byte, 16*slotBytes)
	other := newTier(t, l2.Config{Addrs: []string{srv.Addr}, Prefix: "test:"}, dst)
	connected(t, other)
	res := fetch(other, dst, 5, 0)
	checkFetched(t, src, dst, res, 2)
	if res[2].OK || !res[3].OK || !res[4].OK {
		t.Fatalf("results %+v", res)
	}
	snap, osnap := tr.Metrics().Snapshot(), other.Metrics().Snapshot()
	if osnap.FetchBlocks["ok"] != 4 || osnap.FetchBlocks["miss"] != 1 || snap.Writes["ok"] != 5 || snap.Bytes["written"] != 10*(l2.HeaderSize+slotBytes) ||
		osnap.Bytes["read"] != 9*(l2.HeaderSize+slotBytes) {
		t.Fatalf("metrics %+v, %+v", snap, osnap)
	}
}

func TestPrefixAndTenantsNeverShareKeys(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	pool := make([]byte, 16*slotBytes)
	a := newTier(t, l2.Config{Addrs: []string{srv.Addr}, Prefix: "a:"}, pool)
	b := newTier(t, l2.Config{Addrs: []string{srv.Addr}, Prefix: "b:"}, pool)
	connected(t, a)
	connected(t, b)
	write(t, a, pool, 3)
	if got := lookup(b, 3); got != 0 {
		t.Fatalf("another prefix found %d blocks", got)
	}
	// Another tenant (another fingerprint) of the same prefix: none.
	other := testNS
	other.FP[0] ^= 0xff
	var d []byte
	for i := 0; i < 3; i++ {
		d = append(d, digest(i)...)
	}
	ch := make(chan int, 1)
	a.Lookup(machine.L2Lookup{NS: other, Digests: d}, func(f int) { ch <- f })
	if got := <-ch; got != 0 {
		t.Fatalf("another namespace found %d", got)
	}
	if n, _ := a.Client().Keys(context.Background(), "b:*").Result(); len(n) != 0 {
		t.Fatalf("b wrote %v", n)
	}
	// No TTL without one.
	if ttl, _ := a.Client().PTTL(context.Background(), l2.Key("a:", testNS, digest(0), 0)).Result(); ttl != -1 {
		t.Fatalf("ttl %v without one configured", ttl)
	}
}

func TestACLAndTLS(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{User: "ringside", Password: "pa55word", TLS: true})
	pem, err := os.ReadFile(srv.TLS.CA)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	tc := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	pool := make([]byte, 16*slotBytes)
	good := newTier(t, l2.Config{Addrs: []string{srv.Addr}, Username: "ringside", Password: "pa55word", TLS: tc}, pool)
	connected(t, good)
	write(t, good, pool, 2)
	if lookup(good, 2) != 2 {
		t.Fatal("lookup over TLS as the ACL user")
	}
	// A wrong password, no TLS, or a CA that is not the server's: never
	// connected, lookups miss at once, writes are refused.
	for name, cfg := range map[string]l2.Config{
		"wrong password": {Addrs: []string{srv.Addr}, Username: "ringside", Password: "nope", TLS: tc},
		"no password":    {Addrs: []string{srv.Addr}, TLS: tc},
		"no TLS":         {Addrs: []string{srv.Addr}, Username: "ringside", Password: "pa55word", IOTimeout: 300 * time.Millisecond},
		"another CA":     {Addrs: []string{srv.Addr}, Username: "ringside", Password: "pa55word", TLS: &tls.Config{RootCAs: x509.NewCertPool()}},
	} {
		t.Run(name, func(t *testing.T) {
			bad := newTier(t, cfg, pool)
			time.Sleep(500 * time.Millisecond)
			if bad.Connected() {
				t.Fatal("connected")
			}
			if got := lookup(bad, 2); got != 0 {
				t.Fatalf("lookup found %d", got)
			}
			refused := make(chan bool, 1)
			bad.Write(machine.L2Write{NS: testNS, Digest: digest(9), Length: slotBytes, PoolOffsets: []uint64{0, slotBytes}}, func(r bool) { refused <- r })
			if !<-refused {
				t.Fatal("a write to a tier not connected was taken")
			}
		})
	}
}

func TestCorruptValuesAreRejected(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	src := make([]byte, 16*slotBytes)
	tr := newTier(t, l2.Config{Addrs: []string{srv.Addr}}, src)
	connected(t, tr)
	write(t, tr, src, 4)
	c, ctx := tr.Client(), context.Background()
	// Block 0: a payload byte changed in place. Block 1: its rank 1 value
	// under rank 0's key (a value of another key). Block 2: truncated.
	if err := c.SetRange(ctx, l2.Key(l2.DefaultPrefix, testNS, digest(0), 1), int64(l2.HeaderSize+1000), "X").Err(); err != nil {
		t.Fatal(err)
	}
	v, _ := c.Get(ctx, l2.Key(l2.DefaultPrefix, testNS, digest(1), 1)).Bytes()
	c.Set(ctx, l2.Key(l2.DefaultPrefix, testNS, digest(1), 0), v, 0)
	v, _ = c.Get(ctx, l2.Key(l2.DefaultPrefix, testNS, digest(2), 0)).Bytes()
	c.Set(ctx, l2.Key(l2.DefaultPrefix, testNS, digest(2), 0), v[:len(v)-7], 0)
	dst := make([]byte, 16*slotBytes)
	for i := range dst {
		dst[i] = 0xCC
	}
	other := newTier(t, l2.Config{Addrs: []string{srv.Addr}}, dst)
	connected(t, other)
	res := fetch(other, dst, 4, 0)
	if res[0].OK || res[1].OK || res[2].OK || !res[3].OK {
		t.Fatalf("results %+v", res)
	}
	checkFetched(t, src[6*slotBytes:], dst[6*slotBytes:], res[3:], 1)
	snap := other.Metrics().Snapshot()
	if snap.Rejected[l2.RejectChecksum] != 1 || snap.Rejected[l2.RejectIdentity] != 1 || snap.Rejected[l2.RejectShort] != 1 {
		t.Fatalf("rejections %+v", snap.Rejected)
	}
}

func TestPausedAndUnreachable(t *testing.T) {
	srv := redistest.Single(t, redistest.Options{})
	pool := make([]byte, 16*slotBytes)
	tr := newTier(t, l2.Config{Addrs: []string{srv.Addr}, LookupTimeout: 50 * time.Millisecond, IOTimeout: 200 * time.Millisecond, Writers: 1, Queue: 2}, pool)
	connected(t, tr)
	write(t, tr, pool, 2)
	if _, err := srv.CLI("CLIENT", "PAUSE", "3000", "ALL"); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if got := lookup(tr, 2); got != 0 {
		t.Fatalf("a paused tier answered %d", got)
	}
	// The lookup's deadline bounds it, whatever the server does.
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("a lookup of a paused tier took %v", d)
	}
	// The write queue is bounded: one writer blocked, two queued, the rest
	// refused at once.
	refused := 0
	var mu sync.Mutex
	for i := 0; i < 10; i++ {
		tr.Write(machine.L2Write{NS: testNS, Digest: digest(20 + i), Length: slotBytes, PoolOffsets: []uint64{0, slotBytes}}, func(r bool) {
			mu.Lock()
			if r {
				refused++
			}
			mu.Unlock()
		})
	}
	mu.Lock()
	r := refused
	mu.Unlock()
	if r < 7 {
		t.Fatalf("%d of 10 writes refused by a queue of 2 and one writer", r)
	}
	srv.CLI("CLIENT", "UNPAUSE")
	// Unreachable: the server is gone.
	srv.Kill()
	t0 = time.Now()
	if got := lookup(tr, 2); got != 0 {
		t.Fatalf("a dead tier answered %d", got)
	}
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("a lookup of a dead tier took %v", d)
	}
	if res := fetch(tr, pool, 2, 8); res[0].OK || res[1].OK {
		t.Fatalf("a dead tier fetched %+v", res)
	}
	// It comes back: hits resume (the values are gone with the process:
	// write again).
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		write(t, tr, pool, 2)
		if lookup(tr, 2) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("hits did not resume after the server came back")
		}
	}
}

func TestClusterHashTagAndFailover(t *testing.T) {
	cl := redistest.NewCluster(t, 3, 1, redistest.Options{})
	src := make([]byte, 64*slotBytes)
	tr := newTier(t, l2.Config{Addrs: cl.Addrs()[:1], IOTimeout: 500 * time.Millisecond}, src)
	connected(t, tr)
	if tr.Mode() != "cluster" {
		t.Fatalf("mode %q", tr.Mode())
	}
	const n = 24
	write(t, tr, src, n)
	// Every rank of a block lives on one master; the blocks spread over
	// all three.
	masters := map[string]int{}
	for i := 0; i < n; i++ {
		m0, err := cl.MasterOf(l2.Key(l2.DefaultPrefix, testNS, digest(i), 0))
		if err != nil {
			t.Fatal(err)
		}
		m1, _ := cl.MasterOf(l2.Key(l2.DefaultPrefix, testNS, digest(i), 1))
		if m0 != m1 {
			t.Fatalf("block %d: ranks on %s and %s", i, m0.Addr, m1.Addr)
		}
		masters[m0.Addr]++
	}
	if len(masters) != 3 {
		t.Fatalf("blocks on %d masters: %v", len(masters), masters)
	}
	if got := lookup(tr, n); got != n {
		t.Fatalf("lookup found %d", got)
	}
	dst := make([]byte, 64*slotBytes)
	other := newTier(t, l2.Config{Addrs: cl.Addrs()[3:4], IOTimeout: 500 * time.Millisecond}, dst)
	connected(t, other)
	checkFetched(t, src, dst, fetch(other, dst, n, 0), n)

	// A master killed: its blocks miss (never a wrong byte), then its
	// replica takes over (with the values it had replicated) and hits
	// resume.
	victim, _ := cl.MasterOf(l2.Key(l2.DefaultPrefix, testNS, digest(0), 0))
	victim.Kill()
	for i := range dst {
		dst[i] = 0
	}
	res := fetch(other, dst, n, 0)
	for i, r := range res {
		if r.OK {
			checkFetched(t, src[2*i*slotBytes:], dst[2*i*slotBytes:], res[i:i+1], 1)
		}
	}
	if res[0].OK {
		t.Fatal("a block of the killed master was fetched before any failover")
	}
	if err := cl.WaitHealthy(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for lookup(tr, n) != n {
		if time.Now().After(deadline) {
			err := tr.Client().Get(context.Background(), l2.Key(l2.DefaultPrefix, testNS, digest(0), 0)).Err()
			t.Fatalf("hits did not resume after the failover (found %d; get: %v)", lookup(tr, n), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The other node learns the new master from its own failed round trip.
	for res = fetch(other, dst, n, 0); !res[0].OK; res = fetch(other, dst, n, 0) {
		if time.Now().After(deadline) {
			t.Fatalf("fetches did not resume after the failover: %+v", res[0])
		}
		time.Sleep(100 * time.Millisecond)
	}
	checkFetched(t, src, dst, res, n)
}

func TestConfigValidate(t *testing.T) {
	for name, c := range map[string]l2.Config{
		"no addrs":     {},
		"bad addr":     {Addrs: []string{"nohost"}},
		"mode":         {Addrs: []string{"a:1"}, Mode: "sentinel"},
		"single, two":  {Addrs: []string{"a:1", "b:2"}, Mode: "single"},
		"ttl":          {Addrs: []string{"a:1"}, TTL: time.Microsecond},
		"brace prefix": {Addrs: []string{"a:1"}, Prefix: "x{y}"},
	} {
		c.EnsureDefaults()
		if err := c.Validate(); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// TestLeastPrivilegeACLUser runs the tier as the ACL user deploy/README.md
// tells operators to create: its keys only, and the commands the client
// sends; in a cluster, so that CLUSTER SLOTS is needed too.
func TestLeastPrivilegeACLUser(t *testing.T) {
	cl := redistest.NewCluster(t, 3, 0, redistest.Options{Args: []string{
		"--user", "ringside", "on", ">narrow", "~ringside:*", "+@read", "+@write", "+@connection", "+info", "+cluster|slots"}})
	src := make([]byte, 16*slotBytes)
	tr := newTier(t, l2.Config{Addrs: cl.Addrs(), Username: "ringside", Password: "narrow"}, src)
	connected(t, tr)
	write(t, tr, src, 3)
	if got := lookup(tr, 3); got != 3 {
		t.Fatalf("lookup as the narrow user found %d", got)
	}
	dst := make([]byte, 16*slotBytes)
	other := newTier(t, l2.Config{Addrs: cl.Addrs(), Username: "ringside", Password: "narrow"}, dst)
	connected(t, other)
	checkFetched(t, src, dst, fetch(other, dst, 3, 0), 3)
	if s := tr.Metrics().Snapshot(); s.Errors["write"]+s.Errors["lookup"]+s.Errors["fetch"] != 0 {
		t.Fatalf("errors %+v", s.Errors)
	}
	// Keys outside its prefix are refused to it.
	wrong := newTier(t, l2.Config{Addrs: cl.Addrs(), Username: "ringside", Password: "narrow", Prefix: "other:"}, src)
	connected(t, wrong)
	refused := make(chan bool, 1)
	wrong.Write(machine.L2Write{NS: testNS, Digest: digest(1), Length: slotBytes, PoolOffsets: []uint64{0, slotBytes}}, func(r bool) { refused <- r })
	<-refused
	deadline := time.Now().Add(10 * time.Second)
	for wrong.Metrics().Snapshot().Writes["error"] == 0 {
		if time.Now().After(deadline) {
			t.Fatal("a write outside the user's keys did not fail")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestAHugeValueIsReadOnlyUpToTheBound(t *testing.T) {
	// Whoever can write the tier plants a 64 MiB value under a block's key
	// (its header valid, its payload far too long): the fetch rejects it,
	// and the server sends no more than a slot and a header for it (read
	// whole, a few such values would take the sidecar's memory).
	srv := redistest.Single(t, redistest.Options{})
	src := make([]byte, 4*slotBytes)
	tr := newTier(t, l2.Config{Addrs: []string{srv.Addr}}, src)
	connected(t, tr)
	write(t, tr, src, 1)
	c, ctx := tr.Client(), context.Background()
	key := l2.Key(l2.DefaultPrefix, testNS, digest(0), 0)
	if err := c.SetRange(ctx, key, 64<<20, "X").Err(); err != nil {
		t.Fatal(err)
	}
	sent := func() int64 {
		info, err := c.Info(ctx, "stats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(line, "total_net_output_bytes:"); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				return n
			}
		}
		t.Fatal("no total_net_output_bytes in INFO stats")
		return 0
	}
	dst := make([]byte, 4*slotBytes)
	other := newTier(t, l2.Config{Addrs: []string{srv.Addr}}, dst)
	connected(t, other)
	before := sent()
	res := fetch(other, dst, 1, 0)
	out := sent() - before
	if res[0].OK {
		t.Fatalf("the huge value was accepted: %+v", res)
	}
	if snap := other.Metrics().Snapshot(); snap.Rejected[l2.RejectTrailing] != 1 {
		t.Fatalf("rejections %+v", snap.Rejected)
	}
	if limit := int64(4*slotBytes + 64<<10); out > limit {
		t.Fatalf("the server sent %d bytes for one block's fetch (bound %d)", out, limit)
	}
}
