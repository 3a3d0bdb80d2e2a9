package xds_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/source/xds"
	"github.com/redirector-mesh/redirector/test/istiotest"
)

// TestIstiodChurnAcrossReconnects: a client whose stream to a real istiod
// is cut again and again, while pods, Services, ServiceEntries,
// WorkloadEntries, PeerAuthentications and AuthorizationPolicies are
// created, changed and deleted (some while its stream is down, so it
// resumes with initial_resource_versions and istiod sends only changes
// and removals), ends every round with the very model a client that
// connected afresh gets. A resource removed while the stream was down and
// not removed on resume, or a change istiod skipped as already held,
// would stay in the long-lived client's model for good.
func TestIstiodChurnAcrossReconnects(t *testing.T) {
	rounds := 8
	if s := os.Getenv("XDS_CHURN_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("XDS_CHURN_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (XDS_CHURN_SEED)", seed)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))

	cp := istiotest.StartControlPlane(t)
	cs, dyn, istiod := cp.Client, cp.Dynamic, cp.Istiod
	ctx := context.Background()
	const ns = "churn"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns,
		Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	token := istiotest.AgentToken(t, cs, istiotest.AgentAccount, "node1", istiotest.Audience)
	bundle, err := identity.LoadBundle(istiod.RootCertFile, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	proxy := newCutProxy(t, istiod.Addr)
	long := startChurnClient(t, proxy.addr, bundle, token)

	w := &churnWorld{t: t, rng: rng, cs: cs, dyn: dyn, ns: ns, objs: map[string]bool{}}
	for round := range rounds {
		cut := rng.IntN(3) // 0: no cut; 1: cut, changes while down; 2: changes, then cut
		if cut == 1 {
			proxy.down(true)
		}
		for range 4 + rng.IntN(8) {
			w.step(round)
		}
		switch cut {
		case 1:
			time.Sleep(time.Duration(rng.IntN(1500)) * time.Millisecond)
			proxy.down(false)
		case 2:
			time.Sleep(time.Duration(rng.IntN(300)) * time.Millisecond)
			proxy.down(true)
			time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond)
			proxy.down(false)
		}
		fresh := startChurnClient(t, istiod.Addr, bundle, token)
		if diff := converge(long, fresh, 45*time.Second); diff != "" {
			t.Fatalf("round %d (cut %d, seed %d): the resumed client's model differs from a fresh one's:\n%s\nlast ops:\n%s", round, cut, seed, diff, strings.Join(w.log[max(0, len(w.log)-20):], "\n"))
		}
		fresh.stop()
		t.Logf("round %d (cut %d): %d workloads, %d services, %d policies agree", round, cut, len(long.latest().Workloads), len(long.latest().Services), len(long.latest().Policies))
	}
}

// churnWorld makes random changes to one namespace.
type churnWorld struct {
	t    *testing.T
	rng  *rand.Rand
	cs   kubernetes.Interface
	dyn  dynamic.Interface
	ns   string
	objs map[string]bool // kind/name of what exists
	seq  int
	log  []string
}

var churnGVR = map[string]schema.GroupVersionResource{
	"ServiceEntry":        {Group: "networking.istio.io", Version: "v1", Resource: "serviceentries"},
	"WorkloadEntry":       {Group: "networking.istio.io", Version: "v1", Resource: "workloadentries"},
	"PeerAuthentication":  {Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"},
	"AuthorizationPolicy": {Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"},
}

func (w *churnWorld) step(round int) {
	t, ctx, rng := w.t, context.Background(), w.rng
	w.seq++
	app := []string{"a", "b"}[rng.IntN(2)]
	n := rng.IntN(6)
	switch rng.IntN(9) {
	case 0, 1: // a pod: created, relabelled or deleted
		name := fmt.Sprintf("p%d", n)
		if !w.objs["Pod/"+name] {
			ip := fmt.Sprintf("10.244.%d.%d", 1+rng.IntN(2), 10+w.seq%200)
			istiotest.CreatePod(t, w.cs, w.ns, name, "sa-"+app, []string{"node1", "node2"}[rng.IntN(2)], ip)
			meshed := rng.IntN(2) == 0
			w.updatePod(name, func(p *corev1.Pod) {
				p.Labels = map[string]string{"app": app}
				if meshed {
					p.Annotations = map[string]string{"ambient.istio.io/redirection": "enabled"}
				}
			})
			w.objs["Pod/"+name] = true
			w.note("create pod %s %s app=%s", name, ip, app)
			return
		}
		if rng.IntN(2) == 0 {
			var meshed bool
			w.updatePod(name, func(p *corev1.Pod) {
				p.Labels = map[string]string{"app": app}
				if meshed = p.Annotations == nil; meshed {
					p.Annotations = map[string]string{"ambient.istio.io/redirection": "enabled"}
				} else {
					p.Annotations = nil
				}
			})
			w.note("update pod %s app=%s annotated=%v", name, app, meshed)
			return
		}
		zero := int64(0)
		if err := w.cs.CoreV1().Pods(w.ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			t.Fatal(err)
		}
		delete(w.objs, "Pod/"+name)
		w.note("delete pod %s", name)
	case 2: // a Service
		name := fmt.Sprintf("s%d", n)
		if !w.objs["Service/"+name] {
			if _, err := w.cs.CoreV1().Services(w.ns).Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name},
				Spec: corev1.ServiceSpec{Selector: map[string]string{"app": app}, ClusterIP: fmt.Sprintf("10.96.%d.%d", round%200, 10+w.seq%200),
					Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(int32(8000 + n))}}},
			}, metav1.CreateOptions{}); err != nil && !apierrors.IsInvalid(err) {
				t.Fatal(err)
			} else if err != nil {
				return // the cluster IP is taken
			}
			w.objs["Service/"+name] = true
			w.note("create service %s app=%s", name, app)
			return
		}
		if err := w.cs.CoreV1().Services(w.ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		delete(w.objs, "Service/"+name)
		w.note("delete service %s", name)
	case 3: // a ServiceEntry with endpoints
		w.istio("ServiceEntry", fmt.Sprintf("se%d", n), map[string]any{
			"hosts": []any{fmt.Sprintf("se%d-%d.example.com", n, w.seq)}, "addresses": []any{fmt.Sprintf("240.0.%d.%d", n, w.seq%200)},
			"resolution": "STATIC", "ports": []any{map[string]any{"number": int64(443), "name": "tls", "protocol": "TLS"}},
			"endpoints": []any{map[string]any{"address": fmt.Sprintf("10.250.%d.%d", n, w.seq%200)}},
		})
	case 4: // a WorkloadEntry, meshed or not
		spec := map[string]any{"address": fmt.Sprintf("10.251.%d.%d", n, w.seq%200), "labels": map[string]any{"app": app}, "serviceAccount": "sa-" + app}
		w.istioMeta("WorkloadEntry", fmt.Sprintf("we%d", n), spec, rng.IntN(2) == 0)
	case 5: // a PeerAuthentication
		mode := []string{"STRICT", "PERMISSIVE"}[rng.IntN(2)]
		spec := map[string]any{"mtls": map[string]any{"mode": mode}}
		if rng.IntN(2) == 0 {
			spec["selector"] = map[string]any{"matchLabels": map[string]any{"app": app}}
		}
		w.istio("PeerAuthentication", fmt.Sprintf("pa%d", n%3), spec)
	default: // an AuthorizationPolicy
		spec := map[string]any{
			"selector": map[string]any{"matchLabels": map[string]any{"app": app}},
			"action":   []string{"ALLOW", "DENY"}[rng.IntN(2)],
			"rules": []any{map[string]any{
				"from": []any{map[string]any{"source": map[string]any{"principals": []any{fmt.Sprintf("cluster.local/ns/%s/sa/sa-%s", w.ns, app)}}}},
				"to":   []any{map[string]any{"operation": map[string]any{"ports": []any{strconv.Itoa(8000 + w.seq%50)}}}},
			}},
		}
		w.istio("AuthorizationPolicy", fmt.Sprintf("ap%d", n), spec)
	}
}

func (w *churnWorld) istio(kind, name string, spec map[string]any) {
	w.istioMeta(kind, name, spec, false)
}

// istioMeta creates the object if it does not exist, else replaces its
// spec or deletes it (at random).
func (w *churnWorld) istioMeta(kind, name string, spec map[string]any, meshed bool) {
	t, ctx := w.t, context.Background()
	r := w.dyn.Resource(churnGVR[kind]).Namespace(w.ns)
	key := kind + "/" + name
	meta := map[string]any{"name": name, "namespace": w.ns}
	if meshed {
		meta["annotations"] = map[string]any{"ambient.istio.io/redirection": "enabled"}
	}
	obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": churnGVR[kind].GroupVersion().String(), "kind": kind, "metadata": meta, "spec": spec}}
	switch {
	case !w.objs[key]:
		if _, err := r.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create %s: %v", key, err)
		}
		w.objs[key] = true
		w.note("create %s", key)
	case w.rng.IntN(2) == 0:
		// istiod writes the status of what it reads: read again on a
		// conflict.
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			old, err := r.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			obj.SetResourceVersion(old.GetResourceVersion())
			_, err = r.Update(ctx, obj, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			t.Fatalf("update %s: %v", key, err)
		}
		w.note("update %s", key)
	default:
		if err := r.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatalf("delete %s: %v", key, err)
		}
		delete(w.objs, key)
		w.note("delete %s", key)
	}
}

// updatePod changes pod name with change, read again on a conflict.
func (w *churnWorld) updatePod(name string, change func(*corev1.Pod)) {
	ctx := context.Background()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		p, err := w.cs.CoreV1().Pods(w.ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(p)
		_, err = w.cs.CoreV1().Pods(w.ns).Update(ctx, p, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		w.t.Fatalf("update pod %s: %v", name, err)
	}
}

func (w *churnWorld) note(format string, args ...any) {
	w.log = append(w.log, fmt.Sprintf(format, args...))
}

// churnClient is an xDS client of istiod and its latest snapshot.
type churnClient struct {
	mu   sync.Mutex
	last *xds.Snapshot
	stop func()
}

func startChurnClient(t *testing.T, addr string, bundle identity.Trust, token string) *churnClient {
	t.Helper()
	conn, err := xds.Dial(addr, "", bundle)
	if err != nil {
		t.Fatal(err)
	}
	c, err := xds.New(xds.Config{
		Conn: conn, Token: xds.TokenFile(token), Metrics: xds.NewMetrics(nil),
		MinBackoff: 100 * time.Millisecond, MaxBackoff: time.Second,
		Logger: slog.New(slog.DiscardHandler),
		Node:   xds.Node{IP: netip.MustParseAddr("127.0.0.1"), PodName: "redirector-node1", PodNamespace: istiotest.Namespace, NodeName: "node1", ClusterID: istiotest.ClusterID},
	})
	if err != nil {
		t.Fatal(err)
	}
	cc := &churnClient{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx, func(s *xds.Snapshot) {
			cc.mu.Lock()
			cc.last = s
			cc.mu.Unlock()
		})
	}()
	var once sync.Once
	cc.stop = func() { once.Do(func() { cancel(); <-done; conn.Close() }) }
	t.Cleanup(cc.stop)
	return cc
}

func (c *churnClient) latest() *xds.Snapshot {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

// converge waits until both clients' models agree and returns "", or the
// differences at the deadline.
func converge(a, b *churnClient, within time.Duration) string {
	deadline := time.Now().Add(within)
	for {
		diff := "no snapshot yet"
		if sa, sb := a.latest(), b.latest(); sa != nil && sb != nil {
			if diff = diffModels(canonModel(sa), canonModel(sb)); diff == "" {
				// Agreeing once could be half-way through a push: again
				// after a while.
				time.Sleep(time.Second)
				if diff = diffModels(canonModel(a.latest()), canonModel(b.latest())); diff == "" {
					return ""
				}
			}
		}
		if time.Now().After(deadline) {
			return diff
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// canonModel is a snapshot as text per resource, in an order-independent
// form.
func canonModel(s *xds.Snapshot) map[string]string {
	out := map[string]string{}
	enc := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			return "error: " + err.Error()
		}
		return string(b)
	}
	for _, w := range s.Workloads {
		c := *w
		c.Policies = slices.Sorted(slices.Values(c.Policies))
		out["workload "+w.UID] = enc(c)
	}
	for _, svc := range s.Services {
		out["service "+svc.Key()] = enc(svc)
	}
	for _, p := range s.Policies {
		out["policy "+p.Key()] = enc(p)
	}
	out["unresolved"] = enc(s.Unresolved)
	return out
}

func diffModels(a, b map[string]string) string {
	var d []string
	for k, v := range a {
		if w, ok := b[k]; !ok {
			d = append(d, "only resumed: "+k+" "+v)
		} else if v != w {
			d = append(d, "differs: "+k+"\n  resumed: "+v+"\n  fresh:   "+w)
		}
	}
	for k, v := range b {
		if _, ok := a[k]; !ok {
			d = append(d, "only fresh: "+k+" "+v)
		}
	}
	sort.Strings(d)
	return strings.Join(d, "\n")
}

// cutProxy forwards TCP to a backend; down(true) closes every open
// connection and refuses new ones until down(false).
type cutProxy struct {
	addr    string
	backend string
	mu      sync.Mutex
	conns   map[net.Conn]bool
	isDown  bool
}

func newCutProxy(t *testing.T, backend string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{addr: ln.Addr().String(), backend: backend, conns: map[net.Conn]bool{}}
	t.Cleanup(func() { ln.Close(); p.down(true) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

func (p *cutProxy) serve(c net.Conn) {
	p.mu.Lock()
	if p.isDown {
		p.mu.Unlock()
		c.Close()
		return
	}
	p.mu.Unlock()
	b, err := net.Dial("tcp", p.backend)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	if p.isDown {
		p.mu.Unlock()
		c.Close()
		b.Close()
		return
	}
	p.conns[c], p.conns[b] = true, true
	p.mu.Unlock()
	go func() { io.Copy(b, c); b.Close(); c.Close() }()
	io.Copy(c, b)
	c.Close()
	b.Close()
}

func (p *cutProxy) down(d bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.isDown = d
	if d {
		for c := range p.conns {
			c.Close()
		}
		clear(p.conns)
	}
}
