package kubeobj

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// SubzoneLabel is Istio's node label for a subzone, below Kubernetes'
// region and zone labels.
const SubzoneLabel = "topology.istio.io/subzone"

// TrafficDistributionAnnotation is Istio's way to ask for a Service's
// trafficDistribution on a Service or on its whole namespace (where the
// Kubernetes field is not set).
const TrafficDistributionAnnotation = "networking.istio.io/traffic-distribution"

// localityLabels are the node labels istiod reads a workload's locality
// from.
var localityLabels = []string{corev1.LabelTopologyRegion, corev1.LabelTopologyZone, SubzoneLabel}

// knownDistributions are the trafficDistribution values istiod maps to a
// routing preference.
var knownDistributions = []string{corev1.ServiceTrafficDistributionPreferClose, corev1.ServiceTrafficDistributionPreferSameZone, corev1.ServiceTrafficDistributionPreferSameNode}

// Locality is a node's place in the cluster's topology, from its labels.
type Locality struct{ Region, Zone, Subzone string }

// NodeLocality reads a node's locality from its labels.
func NodeLocality(labels map[string]string) Locality {
	return Locality{labels[corev1.LabelTopologyRegion], labels[corev1.LabelTopologyZone], labels[SubzoneLabel]}
}

// Set gives w the locality.
func (l Locality) Set(w *workload.Workload) {
	w.Region, w.Zone, w.Subzone = l.Region, l.Zone, l.Subzone
}

// Routing is svc's preference for endpoints close to the client, as
// istiod derives it for ztunnel: from spec.trafficDistribution, else the
// Service's networking.istio.io/traffic-distribution annotation, else its
// namespace's. PreferClose (PreferSameZone) ranks by network, region and
// zone; PreferSameNode by network, region, zone, subzone and node; both
// fail over to the next rank where the best has no endpoint. A Service
// with internalTrafficPolicy: Local has none (only its node's endpoints
// serve: NodeLocal). A field value istiod does not know (a newer API
// server's) is passed over for the annotations, as istiod does; an
// annotation value it does not know is an error naming it, and the
// service is balanced without a preference, as istiod does.
func Routing(svc *corev1.Service, ns *corev1.Namespace) (*workload.Routing, error) {
	if derefOr(svc.Spec.InternalTrafficPolicy, "") == corev1.ServiceInternalTrafficPolicyLocal {
		return nil, nil
	}
	value, from := derefOr(svc.Spec.TrafficDistribution, ""), "spec.trafficDistribution"
	if !slices.Contains(knownDistributions, value) {
		value = ""
	}
	if value == "" {
		value, from = svc.Annotations[TrafficDistributionAnnotation], "annotation "+TrafficDistributionAnnotation
	}
	if value == "" && ns != nil {
		value, from = ns.Annotations[TrafficDistributionAnnotation], "namespace "+ns.Name+"'s annotation "+TrafficDistributionAnnotation
	}
	preferClose := []workload.Scope{workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone}
	switch {
	case value == "":
		return nil, nil
	case strings.EqualFold(value, corev1.ServiceTrafficDistributionPreferClose), strings.EqualFold(value, corev1.ServiceTrafficDistributionPreferSameZone):
		return &workload.Routing{Scopes: preferClose}, nil
	case strings.EqualFold(value, corev1.ServiceTrafficDistributionPreferSameNode):
		return &workload.Routing{Scopes: append(preferClose, workload.ScopeSubzone, workload.ScopeNode)}, nil
	}
	// The value is quoted clipped: a tenant's may be hundreds of
	// kilobytes, logged at each translation of the Service.
	quoted := fmt.Sprintf("%.*q", maxQuotedRunes, value)
	if utf8.RuneCountInString(value) > maxQuotedRunes {
		quoted += " (clipped)"
	}
	return nil, fmt.Errorf("service %s/%s: %s %s is not a traffic distribution (PreferClose, PreferSameZone or PreferSameNode); endpoints are balanced without a preference", svc.Namespace, svc.Name, from, quoted)
}

// maxQuotedRunes is how much of a traffic distribution value istiod does
// not know its error quotes.
const maxQuotedRunes = 64

// clipDistribution returns what Routing reads of a traffic-distribution
// annotation's value: all of a value it knows, the start of one it does
// not (enough to quote it and to tell it was clipped). The trimmed objects
// the Kubernetes source caches on every node keep only that.
func clipDistribution(v string) string {
	n := 0
	for i := range v {
		if n == maxQuotedRunes+1 {
			return v[:i]
		}
		n++
	}
	return v
}
