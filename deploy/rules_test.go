package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/ringside-kv/ringside/sidecar"
)

// The rules every rendered overlay must pass. Each one is broken on purpose
// by at least one case under testdata/broken (TestEveryRuleHasABrokenCase),
// and deploy/README.md explains each (TestReadmeNamesEveryRule).
const (
	ruleRender         = "render"                  // kustomize builds the directory
	ruleStrictDecode   = "strict-decode"           // every object decodes strictly
	ruleSidecarNative  = "sidecar-native"          // ringside is an init container with restartPolicy Always
	ruleStartupProbe   = "sidecar-startup-probe"   // and has a startup probe, which holds the engine back
	ruleEngineOrder    = "engine-after-sidecar"    // the engine is a regular container, started after the sidecar
	ruleSharedShm      = "shared-shm"              // one emptyDir, medium Memory, sizeLimit, at /dev/shm in both; --dir on it
	rulePIDNamespace   = "share-process-namespace" // shareProcessNamespace: true
	ruleHostIsolation  = "host-isolation"          // no hostIPC, hostPID, hostNetwork, hostPath, hostPort
	ruleSecurity       = "container-security"      // every container: no privileged, drop ALL, no added caps, no escalation, non-root
	ruleSameUser       = "same-uid"                // sidecar and engine: same explicit uid and gid
	ruleSeccomp        = "seccomp"                 // engine confined; sidecar not under a profile that blocks process_vm_*; never Unconfined
	ruleProbes         = "probes"                  // probes call the sidecar's --metrics.addr port at /healthz and /readyz
	ruleKVConfig       = "kv-transfer-config"      // the engine's --kv-transfer-config loads the connector on the sidecar's socket
	rulePoolSizing     = "pool-sizing"             // requests and the /dev/shm limit count the pool
	ruleSidecarFlags   = "sidecar-flags"           // the sidecar's args and env parse and validate with the real CLI
	rulePrometheus     = "prometheus"              // scrape annotations and a Service on the metrics port
	ruleServiceMonitor = "servicemonitor"          // the ServiceMonitor selects that Service and port
	ruleGPUClaim       = "gpu-claim"               // a GPU is shared through one DRA claim named by both containers
	ruleGPUBackend     = "gpu-backend"             // a sidecar given a GPU runs --copy.backend=cuda
	ruleGPURootFS      = "gpu-root-writable"       // a container given a GPU claim keeps a writable root: NVIDIA's CDI hooks write into it
	ruleL2Tier         = "l2-tier"                 // a shared tier: TLS, and its password and CA from a Secret, never a literal
	ruleNodeTier       = "node-tier"               // the node tier: its socket on a host directory only ringside mounts; its DaemonSet unprivileged, sized, probed
)

var allRules = []string{
	ruleRender, ruleStrictDecode, ruleSidecarNative, ruleStartupProbe, ruleEngineOrder,
	ruleSharedShm, rulePIDNamespace, ruleHostIsolation, ruleSecurity, ruleSameUser, ruleSeccomp, ruleProbes,
	ruleKVConfig, rulePoolSizing, ruleSidecarFlags, rulePrometheus, ruleServiceMonitor, ruleGPUClaim, ruleGPUBackend,
	ruleGPURootFS, ruleL2Tier, ruleNodeTier,
}

const (
	sidecarName = "ringside"
	engineName  = "vllm"
	shmPath     = "/dev/shm"

	// Sizing allowances (deploy/README.md, "Sizing"): ring pairs of this
	// many sessions (one engine's scheduler and worker ranks, with room),
	// the sidecar process itself, and its per-slot index.
	ringSessions    = 16
	sidecarOverhead = 64 << 20
	perSlotOverhead = 64

	connectorName   = "RingsideConnector"
	connectorModule = "ringside.vllm"
	// The connector's default socket when the extra config names none
	// (connector/python/ringside/plugin/config.py DEFAULT_SOCKET).
	connectorDefaultSocket = "/dev/shm/ringside/ringside.sock"
)

// The keys the vLLM connector reads from kv_connector_extra_config and the
// values it accepts, generated from its configuration
// (connector/python/ringside/plugin/config.py, `python -m
// ringside.plugin.config --deploy-keys`; a Python test fails when the file
// differs): a typo is an error, not a default.
const connectorKeysFile = "testdata/connector-keys.json"

type connectorKey struct {
	Type             string   `json:"type"` // string, number, integer, boolean, auto|boolean
	Minimum          *float64 `json:"minimum"`
	ExclusiveMinimum *float64 `json:"exclusiveMinimum"`
	Maximum          *float64 `json:"maximum"`
	Nullable         bool     `json:"nullable"`
}

var connectorKeys = sync.OnceValues(func() (map[string]connectorKey, error) {
	b, err := os.ReadFile(connectorKeysFile)
	if err != nil {
		return nil, err
	}
	keys := map[string]connectorKey{}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&keys); err != nil {
		return nil, fmt.Errorf("%s: %w", connectorKeysFile, err)
	}
	for k, v := range keys {
		switch v.Type {
		case "string", "number", "integer", "boolean", "auto|boolean":
		default:
			return nil, fmt.Errorf("%s: key %q has type %q, which the rule does not know", connectorKeysFile, k, v.Type)
		}
	}
	return keys, nil
})

// allowed says what a value of the key must be, as the connector says it.
func (k connectorKey) allowed() string {
	switch k.Type {
	case "string":
		return "a string"
	case "boolean":
		return "true or false"
	case "auto|boolean":
		return `"auto", true or false`
	}
	what := "a number"
	if k.Type == "integer" {
		what = "an integer"
	}
	if k.Minimum != nil {
		what += " >= " + strconv.FormatFloat(*k.Minimum, 'g', -1, 64)
	}
	if k.ExclusiveMinimum != nil {
		what += " > " + strconv.FormatFloat(*k.ExclusiveMinimum, 'g', -1, 64)
	}
	if k.Maximum != nil {
		what += " <= " + strconv.FormatFloat(*k.Maximum, 'g', -1, 64)
	}
	return what
}

// accepts mirrors the connector's conversion (config.py _convert): JSON
// values of the key's type, booleans also as 0/1 and true/false words,
// numbers also as numeric strings.
func (k connectorKey) accepts(v json.RawMessage) bool {
	if k.Nullable && string(bytes.TrimSpace(v)) == "null" {
		return true
	}
	var s string
	isStr := json.Unmarshal(v, &s) == nil
	switch k.Type {
	case "string":
		return isStr
	case "boolean", "auto|boolean":
		var b bool
		if json.Unmarshal(v, &b) == nil {
			return true
		}
		var n float64
		if json.Unmarshal(v, &n) == nil {
			return n == 0 || n == 1
		}
		w := strings.ToLower(strings.TrimSpace(s))
		return isStr && (slices.Contains([]string{"true", "yes", "on", "1", "false", "no", "off", "0"}, w) ||
			(k.Type == "auto|boolean" && w == "auto"))
	}
	var f float64
	if isStr {
		var err error
		if f, err = strconv.ParseFloat(strings.TrimSpace(s), 64); err != nil {
			return false
		}
	} else if json.Unmarshal(v, &f) != nil {
		return false
	}
	switch {
	case math.IsNaN(f) || math.IsInf(f, 0):
		return false
	case k.Type == "integer" && f != math.Trunc(f):
		return false
	case k.Minimum != nil && f < *k.Minimum:
		return false
	case k.ExclusiveMinimum != nil && f <= *k.ExclusiveMinimum:
		return false
	case k.Maximum != nil && f > *k.Maximum:
		return false
	}
	return true
}

type finding struct{ rule, msg string }

func (f finding) String() string { return f.rule + ": " + f.msg }

type checker struct{ findings []finding }

func (c *checker) fail(rule, format string, args ...any) {
	c.findings = append(c.findings, finding{rule, fmt.Sprintf(format, args...)})
}

type podSpec struct {
	name string
	tpl  *corev1.PodTemplateSpec
	// filled by checkPod
	sidecar     *corev1.Container
	metricsPort int // 0 when unknown
}

// check applies every rule to a decoded render and returns what fails.
func check(objs []runtime.Object) []finding {
	c := &checker{}
	var pods []*podSpec
	var services []*corev1.Service
	var monitors []*monitoringv1.ServiceMonitor
	templates, claims := map[string]bool{}, map[string]bool{}
	for _, obj := range objs {
		switch o := obj.(type) {
		case *appsv1.Deployment:
			pods = append(pods, &podSpec{name: "Deployment/" + o.Name, tpl: &o.Spec.Template})
		case *appsv1.DaemonSet:
			pods = append(pods, &podSpec{name: "DaemonSet/" + o.Name, tpl: &o.Spec.Template})
		case *appsv1.StatefulSet:
			pods = append(pods, &podSpec{name: "StatefulSet/" + o.Name, tpl: &o.Spec.Template})
		case *corev1.Pod:
			pods = append(pods, &podSpec{name: "Pod/" + o.Name, tpl: &corev1.PodTemplateSpec{ObjectMeta: o.ObjectMeta, Spec: o.Spec}})
		case *corev1.Service:
			services = append(services, o)
		case *monitoringv1.ServiceMonitor:
			monitors = append(monitors, o)
		case *resourcev1.ResourceClaimTemplate:
			templates[o.Name] = true
		case *resourcev1.ResourceClaim:
			claims[o.Name] = true
		}
	}
	withSidecar := 0
	for _, p := range pods {
		if ct, _ := findContainer(&p.tpl.Spec, sidecarName); ct != nil {
			withSidecar++
			c.checkPod(p, services, templates, claims)
		} else if ct, _ := findContainer(&p.tpl.Spec, nodeName); ct != nil {
			withSidecar++
			c.checkHost(p)
			c.checkNodeDaemonSet(p)
		}
	}
	if len(pods) > 0 && withSidecar == 0 {
		c.fail(ruleSidecarNative, "no pod has a container named %q", sidecarName)
	}
	c.checkServiceMonitors(monitors, services, pods)
	return c.findings
}

func findContainer(spec *corev1.PodSpec, name string) (ct *corev1.Container, init bool) {
	for i := range spec.InitContainers {
		if spec.InitContainers[i].Name == name {
			return &spec.InitContainers[i], true
		}
	}
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i], false
		}
	}
	return nil, false
}

func (c *checker) checkPod(p *podSpec, services []*corev1.Service, templates, claims map[string]bool) {
	spec := &p.tpl.Spec
	sc, scInit := findContainer(spec, sidecarName)
	en, enInit := findContainer(spec, engineName)
	p.sidecar = sc

	// The native sidecar and the order of start.
	switch {
	case !scInit:
		c.fail(ruleSidecarNative, "%s: %q is a regular container; it must be an init container with restartPolicy: Always (a native sidecar, Kubernetes 1.29+)", p.name, sidecarName)
	case sc.RestartPolicy == nil || *sc.RestartPolicy != corev1.ContainerRestartPolicyAlways:
		c.fail(ruleSidecarNative, "%s: init container %q lacks restartPolicy: Always: it would have to exit before the engine starts", p.name, sidecarName)
	}
	if sc.StartupProbe == nil {
		c.fail(ruleStartupProbe, "%s: %q has no startupProbe: the engine would start before the pool and socket exist", p.name, sidecarName)
	}
	if en == nil {
		c.fail(ruleEngineOrder, "%s: no container named %q", p.name, engineName)
	} else if enInit {
		c.fail(ruleEngineOrder, "%s: the engine %q is an init container; it must be a regular container, which starts after the sidecar's startup probe passes", p.name, engineName)
	}

	// The sidecar's real configuration, from its args and env.
	cfg, err := parseServe(sc)
	cfgOK := err == nil
	if !cfgOK {
		c.fail(ruleSidecarFlags, "%s: the sidecar's command line does not pass `ringside serve`: %v", p.name, err)
	}

	// Shared memory.
	shm := c.checkShm(p, sc, en)
	if cfgOK && !under(cfg.Dir, shmPath) {
		c.fail(ruleSharedShm, "%s: --dir %q is not on the shared /dev/shm volume", p.name, cfg.Dir)
	}

	// Pod-level isolation and security.
	if spec.ShareProcessNamespace == nil || !*spec.ShareProcessNamespace {
		c.fail(rulePIDNamespace, "%s: shareProcessNamespace must be true: the host copy backend addresses the engine by pid, and CUDA IPC needs pids unique in the pod", p.name)
	}
	c.checkHost(p)
	c.checkSecurity(p)
	if en != nil {
		c.checkSameUser(p, sc, en)
	}

	if en != nil {
		c.checkSeccomp(p, sc, en, cfg, cfgOK)
	}

	// Probes, metrics and the connector's socket.
	if cfgOK {
		p.metricsPort = c.checkProbes(p, sc, cfg)
	}
	c.checkPrometheus(p, services)
	if en != nil {
		c.checkKVConfig(p, en, cfg, cfgOK)
	}
	if cfgOK {
		c.checkSizing(p, sc, cfg, shm)
	}
	if en != nil {
		c.checkGPU(p, sc, en, templates, claims)
	}
	if cfgOK && len(sc.Resources.Claims) > 0 && cfg.CopyBackend != "cuda" {
		c.fail(ruleGPUBackend, "%s: the sidecar is given a GPU but runs --copy.backend=%s: with auto a node whose driver is unusable (or an image built without cgo) falls back to the host backend, which cannot copy GPU memory, and vLLM serves without the cache; cuda fails at start instead", p.name, cfg.CopyBackend)
	}
	for _, ct := range []*corev1.Container{sc, en} {
		if ct == nil || len(ct.Resources.Claims) == 0 || ct.SecurityContext == nil {
			continue
		}
		if ro := ct.SecurityContext.ReadOnlyRootFilesystem; ro != nil && *ro {
			c.fail(ruleGPURootFS, "%s: container %q names a resource claim (a GPU, injected through CDI) and has readOnlyRootFilesystem: true: NVIDIA's CDI hooks (update-ldcache, create-symlinks) write into the container's root filesystem when it is created and fail on a read-only one, so the pod never starts", p.name, ct.Name)
		}
	}
	if cfgOK && cfg.L2 != nil && cfg.L2.RedisOn() {
		c.checkL2(p, sc, cfg.L2)
	}
	if cfgOK {
		c.checkNodeTierPod(p, sc, cfg.L2)
	}
}

// checkL2: the shared tier is protected by an ACL user's password and TLS
// (docs/architecture.md, "The shared tier"), so the sidecar that uses one
// must connect with TLS, read its password from a Secret (a file on a
// read-only Secret volume, or a variable from a secretKeyRef: never a
// value in the manifest) and its CA, if named, from a Secret or ConfigMap.
func (c *checker) checkL2(p *podSpec, sc *corev1.Container, l2 *sidecar.L2Config) {
	r := l2.Redis
	if r.TLS == nil && r.TLSFiles == nil {
		c.fail(ruleL2Tier, "%s: the sidecar reaches its tier without TLS (--l2.redis.tls or --l2.redis.tls-ca-file): KV bytes and the password would cross the network in the clear", p.name)
	}
	// fromVolume reports whether file lies on a read-only mount of a
	// volume of one of the kinds allowed.
	fromVolume := func(file string, configMapToo bool) bool {
		for _, m := range sc.VolumeMounts {
			if !under(file, m.MountPath) || !m.ReadOnly {
				continue
			}
			for _, v := range p.tpl.Spec.Volumes {
				if v.Name != m.Name {
					continue
				}
				switch {
				case v.Secret != nil, configMapToo && v.ConfigMap != nil:
					return true
				case v.Projected != nil:
					ok := len(v.Projected.Sources) > 0
					for _, src := range v.Projected.Sources {
						ok = ok && (src.Secret != nil || configMapToo && src.ConfigMap != nil)
					}
					return ok
				}
			}
		}
		return false
	}
	switch {
	case r.PasswordFile != "":
		if !fromVolume(r.PasswordFile, false) {
			c.fail(ruleL2Tier, "%s: --l2.redis.password-file %q is not on a read-only Secret volume of the sidecar", p.name, r.PasswordFile)
		}
	case r.PasswordEnv != "":
		var ev *corev1.EnvVar
		for i := range sc.Env {
			if sc.Env[i].Name == r.PasswordEnv {
				ev = &sc.Env[i]
			}
		}
		if ev == nil || ev.ValueFrom == nil || ev.ValueFrom.SecretKeyRef == nil || ev.Value != "" {
			c.fail(ruleL2Tier, "%s: --l2.redis.password-env names %q, which is not set from a secretKeyRef in the sidecar's env: a password in the manifest is readable by everyone who can read the pod", p.name, r.PasswordEnv)
		}
	default:
		c.fail(ruleL2Tier, "%s: the sidecar's tier has no password (--l2.redis.password-file from a Secret): the cluster must admit only its ACL users", p.name)
	}
	if f := r.TLSFiles; f != nil {
		for flag, file := range map[string]string{"tls-ca-file": f.CA, "tls-cert-file": f.Cert, "tls-key-file": f.Key} {
			if file != "" && !fromVolume(file, flag == "tls-ca-file") {
				c.fail(ruleL2Tier, "%s: --l2.redis.%s %q is not on a read-only Secret (or, for the CA, ConfigMap) volume of the sidecar", p.name, flag, file)
			}
		}
	}
}

// under reports whether file lies strictly inside dir.
func under(file, dir string) bool {
	return strings.HasPrefix(path.Clean(file), path.Clean(dir)+"/")
}

func (c *checker) checkShm(p *podSpec, cts ...*corev1.Container) *corev1.EmptyDirVolumeSource {
	var names []string
	for _, ct := range cts {
		if ct == nil {
			continue
		}
		var m *corev1.VolumeMount
		for i := range ct.VolumeMounts {
			if path.Clean(ct.VolumeMounts[i].MountPath) == shmPath {
				m = &ct.VolumeMounts[i]
			}
		}
		switch {
		case m == nil:
			c.fail(ruleSharedShm, "%s: container %q mounts nothing at %s", p.name, ct.Name, shmPath)
			continue
		case m.ReadOnly || m.SubPath != "" || m.SubPathExpr != "":
			c.fail(ruleSharedShm, "%s: container %q mounts %s read-only or as a sub-path", p.name, ct.Name, shmPath)
		}
		names = append(names, m.Name)
	}
	if len(names) == 0 {
		return nil
	}
	if len(slices.Compact(slices.Sorted(slices.Values(names)))) != 1 {
		c.fail(ruleSharedShm, "%s: the containers mount different volumes at %s: %v", p.name, shmPath, names)
	}
	var vol *corev1.Volume
	for i := range p.tpl.Spec.Volumes {
		if p.tpl.Spec.Volumes[i].Name == names[0] {
			vol = &p.tpl.Spec.Volumes[i]
		}
	}
	switch {
	case vol == nil:
		c.fail(ruleSharedShm, "%s: volume %q is not defined", p.name, names[0])
		return nil
	case vol.EmptyDir == nil:
		c.fail(ruleSharedShm, "%s: volume %q at %s is not an emptyDir", p.name, vol.Name, shmPath)
		return nil
	}
	if vol.EmptyDir.Medium != corev1.StorageMediumMemory {
		c.fail(ruleSharedShm, "%s: emptyDir %q has medium %q; it must be Memory (tmpfs): the pool and rings are shared memory", p.name, vol.Name, vol.EmptyDir.Medium)
	}
	if vol.EmptyDir.SizeLimit == nil || vol.EmptyDir.SizeLimit.Sign() <= 0 {
		c.fail(ruleSharedShm, "%s: emptyDir %q has no sizeLimit: the tmpfs would be sized by the pod's memory limits alone", p.name, vol.Name)
	}
	return vol.EmptyDir
}

func (c *checker) checkHost(p *podSpec) {
	spec := &p.tpl.Spec
	for what, on := range map[string]bool{"hostIPC": spec.HostIPC, "hostPID": spec.HostPID, "hostNetwork": spec.HostNetwork} {
		if on {
			c.fail(ruleHostIsolation, "%s: %s is set; ringside needs none of the host's namespaces", p.name, what)
		}
	}
	for _, v := range spec.Volumes {
		// The node tier's directory, mounted by ringside's containers
		// alone, is the one host path allowed (node-tier checks it).
		if v.HostPath != nil && !hostPathOfRingside(spec, v.Name) {
			c.fail(ruleHostIsolation, "%s: volume %q is a hostPath mounted by a container other than ringside's", p.name, v.Name)
		}
	}
	for _, ct := range allContainers(spec) {
		for _, port := range ct.Ports {
			if port.HostPort != 0 {
				c.fail(ruleHostIsolation, "%s: container %q uses hostPort %d", p.name, ct.Name, port.HostPort)
			}
		}
	}
}

func allContainers(spec *corev1.PodSpec) []*corev1.Container {
	var out []*corev1.Container
	for i := range spec.InitContainers {
		out = append(out, &spec.InitContainers[i])
	}
	for i := range spec.Containers {
		out = append(out, &spec.Containers[i])
	}
	return out
}

func effectiveUser(pod *corev1.PodSecurityContext, ct *corev1.Container) (uid, gid *int64, nonRoot *bool) {
	if pod != nil {
		uid, gid, nonRoot = pod.RunAsUser, pod.RunAsGroup, pod.RunAsNonRoot
	}
	if s := ct.SecurityContext; s != nil {
		if s.RunAsUser != nil {
			uid = s.RunAsUser
		}
		if s.RunAsGroup != nil {
			gid = s.RunAsGroup
		}
		if s.RunAsNonRoot != nil {
			nonRoot = s.RunAsNonRoot
		}
	}
	return
}

func (c *checker) checkSecurity(p *podSpec) {
	for _, ct := range allContainers(&p.tpl.Spec) {
		s := ct.SecurityContext
		if s == nil {
			c.fail(ruleSecurity, "%s: container %q has no securityContext", p.name, ct.Name)
			s = &corev1.SecurityContext{}
		}
		if s.Privileged != nil && *s.Privileged {
			c.fail(ruleSecurity, "%s: container %q is privileged", p.name, ct.Name)
		}
		if s.AllowPrivilegeEscalation == nil || *s.AllowPrivilegeEscalation {
			c.fail(ruleSecurity, "%s: container %q must set allowPrivilegeEscalation: false", p.name, ct.Name)
		}
		dropsAll := false
		if s.Capabilities != nil {
			for _, d := range s.Capabilities.Drop {
				dropsAll = dropsAll || strings.EqualFold(string(d), "ALL")
			}
			if len(s.Capabilities.Add) > 0 {
				c.fail(ruleSecurity, "%s: container %q adds capabilities %v", p.name, ct.Name, s.Capabilities.Add)
			}
		}
		if !dropsAll {
			c.fail(ruleSecurity, "%s: container %q must drop ALL capabilities", p.name, ct.Name)
		}
		uid, _, nonRoot := effectiveUser(p.tpl.Spec.SecurityContext, ct)
		if nonRoot == nil || !*nonRoot {
			c.fail(ruleSecurity, "%s: container %q must run with runAsNonRoot: true", p.name, ct.Name)
		}
		if uid != nil && *uid == 0 {
			c.fail(ruleSecurity, "%s: container %q runs as uid 0", p.name, ct.Name)
		}
	}
}

func (c *checker) checkSameUser(p *podSpec, sc, en *corev1.Container) {
	su, sg, _ := effectiveUser(p.tpl.Spec.SecurityContext, sc)
	eu, eg, _ := effectiveUser(p.tpl.Spec.SecurityContext, en)
	str := func(v *int64) string {
		if v == nil {
			return "unset (the image's)"
		}
		return strconv.FormatInt(*v, 10)
	}
	same := func(a, b *int64) bool { return a != nil && b != nil && *a == *b }
	if !same(su, eu) || !same(sg, eg) {
		c.fail(ruleSameUser, "%s: sidecar runs as uid %s gid %s, engine as uid %s gid %s: the host copy backend's process_vm_readv/writev needs the same explicit uid and gid (ptrace access check), and the sidecar admits its own uid",
			p.name, str(su), str(sg), str(eu), str(eg))
	}
}

func effectiveSeccomp(pod *corev1.PodSecurityContext, ct *corev1.Container) *corev1.SeccompProfile {
	if ct.SecurityContext != nil && ct.SecurityContext.SeccompProfile != nil {
		return ct.SecurityContext.SeccompProfile
	}
	if pod != nil {
		return pod.SeccompProfile
	}
	return nil
}

func (c *checker) checkSeccomp(p *podSpec, sc, en *corev1.Container, cfg sidecar.Config, cfgOK bool) {
	psc := p.tpl.Spec.SecurityContext
	for _, ct := range allContainers(&p.tpl.Spec) {
		if sp := effectiveSeccomp(psc, ct); sp != nil && sp.Type == corev1.SeccompProfileTypeUnconfined {
			c.fail(ruleSeccomp, "%s: container %q is explicitly Unconfined (Pod Security baseline rejects it)", p.name, ct.Name)
		}
	}
	if sp := effectiveSeccomp(psc, en); sp == nil {
		c.fail(ruleSeccomp, "%s: the engine has no seccomp profile; give it RuntimeDefault (or a Localhost profile)", p.name)
	}
	hostCopies := !cfgOK || cfg.CopyBackend == "auto" || cfg.CopyBackend == "host"
	if sp := effectiveSeccomp(psc, sc); hostCopies && sp != nil && sp.Type == corev1.SeccompProfileTypeRuntimeDefault {
		c.fail(ruleSeccomp, "%s: the sidecar runs under RuntimeDefault, whose containerd profile blocks process_vm_readv/writev without CAP_SYS_PTRACE: every host copy would fail with EPERM; leave it unset or use a Localhost profile that allows them", p.name)
	}
}

// resolvePort maps a probe's or Service's port to a container port number.
func resolvePort(ct *corev1.Container, port intstr.IntOrString) int {
	if port.Type == intstr.Int {
		return port.IntValue()
	}
	for _, cp := range ct.Ports {
		if cp.Name == port.StrVal {
			return int(cp.ContainerPort)
		}
	}
	return -1
}

func (c *checker) checkProbes(p *podSpec, sc *corev1.Container, cfg sidecar.Config) int {
	if cfg.MetricsAddr == "" {
		c.fail(ruleProbes, "%s: --metrics.addr is empty: /healthz and /readyz are not served", p.name)
		return 0
	}
	host, portStr, err := net.SplitHostPort(cfg.MetricsAddr)
	port, perr := strconv.Atoi(portStr)
	if err != nil || perr != nil || port <= 0 {
		c.fail(ruleProbes, "%s: --metrics.addr %q has no numeric port", p.name, cfg.MetricsAddr)
		return 0
	}
	if host != "" && host != "0.0.0.0" && host != "::" {
		c.fail(ruleProbes, "%s: --metrics.addr %q listens on %s only: the kubelet probes the pod IP", p.name, cfg.MetricsAddr, host)
	}
	declared := false
	for _, cp := range sc.Ports {
		declared = declared || int(cp.ContainerPort) == port
	}
	if !declared {
		c.fail(ruleProbes, "%s: the sidecar does not declare containerPort %d (--metrics.addr)", p.name, port)
	}
	probe := func(kind string, pr *corev1.Probe, want string) {
		if pr == nil {
			if kind != "startup" { // its absence is ruleStartupProbe's
				c.fail(ruleProbes, "%s: the sidecar has no %s probe", p.name, kind)
			}
			return
		}
		g := pr.HTTPGet
		if g == nil {
			c.fail(ruleProbes, "%s: the sidecar's %s probe is not an httpGet on %s", p.name, kind, want)
			return
		}
		if g.Path != want {
			c.fail(ruleProbes, "%s: the sidecar's %s probe calls %q; ringside serves %s", p.name, kind, g.Path, want)
		}
		if got := resolvePort(sc, g.Port); got != port {
			c.fail(ruleProbes, "%s: the sidecar's %s probe calls port %s (%d); --metrics.addr is %q", p.name, kind, g.Port.String(), got, cfg.MetricsAddr)
		}
		if g.Scheme != "" && g.Scheme != corev1.URISchemeHTTP {
			c.fail(ruleProbes, "%s: the sidecar's %s probe uses %s; ringside serves plain HTTP", p.name, kind, g.Scheme)
		}
	}
	probe("startup", sc.StartupProbe, "/readyz")
	probe("readiness", sc.ReadinessProbe, "/readyz")
	probe("liveness", sc.LivenessProbe, "/healthz")
	return port
}

func (c *checker) checkPrometheus(p *podSpec, services []*corev1.Service) {
	ann := p.tpl.Annotations
	if ann["prometheus.io/scrape"] != "true" {
		c.fail(rulePrometheus, "%s: pod annotation prometheus.io/scrape is not \"true\"", p.name)
	}
	if path, ok := ann["prometheus.io/path"]; ok && path != "/metrics" {
		c.fail(rulePrometheus, "%s: prometheus.io/path is %q; ringside serves /metrics", p.name, path)
	}
	if p.metricsPort == 0 {
		return // unknown: the flags did not parse
	}
	if got := ann["prometheus.io/port"]; got != strconv.Itoa(p.metricsPort) {
		c.fail(rulePrometheus, "%s: prometheus.io/port is %q; --metrics.addr port is %d", p.name, got, p.metricsPort)
	}
	for _, s := range services {
		if selects(s.Spec.Selector, p.tpl.Labels) && metricsServicePort(s, p) != nil {
			return
		}
	}
	c.fail(rulePrometheus, "%s: no Service selects the pod and exposes the sidecar's metrics port %d", p.name, p.metricsPort)
}

// selects reports whether a non-empty selector matches labels.
func selects(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func metricsServicePort(s *corev1.Service, p *podSpec) *corev1.ServicePort {
	for i, sp := range s.Spec.Ports {
		tp := sp.TargetPort
		if tp.Type == intstr.Int && tp.IntVal == 0 {
			tp = intstr.FromInt32(sp.Port)
		}
		if p.sidecar != nil && p.metricsPort > 0 && resolvePort(p.sidecar, tp) == p.metricsPort {
			return &s.Spec.Ports[i]
		}
	}
	return nil
}

func (c *checker) checkServiceMonitors(monitors []*monitoringv1.ServiceMonitor, services []*corev1.Service, pods []*podSpec) {
	for _, m := range monitors {
		var matched []*corev1.Service
		for _, s := range services {
			if len(m.Spec.Selector.MatchExpressions) == 0 && selects(m.Spec.Selector.MatchLabels, s.Labels) {
				matched = append(matched, s)
			}
		}
		if len(matched) == 0 {
			c.fail(ruleServiceMonitor, "ServiceMonitor/%s selects no Service (matchLabels %v)", m.Name, m.Spec.Selector.MatchLabels)
			continue
		}
		scrapesSidecar := false
		for _, ep := range m.Spec.Endpoints {
			if ep.Port == "" {
				c.fail(ruleServiceMonitor, "ServiceMonitor/%s: an endpoint names no Service port", m.Name)
				continue
			}
			found := false
			for _, s := range matched {
				for _, sp := range s.Spec.Ports {
					if sp.Name != ep.Port {
						continue
					}
					found = true
					for _, p := range pods {
						if mp := metricsServicePort(s, p); mp != nil && mp.Name == sp.Name && selects(s.Spec.Selector, p.tpl.Labels) {
							scrapesSidecar = true
							if ep.Path != "" && ep.Path != "/metrics" {
								c.fail(ruleServiceMonitor, "ServiceMonitor/%s: port %q path %q; ringside serves /metrics", m.Name, ep.Port, ep.Path)
							}
						}
					}
				}
			}
			if !found {
				c.fail(ruleServiceMonitor, "ServiceMonitor/%s: endpoint port %q is not a port of the Services it selects", m.Name, ep.Port)
			}
		}
		if !scrapesSidecar {
			c.fail(ruleServiceMonitor, "ServiceMonitor/%s scrapes no ringside metrics port", m.Name)
		}
	}
}

// flagValue finds --name VALUE or --name=VALUE in a command line.
func flagValue(argv []string, name string) (string, bool) {
	for i, a := range argv {
		if a == name && i+1 < len(argv) {
			return argv[i+1], true
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func (c *checker) checkKVConfig(p *podSpec, en *corev1.Container, cfg sidecar.Config, cfgOK bool) {
	raw, ok := flagValue(append(slices.Clone(en.Command), en.Args...), "--kv-transfer-config")
	if !ok {
		c.fail(ruleKVConfig, "%s: the engine has no --kv-transfer-config", p.name)
		return
	}
	var kv struct {
		Connector string                     `json:"kv_connector"`
		Module    string                     `json:"kv_connector_module_path"`
		Role      string                     `json:"kv_role"`
		Extra     map[string]json.RawMessage `json:"kv_connector_extra_config"`
	}
	dec := json.NewDecoder(strings.NewReader(raw))
	if err := dec.Decode(&kv); err != nil || dec.More() {
		c.fail(ruleKVConfig, "%s: --kv-transfer-config is not one JSON object: %v", p.name, err)
		return
	}
	if kv.Connector != connectorName {
		c.fail(ruleKVConfig, "%s: kv_connector is %q, want %q", p.name, kv.Connector, connectorName)
	}
	if kv.Module != connectorModule {
		c.fail(ruleKVConfig, "%s: kv_connector_module_path is %q, want %q", p.name, kv.Module, connectorModule)
	}
	if kv.Role != "kv_both" {
		c.fail(ruleKVConfig, "%s: kv_role is %q; the connector both loads and stores (kv_both)", p.name, kv.Role)
	}
	socket := connectorDefaultSocket
	keys, err := connectorKeys()
	if err != nil {
		c.fail(ruleKVConfig, "%s: the connector's keys: %v", p.name, err)
		return
	}
	for k, v := range kv.Extra {
		key, known := keys[k]
		if !known {
			c.fail(ruleKVConfig, "%s: kv_connector_extra_config key %q is not one the connector reads", p.name, k)
			continue
		}
		if !key.accepts(v) {
			c.fail(ruleKVConfig, "%s: kv_connector_extra_config %q is %s; want %s", p.name, k, bytes.TrimSpace(v), key.allowed())
			continue
		}
		var s string
		if k == "socket" && json.Unmarshal(v, &s) == nil && s != "" {
			socket = s
		}
	}
	var enShm string
	for _, m := range en.VolumeMounts {
		if path.Clean(m.MountPath) == shmPath {
			enShm = shmPath
		}
	}
	if enShm == "" || !under(socket, enShm) {
		c.fail(ruleKVConfig, "%s: the connector's socket %q is not under the engine's %s mount", p.name, socket, shmPath)
	}
	if cfgOK && path.Clean(socket) != path.Clean(cfg.Socket) {
		c.fail(ruleKVConfig, "%s: the connector's socket is %q but the sidecar listens on %q (--dir %q)", p.name, socket, cfg.Socket, cfg.Dir)
	}
}

// sidecarMemory is the least memory the sidecar's request must hold: the
// pool (tmpfs pages it writes are charged to it), its session rings, the
// process and its per-slot index.
func sidecarMemory(cfg sidecar.Config) int64 {
	slots := cfg.PoolBytes / cfg.Machine.SlotBytes
	return int64(cfg.PoolBytes + ringBytes(cfg) + sidecarOverhead + perSlotOverhead*slots)
}

func ringBytes(cfg sidecar.Config) uint64 { return 2 * cfg.RingCapacity * ringSessions }

func (c *checker) checkSizing(p *podSpec, sc *corev1.Container, cfg sidecar.Config, shm *corev1.EmptyDirVolumeSource) {
	if cfg.PoolBytes == 0 {
		c.fail(rulePoolSizing, "%s: --pool.bytes is auto; set it so that the memory request and the /dev/shm limit can count it", p.name)
		return
	}
	if !cfg.PoolReserve {
		c.fail(rulePoolSizing, "%s: --pool.reserve is off: the pool is charged as it fills, so a memory limit or /dev/shm too small for it shows up mid-run (an OOM kill, refused stores), not at start", p.name)
	}
	need := sidecarMemory(cfg)
	req, ok := sc.Resources.Requests[corev1.ResourceMemory]
	if !ok || req.Value() < need {
		c.fail(rulePoolSizing, "%s: the sidecar requests memory %s; the pool (%d B), its rings and overhead need at least %d B (%d MiB)",
			p.name, req.String(), cfg.PoolBytes, need, (need+(1<<20)-1)>>20)
	}
	if lim, ok := sc.Resources.Limits[corev1.ResourceMemory]; ok && lim.Value() < need {
		c.fail(rulePoolSizing, "%s: the sidecar's memory limit %s is under the %d MiB its pool needs: it would be OOM-killed as the pool fills", p.name, lim.String(), (need+(1<<20)-1)>>20)
	}
	if shm == nil || shm.SizeLimit == nil {
		return
	}
	shmNeed := int64(cfg.PoolBytes + ringBytes(cfg))
	if shm.SizeLimit.Value() < shmNeed {
		c.fail(rulePoolSizing, "%s: /dev/shm sizeLimit %s is under the pool and rings (%d MiB)", p.name, shm.SizeLimit.String(), shmNeed>>20)
	}
	// A memory-backed emptyDir is capped at the sum of the pod's memory
	// limits when every container has one.
	var sum int64
	for _, ct := range allContainers(&p.tpl.Spec) {
		init := slices.ContainsFunc(p.tpl.Spec.InitContainers, func(x corev1.Container) bool { return x.Name == ct.Name })
		if init && (ct.RestartPolicy == nil || *ct.RestartPolicy != corev1.ContainerRestartPolicyAlways) {
			continue // a finished init container holds no memory
		}
		lim, ok := ct.Resources.Limits[corev1.ResourceMemory]
		if !ok {
			return
		}
		sum += lim.Value()
	}
	if sum < shm.SizeLimit.Value() {
		c.fail(rulePoolSizing, "%s: the pod's memory limits (%d MiB) are below the /dev/shm sizeLimit %s: the tmpfs is capped there", p.name, sum>>20, shm.SizeLimit.String())
	}
}

func (c *checker) checkGPU(p *podSpec, sc, en *corev1.Container, templates, claims map[string]bool) {
	spec := &p.tpl.Spec
	uses := len(spec.ResourceClaims) > 0
	for _, ct := range allContainers(spec) {
		uses = uses || len(ct.Resources.Claims) > 0
		for _, rl := range []corev1.ResourceList{ct.Resources.Requests, ct.Resources.Limits} {
			for name := range rl {
				if strings.Contains(string(name), "gpu") {
					uses = true
					c.fail(ruleGPUClaim, "%s: container %q asks for %s from a device plugin, which hands a GPU to one container only: the sidecar could not share it; use a DRA ResourceClaim named by both containers", p.name, ct.Name, name)
				}
			}
		}
	}
	if !uses {
		return
	}
	names := func(ct *corev1.Container) []string {
		var out []string
		for _, cl := range ct.Resources.Claims {
			if cl.Request != "" {
				out = append(out, cl.Name+"/"+cl.Request)
			} else {
				out = append(out, cl.Name)
			}
		}
		slices.Sort(out)
		return out
	}
	sn, enn := names(sc), names(en)
	if len(enn) == 0 {
		c.fail(ruleGPUClaim, "%s: the engine names no resource claim", p.name)
	}
	if !slices.Equal(sn, enn) {
		c.fail(ruleGPUClaim, "%s: the sidecar names claims %v and the engine %v: both must name the same claim to see the same GPU", p.name, sn, enn)
	}
	declared := map[string]corev1.PodResourceClaim{}
	for _, rc := range spec.ResourceClaims {
		declared[rc.Name] = rc
	}
	for _, ct := range allContainers(spec) {
		for _, cl := range ct.Resources.Claims {
			if _, ok := declared[cl.Name]; !ok {
				c.fail(ruleGPUClaim, "%s: container %q names claim %q, which the pod does not declare", p.name, ct.Name, cl.Name)
			}
		}
	}
	for _, rc := range spec.ResourceClaims {
		switch {
		case rc.ResourceClaimTemplateName != nil:
			if !templates[*rc.ResourceClaimTemplateName] {
				c.fail(ruleGPUClaim, "%s: claim %q uses ResourceClaimTemplate %q, which the overlay does not define", p.name, rc.Name, *rc.ResourceClaimTemplateName)
			}
		case rc.ResourceClaimName != nil:
			if !claims[*rc.ResourceClaimName] {
				c.fail(ruleGPUClaim, "%s: claim %q uses ResourceClaim %q, which the overlay does not define", p.name, rc.Name, *rc.ResourceClaimName)
			}
		default:
			c.fail(ruleGPUClaim, "%s: claim %q names neither a template nor a claim", p.name, rc.Name)
		}
	}
}

// The kv-config rule accepts and refuses extra-config values as the
// connector does (connector/python/tests/test_plugin_config.py has the
// connector's side of the same cases).
func TestConnectorKeyValues(t *testing.T) {
	keys, err := connectorKeys()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		key, value string
		ok         bool
	}{
		{"socket", `"/dev/shm/ringside/ringside.sock"`, true},
		{"socket", `7`, false},
		{"timeout", `2`, true},
		{"timeout", `"2.5"`, true},
		{"timeout", `0`, false},
		{"timeout", `"fast"`, false},
		{"timeout", `true`, false},
		{"max_wait_us", `0`, true},
		{"max_wait_us", `-1`, false},
		{"lease_ttl", `5e6`, false},
		{"mirror", `false`, true},
		{"mirror", `"off"`, true},
		{"mirror", `"maybe"`, false},
		{"overlap_saves", `"auto"`, true},
		{"overlap_saves", `"sometimes"`, false},
		{"sync_saves", `"auto"`, false},
		{"stats_every", `3`, true},
		{"stats_every", `2.5`, false},
		{"stats_every", `0`, false},
		{"mirror_max_blocks", `4e6`, true},
		{"stats_path", `null`, true},
	} {
		k, known := keys[tc.key]
		if !known {
			t.Errorf("%s: not a key", tc.key)
			continue
		}
		if got := k.accepts(json.RawMessage(tc.value)); got != tc.ok {
			t.Errorf("%s = %s: accepted %v, want %v (allowed: %s)", tc.key, tc.value, got, tc.ok, k.allowed())
		}
	}
	for _, k := range []string{"max_wait_usec", "timout", "max_batches", "staging_pages"} {
		if _, known := keys[k]; known {
			t.Errorf("%q is not a key of the vLLM connector", k)
		}
	}
}
