package selection

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

type podOpt func(*corev1.Pod)

func label(k, v string) podOpt { return func(p *corev1.Pod) { p.Labels[k] = v } }
func annotate(k, v string) podOpt {
	return func(p *corev1.Pod) { p.Annotations[k] = v }
}
func inNamespace(ns string) podOpt    { return func(p *corev1.Pod) { p.Namespace = ns } }
func hostNetwork() podOpt             { return func(p *corev1.Pod) { p.Spec.HostNetwork = true } }
func phase(ph corev1.PodPhase) podOpt { return func(p *corev1.Pod) { p.Status.Phase = ph } }
func noIP() podOpt                    { return func(p *corev1.Pod) { p.Status.PodIP, p.Status.PodIPs = "", nil } }
func runtimeClass(c string) podOpt    { return func(p *corev1.Pod) { p.Spec.RuntimeClassName = &c } }
func terminating() podOpt {
	return func(p *corev1.Pod) { p.DeletionTimestamp = &metav1.Time{} }
}

func newPod(opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "shop", Labels: map[string]string{}, Annotations: map[string]string{}},
		Status: corev1.PodStatus{
			Phase:  corev1.PodRunning,
			PodIP:  "10.0.0.5",
			PodIPs: []corev1.PodIP{{IP: "10.0.0.5"}},
		},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func namespace(name string, ambient bool) *corev1.Namespace {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if ambient {
		ns.Labels = map[string]string{DataplaneModeLabel: DataplaneModeAmbient}
	}
	return ns
}

func TestDecide(t *testing.T) {
	const (
		podAmbient   = "pod label istio.io/dataplane-mode=ambient"
		nsAmbient    = "namespace label istio.io/dataplane-mode=ambient"
		podNone      = "pod label istio.io/dataplane-mode=none"
		sidecar      = "pod has a sidecar (annotation sidecar.istio.io/status)"
		hostNet      = "pod uses hostNetwork"
		noLabel      = "no istio.io/dataplane-mode=ambient label on pod or namespace"
		excludedKube = "namespace kube-system is excluded"
	)
	cfg := Config{ExcludeNamespaces: []string{"kube-system", "redirector"}, SkipRuntimeClasses: []string{"kata-qemu"}}
	handlers := map[string]string{"kata": "kata-qemu", "gvisor": "runsc"}
	lookup := func(c string) (string, bool) { h, ok := handlers[c]; return h, ok }

	tests := []struct {
		name   string
		ns     *corev1.Namespace
		pod    *corev1.Pod
		want   Decision
		wantEr error
	}{
		// Each rule on its own.
		{"no labels", namespace("shop", false), newPod(), Decision{Reason: noLabel}, nil},
		{"namespace unknown", nil, newPod(), Decision{Reason: noLabel}, nil},
		{"namespace ambient", namespace("shop", true), newPod(), Decision{Enrolled: true, Reason: nsAmbient}, nil},
		{"pod ambient", namespace("shop", false), newPod(label(DataplaneModeLabel, "ambient")), Decision{Enrolled: true, Reason: podAmbient}, nil},
		{"pod ambient, namespace unknown", nil, newPod(label(DataplaneModeLabel, "ambient")), Decision{Enrolled: true, Reason: podAmbient}, nil},
		{"pod none", namespace("shop", false), newPod(label(DataplaneModeLabel, "none")), Decision{Reason: podNone}, nil},
		{"excluded namespace", namespace("kube-system", true), newPod(inNamespace("kube-system")), Decision{Reason: excludedKube}, nil},
		{"hostNetwork", namespace("shop", true), newPod(hostNetwork()), Decision{Reason: hostNet}, nil},
		{"sidecar", namespace("shop", true), newPod(annotate(SidecarStatusAnnotation, "{}")), Decision{Reason: sidecar}, nil},
		{"sidecar annotation empty value", namespace("shop", true), newPod(annotate(SidecarStatusAnnotation, "")), Decision{Reason: sidecar}, nil},
		{"unknown pod mode falls through to namespace", namespace("shop", true), newPod(label(DataplaneModeLabel, "sidecar")), Decision{Enrolled: true, Reason: nsAmbient}, nil},
		{"namespace none is not ambient", &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{DataplaneModeLabel: "none"}}}, newPod(), Decision{Reason: noLabel}, nil},

		// Ordering conflicts: the earlier rule wins.
		{"excluded namespace beats pod ambient", namespace("kube-system", false), newPod(inNamespace("kube-system"), label(DataplaneModeLabel, "ambient")), Decision{Reason: excludedKube}, nil},
		{"excluded namespace beats hostNetwork", nil, newPod(inNamespace("redirector"), hostNetwork()), Decision{Reason: "namespace redirector is excluded"}, nil},
		{"hostNetwork beats pod ambient", nil, newPod(hostNetwork(), label(DataplaneModeLabel, "ambient")), Decision{Reason: hostNet}, nil},
		{"hostNetwork beats sidecar", nil, newPod(hostNetwork(), annotate(SidecarStatusAnnotation, "{}")), Decision{Reason: hostNet}, nil},
		{"hostNetwork beats pod none", nil, newPod(hostNetwork(), label(DataplaneModeLabel, "none")), Decision{Reason: hostNet}, nil},
		{"hostNetwork beats namespace ambient", namespace("shop", true), newPod(hostNetwork()), Decision{Reason: hostNet}, nil},
		{"sidecar beats pod ambient", nil, newPod(annotate(SidecarStatusAnnotation, "{}"), label(DataplaneModeLabel, "ambient")), Decision{Reason: sidecar}, nil},
		{"sidecar beats pod none", nil, newPod(annotate(SidecarStatusAnnotation, "{}"), label(DataplaneModeLabel, "none")), Decision{Reason: sidecar}, nil},
		{"pod none beats namespace ambient", namespace("shop", true), newPod(label(DataplaneModeLabel, "none")), Decision{Reason: podNone}, nil},
		{"pod ambient beats namespace without label", namespace("shop", false), newPod(label(DataplaneModeLabel, "ambient")), Decision{Enrolled: true, Reason: podAmbient}, nil},
		{"pod ambient and namespace ambient names the pod", namespace("shop", true), newPod(label(DataplaneModeLabel, "ambient")), Decision{Enrolled: true, Reason: podAmbient}, nil},

		// Pod lifecycle.
		{"pending with IP is enrolled", namespace("shop", true), newPod(phase(corev1.PodPending)), Decision{Enrolled: true, Reason: nsAmbient}, nil},
		{"pending without IP", namespace("shop", true), newPod(phase(corev1.PodPending), noIP()), Decision{Reason: NoIPYet, Pending: nsAmbient}, nil},
		{"podIP only", namespace("shop", true), newPod(func(p *corev1.Pod) { p.Status.PodIPs = nil }), Decision{Enrolled: true, Reason: nsAmbient}, nil},
		{"succeeded", namespace("shop", true), newPod(phase(corev1.PodSucceeded)), Decision{Reason: "pod phase is Succeeded"}, nil},
		{"failed", namespace("shop", true), newPod(phase(corev1.PodFailed)), Decision{Reason: "pod phase is Failed"}, nil},
		{"failed and not selected names the selection", namespace("shop", false), newPod(phase(corev1.PodFailed)), Decision{Reason: noLabel}, nil},
		{"terminating stays enrolled", namespace("shop", true), newPod(terminating()), Decision{Enrolled: true, Reason: nsAmbient + "; terminating, kept until its netns is gone"}, nil},

		// Runtime classes.
		{"skipped runtime handler", namespace("shop", true), newPod(runtimeClass("kata")), Decision{Reason: "runtime class kata (handler kata-qemu) is skipped"}, nil},
		{"other runtime handler", namespace("shop", true), newPod(runtimeClass("gvisor")), Decision{Enrolled: true, Reason: nsAmbient}, nil},
		// Not judged yet: its ADD fails rather than start it unmeshed.
		{"unknown runtime class", namespace("shop", true), newPod(runtimeClass("firecracker")), Decision{Reason: `pod shop/web-1: unknown runtime class "firecracker"`, Undecided: `pod shop/web-1: unknown runtime class "firecracker"`}, ErrUnknownRuntimeClass},
		// Meshed before (the class was deleted while it runs): kept.
		{"unknown runtime class of a pod meshed before", namespace("shop", true), newPod(runtimeClass("firecracker"), annotate(RedirectionAnnotation, "enabled")),
			Decision{Enrolled: true, Reason: nsAmbient + `; runtime class "firecracker" unknown, kept enrolled: the pod was meshed before (annotation ` + RedirectionAnnotation + `=enabled)`}, nil},
		{"unknown runtime class on a pod not selected", namespace("shop", false), newPod(runtimeClass("firecracker")), Decision{Reason: noLabel}, nil},
		{"skipped runtime beats no IP", namespace("shop", true), newPod(runtimeClass("kata"), noIP()), Decision{Reason: "runtime class kata (handler kata-qemu) is skipped"}, nil},

		// Bypass annotation.
		{"bypass inbound", namespace("shop", true), newPod(annotate(BypassInboundAnnotation, "true")), Decision{Enrolled: true, BypassInbound: true, Reason: nsAmbient + "; inbound capture bypassed by annotation " + BypassInboundAnnotation}, nil},
		{"bypass inbound false", namespace("shop", true), newPod(annotate(BypassInboundAnnotation, "false")), Decision{Enrolled: true, Reason: nsAmbient}, nil},
		// Istio reads the annotation with strconv.ParseBool.
		{"bypass inbound True", namespace("shop", true), newPod(annotate(BypassInboundAnnotation, "True")), Decision{Enrolled: true, BypassInbound: true, Reason: nsAmbient + "; inbound capture bypassed by annotation " + BypassInboundAnnotation}, nil},
		{"bypass inbound 1", namespace("shop", true), newPod(annotate(BypassInboundAnnotation, "1")), Decision{Enrolled: true, BypassInbound: true, Reason: nsAmbient + "; inbound capture bypassed by annotation " + BypassInboundAnnotation}, nil},
		{"bypass inbound not a boolean", namespace("shop", true), newPod(annotate(BypassInboundAnnotation, " true")), Decision{Enrolled: true, Reason: nsAmbient + `; annotation ` + BypassInboundAnnotation + `=" true" ignored: not a boolean`}, nil},
		{"bypass on a pod not enrolled", namespace("shop", false), newPod(annotate(BypassInboundAnnotation, "true")), Decision{Reason: noLabel}, nil},
		{"dns capture off", namespace("shop", true), newPod(annotate(DNSCaptureAnnotation, "false")), Decision{Enrolled: true, DNSCapture: workload.ChoiceOff, Reason: nsAmbient + "; DNS capture off by annotation " + DNSCaptureAnnotation}, nil},
		{"dns capture on", namespace("shop", true), newPod(annotate(DNSCaptureAnnotation, "True")), Decision{Enrolled: true, DNSCapture: workload.ChoiceOn, Reason: nsAmbient + "; DNS capture on by annotation " + DNSCaptureAnnotation}, nil},
		{"dns capture not a boolean", namespace("shop", true), newPod(annotate(DNSCaptureAnnotation, "no")), Decision{Enrolled: true, Reason: nsAmbient + `; annotation ` + DNSCaptureAnnotation + `="no" ignored: not a boolean`}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Decide(cfg, tt.ns, tt.pod, lookup)
			if !errors.Is(got.Err, tt.wantEr) {
				t.Errorf("Err = %v, want %v", got.Err, tt.wantEr)
			}
			got.Err = nil
			if got != tt.want {
				t.Errorf("Decide() = %+v\nwant        %+v", got, tt.want)
			}
		})
	}
}

func TestDecideRuntimeClassWithoutSkipList(t *testing.T) {
	// With no skip list the handler cannot change the outcome, so no lookup
	// is needed and an unknown class is no error.
	pod := newPod(label(DataplaneModeLabel, "ambient"), runtimeClass("kata"))
	got := Decide(Config{}, nil, pod, nil)
	if !got.Enrolled || got.Err != nil {
		t.Fatalf("Decide() = %+v, want enrolled", got)
	}
}

func TestDecideNilLookupWithSkipList(t *testing.T) {
	pod := newPod(label(DataplaneModeLabel, "ambient"), runtimeClass("kata"))
	got := Decide(Config{SkipRuntimeClasses: []string{"kata-qemu"}}, nil, pod, nil)
	if got.Enrolled || !errors.Is(got.Err, ErrUnknownRuntimeClass) {
		t.Fatalf("Decide() = %+v, want not enrolled with ErrUnknownRuntimeClass", got)
	}
}

func TestPodAddrs(t *testing.T) {
	tests := []struct {
		name    string
		podIP   string
		podIPs  []string
		want    []string
		wantErr string
	}{
		{name: "none"},
		{name: "podIP fallback", podIP: "10.0.0.5", want: []string{"10.0.0.5"}},
		{name: "dual stack", podIP: "10.0.0.5", podIPs: []string{"10.0.0.5", "fd00::5"}, want: []string{"10.0.0.5", "fd00::5"}},
		{name: "podIPs wins over podIP", podIP: "10.0.0.9", podIPs: []string{"10.0.0.5"}, want: []string{"10.0.0.5"}},
		{name: "v4-mapped is unmapped", podIPs: []string{"::ffff:10.0.0.5"}, want: []string{"10.0.0.5"}},
		{name: "malformed", podIPs: []string{"10.0.0.5", "10.0.0.300"}, wantErr: `pod shop/web-1: status.podIPs[1].ip: bad IP "10.0.0.300"`},
		{name: "leading zero", podIPs: []string{"10.0.0.05"}, wantErr: `pod shop/web-1: status.podIPs[0].ip: bad IP "10.0.0.05"`},
		{name: "empty entry", podIPs: []string{"10.0.0.5", ""}, wantErr: `pod shop/web-1: status.podIPs[1].ip: bad IP ""`},
		{name: "malformed podIP", podIP: "not-an-ip", wantErr: `pod shop/web-1: status.podIP: bad IP "not-an-ip"`},
		{name: "zone", podIPs: []string{"fe80::1%eth0"}, wantErr: `pod shop/web-1: status.podIPs[0].ip: bad IP "fe80::1%eth0"`},
		// As the API server validates: at most one address of each family,
		// so a manifest cannot give a pod any number of addresses (each an
		// enrollment entry, and another pod's maybe).
		{name: "two of a family", podIPs: []string{"10.0.0.5", "10.0.0.6"}, wantErr: `pod shop/web-1: status.podIPs[1].ip: bad IP "10.0.0.6": a second IPv4 address`},
		{name: "duplicate", podIPs: []string{"10.0.0.5", "10.0.0.5"}, wantErr: `pod shop/web-1: status.podIPs[1].ip: bad IP "10.0.0.5": a second IPv4 address`},
		{name: "duplicate mapped", podIPs: []string{"10.0.0.5", "::ffff:10.0.0.5"}, wantErr: `status.podIPs[1].ip: bad IP "::ffff:10.0.0.5": a second IPv4 address`},
		{name: "three", podIPs: []string{"10.0.0.5", "fd00::5", "fd00::6"}, wantErr: `status.podIPs[2].ip: bad IP "fd00::6": a second IPv6 address`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pod := newPod(noIP())
			pod.Status.PodIP = tt.podIP
			for _, ip := range tt.podIPs {
				pod.Status.PodIPs = append(pod.Status.PodIPs, corev1.PodIP{IP: ip})
			}
			got, err := PodAddrs(pod)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				var ae *PodAddrError
				if !errors.As(err, &ae) || ae.Namespace != "shop" || ae.Name != "web-1" {
					t.Errorf("err = %#v, want a *PodAddrError naming the pod", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var want []netip.Addr
			for _, s := range tt.want {
				want = append(want, netip.MustParseAddr(s))
			}
			if !slices.Equal(got, want) {
				t.Fatalf("PodAddrs() = %v, want %v", got, want)
			}
		})
	}
}

func TestParseConfig(t *testing.T) {
	cfg, err := ParseConfig(" kube-system, redirector ,,", "kata-qemu,runsc")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.ExcludeNamespaces, []string{"kube-system", "redirector"}) {
		t.Errorf("ExcludeNamespaces = %q", cfg.ExcludeNamespaces)
	}
	if !slices.Equal(cfg.SkipRuntimeClasses, []string{"kata-qemu", "runsc"}) {
		t.Errorf("SkipRuntimeClasses = %q", cfg.SkipRuntimeClasses)
	}

	cfg, err = ParseConfig("", " ")
	if err != nil || cfg.ExcludeNamespaces != nil || cfg.SkipRuntimeClasses != nil {
		t.Errorf("ParseConfig(empty) = %+v, %v; want empty config", cfg, err)
	}

	for _, tt := range []struct{ ns, rc, want string }{
		{"kube-system,Kube_System", "", `EXCLUDE_NAMESPACES: "Kube_System" is not a DNS-1123 label`},
		{"", "kata.qemu", `SKIP_RUNTIME_CLASSES: "kata.qemu" is not a DNS-1123 label`},
		{"a b", "", `EXCLUDE_NAMESPACES: "a b" is not a DNS-1123 label`},
		{"", strings.Repeat("x", 64), `SKIP_RUNTIME_CLASSES: "` + strings.Repeat("x", 64) + `" is not a DNS-1123 label`},
	} {
		_, err := ParseConfig(tt.ns, tt.rc)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseConfig(%q, %q) error = %v, want it to contain %q", tt.ns, tt.rc, err, tt.want)
		}
	}
}

// TestDecideRefusesBadAddrs: a pod whose address cannot be a pod's is left
// out with the address and why in its reason, and Err set for the log.
func TestDecideRefusesBadAddrs(t *testing.T) {
	ambient := namespace("shop", true)
	for _, tc := range []struct{ ips []string }{
		{[]string{"0.0.0.0"}},
		{[]string{"::"}},
		{[]string{"127.0.0.1"}},
		{[]string{"127.1.2.3"}},
		{[]string{"::1"}},
		{[]string{"::ffff:127.0.0.1"}},
		{[]string{"::ffff:0.0.0.0"}},
		{[]string{"224.0.0.1"}},
		{[]string{"ff02::1"}},
		{[]string{"ff05::2"}},
		{[]string{"169.254.7.127"}},
		{[]string{"fe80::1"}},
		{[]string{"0.1.2.3"}},
		{[]string{"255.255.255.255"}},
		{[]string{"10.0.0.5", "::1"}}, // one bad address of two
	} {
		pod := newPod(func(p *corev1.Pod) {
			p.Status.PodIP = tc.ips[0]
			p.Status.PodIPs = nil
			for _, ip := range tc.ips {
				p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
			}
		})
		d := Decide(Config{}, ambient, pod, nil)
		bad := tc.ips[len(tc.ips)-1]
		if d.Enrolled || !errors.Is(d.Err, ErrBadPodAddr) || !strings.Contains(d.Reason, "shop/web-1") {
			t.Errorf("%v: %+v, want not enrolled with ErrBadPodAddr naming the pod", tc.ips, d)
		}
		if a := netip.MustParseAddr(bad).Unmap().String(); !strings.Contains(d.Reason, a) {
			t.Errorf("%v: reason %q does not name %s", tc.ips, d.Reason, a)
		}
	}
	// A zone is refused by CheckPodAddr too (PodAddrs already rejects it).
	if err := CheckPodAddr(netip.MustParseAddr("fd00::1%eth0")); !errors.Is(err, ErrBadPodAddr) {
		t.Errorf("zoned address: %v", err)
	}
	for _, ok := range []string{"10.0.0.5", "fd00::5", "::ffff:10.0.0.5", "100.64.0.1", "2001:db8::1"} {
		if err := CheckPodAddr(netip.MustParseAddr(ok)); err != nil {
			t.Errorf("%s refused: %v", ok, err)
		}
	}
}

// TestDecideNamesAnUnknownModeValue: a dataplane-mode label whose value is
// neither ambient nor none ("Ambient", "ambient " from a manifest, a typo)
// is ignored, as Istio ignores it, so the pod is not meshed; the reason
// says which label had which value, where it only said there was no
// ambient label, and the operator who wrote one was left to guess.
func TestDecideNamesAnUnknownModeValue(t *testing.T) {
	ns := func(v string) *corev1.Namespace {
		return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{DataplaneModeLabel: v}}}
	}
	for _, tt := range []struct {
		name string
		ns   *corev1.Namespace
		pod  *corev1.Pod
		want string
	}{
		{"namespace in another case", ns("Ambient"), newPod(), `namespace label istio.io/dataplane-mode="Ambient" is neither ambient nor none: ignored`},
		{"pod with a stray space", namespace("shop", false), newPod(label(DataplaneModeLabel, "ambient ")), `pod label istio.io/dataplane-mode="ambient " is neither ambient nor none: ignored`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := Decide(Config{}, tt.ns, tt.pod, nil)
			if d.Enrolled || !strings.Contains(d.Reason, tt.want) {
				t.Fatalf("Decide = %+v, want not enrolled, reason naming %s", d, tt.want)
			}
		})
	}
}

// TestNamespaceNotInViewUndecided: with a source that watches namespaces
// (NamespaceViewLags), a pod whose namespace it has not seen yet (the API
// server admits no pod of a namespace that does not exist) is Undecided,
// so its CNI ADD fails and is retried, unless a rule that does not need
// the namespace decides; without the flag (the file source) such a pod is
// out. Before, it was out: a pod of a new ambient namespace whose
// namespace event lagged its ADD started unmeshed.
func TestNamespaceNotInViewUndecided(t *testing.T) {
	lags := Config{ExcludeNamespaces: []string{"kube-system"}, NamespaceViewLags: true}
	const want = "namespace shop is not in the agent's view yet"
	if d := Decide(lags, nil, newPod(), nil); d.Enrolled || d.Undecided != want || d.Reason != want {
		t.Errorf("unlabelled pod, namespace not in view: %+v; want undecided, %q", d, want)
	}
	if d := Decide(lags, nil, newPod(noIP()), nil); d.Enrolled || d.Undecided != want || d.Pending != "" {
		t.Errorf("unlabelled pod without IP, namespace not in view: %+v; want undecided", d)
	}
	for name, c := range map[string]struct {
		pod      *corev1.Pod
		enrolled bool
	}{
		"pod label ambient":  {newPod(label(DataplaneModeLabel, DataplaneModeAmbient)), true},
		"pod label none":     {newPod(label(DataplaneModeLabel, DataplaneModeNone)), false},
		"hostNetwork":        {newPod(hostNetwork()), false},
		"sidecar":            {newPod(annotate(SidecarStatusAnnotation, "{}")), false},
		"excluded namespace": {newPod(inNamespace("kube-system")), false},
	} {
		if d := Decide(lags, nil, c.pod, nil); d.Enrolled != c.enrolled || d.Undecided != "" {
			t.Errorf("%s, namespace not in view: %+v; want enrolled %v, decided", name, d, c.enrolled)
		}
	}
	if d := Decide(Config{}, nil, newPod(), nil); d.Enrolled || d.Undecided != "" {
		t.Errorf("file source, namespace not declared: %+v; want out", d)
	}
	if d := Decide(lags, namespace("shop", false), newPod(), nil); d.Enrolled || d.Undecided != "" {
		t.Errorf("namespace in view, not ambient: %+v; want out", d)
	}
}

// TestEnrolledWaypointReason: a waypoint's pod without Istio's
// istio.io/dataplane-mode=none in an ambient namespace is enrolled, as
// Istio enrolls it, and the reason says why that breaks it and what
// Istio's waypoints carry.
func TestEnrolledWaypointReason(t *testing.T) {
	d := Decide(Config{}, namespace("shop", true), newPod(label(GatewayClassLabel, WaypointGatewayClass)), nil)
	if !d.Enrolled || !strings.Contains(d.Reason, "a waypoint's pod") || !strings.Contains(d.Reason, "istio.io/dataplane-mode=none") {
		t.Errorf("waypoint pod without dataplane-mode=none: %+v; want enrolled, the reason naming the label Istio's waypoints carry", d)
	}
	if d := Decide(Config{}, namespace("shop", true), newPod(label(GatewayClassLabel, WaypointGatewayClass), label(DataplaneModeLabel, DataplaneModeNone)), nil); d.Enrolled {
		t.Errorf("waypoint pod with dataplane-mode=none: %+v; want out", d)
	}
}
