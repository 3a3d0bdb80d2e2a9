package tunnel

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
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

// A workload keeps its name across rollouts, but its canonical revision
// (the version label; app.kubernetes.io/version is often the release's
// commit) and even its service account can change with each. The series
// of a revision no pod runs any more named a workload that still existed,
// so they stayed for as long as the workload did: a Deployment released
// many times a day grew every reporter's series without bound.
func TestSeriesOfRetiredRevisionsExpire(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	m := NewMetrics(nil)
	m.series.now = func() time.Time { return now }
	client := podObj("mesh", "client", "client", "10.1.0.9", nil)
	release := func(i int) (*workload.Workload, *workload.Directory) {
		w := podObj("mesh", fmt.Sprintf("reviews-%d", i), fmt.Sprintf("reviews-sa-%d", i%2), fmt.Sprintf("10.1.1.%d", i),
			map[string]string{"app": "reviews", "version": fmt.Sprintf("r%d", i)})
		w.WorkloadName, w.CanonicalName, w.CanonicalRevision = "reviews", "reviews", fmt.Sprintf("r%d", i)
		return w, testDir(t, client, w)
	}
	const releases = 20
	for i := range releases {
		w, dir := release(i)
		m.setLive(dir)
		for _, c := range []connInfo{
			{reporter: "source", src: client, dst: w, secure: true,
				srcID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"},
				dstID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: w.ServiceAccount}},
			{reporter: "destination", src: w, dst: client, secure: true,
				srcID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: w.ServiceAccount},
				dstID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}},
		} {
			m.open(c, "").close(context.Background(), 1, 1, nil)
		}
		now = now.Add(time.Minute)
	}
	// The last release runs on, as does the client.
	_, dir := release(releases - 1)
	now = now.Add(seriesGrace + time.Second)
	m.setLive(dir)
	if n := testutil.CollectAndCount(m.series.collector()); n != 8 {
		t.Errorf("%d series a grace after %d releases of one workload, want the running revision's 8", n, releases)
	}
}

// Scrapes, directory updates and connections run at once: a scrape during
// churn must neither race nor lose a counted connection's increments.
func TestSeriesScrapeDuringChurn(t *testing.T) {
	m := NewMetrics(nil)
	m.SetSeriesGrace(time.Millisecond)
	dirs := make([]*workload.Directory, 4)
	pods := make([]*workload.Workload, len(dirs))
	client := podObj("mesh", "client", "client", "10.1.0.9", nil)
	for i := range dirs {
		pods[i] = podObj("mesh", fmt.Sprintf("p%d", i), "sa", fmt.Sprintf("10.1.1.%d", i), map[string]string{"version": fmt.Sprint(i)})
		dirs[i] = testDir(t, client, pods[i])
	}
	stop := make(chan struct{})
	done := make(chan struct{}, 2)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				done <- struct{}{}
				return
			default:
			}
			m.setLive(dirs[i%len(dirs)])
		}
	}()
	go func() {
		for {
			select {
			case <-stop:
				done <- struct{}{}
				return
			default:
			}
			testutil.CollectAndCount(m.series.collector())
		}
	}()
	const conns = 2000
	for i := range conns {
		c := connInfo{reporter: "source", src: client, dst: pods[i%len(pods)], secure: true,
			srcID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}}
		m.open(c, "").close(context.Background(), 1, 1, nil)
	}
	close(stop)
	<-done
	<-done
}
