package sys

import (
	"os"
	"path/filepath"
	"testing"
)

func TestMemoryLimit(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cgroup string
		files  map[string]string
		want   int64
		ok     bool
	}{
		{"v2", "0::/pod/a\n", map[string]string{"pod/a/memory.max": "268435456\n"}, 268435456, true},
		{"v2 max", "0::/pod/a\n", map[string]string{"pod/a/memory.max": "max\n"}, 0, false},
		{"v1", "4:memory:/x\n1:cpu:/x\n", map[string]string{"memory/x/memory.limit_in_bytes": "1073741824\n"}, 1 << 30, true},
		{"v1 unlimited", "4:cpuacct,memory:/x\n", map[string]string{"memory/x/memory.limit_in_bytes": "9223372036854771712\n"}, 0, false},
		{"v1 wins over v2", "4:memory:/x\n0::/y\n", map[string]string{"memory/x/memory.limit_in_bytes": "1000\n", "y/memory.max": "2000\n"}, 1000, true},
		{"none", "1:cpu:/x\n", nil, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			proc := filepath.Join(dir, "cgroup")
			os.WriteFile(proc, []byte(tc.cgroup), 0o600)
			for p, v := range tc.files {
				full := filepath.Join(dir, "root", p)
				os.MkdirAll(filepath.Dir(full), 0o700)
				os.WriteFile(full, []byte(v), 0o600)
			}
			got, _, ok := memoryLimit(proc, filepath.Join(dir, "root"))
			if got != tc.want || ok != tc.ok {
				t.Fatalf("memoryLimit = %d %v, want %d %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}
