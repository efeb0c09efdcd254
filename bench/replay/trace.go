package replay

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"

	"github.com/ringside-kv/ringside/sidecar/cache"
)

// DigestWidth is the width of the page hashes the replay registers (as
// vLLM's sha256 block hashes).
const DigestWidth = 32

// Request is one trace request, expanded to engine pages.
type Request struct {
	ArrivalMs    int64    // arrival time from the start of the (merged) trace
	InputTokens  int      // prompt length
	OutputTokens int      // completion length
	Trace        int      // index of the trace file it came from
	Pages        []uint32 // page ids in prefix order (see Workload.Digest)
	RequestMeta
}

// Workload is one or more traces, merged by arrival time and expanded into
// chained engine pages.
//
// Every 512-token block id of a trace names its whole prefix (two requests
// that share a leading run of ids share that prefix), so a block is
// interned by (parent block, id): the same run of ids always yields the
// same block. Block b's pages are ids b*PagesPerBlock+j, j < PagesPerBlock,
// and their digests are chained, sha256(previous page's digest, block id,
// j), starting from a seed per trace file, so that a page digest names its
// whole prefix as an engine's does; then each digest's first word is set
// so that the sidecar's MQP hashes page id p where the offline model does
// (alignDigest). A request has floor(input_length /
// PageTokens) pages (engines cache full pages only), at most
// PagesPerBlock per id.
type Workload struct {
	Requests      []Request
	Files         []string
	PageTokens    int
	BlockTokens   int
	PagesPerBlock int
	Blocks        int    // distinct blocks
	digests       []byte // DigestWidth bytes per page id
	TotalPages    int64  // pages over all requests
	DistinctPages int    // page ids that occur
	MaxPages      int    // largest request, in pages
	SpanMs        int64  // arrival of the last request
}

// NumPageIDs is the size of the page id space (Blocks * PagesPerBlock).
func (w *Workload) NumPageIDs() int { return w.Blocks * w.PagesPerBlock }

// Digest returns the digest of page id p.
func (w *Workload) Digest(p uint32) []byte {
	return w.digests[int(p)*DigestWidth : (int(p)+1)*DigestWidth]
}

// AppendDigests appends the digests of pages to dst.
func (w *Workload) AppendDigests(dst []byte, pages []uint32) []byte {
	for _, p := range pages {
		dst = append(dst, w.Digest(p)...)
	}
	return dst
}

// UnboundedHitRatio is the page hit ratio of a cache that never evicts
// (leading-run hits per request, the replay's semantics).
func (w *Workload) UnboundedHitRatio() float64 {
	seen := make([]bool, w.NumPageIDs())
	var hits int64
	for _, r := range w.Requests {
		h := 0
		for h < len(r.Pages) && seen[r.Pages[h]] {
			h++
		}
		hits += int64(h)
		for _, p := range r.Pages {
			seen[p] = true
		}
	}
	return ratio(hits, w.TotalPages)
}

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

type rawRequest struct {
	Timestamp    *int64   `json:"timestamp"`
	InputLength  *int     `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
	// Optional retention hints of a trace line (RequestMeta; the Mooncake
	// trace has none): --hints sends them.
	Session    *int    `json:"session"`
	SessionEnd bool    `json:"session_end"`
	RetainSec  float64 `json:"retain_s"`
	Priority   int     `json:"priority"`
	trace      int
	line       int
	meta       RequestMeta
}

// LoadOptions shape the expansion of traces into pages.
type LoadOptions struct {
	PageTokens  int // default 16
	BlockTokens int // default 512 (the Mooncake trace's)
	Limit       int // keep the first Limit requests of the merged trace (0: all)
}

// Load reads JSON Lines traces (the Mooncake format: timestamp in ms,
// input_length, output_length, hash_ids), merges them by timestamp (a
// stable sort: ties keep file order, then line order), keeps the first
// Limit requests and expands them into pages. The ids of different files
// never share blocks.
func Load(files []string, o LoadOptions) (*Workload, error) {
	if len(files) == 0 {
		return nil, errors.New("no trace: give --trace FILE (e.g. ../shared/traces/conversation_trace.jsonl)")
	}
	if err := o.check(); err != nil {
		return nil, err
	}
	var raw []rawRequest
	for i, f := range files {
		rs, err := readTrace(f, i)
		if err != nil {
			return nil, err
		}
		raw = append(raw, rs...)
	}
	if len(files) > 1 {
		slices.SortStableFunc(raw, func(a, b rawRequest) int {
			switch {
			case *a.Timestamp < *b.Timestamp:
				return -1
			case *a.Timestamp > *b.Timestamp:
				return 1
			}
			return 0
		})
	}
	return expand(raw, files, o)
}

// Generate builds the agentic workload (Agentic) as Load builds a trace's;
// its Files name it.
func Generate(c AgenticConfig, o LoadOptions) (*Workload, error) {
	c.defaults()
	if o.BlockTokens != 0 && o.BlockTokens != genBlockTokens {
		return nil, fmt.Errorf("the generated workload has %d-token blocks, not %d", genBlockTokens, o.BlockTokens)
	}
	if err := o.check(); err != nil {
		return nil, err
	}
	return expand(Agentic(c), []string{c.String()}, o)
}

func (o *LoadOptions) check() error {
	if o.PageTokens <= 0 {
		o.PageTokens = 16
	}
	if o.BlockTokens <= 0 {
		o.BlockTokens = 512
	}
	if o.BlockTokens%o.PageTokens != 0 {
		return fmt.Errorf("page tokens %d do not divide the trace's %d-token blocks", o.PageTokens, o.BlockTokens)
	}
	return nil
}

// expand keeps the first o.Limit requests of raw (in arrival order) and
// expands them into pages.
func expand(raw []rawRequest, files []string, o LoadOptions) (*Workload, error) {
	if o.Limit > 0 && o.Limit < len(raw) {
		raw = raw[:o.Limit]
	}
	if len(raw) == 0 {
		return nil, errors.New("the trace has no requests")
	}
	w := &Workload{Files: files, PageTokens: o.PageTokens, BlockTokens: o.BlockTokens, PagesPerBlock: o.BlockTokens / o.PageTokens}
	ppb := w.PagesPerBlock
	type key struct {
		parent int64 // parent block, or -1-trace for the root
		id     uint64
	}
	blocks := map[key]uint32{}
	var d [DigestWidth]byte
	var buf []byte
	t0 := *raw[0].Timestamp
	for _, r := range raw {
		t0 = min(t0, *r.Timestamp)
	}
	w.Requests = make([]Request, len(raw))
	for i, r := range raw {
		n := min(len(r.HashIDs)*ppb, *r.InputLength/o.PageTokens)
		req := Request{ArrivalMs: *r.Timestamp - t0, InputTokens: *r.InputLength, OutputTokens: r.OutputLength, Trace: r.trace, Pages: make([]uint32, 0, n), RequestMeta: r.meta}
		parent := int64(-1 - r.trace)
		for _, id := range r.HashIDs {
			if len(req.Pages) >= n {
				break
			}
			k := key{parent, id}
			b, ok := blocks[k]
			if !ok {
				b = uint32(len(blocks))
				if int(b)+1 > (1<<32-1)/ppb {
					return nil, errors.New("too many distinct blocks for 32-bit page ids")
				}
				blocks[k] = b
				// Chain from the parent's last page (or the trace's seed).
				if parent < 0 {
					d = sha256.Sum256(fmt.Appendf(nil, "ringside-replay/trace/%d", r.trace))
				} else {
					copy(d[:], w.digests[(int(parent)*ppb+ppb-1)*DigestWidth:])
				}
				for j := 0; j < ppb; j++ {
					buf = append(buf[:0], d[:]...)
					buf = binary.LittleEndian.AppendUint64(buf, id)
					buf = binary.LittleEndian.AppendUint32(buf, uint32(j))
					d = sha256.Sum256(buf)
					w.digests = append(w.digests, d[:]...)
				}
			}
			for j := 0; j < ppb && len(req.Pages) < n; j++ {
				req.Pages = append(req.Pages, b*uint32(ppb)+uint32(j))
			}
			parent = int64(b)
		}
		w.TotalPages += int64(len(req.Pages))
		w.MaxPages = max(w.MaxPages, len(req.Pages))
		w.SpanMs = max(w.SpanMs, req.ArrivalMs)
		w.Requests[i] = req
	}
	w.Blocks = len(blocks)
	for p := 0; p < w.NumPageIDs(); p++ {
		alignDigest(w.digests[p*DigestWidth:(p+1)*DigestWidth], uint32(p))
	}
	seen := make([]bool, w.NumPageIDs())
	for _, r := range w.Requests {
		for _, p := range r.Pages {
			if !seen[p] {
				seen[p] = true
				w.DistinctPages++
			}
		}
	}
	return w, nil
}

// replayNamespace is the namespace id the replay's engines get in a fresh
// sidecar: the first, and only, one (the attach probe uses the same
// namespace key).
const replayNamespace cache.NamespaceID = 1

// alignDigest sets the first word of page p's digest (the rest stays the
// sha256 chain's) so that the sidecar's MQP history key of the digest in
// the replay's namespace is p: the very value the offline MQP (MQPPages)
// hashes for page id p in namespace 0. The tip table's and the sampler's
// buckets, fingerprints and collisions are then the same on both sides,
// and --sequential --cache.policy mqp can be checked exactly. The word is
// p XOR a mix of the other words: digests stay distinct and look random.
func alignDigest(d []byte, p uint32) {
	binary.LittleEndian.PutUint64(d, 0)
	binary.LittleEndian.PutUint64(d, uint64(p)^cache.MQPHistoryKey(replayNamespace, d))
}

func readTrace(path string, idx int) ([]rawRequest, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	var out []rawRequest
	br := bufio.NewReaderSize(f, 1<<20)
	for line := 1; ; line++ {
		b, err := br.ReadBytes('\n')
		if len(b) > 0 {
			b = trimSpace(b)
		}
		if len(b) > 0 {
			var r rawRequest
			if jerr := json.Unmarshal(b, &r); jerr != nil {
				return nil, fmt.Errorf("%s:%d: %v", path, line, jerr)
			}
			if r.Timestamp == nil || r.InputLength == nil || r.HashIDs == nil {
				return nil, fmt.Errorf("%s:%d: want timestamp, input_length and hash_ids", path, line)
			}
			if *r.InputLength < 0 || *r.Timestamp < 0 {
				return nil, fmt.Errorf("%s:%d: negative timestamp or input_length", path, line)
			}
			if r.RetainSec < 0 || r.Priority < -1 || r.Priority > 3 {
				return nil, fmt.Errorf("%s:%d: retain_s must not be negative, priority in -1..3", path, line)
			}
			r.trace, r.line = idx, line
			r.meta = RequestMeta{Session: -1, SessionEnd: r.SessionEnd, RetainSec: r.RetainSec, Priority: r.Priority}
			if r.Session != nil {
				r.meta.Session = *r.Session
			}
			out = append(out, r)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("trace %s: %w", path, err)
		}
	}
	return out, nil
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r' || b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	return b
}
