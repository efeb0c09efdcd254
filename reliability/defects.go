package reliability

import (
	"fmt"
	"sort"
	"strings"
	"sync"
)

// Defect is one defect found by an attack on the sidecar, with the test
// that reproduces it and what that test reported on the code before the
// fix (the test was committed first, so the history shows it failing).
type Defect struct {
	Issue  int    // the issue that listed it (orders the report; not printed)
	Point  int    // its number in that issue (orders the report; not printed)
	Title  string // one line: what was wrong
	Tests  string // test names, comma-separated
	Before string // the failure the test reported before the fix (commit and output)
	Fix    string // the fix, in a few words (empty until it is fixed)
}

var (
	defectsMu sync.Mutex
	defects   []Defect
)

// defect registers a Defect; call it from an init function of the file
// that holds the test.
func defect(d Defect) {
	defectsMu.Lock()
	defects = append(defects, d)
	defectsMu.Unlock()
}

// defectSection renders the registered defects, ordered by issue and point.
func defectSection() string {
	defectsMu.Lock()
	ds := append([]Defect(nil), defects...)
	defectsMu.Unlock()
	if len(ds) == 0 {
		return ""
	}
	sort.Slice(ds, func(i, j int) bool {
		if ds[i].Issue != ds[j].Issue {
			return ds[i].Issue < ds[j].Issue
		}
		return ds[i].Point < ds[j].Point
	})
	var b strings.Builder
	b.WriteString("\n## Defects found by attack, and the tests that reproduce them\n\n")
	b.WriteString("Each test was committed before its fix; \"before the fix\" is what it reported on that commit.\n\n")
	b.WriteString("| defect | tests | before the fix | fix |\n|---|---|---|---|\n")
	for _, d := range ds {
		var tests []string
		for _, t := range strings.Split(d.Tests, ",") {
			if t = strings.TrimSpace(t); t != "" {
				tests = append(tests, "`"+t+"`")
			}
		}
		fix := d.Fix
		if fix == "" {
			fix = "not fixed yet"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", cell(d.Title), strings.Join(tests, ", "), cell(d.Before), cell(fix))
	}
	return b.String()
}
