package deploy

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// The deployable directories. overlays/monitoring holds only the
// ServiceMonitor; it is checked together with the Service it selects.
var overlays = []struct {
	name string
	dirs []string
}{
	{"base", []string{"base"}},
	{"cpu", []string{"overlays/cpu"}},
	{"gpu", []string{"overlays/gpu"}},
	{"monitoring", []string{"overlays/monitoring", "base"}},
	{"l2", []string{"overlays/l2"}},
	{"node", []string{"overlays/node"}},
	{"node-daemonset", []string{"node"}},
}

func TestOverlays(t *testing.T) {
	for _, o := range overlays {
		t.Run(o.name, func(t *testing.T) {
			t.Parallel()
			objs, err := renderAndDecode(o.dirs...)
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range check(objs) {
				t.Errorf("%s", f)
			}
			kinds := map[string]int{}
			for _, obj := range objs {
				kinds[kindOf(obj)]++
			}
			if o.name == "node-daemonset" {
				if kinds["DaemonSet"] != 1 || len(kinds) != 1 {
					t.Errorf("want one DaemonSet, got %v", kinds)
				}
				return
			}
			if kinds["Deployment"] != 1 || kinds["Service"] != 1 {
				t.Errorf("want one Deployment and one Service, got %v", kinds)
			}
			d := deployment(t, objs)
			for _, ct := range allContainers(&d.Spec.Template.Spec) {
				if (o.name == "cpu" || o.name == "gpu" || o.name == "l2" || o.name == "node") && !strings.Contains(ct.Image, "/") {
					t.Errorf("container %q keeps the placeholder image %q: the overlay must map it", ct.Name, ct.Image)
				}
			}
			switch o.name {
			case "gpu":
				if kinds["ResourceClaimTemplate"] != 1 {
					t.Errorf("the gpu overlay defines no ResourceClaimTemplate: %v", kinds)
				}
				if len(d.Spec.Template.Spec.ResourceClaims) != 1 {
					t.Errorf("the gpu overlay's pod declares %d claims, want 1", len(d.Spec.Template.Spec.ResourceClaims))
				}
			case "monitoring":
				if kinds["ServiceMonitor"] != 1 {
					t.Errorf("the monitoring overlay renders no ServiceMonitor: %v", kinds)
				}
			case "l2":
				cfg, err := parseServe(&d.Spec.Template.Spec.InitContainers[0])
				if err != nil || cfg.L2 == nil || len(cfg.L2.Redis.Addrs) != 3 || cfg.L2.Redis.Mode != "cluster" ||
					cfg.L2.Redis.PasswordFile == "" || cfg.L2.Redis.TLSFiles == nil || cfg.CopyBackend != "host" {
					t.Errorf("the l2 overlay's sidecar should use a cluster over TLS with the password from a file (on the cpu overlay): %+v, %v", cfg.L2, err)
				}
			case "node":
				cfg, err := parseServe(&d.Spec.Template.Spec.InitContainers[0])
				if err != nil || cfg.L2 == nil || cfg.L2.Node == nil || cfg.L2.RedisOn() || cfg.L2.Node.Socket != "/run/ringside-node/node.sock" {
					t.Errorf("the node overlay's sidecar should attach to the node tier alone: %+v, %v", cfg.L2, err)
				}
			case "cpu":
				cfg, err := parseServe(&d.Spec.Template.Spec.InitContainers[0])
				if err != nil || cfg.CopyBackend != "host" {
					t.Errorf("the cpu overlay's sidecar should use the host copy backend: %q, %v", cfg.CopyBackend, err)
				}
				if err == nil && (cfg.Spin != 0 || cfg.Yield != 0) {
					t.Errorf("the cpu overlay's sidecar should park at once (ring.spin 0, ring.yield 0): %v, %v", cfg.Spin, cfg.Yield)
				}
			}
		})
	}
}

// kindOf names an object's kind by its Go type (decoded objects carry no
// TypeMeta).
func kindOf(obj runtime.Object) string { return reflect.TypeOf(obj).Elem().Name() }

func deployment(t *testing.T, objs []runtime.Object) *appsv1.Deployment {
	t.Helper()
	for _, obj := range objs {
		if d, ok := obj.(*appsv1.Deployment); ok {
			return d
		}
	}
	t.Fatal("no Deployment")
	return nil
}

// Each directory under testdata/broken is a kustomization that takes a
// valid overlay and breaks it in one way; its file `want` lists the rules
// that must fail, one a line, and no other rule may fail.
func TestBrokenManifests(t *testing.T) {
	cases := brokenCases(t)
	for _, name := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join("testdata", "broken", name)
			want := readWant(t, filepath.Join(dir, "want"))
			got := map[string]bool{}
			var msgs []string
			objs, err := renderAndDecode(dir)
			switch {
			case errors.Is(err, errDecode):
				got[ruleStrictDecode] = true
				msgs = append(msgs, err.Error())
			case err != nil:
				got[ruleRender] = true
				msgs = append(msgs, err.Error())
			default:
				for _, f := range check(objs) {
					got[f.rule] = true
					msgs = append(msgs, f.String())
				}
			}
			gotList := slices.Sorted(func(yield func(string) bool) {
				for r := range got {
					if !yield(r) {
						return
					}
				}
			})
			if !slices.Equal(gotList, want) {
				t.Errorf("failed rules %v, want %v; findings:\n  %s", gotList, want, strings.Join(msgs, "\n  "))
			} else {
				t.Logf("rejected as intended:\n  %s", strings.Join(msgs, "\n  "))
			}
		})
	}
}

func brokenCases(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join("testdata", "broken"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names
}

func readWant(t *testing.T, file string) []string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, l := range strings.Split(string(data), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if !slices.Contains(allRules, l) {
			t.Fatalf("%s: unknown rule %q", file, l)
		}
		want = append(want, l)
	}
	slices.Sort(want)
	if len(want) == 0 {
		t.Fatalf("%s names no rule", file)
	}
	return want
}

func TestEveryRuleHasABrokenCase(t *testing.T) {
	covered := map[string]bool{}
	for _, name := range brokenCases(t) {
		for _, r := range readWant(t, filepath.Join("testdata", "broken", name, "want")) {
			covered[r] = true
		}
	}
	for _, r := range allRules {
		if !covered[r] && r != ruleRender {
			t.Errorf("no case in testdata/broken breaks rule %q", r)
		}
	}
}

// Raw manifests the strict decoder must reject; the first line of each says
// what the error must contain: "# want: TEXT".
func TestStrictDecoderRejects(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "strict", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata/strict files: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			first, _, _ := strings.Cut(string(data), "\n")
			want, ok := strings.CutPrefix(first, "# want: ")
			if !ok {
				t.Fatalf("first line is not '# want: TEXT'")
			}
			_, err = decodeStream(data)
			if err == nil {
				t.Fatalf("decoded without error")
			}
			if !errors.Is(err, errDecode) || !strings.Contains(err.Error(), want) {
				t.Fatalf("error %q does not contain %q", err, want)
			}
		})
	}
}

// The image recipes: static non-root ringside image on the module's Go.
func TestDockerfiles(t *testing.T) {
	read := func(f string) string {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	df := read("Dockerfile")
	gomod := read(filepath.Join("..", "go.mod"))
	goVer := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(gomod)
	if goVer == nil || !strings.Contains(df, "ARG GO_VERSION="+goVer[1]) {
		t.Errorf("deploy/Dockerfile's GO_VERSION does not match go.mod's go %v", goVer)
	}
	for _, want := range []string{
		"CGO_ENABLED=0", "./cmd/ringside", "USER 65532:65532", `ENTRYPOINT ["/usr/local/bin/ringside"]`,
	} {
		if !strings.Contains(df, want) {
			t.Errorf("deploy/Dockerfile lacks %q", want)
		}
	}
	if _, err := os.Stat(filepath.Join("..", "cmd", "ringside")); err != nil {
		t.Errorf("deploy/Dockerfile builds ./cmd/ringside: %v", err)
	}
	for _, f := range []string{"Dockerfile.vllm", "Dockerfile.vllm-cpu"} {
		s := read(f)
		for _, want := range []string{"connector/python", "USER 1000:1000"} {
			if !strings.Contains(s, want) {
				t.Errorf("deploy/%s lacks %q", f, want)
			}
		}
	}
	if _, err := os.Stat(filepath.Join("..", "connector", "python", "pyproject.toml")); err != nil {
		t.Errorf("the vLLM images install ./connector/python: %v", err)
	}
}

// deploy/README.md names every rule and every ringside_* series the sidecar
// exports, so that neither drifts from the code.
func TestReadme(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range allRules {
		if !strings.Contains(string(readme), "`"+r+"`") {
			t.Errorf("deploy/README.md does not explain rule `%s`", r)
		}
	}
	src, err := os.ReadFile(filepath.Join("..", "sidecar", "metrics.go"))
	if err != nil {
		t.Fatal(err)
	}
	names := regexp.MustCompile(`"(ringside_[a-z_]+)"`).FindAllStringSubmatch(string(src), -1)
	if len(names) < 10 {
		t.Fatalf("found only %d metric names in sidecar/metrics.go", len(names))
	}
	for _, m := range names {
		if !strings.Contains(string(readme), m[1]) {
			t.Errorf("deploy/README.md does not list metric %s", m[1])
		}
	}
}
