// Package l2 is the sidecar's client of a shared tier on Redis (a single
// node or a Redis Cluster, detected): the I/O of what sidecar/machine
// decides. It looks blocks up (one pipelined round trip for a whole
// continuation), fetches them into pool slots, and writes blocks out of
// pool slots through a bounded queue, with github.com/redis/go-redis/v9.
//
// Every operation has a deadline and never blocks its caller: Lookup and
// Fetch run on goroutines of their own (a bounded number; past it they
// answer a miss at once), Write only enqueues (a full queue refuses at
// once). A tier that is down costs a lookup nothing but its answer.
//
// The tier is trusted infrastructure, like the pool: it is protected by
// Redis ACL users and TLS. Values carry a header and a checksum (value.go)
// so that one that is not the block asked for is rejected and counted,
// never served, but nothing in a value is secret from whoever may read
// the tier.
package l2

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"github.com/rs/zerolog"

	"github.com/ringside-kv/ringside/sidecar/machine"
)

// Config configures a Tier.
type Config struct {
	// Addrs are the server's address, or a cluster's seed nodes.
	Addrs []string
	// Mode is "auto" (default: ask the first node that answers whether it
	// is in cluster mode), "single" or "cluster".
	Mode string
	// Username and the password authenticate (an ACL user, or the default
	// user's password when Username is empty). The password is Password,
	// or read from PasswordFile (at start, and again for every new
	// connection: a rotated file takes effect), or from the environment
	// variable PasswordEnv (at start); at most one of them.
	Username, Password        string
	PasswordFile, PasswordEnv string
	// TLS, when not nil, is used for every connection. TLSFiles make one
	// (read by New and Dial, so that a file that is not there yet when the
	// flags are parsed, a Secret's, is no error until the sidecar starts).
	TLS      *tls.Config
	TLSFiles *TLSFiles
	// Prefix starts every key (default "ringside:").
	Prefix string
	// TTL is every value's time to live (0: none; the server's eviction
	// policy then bounds the tier).
	TTL time.Duration
	// LookupTimeout bounds a lookup; IOTimeout a fetch and a write.
	LookupTimeout, IOTimeout time.Duration
	// Writers is the number of goroutines that write; Queue the writes that
	// may wait for one. A write past that is refused.
	Writers, Queue int
	// Inflight bounds lookups and fetches running at once (a batch of a
	// fetch is at most FetchBatchBytes); past it they miss at once.
	Inflight        int
	FetchBatchBytes int
	// PoolSize is the connections per node.
	PoolSize int
}

// Defaults.
const (
	DefaultMode            = "auto"
	DefaultPrefix          = "ringside:"
	DefaultLookupTimeout   = 100 * time.Millisecond
	DefaultIOTimeout       = 2 * time.Second
	DefaultWriters         = 8
	DefaultQueue           = 1024
	DefaultInflight        = 64
	DefaultFetchBatchBytes = 16 << 20
	DefaultPoolSize        = 32
)

// EnsureDefaults fills zero fields.
func (c *Config) EnsureDefaults() {
	if c.Mode == "" {
		c.Mode = DefaultMode
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.LookupTimeout == 0 {
		c.LookupTimeout = DefaultLookupTimeout
	}
	if c.IOTimeout == 0 {
		c.IOTimeout = DefaultIOTimeout
	}
	if c.Writers == 0 {
		c.Writers = DefaultWriters
	}
	if c.Queue == 0 {
		c.Queue = DefaultQueue
	}
	if c.Inflight == 0 {
		c.Inflight = DefaultInflight
	}
	if c.FetchBatchBytes == 0 {
		c.FetchBatchBytes = DefaultFetchBatchBytes
	}
	if c.PoolSize == 0 {
		c.PoolSize = DefaultPoolSize
	}
}

// Validate reports every bad field, each naming its flag.
func (c *Config) Validate() error {
	var errs []error
	bad := func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--l2.redis.%s: %s", flag, fmt.Sprintf(format, args...)))
	}
	if len(c.Addrs) == 0 {
		bad("addrs", "at least one address is needed")
	}
	for _, a := range c.Addrs {
		if i := strings.LastIndexByte(a, ':'); i <= 0 || i == len(a)-1 {
			bad("addrs", "%q is not host:port", a)
		}
	}
	switch c.Mode {
	case "auto", "single", "cluster":
	default:
		bad("mode", "%q: want auto, single or cluster", c.Mode)
	}
	if c.Mode == "single" && len(c.Addrs) > 1 {
		bad("addrs", "a single node takes one address, not %d", len(c.Addrs))
	}
	if c.TTL < 0 || (c.TTL > 0 && c.TTL < time.Millisecond) {
		bad("ttl", "%v must be 0 (none) or at least 1ms", c.TTL)
	}
	if c.LookupTimeout <= 0 || c.IOTimeout <= 0 {
		bad("timeout", "timeouts must be positive")
	}
	if c.Writers < 1 || c.Writers > 256 || c.Queue < 1 || c.Inflight < 1 || c.PoolSize < 1 || c.FetchBatchBytes < 1<<16 {
		bad("writers", "writers 1..256, and the queue, in-flight bound, pool size and fetch batch must be positive")
	}
	n := 0
	for _, v := range []string{c.Password, c.PasswordFile, c.PasswordEnv} {
		if v != "" {
			n++
		}
	}
	if n > 1 {
		bad("password-file", "give one of a password file and a password environment variable")
	}
	if c.TLS != nil && c.TLSFiles != nil {
		bad("tls", "a TLS configuration and TLS files: give one")
	}
	if len(c.Prefix) > 256 || strings.ContainsAny(c.Prefix, "{}") {
		bad("prefix", "%q: at most 256 bytes, without braces (they would change the hash tag)", c.Prefix)
	}
	return errors.Join(errs...)
}

// TLSFiles are the PEM files of a TLS connection.
type TLSFiles struct {
	CA         string // the CA that signed the servers' certificates (empty: the system's roots)
	Cert, Key  string // a client certificate, for servers that authenticate clients
	ServerName string // the name to verify (empty: each address's host)
}

// resolve reads the password and the TLS files.
func (c *Config) resolve() error {
	if err := c.resolvePassword(); err != nil {
		return err
	}
	f := c.TLSFiles
	if f == nil {
		return nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName}
	if f.CA != "" {
		pem, err := os.ReadFile(f.CA)
		if err != nil {
			return fmt.Errorf("--l2.redis.tls-ca-file: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--l2.redis.tls-ca-file: %s holds no PEM certificate", f.CA)
		}
		tc.RootCAs = roots
	}
	if (f.Cert == "") != (f.Key == "") {
		return errors.New("--l2.redis.tls-cert-file and --l2.redis.tls-key-file go together")
	}
	if f.Cert != "" {
		pair, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			return fmt.Errorf("--l2.redis.tls-cert-file: %w", err)
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	c.TLS = tc
	return nil
}

// resolvePassword reads the password from its file or variable.
func (c *Config) resolvePassword() error {
	switch {
	case c.PasswordFile != "":
		p, err := readPassword(c.PasswordFile)
		if err != nil {
			return fmt.Errorf("--l2.redis.password-file: %w", err)
		}
		c.Password = p
	case c.PasswordEnv != "":
		v, ok := os.LookupEnv(c.PasswordEnv)
		if !ok || v == "" {
			return fmt.Errorf("--l2.redis.password-env: the environment variable %s is not set or empty", c.PasswordEnv)
		}
		c.Password = v
	}
	return nil
}

func readPassword(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	p := strings.TrimRight(string(b), "\r\n")
	if p == "" {
		return "", fmt.Errorf("%s is empty", path)
	}
	return p, nil
}

// credentials is what every new connection authenticates with: the
// password file is read again (the last good password if it cannot be).
func (t *Tier) credentials() (string, string) {
	if f := t.cfg.PasswordFile; f != "" {
		if p, err := readPassword(f); err == nil {
			return t.cfg.Username, p
		}
	}
	return t.cfg.Username, t.cfg.Password
}

// Tier is a connection to the shared tier.
type Tier struct {
	cfg  Config
	pool []byte
	log  zerolog.Logger
	met  *Metrics

	client atomic.Pointer[redisClient] // nil until connected
	mode   atomic.Value                // string: "single" or "cluster" once connected

	writes   chan *writeJob
	inflight chan struct{}
	batches  chan struct{} // fetch batches running (bounds their buffers)
	stop     chan struct{}
	wg       sync.WaitGroup // the connector and the writers
	ops      sync.WaitGroup // lookups and fetches running
	opsMu    sync.RWMutex   // orders ops.Add against Close
	closed   atomic.Bool
	bufs     sync.Pool
}

type redisClient struct{ redis.UniversalClient }

// failed reacts to a failed round trip: a cluster client learns the slots
// again (a master that died is not answering MOVED: without this, its
// slots would be asked of it until the periodic reload).
func (c *redisClient) failed() {
	if cc, ok := c.UniversalClient.(*redis.ClusterClient); ok {
		cc.ReloadState(context.Background()) // lazy: one reload at a time
	}
}

type writeJob struct {
	w      machine.L2Write
	copied func(refused bool)
}

// New starts a Tier over pool (the sidecar's pool bytes; offsets in
// requests index it). It connects in the background: a tier that cannot
// be reached yet answers misses and refuses writes until it can.
func New(cfg Config, pool []byte, log zerolog.Logger) (*Tier, error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.resolve(); err != nil {
		return nil, err
	}
	writes := make(chan *writeJob, cfg.Queue)
	t := &Tier{cfg: cfg, pool: pool, log: log.With().Str("component", "l2").Logger(), met: newMetrics(func() int { return len(writes) }),
		writes: writes, inflight: make(chan struct{}, cfg.Inflight),
		batches: make(chan struct{}, max(cfg.Inflight/8, 2)), stop: make(chan struct{})}
	t.met.queueCap.Set(float64(cfg.Queue))
	// go-redis logs through one global logger: set once (a second set would
	// race with the clients already running).
	setLogger.Do(func() { redis.SetLogger(quietLogger{t.log}) })
	t.wg.Add(1)
	go t.connect()
	for i := 0; i < cfg.Writers; i++ {
		t.wg.Add(1)
		go t.writer()
	}
	return t, nil
}

// Config returns the effective configuration (the password elided).
func (t *Tier) Config() Config {
	c := t.cfg
	if c.Password != "" {
		c.Password = "(set)"
	}
	c.TLS = nil
	return c
}

// Metrics returns the tier's Prometheus collectors.
func (t *Tier) Metrics() *Metrics { return t.met }

// Mode returns "single" or "cluster" once connected, else "".
func (t *Tier) Mode() string {
	m, _ := t.mode.Load().(string)
	return m
}

// Connected reports whether the tier has a client (it may still fail).
func (t *Tier) Connected() bool { return t.client.Load() != nil }

// Close stops the writers (queued writes are refused), waits for the
// lookups and fetches running (nothing touches the pool once it returns)
// and closes the connections.
func (t *Tier) Close() {
	t.opsMu.Lock()
	first := t.closed.CompareAndSwap(false, true)
	t.opsMu.Unlock()
	if !first {
		return
	}
	close(t.stop)
	t.wg.Wait()
	t.ops.Wait()
	for {
		select {
		case j := <-t.writes:
			j.copied(true)
			continue
		default:
		}
		break
	}
	if c := t.client.Load(); c != nil {
		c.Close()
	}
}

var setLogger sync.Once

type quietLogger struct{ log zerolog.Logger }

func (q quietLogger) Printf(_ context.Context, format string, v ...any) {
	q.log.Debug().Msgf(format, v...)
}

// options are the client's settings for one node.
func (c *Config) options(addr string, creds func() (string, string)) *redis.Options {
	return &redis.Options{Addr: addr, CredentialsProvider: creds, TLSConfig: c.TLS,
		DialTimeout: c.IOTimeout, ReadTimeout: c.IOTimeout, WriteTimeout: c.IOTimeout, ContextTimeoutEnabled: true,
		PoolSize: c.PoolSize, MaxRetries: 1, PoolTimeout: c.IOTimeout, Protocol: 2, DisableIdentity: true,
		ReadBufferSize: 256 << 10, WriteBufferSize: 256 << 10,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}}
}

// Dial makes the client the tier uses for cfg (a cluster client when the
// server says it is a cluster node): for tools, and the benchmark that
// measures the tier against a plain loop of the same client. It returns
// "single" or "cluster".
func Dial(cfg Config) (redis.UniversalClient, string, error) {
	cfg.EnsureDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, "", err
	}
	if err := cfg.resolve(); err != nil {
		return nil, "", err
	}
	creds := func() (string, string) { return cfg.Username, cfg.Password }
	mode, err := cfg.detect(creds)
	if err != nil {
		return nil, "", err
	}
	return cfg.client(mode, creds), mode, nil
}

func (c *Config) client(mode string, creds func() (string, string)) redis.UniversalClient {
	if mode != "cluster" {
		return redis.NewClient(c.options(c.Addrs[0], creds))
	}
	o := c.options("", creds)
	return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, CredentialsProvider: creds,
		TLSConfig: o.TLSConfig, DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout, WriteTimeout: o.WriteTimeout,
		ContextTimeoutEnabled: true, PoolSize: o.PoolSize, PoolTimeout: o.PoolTimeout, MaxRetries: 1, MaxRedirects: 3,
		Protocol: 2, DisableIdentity: true, ReadBufferSize: o.ReadBufferSize, WriteBufferSize: o.WriteBufferSize,
		MaintNotificationsConfig: o.MaintNotificationsConfig, ClusterStateReloadInterval: 5 * time.Second})
}

// connect finds out whether the tier is a cluster (unless told) and makes
// the client, retrying with a backoff while no node answers.
func (t *Tier) connect() {
	defer t.wg.Done()
	delay := 100 * time.Millisecond
	for first := true; ; first = false {
		mode, err := t.cfg.detect(t.credentials)
		if err == nil {
			t.mode.Store(mode)
			t.client.Store(&redisClient{t.cfg.client(mode, t.credentials)})
			t.log.Info().Str("mode", mode).Strs("addrs", t.cfg.Addrs).Bool("tls", t.cfg.TLS != nil).Msg("shared tier connected")
			return
		}
		if first {
			t.log.Warn().Err(err).Strs("addrs", t.cfg.Addrs).Msg("shared tier unreachable: lookups miss and writes are skipped until it answers")
		}
		t.met.errors.WithLabelValues("connect").Inc()
		select {
		case <-t.stop:
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

func (c *Config) detect(creds func() (string, string)) (string, error) {
	var errs []error
	for _, a := range c.Addrs {
		cl := redis.NewClient(c.options(a, creds))
		ctx, cancel := context.WithTimeout(context.Background(), c.IOTimeout)
		info, err := cl.Info(ctx, "cluster").Result()
		cancel()
		cl.Close()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a, err))
			continue
		}
		cluster := strings.Contains(info, "cluster_enabled:1")
		switch {
		case c.Mode == "cluster" && !cluster:
			return "", fmt.Errorf("%s is not in cluster mode (--l2.redis.mode cluster)", a)
		case c.Mode == "single" && cluster:
			return "", fmt.Errorf("%s is a cluster node (--l2.redis.mode single)", a)
		case cluster:
			return "cluster", nil
		case len(c.Addrs) > 1:
			return "", fmt.Errorf("%s is a single node, but %d addresses were given", a, len(c.Addrs))
		}
		return "single", nil
	}
	return "", errors.Join(errs...)
}

// take reserves a slot for a lookup or a fetch (and counts it in ops);
// false: closed, or too many run.
func (t *Tier) take() bool {
	t.opsMu.RLock()
	defer t.opsMu.RUnlock()
	if t.closed.Load() {
		return false
	}
	select {
	case t.inflight <- struct{}{}:
		t.ops.Add(1)
		return true
	default:
		return false
	}
}

func (t *Tier) give() {
	<-t.inflight
	t.ops.Done()
}

// Lookup answers, through done (on another goroutine, or at once), how
// many leading blocks of l.Digests the tier holds, every rank of each.
func (t *Tier) Lookup(l machine.L2Lookup, done func(found int)) {
	c := t.client.Load()
	if c == nil || t.closed.Load() || !t.take() {
		t.met.lookups.WithLabelValues("unavailable").Inc()
		done(0)
		return
	}
	go func() {
		defer t.give()
		done(t.lookup(c, l))
	}()
}

func (t *Tier) lookup(c *redisClient, l machine.L2Lookup) int {
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.LookupTimeout)
	defer cancel()
	w := l.NS.Width
	n := len(l.Digests) / w
	pipe := c.Pipeline()
	cmds := make([]*redis.IntCmd, n)
	keys := make([]string, l.NS.World)
	for i := 0; i < n; i++ {
		d := l.Digests[i*w : (i+1)*w]
		for r := range keys {
			keys[r] = Key(t.cfg.Prefix, l.NS, d, r)
		}
		cmds[i] = pipe.Exists(ctx, keys...) // one slot: the ranks share a hash tag
	}
	_, err := pipe.Exec(ctx)
	found := 0
	for found < n {
		v, cerr := cmds[found].Result()
		if cerr != nil || v != int64(l.NS.World) {
			break
		}
		found++
	}
	t.met.seconds.WithLabelValues("lookup").Observe(time.Since(t0).Seconds())
	if err != nil && !errors.Is(err, redis.Nil) {
		c.failed()
		t.met.errors.WithLabelValues("lookup").Inc()
		t.met.lookups.WithLabelValues("error").Inc()
	} else {
		t.met.lookups.WithLabelValues("ok").Inc()
	}
	t.met.lookupBlocks.WithLabelValues("hit").Add(float64(found))
	t.met.lookupBlocks.WithLabelValues("miss").Add(float64(n - found))
	return found
}

// Fetch reads f's blocks into their pool slots and answers, through done,
// how each ended. done is called after the last byte is written to the
// pool: the slots are the caller's again.
func (t *Tier) Fetch(f machine.L2Fetch, done func([]machine.L2FetchResult)) {
	res := make([]machine.L2FetchResult, len(f.Blocks))
	c := t.client.Load()
	if c == nil || t.closed.Load() || !t.take() {
		t.met.fetchBlocks.WithLabelValues("unavailable").Add(float64(len(f.Blocks)))
		done(res)
		return
	}
	go func() {
		defer t.give()
		t.fetch(c, f, res)
		done(res)
	}()
}

func (t *Tier) fetch(c *redisClient, f machine.L2Fetch, res []machine.L2FetchResult) {
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.IOTimeout)
	defer cancel()
	// Batches of at most FetchBatchBytes run side by side (a cluster's
	// nodes answer in parallel), a bounded number in all.
	per := max(1, t.cfg.FetchBatchBytes/int(max(f.MaxLength, 1)*uint64(max(f.NS.World, 1))))
	var wg sync.WaitGroup
	for i := 0; i < len(f.Blocks); i += per {
		e := min(i+per, len(f.Blocks))
		select {
		case t.batches <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			t.met.fetchBlocks.WithLabelValues("timeout").Add(float64(len(f.Blocks) - i))
			return
		}
		wg.Add(1)
		go func() {
			defer func() { <-t.batches; wg.Done() }()
			t.fetchBatch(ctx, c, f, i, e, res)
		}()
	}
	wg.Wait()
	t.met.seconds.WithLabelValues("fetch").Observe(time.Since(t0).Seconds())
}

func (t *Tier) fetchBatch(ctx context.Context, c *redisClient, f machine.L2Fetch, first, end int, res []machine.L2FetchResult) {
	pipe := c.Pipeline()
	cmds := make([][]*redis.StringCmd, end-first)
	for i := first; i < end; i++ {
		b := f.Blocks[i]
		cmds[i-first] = make([]*redis.StringCmd, len(b.PoolOffsets))
		for r := range b.PoolOffsets {
			// At most the header, the largest payload and one byte more
			// (a longer value is rejected as trailing): whoever can write
			// the tier cannot make the sidecar read a value of any size.
			cmds[i-first][r] = pipe.GetRange(ctx, Key(t.cfg.Prefix, f.NS, b.Digest, r), 0, int64(HeaderSize)+int64(f.MaxLength))
		}
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		c.failed()
		t.met.errors.WithLabelValues("fetch").Inc()
	}
	for i := first; i < end; i++ {
		b := f.Blocks[i]
		ok, length := true, f.Length
		for r, off := range b.PoolOffsets {
			v, err := cmds[i-first][r].Bytes()
			if err == nil && len(v) == 0 {
				err = redis.Nil // GETRANGE of a missing key: an empty string
			}
			if err != nil {
				ok = false
				if errors.Is(err, redis.Nil) {
					t.met.fetchBlocks.WithLabelValues("miss").Inc()
				} else {
					t.met.fetchBlocks.WithLabelValues("error").Inc()
				}
				break
			}
			p, crc, why := CheckHeader(v, f.NS, b.Digest, r, length, f.MaxLength)
			if why == "" && off+uint64(len(p)) > uint64(len(t.pool)) {
				ok = false
				t.met.errors.WithLabelValues("fetch").Inc()
				break
			}
			// Copied and checksummed in one pass; a payload whose checksum
			// does not match leaves garbage in a slot reserved for this
			// block alone, which the Machine then frees unseen.
			if why == "" && CopyOutCRC(t.pool[off:off+uint64(len(p))], p) != crc {
				why = RejectChecksum
			}
			if why != "" {
				ok = false
				t.met.rejected.WithLabelValues(why).Inc()
				t.met.fetchBlocks.WithLabelValues("rejected").Inc()
				break
			}
			length = uint64(len(p)) // every rank the same size
			t.met.bytes.WithLabelValues("read").Add(float64(len(v)))
		}
		if ok {
			res[i] = machine.L2FetchResult{OK: true, Length: length}
			t.met.fetchBlocks.WithLabelValues("ok").Inc()
		}
	}
}

// Write queues w: a writer copies every rank's bytes out of the pool,
// calls copied(false) (the slots are the caller's again), then writes the
// values. A full queue (or a tier not connected) refuses at once:
// copied(true).
func (t *Tier) Write(w machine.L2Write, copied func(refused bool)) {
	if t.client.Load() == nil || t.closed.Load() {
		t.met.writes.WithLabelValues("unavailable").Inc()
		copied(true)
		return
	}
	select {
	case t.writes <- &writeJob{w: w, copied: copied}:
	default:
		t.met.writes.WithLabelValues("queue_full").Inc()
		copied(true)
	}
}

func (t *Tier) writer() {
	defer t.wg.Done()
	for {
		select {
		case <-t.stop:
			return
		case j := <-t.writes:
			t.write(j)
		}
	}
}

func (t *Tier) write(j *writeJob) {
	c := t.client.Load()
	w := j.w
	vals := make([][]byte, len(w.PoolOffsets))
	for r, off := range w.PoolOffsets {
		buf, _ := t.bufs.Get().(*[]byte)
		if buf == nil {
			buf = new([]byte)
		}
		*buf = AppendValue((*buf)[:0], w.NS, w.Digest, r, t.pool[off:off+w.Length])
		vals[r] = *buf
		defer t.bufs.Put(buf)
	}
	j.copied(false) // the pool is not read past this point
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.IOTimeout)
	defer cancel()
	pipe := c.Pipeline()
	for r, v := range vals {
		pipe.Set(ctx, Key(t.cfg.Prefix, w.NS, w.Digest, r), v, t.cfg.TTL)
	}
	_, err := pipe.Exec(ctx)
	t.met.seconds.WithLabelValues("write").Observe(time.Since(t0).Seconds())
	if err != nil {
		c.failed()
		t.met.errors.WithLabelValues("write").Inc()
		t.met.writes.WithLabelValues("error").Inc()
		return
	}
	t.met.writes.WithLabelValues("ok").Inc()
	for _, v := range vals {
		t.met.bytes.WithLabelValues("written").Add(float64(len(v)))
	}
}

// Client returns the go-redis client (nil until connected), for tests and
// tools that look at the tier directly.
func (t *Tier) Client() redis.UniversalClient {
	if c := t.client.Load(); c != nil {
		return c.UniversalClient
	}
	return nil
}

// WaitConnected waits until the tier is connected or the deadline passes.
func (t *Tier) WaitConnected(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !t.Connected() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}
