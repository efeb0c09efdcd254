package harness

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// tree makes files (and executables, ending in *) under a fresh directory.
func tree(t *testing.T, files ...string) string {
	t.Helper()
	root := t.TempDir()
	for _, f := range files {
		mode := os.FileMode(0o644)
		if name, ok := strings.CutSuffix(f, "*"); ok {
			f, mode = name, 0o755
		}
		p := filepath.Join(root, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("print('peer')\n"), mode); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestFindConnector(t *testing.T) {
	repo := tree(t, "bin/ringside-bench*", "connector/python/ringside/__init__.py",
		"connector/python/ringside/_benchpeer.py", "deep/er/x")
	conn := filepath.Join(repo, "connector", "python")
	elsewhere := t.TempDir()
	tests := []struct {
		name, pkgDir, exe, wd string
		files                 []string
		want                  string
		wantErr               string
	}{
		{name: "beside the executable", exe: repo + "/bin/ringside-bench", wd: elsewhere, files: []string{"ringside/_benchpeer.py"}, want: conn},
		{name: "above the working directory", exe: elsewhere + "/ringside-bench", wd: repo + "/deep/er", want: conn},
		{name: "flag", pkgDir: conn, exe: elsewhere + "/x", wd: elsewhere, files: []string{"ringside/_benchpeer.py"}, want: conn},
		{name: "flag lacks a file", pkgDir: conn, wd: elsewhere, files: []string{"ringside/_pollbench.py"}, wantErr: "has no ringside/_pollbench.py (--python-path)"},
		{name: "found, lacks a file", exe: repo + "/bin/ringside-bench", wd: elsewhere, files: []string{"ringside/client.py"}, wantErr: conn + " has no ringside/client.py (set --python-path)"},
		{name: "a directory is not the file", exe: repo + "/bin/ringside-bench", wd: elsewhere, files: []string{"ringside"}, wantErr: "has no ringside"},
		{name: "nowhere", exe: elsewhere + "/ringside-bench", wd: elsewhere, wantErr: "connector/python/ringside not found near " + elsewhere + "/ringside-bench"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Chdir(tt.wd)
			got, err := FindConnector(tt.pkgDir, tt.exe, tt.files...)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %q, %v; want an error with %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

func TestFindPython(t *testing.T) {
	repo := tree(t, "connector/python/ringside/__init__.py", "connector/python/ringside/_benchpeer.py")
	_, err := FindPython("/nonexistent/python3", "", repo+"/ringside-bench")
	if err == nil || !strings.Contains(err.Error(), `no Python interpreter "/nonexistent/python3" (set --python)`) {
		t.Fatalf("missing interpreter: %v", err)
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 on PATH")
	}
	p, err := FindPython("python3", "", repo+"/ringside-bench", "ringside/_benchpeer.py")
	if err != nil {
		t.Fatal(err)
	}
	if !filepath.IsAbs(p.Exe) || p.Path != filepath.Join(repo, "connector", "python") {
		t.Fatalf("%+v", p)
	}
	// The package is importable from anywhere, ahead of an inherited
	// PYTHONPATH, and no bytecode lands beside it.
	t.Setenv("PYTHONPATH", "/nonexistent")
	t.Chdir(t.TempDir())
	out, err := p.Command(context.Background(), "-c", "import sys, ringside._benchpeer; print(sys.path[1])").CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	// ringside/__init__.py and _benchpeer.py each print "peer".
	if lines := strings.Split(strings.TrimSpace(string(out)), "\n"); len(lines) != 3 || lines[1] != "peer" || lines[2] != p.Path {
		t.Errorf("output %q", out)
	}
	if _, err := os.Stat(filepath.Join(p.Path, "ringside", "__pycache__")); err == nil {
		t.Error("bytecode written into the package")
	}
}

func TestLastLine(t *testing.T) {
	tests := []struct {
		out, want string
		err       error
	}{
		{"Traceback (most recent call last):\n  ...\nValueError: bad ring\n", "ValueError: bad ring", nil},
		{"one", "one", exec.ErrNotFound},
		{"  \n", exec.ErrNotFound.Error(), exec.ErrNotFound},
		{"", "", nil},
	}
	for _, tt := range tests {
		if got := LastLine([]byte(tt.out), tt.err); got != tt.want {
			t.Errorf("LastLine(%q, %v) = %q, want %q", tt.out, tt.err, got, tt.want)
		}
	}
}

func TestFindRingside(t *testing.T) {
	both := tree(t, "bin/ringside-bench*", "bin/ringside*")
	benchOnly := tree(t, "bin/ringside-bench*", "bin/ringside") // ringside not executable
	onPath := tree(t, "ringside*")
	empty := t.TempDir()
	tests := []struct {
		name, flag, exe, path string
		want, wantErr         string
	}{
		{name: "beside", exe: both + "/bin/ringside-bench", path: onPath, want: both + "/bin/ringside"},
		{name: "not executable beside: PATH", exe: benchOnly + "/bin/ringside-bench", path: onPath, want: onPath + "/ringside"},
		{name: "flag wins", flag: onPath + "/ringside", exe: both + "/bin/ringside-bench", path: empty, want: onPath + "/ringside"},
		{name: "flag as a name on PATH", flag: "ringside", exe: both + "/bin/ringside-bench", path: onPath, want: onPath + "/ringside"},
		{name: "bad flag", flag: empty + "/ringside", exe: both + "/bin/ringside-bench", path: onPath, wantErr: "--ringside " + empty + "/ringside"},
		{name: "nowhere", exe: benchOnly + "/bin/ringside-bench", path: empty, wantErr: "no ringside executable beside " + benchOnly + "/bin/ringside-bench or on PATH"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("PATH", tt.path)
			got, err := FindRingside(tt.flag, tt.exe)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %q, %v; want an error with %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}
