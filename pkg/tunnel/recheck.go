package tunnel

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"sync"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Policy changes reach open connections, as in ztunnel: every open inbound
// connection (HBONE and plaintext) is registered with what its admission
// was decided on, and when Update installs a state whose policies, or the
// destination pod's labels or namespace, differ, each affected connection
// is decided again and closed if the new state no longer admits it.

// inboundConn is one open (or opening) inbound connection.
type inboundConn struct {
	dst    netip.AddrPort // the pod address and port the client asked for
	src    netip.AddrPort // the client's address and port (an HBONE client's tunnel's)
	client netip.Addr     // src's address
	peer   identity.ID    // verified client identity; zero for plaintext
	secure bool

	mu      sync.Mutex
	closer  func() // closes the connection's sockets; nil until connected
	revoked string // why a policy change closed it; "" while admitted
	service string // the host name of the service it is counted under, for the config dump
}

// track registers a connection before its first decision, so that an
// Update landing between that decision and the registration cannot miss
// it (ztunnel registers first for the same reason).
func (p *pod) track(dst, src netip.AddrPort, peer identity.ID, secure bool) *inboundConn {
	ic := &inboundConn{dst: dst, src: src, client: src.Addr(), peer: peer, secure: secure}
	p.mu.Lock()
	p.inbound[ic] = struct{}{}
	p.mu.Unlock()
	return ic
}

func (p *pod) untrack(ic *inboundConn) {
	p.mu.Lock()
	delete(p.inbound, ic)
	p.mu.Unlock()
}

// setService records the service ic is counted under (nil: none).
func (ic *inboundConn) setService(s *workload.Service) {
	if s == nil {
		return
	}
	ic.mu.Lock()
	ic.service = s.Hostname
	ic.mu.Unlock()
}

// connected gives ic what closes it. It reports false, having closed it,
// when a policy change revoked ic in the meantime.
func (ic *inboundConn) connected(closer func()) bool {
	ic.mu.Lock()
	revoked := ic.revoked != ""
	if !revoked {
		ic.closer = closer
	}
	ic.mu.Unlock()
	if revoked {
		closer()
	}
	return !revoked
}

// revoke closes ic (or marks it, if it is not connected yet) for reason;
// it reports false if ic was revoked already.
func (ic *inboundConn) revoke(reason string) bool {
	ic.mu.Lock()
	if ic.revoked != "" {
		ic.mu.Unlock()
		return false
	}
	ic.revoked = reason
	closer := ic.closer
	ic.mu.Unlock()
	if closer != nil {
		closer()
	}
	return true
}

// reasonNotThisPod: the directory gives an inbound connection's
// destination address to another workload than the pod whose listener
// took it, as redirector_fail_closed_total labels it.
const reasonNotThisPod = "destination_not_this_pod"

// inboundVerdict decides an inbound connection to p against st: it returns
// the destination pod's workload and "" when admitted, else the reason it
// is not (a metric label: unknown_destination, destination_not_this_pod,
// strict_plaintext, authorization) with the detail and policy to log;
// podW is nil for the first two.
//
// The connection reached p's own listener, so only p's policies may decide
// it: a directory that gives p's address to another workload (a pod that
// is not terminating takes the address of one that is, and a kubelet
// writes its pods' addresses) must not have that workload's namespace,
// labels and PeerAuthentication judge p's traffic. Such a connection is
// refused, as the outbound side refuses a source the directory gives to
// another pod (pod.self).
func (t *Tunnel) inboundVerdict(st *State, p *pod, dst netip.AddrPort, client netip.Addr, peer identity.ID, secure bool) (podW *workload.Workload, reason, detail, pol string) {
	podW, ok := st.Dir.ByAddr(dst.Addr().Unmap())
	if !ok {
		return nil, "unknown_destination", "destination pod not in the workload directory", ""
	}
	if podW.Key() != p.uid {
		return nil, reasonNotThisPod, fmt.Sprintf("the directory gives %s to %s, not to pod %s", dst.Addr(), podW, p.uid), ""
	}
	// Compiled policies (istiod's) carry STRICT as a DENY of plaintext.
	if !secure && st.Compiled == nil {
		mode := st.index(t.cfg.RootNamespace).EffectiveMode(podW.Namespace, podW.Labels, dst.Port())
		if mode.Strict() {
			return podW, "strict_plaintext", "mTLS is STRICT", mode.Source
		}
	}
	src := policy.Peer{Addr: client, Authenticated: secure}
	if secure {
		src.Principal = peer.Principal()
		src.Namespace = peer.Namespace
	}
	target := policy.Target{Namespace: podW.Namespace, Labels: podW.Labels, Port: dst.Port(), Addr: dst.Addr()}
	v := st.index(t.cfg.RootNamespace).Authorize(target, podW.Namespace+"/"+podW.Name, src)
	if !v.Allowed {
		return podW, "authorization", v.Reason, v.Policy
	}
	return podW, "", "", ""
}

// recheck closes the open inbound connections that next no longer admits.
// Its cost is bounded by what changed: nothing is decided when the
// policies are the same and no served pod's workload changed, and then
// only the connections of the pods that did.
func (t *Tunnel) recheck(ctx context.Context, prev, next *State) {
	samePolicies := reflect.DeepEqual(prev.PeerAuthentications, next.PeerAuthentications) &&
		reflect.DeepEqual(prev.AuthorizationPolicies, next.AuthorizationPolicies) &&
		reflect.DeepEqual(prev.Compiled, next.Compiled)
	t.mu.Lock()
	pods := slices.Collect(maps.Values(t.pods))
	t.mu.Unlock()
	closed := map[string]int{}
	for _, p := range pods {
		if samePolicies && !p.workloadChanged(prev.Dir, next.Dir) {
			continue
		}
		p.mu.Lock()
		conns := slices.Collect(maps.Keys(p.inbound))
		p.mu.Unlock()
		for _, ic := range conns {
			_, reason, detail, pol := t.inboundVerdict(next, p, ic.dst, ic.client, ic.peer, ic.secure)
			if reason == "" || !ic.revoke(reason) {
				continue
			}
			closed[reason]++
			t.cfg.Metrics.policyClosed.WithLabelValues(reason).Inc()
			t.log.DebugContext(ctx, "open connection closed: no longer allowed", "pod", p.uid, "client", ic.client,
				"peer", ic.peer.String(), "dst", ic.dst, "reason", reason, "detail", detail, "policy", pol)
		}
	}
	if len(closed) > 0 {
		args := []any{}
		for _, r := range slices.Sorted(maps.Keys(closed)) {
			args = append(args, r, closed[r])
		}
		t.log.InfoContext(ctx, "closed open inbound connections that the new policy no longer allows", args...)
	}
}

// workloadChanged reports whether any of p's addresses maps to a workload
// with other policy inputs (presence, identity, namespace, labels) in next
// than in prev.
func (p *pod) workloadChanged(prev, next *workload.Directory) bool {
	for _, a := range p.addrs {
		was, wok := prev.ByAddr(a)
		is, iok := next.ByAddr(a)
		if wok != iok {
			return true
		}
		if wok && (was.Key() != is.Key() || was.Namespace != is.Namespace || !maps.Equal(was.Labels, is.Labels)) {
			return true
		}
	}
	return false
}

// recheckPeers runs when the trust bundle changed. A handshake verified
// its peer against the roots of that moment; it drains the HBONE
// connections, inbound and pooled outbound, whose peer no longer verifies
// (its root removed), so the identity of that handshake authorizes no new
// stream. Their open streams run to their end. Connections whose peer
// still verifies are left alone: a rotation that adds a root reconnects
// nothing.
//
// It also drains the connections, pooled and inbound, on which this node
// presented a certificate that no longer verifies: a peer that does not
// drain them itself (ztunnel, a waypoint, curl) would go on opening or
// taking streams as that identity; the next stream's handshake presents
// the certificate of that moment (the identity manager renews such
// certificates at the same change), which a peer holding the new roots
// checks anew.
func (t *Tunnel) recheckPeers() {
	m := t.cfg.Certs
	t.mu.Lock()
	pods := slices.Collect(maps.Values(t.pods))
	t.mu.Unlock()
	reverify := func(usage x509.ExtKeyUsage) func(cs tls.ConnectionState) bool {
		return func(cs tls.ConnectionState) bool { return m.Reverify(cs, usage) == nil }
	}
	keepOwn := func(usage x509.ExtKeyUsage) func(*tls.Certificate) bool {
		return func(cert *tls.Certificate) bool {
			cs, err := presentedState(cert)
			return err == nil && m.Reverify(cs, usage) == nil
		}
	}
	inbound, outbound, inboundOwn, outboundOwn := 0, 0, 0, 0
	for _, p := range pods {
		if p.hbone != nil {
			inbound += p.hbone.DrainPeers(reverify(x509.ExtKeyUsageClientAuth))
			inboundOwn += p.hbone.DrainPresented(keepOwn(x509.ExtKeyUsageServerAuth))
		}
	}
	if t.cfg.Pool != nil {
		outbound = t.cfg.Pool.DrainPeers(reverify(x509.ExtKeyUsageServerAuth))
		outboundOwn = t.cfg.Pool.DrainPresented(keepOwn(x509.ExtKeyUsageClientAuth))
	}
	if inbound+outbound+inboundOwn+outboundOwn > 0 {
		t.log.Info("trust bundle changed: HBONE connections whose peer, or whose certificate this node presented, no longer verifies drained",
			"inbound", inbound, "outbound", outbound, "inbound_own_certificate", inboundOwn, "outbound_own_certificate", outboundOwn)
	}
}

// presentedState is a certificate this node presented, as its peer saw it.
func presentedState(cert *tls.Certificate) (tls.ConnectionState, error) {
	chain := make([]*x509.Certificate, 0, len(cert.Certificate))
	for i, der := range cert.Certificate {
		if i == 0 && cert.Leaf != nil {
			chain = append(chain, cert.Leaf)
			continue
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return tls.ConnectionState{}, fmt.Errorf("parse presented certificate %d: %w", i, err)
		}
		chain = append(chain, c)
	}
	return tls.ConnectionState{PeerCertificates: chain}, nil
}
