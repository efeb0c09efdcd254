package replay_test

import (
	"testing"
)

// TestBenchReplayHints replays testdata/hints.jsonl, a hand-made trace of
// 512-token pages (one page per block) with retention hints, through a
// 16-page sidecar without and with --hints, under each policy:
//
//  1. session 0 asks for blocks 1-4, hint: keep 600 s at priority 1;
//     2-6. five one-off requests of 4 new blocks (priority -1, session ends);
//  7. session 0 asks for 1-5 and ends;
//  8. one more one-off of 4 new blocks;
//  9. a new session asks for 1-5.
//
// Without hints the 20 one-off pages flush blocks 1-4 (request 7 hits
// nothing) and request 9 hits all 5: 5 hits, the model's. With hints
// request 7 hits the 4 retained blocks, its session end makes them the
// first to go, request 8 evicts them, and request 9 hits nothing: 4
// hits. The one-offs (priority -1) send nothing, not even their session
// ends: one retain of 4 blocks, one end of 4 retentions.
//
// Under MQP2 a retention is evidence, not an order above every other
// block: it lifts blocks 1-4 one level (count 2) for one lifetime (before
// one is measured, one pass of the pool: 16 placements), which the flood
// of 20 one-off pages through 16 slots does not outlast at the level
// below, so the outcome is LRU's: 4 hits and one end of 4 retentions.
// (That the hints never cost hits on real workloads is measured by the
// replay's tables, docs/benchmarks.md; here the session's end is wrong
// on purpose: a new session reads its blocks.)
func TestBenchReplayHints(t *testing.T) {
	if testing.Short() {
		t.Skip("starts sidecars")
	}
	want := map[string][2]float64{"lru": {4, 4}, "mqp": {4, 4}, "mqp2": {4, 4}} // hit pages and ended retentions with hints
	for _, policy := range []string{"lru", "mqp", "mqp2"} {
		w := want[policy]
		rows := replayJSON(t, "--sequential", "--cache.policy", policy, "--hints", "--trace", "testdata/hints.jsonl",
			"--page-tokens", "512", "--capacity-pages", "16")
		got := map[string]map[string]any{}
		for _, row := range rows {
			if row["bench"] == "replay" {
				got[row["transport"].(string)] = row
			}
			if row["bench"] == "replay_policy" {
				if v, ok := row["live_hints_hit_ratio"].(float64); !ok || v != w[0]/38 {
					t.Errorf("%s: live_hints_hit_ratio %v, want %v/38: %v", policy, row["live_hints_hit_ratio"], w[0], row)
				}
			}
		}
		plain, hinted := got["ring"], got["ring+hints"]
		if plain == nil || hinted == nil {
			t.Fatalf("%s: want rows ring and ring+hints, got %v", policy, got)
		}
		if num(plain, "hit_pages") != 5 || num(plain, "oracle_hit_pages") != 5 || plain["hints"] != false || num(plain, "retains") != 0 {
			t.Errorf("%s without hints: %v", policy, plain)
		}
		if num(hinted, "hit_pages") != w[0] || hinted["hints"] != true {
			t.Errorf("%s with hints: %v hit pages, want %v (the hints did not change the eviction order as they should): %v", policy, hinted["hit_pages"], w[0], hinted)
		}
		if num(hinted, "retains") != 1 || num(hinted, "retained_pages") != 4 || num(hinted, "ends") != 1 || num(hinted, "ended_pages") != w[1] {
			t.Errorf("%s with hints: want 1 retain of 4 blocks and 1 end of %v retentions: %v", policy, w[1], hinted)
		}
	}
}
