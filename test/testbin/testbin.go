// Package testbin finds the heavy test binaries (kube-apiserver, etcd, istiod, ...) that the
// hack/*-binaries.sh scripts build into a cache folder keyed by content hash, building them on
// first use, and starts them so that they never outlive the test binary.
package testbin

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// Tool says where one set of binaries comes from.
type Tool struct {
	// Name is what the binaries are called in messages ("kube-apiserver and etcd").
	Name string
	// Script is the build script, relative to the repository root ("hack/k8s-binaries.sh").
	// It prints its cache folder with --dir, and builds there (printing the folder) without.
	Script string
	// EnvBinDir names a variable that, when set, holds a folder with the binaries: nothing
	// is built.
	EnvBinDir string
	// EnvSkipBuild names a variable that, set to 1, makes tests skip instead of running a
	// cold build (several minutes). CI leaves it unset, so it builds and runs the tests.
	EnvSkipBuild string
}

// Find returns the tool's binaries as in reads them out of a folder (their paths, or an
// error naming what the folder lacks): EnvBinDir's, else the script's cache folder, built
// there when in refuses it.
func Find[B any](t testing.TB, tool Tool, in func(dir string) (B, error)) B {
	t.Helper()
	if dir := os.Getenv(tool.EnvBinDir); dir != "" {
		b, err := in(dir)
		if err != nil {
			t.Fatalf("%s=%s: %v", tool.EnvBinDir, dir, err)
		}
		return b
	}
	script, err := repoFile(tool.Script)
	if err != nil {
		t.Fatalf("find %s: %v (or set %s)", tool.Script, err, tool.EnvBinDir)
	}
	out, err := exec.Command("bash", script, "--dir").Output()
	if err != nil {
		t.Fatalf("%s --dir: %v", script, err)
	}
	dir := strings.TrimSpace(string(out))
	if b, err := in(dir); err == nil {
		return b
	}
	if os.Getenv(tool.EnvSkipBuild) == "1" {
		t.Skipf("%s not built in %s and %s=1; run %s or set %s", tool.Name, dir, tool.EnvSkipBuild, tool.Script, tool.EnvBinDir)
	}
	t.Logf("building %s into %s (several minutes when cold)", tool.Name, dir)
	cmd := exec.Command("bash", script)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = os.Stderr // progress of a long build, visible with go test -v
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	dir = strings.TrimSpace(stdout.String())
	b, err := in(dir)
	if err != nil {
		t.Fatalf("after %s: %v", script, err)
	}
	return b
}

// Executable reports whether path is a regular file someone may execute.
func Executable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// repoFile finds rel by walking up from the working directory, which go test sets to the
// package under test, somewhere inside the repository.
func repoFile(rel string) (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, rel)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("not inside the redirector repository")
		}
		dir = parent
	}
}
