package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/sidecar"
)

func init() {
	inspectSubcommands = append(inspectSubcommands, &cli.Command{
		Name:  "sidecar",
		Usage: "print the live state of a running sidecar (sessions, rings, pool usage)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "metrics.addr", Value: "127.0.0.1" + sidecar.DefaultMetricsAddr, Usage: "the sidecar's metrics address", EnvVars: env("metrics.addr")},
			&cli.BoolFlag{Name: "json", Usage: "print the raw JSON"},
		},
		Action: func(c *cli.Context) error {
			addr := c.String("metrics.addr")
			if strings.HasPrefix(addr, ":") {
				addr = "127.0.0.1" + addr
			}
			hc := http.Client{Timeout: 5 * time.Second}
			resp, err := hc.Get("http://" + addr + "/debug/state")
			if err != nil {
				return fmt.Errorf("inspect sidecar: %w (is `ringside serve` running with --metrics.addr %s?)", err, addr)
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
			if err != nil {
				return err
			}
			if c.Bool("json") {
				_, err := c.App.Writer.Write(body)
				return err
			}
			var st sidecar.State
			if err := json.Unmarshal(body, &st); err != nil {
				return err
			}
			w := c.App.Writer
			p := st.Pool
			fmt.Fprintf(w, "sidecar epoch %s  dir %s  ready %v\n", st.Epoch, st.Dir, st.Ready)
			fmt.Fprintf(w, "pool: %d slots of %d bytes: %d free, %d used (%d stored, %d writing)  blocks %d (pinned %d)  leases %d\n",
				p.Capacity, st.SlotBytes, p.Free, p.Used, p.Stored, p.Writing, p.Blocks, p.PinnedBlocks, p.Leases)
			fmt.Fprintf(w, "lookups %d  hit blocks %d of %d  stores %d  evictions %d  expired leases %d\n",
				p.Lookups, p.HitBlocks, p.LookupBlocks, p.Stores, p.Evictions, p.ExpiredLeases)
			if l := st.L2; l != nil {
				m := l.Machine
				fmt.Fprintf(w, "tiers: policy %s  lookups %d (%d blocks asked, %d found, %d timed out)  fetches %d: %d blocks fetched, %d missed, %d timed out\n",
					l.Policy, m.Lookups, m.LookupBlocks, m.LookupHitBlocks, m.LookupTimeouts, m.Fetches, m.FetchedBlocks, m.FetchMisses, m.FetchTimeouts)
				fmt.Fprintf(w, "  writes %d (skipped %d, refused %d)  pinned slots %d  evicted unwritten %d\n",
					m.Writes, m.WritesSkipped, m.WritesNotTaken, m.WritingSlots, l.EvictedUnwritten)
				if n := l.Node; n != nil {
					k := n.Counts
					fmt.Fprintf(w, "node tier: %s pod %s connected %v epoch %016x  lookups %d (%d blocks found)  fetched %d, missed %d, rejected %d\n",
						n.Socket, n.Pod, n.Connected, n.Epoch, k["lookups"], k["lookup_hit_blocks"], k["fetched_blocks"], k["fetch_missed_blocks"], k["fetch_rejected_values"])
					fmt.Fprintf(w, "  writes stored %d, held already %d, refused %d, failed %d  timeouts %d  attaches %d\n",
						k["writes_stored"], k["writes_held_already"], k["writes_refused"], k["writes_failed"], k["timeouts"], k["attaches"])
					fmt.Fprintf(w, "  KV events: described %d (dropped %d)  node log: stored %d, removed %d, dropped %d, rebuilds %d, read failures %d\n",
						k["described"], k["describe_dropped"], k["events_stored"], k["events_removed"], k["events_dropped"], k["events_rebuilds"], k["events_read_failures"])
					if n.LastError != "" {
						fmt.Fprintf(w, "  not attached: %s\n", n.LastError)
					}
				}
				if cl := l.Client; cl != nil {
					fmt.Fprintf(w, "l2: %s %v connected %v tls %v prefix %q ttl %s\n", l.Mode, l.Addrs, l.Connected, l.TLS, l.Prefix, l.TTL)
					fmt.Fprintf(w, "  writes ok %.0f, errors %.0f  queue %.0f\n", cl.Writes["ok"], cl.Writes["error"], cl.Queue)
					var rej float64
					for _, v := range cl.Rejected {
						rej += v
					}
					fmt.Fprintf(w, "  bytes read %.0f written %.0f  rejected values %.0f  errors lookup %.0f fetch %.0f write %.0f connect %.0f\n",
						cl.Bytes["read"], cl.Bytes["written"], rej, cl.Errors["lookup"], cl.Errors["fetch"], cl.Errors["write"], cl.Errors["connect"])
				}
			}
			fmt.Fprintf(w, "sessions: %d\n", len(st.Sessions))
			for _, s := range st.Sessions {
				fmt.Fprintf(w, "  #%d %s role %d rank %d pid %d regions %d  rings %s (%d B queued), %s (%d B queued)\n",
					s.ID, s.Instance, s.Role, s.Rank, s.PID, s.Regions, s.SubmissionRing, s.SubmissionUsed, s.CompletionRing, s.CompletionUsed)
			}
			return nil
		},
	})
}
