package istioca

import (
	"context"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/connectivity"
	pb "istio.io/api/security/v1alpha1"

	"github.com/redirector-mesh/redirector/pkg/identity"
)

// TestSignTimeoutSparesRequestsInFlight: one request times out (istiod, or
// a signer behind it such as cert-manager's istio-csr, slow for it) while
// another is in flight on the same connection. The timeout replaces the
// connection, but the other request runs on to its answer, and the
// replaced connection is closed once it has. Before, it was closed at
// once: every request in flight on it failed ("the client connection is
// closing", counted as a timeout) and was asked again, so one slow answer
// wasted up to 7 others, signed by istiod and thrown away (a stand-in
// istiod, fast for one identity and slow for another, lost about a
// quarter of the fast answers so).
func TestSignTimeoutSparesRequestsInFlight(t *testing.T) {
	pki := newPKI(t)
	f, addr := startIstiod(t, pki, DefaultServerName)
	gate := make(chan struct{})
	f.answer = func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
		u := csr.URIs[0].String()
		if strings.HasSuffix(u, "/sa/slow") {
			time.Sleep(2 * time.Second)
		} else {
			<-gate
		}
		return f.issue(u)(csr)
	}
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: trustOf(pki.root)})
	first := c.acquire()
	c.release(first)

	fast := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := c.Sign(ctx, idWeb, time.Hour)
		fast <- err
	}()
	// The fast request is in flight when the slow one times out.
	deadline := time.Now().Add(5 * time.Second)
	for {
		c.mu.Lock()
		n := first.inflight
		c.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the first request never went out")
		}
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	slow := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "slow"}
	if _, err := c.Sign(ctx, slow, time.Hour); identity.ReasonOf(err) != identity.ReasonTimeout {
		t.Fatalf("slow request: %v, want a timeout", err)
	}
	close(gate)
	if err := <-fast; err != nil {
		t.Fatalf("the request in flight when another timed out: %v", err)
	}
	cur := c.acquire()
	c.release(cur)
	if cur == first {
		t.Error("the connection a request timed out on is still used")
	}
	deadline = time.Now().Add(5 * time.Second)
	for first.GetState() != connectivity.Shutdown {
		if time.Now().After(deadline) {
			t.Fatalf("the replaced connection is %s after its last request, want closed", first.GetState())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
