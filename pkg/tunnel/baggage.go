package tunnel

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// HBONE metadata headers, as ztunnel sends them on every CONNECT
// (src/baggage.rs, src/proxy/outbound.rs): baggage carries the source
// workload's names, so a destination that does not know the client's
// address can still label its metrics; traceparent gives each tunnelled
// connection a W3C trace id that both ends' access logs show.
const (
	headerBaggage     = "baggage"
	headerTraceparent = "traceparent"
)

// peerMeta is what a client announced about itself in its baggage. Fields
// are empty when not announced.
type peerMeta struct {
	cluster, namespace, workload, service, revision, region, zone string
}

// baggageOf is the baggage value for the source workload w: ztunnel's
// keys, with the workload type in k8s.<type>.name.
func baggageOf(w *workload.Workload, cluster string) string {
	name, canon, rev := workloadMeta(w)
	typ := w.WorkloadType
	if typ == "" {
		typ = workload.TypePod
	}
	members := []string{
		"k8s.cluster.name=" + cluster,
		"k8s.namespace.name=" + w.Namespace,
		"k8s." + typ + ".name=" + name,
		"service.name=" + canon,
		"service.version=" + rev,
	}
	if w.Region != "" {
		members = append(members, "cloud.region="+w.Region)
	}
	if w.Zone != "" {
		members = append(members, "cloud.availability_zone="+w.Zone)
	}
	return strings.Join(members, ",")
}

// Bounds of announced values, as Kubernetes bounds what they name: a
// workload's (pod's, Deployment's, Job's) name is a DNS subdomain of up to
// 253 characters; namespaces, label values (canonical service and
// revision, region, zone) and cluster names (CLUSTER_ID is checked as a
// label value) are at most 63.
const (
	maxBaggageName  = 253
	maxBaggageValue = 63
)

// parseBaggage reads ztunnel's keys from the baggage headers of h. The
// announcement is a claim by the peer, so it is only taken when its
// namespace is the one of the peer's verified identity and it names a
// workload; otherwise, or without baggage, it returns nil. A value that is
// not a plain name (letters, digits, '-', '_' or '.', within its key's
// bound) is left out on its own, as are unknown keys: one odd value (a
// long Deployment name, a region with a space) does not cost the peer its
// other labels.
func parseBaggage(h http.Header, peer identity.ID) *peerMeta {
	vals := h.Values(headerBaggage)
	if len(vals) == 0 || peer.IsZero() {
		return nil
	}
	var m peerMeta
	for _, v := range vals {
		for _, member := range strings.Split(v, ",") {
			// A member may carry properties after ';'; ztunnel sends none.
			member, _, _ = strings.Cut(member, ";")
			k, val, ok := strings.Cut(strings.TrimSpace(member), "=")
			if !ok {
				continue
			}
			k, val = strings.TrimSpace(k), strings.TrimSpace(val)
			var field *string
			bound := maxBaggageValue
			switch k {
			case "k8s.cluster.name":
				field = &m.cluster
			case "k8s.namespace.name":
				field = &m.namespace
			case "k8s.deployment.name", "k8s.cronjob.name", "k8s.pod.name", "k8s.job.name":
				field, bound = &m.workload, maxBaggageName
			case "service.name":
				field = &m.service
			case "service.version":
				field = &m.revision
			case "cloud.region":
				field = &m.region
			case "cloud.availability_zone":
				field = &m.zone
			}
			if field != nil && plainName(val, bound) {
				*field = val
			}
		}
	}
	if m.namespace != peer.Namespace || m.workload == "" {
		return nil
	}
	return &m
}

// plainName reports whether s is at most bound letters, digits, '-', '_'
// or '.': safe as a label value and in a log line.
func plainName(s string, bound int) bool {
	if len(s) > bound {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// labels fills the source labels as ztunnel's with_derived_source does
// (source_app is the workload name there, not the canonical service).
func (m *peerMeta) labels(l prometheus.Labels) {
	set := func(k, v string) {
		if v != "" {
			l[k] = v
		}
	}
	set("source_workload", m.workload)
	set("source_canonical_service", m.service)
	set("source_canonical_revision", m.revision)
	set("source_workload_namespace", m.namespace)
	set("source_app", m.workload)
	set("source_version", m.revision)
	set("source_cluster", m.cluster)
	set("source_region", m.region)
	set("source_zone", m.zone)
}

// newTraceparent returns a W3C traceparent with a fresh random trace and
// span id, version 00 and no flags, as ztunnel starts one per connection.
func newTraceparent() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return "00-" + hex.EncodeToString(b[:16]) + "-" + hex.EncodeToString(b[16:]) + "-00"
}

// traceID returns the trace id of a well-formed traceparent from h, or "".
func traceID(h http.Header) string {
	v := h.Get(headerTraceparent)
	parts := strings.Split(v, "-")
	if len(parts) < 4 || len(parts[0]) != 2 || len(parts[1]) != 32 || len(parts[2]) != 16 || len(parts[3]) != 2 {
		return ""
	}
	for _, p := range parts[:4] {
		if _, err := hex.DecodeString(p); err != nil {
			return ""
		}
	}
	if parts[1] == strings.Repeat("0", 32) || strings.ToLower(parts[1]) != parts[1] {
		return ""
	}
	return parts[1]
}

// traceIDOf returns the trace id of a traceparent value made by
// newTraceparent.
func traceIDOf(tp string) string {
	if len(tp) < 35 {
		return ""
	}
	return tp[3:35]
}
