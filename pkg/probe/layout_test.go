package probe

import (
	"bytes"
	"context"
	"encoding/binary"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// TestLayoutMatchesELF checks, without privileges, that the host-probe
// object's maps have the sizes of the Go types used with them, and that its
// copy of rd_pods is the loader's map exactly (else loading one object would
// refuse the other's pinned map).
func TestLayoutMatchesELF(t *testing.T) {
	spec, err := bpf.LoadHostProbe()
	if err != nil {
		t.Fatal(err)
	}
	capture, err := bpf.LoadCapture()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		typ        ebpf.MapType
		key, value any
	}{
		bpf.HostProbeMapRdPods:    {ebpf.Hash, bpf.CapturePodAddr{}, bpf.CapturePodSettings{}},
		NATMapName:                {ebpf.LRUHash, bpf.HostProbeNatKey{}, bpf.HostProbeNatEntry{}},
		StatsMapName:              {ebpf.PerCPUHash, uint32(0), bpf.HostProbeSnatCounters{}},
		VethsMapName:              {ebpf.Hash, uint32(0), uint32(0)},
		bpf.HostProbeMapRdReasons: {ebpf.PerCPUArray, uint32(0), uint64(0)},
	}
	for name, w := range want {
		ms, ok := spec.Maps[name]
		if !ok {
			t.Errorf("map %s missing from the ELF", name)
			continue
		}
		if ms.Type != w.typ {
			t.Errorf("map %s is a %s, want %s", name, ms.Type, w.typ)
		}
		if got, exp := ms.KeySize, sizeOf(t, w.key); got != exp {
			t.Errorf("map %s: key size %d in ELF, Go type has %d", name, got, exp)
		}
		if got, exp := ms.ValueSize, sizeOf(t, w.value); got != exp {
			t.Errorf("map %s: value size %d in ELF, Go type has %d", name, got, exp)
		}
		if ms.Pinning != ebpf.PinByName {
			t.Errorf("map %s is not pinned by name", name)
		}
	}
	for name := range spec.Maps {
		if _, ok := want[name]; !ok && !strings.HasPrefix(name, ".") {
			t.Errorf("map %s has no check here", name)
		}
	}
	// The maps both objects declare must agree, or loading the second would
	// refuse the pinned map of the first.
	for _, name := range []string{bpf.CaptureMapRdPods, bpf.CaptureMapRdReasons} {
		mine, theirs := spec.Maps[name], capture.Maps[name]
		if mine.Type != theirs.Type || mine.KeySize != theirs.KeySize || mine.ValueSize != theirs.ValueSize ||
			mine.MaxEntries != theirs.MaxEntries || mine.Flags != theirs.Flags || mine.Pinning != theirs.Pinning {
			t.Errorf("%s differs between the objects:\nhost probe %+v\ncapture    %+v", name, mine, theirs)
		}
	}
	for name := range spec.Programs {
		if len(name) > 15 || !strings.HasPrefix(name, "rd_") {
			t.Errorf("program name %q: want the rd_ prefix and at most 15 characters", name)
		}
	}
	for name := range spec.Maps {
		if !strings.HasPrefix(name, ".") && (len(name) > 15 || !strings.HasPrefix(name, "rd_")) {
			t.Errorf("map name %q: want the rd_ prefix and at most 15 characters", name)
		}
	}
}

func sizeOf(t *testing.T, v any) uint32 {
	t.Helper()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.LittleEndian, v); err != nil {
		t.Fatal(err)
	}
	return uint32(buf.Len())
}

// TestLoadRejectsBadSettings needs no privileges: settings are checked before
// anything touches the kernel.
func TestLoadRejectsBadSettings(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"v4 outside link-local", Config{SNATv4: netip.MustParseAddr("10.0.0.1")}, "HOST_PROBE_SNAT_IP=10.0.0.1 must be an IPv4 address inside 169.254.0.0/16"},
		{"v4 given as IPv6", Config{SNATv4: netip.MustParseAddr("fd00::1")}, "HOST_PROBE_SNAT_IP=fd00::1 must be"},
		{"v4-mapped v4", Config{SNATv4: netip.MustParseAddr("::ffff:169.254.1.2")}, "HOST_PROBE_SNAT_IP=::ffff:169.254.1.2 must be"},
		{"v6 link-local", Config{SNATv6: netip.MustParseAddr("fe80::1")}, "HOST_PROBE_SNAT_IPV6=fe80::1 must be"},
		{"v6 given as IPv4", Config{SNATv6: netip.MustParseAddr("169.254.7.127")}, "HOST_PROBE_SNAT_IPV6=169.254.7.127 must be"},
		{"mark outside mask", Config{TunnelMark: 0x1000, MarkMask: 0xfff}, "tunnel mark 0x1000 is zero under mask 0xfff"},
		{"tiny NAT map", Config{NATSize: 8}, "NAT size 8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.PinRoot = t.TempDir()
			a, err := Load(context.Background(), tc.cfg)
			if err == nil {
				a.Close()
				t.Fatalf("Load accepted %+v", tc.cfg)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Load error %q, want it to contain %q", err, tc.want)
			}
		})
	}
	// As the agent reads them from the environment.
	if _, _, err := ParseSNAT("169.254.7.127", "not-an-ip"); err == nil || !strings.Contains(err.Error(), `HOST_PROBE_SNAT_IPV6="not-an-ip" is not an IP address`) {
		t.Errorf("ParseSNAT(HOST_PROBE_SNAT_IPV6=not-an-ip) = %v", err)
	}
	if _, _, err := ParseSNAT("10.0.0.1", DefaultSNATv6.String()); err == nil || !strings.Contains(err.Error(), "HOST_PROBE_SNAT_IP=10.0.0.1") {
		t.Errorf("ParseSNAT(HOST_PROBE_SNAT_IP=10.0.0.1) = %v", err)
	}
}
