package tunnel

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Connections lists a served pod's admitted inbound connections (with the
// service they are counted under) and its relayed outbound ones, and
// forgets each when it ends; a pod not served is reported as such.
func TestConnectionsListsOpenConnections(t *testing.T) {
	tun := newTestTunnel(t, nil)
	server := netip.MustParseAddr("10.1.0.2")
	p := testPod(tun, "uid-server", server)
	if _, _, ok := tun.Connections("uid-other"); ok {
		t.Error("a pod not served has connections")
	}

	dst := netip.AddrPortFrom(server, 8080)
	peer := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	open := p.track(dst, netip.MustParseAddrPort("10.2.0.1:40001"), peer, true)
	open.setService(&workload.Service{Hostname: "app.mesh.svc.cluster.local"})
	open.connected(func() {})
	p.track(dst, netip.MustParseAddrPort("10.2.0.2:40002"), identity.ID{}, false) // still being decided
	revoked := p.track(dst, netip.MustParseAddrPort("10.2.0.3:40003"), peer, true)
	revoked.connected(func() {})
	revoked.revoke("authorization")

	// An outbound connection: app is the accepted socket (its local
	// address the original destination), up the upstream.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	appSide, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer appSide.Close()
	accepted, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	upLocal, upRemote := net.Pipe()
	defer upRemote.Close()
	actual := netip.MustParseAddrPort("10.1.0.9:15008")
	p.relayCounted(context.Background(), accepted, upLocal, 0, tun.cfg.Metrics.open(connInfo{reporter: "source", secure: true, dstAddr: actual}, ""))

	in, out, ok := tun.Connections("uid-server")
	if !ok || len(in) != 1 || in[0] != (OpenInbound{Src: netip.MustParseAddrPort("10.2.0.1:40001"), Dst: dst, Service: "app.mesh.svc.cluster.local", HBONE: true}) {
		t.Errorf("inbound %+v (served %v), want only the admitted, connected one", in, ok)
	}
	want := OpenOutbound{Src: addrPortOf(appSide.LocalAddr()), OriginalDst: addrPortOf(appSide.RemoteAddr()), ActualDst: actual, HBONE: true}
	if len(out) != 1 || out[0] != want {
		t.Errorf("outbound %+v, want %+v", out, want)
	}

	appSide.Close()
	upRemote.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, out, _ = tun.Connections("uid-server"); len(out) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("outbound still listed after it closed: %+v", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
