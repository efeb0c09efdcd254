package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	sigsyaml "sigs.k8s.io/yaml"
)

// errDecode marks a strict-decoding failure (as opposed to a render error).
var errDecode = errors.New("strict decoding failed")

// scheme knows every kind the manifests may contain; anything else fails to
// decode, so a new kind must be added here (and checked) deliberately.
func newDecoder() runtime.Decoder {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, resourcev1.AddToScheme, monitoringv1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	// Strict: unknown fields, fields whose case differs from the API's and
	// duplicate keys are errors (sigs.k8s.io/yaml.UnmarshalStrict would let
	// a mis-cased field through, since encoding/json matches names
	// case-insensitively).
	return kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, s, s,
		kjson.SerializerOptions{Yaml: true, Strict: true})
}

// kustomizeMu serializes builds: kustomize's kyaml initialises its global
// OpenAPI schema lazily without a lock (a data race the race detector
// reports when two parallel subtests build at once).
var kustomizeMu sync.Mutex

// render builds one kustomization directory in-process (no kustomize or
// kubectl binary, no network) and returns its YAML stream.
func render(dir string) ([]byte, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	kustomizeMu.Lock()
	defer kustomizeMu.Unlock()
	fs := &dupCheckFS{FileSystem: filesys.MakeFsOnDisk()}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fs, abs)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	if len(fs.errs) > 0 {
		return nil, fmt.Errorf("%w: %v", errDecode, errors.Join(fs.errs...))
	}
	return m.AsYaml()
}

// dupCheckFS checks every YAML file kustomize reads (kustomizations,
// resources, patches) for duplicate keys: kustomize's own parser accepts
// them and keeps one value silently, so the rendered output could not show
// them to the strict decoder any more.
type dupCheckFS struct {
	filesys.FileSystem
	errs []error
}

func (f *dupCheckFS) ReadFile(name string) ([]byte, error) {
	data, err := f.FileSystem.ReadFile(name)
	if err != nil || (!strings.HasSuffix(name, ".yaml") && !strings.HasSuffix(name, ".yml")) {
		return data, err
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, rerr := r.Read()
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr == nil {
			_, rerr = sigsyaml.YAMLToJSONStrict(doc)
		}
		if rerr != nil {
			f.errs = append(f.errs, fmt.Errorf("%s: %v", name, rerr))
			break
		}
	}
	return data, nil
}

// decodeStream strictly decodes every document of a YAML stream.
func decodeStream(data []byte) ([]runtime.Object, error) {
	dec := newDecoder()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []runtime.Object
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%w: document %d: %v", errDecode, i, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 || string(bytes.TrimSpace(doc)) == "---" {
			continue
		}
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			what := "?"
			if gvk != nil {
				what = gvk.Kind
			}
			return nil, fmt.Errorf("%w: document %d (%s): %v", errDecode, i, what, err)
		}
		objs = append(objs, obj)
	}
}

// renderAndDecode renders dirs and decodes everything they produce.
func renderAndDecode(dirs ...string) ([]runtime.Object, error) {
	var all []runtime.Object
	for _, d := range dirs {
		y, err := render(d)
		if err != nil {
			return nil, err
		}
		objs, err := decodeStream(y)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d, err)
		}
		all = append(all, objs...)
	}
	return all, nil
}
