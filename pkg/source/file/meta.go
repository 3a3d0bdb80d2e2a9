package file

import (
	"fmt"
	"regexp"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metavalidation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// The file source stands in for the API server: what it would refuse is
// refused here too, or a manifest the cluster would never hold is acted on
// as it reads to the agent. A namespace labelled "ambient " (a stray space)
// was simply not ambient, its pods unenrolled without a word; a policy
// selecting "app: web " selected nothing; a pod name or uid holding a '/'
// could take another pod's key (Workload.Key is namespace/name without a
// uid).

// nameRules is how the API server checks the name of each kind (core
// validation for the built-in kinds; Istio's CRDs take DNS-1123 subdomains).
var nameRules = map[string]apivalidation.ValidateNameFunc{
	"Namespace":           apivalidation.ValidateNamespaceName,
	"Node":                apivalidation.NameIsDNSSubdomain,
	"Pod":                 apivalidation.NameIsDNSSubdomain,
	"Service":             apivalidation.NameIsDNS1035Label,
	"EndpointSlice":       apivalidation.NameIsDNSSubdomain,
	"RuntimeClass":        apivalidation.NameIsDNSSubdomain,
	"PeerAuthentication":  apivalidation.NameIsDNSSubdomain,
	"AuthorizationPolicy": apivalidation.NameIsDNSSubdomain,
}

// trafficDistributions are the values the API server takes in a
// Service's spec.trafficDistribution.
var trafficDistributions = []string{corev1.ServiceTrafficDistributionPreferClose, corev1.ServiceTrafficDistributionPreferSameZone, corev1.ServiceTrafficDistributionPreferSameNode}

// uidPattern is what a manifest's pod uid may be: the API server sets
// uids itself (UUIDs), so a manifest's is checked only to be a token that
// cannot be read as a namespace/name key, nor be outsized.
var uidPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// validateObject checks obj, of kind, after its namespace was defaulted,
// as the API server checks an object it is asked to create: the metadata
// (names, namespace, labels, annotations, owner references, finalizers)
// and the fields of the spec that name something. The error lists every
// field that fails.
func validateObject(kind string, obj metav1.Object, namespaced bool) error {
	nameFn, ok := nameRules[kind]
	if !ok {
		return fmt.Errorf("no name rule for kind %s", kind) // a kind added without its rule
	}
	errs := apivalidation.ValidateObjectMetaAccessor(obj, namespaced, nameFn, field.NewPath("metadata"))
	if uid := string(obj.GetUID()); uid != "" && !uidPattern.MatchString(uid) {
		errs = append(errs, field.Invalid(field.NewPath("metadata", "uid"), uid,
			"must be 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"))
	}
	switch o := obj.(type) {
	case *corev1.Pod:
		if sa := o.Spec.ServiceAccountName; sa != "" {
			for _, msg := range apivalidation.NameIsDNSSubdomain(sa, false) {
				errs = append(errs, field.Invalid(field.NewPath("spec", "serviceAccountName"), sa, msg))
			}
		}
	case *corev1.Service:
		if td := o.Spec.TrafficDistribution; td != nil && !slices.Contains(trafficDistributions, *td) {
			errs = append(errs, field.NotSupported(field.NewPath("spec", "trafficDistribution"), *td, trafficDistributions))
		}
	case *peerAuthnDoc:
		errs = append(errs, validateSelector(o.Spec.Selector)...)
	case *authzDoc:
		errs = append(errs, validateSelector(o.Spec.Selector)...)
	}
	return errs.ToAggregate()
}

// validateSelector checks a policy's workload selector as Istio's webhook
// does: its keys and values must be label keys and values, or the
// selector matches no pod, and a DENY or STRICT policy would hold for no
// one without a word.
func validateSelector(sel *policy.WorkloadSelector) field.ErrorList {
	if sel == nil {
		return nil
	}
	return metavalidation.ValidateLabels(sel.MatchLabels, field.NewPath("spec", "selector", "matchLabels"))
}
