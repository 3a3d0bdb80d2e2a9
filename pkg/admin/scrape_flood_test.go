package admin

import (
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// costly is a collector whose every collection takes cost, as a large
// registry's gathering and writing do, and counts them.
type costly struct {
	desc  *prometheus.Desc
	cost  time.Duration
	calls atomic.Int64
}

func (c *costly) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }
func (c *costly) Collect(ch chan<- prometheus.Metric) {
	n := c.calls.Add(1)
	time.Sleep(c.cost)
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(n))
}

// TestMetricsScrapeFloodBounded: every pod reaches the metrics port, and a
// scrape's answer costs the agent in proportion to its series (1.1 s of
// CPU for 5000 istio_tcp_* series). The bounds on scrapes in flight (4, 2
// per address) bounded how many ran at once, not how often: one address
// asking again as soon as each answer came (with ever other headers, name[]
// filters, encodings) had every request rendered, two at a time, which
// kept two of the agent's cores busy for as long as it liked. Renderings
// are now made one at a time within a share of the time, and shared: the
// flood gets earlier renderings, and a scrape after it a fresh one.
func TestMetricsScrapeFloodBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := &costly{desc: prometheus.NewDesc("redirector_costly_total", "A collector that takes time.", nil, nil), cost: 20 * time.Millisecond}
	reg.MustRegister(c)
	s := start(t, Options{Registry: reg, scrapeBurst: time.Nanosecond})
	url := "http://" + s.MetricsAddr() + "/metrics"
	accepts := []string{"", "text/plain", "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
		"text/plain;version=0.0.4;escaping=allow-utf-8", "*/*", "application/openmetrics-text;version=1.0.0"}
	encodings := []string{"", "gzip", "br", "identity", "gzip;q=0"}

	const flood = 2 * time.Second
	var wg sync.WaitGroup
	var answered, failed atomic.Int64
	stop := time.Now().Add(flood)
	for g := range maxScrapesPerSource {
		wg.Go(func() {
			client := clientFrom("127.0.0.30")
			for i := g; time.Now().Before(stop); i++ {
				req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("%s?name[]=x%d", url, i), nil)
				req.Header.Set("Accept", accepts[i%len(accepts)])
				req.Header.Set("Accept-Encoding", encodings[i%len(encodings)])
				resp, err := client.Do(req)
				if err != nil {
					failed.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					answered.Add(1)
				}
			}
		})
	}
	wg.Wait()
	renders := c.calls.Load()
	t.Logf("%d scrapes answered (%d failed), %d renderings of %v in %v", answered.Load(), failed.Load(), renders, c.cost, flood)
	// Within the budget: a quarter of the time, plus what is under way.
	if most := int64(flood/c.cost/scrapeShare) + 3; renders > most {
		t.Errorf("a flood of scrapes from one address rendered %d times in %v, each taking %v: want at most %d (a quarter of the time)",
			renders, flood, c.cost, most)
	}
	if answered.Load() < 2*renders {
		t.Errorf("%d scrapes answered for %d renderings: the flood's scrapes are not answered from earlier renderings", answered.Load(), renders)
	}

	// Once the flood is over, a scrape gets a fresh rendering as soon as
	// the renderings' share of the time allows (at once with the default
	// credit; here, in at most 4 times the last rendering's time).
	var code int
	var body string
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		before := c.calls.Load()
		code, body = get(t, url)
		if c.calls.Load() > before {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no fresh rendering %v after a flood of scrapes ended", 3*time.Second)
		}
	}
	if want := fmt.Sprintf("redirector_costly_total %d\n", c.calls.Load()); code != http.StatusOK || !strings.Contains(body, want) {
		t.Errorf("a scrape after the flood: %d, want a fresh rendering (%q):\n%s", code, want, body)
	}
	if code, body = get(t, url); !strings.Contains(body, "redirector_metrics_scrapes_reused_total") {
		t.Errorf("%d: no redirector_metrics_scrapes_reused_total:\n%s", code, body)
	}
}

// TestMetricsScrapeFormats: a rendering is made in the format and encoding
// the scrape asks for (Prometheus's delimited protocol buffers or text,
// gzip or not), and each serves only scrapes of its kind.
func TestMetricsScrapeFormats(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := &costly{desc: prometheus.NewDesc("redirector_costly_total", "A collector that takes time.", nil, nil)}
	reg.MustRegister(c)
	s := start(t, Options{Registry: reg})
	url := "http://" + s.MetricsAddr() + "/metrics"
	for _, tc := range []struct {
		accept, encoding string
		proto, gzip      bool
	}{
		{"", "", false, false},
		{"application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,text/plain;version=0.0.4;q=0.3", "gzip", true, true},
		{"text/plain;version=0.0.4", "gzip, deflate", false, true},
		{"application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited", "gzip;q=0", true, false},
	} {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set("Accept", tc.accept)
		req.Header.Set("Accept-Encoding", tc.encoding)
		resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		body := io.Reader(resp.Body)
		if got := resp.Header.Get("Content-Encoding") == "gzip"; got != tc.gzip {
			t.Errorf("Accept-Encoding %q: gzip %v, want %v", tc.encoding, got, tc.gzip)
		} else if got {
			if body, err = gzip.NewReader(resp.Body); err != nil {
				t.Fatal(err)
			}
		}
		format := expfmt.ResponseFormat(resp.Header)
		if got := format.FormatType() == expfmt.TypeProtoDelim; got != tc.proto {
			t.Errorf("Accept %q: Content-Type %q, want protocol buffers %v", tc.accept, resp.Header.Get("Content-Type"), tc.proto)
		}
		dec := expfmt.NewDecoder(body, format)
		found := false
		for {
			var mf dto.MetricFamily
			if err := dec.Decode(&mf); err != nil {
				if err != io.EOF {
					t.Errorf("Accept %q, Accept-Encoding %q: decoding the answer: %v", tc.accept, tc.encoding, err)
				}
				break
			}
			found = found || mf.GetName() == "redirector_costly_total"
		}
		resp.Body.Close()
		if !found {
			t.Errorf("Accept %q, Accept-Encoding %q: no redirector_costly_total in the answer", tc.accept, tc.encoding)
		}
	}
}

// TestMetricsScrapeFloodLeavesPrometheusFresh: a flood of one kind of
// scrape takes the renderings' budget as soon as it is there; another kind
// (Prometheus's protocol buffers) must still get renderings of its own,
// none of its answers older than scrapeKeep (and a little), rather than
// the last one it got before the flood for as long as the flood lasts.
func TestMetricsScrapeFloodLeavesPrometheusFresh(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := &costly{desc: prometheus.NewDesc("redirector_costly_total", "A collector that takes time.", nil, nil), cost: 10 * time.Millisecond}
	reg.MustRegister(c)
	cache := newScrapeCache(promhttp.HandlerFor(reg, promhttp.HandlerOpts{AcceptedFormats: scrapeFormats}), time.Nanosecond, func() {})
	cache.keep = 200 * time.Millisecond
	srv := httptest.NewServer(cache)
	defer srv.Close()

	const flood = 2 * time.Second
	stop := time.Now().Add(flood)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for time.Now().Before(stop) {
				if resp, err := http.Get(srv.URL); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}
	// Prometheus: protocol buffers, every 50 ms; the value is the number
	// of the rendering it got.
	var seen float64
	since, worst := time.Now(), time.Duration(0)
	for time.Now().Before(stop) {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		req.Header.Set("Accept", string(scrapeFormats[0]))
		start := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var mf dto.MetricFamily
		err = expfmt.NewDecoder(resp.Body, expfmt.ResponseFormat(resp.Header)).Decode(&mf)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if v := mf.GetMetric()[0].GetCounter().GetValue(); v != seen {
			seen, since = v, start
		}
		worst = max(worst, time.Since(since))
		time.Sleep(50 * time.Millisecond)
	}
	wg.Wait()
	t.Logf("%d renderings; Prometheus's answers at most %v old", c.calls.Load(), worst)
	if most := cache.keep + 20*c.cost*scrapeShare; worst > most {
		t.Errorf("during a flood of text scrapes, Prometheus's answers were up to %v old, want at most %v", worst, most)
	}
}
