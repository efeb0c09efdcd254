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
	"github.com/ringside-kv/ringside/sidecar/node"
)

// sidecarNode is one node of a run: a sidecar process with its own
// directory and pool.
type sidecarNode struct {
	sc      *harness.Child
	dir     string
	sock    string
	metrics string // host:port of /debug/state; empty: none
}

// startNode starts node i's sidecar for run k; with nt, attached to that
// node tier as pod i.
func (c *Config) startNode(ctx context.Context, w *Workload, dir string, capacity int, transport string, nt *nodeTier, k, i int) (*sidecarNode, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	n := &sidecarNode{dir: dir, sock: filepath.Join(dir, "ringside.sock")}
	budget := max(int64(64<<20), int64(w.MaxPages)*int64(c.PageBytes))
	if tiered(transport) || nt != nil {
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
		"--cache.policy", c.Policy,
		// Stated, as the models read it: what one acquire may fetch.
		"--limits.pending-share", strconv.FormatFloat(FetchPendingShare, 'g', -1, 64)}
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
	if nt != nil {
		pages := strconv.Itoa(max(w.MaxPages, 1))
		args = append(args, "--node.socket", nt.sock, "--node.pod", fmt.Sprintf("replay-pod-%d", i),
			// No bound may cut a continuation short or skip a write: the
			// model has none (as for the shared tier above).
			"--l2.max-lookup-blocks", pages, "--l2.max-fetch-blocks", pages,
			"--l2.write-slots", strconv.Itoa(capacity), "--node.write-queue", strconv.Itoa(max(capacity, w.MaxPages, 1024)))
		if c.Sequential {
			// One writer (its pins end in commit order, the node takes the
			// writes in that order) and deadlines no loaded machine reaches.
			args = append(args, "--node.writers", "1", "--node.lookup-timeout", c.Timeout.String(), "--node.io-timeout", c.Timeout.String())
			// One chunk per store: its commits, each followed by its write's
			// pin, come in one step, before any write ends. Over several
			// chunks a write could end between two of them, and MQP's clock
			// (markers, demotions) would see its block listed at a time the
			// model cannot know; the LRU's order is the same either way.
			args = append(args, "--copy.chunk-bytes", strconv.FormatInt(max(4<<20, int64(w.MaxPages)*int64(c.PageBytes)), 10))
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
	if nt != nil {
		if err := sc.WaitUntil(ctx, c.Timeout, "attached to the node tier", func() error {
			st, err := n.state()
			if err != nil {
				return err
			}
			if st.L2 == nil || st.L2.Node == nil || !st.L2.Node.Connected {
				return fmt.Errorf("node tier not attached")
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
		Node *struct {
			Connected bool              `json:"connected"`
			Counts    map[string]uint64 `json:"counts"`
		} `json:"node"`
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
			if l := st.L2; l != nil && l.Node != nil {
				// The node tier's client ends each write one way.
				nc := l.Node.Counts
				if nc["writes_stored"]+nc["writes_held_already"]+nc["writes_refused"]+nc["writes_failed"] >= l.Machine.Writes {
					return nil
				}
			} else if l != nil && uint64(l.Client.Writes["ok"]+l.Client.Writes["error"])+l.Machine.WritesNotTaken >= l.Machine.Writes {
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

// nodeTier is a run's `ringside node` process (--node-tier): one pool the
// pods' sidecars attach to.
type nodeTier struct {
	sc      *harness.Child
	sock    string
	metrics string
}

// NodeTierStats are the node process's counts at the end of a run (its
// /metrics, ringside_node_server_*).
type NodeTierStats struct {
	Slots, PresentSlots                      int64
	LookupHitBlocks, GetHitValues            int64
	PutStored, PutHeld, PutNoSpace, Rejected int64
	Evicted                                  int64
	BytesIn, BytesOut                        int64
}

// startNodeTier starts the node process of a run with a pool of pages
// slots (the pages' bytes plus the value's header each).
func (c *Config) startNodeTier(ctx context.Context, dir string, pages int) (*nodeTier, error) {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return nil, err
	}
	p, err := freeTCP()
	if err != nil {
		return nil, err
	}
	nt := &nodeTier{sock: filepath.Join(dir, "node.sock"), metrics: p}
	stride := int64(c.PageBytes) + node.SlotHeadroom
	args := []string{"node", "--dir", dir, "--socket", nt.sock, "--metrics.addr", nt.metrics,
		"--pool.bytes", strconv.FormatInt(int64(pages)*stride, 10), "--pool.slot-bytes", strconv.Itoa(c.PageBytes),
		// The engines of one trace are one tenant (as --limits.pin-share 1
		// above): no pod's share evicts its own blocks first, the pool is
		// one LRU, as the model's.
		"--pod-share", "1", "--max-pods", strconv.Itoa(c.Engines + 4),
		// The pods' sidecars share this process's network namespace: each
		// is the pod its --node.pod names.
		"--pod-identity", "declared",
		"--io-timeout", c.Timeout.String(), "--log.level", "warn"}
	sc, err := harness.Start("node tier", c.Ringside, args, harness.Options{Timeout: c.Timeout})
	if err != nil {
		return nil, err
	}
	nt.sc = sc
	if err := sc.WaitUntil(ctx, c.Timeout, "serving", func() error {
		if _, err := os.Stat(nt.sock); err != nil {
			return err
		}
		_, err := nt.stats()
		return err
	}); err != nil {
		sc.Kill()
		return nil, err
	}
	return nt, nil
}

func (nt *nodeTier) stats() (NodeTierStats, error) {
	var st NodeTierStats
	resp, err := httpClient.Get("http://" + nt.metrics + "/metrics")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return st, err
	}
	fields := map[string]*int64{
		"slots": &st.Slots, "present_slots": &st.PresentSlots, "lookup_hit_blocks_total": &st.LookupHitBlocks,
		"get_hit_values_total": &st.GetHitValues, "put_stored_values_total": &st.PutStored, "put_held_values_total": &st.PutHeld,
		"put_no_space_values_total": &st.PutNoSpace, "rejected_values_total": &st.Rejected, "evicted_total": &st.Evicted,
		"bytes_in_total": &st.BytesIn, "bytes_out_total": &st.BytesOut,
	}
	seen := 0
	for _, line := range strings.Split(string(b), "\n") {
		name, v, ok := strings.Cut(line, " ")
		if !ok || !strings.HasPrefix(name, "ringside_node_server_") {
			continue
		}
		if f := fields[strings.TrimPrefix(name, "ringside_node_server_")]; f != nil {
			x, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return st, fmt.Errorf("/metrics: %q: %w", line, err)
			}
			*f = int64(x)
			seen++
		}
	}
	if seen != len(fields) {
		return st, fmt.Errorf("/metrics: %d of %d series", seen, len(fields))
	}
	return st, nil
}
