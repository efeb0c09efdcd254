package replay

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ringside-kv/ringside/bench/harness"
	"github.com/ringside-kv/ringside/internal/redistest"
)

// sidecarNode is one node of a run: a sidecar process with its own
// directory and pool.
type sidecarNode struct {
	sc      *harness.Child
	dir     string
	sock    string
	metrics string // host:port of /debug/state; empty: none
}

// startNode starts node i's sidecar for run k.
func (c *Config) startNode(ctx context.Context, w *Workload, dir string, capacity int, transport string, k, i int) (*sidecarNode, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	n := &sidecarNode{dir: dir, sock: filepath.Join(dir, "ringside.sock")}
	budget := max(int64(64<<20), int64(w.MaxPages)*int64(c.PageBytes))
	if tiered(transport) {
		p, err := freeTCP()
		if err != nil {
			return nil, err
		}
		n.metrics = p
	}
	args := []string{"serve",
		"--dir", dir, "--socket", n.sock, "--metrics.addr", n.metrics,
		"--pool.slot-bytes", strconv.Itoa(c.PageBytes), "--pool.bytes", strconv.FormatInt(int64(capacity)*int64(c.PageBytes), 10),
		"--budget", strconv.FormatInt(budget, 10), "--log.level", "warn",
		// The engines of one trace are one tenant: a pin quota would shorten
		// leases and take the hit rate off the exact LRU model, and a
		// retain quota would cut the hints of --hints short.
		"--limits.pin-share", "1", "--limits.retain-share", "1",
		"--cache.policy", c.Policy}
	if c.Sequential {
		// One copy worker: a store's chunks commit in prefix order, as the
		// models commit a request's pages (with two, a request of more
		// pages than a chunk holds, such as thousands of 16-token pages,
		// committed its chunks in whatever order they finished).
		// And no stall bound a loaded machine reaches: a store of
		// thousands of pages that outlasts --copy.stall (1 s) is cancelled
		// as stuck, and the run stops on a copy the model never loses.
		args = append(args, "--copy.workers", "1", "--copy.stall", c.Timeout.String())
	}
	if tiered(transport) {
		pages := strconv.Itoa(max(w.MaxPages, 1))
		args = append(args, "--l2.redis.addrs", strings.Join(c.L2Addrs, ","),
			// Each run a tier of its own: nothing of an earlier run is found.
			"--l2.redis.prefix", fmt.Sprintf("ringside-replay-%d-%d:", os.Getpid(), k),
			// No bound of the tier's may cut a continuation short, and no
			// write may be skipped: the model has none.
			"--l2.max-lookup-blocks", pages, "--l2.max-fetch-blocks", pages,
			"--l2.write-slots", strconv.Itoa(capacity), "--l2.redis.write-queue", strconv.Itoa(max(capacity, 1024)))
		if c.Sequential {
			// Deterministic: one writer (the writes' pins end in commit
			// order) and deadlines no loaded machine reaches.
			args = append(args, "--l2.redis.writers", "1", "--l2.redis.lookup-timeout", c.Timeout.String(), "--l2.redis.io-timeout", c.Timeout.String())
		}
	}
	sc, err := harness.Start(fmt.Sprintf("sidecar %d", i), c.Ringside, args, harness.Options{Timeout: c.Timeout})
	if err != nil {
		return nil, err
	}
	n.sc = sc
	if err := waitAttachable(ctx, sc, n.sock, c.layout(), c.Timeout); err != nil {
		return n, err
	}
	if tiered(transport) {
		if err := sc.WaitUntil(ctx, c.Timeout, "connected to the tier", func() error {
			st, err := n.state()
			if err != nil {
				return err
			}
			if st.L2 == nil || !st.L2.Connected {
				return fmt.Errorf("tier not connected")
			}
			return nil
		}); err != nil {
			return n, err
		}
	}
	return n, nil
}

// nodeState is the part of /debug/state the replay reads.
type nodeState struct {
	L2 *struct {
		Connected bool `json:"connected"`
		Machine   struct {
			Writes, WritesNotTaken, FetchedBlocks uint64
		} `json:"machine"`
		Client struct {
			Writes map[string]float64 `json:"writes"`
		} `json:"client"`
	} `json:"l2"`
}

var httpClient = &http.Client{Timeout: 10 * time.Second}

func (n *sidecarNode) state() (nodeState, error) {
	var st nodeState
	if n.metrics == "" {
		return st, fmt.Errorf("no metrics address")
	}
	resp, err := httpClient.Get("http://" + n.metrics + "/debug/state")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(b, &st)
}

// waitWrites returns a function that waits until every write the node
// handed to the tier has ended (written, failed or refused).
func (n *sidecarNode) waitWrites(timeout time.Duration) func() error {
	return func() error {
		deadline := time.Now().Add(timeout)
		for {
			st, err := n.state()
			if err != nil {
				return err
			}
			if l := st.L2; l != nil && uint64(l.Client.Writes["ok"]+l.Client.Writes["error"])+l.Machine.WritesNotTaken >= l.Machine.Writes {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the tier's writes did not end within %v", timeout)
			}
			time.Sleep(200 * time.Microsecond)
		}
	}
}

func freeTCP() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// startTier starts the Redis the nodes share (--l2.start) and sets
// L2Addrs; the returned function stops it.
func (c *Config) startTier() (func(), error) {
	base := filepath.Join(os.TempDir(), fmt.Sprintf("ringside-replay-redis-%d", os.Getpid()))
	if err := os.MkdirAll(base, 0o700); err != nil {
		return nil, err
	}
	switch c.L2Start {
	case "single":
		s, err := redistest.Start(base, redistest.Options{})
		if err != nil {
			os.RemoveAll(base)
			return nil, err
		}
		c.L2Addrs = []string{s.Addr}
		return func() { s.Close(); os.RemoveAll(base) }, nil
	default:
		cl, err := redistest.StartCluster(base, 3, 1, redistest.Options{})
		if err != nil {
			os.RemoveAll(base)
			return nil, err
		}
		c.L2Addrs = cl.Addrs()
		return func() { cl.Close(); os.RemoveAll(base) }, nil
	}
}
