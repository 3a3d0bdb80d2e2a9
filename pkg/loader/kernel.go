package loader

import (
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
)

// kernelFeature is one thing the data path needs from the kernel.
type kernelFeature struct {
	name  string       // as a user would search for it
	why   string       // what breaks without it
	probe func() error // nil when present
}

// requiredFeatures are probed once at Load, so that an unsuitable kernel
// fails at start with a message naming what is missing rather than with a
// verifier log later. tcx is not required: without it the loader attaches
// with clsact + cls_bpf.
func requiredFeatures() []kernelFeature {
	return []kernelFeature{
		{"BTF (/sys/kernel/btf/vmlinux)", "the programs and maps carry BTF; socket helpers need the kernel's", func() error {
			_, err := os.Stat("/sys/kernel/btf/vmlinux")
			return err
		}},
		{"BPF program type sched_cls (tc)", "the pod-side and host-side programs are tc classifiers", func() error {
			return features.HaveProgramType(ebpf.SchedCLS)
		}},
		{"BPF helper bpf_skc_lookup_tcp", "finding the tunnel's sockets and listeners", func() error {
			return features.HaveProgramHelper(ebpf.SchedCLS, asm.FnSkcLookupTcp)
		}},
		{"BPF helper bpf_sk_assign (Linux 5.7+)", "handing captured connections to the tunnel's listeners", func() error {
			return features.HaveProgramHelper(ebpf.SchedCLS, asm.FnSkAssign)
		}},
		{"BPF map type LRU hash", "the host-probe NAT table", func() error {
			return features.HaveMapType(ebpf.LRUHash)
		}},
	}
}

// ErrKernel is wrapped by errors about missing kernel features.
var ErrKernel = errors.New("kernel lacks a feature the data path needs")

// CheckKernel reports the first required feature the running kernel lacks.
func CheckKernel() error { return checkKernel(requiredFeatures()) }

func checkKernel(fs []kernelFeature) error {
	for _, f := range fs {
		if err := f.probe(); err != nil {
			return fmt.Errorf("%w: %s (needed for %s): %v", ErrKernel, f.name, f.why, err)
		}
	}
	return nil
}
