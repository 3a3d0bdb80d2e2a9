package kubetest

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/redirector-mesh/redirector/test/testbin"
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

var tool = testbin.Tool{Name: "kube-apiserver and etcd", Script: "hack/k8s-binaries.sh", EnvBinDir: EnvBinDir, EnvSkipBuild: EnvSkipBuild}

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
	return testbin.Find(t, tool, binariesIn)
}

// binariesIn finds kube-apiserver and etcd in dir.
func binariesIn(dir string) (binaries, error) {
	b := binaries{apiserver: filepath.Join(dir, "kube-apiserver")}
	if !testbin.Executable(b.apiserver) {
		return binaries{}, fmt.Errorf("no kube-apiserver in %s", dir)
	}
	for _, name := range []string{"etcd", "server"} {
		if p := filepath.Join(dir, name); testbin.Executable(p) {
			b.etcd = p
			return b, nil
		}
	}
	return binaries{}, fmt.Errorf("no etcd (or server) in %s", dir)
}
