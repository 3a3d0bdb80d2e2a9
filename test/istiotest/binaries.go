package istiotest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/redirector-mesh/redirector/test/testbin"
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

var tool = testbin.Tool{Name: "istiod", Script: "hack/istio-binaries.sh", EnvBinDir: EnvBinDir, EnvSkipBuild: EnvSkipBuild}

// binaries are the istiod binary and the CRDs of the same Istio version.
type binaries struct {
	istiod string
	crds   string
}

// findBinaries returns istiod from EnvBinDir, or else from the cache folder of
// hack/istio-binaries.sh, building it there when missing.
func findBinaries(t testing.TB) binaries {
	t.Helper()
	return testbin.Find(t, tool, binariesIn)
}

func binariesIn(dir string) (binaries, error) {
	b := binaries{istiod: filepath.Join(dir, "pilot-discovery"), crds: filepath.Join(dir, "crd-all.gen.yaml")}
	if !testbin.Executable(b.istiod) {
		return binaries{}, fmt.Errorf("no pilot-discovery in %s", dir)
	}
	if _, err := os.Stat(b.crds); err != nil {
		return binaries{}, fmt.Errorf("no crd-all.gen.yaml in %s", dir)
	}
	return b, nil
}

// Binaries returns the paths of pilot-discovery and of Istio's CRDs of the same version,
// building them as findBinaries does, for a caller that runs istiod its own way (the
// real-node test runs it inside its node).
func Binaries(t testing.TB) (istiod, crds string) {
	t.Helper()
	b := findBinaries(t)
	return b.istiod, b.crds
}
