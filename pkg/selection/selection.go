// Package selection decides which pods the agent enrolls in the mesh. It is
// Istio ambient's enrollment rules as a pure function, so the Kubernetes and
// file sources, the reconciler and the inspect CLI all agree on the outcome
// and on the reason shown to the user.
package selection

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Labels and annotations the rules read. They are Istio's, so manifests
// written for Istio ambient select the same pods here.
const (
	DataplaneModeLabel      = "istio.io/dataplane-mode"
	DataplaneModeAmbient    = "ambient"
	DataplaneModeNone       = "none"
	SidecarStatusAnnotation = "sidecar.istio.io/status"
	BypassInboundAnnotation = "ambient.istio.io/bypass-inbound-capture"
	// DNSCaptureAnnotation turns the DNS capture of one pod on or off,
	// over the node's setting (istio-cni's ambient.istio.io/dns-capture).
	DNSCaptureAnnotation = "ambient.istio.io/dns-capture"
	// RedirectionAnnotation is set to "enabled" on a pod whose traffic the
	// node's dataplane redirects (istio-cni sets it; istiod reads it).
	RedirectionAnnotation = "ambient.istio.io/redirection"
	// GatewayClassLabel and WaypointGatewayClass mark a waypoint's pod
	// (Istio's waypoint template sets them); the rules do not read them,
	// the reason of an enrolled waypoint does.
	GatewayClassLabel    = "gateway.networking.k8s.io/gateway-class-name"
	WaypointGatewayClass = "istio-waypoint"
)

// ErrBadPodAddr marks a pod address that cannot be a pod's own: enrolling
// it would capture traffic that is not the pod's (loopback, multicast) or
// match every packet (unspecified). Such a pod is left out, with the reason.
// Services' VIPs and endpoints are held to the same rule, so the text names
// no kind of object.
var ErrBadPodAddr = errors.New("not the address of one host in the cluster")

// ErrUnknownRuntimeClass marks a pod whose RuntimeClass the lookup does not
// know: the agent cannot tell whether the pod runs in a sandbox it must skip,
// so it leaves the pod alone and the caller should log the error.
var ErrUnknownRuntimeClass = errors.New("unknown runtime class")

// Config is the operator's part of the rules.
type Config struct {
	// ExcludeNamespaces are never enrolled (kube-system, typically, as
	// istio-cni's excludeNamespaces).
	ExcludeNamespaces []string
	// SkipRuntimeClasses are RuntimeClass handlers (not class names) whose
	// pods are never enrolled: VM-sandboxed runtimes such as Kata have their
	// own kernel, so in-pod eBPF on the node cannot see their traffic.
	SkipRuntimeClasses []string
	// NamespaceViewLags is set by sources that watch namespaces: the API
	// server admits no pod of a namespace that does not exist, so a pod
	// whose namespace is missing from their view is one the view has not
	// caught up with. Unless another rule decides first, such a pod is
	// Undecided (its CNI ADD fails and is retried) rather than out: it
	// would start unmeshed if its namespace is ambient. Istio's plugin
	// reads the namespace from the API server at the ADD. Sources whose
	// objects are all there is (the file source) leave it false: a
	// namespace they lack has no label.
	NamespaceViewLags bool
}

// HandlerLookup maps a RuntimeClass name to its handler; ok is false when
// the class does not exist. The Kubernetes source backs it with an informer.
type HandlerLookup func(className string) (handler string, ok bool)

// Decision is the outcome for one pod.
type Decision struct {
	Enrolled bool
	// Reason is a short human sentence naming the rule that decided.
	Reason string
	// BypassInbound turns inbound capture off while outbound stays on.
	BypassInbound bool
	// DNSCapture is the pod's own choice about DNS capture.
	DNSCapture workload.Choice
	// Err is set when the pod is left out because of a problem the
	// operator should fix (wraps ErrUnknownRuntimeClass); Reason repeats it.
	Err error
	// Pending is set, with Enrolled false, when the rules select the pod
	// but it has no IP yet: it is the reason the pod is enrolled under once
	// its addresses are known (the CNI plugin reports them before the API
	// server does).
	Pending string
	// Undecided is set, with Enrolled false, when the agent cannot tell
	// yet whether the rules select the pod (its namespace is not in the
	// agent's view yet, Config.NamespaceViewLags) or whether its runtime
	// may be meshed (its RuntimeClass is not in the view yet: the API
	// server admits no pod of an unknown class, so the view lags). The CNI
	// ADD fails rather than let the pod start unmeshed; the runtime
	// retries.
	Undecided string
}

// Decide applies the rules to pod, whose namespace object is ns (nil if
// unknown). The opt-in rules are evaluated first, first match wins:
//
//  1. namespace in cfg.ExcludeNamespaces: out
//  2. hostNetwork: out (the pod has no netns of its own)
//  3. sidecar.istio.io/status annotation: out (a sidecar already captures)
//  4. pod label istio.io/dataplane-mode=none: out
//  5. pod label istio.io/dataplane-mode=ambient: in
//  6. namespace label istio.io/dataplane-mode=ambient: in (a namespace
//     not in view is Undecided with cfg.NamespaceViewLags)
//  7. otherwise out.
//
// A pod the rules enroll is still left out when its phase is Succeeded or
// Failed, when its RuntimeClass handler is skipped or the class is unknown
// (checked only when cfg.SkipRuntimeClasses is set; lookup may be nil
// otherwise), when it has no IP yet, or when one of its addresses cannot be
// a pod's (see CheckPodAddr; Err is then set). A Pending pod with an IP is enrolled
// so that its init containers are meshed, and a terminating pod stays
// enrolled: its netns, and connections in it, live until it is gone.
func Decide(cfg Config, ns *corev1.Namespace, pod *corev1.Pod, lookup HandlerLookup) Decision {
	d := optIn(cfg, ns, pod)
	if !d.Enrolled {
		return d
	}
	if p := pod.Status.Phase; p == corev1.PodSucceeded || p == corev1.PodFailed {
		return Decision{Reason: fmt.Sprintf("pod phase is %s", p)}
	}
	if out := checkRuntimeClass(cfg, pod, lookup); out != nil {
		var rc *RuntimeClassError
		switch {
		case !errors.As(out.Err, &rc):
			return *out
		case pod.Annotations[RedirectionAnnotation] == "enabled":
			// Meshed before, under a class the agent knew then: the
			// class was deleted while the pod runs (its sandbox keeps
			// its handler), and a restarted agent has no decision of its
			// own to keep. It stays enrolled.
			d.Reason += fmt.Sprintf("; runtime class %q unknown, kept enrolled: the pod was meshed before (annotation %s=enabled)", rc.Class, RedirectionAnnotation)
		default:
			out.Undecided = out.Reason
			return *out
		}
	}
	if pod.DeletionTimestamp != nil {
		d.Reason += "; terminating, kept until its netns is gone"
	}
	// Enrolled as Istio enrolls it, but a waypoint serves HBONE on 15008
	// itself, which the tunnel then holds in its namespace: the reason says
	// what Istio's own waypoints carry instead.
	if pod.Labels[GatewayClassLabel] == WaypointGatewayClass {
		d.Reason += fmt.Sprintf("; a waypoint's pod (label %s=%s): its own port 15008 is the tunnel's now; Istio's waypoints carry %s=%s", GatewayClassLabel, WaypointGatewayClass, DataplaneModeLabel, DataplaneModeNone)
	}
	// Istio reads the annotation with strconv.ParseBool ("1", "t", "True"
	// are true) and ignores a value that is not a boolean; so do the rules.
	if v, ok := pod.Annotations[BypassInboundAnnotation]; ok {
		bypass, err := strconv.ParseBool(v)
		switch {
		case err != nil:
			d.Reason += fmt.Sprintf("; annotation %s=%q ignored: not a boolean", BypassInboundAnnotation, v)
		case bypass:
			d.BypassInbound = true
			d.Reason += "; inbound capture bypassed by annotation " + BypassInboundAnnotation
		}
	}
	// The same for DNS capture: a value that is not a boolean leaves the
	// node's setting, as istio-cni's CheckBooleanAnnotation does.
	if v, ok := pod.Annotations[DNSCaptureAnnotation]; ok {
		on, err := strconv.ParseBool(v)
		switch {
		case err != nil:
			d.Reason += fmt.Sprintf("; annotation %s=%q ignored: not a boolean", DNSCaptureAnnotation, v)
		case on:
			d.DNSCapture = workload.ChoiceOn
			d.Reason += "; DNS capture on by annotation " + DNSCaptureAnnotation
		default:
			d.DNSCapture = workload.ChoiceOff
			d.Reason += "; DNS capture off by annotation " + DNSCaptureAnnotation
		}
	}
	if pod.Status.PodIP == "" && len(pod.Status.PodIPs) == 0 {
		return Decision{Reason: NoIPYet, BypassInbound: d.BypassInbound, DNSCapture: d.DNSCapture, Pending: d.Reason}
	}
	if out := checkAddrs(pod); out != nil {
		return *out
	}
	return d
}

// NoIPYet is the reason of a selected pod without an address (see
// Decision.Pending).
const NoIPYet = "pod has no IP yet"

// optIn is rules 1 to 7.
func optIn(cfg Config, ns *corev1.Namespace, pod *corev1.Pod) Decision {
	switch {
	case slices.Contains(cfg.ExcludeNamespaces, pod.Namespace):
		return Decision{Reason: fmt.Sprintf("namespace %s is excluded", pod.Namespace)}
	case pod.Spec.HostNetwork:
		return Decision{Reason: "pod uses hostNetwork"}
	}
	if _, ok := pod.Annotations[SidecarStatusAnnotation]; ok {
		return Decision{Reason: "pod has a sidecar (annotation " + SidecarStatusAnnotation + ")"}
	}
	switch pod.Labels[DataplaneModeLabel] {
	case DataplaneModeNone:
		return Decision{Reason: "pod label " + DataplaneModeLabel + "=" + DataplaneModeNone}
	case DataplaneModeAmbient:
		return Decision{Enrolled: true, Reason: "pod label " + DataplaneModeLabel + "=" + DataplaneModeAmbient}
	}
	if ns == nil && cfg.NamespaceViewLags {
		why := fmt.Sprintf("namespace %s is not in the agent's view yet", pod.Namespace)
		return Decision{Reason: why, Undecided: why}
	}
	if ns != nil && ns.Labels[DataplaneModeLabel] == DataplaneModeAmbient {
		return Decision{Enrolled: true, Reason: "namespace label " + DataplaneModeLabel + "=" + DataplaneModeAmbient}
	}
	reason := "no " + DataplaneModeLabel + "=" + DataplaneModeAmbient + " label on pod or namespace"
	// A value Istio does not know ("Ambient", "ambient " from a manifest,
	// a typo) is ignored as Istio ignores it; the reason names it, so the
	// operator who wrote it sees why the pod is not meshed.
	if v, ok := pod.Labels[DataplaneModeLabel]; ok {
		reason += fmt.Sprintf("; pod label %s=%q is neither %s nor %s: ignored", DataplaneModeLabel, v, DataplaneModeAmbient, DataplaneModeNone)
	}
	if ns != nil {
		if v, ok := ns.Labels[DataplaneModeLabel]; ok && v != DataplaneModeNone {
			reason += fmt.Sprintf("; namespace label %s=%q is neither %s nor %s: ignored", DataplaneModeLabel, v, DataplaneModeAmbient, DataplaneModeNone)
		}
	}
	return Decision{Reason: reason}
}

// checkRuntimeClass returns a not-enrolled decision when the pod's runtime
// handler is skipped or cannot be resolved, and nil when it may be enrolled.
func checkRuntimeClass(cfg Config, pod *corev1.Pod, lookup HandlerLookup) *Decision {
	if len(cfg.SkipRuntimeClasses) == 0 || pod.Spec.RuntimeClassName == nil {
		return nil
	}
	class := *pod.Spec.RuntimeClassName
	var handler string
	ok := false
	if lookup != nil {
		handler, ok = lookup(class)
	}
	if !ok {
		err := &RuntimeClassError{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID), Class: class}
		return &Decision{Reason: err.Error(), Err: err}
	}
	if slices.Contains(cfg.SkipRuntimeClasses, handler) {
		return &Decision{Reason: fmt.Sprintf("runtime class %s (handler %s) is skipped", class, handler)}
	}
	return nil
}

// RuntimeClassError is a pod whose RuntimeClass the lookup does not know
// (it wraps ErrUnknownRuntimeClass). The API server lets a class be deleted
// while its pods run, and their sandboxes keep the handler they started
// with: a source keeps the last decision of a pod it had decided (see
// kubeobj.KeepDecision).
type RuntimeClassError struct {
	Namespace, Name, UID, Class string
}

func (e *RuntimeClassError) Error() string {
	return fmt.Sprintf("pod %s/%s: %v %q", e.Namespace, e.Name, ErrUnknownRuntimeClass, e.Class)
}

func (e *RuntimeClassError) Unwrap() error { return ErrUnknownRuntimeClass }

// PodAddrs returns the pod's addresses from status.podIPs, or status.podIP
// when podIPs is empty. An address that does not parse (or has a zone), or
// a second one of a family (the API server allows one of each, so a
// manifest cannot give a pod any number of addresses: each is an
// enrollment entry), is a *PodAddrError naming the pod, the field and the
// bad string: the pod object is malformed, so callers keep what they had of
// the pod rather than drop it (see PodAddrError).
func PodAddrs(pod *corev1.Pod) ([]netip.Addr, error) { return podAddrs(pod, false) }

// PodAddrsOfOneHost is PodAddrs, with an address of no one host (see
// CheckPodAddr) also a *PodAddrError: for a source that refuses an edit
// moving an enrolled pod to such an address, where translation would
// leave the pod out.
func PodAddrsOfOneHost(pod *corev1.Pod) ([]netip.Addr, error) { return podAddrs(pod, true) }

func podAddrs(pod *corev1.Pod, oneHost bool) ([]netip.Addr, error) {
	type field struct{ name, value string }
	raw := make([]field, 0, len(pod.Status.PodIPs))
	for i, ip := range pod.Status.PodIPs {
		raw = append(raw, field{fmt.Sprintf("status.podIPs[%d].ip", i), ip.IP})
	}
	if len(raw) == 0 && pod.Status.PodIP != "" {
		raw = append(raw, field{"status.podIP", pod.Status.PodIP})
	}
	addrs := make([]netip.Addr, 0, len(raw))
	for _, f := range raw {
		a, err := netip.ParseAddr(f.value)
		a = a.Unmap()
		switch {
		case err != nil:
		case a.Zone() != "":
			err = errors.New("zone not allowed")
		case slices.ContainsFunc(addrs, func(b netip.Addr) bool { return b.Is4() == a.Is4() }):
			err = fmt.Errorf("a second %s address", family(a))
		case oneHost:
			err = CheckPodAddr(a)
		}
		if err != nil {
			return nil, &PodAddrError{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID), Field: f.name, Value: f.value, Err: err}
		}
		addrs = append(addrs, a)
	}
	return addrs, nil
}

func family(a netip.Addr) string {
	if a.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

// PodAddrError is a pod address that does not parse: the pod object is
// malformed (an edited manifest, a half-written status), not a pod that
// left. A source must not take it for the pod's removal: enrollment would
// be dropped and the pod's traffic leave the mesh. The file source refuses
// the load; the others keep the pod's last good version.
type PodAddrError struct {
	Namespace, Name, UID string
	// Field is where the address is: status.podIPs[i].ip or status.podIP.
	Field string
	Value string
	Err   error
}

func (e *PodAddrError) Error() string {
	return fmt.Sprintf("pod %s/%s: %s: bad IP %q: %v", e.Namespace, e.Name, e.Field, e.Value, e.Err)
}

func (e *PodAddrError) Unwrap() error { return e.Err }

// checkAddrs returns a not-enrolled decision, with Err set, when an address
// of the pod is malformed or cannot be a pod's; nil when all are fine.
func checkAddrs(pod *corev1.Pod) *Decision {
	addrs, err := PodAddrs(pod)
	for i := 0; err == nil && i < len(addrs); i++ {
		if err = CheckPodAddr(addrs[i]); err != nil {
			err = fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
	}
	if err == nil {
		return nil
	}
	return &Decision{Reason: err.Error(), Err: err}
}

// CheckPodAddr says why a (parsed) address cannot be a pod's own, or nil.
// IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry, and
// zones are refused: a pod address is global to the cluster.
func CheckPodAddr(a netip.Addr) error {
	why := ""
	u := a.Unmap()
	switch {
	case !a.IsValid():
		why = "invalid"
	case a.Zone() != "":
		why = "has a zone"
	case u.IsUnspecified():
		why = "unspecified"
	case u.IsLoopback():
		why = "loopback"
	case u.IsMulticast():
		why = "multicast"
	case u.IsLinkLocalUnicast():
		why = "link-local"
	case u.Is4() && u.As4()[0] == 0:
		why = `in 0.0.0.0/8 ("this network")`
	case u == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		why = "broadcast"
	}
	if why == "" {
		return nil
	}
	return fmt.Errorf("address %s is %s: %w", a, why, ErrBadPodAddr)
}
