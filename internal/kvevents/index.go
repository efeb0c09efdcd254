package kvevents

import "sort"

// Index is what one pod holds, per tier, as its events say: a block is in
// a tier from its BlockStored to its BlockRemoved in that tier (a repeated
// BlockStored changes nothing); AllBlocksCleared empties every tier, as
// llm-d does. Not safe for concurrent use.
type Index struct {
	tiers map[string]map[uint64]struct{}
}

// NewIndex returns an empty Index.
func NewIndex() *Index { return &Index{tiers: map[string]map[uint64]struct{}{}} }

// Apply applies one event.
func (x *Index) Apply(e *Event) {
	switch e.Type {
	case AllBlocksCleared:
		x.Clear()
	case BlockStored:
		t := x.tiers[e.Tier()]
		if t == nil {
			t = map[uint64]struct{}{}
			x.tiers[e.Tier()] = t
		}
		for _, h := range e.BlockHashes {
			t[h] = struct{}{}
		}
	case BlockRemoved:
		t := x.tiers[e.Tier()]
		for _, h := range e.BlockHashes {
			delete(t, h)
		}
	}
}

// Clear forgets every block (the publisher restarted, or cleared).
func (x *Index) Clear() { x.tiers = map[string]map[uint64]struct{}{} }

// Tiers lists the tiers that ever held a block, sorted.
func (x *Index) Tiers() []string {
	out := make([]string, 0, len(x.tiers))
	for t := range x.tiers {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

// Len is the number of blocks in tier.
func (x *Index) Len(tier string) int { return len(x.tiers[tier]) }

// Has reports whether tier holds block h.
func (x *Index) Has(tier string, h uint64) bool {
	_, ok := x.tiers[tier][h]
	return ok
}

// Prefix answers, for each tier, how many leading blocks of a prompt's
// block hashes the tier holds (a router's prefix match for that tier).
func (x *Index) Prefix(hashes []uint64) map[string]int {
	out := map[string]int{}
	for name, t := range x.tiers {
		n := 0
		for _, h := range hashes {
			if _, ok := t[h]; !ok {
				break
			}
			n++
		}
		out[name] = n
	}
	return out
}
