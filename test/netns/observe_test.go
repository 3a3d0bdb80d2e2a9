package netnstest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// mirrorServer reads the request to EOF, then sends as many bytes back.
func mirrorServer(t *testing.T, p *Pod, port int) {
	ServeTCP(t, p, port, func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		io.Copy(c, io.LimitReader(newPattern(), n))
	})
}

// scrape fetches a URL from inside the node namespace of agent a.
func scrape(t *testing.T, a *Agent, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := Exec(ctx, a.Node.Path(), "curl", "-sS", "--max-time", "5", url)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// metricSum adds up the samples of name whose labels contain every want.
func metricSum(text, name string, want ...string) float64 {
	var sum float64
	re := regexp.MustCompile(`^` + name + `(?:\{(.*)\})? (\S+)$`)
	for _, line := range strings.Split(text, "\n") {
		m := re.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		ok := true
		for _, w := range want {
			ok = ok && strings.Contains(m[1], w)
		}
		if ok {
			v, _ := strconv.ParseFloat(m[2], 64)
			sum += v
		}
	}
	return sum
}

func TestObservability(t *testing.T) {
	ms, client, server, _ := meshed(t)
	mirrorServer(t, server, 9300)
	const size = 10 << 20
	const conns = 3
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := 0; i < conns; i++ {
		var c net.Conn
		Eventually(t, 10*time.Second, func() error {
			var err error
			c, err = netns.Dial(ctx, client.Path(), "tcp", netip.AddrPortFrom(server.IPv4, 9300).String(), netns.SocketOptions{})
			return err
		})
		n := int64(size)
		if i > 0 {
			n = 1000 // small ones, to count connections
		}
		if _, err := io.Copy(c, io.LimitReader(newPattern(), n)); err != nil {
			t.Fatal(err)
		}
		c.(*net.TCPConn).CloseWrite()
		got, err := io.Copy(io.Discard, bufio.NewReader(c))
		if err != nil || got != n {
			t.Fatalf("mirror returned %d bytes (%v), want %d", got, err, n)
		}
		c.Close()
	}
	srcP, dstP := `source_principal="spiffe://cluster.local/ns/mesh/sa/client-sa"`, `destination_principal="spiffe://cluster.local/ns/mesh/sa/server-sa"`
	want := float64(size + 2*1000)
	for i, reporter := range []string{"source", "destination"} {
		a := ms.agents[i]
		var text string
		Eventually(t, 5*time.Second, func() error {
			text = scrape(t, a, "http://127.0.0.1:15020/metrics")
			if got := metricSum(text, "istio_tcp_connections_closed_total", `reporter="`+reporter+`"`, srcP, dstP); got < conns {
				return fmt.Errorf("%s reporter: %v connections closed, want %d", reporter, got, conns)
			}
			return nil
		})
		for _, name := range []string{"istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"} {
			got := metricSum(text, name, `reporter="`+reporter+`"`, srcP, dstP, `connection_security_policy="mutual_tls"`)
			if got < want*0.99 || got > want*1.01 {
				t.Errorf("%s{reporter=%s} = %.0f, want within 1%% of %.0f", name, reporter, got, want)
			}
		}
		opened := metricSum(text, "istio_tcp_connections_opened_total", `reporter="`+reporter+`"`, srcP, dstP)
		closed := metricSum(text, "istio_tcp_connections_closed_total", `reporter="`+reporter+`"`, srcP, dstP)
		if opened != closed || opened < conns {
			t.Errorf("%s reporter: opened %v closed %v, want equal and >= %d", reporter, opened, closed, conns)
		}
		for _, m := range []string{"redirector_bpf_packets_total", "redirector_enrolled_pods 1", "redirector_certificate_expiry_seconds", `redirector_listener_drops_total{listener="hbone"}`, "go_goroutines", "process_resident_memory_bytes"} {
			if !strings.Contains(text, m) {
				t.Errorf("%s agent metrics lack %s", reporter, m)
			}
		}
		if out := scrape(t, a, "http://127.0.0.1:15021/healthz/ready"); !strings.Contains(out, "ready") {
			t.Errorf("readiness: %q", out)
		}
	}
	if got := metricSum(scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics"), "redirector_bpf_pod_connections_total", `pod="client"`, `direction="outbound"`); got < conns {
		t.Errorf("BPF outbound connection counter of the client is %v, want >= %d", got, conns)
	}

	// Config dump and inspect against the live agent.
	var dump map[string]json.RawMessage
	if err := json.Unmarshal([]byte(scrape(t, ms.agents[1], "http://127.0.0.1:15000/config_dump")), &dump); err != nil {
		t.Fatal(err)
	}
	for _, section := range []string{"pods", "workloads", "services", "policies", "certs"} {
		if len(dump[section]) == 0 {
			t.Errorf("config dump lacks %s", section)
		}
	}
	out, err := Exec(ctx, ms.agents[1].Node.Path(), redirectorBin(), "inspect", "certs")
	if err != nil || !strings.Contains(string(out), "spiffe://cluster.local/ns/mesh/sa/server-sa") || !strings.Contains(string(out), "valid") {
		t.Errorf("inspect certs: %v\n%s", err, out)
	}
	// inspect pods and maps read pinned state: they work with the agent stopped.
	ms.agents[0].Stop(10 * time.Second)
	out, err = Exec(ctx, ms.agents[0].Node.Path(), redirectorBin(), "inspect", "pods", "--bpf-root", ms.agents[0].BPFRoot)
	if err != nil || !strings.Contains(string(out), "client") || !strings.Contains(string(out), client.IPv4.String()) {
		t.Errorf("inspect pods with the agent stopped: %v\n%s", err, out)
	}
	out, err = Exec(ctx, ms.agents[0].Node.Path(), redirectorBin(), "inspect", "maps", "-o", "json", "--bpf-root", ms.agents[0].BPFRoot)
	if err != nil || !strings.Contains(string(out), "out_syn_steered") || !strings.Contains(string(out), `"rd_pod_netns"`) {
		t.Errorf("inspect maps: %v\n%s", err, out)
	}
}

// TestReadinessAndCounters: readiness flips to ready after the first
// reconcile and back when the BPF objects are removed underneath; the BPF
// counters agree across /metrics, `inspect maps` and bpftool; /metrics
// passes promlint.
func TestReadinessAndCounters(t *testing.T) {
	ms, client, server, _ := meshed(t)
	a := ms.agents[0]
	for i := 0; i < 3; i++ {
		Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	}
	readiness := func() (int, string) {
		out, err := Exec(context.Background(), a.Node.Path(), "curl", "-sS", "-o", "/dev/stderr", "-w", "%{http_code}", "http://127.0.0.1:15021/healthz/ready")
		if err != nil {
			t.Fatal(err)
		}
		code, _ := strconv.Atoi(strings.TrimSpace(string(out[len(out)-3:])))
		return code, string(out)
	}
	Eventually(t, 5*time.Second, func() error {
		if code, body := readiness(); code != 200 {
			return fmt.Errorf("readiness %d %s", code, body)
		}
		return nil
	})

	// The same counter three ways: /metrics, inspect maps (json), bpftool.
	text := scrape(t, a, "http://127.0.0.1:15020/metrics")
	fromMetrics := metricSum(text, "redirector_bpf_packets_total", `reason="out_syn_steered"`)
	out, err := Exec(context.Background(), a.Node.Path(), redirectorBin(), "inspect", "maps", "-o", "json", "--bpf-root", a.BPFRoot)
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct{ Map, Key, Value string }
	if err := json.Unmarshal(out, &rows); err != nil {
		t.Fatal(err)
	}
	var fromInspect float64 = -1
	for _, r := range rows {
		if r.Map == "rd_reasons" && r.Key == "out_syn_steered" {
			fromInspect, _ = strconv.ParseFloat(r.Value, 64)
		}
	}
	bt, err := exec.Command("bpftool", "-j", "map", "lookup", "pinned", a.BPFRoot+"/rd_reasons", "key", "0", "0", "0", "0").Output()
	if err != nil {
		t.Fatal(err)
	}
	var lookup struct {
		Formatted struct {
			Values []struct{ Value uint64 } `json:"values"`
		} `json:"formatted"`
	}
	if err := json.Unmarshal(bt, &lookup); err != nil {
		t.Fatalf("bpftool output %s: %v", bt, err)
	}
	var fromBpftool float64
	for _, v := range lookup.Formatted.Values {
		fromBpftool += float64(v.Value)
	}
	if fromMetrics < 3 || fromMetrics != fromInspect || fromMetrics != fromBpftool {
		t.Errorf("out_syn_steered: /metrics %v, inspect %v, bpftool %v: want equal and >= 3", fromMetrics, fromInspect, fromBpftool)
	}

	// promlint finds nothing wrong with /metrics, but in the names ztunnel
	// chose, which Istio's ztunnel dashboard reads as they are.
	istioNames := map[string]bool{"workload_manager_active_proxy_count": true, "workload_manager_pending_proxy_count": true}
	problems, err := promlint.New(strings.NewReader(text)).Lint()
	if err != nil {
		t.Fatalf("metrics do not parse: %v", err)
	}
	for _, p := range problems {
		if !istioNames[p.Metric] {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}

	// BPF objects removed underneath: not ready.
	if err := os.Remove(a.BPFRoot + "/rd_pods"); err != nil {
		t.Fatal(err)
	}
	if code, body := readiness(); code != 503 || !strings.Contains(body, "rd_pods") {
		t.Errorf("with rd_pods unpinned, readiness %d %q, want 503 naming rd_pods", code, body)
	}
}
