package kubernetes_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// outageProxy stands between a source and the test API server. While down it answers
// requests with 503, and going down cuts the streams it is serving (watches end with an
// unexpected EOF), as an API server outage or a broken network path does. An outage may
// spare some paths (a partial outage).
type outageProxy struct {
	srv   *httptest.Server
	proxy *httputil.ReverseProxy

	mu      sync.Mutex
	down    bool
	spared  string // while down, paths with this prefix still pass ("": none)
	hidden  string // this exact path answers 404 ("": none)
	slowed  string // requests for paths with this prefix wait slowFor first ("": none)
	slowFor time.Duration
	gen     context.Context // cancelled when the proxy goes down: cuts open streams
	cut     context.CancelFunc
}

func newOutageProxy(t *testing.T, c *kubetest.Cluster) *outageProxy {
	t.Helper()
	target, err := url.Parse(c.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	rt, err := rest.TransportFor(c.Config) // TLS to the API server and the bearer token
	if err != nil {
		t.Fatal(err)
	}
	p := &outageProxy{proxy: httputil.NewSingleHostReverseProxy(target)}
	p.proxy.Transport = rt
	p.proxy.FlushInterval = -1
	p.proxy.ErrorLog = nil
	p.gen, p.cut = context.WithCancel(context.Background())
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(func() {
		p.setDown(true)
		p.srv.Close()
	})
	return p
}

func (p *outageProxy) serve(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	down, spared, hidden, gen := p.down, p.spared, p.hidden, p.gen
	slowed, slowFor := p.slowed, p.slowFor
	p.mu.Unlock()
	if slowed != "" && strings.HasPrefix(r.URL.Path, slowed) {
		select {
		case <-time.After(slowFor):
		case <-r.Context().Done():
			return
		}
	}
	if hidden != "" && r.URL.Path == hidden {
		http.Error(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`, http.StatusNotFound)
		return
	}
	if down && (spared == "" || !strings.HasPrefix(r.URL.Path, spared)) {
		http.Error(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"ServiceUnavailable","code":503}`, http.StatusServiceUnavailable)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stop := context.AfterFunc(gen, cancel)
	defer stop()
	p.proxy.ServeHTTP(w, r.WithContext(ctx))
}

func (p *outageProxy) setDown(down bool) { p.setDownSparing(down, "") }

// setDownSparing is setDown letting requests for paths under spared through.
func (p *outageProxy) setDownSparing(down bool, spared string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down, p.spared = down, spared
	if down {
		p.cut() // streams open now end; spared requests get a fresh context below
	}
	p.gen, p.cut = context.WithCancel(context.Background())
}

// hide makes path answer 404 ("" to stop).
func (p *outageProxy) hide(path string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hidden = path
}

// slow makes requests for paths under prefix wait d before they are served ("" to stop), as
// an API server under load answers them.
func (p *outageProxy) slow(prefix string, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.slowed, p.slowFor = prefix, d
}

// config reaches the API server through the proxy.
func (p *outageProxy) config() *rest.Config {
	return &rest.Config{Host: p.srv.URL, QPS: 100, Burst: 200}
}

// runSourceWith is runSource for a given Config, with its snapshots and metrics.
func runSourceWith(t *testing.T, cfg kubernetes.Config) *watcher {
	t.Helper()
	cfg.NodeName = "node-a"
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	src, err := kubernetes.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := &watcher{change: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- src.Run(ctx, func(s source.Snapshot) {
			w.mu.Lock()
			w.snaps = append(w.snaps, s)
			w.mu.Unlock()
			select {
			case w.change <- struct{}{}:
			default:
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Run did not return after its context was cancelled")
		}
	})
	return w
}

func (w *watcher) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.snaps)
}

func errorCount(t *testing.T, m *source.Metrics, reason string) float64 {
	t.Helper()
	return promtest.Scrape(t, m)[`redirector_source_errors_total{reason="`+reason+`",source="kubernetes"}`]
}

// TestSourceUnreachableAtStart: with no API server to answer, the source delivers nothing (an
// empty first snapshot would unenroll every pod a previous agent enrolled), counts the
// failures, and delivers the full state once the API server answers.
func TestSourceUnreachableAtStart(t *testing.T) {
	t.Parallel()
	c := kubetest.Start(t)
	createNamespace(t, c.Client(t), "before", ambient)
	p := newOutageProxy(t, c)
	p.setDown(true)

	m := source.NewMetrics(nil)
	w := runSourceWith(t, kubernetes.Config{RestConfig: p.config(), Metrics: m, PolicyRecheck: 200 * time.Millisecond})
	time.Sleep(3 * time.Second)
	if n := w.count(); n != 0 {
		t.Fatalf("%d snapshots delivered with the API server unreachable", n)
	}
	if errorCount(t, m, source.ReasonDiscovery)+errorCount(t, m, source.ReasonListWatch) == 0 {
		t.Error("no source error counted while the API server was unreachable")
	}

	p.setDown(false)
	w.waitFor(t, "namespace created before the start", func(s source.Snapshot) bool {
		return slices.Contains(s.AmbientNamespaces, "before")
	})
}

// TestSourceOutageKeepsLastState cuts the API server off under a running source, long enough
// for its watches to fail and its relists to fail too, except for Services: a Service created
// meanwhile makes a snapshot, which must still hold every object, policies included. The
// errors are counted; once the API server is back, what changed during the outage arrives,
// and no snapshot ever lacked an object.
func TestSourceOutageKeepsLastState(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1")
	createNamespace(t, client, "shop", ambient)
	createRunningPod(t, client, "shop", "web", "node-a", "10.244.1.5", "")
	createStrictPeerAuthentication(t, dyn, "v1", "shop")
	waitServed(t, c.Config, authzGVR)
	waitServed(t, c.Config, peerAuthGVR)

	p := newOutageProxy(t, c)
	m := source.NewMetrics(nil)
	w := runSourceWith(t, kubernetes.Config{RestConfig: p.config(), Metrics: m, PolicyRecheck: 200 * time.Millisecond})
	complete := func(s source.Snapshot) bool {
		return slices.Contains(s.AmbientNamespaces, "shop") &&
			slices.ContainsFunc(s.Workloads, withIP("shop", "web", "10.244.1.5")) &&
			slices.ContainsFunc(s.PeerAuthentications, named[policy.PeerAuthentication]("shop", "strict"))
	}
	w.waitFor(t, "namespace, pod and PeerAuthentication", complete)

	p.setDownSparing(true, "/api/v1/services")
	time.Sleep(4 * time.Second)
	createNamespace(t, client, "during", ambient) // behind the source's back
	if _, err := client.CoreV1().Services("shop").Create(t.Context(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "during"},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 80}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor(t, "the Service created during the outage", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.Services, isService("shop", "during"))
	})
	if errorCount(t, m, source.ReasonListWatch) == 0 {
		t.Error("no list/watch error counted during the outage")
	}

	p.setDown(false)
	w.waitFor(t, "the namespace created during the outage", func(s source.Snapshot) bool {
		return complete(s) && slices.Contains(s.AmbientNamespaces, "during")
	})
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, s := range w.snaps {
		if !complete(s) {
			t.Errorf("snapshot %d of %d lacks an object: ambient namespaces %v, %d workloads, %d PeerAuthentications",
				i+1, len(w.snaps), s.AmbientNamespaces, len(s.Workloads), len(s.PeerAuthentications))
		}
	}
}

// TestSourceWaitsForInstalledCRDs: discovery does not list security.istio.io/v1 (as right after
// an API server start) while its CRDs exist. The source must not start without policies (that
// would drop STRICT until its next check): no snapshot until discovery serves them, then one
// with the PeerAuthentication.
func TestSourceWaitsForInstalledCRDs(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1")
	createNamespace(t, client, "shop", nil)
	createStrictPeerAuthentication(t, dyn, "v1", "shop")
	waitServed(t, c.Config, peerAuthGVR)

	p := newOutageProxy(t, c)
	p.hide("/apis/security.istio.io/v1")
	m := source.NewMetrics(nil)
	w := runSourceWith(t, kubernetes.Config{RestConfig: p.config(), Metrics: m, PolicyRecheck: 200 * time.Millisecond})
	time.Sleep(3 * time.Second)
	if n := w.count(); n != 0 {
		t.Fatalf("%d snapshots delivered while the installed policy CRDs were not served", n)
	}
	if errorCount(t, m, source.ReasonDiscovery) == 0 {
		t.Error("no discovery error counted")
	}
	p.hide("")
	first := w.first(t)
	if !slices.ContainsFunc(first.PeerAuthentications, named[policy.PeerAuthentication]("shop", "strict")) {
		t.Fatalf("first snapshot lacks the PeerAuthentication: %+v", first.PeerAuthentications)
	}
}

// TestSlowPolicyDiscoveryHoldsNoSnapshotBack: in a cluster without Istio's CRDs the source
// looks for them every PolicyRecheck. An API server slow to answer that discovery (under
// load, discovery waits its turn as any request) must not hold back snapshots of pod
// changes: a new pod's CNI ADD waits for the pod to reach a snapshot, and fails after 20 s.
// Before, the look-up ran on the goroutine that makes snapshots, so every change waited for
// it, up to the discovery client's 32 s timeout per request. Run still returns at once when
// cancelled during a look-up.
func TestSlowPolicyDiscoveryHoldsNoSnapshotBack(t *testing.T) {
	t.Parallel()
	c := kubetest.Start(t)
	client := c.Client(t)
	createNamespace(t, client, "shop", ambient)
	p := newOutageProxy(t, c)
	w := runSourceWith(t, kubernetes.Config{RestConfig: p.config(), PolicyRecheck: 100 * time.Millisecond})
	w.waitFor(t, "the ambient namespace", func(s source.Snapshot) bool { return slices.Contains(s.AmbientNamespaces, "shop") })

	const slowFor = 15 * time.Second
	p.slow("/apis/security.istio.io/", slowFor) // still slow when Run must return, at cleanup
	time.Sleep(time.Second)                     // a look-up is under way
	start := time.Now()
	createRunningPod(t, client, "shop", "web", "node-a", "10.244.1.5", "")
	w.waitFor(t, "the new pod", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.Workloads, withIP("shop", "web", "10.244.1.5"))
	})
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the new pod reached a snapshot after %v, held back by the slow policy discovery", took.Round(time.Millisecond))
	}
}

// TestSourceDropsPoliciesOfDeletedCRD: Istio's CRDs are deleted (Istio uninstalled) while the
// source is cut off from the API server, so it never sees its policies' deletions; once back,
// its relists answer 404. Before, the informers retried for ever and the policies stayed in
// force (a DENY kept denying). The kind is looked up again: its CRD gone, it has no policies.
func TestSourceDropsPoliciesOfDeletedCRD(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1")
	createNamespace(t, client, "shop", ambient)
	createDenyAll(t, dyn, "v1", "shop", "deny-all")
	waitServed(t, c.Config, authzGVR)
	waitServed(t, c.Config, peerAuthGVR)

	p := newOutageProxy(t, c)
	w := runSourceWith(t, kubernetes.Config{RestConfig: p.config(), PolicyRecheck: 200 * time.Millisecond})
	w.waitFor(t, "the DENY policy", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-all"))
	})

	p.setDown(true)
	for _, name := range []string{"peerauthentications.security.istio.io", "authorizationpolicies.security.istio.io"} {
		if err := dyn.Resource(crdGVR).Delete(t.Context(), name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(100 * time.Millisecond) {
		_, err := dyn.Resource(crdGVR).Get(t.Context(), "authorizationpolicies.security.istio.io", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("CRD not deleted after %v: %v", waitTimeout, err)
		}
	}
	createNamespace(t, client, "after", ambient)
	p.setDown(false)
	w.waitFor(t, "the namespace made after the CRDs were deleted, without the DENY policy", func(s source.Snapshot) bool {
		return slices.Contains(s.AmbientNamespaces, "after") &&
			!slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-all"))
	})
}
