package scenario

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// The drivers must send the same bytes: these values are pinned here and
// in connector/python/tests/test_scenarios.py (test_deterministic_data).
func TestDeterministicData(t *testing.T) {
	r := &runner{names: map[string]string{}, chains: map[string][][32]byte{}}
	d, err := r.digests("p#0,p#299", 32)
	if err != nil {
		t.Fatal(err)
	}
	if got := hex.EncodeToString(d[:32]); got != "d3c226bfb1ac95e23c678396c52fdd83071367264bc0d7790e603838eb020f0c" {
		t.Errorf("p#0 = %s", got)
	}
	if got := hex.EncodeToString(d[32:40]); got != "5181c2c785d41e9e" {
		t.Errorf("p#299 starts %s", got)
	}
	if n := r.names[string(d[32:])]; n != "p#299" {
		t.Errorf("p#299 is named %q", n)
	}
	w8, err := r.digests("p#299", 8)
	if err != nil || !slices.Equal(w8, d[32:40]) || r.names[string(w8)] != "p#299" {
		t.Errorf("width 8: %x %v %q", w8, err, r.names[string(w8)])
	}
	c := Content("kv", 3, 70)
	if h := sha256.Sum256(c); hex.EncodeToString(h[:]) != "5ab27d17b40c3b491391f2b9e683d3daeff4e9885bde4676a45c4fdee9fa215a" {
		t.Errorf("content kv#3 of 70 bytes hashes to %x", h)
	}
}

func TestLists(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want []uint32
		ok   bool
	}{
		{"", nil, true}, {"0-2,7", []uint32{0, 1, 2, 7}, true}, {"7,6", []uint32{7, 6}, true},
		{"3-1", nil, false}, {"a", nil, false}, {"1,", nil, false}, {"-1", nil, false},
	} {
		got, err := PageList(tc.spec)
		if (err == nil) != tc.ok || !slices.Equal(got, tc.want) {
			t.Errorf("PageList(%q) = %v, %v", tc.spec, got, err)
		}
	}
	r := &runner{names: map[string]string{}, chains: map[string][][32]byte{}}
	for _, bad := range []string{"p", "#1", "p#", "p#2-1", "p#x", "p#0,"} {
		if _, err := r.digests(bad, 32); err == nil {
			t.Errorf("digest list %q accepted", bad)
		}
	}
	if d, err := r.digests("a-b#1-2,c#0", 16); err != nil || len(d) != 48 || r.names[string(d[16:32])] != "a-b#2" {
		t.Errorf("a-b#1-2,c#0: %d bytes, %v", len(d), err)
	}
}

func TestDriversDirective(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		text string
		want []string
		ok   bool
	}{
		{"# a comment\n\nattach s=a\n----\nok\n", []string{Pure, Go, Python}, true},
		{"# a comment\n# drivers: pure, go\n\nattach s=a\n", []string{Pure, Go}, true},
		{"# drivers: pure\n", []string{Pure}, true},
		{"attach s=a\n----\nok\n\n# drivers: pure\n", []string{Pure, Go, Python}, true}, // after the first command: a comment
		{"# drivers: pure, rust\n", nil, false},
	} {
		got, err := Drivers(write("x.txt", tc.text))
		if (err == nil) != tc.ok || !slices.Equal(got, tc.want) {
			t.Errorf("%q: %v %v, want %v", tc.text, got, err, tc.want)
		}
	}
}

func TestNamesPrinted(t *testing.T) {
	r := &runner{names: map[string]string{}, chains: map[string][][32]byte{}}
	d, err := r.digests("p#0-3,q#1,p#5,p#7-8,p#4", 16)
	if err != nil {
		t.Fatal(err)
	}
	d = append(d, make([]byte, 16)...) // a digest no command sent
	if got := r.digestNames(d, 16); got != "p#0-3,q#1,p#5,p#7-8,p#4,unknown" {
		t.Errorf("digest names %q", got)
	}
	for _, tc := range []struct {
		pages []uint32
		want  string
	}{{nil, ""}, {[]uint32{3}, "3"}, {[]uint32{0, 1, 2, 7, 5, 6}, "0-2,7,5-6"}} {
		if got := pageSpec(tc.pages); got != tc.want {
			t.Errorf("pageSpec(%v) = %q, want %q", tc.pages, got, tc.want)
		}
		if back, err := PageList(pageSpec(tc.pages)); err != nil || !slices.Equal(back, tc.pages) && len(tc.pages) > 0 {
			t.Errorf("PageList(pageSpec(%v)) = %v %v", tc.pages, back, err)
		}
	}
}
