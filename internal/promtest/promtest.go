// Package promtest reads what a Prometheus collector exports, for tests.
package promtest

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Scrape registers c with a pedantic registry (which checks descriptors and
// label consistency), gathers it and returns every counter and gauge by
// name{label="value",...}. Any other metric type fails the test.
func Scrape(t testing.TB, c prometheus.Collector) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatalf("register: %v", err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	out := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			key := f.GetName()
			if len(labels) > 0 {
				key += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[key] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[key] = m.GetGauge().GetValue()
			default:
				t.Fatalf("%s is neither a counter nor a gauge", key)
			}
		}
	}
	return out
}
