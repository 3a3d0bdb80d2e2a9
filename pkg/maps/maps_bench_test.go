package maps

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// The map operations the agent makes per pod (enroll, unenroll, record
// metadata) and per scrape (read every pod's per-CPU counters), against real
// kernel maps created from the compiled object's specs, unpinned.

// benchAddr is the i-th pod address, alternating IPv4 and IPv6.
func benchAddr(i int) netip.Addr {
	if i%2 == 0 {
		return netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
	}
	return netip.AddrFrom16([16]byte{0xfd, 0, 12: byte(i >> 24), 13: byte(i >> 16), 14: byte(i >> 8), 15: byte(i)})
}

// fillPods records n pods with two addresses each and their counters.
func fillPods(b *testing.B, m *Maps, n int) {
	b.Helper()
	for i := range n {
		a4, a6 := benchAddr(2*i), benchAddr(2*i+1)
		p := PodMeta{UID: fmt.Sprintf("uid-%d", i), Namespace: "bench", Name: fmt.Sprintf("pod-%d", i),
			NetNS: "/var/run/netns/bench", Interface: "eth0", Addrs: []netip.Addr{a4, a6},
			Settings: PodSettings{CaptureOutbound: true, CaptureInbound: true, PodID: uint32(i + 1)}}
		if err := m.PutMeta(uint32(i+1), p); err != nil {
			b.Fatal(err)
		}
		for _, a := range p.Addrs {
			if err := m.CreateCounters(a); err != nil {
				b.Fatal(err)
			}
			if err := m.SetPod(a, p.Settings); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkSetPod updates one enrollment entry in place.
func BenchmarkSetPod(b *testing.B) {
	m := newTestMaps(b)
	a := benchAddr(0)
	s := PodSettings{CaptureOutbound: true, CaptureInbound: true, PodID: 1}
	b.ReportAllocs()
	for b.Loop() {
		if err := m.SetPod(a, s); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPodLookup reads one enrollment entry.
func BenchmarkPodLookup(b *testing.B) {
	m := newTestMaps(b)
	a := benchAddr(0)
	if err := m.SetPod(a, PodSettings{CaptureOutbound: true, PodID: 1}); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, ok, err := m.Pod(a); err != nil || !ok {
			b.Fatal(ok, err)
		}
	}
}

// BenchmarkEnrollAddress is the map work of enrolling and then unenrolling
// one address: counters created, entry written, entry and counters deleted.
func BenchmarkEnrollAddress(b *testing.B) {
	m := newTestMaps(b)
	a := benchAddr(1)
	s := PodSettings{CaptureOutbound: true, CaptureInbound: true, PodID: 1}
	b.ReportAllocs()
	for b.Loop() {
		if err := m.CreateCounters(a); err != nil {
			b.Fatal(err)
		}
		if err := m.SetPod(a, s); err != nil {
			b.Fatal(err)
		}
		if err := m.DeletePod(a); err != nil {
			b.Fatal(err)
		}
		if err := m.DeleteCounters(a); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPutMeta records one pod's metadata (strings packed into C chars).
func BenchmarkPutMeta(b *testing.B) {
	m := newTestMaps(b)
	p := PodMeta{UID: "0d9f4c1e-8a57-4c2b-9e1a-3f6b2d7c5e90", Namespace: "shop", Name: "web-7d4b9c6f5-x2k8p",
		NetNS: "/var/run/netns/cni-6f1d2c3b-aa55-4e2f-8d9c-0b1a2c3d4e5f", Interface: "eth0",
		Addrs: []netip.Addr{benchAddr(0), benchAddr(1)}, Settings: PodSettings{CaptureOutbound: true, PodID: 1}}
	b.ReportAllocs()
	for b.Loop() {
		if err := m.PutMeta(1, p); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCounters reads one address's per-CPU counters and sums them.
func BenchmarkCounters(b *testing.B) {
	m := newTestMaps(b)
	a := benchAddr(0)
	if err := m.CreateCounters(a); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, ok, err := m.Counters(a); err != nil || !ok {
			b.Fatal(ok, err)
		}
	}
}

// BenchmarkAllCounters iterates the counters of 100 pods (200 addresses),
// as a scrape does.
func BenchmarkAllCounters(b *testing.B) {
	m := newTestMaps(b)
	fillPods(b, m, 100)
	b.ReportAllocs()
	for b.Loop() {
		c, err := m.AllCounters()
		if err != nil || len(c) != 200 {
			b.Fatal(len(c), err)
		}
	}
}

// BenchmarkCollect is a whole scrape of the BPF collector with 100 pods:
// reasons, metadata, counters, and the Prometheus metrics built from them.
func BenchmarkCollect(b *testing.B) {
	m := newTestMaps(b)
	fillPods(b, m, 100)
	c := NewCollector(m)
	b.ReportAllocs()
	for b.Loop() {
		ch := make(chan prometheus.Metric, 1024)
		c.Collect(ch)
		close(ch)
		n := 0
		for range ch {
			n++
		}
		if n < 500 {
			b.Fatalf("scrape produced %d metrics, want at least 500", n)
		}
	}
}
