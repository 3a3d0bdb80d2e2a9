package admin

import (
	"bufio"
	"errors"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The metrics and readiness ports listen on every node address, so any pod
// can reach them; the admin port on loopback, any host process. None of
// them may let a caller hold an unbounded share of the agent's memory, fds
// or CPU, which it shares with every pod's data path.

// openStalled opens n connections to addr, each sending the start of a
// request and then nothing (slowloris), and returns them.
func openStalled(t *testing.T, addr string, n int) []net.Conn {
	t.Helper()
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range n {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := c.Write([]byte("GET /metrics HTTP/1.1\r\nHost: x\r\n")); err != nil {
			t.Fatal(err)
		}
	}
	return conns
}

// stillOpen counts the connections the server has not closed.
func stillOpen(t *testing.T, conns []net.Conn) int {
	t.Helper()
	open := 0
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			open++
		}
	}
	return open
}

func TestEndpointsBoundConnections(t *testing.T) {
	s := start(t, Options{})
	for _, e := range []struct{ name, addr string }{
		{"metrics", s.MetricsAddr()}, {"readiness", s.ReadinessAddr()}, {"admin", s.AdminAddr()},
	} {
		t.Run(e.name, func(t *testing.T) {
			conns := openStalled(t, e.addr, maxConnsPerSource+20)
			time.Sleep(100 * time.Millisecond)
			if open := stillOpen(t, conns); open > maxConnsPerSource {
				t.Errorf("%d stalled connections from one address held open, want at most %d", open, maxConnsPerSource)
			}
			// The connections over the limit were closed: once the held ones
			// go, the endpoint serves again.
			for _, c := range conns {
				c.Close()
			}
			deadline := time.Now().Add(2 * time.Second)
			for {
				c, err := net.DialTimeout("tcp", e.addr, time.Second)
				if err == nil {
					c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
					c.SetReadDeadline(time.Now().Add(time.Second))
					line, rerr := bufio.NewReader(c).ReadString('\n')
					c.Close()
					if rerr == nil && strings.HasPrefix(line, "HTTP/1.1 ") {
						return
					}
				}
				if time.Now().After(deadline) {
					t.Fatalf("endpoint does not serve after the stalled connections closed: %v", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}

// TestEndpointsCountRefusedConnections: what the bounds close is counted
// per endpoint and bound, not only in a once-a-minute log line, and the
// open connections are a gauge that falls back when they close.
func TestEndpointsCountRefusedConnections(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := start(t, Options{Registry: reg})
	conns := openStalled(t, s.ReadinessAddr(), maxConnsPerSource+5)
	refused := func() float64 {
		return metricValue(t, reg, "redirector_endpoint_refused_connections_total", "readiness", "per_source")
	}
	open := func() float64 { return metricValue(t, reg, "redirector_endpoint_open_connections", "readiness") }
	deadline := time.Now().Add(5 * time.Second)
	for refused() < 5 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := refused(); got != 5 {
		t.Errorf("readiness refused per source: %v, want 5", got)
	}
	if got := open(); got != maxConnsPerSource {
		t.Errorf("readiness open connections: %v, want %d", got, maxConnsPerSource)
	}
	for _, c := range conns {
		c.Close()
	}
	for open() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := open(); got != 0 {
		t.Errorf("readiness open connections after closing them: %v, want 0", got)
	}
}

// metricValue is the value of the counter or gauge name with these label
// values (in label name order) in reg, or -1 if there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, values ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(values) {
				continue
			}
			for i, l := range m.GetLabel() {
				if l.GetValue() != values[i] {
					continue metrics
				}
			}
			return m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return -1
}

func TestEndpointsRejectLargeHeaders(t *testing.T) {
	s := start(t, Options{})
	for _, addr := range []string{s.MetricsAddr(), s.ReadinessAddr(), s.AdminAddr()} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/healthz/ready", nil)
		req.Header.Set("X-Pad", strings.Repeat("a", 256<<10))
		resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
		if err != nil {
			continue // closed on us: refused too
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("%s: a 256 KiB header got %d, want %d", addr, resp.StatusCode, http.StatusRequestHeaderFieldsTooLarge)
		}
	}
}

// blocking is a collector whose Collect waits until release is closed,
// counting the scrapes inside it.
type blocking struct {
	desc    *prometheus.Desc
	release chan struct{}
	mu      sync.Mutex
	inside  int
	most    int
}

func (b *blocking) Describe(ch chan<- *prometheus.Desc) { ch <- b.desc }
func (b *blocking) Collect(ch chan<- prometheus.Metric) {
	b.mu.Lock()
	b.inside++
	b.most = max(b.most, b.inside)
	b.mu.Unlock()
	<-b.release
	b.mu.Lock()
	b.inside--
	b.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(b.desc, prometheus.GaugeValue, 1)
}

func TestMetricsBoundsConcurrentScrapes(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := &blocking{desc: prometheus.NewDesc("slow", "A collector that blocks.", nil, nil), release: make(chan struct{})}
	reg.MustRegister(b)
	s := start(t, Options{Registry: reg})
	const n = maxScrapesInFlight + 6
	var wg sync.WaitGroup
	codes := make(chan int, n)
	for range n {
		wg.Go(func() {
			resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + s.MetricsAddr() + "/metrics")
			if err != nil {
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	time.Sleep(300 * time.Millisecond)
	close(b.release)
	wg.Wait()
	close(codes)
	busy := 0
	for c := range codes {
		if c == http.StatusServiceUnavailable {
			busy++
		}
	}
	if b.most > maxScrapesInFlight {
		t.Errorf("%d scrapes collected at once, want at most %d", b.most, maxScrapesInFlight)
	}
	if busy == 0 {
		t.Errorf("no scrape was turned away while %d were in flight", maxScrapesInFlight)
	}
}

// A config dump marshals every section into memory: concurrent callers must
// not each hold their own copy of a large directory.
func TestConfigDumpOneAtATime(t *testing.T) {
	var mu sync.Mutex
	inside, most := 0, 0
	release := make(chan struct{})
	s := start(t, Options{Sections: map[string]func() any{"x": func() any {
		mu.Lock()
		inside++
		most = max(most, inside)
		mu.Unlock()
		<-release
		mu.Lock()
		inside--
		mu.Unlock()
		return 1
	}}})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + s.AdminAddr() + "/config_dump")
			if err == nil {
				resp.Body.Close()
			}
		})
	}
	time.Sleep(200 * time.Millisecond)
	close(release)
	wg.Wait()
	if most > 1 {
		t.Errorf("%d config dumps built at once, want 1", most)
	}
}
