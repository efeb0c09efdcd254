package harness

import (
	"fmt"
	"strconv"
	"strings"
)

// Cmp is how a measured value must compare with a Target's bound.
type Cmp string

// The comparisons a target can state; Statement is a target that holds or
// not, with no bound ("hit rate equal to the offline LRU").
const (
	AtMost    Cmp = "<="
	Below     Cmp = "<"
	AtLeast   Cmp = ">="
	Above     Cmp = ">"
	Statement Cmp = ""
)

// Target is one design target a benchmark reads its rows against, declared
// once as data beside the benchmark (its targets.go) and rendered into a
// verdict line here: "target What Cmp Bound Unit (Where): met (detail)".
// Verdicts report; they never fail a run.
type Target struct {
	What  string  // the measured quantity: "Go->Go ring p50"
	Cmp   Cmp     // how the value compares with Bound
	Bound float64 // in Unit
	// Unit follows the bound: "µs", "x the ceiling". One starting with "x"
	// or "%" joins the number ("2x", "25%"); any other takes a space.
	Unit  string
	Where string // the conditions, printed in parentheses: "16 B, spin"
}

// At returns t with where added to its conditions.
func (t Target) At(where string) Target {
	if t.Where == "" {
		t.Where = where
	} else if where != "" {
		t.Where += ", " + where
	}
	return t
}

// String is the target as the verdicts state it: "Go->Go ring p50 <= 0.5 µs
// (16 B, spin)".
func (t Target) String() string {
	s := t.What
	if t.Cmp != Statement {
		b := strconv.FormatFloat(t.Bound, 'f', -1, 64)
		sep := " "
		if t.Unit == "" || strings.HasPrefix(t.Unit, "x") || strings.HasPrefix(t.Unit, "%") {
			sep = ""
		}
		s += " " + string(t.Cmp) + " " + b + sep + t.Unit
	}
	if t.Where != "" {
		s += " (" + t.Where + ")"
	}
	return s
}

// Met reports whether v, in the target's unit, meets the bound.
func (t Target) Met(v float64) bool {
	switch t.Cmp {
	case AtMost:
		return v <= t.Bound
	case Below:
		return v < t.Bound
	case AtLeast:
		return v >= t.Bound
	case Above:
		return v > t.Bound
	}
	panic(fmt.Sprintf("harness: target %q has no bound to compare with", t.What))
}

// Verdict is the line for value v (in the target's unit); detail, when not
// empty, follows in parentheses (the measured numbers).
func (t Target) Verdict(v float64, detail string) string { return t.Holds(t.Met(v), detail) }

// Holds is the line for a target judged by the caller: a Statement, or a
// bound checked on values the caller compares itself.
func (t Target) Holds(ok bool, detail string) string {
	word := "MISSED"
	if ok {
		word = "met"
	}
	return t.line(word, detail)
}

// NotMeasured is the line for a target whose rows the run lacks; why, when
// not empty, follows in parentheses.
func (t Target) NotMeasured(why string) string { return t.line("not measured", why) }

func (t Target) line(word, detail string) string {
	s := "target " + t.String() + ": " + word
	if detail != "" {
		s += " (" + detail + ")"
	}
	return s
}
