package kubernetes

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

func TestSortedMap(t *testing.T) {
	var m sortedMap[string]
	if got := m.values(); len(got) != 0 {
		t.Fatalf("empty map values = %v", got)
	}
	set := func(ns, name string) { m.set(objKey{ns, name}, ns+"/"+name) }
	// "a-x" sorts after "a" as a namespace, though "a-x/..." sorts before "a/..." as a string.
	set("b", "1")
	set("a-x", "1")
	set("a", "2")
	set("a", "1")
	want := []string{"a/1", "a/2", "a-x/1", "b/1"}
	first := m.values()
	if !slices.Equal(first, want) {
		t.Fatalf("values = %v, want %v", first, want)
	}
	if again := m.values(); &again[0] != &first[0] {
		t.Error("values without a change made a new slice")
	}

	m.set(objKey{"a", "2"}, "a/2'") // a value change keeps the order
	m.delete(objKey{"b", "1"})
	m.delete(objKey{"b", "1"}) // deleting an absent key is a no-op
	set("0", "z")
	m.delete(objKey{"a-x", "1"}) // deleted and added back before values: once
	set("a-x", "1")
	got := m.values()
	if want := []string{"0/z", "a/1", "a/2'", "a-x/1"}; !slices.Equal(got, want) {
		t.Fatalf("values = %v, want %v", got, want)
	}
	if !slices.Equal(first, []string{"a/1", "a/2", "a-x/1", "b/1"}) {
		t.Errorf("an earlier values result changed: %v", first)
	}
}

// storeOnlyInformers is the informer set with the agent's indexers but no
// list or watch: a test fills the stores itself and applies changes.
func storeOnlyInformers() informerSet {
	newInf := func(obj runtime.Object, idx cache.Indexers) cache.SharedIndexInformer {
		return cache.NewSharedIndexInformer(&cache.ListWatch{}, obj, 0, idx)
	}
	return informerSet{
		namespaces:     newInf(&corev1.Namespace{}, cache.Indexers{}),
		runtimeClasses: newInf(&nodev1.RuntimeClass{}, cache.Indexers{}),
		pods: newInf(&kubeobj.CompactPod{}, cache.Indexers{
			cache.NamespaceIndex: cache.MetaNamespaceIndexFunc, podsByRuntimeClass: indexPodsByRuntimeClass}),
		services:       newInf(&corev1.Service{}, cache.Indexers{}),
		endpointSlices: newInf(&discoveryv1.EndpointSlice{}, cache.Indexers{slicesByService: indexSlicesByService}),
	}
}

// TestModelKeepsPodWithMalformedAddress: a pod whose address stops parsing
// (status.podIP(s) edited to "10.0.0.05", say) keeps its last good
// workload, enrolled at its old address, with the error logged naming the
// pod and field and counted; a fix is taken; a pod of the same name but
// another uid, malformed from the start, is left out; a deleted pod goes.
// Before, the model deleted the workload and so unenrolled the pod.
func TestModelKeepsPodWithMalformedAddress(t *testing.T) {
	inf := storeOnlyInformers()
	var logs bytes.Buffer
	m := newModel(selection.Config{}, slog.New(slog.NewTextHandler(&logs, nil)), inf)
	metrics := source.NewMetrics(nil)
	m.metrics = metrics
	if err := inf.namespaces.GetStore().Add(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}); err != nil {
		t.Fatal(err)
	}
	setPod := func(uid string, ips ...string) {
		t.Helper()
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", UID: types.UID(uid)},
			Spec: corev1.PodSpec{NodeName: "node-a"}, Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ips[0]}}
		for _, ip := range ips {
			p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
		}
		if err := inf.pods.GetStore().Update(kubeobj.NewCompactPod(p)); err != nil {
			t.Fatal(err)
		}
		var c changes
		c.add(kindNamespace, "shop")
		c.add(kindPod, "shop/web")
		m.apply(c)
	}
	web := func() *workload.Workload {
		for _, w := range m.snapshot().Workloads {
			if w.Name == "web" {
				return w
			}
		}
		return nil
	}
	setPod("u1", "10.0.0.5")
	if w := web(); w == nil || !w.Enrolled {
		t.Fatalf("web = %+v, want enrolled", w)
	}
	for i, bad := range [][]string{{"10.0.0.300"}, {"10.0.0.05"}, {"10.0.0.5", "fe80::1%eth0"}, {""}, {"garbage"}} {
		logs.Reset()
		setPod("u1", bad...)
		if w := web(); w == nil || !w.Enrolled || len(w.Addrs) != 1 || w.Addrs[0] != netip.MustParseAddr("10.0.0.5") {
			t.Errorf("podIPs %q: web = %+v, want its last good version, enrolled at 10.0.0.5", bad, w)
		}
		field := fmt.Sprintf("status.podIPs[%d].ip", len(bad)-1)
		if out := logs.String(); !strings.Contains(out, "pod shop/web: "+field) || !strings.Contains(out, "last good version is kept") {
			t.Errorf("podIPs %q: log %q does not name the pod and field, or say the pod is kept", bad, out)
		}
		key := `redirector_source_errors_total{reason="invalid",source="kubernetes"}`
		if got := promtest.Scrape(t, metrics)[key]; got != float64(i+1) {
			t.Errorf("%s = %v, want %d", key, got, i+1)
		}
	}
	setPod("u1", "10.0.0.6")
	if w := web(); w == nil || w.Addrs[0] != netip.MustParseAddr("10.0.0.6") {
		t.Errorf("after the fix: web = %+v, want 10.0.0.6", w)
	}
	setPod("u2", "10.0.0.05")
	if w := web(); w != nil {
		t.Errorf("a new pod of the same name, malformed from the start: %+v, want left out", w)
	}
	setPod("u2", "10.0.0.7")
	if err := inf.pods.GetStore().Delete(&kubeobj.CompactPod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web"}}); err != nil {
		t.Fatal(err)
	}
	var c changes
	c.add(kindPod, "shop/web")
	m.apply(c)
	if w := web(); w != nil {
		t.Errorf("deleted pod: %+v", w)
	}
}

// TestModelKeepsEnrolledPodWhoseRuntimeClassIsDeleted: the API server lets
// a RuntimeClass be deleted while its pods run (their sandboxes keep their
// handler); an enrolled pod of it stays enrolled, with the error logged.
// Before, it was unenrolled and its traffic left the mesh.
func TestModelKeepsEnrolledPodWhoseRuntimeClassIsDeleted(t *testing.T) {
	inf := storeOnlyInformers()
	var logs bytes.Buffer
	m := newModel(selection.Config{SkipRuntimeClasses: []string{"kata"}}, slog.New(slog.NewTextHandler(&logs, nil)), inf)
	class := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "fast"}, Handler: "runc"}
	for _, obj := range []any{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}},
		class,
		kubeobj.NewCompactPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", UID: "u1"},
			Spec:   corev1.PodSpec{NodeName: "node-a", RuntimeClassName: new("fast")},
			Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.5"}}),
	} {
		var err error
		switch o := obj.(type) {
		case *corev1.Namespace:
			err = inf.namespaces.GetStore().Add(o)
		case *nodev1.RuntimeClass:
			err = inf.runtimeClasses.GetStore().Add(o)
		default:
			err = inf.pods.GetStore().Add(o)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	var first changes
	first.add(kindNamespace, "shop")
	first.add(kindRuntimeClass, "fast")
	first.add(kindPod, "shop/web")
	m.apply(first)
	web := func() *workload.Workload {
		if ws := m.snapshot().Workloads; len(ws) == 1 {
			return ws[0]
		}
		return nil
	}
	if w := web(); w == nil || !w.Enrolled {
		t.Fatalf("web = %+v, want enrolled", w)
	}
	if err := inf.runtimeClasses.GetStore().Delete(class); err != nil {
		t.Fatal(err)
	}
	var c changes
	c.add(kindRuntimeClass, "fast")
	m.apply(c)
	if w := web(); w == nil || !w.Enrolled {
		t.Errorf("class deleted: web = %+v, want still enrolled", w)
	}
	if out := logs.String(); !strings.Contains(out, `pod shop/web: unknown runtime class \"fast\"`) || !strings.Contains(out, "last decision (enrolled) is kept") {
		t.Errorf("log %q does not name the pod and class, or say the pod is kept", out)
	}
}

// TestNodeUpdatesWithoutLocalityChangeMarkNothing: the model reads only a
// Node's locality labels, but every update of any node (its kubelet
// reports status at least every few minutes, conditions and images
// change, controllers annotate it) asked for a snapshot, and every agent
// of the cluster built its whole directory again: work proportional to the
// cluster's size times its nodes' update rate, for nothing. An update that
// leaves the locality as it was now marks nothing.
func TestNodeUpdatesWithoutLocalityChangeMarkNothing(t *testing.T) {
	notified := 0
	p := &pending{notify: func() { notified++ }}
	h := p.nodeHandler()
	node := func(rv, zone string, labels ...string) *metav1.PartialObjectMetadata {
		n := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: "node-a", ResourceVersion: rv,
			Labels: map[string]string{corev1.LabelTopologyRegion: "r1", corev1.LabelTopologyZone: zone}}}
		for i := 0; i+1 < len(labels); i += 2 {
			n.Labels[labels[i]] = labels[i+1]
		}
		return kubeobj.TrimNodeMeta(n)
	}
	h.OnUpdate(node("1", "a"), node("2", "a"))
	h.OnUpdate(node("2", "a"), node("3", "a", "node.kubernetes.io/instance-type", "big"))
	if c := p.take(); notified != 0 || len(c.keys[kindNode]) != 0 {
		t.Errorf("status updates: %d notifications, marked %v; want none", notified, c.keys[kindNode])
	}
	h.OnUpdate(node("3", "a"), node("4", "b"))
	if c := p.take(); notified != 1 || len(c.keys[kindNode]) != 1 {
		t.Errorf("zone changed: %d notifications, marked %v; want node-a", notified, c.keys[kindNode])
	}
	h.OnAdd(node("5", "b"), false)
	h.OnDelete(cache.DeletedFinalStateUnknown{Key: "node-a", Obj: node("5", "b")})
	if c := p.take(); notified != 3 || len(c.keys[kindNode]) != 1 {
		t.Errorf("added and deleted: %d notifications, marked %v; want node-a twice", notified, c.keys[kindNode])
	}
}

// TestModelPodBeforeItsNamespaceUndecided: the pod and namespace watches
// have no order between them, so a pod of a new ambient namespace can come
// first. It is Undecided (its CNI ADD fails and is retried) until its
// namespace is seen, then enrolled. Before, it was out, and its ADD let
// it start unmeshed.
func TestModelPodBeforeItsNamespaceUndecided(t *testing.T) {
	inf := storeOnlyInformers()
	m := newModel(selection.Config{}, slog.New(slog.DiscardHandler), inf)
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "fresh", Name: "web", UID: "u1"},
		Spec: corev1.PodSpec{NodeName: "node-a"}, Status: corev1.PodStatus{Phase: corev1.PodPending}}
	if err := inf.pods.GetStore().Add(kubeobj.NewCompactPod(p)); err != nil {
		t.Fatal(err)
	}
	var c changes
	c.add(kindPod, "fresh/web")
	m.apply(c)
	if ws := m.snapshot().Workloads; len(ws) != 1 || ws[0].Enrolled || ws[0].Undecided == "" {
		t.Fatalf("pod before its namespace: %+v; want undecided", ws)
	}
	if err := inf.namespaces.GetStore().Add(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "fresh", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}); err != nil {
		t.Fatal(err)
	}
	c = changes{}
	c.add(kindNamespace, "fresh")
	m.apply(c)
	if ws := m.snapshot().Workloads; len(ws) != 1 || ws[0].Pending == "" || ws[0].Undecided != "" {
		t.Errorf("once its ambient namespace is seen: %+v; want selected (pending its address)", ws)
	}
}

// TestModelKeepsEnrolledPodWhoseNamespaceLeavesView: the API server removes
// a namespace only once its pods are gone, so a pod whose namespace is not
// in the agent's view is one the view lags on (the two watches have no
// order between them, a relist that lost it): such a pod is Undecided. An
// enrolled pod keeps its enrollment then, as for a deleted RuntimeClass.
// Before, it was unenrolled and detached (not sealed, as a pod gone from
// the source is), and its traffic left the mesh in plaintext; a pod that
// was never enrolled stays Undecided.
func TestModelKeepsEnrolledPodWhoseNamespaceLeavesView(t *testing.T) {
	inf := storeOnlyInformers()
	var logs bytes.Buffer
	m := newModel(selection.Config{}, slog.New(slog.NewTextHandler(&logs, nil)), inf)
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}
	pod := func(name, uid, ip string) *kubeobj.CompactPod {
		return kubeobj.NewCompactPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name, UID: types.UID(uid)},
			Spec: corev1.PodSpec{NodeName: "node-a"}, Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip}})
	}
	if err := inf.namespaces.GetStore().Add(ns); err != nil {
		t.Fatal(err)
	}
	if err := inf.pods.GetStore().Add(pod("web", "u1", "10.0.0.5")); err != nil {
		t.Fatal(err)
	}
	var first changes
	first.add(kindNamespace, "shop")
	first.add(kindPod, "shop/web")
	m.apply(first)
	get := func(name string) *workload.Workload {
		for _, w := range m.snapshot().Workloads {
			if w.Name == name {
				return w
			}
		}
		return nil
	}
	if w := get("web"); w == nil || !w.Enrolled {
		t.Fatalf("web = %+v, want enrolled", w)
	}
	if err := inf.namespaces.GetStore().Delete(ns); err != nil {
		t.Fatal(err)
	}
	if err := inf.pods.GetStore().Add(pod("new", "u2", "10.0.0.6")); err != nil {
		t.Fatal(err)
	}
	var c changes
	c.add(kindNamespace, "shop")
	c.add(kindPod, "shop/new")
	m.apply(c)
	if w := get("web"); w == nil || !w.Enrolled || w.Undecided != "" {
		t.Errorf("namespace out of view: web = %+v, want still enrolled", w)
	}
	if w := get("new"); w == nil || w.Enrolled || w.Undecided == "" {
		t.Errorf("namespace out of view: new = %+v, want undecided (never enrolled)", w)
	}
	if out := logs.String(); !strings.Contains(out, "shop/web") || !strings.Contains(out, "last decision (enrolled) is kept") {
		t.Errorf("log %q does not name the pod, or say its decision is kept", out)
	}
}
