package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Python is an interpreter and the directory holding the ringside Python
// package (connector/python), put first on its PYTHONPATH.
type Python struct {
	Exe  string // the interpreter, resolved on PATH
	Path string // absolute directory holding ringside/
}

// FindPython resolves the interpreter interp (a name on PATH or a path)
// and the connector package: pkgDir when set (the --python-path flag),
// else connector/python in the directory of exe or one of its parents, or
// in the working directory or one of its parents. The package directory
// must hold each of files (relative to it, e.g. "ringside/_benchpeer.py").
// The error says what is missing and which flag sets it.
func FindPython(interp, pkgDir, exe string, files ...string) (Python, error) {
	py, err := exec.LookPath(interp)
	if err != nil {
		return Python{}, fmt.Errorf("no Python interpreter %q (set --python)", interp)
	}
	dir, err := FindConnector(pkgDir, exe, files...)
	if err != nil {
		return Python{}, err
	}
	return Python{Exe: py, Path: dir}, nil
}

// FindConnector returns the directory holding the ringside Python package
// (see FindPython), made absolute.
func FindConnector(pkgDir, exe string, files ...string) (string, error) {
	check := func(dir, flag string) (string, error) {
		for _, f := range files {
			fi, err := os.Stat(filepath.Join(dir, f))
			if err != nil || !fi.Mode().IsRegular() {
				return "", fmt.Errorf("%s has no %s%s", dir, f, flag)
			}
		}
		abs, err := filepath.Abs(dir)
		if err != nil {
			return "", err
		}
		return abs, nil
	}
	if pkgDir != "" {
		return check(pkgDir, " (--python-path)")
	}
	var starts []string
	if exe != "" {
		if real, err := filepath.EvalSymlinks(exe); err == nil {
			exe = real
		}
		starts = append(starts, filepath.Dir(exe))
	}
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	for _, s := range starts {
		for d := s; ; d = filepath.Dir(d) {
			c := filepath.Join(d, "connector", "python")
			if fi, err := os.Stat(filepath.Join(c, "ringside")); err == nil && fi.IsDir() {
				return check(c, " (set --python-path)")
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", fmt.Errorf("connector/python/ringside not found near %s or the working directory (set --python-path)", exe)
}

// Command runs the interpreter with args, the package first on
// PYTHONPATH and no bytecode written into the source tree.
func (p Python) Command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, p.Exe, args...)
	pp := p.Path
	if old := os.Getenv("PYTHONPATH"); old != "" {
		pp += string(os.PathListSeparator) + old
	}
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pp, "PYTHONDONTWRITEBYTECODE=1")
	return cmd
}

// LastLine is the last line of a child's output (a Python traceback's
// exception), or err's text when the output is empty.
func LastLine(out []byte, err error) string {
	s := strings.TrimSpace(string(out))
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	if s == "" && err != nil {
		return err.Error()
	}
	return s
}
