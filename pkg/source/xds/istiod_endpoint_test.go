package xds

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/pkg/workload"
	"github.com/redirector-mesh/redirector/test/istiotest"
)

// TestIstiodPodsAtOneAddress: what TestMergeEndpointIsTheWorkloadIstiodNames
// stands for, with a real istiod: two pods whose status lists one address
// (any kubelet writes its pods' status.podIPs) are both sent, each the
// endpoint of its own services; the service's endpoint naming the pod that
// does not keep the address is unresolved, not dialled as the one that
// does, and so is one of another node's pod at this node's pod's address.
// A ServiceEntry's endpoint at a pod's address is that pod.
func TestIstiodPodsAtOneAddress(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cs := cp.Client
	ctx := context.Background()
	for _, ns := range []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "aaa"}},
	} {
		if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	label := func(p *corev1.Pod, app string) *corev1.Pod {
		p.Labels = map[string]string{"app": app}
		p, err := cs.CoreV1().Pods(p.Namespace).Update(ctx, p, metav1.UpdateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	// web-1 is node1's (the agent's), web-0 and web-2 are node2's; aaa's
	// stale lists web-0's address and sorts first, aaa's intruder lists
	// web-1's.
	local := label(istiotest.CreatePod(t, cs, "shop", "web-1", "web", "node1", "10.244.1.5"), "web")
	label(istiotest.CreatePod(t, cs, "shop", "web-0", "web", "node2", "10.244.2.7"), "web")
	label(istiotest.CreatePod(t, cs, "shop", "web-2", "web", "node2", "10.244.2.5"), "web")
	istiotest.CreatePod(t, cs, "aaa", "stale", "batch", "node3", "10.244.2.7")
	label(istiotest.CreatePod(t, cs, "aaa", "intruder", "batch", "node2", "10.244.1.5"), "api")
	for _, svc := range []*corev1.Service{
		{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"}, Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "web"}, ClusterIP: "10.96.0.60",
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "api", Namespace: "aaa"}, Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "api"}, ClusterIP: "10.96.0.61",
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}},
	} {
		if _, err := cs.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	createServiceEntry(t, cp.Dynamic, "shop", "ext", map[string]any{
		"hosts": []any{"ext.example.com"}, "addresses": []any{"240.1.1.9"}, "resolution": "STATIC",
		"ports":     []any{map[string]any{"number": int64(80), "name": "tcp", "protocol": "TCP"}},
		"endpoints": []any{map[string]any{"address": "10.244.2.5"}}})
	state := nodepods.State{
		Namespaces: []corev1.Namespace{{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}},
		Pods:       []corev1.Pod{*local},
	}

	snaps := istiodSnapshots(t, cp)
	endpoints := func(dir *workload.Directory, vip string) (map[string]*workload.Endpoint, error) {
		svc, ok := dir.ServiceByVIP(netip.MustParseAddr(vip))
		if !ok {
			return nil, fmt.Errorf("no service at %s", vip)
		}
		out := map[string]*workload.Endpoint{}
		for i := range svc.Endpoints {
			out[svc.Endpoints[i].Addr.String()] = &svc.Endpoints[i]
		}
		return out, nil
	}
	check := func(s *Snapshot) error {
		snap, _ := merge(state, s, "node1", selection.Config{}, nil)
		dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
		web, err := endpoints(dir, "10.96.0.60")
		if err != nil || len(web) != 3 {
			return fmt.Errorf("service shop/web: %v %v, want 3 endpoints", web, err)
		}
		api, err := endpoints(dir, "10.96.0.61")
		if err != nil || len(api) != 1 {
			return fmt.Errorf("service aaa/api: %v %v, want 1 endpoint", api, err)
		}
		ext, err := endpoints(dir, "240.1.1.9")
		if err != nil || len(ext) != 1 {
			return fmt.Errorf("service entry ext.example.com: %v %v, want 1 endpoint", ext, err)
		}
		if w, _ := dir.ByAddr(netip.MustParseAddr("10.244.2.7")); w == nil || w.Name != "stale" {
			return fmt.Errorf("10.244.2.7 belongs to %v, want aaa/stale (the first by name of two plaintext pods)", w)
		}
		for _, c := range []struct {
			what string
			ep   *workload.Endpoint
			uid  string // "" for unresolved
		}{
			{"shop/web-1 (the local pod, from istiod's copy)", web["10.244.1.5"], string(local.UID)},
			{"shop/web-2", web["10.244.2.5"], istiotest.ClusterID + "//Pod/shop/web-2"},
			{"shop/web-0, whose address aaa/stale keeps", web["10.244.2.7"], ""},
			{"aaa/intruder, at the local pod's address", api["10.244.1.5"], ""},
			{"the ServiceEntry's endpoint at shop/web-2's address", ext["10.244.2.5"], istiotest.ClusterID + "//Pod/shop/web-2"},
		} {
			switch {
			case c.ep == nil:
				return fmt.Errorf("%s: no endpoint", c.what)
			case c.uid == "" && (c.ep.Workload != nil || !c.ep.Unresolved):
				return fmt.Errorf("%s: endpoint resolves to %v (unresolved %v), want unresolved", c.what, c.ep.Workload, c.ep.Unresolved)
			case c.uid != "" && (c.ep.Workload == nil || c.ep.Workload.UID != c.uid || c.ep.Unresolved):
				return fmt.Errorf("%s: endpoint resolves to %v (unresolved %v), want %s", c.what, c.ep.Workload, c.ep.Unresolved, c.uid)
			}
		}
		return nil
	}
	waitForIstiodState(t, snaps, check)
}

// TestIstiodEndpointsOfHonestPods: what TestMergeHonestEndpointsResolve
// stands for, with a real istiod, for what one cluster can show: a pod
// being deleted whose object lingers (a finalizer here) while a new, ready
// pod has its address; istiod sends both, the old one unhealthy, and the
// new pod's endpoints resolve to it (before, the old pod kept the address
// by name and they were refused). hostNetwork pods of this node and
// another, and a ServiceEntry selecting the pods (its endpoints are
// theirs), resolve too.
func TestIstiodEndpointsOfHonestPods(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cs := cp.Client
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// pod creates a ready pod of app web, as a kubelet would report it.
	pod := func(name, node, ip string, hostNetwork bool, finalizers ...string) *corev1.Pod {
		p, err := cs.CoreV1().Pods("shop").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "shop", Labels: map[string]string{"app": "web"}, Finalizers: finalizers},
			Spec:       corev1.PodSpec{NodeName: node, HostNetwork: hostNetwork, Containers: []corev1.Container{{Name: "app", Image: "app"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
		if p, err = cs.CoreV1().Pods("shop").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		return p
	}
	local := pod("web-1", "node1", "10.244.1.5", false)
	localHost := pod("agent-1", "node1", "192.168.0.1", true)
	pod("agent-2", "node2", "192.168.0.2", true)
	// a-old sorts before b-new, which is given its address.
	pod("a-old", "node2", "10.244.2.9", false, "example.com/hold")
	t.Cleanup(func() {
		if p, err := cs.CoreV1().Pods("shop").Get(ctx, "a-old", metav1.GetOptions{}); err == nil {
			p.Finalizers = nil
			_, _ = cs.CoreV1().Pods("shop").Update(ctx, p, metav1.UpdateOptions{})
		}
	})
	if err := cs.CoreV1().Pods("shop").Delete(ctx, "a-old", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pod("b-new", "node2", "10.244.2.9", false)
	if _, err := cs.CoreV1().Services("shop").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "web"}, ClusterIP: "10.96.0.60",
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	createServiceEntry(t, cp.Dynamic, "shop", "selected", map[string]any{
		"hosts": []any{"selected.example.com"}, "addresses": []any{"240.1.1.10"}, "resolution": "STATIC",
		"ports":            []any{map[string]any{"number": int64(80), "name": "tcp", "protocol": "TCP", "targetPort": int64(9090)}},
		"workloadSelector": map[string]any{"labels": map[string]any{"app": "web"}}})
	state := nodepods.State{Namespaces: []corev1.Namespace{*ns}, Pods: []corev1.Pod{*local, *localHost}}

	snaps := istiodSnapshots(t, cp)
	uid := func(name string) string { return istiotest.ClusterID + "//Pod/shop/" + name }
	check := func(s *Snapshot) error {
		snap, _ := merge(state, s, "node1", selection.Config{}, nil)
		dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
		for _, vip := range []string{"10.96.0.60", "240.1.1.10"} {
			svc, ok := dir.ServiceByVIP(netip.MustParseAddr(vip))
			if !ok {
				return fmt.Errorf("no service at %s", vip)
			}
			want := map[string]string{ // pod -> the uid its endpoint resolves to; "-" none, "" unresolved
				"web-1": string(local.UID), "agent-1": "-", "agent-2": "-", "a-old": "", "b-new": uid("b-new"),
			}
			for _, ep := range svc.Endpoints {
				w, ok := want[ep.PodName]
				if !ok {
					return fmt.Errorf("%s: unexpected endpoint %s of %q", vip, ep.Addr, ep.PodName)
				}
				delete(want, ep.PodName)
				got := "-"
				switch {
				case ep.Unresolved:
					got = ""
				case ep.Workload != nil:
					got = ep.Workload.UID
				}
				if got != w {
					return fmt.Errorf("%s: endpoint %s of %s resolves to %q, want %q (\"\": unresolved, \"-\": no workload)", vip, ep.Addr, ep.PodName, got, w)
				}
			}
			if len(want) > 0 {
				return fmt.Errorf("%s: no endpoint of %v", vip, want)
			}
		}
		return nil
	}
	waitForIstiodState(t, snaps, check)
}

// waitForIstiodState waits up to a minute for a snapshot from snaps that check accepts
// (returns nil for), failing t with check's last complaint: istiod sends the cluster's
// state over several pushes, so early snapshots may lack part of it.
func waitForIstiodState(t *testing.T, snaps <-chan *Snapshot, check func(*Snapshot) error) {
	t.Helper()
	deadline := time.After(60 * time.Second)
	var last error
	for {
		select {
		case s := <-snaps:
			if last = check(s); last == nil {
				return
			}
		case <-deadline:
			t.Fatalf("istiod's state never came out as wanted: %v", last)
		}
	}
}
