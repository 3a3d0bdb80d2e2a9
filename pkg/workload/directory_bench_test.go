package workload

import (
	"fmt"
	"net/netip"
	"testing"
)

// BenchmarkNewDirectory indexes 20k workloads and 2k services of 10
// endpoints each, the Kubernetes source's scale benchmark's cluster: the
// cost every snapshot pays.
func BenchmarkNewDirectory(b *testing.B) {
	ws := make([]*Workload, 20000)
	for i := range ws {
		a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		ws[i] = &Workload{Namespace: fmt.Sprintf("ns-%d", i%20), Name: fmt.Sprintf("pod-%d", i), UID: fmt.Sprint(i),
			Node: fmt.Sprintf("node-%d", i%200), Addrs: []netip.Addr{a}, Enrolled: true}
	}
	svcs := make([]*Service, 2000)
	for i := range svcs {
		s := &Service{Namespace: fmt.Sprintf("ns-%d", i%20), Name: fmt.Sprintf("svc-%d", i),
			VIPs: []netip.Addr{netip.AddrFrom4([4]byte{172, 16, byte(i >> 8), byte(i)})}, Ports: []ServicePort{{Name: "http", Port: 80}}}
		for j := range 10 {
			s.Endpoints = append(s.Endpoints, Endpoint{Addr: ws[(i*10+j)%len(ws)].Addrs[0], Ready: true, Ports: map[string]int32{"http": 8080}})
		}
		svcs[i] = s
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, errs := NewDirectory(ws, svcs); len(errs) > 0 {
			b.Fatal(errs)
		}
	}
}
