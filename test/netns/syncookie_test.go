package netnstest

import (
	"context"
	"testing"
	"time"
)

// TestSynCookieACKUnderStrict: a pod that sends SYN cookies (its inbound
// listener's SYN queue overflowed, or net.ipv4.tcp_syncookies=2, a sysctl
// Kubernetes lets any pod set) answers a plaintext client's SYN from the
// tunnel's inbound listener with a cookie and keeps no request for it. The
// client's ACK then matched no socket, and the kernel handed it to the app's
// own listener on the port, which took the cookie (it had sent cookies of
// its own to the tunnel's dials) and accepted the connection: in plaintext,
// past STRICT mTLS. The ACK must go to the tunnel's listener, which refuses
// the client as it refuses its SYN without cookies.
func TestSynCookieACKUnderStrict(t *testing.T) {
	_, client, server, plain := meshed(t, strictMesh)
	WaitRefused(t, plain, URL(server.IPv4, 8080), 10*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	out, err := Exec(ctx, server.Path(), "sysctl", "-w", "net.ipv4.tcp_syncookies=2")
	cancel()
	if err != nil {
		t.Fatalf("set tcp_syncookies in the server pod: %v: %s", err, out)
	}
	for _, u := range []string{URL(server.IPv4, 8080), URL(server.IPv6, 8080)} {
		// A meshed request first: the tunnel's dial to the app is answered
		// with a cookie too, which opens the app's listener to cookies.
		if out, err := Curl(client, u); err != nil {
			t.Fatalf("meshed client to %s with SYN cookies: %v: %s", u, err, out)
		}
		if out, err := Curl(plain, u); err == nil {
			t.Errorf("the STRICT pod's app answered a plaintext client at %s: %q", u, out)
		}
	}
}

// TestSynCookieACKThroughTunnel: with SYN cookies on, a plaintext client the
// policy allows is still served, through the tunnel's inbound listener that
// checks its cookie (in_assign_cookie_ack), not by the app's listener.
func TestSynCookieACKThroughTunnel(t *testing.T) {
	ms, client, server, plain := meshed(t)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(plain, URL(server.IPv4, 8080)); return err })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	out, err := Exec(ctx, server.Path(), "sysctl", "-w", "net.ipv4.tcp_syncookies=2")
	cancel()
	if err != nil {
		t.Fatalf("set tcp_syncookies in the server pod: %v: %s", err, out)
	}
	cookieACKs := func() float64 {
		return metricSum(scrape(t, ms.agents[1], "http://127.0.0.1:15020/metrics"), "redirector_bpf_packets_total", `reason="in_assign_cookie_ack"`)
	}
	before := cookieACKs()
	for _, u := range []string{URL(server.IPv4, 8080), URL(server.IPv6, 8080)} {
		if out, err := Curl(client, u); err != nil {
			t.Fatalf("meshed client to %s with SYN cookies: %v: %s", u, err, out)
		}
		if out, err := Curl(plain, u); err != nil {
			t.Errorf("plaintext client to %s with SYN cookies: %v: %s", u, err, out)
		}
	}
	if got := cookieACKs() - before; got < 2 {
		t.Errorf("in_assign_cookie_ack grew by %v for two plaintext connections, want at least 2", got)
	}
}
