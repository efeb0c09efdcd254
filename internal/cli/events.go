package cli

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/internal/kvevents"
)

func eventsCommand() *cli.Command {
	return &cli.Command{
		Name:  "events",
		Usage: "follow an engine's KV event stream (vLLM's ZMQ publisher): print the events, fill gaps from the replay socket, answer a prompt's prefix per tier",
		Description: "Subscribes to the publisher at --endpoint (vLLM's --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557)\n" +
			"and prints each event as a line (--json: JSON Lines). A jump in the sequence numbers is filled from the\n" +
			"replay socket (--replay, vLLM's replay_endpoint); batches it no longer holds are reported as lost. A number\n" +
			"lower than expected is a restarted publisher: what it said before is forgotten. With --prefix (a prompt's\n" +
			"block hashes, as the engine's events carry them: decimal or 0x hex, comma-separated, or @FILE) it prints at\n" +
			"the end how many leading blocks of the prompt each tier of the pod holds.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "endpoint", Required: true, Usage: "the publisher's endpoint, tcp://HOST:PORT", EnvVars: env("events.endpoint")},
			&cli.StringFlag{Name: "replay", Usage: "its replay endpoint (empty: gaps are reported, not filled)", EnvVars: env("events.replay")},
			&cli.StringFlag{Name: "topic", Usage: "topic prefix to subscribe to (empty: all)", EnvVars: env("events.topic")},
			&cli.BoolFlag{Name: "json", Usage: "print JSON Lines: one object per event, gap, restart and the prefix answer"},
			&cli.StringFlag{Name: "from", Usage: "first sequence number wanted: the batches before the first one received come from the replay socket (e.g. 0: everything it holds)"},
			&cli.DurationFlag{Name: "duration", Usage: "stop after this long (0: at SIGINT/SIGTERM)"},
			&cli.IntFlag{Name: "count", Usage: "stop after this many batches (0: no limit)"},
			&cli.DurationFlag{Name: "replay-timeout", Value: 5 * time.Second, Usage: "deadline of one replay request; one that got nothing is asked once more on a fresh connection"},
			&cli.StringFlag{Name: "prefix", Usage: "a prompt's block hashes (comma-separated, or @FILE): print each tier's leading match at the end"},
			&cli.BoolFlag{Name: "quiet", Usage: "print no events (only gaps, restarts and the prefix answer)"},
			&cli.Uint64Flag{Name: "debug.drop-nth", Hidden: true, Usage: "tests: drop the n-th live message, as if lost, to exercise the gap fill"},
		},
		Action: eventsAction,
	}
}

func eventsAction(c *cli.Context) error {
	var prefix []uint64
	if p := c.String("prefix"); p != "" {
		var err error
		if prefix, err = parseHashes(p); err != nil {
			return err
		}
	}
	o := kvevents.Options{Endpoint: c.String("endpoint"), Replay: c.String("replay"), Topic: c.String("topic"),
		ReplayTimeout: c.Duration("replay-timeout"), DropNth: c.Uint64("debug.drop-nth")}
	if f := c.String("from"); f != "" {
		n, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			return fmt.Errorf("events: --from %q: %w", f, err)
		}
		o.From = &n
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	if d := c.Duration("duration"); d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	s, err := kvevents.Subscribe(ctx, o)
	if err != nil {
		return err
	}
	defer s.Close()
	p := &printer{w: c.App.Writer, json: c.Bool("json"), quiet: c.Bool("quiet"), idx: kvevents.NewIndex()}
	err = follow(ctx, s, p, c.Int("count"))
	if prefix != nil {
		p.prefix(prefix)
	}
	st := s.Stats()
	fmt.Fprintf(c.App.ErrWriter, "events: %d batches live, %d replayed, %d gaps (%d batches lost), %d restarts\n",
		st.Live, st.Replayed, st.Gaps, st.Lost, st.Restarts)
	return err
}

// follow feeds the stream's items to p until ctx ends or count batches
// were read; a malformed message is reported and skipped.
func follow(ctx context.Context, s *kvevents.Stream, p *printer, count int) error {
	n := 0
	for count <= 0 || n < count {
		items, err := s.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, kvevents.ErrMalformed) {
				p.malformed(err)
				continue
			}
			return err
		}
		for i := range items {
			p.item(&items[i])
		}
		n++
	}
	return nil
}

type printer struct {
	w     io.Writer
	json  bool
	quiet bool
	idx   *kvevents.Index
	enc   *json.Encoder
}

func (p *printer) emit(v any) {
	if p.enc == nil {
		p.enc = json.NewEncoder(p.w)
	}
	_ = p.enc.Encode(v)
}

func (p *printer) malformed(err error) {
	if p.json {
		p.emit(map[string]any{"malformed": err.Error()})
		return
	}
	fmt.Fprintf(p.w, "malformed message: %v\n", err)
}

func (p *printer) item(it *kvevents.Item) {
	if it.Restart {
		p.idx.Clear()
		if p.json {
			p.emit(map[string]any{"restart": true})
		} else {
			fmt.Fprintln(p.w, "publisher restarted: its earlier events are void")
		}
	}
	if it.Msg == nil {
		reason := "not in the replay buffer"
		if it.Err != nil {
			reason = it.Err.Error()
		}
		if p.json {
			p.emit(map[string]any{"gap": map[string]any{"from": it.GapFrom, "lost": it.Missing, "reason": reason}})
		} else {
			fmt.Fprintf(p.w, "gap: %d batches from seq %d lost (%s)\n", it.Missing, it.GapFrom, reason)
		}
		return
	}
	m := it.Msg
	for i := range m.Batch.Events {
		e := &m.Batch.Events[i]
		p.idx.Apply(e)
		if p.quiet {
			continue
		}
		if p.json {
			p.emit(map[string]any{"seq": m.Seq, "topic": m.Topic, "ts": m.Batch.TS, "dp_rank": m.Batch.DPRank,
				"replayed": it.Replayed, "tier": e.Tier(), "event": e})
			continue
		}
		fmt.Fprintln(p.w, line(m, e, it.Replayed))
	}
}

func line(m *kvevents.Message, e *kvevents.Event, replayed bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "seq %d", m.Seq)
	if replayed {
		b.WriteString(" (replayed)")
	}
	fmt.Fprintf(&b, " %s", e.Type)
	if e.Type == kvevents.AllBlocksCleared {
		return b.String()
	}
	fmt.Fprintf(&b, " %s", e.Tier())
	hs := make([]string, len(e.BlockHashes))
	for i, h := range e.BlockHashes {
		hs[i] = fmt.Sprintf("%#016x", h)
	}
	fmt.Fprintf(&b, " [%s]", strings.Join(hs, " "))
	if e.Type == kvevents.BlockStored {
		if e.Parent != nil {
			fmt.Fprintf(&b, " parent %#016x", *e.Parent)
		}
		fmt.Fprintf(&b, " tokens %d block %d", len(e.TokenIDs), e.BlockSize)
		if e.LoraName != nil {
			fmt.Fprintf(&b, " lora %s", *e.LoraName)
		}
	}
	if e.GroupIdx != nil {
		fmt.Fprintf(&b, " group %d", *e.GroupIdx)
	}
	return b.String()
}

func (p *printer) prefix(hashes []uint64) {
	got := p.idx.Prefix(hashes)
	tiers := p.idx.Tiers()
	if p.json {
		out := map[string]int{}
		for _, t := range tiers {
			out[t] = got[t]
		}
		p.emit(map[string]any{"prefix": map[string]any{"blocks": len(hashes), "tiers": out}})
		return
	}
	sort.Strings(tiers)
	fmt.Fprintf(p.w, "prefix of %d blocks:", len(hashes))
	if len(tiers) == 0 {
		fmt.Fprint(p.w, " no tier holds any block")
	}
	for _, t := range tiers {
		fmt.Fprintf(p.w, " %s %d", t, got[t])
	}
	fmt.Fprintln(p.w)
}

// parseHashes reads comma- or space-separated hashes (decimal, 0x hex, or
// a digest's hex bytes: its last 8), or @FILE of them.
func parseHashes(s string) ([]uint64, error) {
	if strings.HasPrefix(s, "@") {
		b, err := os.ReadFile(s[1:])
		if err != nil {
			return nil, fmt.Errorf("events: --prefix: %w", err)
		}
		s = string(b)
	}
	f := strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\t' || r == '[' || r == ']' })
	out := make([]uint64, 0, len(f))
	for _, x := range f {
		var v uint64
		var err error
		switch {
		case strings.HasPrefix(x, "0x") || strings.HasPrefix(x, "0X"):
			v, err = strconv.ParseUint(x[2:], 16, 64)
		case len(x) >= 16 && len(x)%2 == 0 && strings.Trim(x, "0123456789") != "" || len(x) > 20:
			// a digest in hex (vLLM's bytes hashes): its last 8 bytes
			var b []byte
			if b, err = hex.DecodeString(x); err == nil {
				v, err = kvevents.Hash(b)
			}
		default:
			v, err = strconv.ParseUint(x, 10, 64)
		}
		if err != nil {
			return nil, fmt.Errorf("events: --prefix: %q is not a block hash", x)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, errors.New("events: --prefix: no hashes")
	}
	return out, nil
}
