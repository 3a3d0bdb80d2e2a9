package netnstest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// bin is the directory with the freshly built binaries.
var bin string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "test/netns: the end-to-end tests need root; skipping")
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "redirector-e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if err := BuildBinaries(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	bin = dir
	return m.Run()
}

func redirectorBin() string { return filepath.Join(bin, "redirector") }
