package admin

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// start serves every endpoint on loopback ports the kernel picks.
func start(t *testing.T, o Options) *Servers {
	t.Helper()
	if o.Registry == nil {
		o.Registry = prometheus.NewRegistry()
	}
	if o.Ready == nil {
		o.Ready = func() (bool, string) { return true, "" }
	}
	if o.Level == nil {
		o.Level = new(slog.LevelVar)
	}
	o.MetricsAddr, o.ReadinessAddr, o.AdminAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	s, err := Start(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func request(t *testing.T, method, url string) (int, string) {
	t.Helper()
	return requestBody(t, method, url, nil)
}

func requestBody(t *testing.T, method, url string, body io.Reader) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	return do(t, req)
}

// do sends req and returns the status and body.
func do(t *testing.T, req *http.Request) (int, string) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	return request(t, http.MethodGet, url)
}

func TestReadinessFollowsCheck(t *testing.T) {
	var reconciled atomic.Bool
	s := start(t, Options{Ready: func() (bool, string) {
		if !reconciled.Load() {
			return false, "first full reconcile pending"
		}
		return true, ""
	}})
	url := "http://" + s.ReadinessAddr() + "/healthz/ready"

	code, body := get(t, url)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "first full reconcile pending") {
		t.Errorf("before: %d %q, want 503 with the reason", code, body)
	}
	reconciled.Store(true)
	if code, body := get(t, url); code != http.StatusOK {
		t.Errorf("after: %d %q, want 200", code, body)
	}
}

func TestAllReadyListsEveryReason(t *testing.T) {
	ok := func() (bool, string) { return true, "" }
	ready := AllReady(ok, func() (bool, string) { return false, "a" }, ok, func() (bool, string) { return false, "b" })
	if r, reason := ready(); r || reason != "a; b" {
		t.Errorf("got %v %q, want not ready with %q", r, reason, "a; b")
	}
	if r, reason := AllReady(ok, ok)(); !r || reason != "" {
		t.Errorf("got %v %q, want ready", r, reason)
	}
}

func TestConfigDumpSections(t *testing.T) {
	notAfter := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	s := start(t, Options{Sections: map[string]func() any{
		SectionPods: func() any {
			return []PodRow{{Namespace: "shop", Name: "web", Enrolled: true, Reason: "namespace shop has istio.io/dataplane-mode=ambient"}}
		},
		SectionWorkloads: func() any { return []map[string]string{{"name": "web"}} },
		SectionServices:  func() any { return []string{} },
		SectionPolicies:  func() any { return Policies{PeerAuthentications: []string{}, AuthorizationPolicies: nil} },
		SectionCerts: func() any {
			return []CertRow{{Identity: "spiffe://cluster.local/ns/shop/sa/web", Serial: "1f", NotAfter: notAfter, Issuer: "O=mesh", State: "valid"}}
		},
	}})
	code, body := get(t, "http://"+s.AdminAddr()+"/config_dump")
	if code != http.StatusOK {
		t.Fatalf("%d %s", code, body)
	}
	var dump map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &dump); err != nil {
		t.Fatalf("config dump is not JSON: %v\n%s", err, body)
	}
	for _, name := range []string{SectionPods, SectionWorkloads, SectionServices, SectionPolicies, SectionCerts} {
		if !json.Valid(dump[name]) {
			t.Errorf("section %s missing or invalid: %q", name, dump[name])
		}
	}

	var policies map[string]any
	if err := json.Unmarshal(dump[SectionPolicies], &policies); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"peerAuthentications", "authorizationPolicies"} {
		if _, ok := policies[k]; !ok {
			t.Errorf("policies has no %s: %v", k, policies)
		}
	}

	// The field names `redirector inspect certs` decodes.
	var certs []map[string]any
	if err := json.Unmarshal(dump[SectionCerts], &certs); err != nil || len(certs) != 1 {
		t.Fatalf("certs: %v %s", err, dump[SectionCerts])
	}
	var keys []string
	for k := range certs[0] {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if want := []string{"ca", "identity", "issuer", "notAfter", "notBefore", "refreshAt", "serial", "state"}; !slices.Equal(keys, want) {
		t.Errorf("cert row keys %v, want %v", keys, want)
	}
	if certs[0]["notAfter"] != notAfter.Format(time.RFC3339) {
		t.Errorf("notAfter %v, want RFC 3339 %s", certs[0]["notAfter"], notAfter.Format(time.RFC3339))
	}
}

func TestConfigDumpNamesFailingSection(t *testing.T) {
	s := start(t, Options{Sections: map[string]func() any{
		SectionPods:     func() any { return []PodRow{} },
		SectionServices: func() any { return make(chan int) }, // not JSON
	}})
	code, body := get(t, "http://"+s.AdminAddr()+"/config_dump")
	if code != http.StatusInternalServerError || !strings.Contains(body, "section services") {
		t.Errorf("%d %q, want 500 naming the services section", code, body)
	}
}

func TestLoggingLevel(t *testing.T) {
	level := new(slog.LevelVar)
	s := start(t, Options{Level: level})
	url := "http://" + s.AdminAddr() + "/logging"

	if code, body := get(t, url); code != http.StatusOK || body != "level=info\n" {
		t.Errorf("GET: %d %q, want the current level info", code, body)
	}
	if code, body := request(t, http.MethodPost, url+"?level=debug"); code != http.StatusOK || body != "level=debug\n" {
		t.Errorf("POST debug: %d %q", code, body)
	}
	if level.Level() != slog.LevelDebug {
		t.Errorf("level is %s after POST debug", level.Level())
	}
	if code, body := request(t, http.MethodPost, url+"?level=verbose"); code != http.StatusBadRequest || !strings.Contains(body, `"verbose"`) {
		t.Errorf("POST verbose: %d %q, want 400 naming the value", code, body)
	}
	if code, body := request(t, http.MethodPost, url); code != http.StatusOK || body != "level=debug\n" {
		t.Errorf("POST without a level: %d %q, want the level shown, as ztunnel does", code, body)
	}
	if code, _ := get(t, url+"?level=error"); code != http.StatusMethodNotAllowed {
		t.Errorf("GET with a level: %d, want 405", code)
	}
	if level.Level() != slog.LevelDebug {
		t.Errorf("level changed to %s by rejected requests", level.Level())
	}
}

func TestPprofOnlyOnAdmin(t *testing.T) {
	s := start(t, Options{})
	if code, body := get(t, "http://"+s.AdminAddr()+"/debug/pprof/"); code != http.StatusOK || !strings.Contains(body, "goroutine") {
		t.Errorf("pprof index: %d %.200q", code, body)
	}
	if code, _ := get(t, "http://"+s.AdminAddr()+"/debug/pprof/goroutine?debug=1"); code != http.StatusOK {
		t.Errorf("goroutine profile: %d", code)
	}
	for _, addr := range []string{s.MetricsAddr(), s.ReadinessAddr()} {
		if code, _ := get(t, "http://"+addr+"/debug/pprof/"); code != http.StatusNotFound {
			t.Errorf("pprof on %s: %d, want 404", addr, code)
		}
	}
}

// TestStartBindsTakenPortLater: an endpoint address in use failed the
// start, and the agent exited; any hostNetwork pod that bound the port
// while the agent restarted (after a crash, or a restart without
// hand-over) kept it from ever starting again, and the enrolled pods'
// tunnels down. The agent now starts without the endpoint, not ready and
// naming it, and serves it once the address is free.
func TestStartBindsTakenPortLater(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	addr := busy.Addr().String()
	s, err := Start(context.Background(), Options{
		ReadinessAddr: "127.0.0.1:0", Ready: func() (bool, string) { return true, "" },
		MetricsAddr: addr, Registry: prometheus.NewRegistry(),
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		bindRetry: 20 * time.Millisecond,
	})
	if err != nil {
		t.Fatalf("start with the metrics address in use: %v, want a start without it", err)
	}
	defer s.Close()
	if s.Listener(EndpointMetrics) != nil {
		t.Error("the listener of an endpoint not bound is handed over")
	}
	code, body := get(t, "http://"+s.ReadinessAddr()+"/healthz/ready")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "metrics endpoint") || !strings.Contains(body, addr) || !strings.Contains(body, "in use") {
		t.Errorf("readiness while the metrics address is in use: %d %q, want 503 naming the endpoint, %s and why", code, body, addr)
	}
	time.Sleep(100 * time.Millisecond) // a few retries fail
	busy.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			if code, _ := get(t, "http://"+addr+"/metrics"); code == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics endpoint not served once its address is free: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code, body := get(t, "http://"+s.ReadinessAddr()+"/healthz/ready"); code != http.StatusOK {
		t.Errorf("readiness once every endpoint is served: %d %q, want 200", code, body)
	}
	if s.Listener(EndpointMetrics) == nil {
		t.Error("the bound endpoint's listener is not handed over")
	}
}

// TestStartReportsBadAddress: an address that can never be bound still
// fails the start, naming the endpoint.
func TestStartReportsBadAddress(t *testing.T) {
	_, err := Start(context.Background(), Options{
		ReadinessAddr: "127.0.0.1:0", Ready: func() (bool, string) { return true, "" },
		MetricsAddr: "127.0.0.1:99999", Registry: prometheus.NewRegistry(),
	})
	if err == nil || !strings.Contains(err.Error(), "metrics endpoint") {
		t.Errorf("got %v, want an error naming the metrics endpoint", err)
	}
}

func TestStartRequiresSources(t *testing.T) {
	for name, o := range map[string]Options{
		"metrics without registry": {MetricsAddr: ":0"},
		"readiness without check":  {ReadinessAddr: ":0"},
		"admin without level":      {AdminAddr: "127.0.0.1:0"},
	} {
		if _, err := Start(context.Background(), o); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestCloseStopsServing(t *testing.T) {
	s := start(t, Options{})
	addr := s.ReadinessAddr()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Errorf("%s still accepts connections after Close", addr)
	}
}
