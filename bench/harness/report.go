package harness

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// JSONLines writes rows as JSON Lines, one object a line.
func JSONLines[T any](w io.Writer, rows []T) error {
	enc := json.NewEncoder(w)
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return nil
}

// Verdicts prints a run's verdicts (its Targets' lines, and notes), one a
// line: after the table on out, or, when the rows went out as JSON Lines, on
// log (and nowhere when quiet), so that stdout stays machine-readable.
func Verdicts(out, log io.Writer, jsonRows, quiet bool, verdicts []string) {
	w := out
	if jsonRows {
		if quiet {
			return
		}
		w = log
	}
	for _, v := range verdicts {
		fmt.Fprintln(w, v)
	}
}

// Median is the upper median of v (v[n/2] of it sorted), 0 when empty;
// v is not changed.
func Median(v []int64) int64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// Rank is the nearest-rank q-th percentile (the ceil(q*n/100)-th smallest)
// of sorted v, 0 when empty; the Python peers compute it the same way.
func Rank(sorted []int64, q int) int64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	k := (q*n + 99) / 100
	k = min(n, max(1, k))
	return sorted[k-1]
}

// LoadAvg is /proc/loadavg's first three fields (the machine's business
// besides the benchmark's), or "?".
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "?"
}
