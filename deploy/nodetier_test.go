package deploy

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"

	ucli "github.com/urfave/cli/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	rcli "github.com/ringside-kv/ringside/internal/cli"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/node"
)

// The node tier (deploy/node, overlays/node): `ringside node` in a
// DaemonSet, its socket in a host directory that only ringside containers
// mount.
const (
	nodeName    = "ringside-node" // the node process's container
	prepareName = "prepare-dir"   // the DaemonSet's init container that makes the directory its own
	// nodeOverhead is the node process beside its pool and windows.
	nodeOverhead = 64 << 20
)

// ringsideMounter reports whether a container that mounts a host
// directory is one of ringside's: the sidecar, the node process or the
// DaemonSet's init container.
func ringsideMounter(name string) bool {
	return name == sidecarName || name == nodeName || name == prepareName
}

// hostPathOfRingside reports whether the hostPath volume is mounted by
// ringside's containers alone (the node tier's directory).
func hostPathOfRingside(spec *corev1.PodSpec, volume string) bool {
	mounted := false
	for _, ct := range allContainers(spec) {
		for _, m := range ct.VolumeMounts {
			if m.Name != volume {
				continue
			}
			if !ringsideMounter(ct.Name) {
				return false
			}
			mounted = true
		}
	}
	return mounted
}

// parseNode runs a container's command line and RINGSIDE_NODE_* variables
// through the real `ringside node` flags, as parseServe does for serve.
func parseNode(ct *corev1.Container) (node.ServerConfig, string, error) {
	argv := append([]string{"ringside"}, ct.Args...)
	if len(ct.Command) > 0 {
		if filepath.Base(ct.Command[0]) != "ringside" {
			return node.ServerConfig{}, "", fmt.Errorf("command %q does not run ringside", ct.Command)
		}
		argv = append(append([]string{"ringside"}, ct.Command[1:]...), ct.Args...)
	}
	if len(argv) < 2 || argv[1] != "node" {
		return node.ServerConfig{}, "", fmt.Errorf("arguments %q do not start with the node command", argv[1:])
	}
	env := map[string]string{}
	for _, e := range ct.Env {
		if !strings.HasPrefix(e.Name, "RINGSIDE_") {
			continue
		}
		if e.ValueFrom != nil {
			return node.ServerConfig{}, "", fmt.Errorf("%s uses valueFrom, which cannot be checked", e.Name)
		}
		env[e.Name] = e.Value
	}
	app := rcli.App()
	app.Writer, app.ErrWriter = io.Discard, io.Discard
	var cfg node.ServerConfig
	var owner string
	ran := false
	for _, c := range app.Commands {
		if c.Name == "node" {
			c.Action = func(c *ucli.Context) error {
				ran = true
				owner = c.String("dir.owner")
				var err error
				cfg, err = rcli.NodeConfig(c)
				return err
			}
		}
	}
	if err := withRingsideEnv(env, func() error { return app.Run(argv) }); err != nil {
		return cfg, owner, err
	}
	if !ran {
		return cfg, owner, errors.New("node did not run (help or version asked?)")
	}
	return cfg, owner, nil
}

// checkNodeTierPod: an engine pod's sidecar reaches the node tier's socket
// on a host directory it mounts read-only (and that no other container
// mounts: host-isolation).
func (c *checker) checkNodeTierPod(p *podSpec, sc *corev1.Container, cfg *sidecar.L2Config) {
	spec := &p.tpl.Spec
	hostMounts := map[string]corev1.VolumeMount{}
	for _, m := range sc.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.HostPath != nil {
				hostMounts[m.Name] = m
				if !m.ReadOnly {
					c.fail(ruleNodeTier, "%s: the sidecar mounts the host directory %q writable: it only connects to the node tier's socket there, which needs no write access", p.name, v.HostPath.Path)
				}
			}
		}
	}
	if cfg == nil || cfg.Node == nil {
		if len(hostMounts) > 0 {
			c.fail(ruleNodeTier, "%s: the sidecar mounts a host directory but has no --node.socket", p.name)
		}
		return
	}
	for _, m := range hostMounts {
		if under(cfg.Node.Socket, m.MountPath) {
			return
		}
	}
	c.fail(ruleNodeTier, "%s: --node.socket %q is not on a host directory the sidecar mounts: no node process can be reached there", p.name, cfg.Node.Socket)
}

// checkNodeDaemonSet: the node process runs unprivileged on its host
// directory, sized for its pool and windows, probed; the one container
// that may run as root only makes that directory its own.
func (c *checker) checkNodeDaemonSet(p *podSpec) {
	spec := &p.tpl.Spec
	nc, _ := findContainer(spec, nodeName)
	cfg, _, err := parseNode(nc)
	if err != nil {
		c.fail(ruleNodeTier, "%s: the node container's command line does not pass `ringside node`: %v", p.name, err)
		return
	}
	dirMounted := false
	for _, m := range nc.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.HostPath != nil && filepath.Clean(m.MountPath) == filepath.Clean(cfg.Dir) && !m.ReadOnly {
				dirMounted = true
			}
		}
	}
	if !dirMounted {
		c.fail(ruleNodeTier, "%s: --dir %q is not a writable hostPath mount of the node container: the sidecars could not reach its socket", p.name, cfg.Dir)
	}
	for _, ct := range allContainers(spec) {
		s := ct.SecurityContext
		if s == nil {
			c.fail(ruleNodeTier, "%s: container %q has no securityContext", p.name, ct.Name)
			continue
		}
		if (s.Privileged != nil && *s.Privileged) || s.AllowPrivilegeEscalation == nil || *s.AllowPrivilegeEscalation ||
			s.Capabilities == nil || !slices.Contains(s.Capabilities.Drop, "ALL") {
			c.fail(ruleNodeTier, "%s: container %q must not be privileged, must set allowPrivilegeEscalation: false and drop ALL capabilities", p.name, ct.Name)
		}
		uid, _, nonRoot := effectiveUser(spec.SecurityContext, ct)
		root := uid == nil || *uid == 0 || nonRoot == nil || !*nonRoot
		if !root {
			if len(s.Capabilities.Add) > 0 {
				c.fail(ruleNodeTier, "%s: container %q adds capabilities %v", p.name, ct.Name, s.Capabilities.Add)
			}
			continue
		}
		// Root only to chown the directory: `ringside node --dir.owner`,
		// CAP_CHOWN and CAP_FOWNER at most.
		_, owner, err := parseNode(ct)
		extra := slices.DeleteFunc(slices.Clone(s.Capabilities.Add), func(c corev1.Capability) bool { return c == "CHOWN" || c == "FOWNER" })
		if ct.Name == nodeName || err != nil || owner == "" || len(extra) > 0 {
			c.fail(ruleNodeTier, "%s: container %q runs as root: only an init container that runs `ringside node --dir.owner` with CAP_CHOWN and CAP_FOWNER may", p.name, ct.Name)
		}
	}
	if ro := nc.SecurityContext; ro != nil && (ro.ReadOnlyRootFilesystem == nil || !*ro.ReadOnlyRootFilesystem) {
		c.fail(ruleNodeTier, "%s: the node container's root file system is writable: it writes nothing but its socket", p.name)
	}
	need := int64(cfg.PoolBytes/cfg.Stride()*cfg.Stride()) + int64(cfg.MaxPods*cfg.WindowSlots)*int64(cfg.Stride()) + nodeOverhead
	lim, req := nc.Resources.Limits[corev1.ResourceMemory], nc.Resources.Requests[corev1.ResourceMemory]
	if lim.Value() < need || req.Cmp(lim) != 0 {
		c.fail(ruleNodeTier, "%s: the node container's memory request and limit (%s, %s) must be equal and hold the pool, %d windows and the process: %s",
			p.name, req.String(), lim.String(), cfg.MaxPods, resource.NewQuantity(need, resource.BinarySI).String())
	}
	if !cfg.Reserve {
		c.fail(ruleNodeTier, "%s: the node pool is not reserved at start (--pool.reserve): a memory limit too small for it would kill the node process later", p.name)
	}
	probe := func(pr *corev1.Probe, path string) bool {
		return pr != nil && pr.HTTPGet != nil && pr.HTTPGet.Path == path
	}
	if !probe(nc.ReadinessProbe, "/readyz") || !probe(nc.LivenessProbe, "/healthz") {
		c.fail(ruleNodeTier, "%s: the node container needs a readiness probe on /readyz and a liveness probe on /healthz (--metrics.addr)", p.name)
	}
}
