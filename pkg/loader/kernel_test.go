package loader

import (
	"errors"
	"os"
	"strings"
	"testing"
)

func TestCheckKernelNamesTheMissingFeature(t *testing.T) {
	fs := requiredFeatures()
	// Simulate a kernel without bpf_sk_assign.
	for i := range fs {
		if strings.Contains(fs[i].name, "bpf_sk_assign") {
			fs[i].probe = func() error { return errors.New("not supported") }
		}
	}
	if os.Geteuid() != 0 {
		// Probes load tiny programs: without root only the injected failure is checked.
		for i := range fs {
			if !strings.Contains(fs[i].name, "bpf_sk_assign") {
				fs[i].probe = func() error { return nil }
			}
		}
	}
	err := checkKernel(fs)
	if !errors.Is(err, ErrKernel) || !strings.Contains(err.Error(), "bpf_sk_assign") {
		t.Fatalf("checkKernel = %v, want an error naming bpf_sk_assign", err)
	}
}

func TestThisKernelHasEverything(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("feature probes need root")
	}
	if err := CheckKernel(); err != nil {
		t.Fatal(err)
	}
}
