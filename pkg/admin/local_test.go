package admin

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The admin endpoint is on loopback: every process of the node's network
// namespace reaches it (a hostNetwork pod's too), and so does a browser
// running on the node, for a page of any site. These tests hold it to what
// such callers may not do.

// adminRequest sends method path to the admin endpoint with the headers
// given (Host among them) and returns the status and body.
func adminRequest(t *testing.T, s *Servers, method, path string, headers map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+s.AdminAddr()+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range headers {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	return do(t, req)
}

// TestAdminRefusesForeignHost: a page whose DNS name is rebound to
// 127.0.0.1 after it loaded is same-origin with the admin endpoint in the
// browser's eyes, and read the config dump (every workload, policy and
// certificate chain) and profiles; its requests carry the page's name as
// Host. The admin endpoint answers only requests addressed to an IP
// address or localhost now, and says why it refuses the others.
func TestAdminRefusesForeignHost(t *testing.T) {
	s := start(t, Options{Sections: map[string]func() any{"workloads": func() any { return "secret-ish" }}})
	_, port, _ := strings.Cut(s.AdminAddr(), ":")
	for _, host := range []string{"rebind.example:" + port, "rebind.example", "localhost.rebind.example:" + port, "127.0.0.1.nip.io:" + port} {
		code, body := adminRequest(t, s, http.MethodGet, "/config_dump", map[string]string{"Host": host})
		if code != http.StatusMisdirectedRequest || strings.Contains(body, "secret-ish") || !strings.Contains(body, "Host") {
			t.Errorf("config dump with Host %q: %d %.200q, want 421 naming the Host, without the dump", host, code, body)
		}
	}
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "LOCALHOST", "[::1]:" + port, "10.0.0.7:" + port, ""} {
		if code, body := adminRequest(t, s, http.MethodGet, "/config_dump", map[string]string{"Host": host}); code != http.StatusOK {
			t.Errorf("config dump with Host %q: %d %.200q, want 200", host, code, body)
		}
	}
}

// TestAdminRefusesCrossOriginChange: a page of any site may POST a form to
// http://127.0.0.1:15000/logging?level=off (a simple request: the browser
// sends it without asking), which turned the agent's logging off. A
// request a browser marks as cross-origin is refused now, and changes
// nothing; istioctl and curl send no such marks.
func TestAdminRefusesCrossOriginChange(t *testing.T) {
	level := new(slog.LevelVar)
	s := start(t, Options{Level: level})
	for _, h := range []map[string]string{
		{"Origin": "http://evil.example"},
		{"Sec-Fetch-Site": "cross-site"},
		{"Origin": "null"},
	} {
		code, body := adminRequest(t, s, http.MethodPost, "/logging?level=off", h)
		if code != http.StatusForbidden {
			t.Errorf("POST /logging?level=off with %v: %d %.200q, want 403", h, code, body)
		}
		if level.Level() != slog.LevelInfo {
			t.Fatalf("POST /logging?level=off with %v changed the level to %v", h, level.Level())
		}
	}
	// An image tag of any page starts a CPU profile with a GET.
	if code, body := adminRequest(t, s, http.MethodGet, "/debug/pprof/profile?seconds=1", map[string]string{"Sec-Fetch-Site": "cross-site"}); code != http.StatusForbidden {
		t.Errorf("cross-site GET of a profile: %d %.200q, want 403", code, body)
	}
	if code, body := adminRequest(t, s, http.MethodPost, "/logging?level=debug", map[string]string{"Sec-Fetch-Site": "none"}); code != http.StatusOK {
		t.Errorf("POST /logging typed into the browser's address bar (Sec-Fetch-Site none): %d %q, want 200", code, body)
	}
	if code, body := adminRequest(t, s, http.MethodPost, "/logging?level=debug", nil); code != http.StatusOK || level.Level() != slog.LevelDebug {
		t.Errorf("POST /logging?level=debug without browser headers: %d %q, level %v, want 200 and debug", code, body, level.Level())
	}
}

// TestPprofInFlightBounded: a goroutine dump (debug=2) is built in a
// buffer of up to 64 MiB, doubling from 1 MiB with the world stopped for
// each try, and held until the caller reads it (up to the admin write
// timeout, 65 s); every one of the admin's 16 connections could hold one.
// At most maxProfilesInFlight pprof answers are built or written at once
// now, and the next caller is answered 503 at once.
func TestPprofInFlightBounded(t *testing.T) {
	h := adminHandler(nil, new(slog.LevelVar), slog.Default())
	writing, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	for range maxProfilesInFlight {
		go h.ServeHTTP(&stuckWriter{header: http.Header{}, writing: writing, release: release}, localRequest("/debug/pprof/goroutine?debug=2"))
		select {
		case <-writing:
		case <-time.After(2 * time.Second):
			t.Fatal("a goroutine dump is not written")
		}
	}
	for _, path := range []string{"/debug/pprof/goroutine?debug=2", "/debug/pprof/heap?gc=1", "/debug/pprof/profile?seconds=1", "/debug/pprof/trace?seconds=1"} {
		done := make(chan *stuckWriter)
		go func() {
			w := &stuckWriter{header: http.Header{}, writing: writing, release: release}
			h.ServeHTTP(w, localRequest(path))
			done <- w
		}()
		select {
		case w := <-done:
			if w.code != http.StatusServiceUnavailable || !strings.Contains(w.body.String(), "busy") {
				t.Errorf("%s while %d are written: %d %.200q, want 503 busy", path, maxProfilesInFlight, w.code, w.body.String())
			}
		case <-writing:
			t.Errorf("%s is served while %d others are held by readers that do not read", path, maxProfilesInFlight)
		case <-time.After(5 * time.Second):
			t.Errorf("%s waits while others are written, want 503 at once", path)
		}
	}
}

// localRequest is a GET of path as a local caller sends it.
func localRequest(path string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, path, nil)
	r.Host = "127.0.0.1:15000"
	return r
}

// TestReadinessProbeAmidStalledRequests: kubelet probes a hostNetwork
// agent from the node's own address, which every hostNetwork pod may
// connect from too. One such pod that kept 16 connections from that
// address half-way through a request (renewed within the 5 s header
// timeout) had kubelet's probe closed at accept, and 8 pods doing so
// from their addresses (or one pod from 8 loopback addresses) every
// probe: the agent stayed NotReady for as long as they liked. A stalled
// request is not idle, so it was never evicted. The readiness endpoint's
// honest clients send their request at once and are answered at once, so
// a connection over a bound now evicts the one open longest of the source
// holding the most, its own source's if that is the bound.
func TestReadinessProbeAmidStalledRequests(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := start(t, Options{Registry: reg})
	stall := func(src string, n int) {
		for range n {
			c := dialFrom(t, src, s.ReadinessAddr())
			if _, err := c.Write([]byte("GET /healthz/ready HTTP/1.1\r\nHost: x\r\n")); err != nil {
				t.Fatal(err)
			}
		}
	}
	stall("127.0.0.1", maxConnsPerSource) // the node's address, kubelet's
	time.Sleep(50 * time.Millisecond)     // open longer than the probe
	resp, err := ask(dialFrom(t, "127.0.0.1", s.ReadinessAddr()), "/healthz/ready")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("probe from an address holding %d stalled requests: %v %v, want 200", maxConnsPerSource, resp, err)
	}
	for i := range maxConnsPerEndpoint / maxConnsPerSource {
		stall(fmt.Sprintf("127.0.0.%d", 10+i), maxConnsPerSource)
	}
	time.Sleep(50 * time.Millisecond)
	for _, src := range []string{"127.0.0.1", "127.0.0.200"} {
		resp, err := ask(dialFrom(t, src, s.ReadinessAddr()), "/healthz/ready")
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("probe from %s while the endpoint's %d connections are stalled requests: %v %v, want 200", src, maxConnsPerEndpoint, resp, err)
		}
	}
	if got := metricValue(t, reg, "redirector_endpoint_evicted_connections_total", "readiness"); got < 2 {
		t.Errorf("readiness evictions: %v, want the probes' counted", got)
	}
}
