//go:build !cgo

package deploy

// cgoEnabled: this test binary, and so the sidecar it runs, has the CUDA backend.
const cgoEnabled = false
