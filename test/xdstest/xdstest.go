// Package xdstest runs the xDS source's client against a test istiod as a node agent would,
// for tests that check what istiod sends.
//
// It is not part of test/istiotest: the xds package's own tests use istiotest, so istiotest
// cannot import the xds package.
package xdstest

import (
	"context"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/source/xds"
)

// Watch connects to istiod at addr, trusting the root in rootCertFile, as the agent node
// describes, authenticated by the token in tokenFile, and returns the channel every
// snapshot it delivers arrives on (buffered for 1024). The client stops, and its connection
// closes, when the test ends.
func Watch(t testing.TB, addr, rootCertFile, tokenFile string, node xds.Node) <-chan *xds.Snapshot {
	t.Helper()
	bundle, err := identity.LoadBundle(rootCertFile, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := xds.Dial(addr, "", bundle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c, err := xds.New(xds.Config{Conn: conn, Token: xds.TokenFile(tokenFile), Metrics: xds.NewMetrics(nil), Node: node})
	if err != nil {
		t.Fatal(err)
	}
	snaps := make(chan *xds.Snapshot, 1024)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx, func(s *xds.Snapshot) {
			select {
			case snaps <- s:
			case <-ctx.Done():
			}
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return snaps
}
