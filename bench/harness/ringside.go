package harness

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// ProductName is the product executable's name: the sidecar that the
// benchmarks start as `ringside serve`.
const ProductName = "ringside"

// FindRingside returns the ringside executable to start as the sidecar:
// flag when set (a path, or a name looked up on PATH), else ringside in the
// directory of exe (bin/ringside beside bin/ringside-bench, as `make build`
// leaves them), else ringside on PATH.
func FindRingside(flag, exe string) (string, error) {
	if flag != "" {
		p, err := exec.LookPath(flag)
		if err != nil {
			return "", fmt.Errorf("--ringside %s: %w", flag, err)
		}
		return filepath.Abs(p)
	}
	if exe != "" {
		if real, err := filepath.EvalSymlinks(exe); err == nil {
			exe = real
		}
		p := filepath.Join(filepath.Dir(exe), ProductName)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	p, err := exec.LookPath(ProductName)
	if err == nil {
		return filepath.Abs(p)
	}
	if !errors.Is(err, exec.ErrNotFound) {
		return "", err
	}
	return "", fmt.Errorf("no %s executable beside %s or on PATH (build it with `make build`, or set --ringside)", ProductName, exe)
}
