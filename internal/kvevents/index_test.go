package kvevents

import "testing"

// The captured vLLM stream applied to an Index: the CPU tier holds what
// the stream's CPU stores and removals leave, and a prompt's prefix (the
// first GPU event's chain) is answered per tier.
func TestIndexOfTheCapturedStream(t *testing.T) {
	cs, vb := loadCapture(t)
	x := NewIndex()
	want := map[string]map[uint64]bool{}
	for i, c := range cs {
		m, err := DecodeFrames(frames(c))
		if err != nil {
			t.Fatal(err)
		}
		for j := range m.Batch.Events {
			x.Apply(&m.Batch.Events[j])
		}
		for _, e := range vb[i].Events { // the same from vLLM's decoding
			tier := "gpu"
			if md, _ := e["medium"].(string); md == "CPU" {
				tier = "cpu"
			}
			if want[tier] == nil {
				want[tier] = map[uint64]bool{}
			}
			hs, _ := e["block_hashes"].([]any)
			for _, h := range hs {
				if e["type"] == BlockStored {
					want[tier][u64(h)] = true
				} else {
					delete(want[tier], u64(h))
				}
			}
		}
	}
	for tier, w := range want {
		if x.Len(tier) != len(w) {
			t.Fatalf("%s: %d blocks, want %d", tier, x.Len(tier), len(w))
		}
		for h := range w {
			if !x.Has(tier, h) {
				t.Fatalf("%s: %#x missing", tier, h)
			}
		}
	}
	m, _ := DecodeFrames(frames(cs[0]))
	chain := m.Batch.Events[0].BlockHashes
	got := x.Prefix(append(append([]uint64(nil), chain...), 12345))
	n := 0
	for _, h := range chain {
		if !want["cpu"][h] {
			break
		}
		n++
	}
	if got["gpu"] != len(chain) || got["cpu"] != n {
		t.Fatalf("prefix %v, want gpu %d cpu %d", got, len(chain), n)
	}
	x.Apply(&Event{Type: AllBlocksCleared})
	if len(x.Tiers()) != 0 {
		t.Fatal("AllBlocksCleared left blocks")
	}
}
