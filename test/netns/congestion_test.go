package netnstest

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestHBONECongestionControl: with --hbone-congestion-control, both ends of a
// pooled HBONE connection (the client pod's dial and what the server pod's
// listener accepted) use that algorithm, not the namespaces' default.
func TestHBONECongestionControl(t *testing.T) {
	def, err := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control")
	if err != nil {
		t.Fatal(err)
	}
	avail, err := os.ReadFile("/proc/sys/net/ipv4/tcp_available_congestion_control")
	if err != nil {
		t.Fatal(err)
	}
	// reno is always built in; cubic when reno is the default.
	algo := "reno"
	if strings.TrimSpace(string(def)) == algo {
		algo = "cubic"
	}
	known := strings.Fields(string(avail)) // ss prints a socket's algorithm by its name
	if !slices.Contains(known, algo) {
		t.Fatalf("kernel offers %q, want %s among them", avail, algo)
	}
	_, client, server := newMeshPair(t, []string{"--hbone-congestion-control", algo})
	Eventually(t, 10*time.Second, func() error {
		_, err := Curl(client, URL(server.IPv4, 8080))
		return err
	})
	// The pooled connection stays open (idle timeout 30 s) for ss to see.
	algoOf := func(p *Pod, filter string) []string {
		t.Helper()
		out, err := Exec(context.Background(), p.Path(), "ss", "-Htin", "state", "established", filter)
		if err != nil {
			t.Fatal(err)
		}
		var algos []string
		for _, f := range strings.Fields(string(out)) {
			if slices.Contains(known, f) {
				algos = append(algos, f)
			}
		}
		return algos
	}
	for _, c := range []struct {
		side   string
		pod    *Pod
		filter string
	}{{"dialled (client pod)", client, "( dport = :15008 )"}, {"accepted (server pod)", server, "( sport = :15008 )"}} {
		got := algoOf(c.pod, c.filter)
		if len(got) == 0 {
			t.Errorf("%s: no HBONE connection in ss", c.side)
			continue
		}
		for _, a := range got {
			if a != algo {
				t.Errorf("%s HBONE socket uses %s, want %s (the setting)", c.side, a, algo)
			}
		}
	}
}
