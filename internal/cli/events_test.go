package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/ringside-kv/ringside/internal/kvevents"
)

func endpoint(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

func seqBytes(n uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], n)
	return b[:]
}

// `ringside events` against a replay socket holding the captured real vLLM
// stream (internal/kvevents/testdata): it prints every event, and its
// prefix answer per tier is what the stream's events leave.
func TestEventsCommand(t *testing.T) {
	f, err := os.Open("../kvevents/testdata/vllm-0.32-cpu.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	var payloads [][]byte
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var c struct{ Payload string }
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatal(err)
		}
		p, _ := hex.DecodeString(c.Payload)
		payloads = append(payloads, p)
	}
	f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pubEP, rtrEP := endpoint(t), endpoint(t)
	pub, rtr := zmq4.NewPub(ctx), zmq4.NewRouter(ctx, zmq4.WithID(zmq4.SocketIdentity("r")))
	defer pub.Close()
	defer rtr.Close()
	if err := pub.Listen(pubEP); err != nil {
		t.Fatal(err)
	}
	if err := rtr.Listen(rtrEP); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			m, err := rtr.Recv()
			if err != nil || len(m.Frames) != 3 {
				return
			}
			start := binary.BigEndian.Uint64(m.Frames[2])
			for i, p := range payloads {
				if uint64(i) >= start {
					rtr.Send(zmq4.NewMsgFrom(m.Frames[0], []byte{}, []byte("kv@t@m"), seqBytes(uint64(i)), p))
				}
			}
			rtr.Send(zmq4.NewMsgFrom(m.Frames[0], []byte{}, []byte{}, seqBytes(kvevents.EndSeq), []byte{}))
		}
	}()
	// What the stream leaves, and a prompt: the first GPU event's chain.
	idx := kvevents.NewIndex()
	var chain []uint64
	for _, p := range payloads {
		b, err := kvevents.DecodeBatch(p)
		if err != nil {
			t.Fatal(err)
		}
		for i := range b.Events {
			if chain == nil && b.Events[i].Tier() == "gpu" {
				chain = b.Events[i].BlockHashes
			}
			idx.Apply(&b.Events[i])
		}
	}
	want := idx.Prefix(chain)
	var hs []string
	for _, h := range chain {
		hs = append(hs, strconv.FormatUint(h, 10))
	}
	var out, errOut bytes.Buffer
	app := App()
	app.Writer, app.ErrWriter = &out, &errOut
	err = app.Run([]string{"ringside", "events", "--endpoint", pubEP, "--replay", rtrEP, "--from", "0", "--json",
		"--duration", "2s", "--prefix", strings.Join(hs, ",")})
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut.String())
	}
	var events int
	var answer map[string]any
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var x map[string]any
		if err := json.Unmarshal([]byte(l), &x); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		if _, ok := x["event"]; ok {
			events++
		}
		if p, ok := x["prefix"]; ok {
			answer = p.(map[string]any)
		}
	}
	total := 0
	for _, p := range payloads {
		b, _ := kvevents.DecodeBatch(p)
		total += len(b.Events)
	}
	if events != total {
		t.Fatalf("%d events printed, the stream has %d", events, total)
	}
	tiers := answer["tiers"].(map[string]any)
	for tier, n := range want {
		if int(tiers[tier].(float64)) != n {
			t.Fatalf("tier %s: %v, want %d", tier, tiers[tier], n)
		}
	}
	if !strings.Contains(errOut.String(), "1 gaps") {
		t.Fatalf("the replayed start is not counted as a filled gap: %s", errOut.String())
	}
	// Readable lines too.
	out.Reset()
	if err := app.Run([]string{"ringside", "events", "--endpoint", pubEP, "--replay", rtrEP, "--from", "0", "--duration", "1s",
		"--prefix", strings.Join(hs, ",")}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "BlockStored cpu") || !strings.Contains(out.String(), "prefix of "+strconv.Itoa(len(chain))+" blocks: cpu ") {
		t.Fatalf("readable output:\n%s", out.String())
	}
}

func TestParseHashes(t *testing.T) {
	for in, want := range map[string][]uint64{
		"1,2,3":                    {1, 2, 3},
		"0x10 17\n[18]":            {16, 17, 18},
		"18446744073709551615":     {1<<64 - 1},
		"00000000000000aa00000001": {0xaa00000001}, // a digest's hex: its last 8 bytes
	} {
		got, err := parseHashes(in)
		if err != nil || len(got) != len(want) {
			t.Fatalf("%q: %v %v", in, got, err)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%q: %v", in, got)
			}
		}
	}
	for _, bad := range []string{"", "x", "1,,y", "@/nonexistent"} {
		if _, err := parseHashes(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
