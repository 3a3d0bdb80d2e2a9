package workload

import (
	"net/netip"
	"sync"
	"testing"
)

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestStore(t *testing.T) {
	var s Store
	empty := s.Load()
	if _, ok := empty.ByAddr(addr("10.0.0.1")); ok || len(empty.All()) != 0 || len(empty.LocalPods("n")) != 0 || len(empty.Services()) != 0 {
		t.Fatal("empty directory is not empty")
	}
	if _, ok := empty.ServiceByVIP(addr("10.96.0.1")); ok {
		t.Fatal("empty directory has a service")
	}

	d1, _ := NewDirectory([]*Workload{{Namespace: "a", Name: "one", Node: "n", Addrs: []netip.Addr{addr("10.0.0.1")}}}, nil)
	d2, _ := NewDirectory([]*Workload{{Namespace: "a", Name: "two", Node: "n", Addrs: []netip.Addr{addr("10.0.0.1")}}}, nil)
	s.Set(d1)
	if s.Load() != d1 {
		t.Fatal("Load() after Set(d1) is not d1")
	}

	// Readers racing a writer see one whole directory or the other.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 1000 {
				w, ok := s.Load().ByAddr(addr("10.0.0.1"))
				if !ok || (w.Name != "one" && w.Name != "two") {
					t.Errorf("ByAddr = %v, %v", w, ok)
					return
				}
			}
		})
	}
	for i := range 1000 {
		s.Set([]*Directory{d1, d2}[i%2])
	}
	wg.Wait()
}
