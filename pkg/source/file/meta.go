package file

import (
	"fmt"
	"regexp"
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metavalidation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilvalidation "k8s.io/apimachinery/pkg/util/validation"
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
		for _, list := range []struct {
			name       string
			containers []corev1.Container
		}{{"initContainers", o.Spec.InitContainers}, {"containers", o.Spec.Containers}} {
			for i, c := range list.containers {
				errs = append(errs, validateContainerPorts(c.Ports, field.NewPath("spec", list.name).Index(i).Child("ports"))...)
			}
		}
	case *corev1.Service:
		if td := o.Spec.TrafficDistribution; td != nil && !slices.Contains(trafficDistributions, *td) {
			errs = append(errs, field.NotSupported(field.NewPath("spec", "trafficDistribution"), *td, trafficDistributions))
		}
		errs = append(errs, validateServicePorts(o.Spec.Ports, field.NewPath("spec", "ports"))...)
	case *discoveryv1.EndpointSlice:
		errs = append(errs, validateSlicePorts(o.Ports, field.NewPath("ports"))...)
	case *peerAuthnDoc:
		errs = append(errs, validateSelector(o.Spec.Selector)...)
	case *authzDoc:
		errs = append(errs, validateSelector(o.Spec.Selector)...)
	}
	return errs.ToAggregate()
}

// Ports are checked as the API server checks them: a number outside
// 1-65535, a protocol spelled other than TCP, UDP or SCTP, a name that is
// none, a service port or name listed twice. Taken as written, a number
// over 65535 was another port once cut to 16 bits (65616 is 80), "tcp"
// made a port no TCP port, and of two entries for one port or name the
// last won without a word. (The API server leaves an EndpointSlice's port
// numbers unchecked; a number no port has is refused here all the same.)

// protocols are the port protocols the API server takes.
var protocols = []string{string(corev1.ProtocolTCP), string(corev1.ProtocolUDP), string(corev1.ProtocolSCTP)}

// validateServicePorts checks a Service's spec.ports.
func validateServicePorts(ports []corev1.ServicePort, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	names := map[string]bool{}
	type portKey struct {
		port     int32
		protocol corev1.Protocol
	}
	seen := map[portKey]bool{}
	for i, p := range ports {
		at := path.Index(i)
		switch {
		case p.Name == "" && len(ports) > 1:
			errs = append(errs, field.Required(at.Child("name"), "each port of a service with several is named"))
		case p.Name != "":
			errs = append(errs, invalid(at.Child("name"), p.Name, utilvalidation.IsDNS1123Label(p.Name))...)
			if names[p.Name] {
				errs = append(errs, field.Duplicate(at.Child("name"), p.Name))
			}
			names[p.Name] = true
		}
		errs = append(errs, invalid(at.Child("port"), p.Port, utilvalidation.IsValidPortNum(int(p.Port)))...)
		errs = append(errs, validateProtocol(at.Child("protocol"), p.Protocol)...)
		// An empty or zero targetPort is the port itself, as the API
		// server defaults it.
		switch tp := p.TargetPort; {
		case tp.Type == intstr.String && tp.StrVal != "":
			errs = append(errs, invalid(at.Child("targetPort"), tp.StrVal, utilvalidation.IsValidPortName(tp.StrVal))...)
		case tp.Type == intstr.Int && tp.IntVal != 0:
			errs = append(errs, invalid(at.Child("targetPort"), tp.IntVal, utilvalidation.IsValidPortNum(int(tp.IntVal)))...)
		}
		k := portKey{p.Port, p.Protocol}
		if k.protocol == "" {
			k.protocol = corev1.ProtocolTCP
		}
		if seen[k] {
			errs = append(errs, field.Duplicate(at, fmt.Sprintf("%d/%s", k.port, k.protocol)))
		}
		seen[k] = true
	}
	return errs
}

// validateSlicePorts checks an EndpointSlice's ports.
func validateSlicePorts(ports []discoveryv1.EndpointPort, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	names := map[string]bool{}
	for i, p := range ports {
		at := path.Index(i)
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		if name != "" {
			errs = append(errs, invalid(at.Child("name"), name, utilvalidation.IsDNS1123Label(name))...)
		}
		if names[name] {
			errs = append(errs, field.Duplicate(at.Child("name"), name))
		}
		names[name] = true
		if p.Port != nil {
			errs = append(errs, invalid(at.Child("port"), *p.Port, utilvalidation.IsValidPortNum(int(*p.Port)))...)
		}
		if p.Protocol != nil {
			errs = append(errs, validateProtocol(at.Child("protocol"), *p.Protocol)...)
		}
	}
	return errs
}

// validateContainerPorts checks one container's ports.
func validateContainerPorts(ports []corev1.ContainerPort, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	names := map[string]bool{}
	for i, p := range ports {
		at := path.Index(i)
		if p.Name != "" {
			if msgs := utilvalidation.IsValidPortName(p.Name); len(msgs) > 0 {
				errs = append(errs, invalid(at.Child("name"), p.Name, msgs)...)
			} else if names[p.Name] {
				errs = append(errs, field.Duplicate(at.Child("name"), p.Name))
			}
			names[p.Name] = true
		}
		errs = append(errs, invalid(at.Child("containerPort"), p.ContainerPort, utilvalidation.IsValidPortNum(int(p.ContainerPort)))...)
		errs = append(errs, validateProtocol(at.Child("protocol"), p.Protocol)...)
	}
	return errs
}

// validateProtocol checks a port's protocol; empty is TCP, as the API
// server defaults it.
func validateProtocol(path *field.Path, p corev1.Protocol) field.ErrorList {
	if p == "" || slices.Contains(protocols, string(p)) {
		return nil
	}
	return field.ErrorList{field.NotSupported(path, p, protocols)}
}

// invalid turns a validation function's messages about value into errors.
func invalid(path *field.Path, value any, msgs []string) field.ErrorList {
	var errs field.ErrorList
	for _, m := range msgs {
		errs = append(errs, field.Invalid(path, value, m))
	}
	return errs
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
