// Package deploy holds ringside's container image recipes and Kubernetes
// manifests (kustomize base and overlays); it has no code. Its tests render
// every overlay with the kustomize library, decode each object with the
// Kubernetes API machinery's strict decoder and check the pod against the
// rules in deploy/README.md, with the real `ringside serve` flags.
package deploy
