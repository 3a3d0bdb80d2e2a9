package kubetest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// Environment variables that steer where the binaries come from.
const (
	// EnvBinDir names a folder holding kube-apiserver and etcd (or etcd's Go build name,
	// server). When set, nothing is built.
	EnvBinDir = "REDIRECTOR_K8S_BIN"
	// EnvSkipBuild=1 makes tests skip instead of running the (cold: ~7 min) build when the
	// binaries are not there yet. CI leaves it unset, so it builds and runs the tests.
	EnvSkipBuild = "REDIRECTOR_K8S_SKIP_BUILD"
)

// binaries are the paths of the two programs a Cluster runs.
type binaries struct {
	apiserver string
	etcd      string
}

// findBinaries returns the binaries from EnvBinDir, or else from the cache folder of
// hack/k8s-binaries.sh, building them there when missing (unless EnvSkipBuild=1, then it
// skips the test).
func findBinaries(t testing.TB) binaries {
	t.Helper()
	if dir := os.Getenv(EnvBinDir); dir != "" {
		b, err := binariesIn(dir)
		if err != nil {
			t.Fatalf("%s=%s: %v", EnvBinDir, dir, err)
		}
		return b
	}

	script, err := buildScript()
	if err != nil {
		t.Fatalf("find hack/k8s-binaries.sh: %v (or set %s)", err, EnvBinDir)
	}
	out, err := exec.Command("bash", script, "--dir").Output()
	if err != nil {
		t.Fatalf("%s --dir: %v", script, err)
	}
	dir := strings.TrimSpace(string(out))
	if b, err := binariesIn(dir); err == nil {
		return b
	}
	if os.Getenv(EnvSkipBuild) == "1" {
		t.Skipf("kube-apiserver/etcd not built in %s and %s=1; run hack/k8s-binaries.sh or set %s", dir, EnvSkipBuild, EnvBinDir)
	}

	t.Logf("building kube-apiserver and etcd into %s (several minutes when cold)", dir)
	cmd := exec.Command("bash", script)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = os.Stderr // progress of a long build, visible with go test -v
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	b, err := binariesIn(strings.TrimSpace(stdout.String()))
	if err != nil {
		t.Fatalf("after %s: %v", script, err)
	}
	return b
}

// binariesIn finds kube-apiserver and etcd in dir.
func binariesIn(dir string) (binaries, error) {
	b := binaries{apiserver: filepath.Join(dir, "kube-apiserver")}
	if !executable(b.apiserver) {
		return binaries{}, fmt.Errorf("no kube-apiserver in %s", dir)
	}
	for _, name := range []string{"etcd", "server"} {
		if p := filepath.Join(dir, name); executable(p) {
			b.etcd = p
			return b, nil
		}
	}
	return binaries{}, fmt.Errorf("no etcd (or server) in %s", dir)
}

func executable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// buildScript finds hack/k8s-binaries.sh by walking up from the working directory, which go
// test sets to the package under test, somewhere inside the repository.
func buildScript() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, "hack", "k8s-binaries.sh")
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
