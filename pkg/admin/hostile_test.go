package admin

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"reflect"
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
// open connections are a gauge that falls back when they close. (The
// readiness endpoint evicts instead: TestReadinessProbeAmidStalledRequests.)
func TestEndpointsCountRefusedConnections(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := start(t, Options{Registry: reg})
	conns := openStalled(t, s.MetricsAddr(), maxConnsPerSource+5)
	refused := func() float64 {
		return metricValue(t, reg, "redirector_endpoint_refused_connections_total", "metrics", "per_source")
	}
	open := func() float64 { return metricValue(t, reg, "redirector_endpoint_open_connections", "metrics") }
	deadline := time.Now().Add(5 * time.Second)
	for refused() < 5 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := refused(); got != 5 {
		t.Errorf("metrics refused per source: %v, want 5", got)
	}
	if got := open(); got != maxConnsPerSource {
		t.Errorf("metrics open connections: %v, want %d", got, maxConnsPerSource)
	}
	for _, c := range conns {
		c.Close()
	}
	for open() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := open(); got != 0 {
		t.Errorf("metrics open connections after closing them: %v, want 0", got)
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
	for i := range n {
		wg.Go(func() {
			// Each from an address of its own: one address has one scrape
			// in flight at most (TestMetricsScrapesBoundedPerSource).
			resp, err := clientFrom(fmt.Sprintf("127.0.0.%d", 10+i)).Get("http://" + s.MetricsAddr() + "/metrics")
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

// dialFrom opens a connection to addr's port on 127.0.0.1 from the
// loopback address src: every 127/8 address reaches it, so one test plays
// many client addresses.
func dialFrom(t *testing.T, src, addr string) net.Conn {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: time.Second}
	c, err := d.Dial("tcp", net.JoinHostPort("127.0.0.1", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// ask sends one HTTP/1.1 request for path on c, keep-alive unless the
// server says otherwise, and returns the answer with its body read (or
// the error, if the connection was closed instead).
func ask(c net.Conn, path string) (*http.Response, error) {
	c.SetDeadline(time.Now().Add(2 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n", path); err != nil {
		return nil, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp, err
}

// idleClients opens n keep-alive connections to addr from src, each
// answered once and left idle, as a client that pools them does.
func idleClients(t *testing.T, src, addr, path string, n int) []net.Conn {
	t.Helper()
	var conns []net.Conn
	for range n {
		c := dialFrom(t, src, addr)
		if _, err := ask(c, path); err != nil {
			t.Fatalf("request from %s: %v", src, err)
		}
		conns = append(conns, c)
	}
	return conns
}

// TestReadinessProbeNotStarvedByIdleClients: 8 client addresses (pods),
// each within its 16 connections, sent one honest request on each and
// kept them idle: all 128 slots were held for the idle timeout (a minute,
// renewed at will), kubelet's probe was closed at accept and the agent
// stayed NotReady. The readiness endpoint keeps no connection alive now
// (kubelet reuses none), so the probe is answered.
func TestReadinessProbeNotStarvedByIdleClients(t *testing.T) {
	s := start(t, Options{})
	for i := range maxConnsPerEndpoint / maxConnsPerSource {
		idleClients(t, fmt.Sprintf("127.0.0.%d", 10+i), s.ReadinessAddr(), "/healthz/ready", maxConnsPerSource)
	}
	resp, err := ask(dialFrom(t, "127.0.0.200", s.ReadinessAddr()), "/healthz/ready")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("probe from a fresh address while %d addresses idled %d connections each: %v %v, want 200",
			maxConnsPerEndpoint/maxConnsPerSource, maxConnsPerSource, resp, err)
	}
}

// TestReadinessClosesConnectionAfterAnswer: the readiness endpoint answers
// "Connection: close" and closes, even to a client that asked for nothing.
func TestReadinessClosesConnectionAfterAnswer(t *testing.T) {
	s := start(t, Options{})
	c := dialFrom(t, "127.0.0.1", s.ReadinessAddr())
	resp, err := ask(c, "/healthz/ready")
	if err != nil {
		t.Fatal(err)
	}
	if !resp.Close {
		t.Errorf("readiness answer without Connection: close: %v", resp.Header)
	}
	if stillOpen(t, []net.Conn{c}) != 0 {
		t.Error("readiness endpoint keeps the connection open after its answer")
	}
}

// TestIdleConnectionEvictedAtBound: when an endpoint holds its 128
// connections, a new one evicts an idle keep-alive connection instead of
// being refused: the one idle longest of the client address holding the
// most connections. The eviction is counted.
func TestIdleConnectionEvictedAtBound(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := start(t, Options{Registry: reg})
	// One address holds 16, eight others 14 each: 128 in all, every one
	// idle. The server marks a connection idle after its answer is sent, so
	// the first waits a little for it to be the one idle longest however
	// the server's goroutines are scheduled.
	heavy := idleClients(t, "127.0.0.10", s.MetricsAddr(), "/metrics", 1)
	time.Sleep(50 * time.Millisecond)
	heavy = append(heavy, idleClients(t, "127.0.0.10", s.MetricsAddr(), "/metrics", maxConnsPerSource-1)...)
	for i := range 8 {
		idleClients(t, fmt.Sprintf("127.0.0.%d", 20+i), s.MetricsAddr(), "/metrics", (maxConnsPerEndpoint-maxConnsPerSource)/8)
	}
	resp, err := ask(dialFrom(t, "127.0.0.200", s.MetricsAddr()), "/metrics")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape from a fresh address while %d idle connections are open: %v %v, want 200", maxConnsPerEndpoint, resp, err)
	}
	if stillOpen(t, heavy[:1]) != 0 {
		t.Error("the heavy address's connection idle longest is still open")
	}
	if open := stillOpen(t, heavy[1:]); open != len(heavy)-1 {
		t.Errorf("%d of the heavy address's other %d connections still open, want all: one eviction makes room for one", open, len(heavy)-1)
	}
	if got := metricValue(t, reg, "redirector_endpoint_evicted_connections_total", "metrics"); got != 1 {
		t.Errorf("metrics evicted connections: %v, want 1", got)
	}
	if got := metricValue(t, reg, "redirector_endpoint_refused_connections_total", "metrics", "endpoint"); got > 0 {
		t.Errorf("metrics refused connections over the endpoint bound: %v, want none", got)
	}
}

// TestNewConnectionEvictsOwnIdleAtSourceBound: a client address at its own
// bound (the admin endpoint's 16, all from loopback) that opens another
// connection evicts its own connection idle longest, so a pooling client
// cannot lock itself (or a second local caller) out for a minute.
func TestNewConnectionEvictsOwnIdleAtSourceBound(t *testing.T) {
	s := start(t, Options{})
	conns := idleClients(t, "127.0.0.1", s.AdminAddr(), "/", 1)
	time.Sleep(50 * time.Millisecond) // idle longest (TestIdleConnectionEvictedAtBound)
	conns = append(conns, idleClients(t, "127.0.0.1", s.AdminAddr(), "/", maxConnsPerSource-1)...)
	resp, err := ask(dialFrom(t, "127.0.0.1", s.AdminAddr()), "/logging")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("a 17th connection while 16 idle: %v %v, want 200", resp, err)
	}
	if stillOpen(t, conns[:1]) != 0 {
		t.Error("the connection idle longest is still open")
	}
}

// TestMetricsScrapesBoundedPerSource: one client address that starts
// scrapes and does not read them (each held to the 30 s write timeout)
// took all 4 in-flight slots, and Prometheus got 503 meanwhile. An address
// now has one scrape in flight at a time; more are answered 503 at once,
// and another address is served.
func TestMetricsScrapesBoundedPerSource(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := &blocking{desc: prometheus.NewDesc("slow", "A collector that blocks.", nil, nil), release: make(chan struct{})}
	reg.MustRegister(b)
	s := start(t, Options{Registry: reg})
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(b.release) }) }
	defer release()

	scrape := func(src string, codes chan<- int) {
		resp, err := clientFrom(src).Get("http://" + s.MetricsAddr() + "/metrics")
		if err != nil {
			codes <- 0
			return
		}
		resp.Body.Close()
		codes <- resp.StatusCode
	}
	attacker := make(chan int, maxScrapesInFlight)
	for range maxScrapesInFlight {
		go scrape("127.0.0.10", attacker)
	}
	// All but maxScrapesPerSource of the attacker's are turned away
	// without waiting.
	for range maxScrapesInFlight - maxScrapesPerSource {
		select {
		case code := <-attacker:
			if code != http.StatusServiceUnavailable {
				t.Errorf("a scrape from one address past its %d answered %d, want 503", maxScrapesPerSource, code)
			}
		case <-time.After(2 * time.Second):
			t.Fatalf("scrapes from one address all wait: %d gathered at once", b.inFlight())
		}
	}
	// Another address's scrape is admitted: it waits for the rendering
	// under way (scrapeCache), where it was turned away before.
	other := make(chan int, 1)
	go scrape("127.0.0.20", other)
	select {
	case code := <-other:
		t.Fatalf("another address's scrape answered %d while one address has scrapes in flight, want it admitted", code)
	case <-time.After(300 * time.Millisecond):
	}
	release()
	if code := <-other; code != http.StatusOK {
		t.Errorf("another address's scrape answered %d, want 200", code)
	}
	for range maxScrapesPerSource {
		if code := <-attacker; code != http.StatusOK {
			t.Errorf("an admitted scrape answered %d, want 200", code)
		}
	}
}

// clientFrom is an HTTP client whose connections come from the loopback
// address src.
func clientFrom(src string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: time.Second}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
}

func (b *blocking) inFlight() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.inside
}

// stuckWriter is a ResponseWriter whose successful answer's body is never
// taken (a reader that does not read): Write blocks until release closes.
// Error answers are written at once.
type stuckWriter struct {
	header  http.Header
	code    int
	body    strings.Builder
	writing chan<- struct{}
	release <-chan struct{}
}

func (w *stuckWriter) Header() http.Header  { return w.header }
func (w *stuckWriter) WriteHeader(code int) { w.code = code }
func (w *stuckWriter) Write(p []byte) (int, error) {
	if w.code == 0 || w.code == http.StatusOK {
		w.writing <- struct{}{}
		<-w.release
	}
	return w.body.Write(p)
}

// TestConfigDumpsInFlightBounded: dumps were built one at a time, but each
// copy was held until its reader took it (up to a minute), so callers that
// did not read held a copy each. At most maxDumpsInFlight are now built or
// written at once; the next caller is answered 503 at once.
func TestConfigDumpsInFlightBounded(t *testing.T) {
	h := configDump(map[string]func() any{"x": func() any { return "dump" }})
	writing, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	for range maxDumpsInFlight {
		go h.ServeHTTP(&stuckWriter{header: http.Header{}, writing: writing, release: release}, httptest.NewRequest(http.MethodGet, "/config_dump", nil))
		select {
		case <-writing:
		case <-time.After(2 * time.Second):
			t.Fatal("a config dump is not written")
		}
	}
	done := make(chan *stuckWriter)
	go func() {
		w := &stuckWriter{header: http.Header{}, writing: writing, release: release}
		h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/config_dump", nil))
		done <- w
	}()
	select {
	case w := <-done:
		if w.code != http.StatusServiceUnavailable || !strings.Contains(w.body.String(), "busy") {
			t.Errorf("dump while %d are written: %d %q, want 503 busy", maxDumpsInFlight, w.code, w.body.String())
		}
	case <-writing:
		t.Errorf("a dump is built and written while %d others are held by readers that do not read", maxDumpsInFlight)
	case <-time.After(2 * time.Second):
		t.Error("a dump waits while others are written, want 503 at once")
	}
}

// aFunctionWhoseAddressIsLookedUp is resolved by pprof's symbol lookup.
func aFunctionWhoseAddressIsLookedUp() {}

// TestPprofSymbolBodyBounded: POST /debug/pprof/symbol read a body of any
// size while it held its whole answer in memory (a line per address), so a
// local caller made the agent hold more than it sent. A body over
// maxBodyBytes is refused with 413 now, and one within it still answered.
func TestPprofSymbolBodyBounded(t *testing.T) {
	s := start(t, Options{})
	pc := fmt.Sprintf("%#x", reflect.ValueOf(aFunctionWhoseAddressIsLookedUp).Pointer())
	post := func(body string) (int, string) {
		return requestBody(t, http.MethodPost, "http://"+s.AdminAddr()+"/debug/pprof/symbol", strings.NewReader(body))
	}
	if code, body := post(pc); code != http.StatusOK || !strings.Contains(body, "aFunctionWhoseAddressIsLookedUp") {
		t.Errorf("lookup of one address: %d %.200q, want 200 naming the function", code, body)
	}
	// 1 MiB of the address: unbounded, the answer was about 7 MiB.
	large := strings.Repeat(pc+"+", (1<<20)/(len(pc)+1))
	code, body := post(large)
	if code != http.StatusRequestEntityTooLarge || len(body) > 1<<10 {
		t.Errorf("lookup of %d bytes: %d with %d bytes of answer, want 413 and a short answer", len(large), code, len(body))
	}
}

// TestProfileDurationsBounded: the admin server had no write timeout, so a
// profile or trace ran as long as its seconds asked (10^9 s): the runtime's
// tracer stayed on, its buffers filling while the caller read nothing. A
// duration over maxProfileSeconds (or not a positive number) is refused
// now, saying the bound, for every profile that takes one.
func TestProfileDurationsBounded(t *testing.T) {
	s := start(t, Options{})
	for _, path := range []string{
		"/debug/pprof/trace?seconds=1000000000",
		"/debug/pprof/profile?seconds=61",
		"/debug/pprof/goroutine?seconds=3600", // a delta profile
		"/debug/pprof/heap?seconds=inf",
		"/debug/pprof/trace?seconds=NaN",
		"/debug/pprof/trace?seconds=-1",
	} {
		code, body := get(t, "http://"+s.AdminAddr()+path)
		if code != http.StatusBadRequest || !strings.Contains(body, fmt.Sprintf("at most %d seconds", maxProfileSeconds)) {
			t.Errorf("GET %s: %d %q, want 400 saying the %d s bound", path, code, body, maxProfileSeconds)
		}
	}
	if code, body := get(t, "http://"+s.AdminAddr()+"/debug/pprof/trace?seconds=0.1"); code != http.StatusOK {
		t.Errorf("a trace of 0.1 s: %d %.200q, want 200", code, body)
	}
}

// TestAdminServerWriteTimeoutAboveProfileBound: the admin server bounds
// how long an answer may take, just above the longest profile, so that
// pprof's own check of a duration against it applies and a caller that
// stops reading a profile is cut off.
func TestAdminServerWriteTimeoutAboveProfileBound(t *testing.T) {
	s := start(t, Options{})
	admin := s.servers[len(s.servers)-1] // started last
	if wt := admin.WriteTimeout; wt <= maxProfileSeconds*time.Second || wt > maxProfileSeconds*time.Second+10*time.Second {
		t.Errorf("admin server write timeout %v, want just above the %d s profile bound", wt, maxProfileSeconds)
	}
}

// TestEvictionSparesSmallerHolders: at the endpoint's bound a newcomer
// evicts an idle connection only from an address holding more than its
// own does. Before, an address whose connections were all busy could
// evict Prometheus's one idle keep-alive with its fifteenth.
func TestEvictionSparesSmallerHolders(t *testing.T) {
	prom, busy, fresh := connSource{addr: netip.MustParseAddr("127.0.0.30")}, connSource{addr: netip.MustParseAddr("127.0.0.31")}, connSource{addr: netip.MustParseAddr("127.0.0.32")}
	l := &limitListener{bySrc: map[connSource]int{prom: 1, busy: 14}, idle: map[*limitedConn]time.Time{}}
	scraper := &limitedConn{src: prom, l: l}
	l.idle[scraper] = time.Now()
	if v := l.evictable(busy, false); v != nil {
		t.Errorf("an address holding 14 evicted the idle connection of one holding 1")
	}
	if v := l.evictable(fresh, false); v != scraper {
		t.Errorf("a new address (holding none) did not evict the idle connection of one holding 1: %v", v)
	}
}
