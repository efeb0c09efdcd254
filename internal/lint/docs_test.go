package lint

import (
	"bufio"
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// mdFile is one Markdown file of the repository, read once.
type mdFile struct {
	path    string   // slash-separated, relative to the repository root
	lines   []string // the file's lines
	prose   []bool   // prose[i]: line i is outside a fenced code block
	anchors map[string]bool
}

// mdFiles reads every Markdown file of the repository, skipping hidden
// directories (.git, the virtual environments, .tools) and vendor.
func mdFiles(t *testing.T) map[string]*mdFile {
	t.Helper()
	out := map[string]*mdFile{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != root && (strings.HasPrefix(name, ".") || name == "vendor" || name == "node_modules" || name == "dist") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".md") {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		f, err := readMD(p)
		if err != nil {
			return err
		}
		f.path = filepath.ToSlash(rel)
		out[f.path] = f
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var (
	headingRe  = regexp.MustCompile(`^(#{1,6})\s+(.*?)\s*#*\s*$`)
	htmlAnchor = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
	fenceRe    = regexp.MustCompile("^\\s*(```|~~~)")
)

func readMD(p string) (*mdFile, error) {
	fh, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	f := &mdFile{anchors: map[string]bool{}}
	seen := map[string]int{}
	sc := bufio.NewScanner(fh)
	sc.Buffer(make([]byte, 1<<20), 1<<22)
	inFence := false
	for sc.Scan() {
		line := sc.Text()
		fence := fenceRe.MatchString(line)
		if fence {
			inFence = !inFence
		}
		f.lines = append(f.lines, line)
		f.prose = append(f.prose, !inFence && !fence)
		if inFence || fence {
			continue
		}
		if m := headingRe.FindStringSubmatch(line); m != nil {
			s := slug(m[2])
			if n := seen[s]; n > 0 {
				f.anchors[fmt.Sprintf("%s-%d", s, n)] = true
			} else {
				f.anchors[s] = true
			}
			seen[s]++
		}
		for _, m := range htmlAnchor.FindAllStringSubmatch(line, -1) {
			f.anchors[m[1]] = true
		}
	}
	return f, sc.Err()
}

// slug is GitHub's anchor for a heading: lower case, letters, digits,
// spaces, hyphens and underscores kept (spaces become hyphens), the rest
// (punctuation, backticks, emphasis marks) dropped.
func slug(h string) string {
	h = mdLinkRe.ReplaceAllString(h, "$1") // a link in a heading keeps its text
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

var (
	mdLinkRe   = regexp.MustCompile(`\[([^\]]*)\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeSpanRe = regexp.MustCompile("`[^`]*`")
)

// TestDocLinks: every relative link in the repository's Markdown names a
// file that exists and, with a #fragment, a heading (or an <a id>) of that
// file, as GitHub renders them. A page renamed or a heading reworded
// breaks the links into it; this test names each.
func TestDocLinks(t *testing.T) {
	files := mdFiles(t)
	for _, f := range files {
		for i, line := range f.lines {
			if !f.prose[i] {
				continue
			}
			for _, m := range mdLinkRe.FindAllStringSubmatch(codeSpanRe.ReplaceAllString(line, ""), -1) {
				target := m[2]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				file, frag, _ := strings.Cut(target, "#")
				dest := f
				if file != "" {
					p := filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(f.path), file)))
					if strings.HasPrefix(p, "../") {
						t.Errorf("%s:%d: link %q leaves the repository", f.path, i+1, target)
						continue
					}
					if _, err := os.Stat(filepath.Join(root, p)); err != nil {
						t.Errorf("%s:%d: link %q: %s does not exist", f.path, i+1, target, p)
						continue
					}
					dest = files[p]
				}
				if frag == "" {
					continue
				}
				if dest == nil {
					t.Errorf("%s:%d: link %q: a #fragment into a file that is not Markdown", f.path, i+1, target)
					continue
				}
				if !dest.anchors[frag] {
					t.Errorf("%s:%d: link %q: %s has no heading with anchor #%s", f.path, i+1, target, dest.path, frag)
				}
			}
		}
	}
}

// The product's documentation speaks of the product: no issue or session
// numbers of its own development, no paths outside the repository, which a
// user does not have. (A change of another project cited as a source, such
// as "vLLM PR #46865", names that project and is allowed.)
var docRules = []struct {
	re  *regexp.Regexp
	why string
}{
	{regexp.MustCompile(`\.\./shared\b`), "a path outside the repository"},
	{regexp.MustCompile(`(?i)(?:^|[^-\w./])issues? #?\d+\b`), "an issue number of the project's development (cite another project's change as `PROJECT PR #N`)"},
	{regexp.MustCompile(`(?i)^#+ .*\bsession \d+\b`), "a heading naming a development session"},
	{regexp.MustCompile(`(?i)\bsession 20\d\d-\d\d`), "a development session's date"},
}

// productDocs are the Markdown files a user reads (the repository's, bar
// none); CHANGELOG.md may name versions but follows the same rules.
func TestDocsSpeakOfTheProduct(t *testing.T) {
	for _, f := range mdFiles(t) {
		for i, line := range f.lines {
			for _, r := range docRules {
				if loc := r.re.FindStringIndex(line); loc != nil {
					t.Errorf("%s:%d: %s: %q", f.path, i+1, r.why, line[loc[0]:loc[1]])
				}
			}
		}
	}
}

// TestReadmeIsShort: the README is the five-minute page (what ringside is,
// the picture, set-up and `make demo`, what works where, the headline
// figures, links); everything else lives in docs/ and is linked.
func TestReadmeIsShort(t *testing.T) {
	f, err := readMD(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(f.lines); n > 160 {
		t.Errorf("README.md has %d lines; keep it at most 160 and move detail to a page under docs/ that it links", n)
	}
}

func TestSlug(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"The cache (`sidecar/cache`)", "the-cache-sidecarcache"},
		{"KV cache groups (vLLM's hybrid memory allocator)", "kv-cache-groups-vllms-hybrid-memory-allocator"},
		{"5.5.1 Region kinds, and what the host copy backend needs", "551-region-kinds-and-what-the-host-copy-backend-needs"},
		{"Changelog of protocol versions", "changelog-of-protocol-versions"},
		{"How an engine drives it — without waiting", "how-an-engine-drives-it--without-waiting"},
		{"A [link](x.md) in a heading", "a-link-in-a-heading"},
	} {
		if got := slug(c.in); got != c.want {
			t.Errorf("slug(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestSVGsParse: the diagrams under docs/img are committed sources (SVG,
// edited as text); each must be well-formed XML so that it renders.
func TestSVGsParse(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join(root, "docs", "img", "*.svg"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		d := xml.NewDecoder(bytes.NewReader(data))
		for {
			_, err := d.Token()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Errorf("%s: %v", p, err)
				break
			}
		}
	}
}
