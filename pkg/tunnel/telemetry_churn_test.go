package tunnel

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/identity"
)

// A client the directory does not name (a remote cluster's or VM's peer
// with no baggage, or one at an address whose workload runs as another
// identity) is counted under its verified identity alone. Those series
// named no workload that could leave, so they were live for as long as the
// destination was: every identity that ever connected (a CI system's
// per-run service accounts, a tenant minting service accounts) held its
// istio_tcp_* and denial series for good. They now go a grace after their
// last connection, like the series of names peers announce.
func TestSeriesOfUnnamedPeersExpire(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	m := NewMetrics(nil)
	m.series.now = func() time.Time { return now }
	dir := bookinfo(t)
	m.setLive(dir)
	dst := mustPod(t, dir, "10.1.0.13")
	const peers = 50
	for i := range peers {
		id := identity.ID{TrustDomain: "cluster.local", Namespace: "ci", ServiceAccount: fmt.Sprintf("run-%d", i)}
		c := connInfo{reporter: "destination", srcID: id, dst: dst, secure: true}
		m.open(c, "").close(context.Background(), 1, 1, nil)
		m.deniedConn(context.Background(), "deny_policy", c, "", errors.New("denied"))
	}
	count := func() int { return testutil.CollectAndCount(m.series.collector()) }
	if n := count(); n < peers*4 {
		t.Fatalf("%d series, want at least 4 per peer identity", n)
	}
	// An open connection keeps its series past the grace.
	held := identity.ID{TrustDomain: "cluster.local", Namespace: "ci", ServiceAccount: "held"}
	open := m.open(connInfo{reporter: "destination", srcID: held, dst: dst, secure: true}, "")

	now = now.Add(seriesGrace + time.Second)
	m.setLive(dir)
	now = now.Add(seriesGrace + time.Second)
	if n := count(); n != 4 {
		t.Errorf("%d series a grace after the last connection of %d identities the directory does not name, want the open connection's 4", n, peers)
	}
	if n := len(m.series.series); n != 1 {
		t.Errorf("the collector tracks %d series, want 1", n)
	}
	open.close(context.Background(), 0, 0, nil)

	// Clients the directory names keep their series while they exist.
	src := mustPod(t, dir, "10.1.0.12")
	m.open(connInfo{reporter: "destination", src: src, srcID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: src.ServiceAccount}, dst: dst, secure: true}, "").close(context.Background(), 1, 1, nil)
	now = now.Add(3 * seriesGrace)
	m.setLive(dir)
	if n := count(); n != 4 {
		t.Errorf("%d series of a named client and destination that both exist, want 4", n)
	}
}
