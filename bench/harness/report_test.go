package harness

import (
	"bytes"
	"regexp"
	"slices"
	"testing"
)

func TestJSONLines(t *testing.T) {
	type row struct {
		Bench string `json:"bench"`
		N     int    `json:"n"`
	}
	var b bytes.Buffer
	if err := JSONLines(&b, []row{{"ring", 1}, {"poll", 2}}); err != nil {
		t.Fatal(err)
	}
	if want := "{\"bench\":\"ring\",\"n\":1}\n{\"bench\":\"poll\",\"n\":2}\n"; b.String() != want {
		t.Errorf("got %q, want %q", b.String(), want)
	}
}

func TestVerdicts(t *testing.T) {
	vs := []string{"target a: met", "target b: MISSED"}
	tests := []struct {
		name            string
		json, quiet     bool
		wantOut, wantLg string
	}{
		{"table", false, false, "target a: met\ntarget b: MISSED\n", ""},
		{"table, quiet", false, true, "target a: met\ntarget b: MISSED\n", ""},
		{"json", true, false, "", "target a: met\ntarget b: MISSED\n"},
		{"json, quiet", true, true, "", ""},
	}
	for _, tt := range tests {
		var out, lg bytes.Buffer
		Verdicts(&out, &lg, tt.json, tt.quiet, vs)
		if out.String() != tt.wantOut || lg.String() != tt.wantLg {
			t.Errorf("%s: out %q log %q", tt.name, out.String(), lg.String())
		}
	}
}

func TestMedianRank(t *testing.T) {
	tests := []struct {
		v              []int64
		median, p50    int64
		p99, p100, p01 int64
	}{
		{nil, 0, 0, 0, 0, 0},
		{[]int64{7}, 7, 7, 7, 7, 7},
		{[]int64{4, 1, 3, 2}, 3, 2, 4, 4, 1}, // upper median; nearest rank 50 = 2nd smallest
		{[]int64{5, 1, 4, 2, 3}, 3, 3, 5, 5, 1},
	}
	for _, tt := range tests {
		in := append([]int64(nil), tt.v...)
		if got := Median(tt.v); got != tt.median {
			t.Errorf("Median(%v) = %d, want %d", tt.v, got, tt.median)
		}
		if !slices.Equal(in, tt.v) {
			t.Errorf("Median sorted its argument: %v", tt.v)
		}
		sorted := slices.Sorted(slices.Values(tt.v))
		for _, c := range []struct {
			q    int
			want int64
		}{{50, tt.p50}, {99, tt.p99}, {100, tt.p100}, {1, tt.p01}} {
			if got := Rank(sorted, c.q); got != c.want {
				t.Errorf("Rank(%v, %d) = %d, want %d", sorted, c.q, got, c.want)
			}
		}
	}
	// 1..1000: p99 is the 990th value.
	v := make([]int64, 1000)
	for i := range v {
		v[i] = int64(i + 1)
	}
	if got := Rank(v, 99); got != 990 {
		t.Errorf("p99 of 1..1000 = %d", got)
	}
}

func TestLoadAvg(t *testing.T) {
	if got := LoadAvg(); !regexp.MustCompile(`^(\d+\.\d+ \d+\.\d+ \d+\.\d+|\?)$`).MatchString(got) {
		t.Errorf("LoadAvg() = %q", got)
	}
}
