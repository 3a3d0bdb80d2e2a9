package istiotest

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

// Environment variables that steer where istiod comes from.
const (
	// EnvBinDir names a folder holding pilot-discovery and crd-all.gen.yaml. When set,
	// nothing is built.
	EnvBinDir = "REDIRECTOR_ISTIO_BIN"
	// EnvSkipBuild=1 makes tests skip instead of running the (cold: several minutes) build
	// when istiod is not built yet. CI leaves it unset, so it builds and runs the tests.
	EnvSkipBuild = "REDIRECTOR_ISTIO_SKIP_BUILD"
)

// binaries are the istiod binary and the CRDs of the same Istio version.
type binaries struct {
	istiod string
	crds   string
}

// findBinaries returns istiod from EnvBinDir, or else from the cache folder of
// hack/istio-binaries.sh, building it there when missing.
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
		t.Fatalf("find hack/istio-binaries.sh: %v (or set %s)", err, EnvBinDir)
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
		t.Skipf("istiod not built in %s and %s=1; run hack/istio-binaries.sh or set %s", dir, EnvSkipBuild, EnvBinDir)
	}
	t.Logf("building istiod into %s (several minutes when cold)", dir)
	cmd := exec.Command("bash", script)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	b, err := binariesIn(strings.TrimSpace(stdout.String()))
	if err != nil {
		t.Fatalf("after %s: %v", script, err)
	}
	return b
}

func binariesIn(dir string) (binaries, error) {
	b := binaries{istiod: filepath.Join(dir, "pilot-discovery"), crds: filepath.Join(dir, "crd-all.gen.yaml")}
	if fi, err := os.Stat(b.istiod); err != nil || fi.Mode()&0o111 == 0 {
		return binaries{}, fmt.Errorf("no pilot-discovery in %s", dir)
	}
	if _, err := os.Stat(b.crds); err != nil {
		return binaries{}, fmt.Errorf("no crd-all.gen.yaml in %s", dir)
	}
	return b, nil
}

// buildScript finds hack/istio-binaries.sh by walking up from the working directory.
func buildScript() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, "hack", "istio-binaries.sh")
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
