package tunnel

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// plainWitness is a plaintext server standing at a destination's address:
// it reports every byte that reaches it.
type plainWitness struct {
	l   net.Listener
	got chan []byte
}

// reachedFrom hands p an app connection to dst, as the pod's capture
// would, the app writing a request, and reports whether the request
// reached w. The handler returns once the relay ends, which w's close
// (after it reported) also does, so its return alone says nothing: w gets
// 300 ms more then. A handler that neither reached w nor returned within
// wait fails the test.
func (w *plainWitness) reachedFrom(t *testing.T, p *pod, dst string, wait time.Duration) bool {
	t.Helper()
	app, c := clientConnTo(dst)
	defer app.Close()
	defer c.Close()
	go func() {
		_, _ = app.Write([]byte("secret request"))
		_, _ = io.Copy(io.Discard, app)
	}()
	done := make(chan struct{})
	go func() { defer close(done); p.handleOutbound(c) }()
	select {
	case <-w.got:
		return true
	case <-done:
	case <-time.After(wait):
		t.Fatalf("outbound handler to %s neither reached it nor returned in %v", dst, wait)
	}
	select {
	case <-w.got:
		return true
	case <-time.After(300 * time.Millisecond):
		return false
	}
}

func newPlainWitness(t *testing.T, addr string) *plainWitness {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	w := &plainWitness{l: l, got: make(chan []byte, 16)}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
				b := make([]byte, 512)
				n, _ := c.Read(b)
				w.got <- b[:n]
			}()
		}
	}()
	return w
}

func (w *plainWitness) port() uint16 { return uint16(w.l.Addr().(*net.TCPAddr).Port) }

// clientConnTo is what the capture hands the outbound listener when the
// client pod (10.1.0.1) connects to dst: c, the tunnel's side, and app, the
// app's end of the same pipe.
func clientConnTo(dst string) (app net.Conn, c *fakeConn) {
	app, tunnelSide := net.Pipe()
	return app, &fakeConn{Conn: tunnelSide, local: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(dst)),
		remote: net.TCPAddrFromAddrPort(netip.MustParseAddrPort("10.1.0.1:40000"))}
}

// outboundClient is the client pod (uid-client, 10.1.0.1) of tun serving
// outbound connections in this process's namespace; it stops, with 5 s to
// end its connections, when the test ends.
func outboundClient(t *testing.T, tun *Tunnel) *pod {
	t.Helper()
	p := testPod(tun, "uid-client", netip.MustParseAddr("10.1.0.1"))
	inOwnNamespace(t, p)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		p.stop(ctx)
	})
	return p
}

// setDirectory gives tun the directory of these workloads and services,
// which must all be valid.
func setDirectory(t *testing.T, tun *Tunnel, workloads []*workload.Workload, services []*workload.Service) {
	t.Helper()
	dir, errs := workload.NewDirectory(workloads, services)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	tun.Update(&State{Dir: dir})
}

// tunnelWithPool is a test tunnel that can open HBONE: certificates and a
// pool (its dials fail before any handshake when nothing listens).
func tunnelWithPool(t *testing.T) *Tunnel {
	t.Helper()
	pki := identitytest.NewPKI(t, "ecdsa")
	ca, err := identity.LoadCAFor(identitytest.WriteCacerts(t, pki), "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	certs := identity.NewManager(ca, time.Hour, nil)
	t.Cleanup(certs.Close)
	pool := hbone.NewPool(hbone.PoolOptions{})
	t.Cleanup(func() { pool.Close() })
	return New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008,
		TunnelMark: testMark, Certs: certs, Pool: pool, Metrics: NewMetrics(prometheus.NewRegistry()), NoAccessLog: true})
}

// TestOutboundToCapturedPodNeverPlaintext: a pod of another node whose
// own node records it captured (annotation
// ambient.istio.io/redirection=enabled, Workload.Redirected) takes HBONE,
// whatever this agent's rules say of it: its namespace not (yet) in this
// agent's view, a namespace label just removed while its node has not
// detached it yet, nodes whose settings differ. istiod decides a pod's
// tunnel protocol by that annotation. Before, such a pod was dialled in
// plain TCP, directly and as a service endpoint, and the app's bytes
// crossed the network in plaintext to a meshed pod (which, STRICT,
// refused them only once they had arrived).
func TestOutboundToCapturedPodNeverPlaintext(t *testing.T) {
	tun := tunnelWithPool(t)
	witness := newPlainWitness(t, "127.0.0.2:0")
	client := podObj("mesh", "client", "client", "10.1.0.1", nil)
	remote := podObj("fresh", "server", "server", "127.0.0.2", nil)
	remote.Node, remote.Enrolled, remote.Redirected = "n2", false, true
	remote.Reason = "no istio.io/dataplane-mode=ambient label on pod or namespace"
	svc := &workload.Service{Name: "server", Namespace: "fresh", Hostname: "server.fresh.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.20")},
		Ports:     []workload.ServicePort{{Name: "tcp", Port: 80, TargetPort: int32(witness.port())}},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("127.0.0.2"), Ready: true}}}
	setDirectory(t, tun, []*workload.Workload{client, remote}, []*workload.Service{svc})
	p := outboundClient(t, tun)
	for _, dst := range []string{
		"127.0.0.2:" + strconv.Itoa(int(witness.port())), // the pod's own address
		"10.96.0.20:80", // its service
		// As a dual-stack socket reports an IPv4 destination.
		"[::ffff:127.0.0.2]:" + strconv.Itoa(int(witness.port())),
		"[::ffff:10.96.0.20]:80",
	} {
		app, c := clientConnTo(dst)
		go func() {
			_, _ = app.Write([]byte("secret request"))
			_, _ = io.Copy(io.Discard, app)
		}()
		done := make(chan struct{})
		go func() { defer close(done); p.handleOutbound(c) }()
		select {
		case b := <-witness.got:
			t.Errorf("to %s: %q reached the captured pod in plaintext", dst, b)
		case <-done:
			select {
			case b := <-witness.got:
				t.Errorf("to %s: %q reached the captured pod in plaintext", dst, b)
			case <-time.After(500 * time.Millisecond):
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("to %s: outbound handler still running", dst)
		}
		app.Close()
		c.Close()
	}
}

// TestInboundJudgedOnlyAsTheServedPod: an inbound connection is decided
// with the policies of the pod whose listener took it, never those of
// another workload the directory has at that address. A terminating pod
// loses its address in the directory to any pod that is not terminating
// (a kubelet writes its own pods' status.podIPs, and a compromised one
// can name any address), while the terminating pod still runs and takes
// connections. Before, those were judged by the other pod's namespace
// and labels: a STRICT pod took plaintext under the other namespace's
// PERMISSIVE, and AuthorizationPolicies selecting it did not apply. Such a
// connection is refused and counted instead, and an open one is closed
// when an update gives its address away.
func TestInboundJudgedOnlyAsTheServedPod(t *testing.T) {
	tun := newTestTunnel(t, nil)
	server := podObj("strict", "server", "server", "10.1.0.2", nil)
	server.Terminating = true
	intruder := podObj("open", "intruder", "intruder", "10.1.0.2", nil)
	intruder.Node = "n2"
	strict := policy.PeerAuthentication{Meta: policy.Meta{Namespace: "strict", Name: "strict"},
		Spec: policy.PeerAuthenticationSpec{MTLS: &policy.MTLS{Mode: policy.ModeStrict}}}
	own := testDir(t, server)
	tun.Update(&State{Dir: own, PeerAuthentications: []policy.PeerAuthentication{strict}})
	p := testPod(tun, server.Key(), netip.MustParseAddr("10.1.0.2"))

	// Open over mTLS while the directory is right.
	peer := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	var closed atomic.Bool
	ic := p.track(netip.MustParseAddrPort("10.1.0.2:8080"), netip.MustParseAddrPort("10.2.0.1:40000"), peer, true)
	ic.connected(func() { closed.Store(true) })

	taken, _ := workload.NewDirectory([]*workload.Workload{server, intruder}, nil)
	if w, _ := taken.ByAddr(netip.MustParseAddr("10.1.0.2")); w != intruder {
		t.Fatalf("directory gives the address to %v, want the intruder", w)
	}
	tun.Update(&State{Dir: taken, PeerAuthentications: []policy.PeerAuthentication{strict}})
	if !closed.Load() {
		t.Error("an open connection to the pod stayed open after its address went to another workload")
	}
	c := newFakeConn("10.1.0.2:8080", "10.2.0.7:40000")
	p.handleInboundPlaintext(c)
	if !c.closed.Load() {
		t.Error("plaintext connection left open")
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues(reasonNotThisPod)); got != 1 {
		t.Errorf("fail_closed{%s} = %v, want 1: the plaintext connection was judged as the other workload's", reasonNotThisPod, got)
	}
	for _, tc := range []struct {
		name   string
		secure bool
	}{{"plaintext", false}, {"mTLS", true}} {
		podW, why, _, _ := tun.inboundVerdict(tun.State(), p, netip.MustParseAddrPort("10.1.0.2:8080"), netip.MustParseAddr("10.2.0.7"), peer, tc.secure)
		if why != reasonNotThisPod || podW != nil {
			t.Errorf("%s: verdict %v %q, want %q", tc.name, podW, why, reasonNotThisPod)
		}
	}
}

// TestInboundClosedWhenAddressGoesToLookalike: an open connection is
// decided again when its pod's address goes to another workload, even one
// of the same namespace and labels (nothing the policies read changed, but
// the pod is no longer the directory's at that address).
func TestInboundClosedWhenAddressGoesToLookalike(t *testing.T) {
	tun := newTestTunnel(t, nil)
	server := podObj("mesh", "server", "server", "10.1.0.2", map[string]string{"app": "web"})
	server.Terminating = true
	lookalike := podObj("mesh", "web-2", "server", "10.1.0.2", map[string]string{"app": "web"})
	lookalike.Node = "n2"
	tun.Update(&State{Dir: testDir(t, server)})
	p := testPod(tun, server.Key(), netip.MustParseAddr("10.1.0.2"))
	var closed atomic.Bool
	ic := p.track(netip.MustParseAddrPort("10.1.0.2:8080"), netip.MustParseAddrPort("10.2.0.1:40000"), identity.ID{}, false)
	ic.connected(func() { closed.Store(true) })
	taken, _ := workload.NewDirectory([]*workload.Workload{server, lookalike}, nil)
	tun.Update(&State{Dir: taken})
	if !closed.Load() {
		t.Error("an open connection stayed open after its pod's address went to another workload")
	}
}

// TestServiceEndpointInTheVIPsFamily: a connection to an IPv4 VIP goes to
// an endpoint workload's IPv4 address, though the service lists the
// workload by its IPv6 one (a dual-stack service has a slice per family),
// as kube-proxy routes and ztunnel picks. Before, it went to the IPv6
// address, which an app listening on IPv4 only refused, and the refusal
// marked the endpoint failed for every pod of the node.
func TestServiceEndpointInTheVIPsFamily(t *testing.T) {
	tun := tunnelWithPool(t)
	witness := newPlainWitness(t, "127.0.0.3:0")
	client := podObj("mesh", "client", "client", "10.1.0.1", nil)
	server := podObj("plain", "server", "server", "127.0.0.3", nil)
	server.Addrs = append(server.Addrs, netip.MustParseAddr("::1"))
	server.Enrolled = false // outside the mesh: plain TCP is right here
	svc := &workload.Service{Name: "server", Namespace: "plain", Hostname: "server.plain.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.30"), netip.MustParseAddr("fd00:96::30")},
		Ports:     []workload.ServicePort{{Name: "tcp", Port: 80, TargetPort: int32(witness.port())}},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("::1"), Ready: true}}}
	setDirectory(t, tun, []*workload.Workload{client, server}, []*workload.Service{svc})
	p := outboundClient(t, tun)
	app, c := clientConnTo("10.96.0.30:80")
	defer app.Close()
	go func() { _, _ = app.Write([]byte("hello")) }()
	p.handleOutbound(c)
	select {
	case b := <-witness.got:
		if string(b) != "hello" {
			t.Errorf("the endpoint got %q", b)
		}
	case <-time.After(5 * time.Second):
		t.Error("the endpoint's IPv4 address got nothing")
	}
	tun.lb.mu.Lock()
	failed := len(tun.lb.failed)
	tun.lb.mu.Unlock()
	if failed != 0 {
		t.Errorf("%d endpoints marked failed, want none", failed)
	}
	c.Close()
}

// TestServiceEndpointFamilyAddressIsTheWorkloadsOwn: a connection to an
// IPv6 VIP whose endpoint is listed at a workload's IPv4 address goes to
// that workload's IPv6 address only where the directory gives that address
// to the workload. A pod object that still lists an address the directory
// gives to another workload (a terminating pod whose address a new pod
// took, as NewDirectory settles it) does not speak for what is there now:
// before, the plaintext endpoint's other-family address was dialled in
// plain TCP, and the app's bytes went in plaintext to the meshed pod that
// holds it now. Such an endpoint keeps its listed address.
func TestServiceEndpointFamilyAddressIsTheWorkloadsOwn(t *testing.T) {
	tun := tunnelWithPool(t)
	taken := newPlainWitness(t, "[::1]:0")
	own := newPlainWitness(t, "127.0.0.3:"+strconv.Itoa(int(taken.port())))
	client := podObj("mesh", "client", "client", "10.1.0.1", nil)
	old := podObj("plain", "old", "old", "127.0.0.3", nil)
	old.Addrs = append(old.Addrs, netip.MustParseAddr("::1"))
	old.Enrolled, old.Terminating = false, true
	meshed := podObj("mesh", "new", "new", "::1", nil) // has ::1 now
	svc := &workload.Service{Name: "old", Namespace: "plain", Hostname: "old.plain.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.30"), netip.MustParseAddr("fd00:96::30")},
		Ports:     []workload.ServicePort{{Name: "tcp", Port: 80, TargetPort: int32(taken.port())}},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("127.0.0.3"), Ready: true}}}
	dir, _ := workload.NewDirectory([]*workload.Workload{client, old, meshed}, []*workload.Service{svc})
	if w, _ := dir.ByAddr(netip.MustParseAddr("::1")); w != meshed {
		t.Fatalf("::1 is %v's in the directory, want mesh/new's", w)
	}
	tun.Update(&State{Dir: dir})
	p := outboundClient(t, tun)
	app, c := clientConnTo("[fd00:96::30]:80")
	defer app.Close()
	go func() { _, _ = app.Write([]byte("hello")) }()
	done := make(chan struct{})
	go func() { p.handleOutbound(c); close(done) }()
	select {
	case b := <-taken.got:
		t.Errorf("the meshed pod's address got %q in plaintext", b)
	case b := <-own.got:
		if string(b) != "hello" {
			t.Errorf("the endpoint's own address got %q", b)
		}
	case <-time.After(5 * time.Second):
		t.Error("no address got the connection")
	}
	c.Close()
	<-done
}

// inFamilyOf maps dual-stack workloads to the destination's family, drops
// the repeats that makes, and puts endpoints it cannot map last.
func TestInFamilyOf(t *testing.T) {
	ds := &workload.Workload{Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fd00::1")}}
	v6only := &workload.Workload{Addrs: []netip.Addr{netip.MustParseAddr("fd00::2")}}
	tg := func(w *workload.Workload, a string) target {
		return target{ep: workload.Endpoint{Workload: w}, addr: netip.MustParseAddrPort(a)}
	}
	cands := []target{tg(ds, "[fd00::1]:80"), tg(v6only, "[fd00::2]:80"), tg(ds, "10.0.0.1:80"), tg(nil, "10.0.0.9:80")}
	dir, errs := workload.NewDirectory([]*workload.Workload{ds, v6only}, nil)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	var got []string
	for _, c := range inFamilyOf(dir, cands, netip.MustParseAddr("10.96.0.1")) {
		got = append(got, c.addr.String())
	}
	if want := []string{"10.0.0.1:80", "10.0.0.9:80", "[fd00::2]:80"}; !slices.Equal(got, want) {
		t.Errorf("inFamilyOf = %v, want %v", got, want)
	}
}

// TestServiceEndpointOfUnseenPodNeverPlaintext: an EndpointSlice and the
// Pod it names are watched apart, with no order between them, so a
// service's endpoint may name a pod the directory does not have yet. That
// pod may be meshed: before, the endpoint was dialled in plain TCP, and a
// meshed pod's first connections crossed the network unencrypted. Such an
// endpoint is refused (and counted) until the pod is known; an endpoint
// naming a pod known outside the mesh (a hostNetwork pod, at its node's
// address) is still dialled in plain TCP.
func TestServiceEndpointOfUnseenPodNeverPlaintext(t *testing.T) {
	tun := tunnelWithPool(t)
	witness := newPlainWitness(t, "127.0.0.2:0")
	client := podObj("mesh", "client", "client", "10.1.0.1", nil)
	hostPod := podObj("infra", "agent", "agent", "127.0.0.9", nil)
	hostPod.Addrs, hostPod.Enrolled = nil, false // hostNetwork: no address of its own
	service := func(pod string) *workload.Service {
		return &workload.Service{Name: "server", Namespace: "fresh", Hostname: "server.fresh.svc.cluster.local",
			VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.20")},
			Ports: []workload.ServicePort{{Name: "tcp", Port: 80, TargetPort: int32(witness.port())}},
			Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("127.0.0.2"), Ready: true,
				PodNamespace: "fresh", PodName: pod}}}
	}
	p := outboundClient(t, tun)
	// connect opens a connection to the service and returns what reached
	// the endpoint's plaintext server within wait, if anything.
	connect := func(wait time.Duration) ([]byte, bool) {
		t.Helper()
		app, c := clientConnTo("10.96.0.20:80")
		defer func() { app.Close(); c.Close() }()
		go func() {
			_, _ = app.Write([]byte("secret request"))
			_, _ = io.Copy(io.Discard, app)
		}()
		go p.handleOutbound(c)
		select {
		case b := <-witness.got:
			return b, true
		case <-time.After(wait):
			return nil, false
		}
	}

	setDirectory(t, tun, []*workload.Workload{client, hostPod}, []*workload.Service{service("server")})
	if b, ok := connect(time.Second); ok {
		t.Errorf("%q reached an endpoint naming an unseen pod in plaintext", b)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues("endpoint_unresolved")); got != 1 {
		t.Errorf("fail_closed{endpoint_unresolved} = %v, want 1", got)
	}

	// The same endpoint naming a pod known outside the mesh: plain TCP.
	hostPod.Namespace = "fresh"
	setDirectory(t, tun, []*workload.Workload{client, hostPod}, []*workload.Service{service("agent")})
	if b, ok := connect(5 * time.Second); !ok || string(b) != "secret request" {
		t.Errorf("an endpoint naming a pod known outside the mesh got %q (%v), want the request in plain TCP", b, ok)
	}
}

// TestUnresolvedEndpointsSpendNoAttempts: a service whose endpoints name
// pods the directory does not have (maxServiceAttempts of them or more)
// beside one it can dial. The unresolved ones are never dialled, and they
// no longer take a connection's attempts either: before, a connection
// whose turn in the rotation began at them tried only them and was reset,
// though a good endpoint was there (ztunnel picks only endpoints whose
// workload it knows). A service with only unresolved endpoints is refused
// and counted as endpoint_unresolved.
func TestUnresolvedEndpointsSpendNoAttempts(t *testing.T) {
	tun := tunnelWithPool(t)
	witness := newPlainWitness(t, "127.0.0.2:0")
	client := podObj("mesh", "client", "client", "10.1.0.1", nil)
	hostPod := podObj("fresh", "agent", "agent", "127.0.0.9", nil)
	hostPod.Addrs, hostPod.Enrolled = nil, false // hostNetwork: no address of its own
	var eps []workload.Endpoint
	for i := range maxServiceAttempts + 1 {
		eps = append(eps, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{127, 0, 0, byte(3 + i)}), Ready: true,
			PodNamespace: "fresh", PodName: fmt.Sprintf("unseen-%d", i)})
	}
	good := workload.Endpoint{Addr: netip.MustParseAddr("127.0.0.2"), Ready: true, PodNamespace: "fresh", PodName: "agent"}
	service := func(eps []workload.Endpoint) *workload.Service {
		return &workload.Service{Name: "server", Namespace: "fresh", Hostname: "server.fresh.svc.cluster.local",
			VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.20")},
			Ports:     []workload.ServicePort{{Name: "tcp", Port: 80, TargetPort: int32(witness.port())}},
			Endpoints: eps}
	}
	p := outboundClient(t, tun)
	connect := func() bool {
		t.Helper()
		return witness.reachedFrom(t, p, "10.96.0.20:80", 5*time.Second)
	}
	unresolved := func() float64 {
		return testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues("endpoint_unresolved"))
	}

	setDirectory(t, tun, []*workload.Workload{client, hostPod}, []*workload.Service{service(append(slices.Clone(eps), good))})
	// Every start of the rotation, the unresolved endpoints' included.
	for i := range len(eps) + 1 {
		if !connect() {
			t.Errorf("connection %d was not carried to the one endpoint the directory resolves", i)
		}
	}
	if got := unresolved(); got != 0 {
		t.Errorf("fail_closed{endpoint_unresolved} = %v with a good endpoint there, want 0", got)
	}

	setDirectory(t, tun, []*workload.Workload{client, hostPod}, []*workload.Service{service(eps)})
	if connect() {
		t.Error("a service of unresolved endpoints only was carried")
	}
	if got := unresolved(); got != 1 {
		t.Errorf("fail_closed{endpoint_unresolved} = %v, want 1", got)
	}
}
